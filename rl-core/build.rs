//! Emits `cfg(torch_cuda)` when the libtorch that torch-sys links is a CUDA build, so that
//! `src/cuda_link.rs` keeps `libtorch_cuda.so` linked into every binary and test (issue #2).
//!
//! torch-sys passes `-ltorch_cuda` when `$LIBTORCH/lib/libtorch_cuda.so` exists, but rustc links
//! with `--as-needed` and no Rust code calls into `libtorch_cuda`, so the linker drops it; CUDA
//! then never registers and `tch::Cuda::is_available()` is false even on a GPU machine.
//! The `-as-needed` link modifier (`rustc-link-lib=dylib:-as-needed=torch_cuda`) would say this
//! here alone, but it is still nightly-only (rust-lang/rust#99424), and `rustc-link-arg` flags
//! such as `-Wl,--no-as-needed` only reach this package's own binaries, not its dependents'.
//! So rl-core, which every binary of the workspace links, holds a `#[used]` reference to one
//! `libtorch_cuda` symbol, which makes the library needed in every final link.
//!
//! The test is the one torch-sys makes (the file exists), so the two always agree; a CPU
//! libtorch, as `scripts/setup` installs by default, emits nothing and links as before.
//!
//! It also compiles `csrc/device_memory.cpp` (the caching allocator's counters, see
//! `src/device_memory.rs`) against the libtorch headers and emits `cfg(rl_core_device_memory)`;
//! it needs no CUDA headers, so CPU and CUDA builds compile it alike.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(torch_cuda)");
    println!("cargo:rustc-check-cfg=cfg(rl_core_device_memory)");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc");
    for var in [
        "LIBTORCH",
        "LIBTORCH_LIB",
        "LIBTORCH_INCLUDE",
        "LIBTORCH_CXX11_ABI",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    compile_device_memory_shim();
    // torch-sys's order: `LIBTORCH_LIB` overrides `$LIBTORCH/lib`. Neither set (a system-wide
    // libtorch) is left to torch-sys alone, as before this script existed.
    let lib = env::var_os("LIBTORCH_LIB")
        .map(PathBuf::from)
        .or_else(|| env::var_os("LIBTORCH").map(|dir| PathBuf::from(dir).join("lib")));
    let Some(lib) = lib.filter(|lib| lib.is_dir()) else {
        println!("cargo:rustc-env=RL_CORE_LIBTORCH_LIB=");
        return;
    };
    // The tests check the outcome against the same folder.
    println!("cargo:rustc-env=RL_CORE_LIBTORCH_LIB={}", lib.display());
    // `.libtorch/active` is a symlink that `scripts/setup --cuda`/`--cpu` re-points without
    // changing `LIBTORCH`: watching the folder it resolves to reruns this script when the
    // libraries there change (and setup also cleans rl-core when it switches). Only an existing
    // path is watched, since cargo reruns a script on every build for a missing one.
    println!("cargo:rerun-if-changed={}", lib.display());

    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-cfg=torch_cuda");
        // torch-sys emits these too; repeating them keeps this crate's link self-contained.
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
    }
}

/// The device-memory shim, when the libtorch headers are found (torch-sys's order:
/// `LIBTORCH_INCLUDE` overrides `$LIBTORCH/include`); without them the Rust side reports the
/// shim missing instead of failing the build, as a system-wide libtorch left to torch-sys would.
fn compile_device_memory_shim() {
    let include = env::var_os("LIBTORCH_INCLUDE")
        .map(PathBuf::from)
        .or_else(|| env::var_os("LIBTORCH").map(|dir| PathBuf::from(dir).join("include")));
    let Some(include) =
        include.filter(|dir| dir.join("c10/core/CachingDeviceAllocator.h").is_file())
    else {
        return;
    };
    let cxx11_abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .file("csrc/device_memory.cpp")
        .compile("rl_core_device_memory");
    println!("cargo:rustc-cfg=rl_core_device_memory");
}
