//! Keeps `libtorch_cuda` linked when building against a CUDA libtorch (issue #2; see `build.rs`).
//!
//! Linked with `--as-needed`, a shared library stays in a binary's `NEEDED` list only if the
//! binary references one of its symbols, and nothing in tch or the workspace calls into
//! `libtorch_cuda`: its work is done by static initialisers that register CUDA with
//! `libtorch_cpu` when the library is loaded. The `#[used]` static below is that reference;
//! rustc keeps `#[used]` statics of every linked crate in the final link, so every binary and
//! test that links rl-core (every one in the workspace that links tch through another crate)
//! loads `libtorch_cuda`, and with it `libc10_cuda` and the CUDA libraries it needs.

// The crate's only `unsafe`: declaring a foreign function, which is never called.
#[cfg(torch_cuda)]
#[allow(unsafe_code)]
mod keep {
    unsafe extern "C" {
        /// A function of the AOTInductor C shim (`torch/csrc/inductor/aoti_torch/c/shim.h`), part
        /// of the ABI that PyTorch keeps stable across releases; only its address is taken, it
        /// is never called, so the signature is irrelevant.
        fn aoti_torch_create_cuda_guard();
    }

    #[used]
    static KEEP_LIBTORCH_CUDA: unsafe extern "C" fn() = aoti_torch_create_cuda_guard;
}
