//! The only unsafe code in the crate: the binding to the C++ shim in `csrc/` (the oneDNN linear
//! layer and its packed weights for [`crate::gemm`], the decode step's attention for
//! [`crate::attention`], the fused element-wise kernels for [`crate::fused`]), and glibc's
//! `mallopt` for [`crate::heap`].
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_void};

use tch::Tensor;

unsafe extern "C" {
    /// `x · wᵀ + b` as one autograd node; NULL or an error text.
    fn rl_onednn_linear(
        out: *mut *mut c_void,
        x: *const c_void,
        w: *const c_void,
        b: *const c_void,
    ) -> *mut c_char;
    /// `w` in oneDNN's blocked layout; NULL or an error text.
    fn rl_onednn_pack(out: *mut *mut c_void, w: *const c_void) -> *mut c_char;
    /// `x · wᵀ + b` with a packed `w`, without gradients; NULL or an error text.
    fn rl_onednn_linear_packed(
        out: *mut *mut c_void,
        x: *const c_void,
        packed: *const c_void,
        b: *const c_void,
    ) -> *mut c_char;
    fn rl_packable_version(x: *const c_void) -> i64;
    /// `csrc/decode_attention.cpp`: one query per row; NULL or an error text.
    fn rl_one_query_attention(
        out: *mut *mut c_void,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        mask: *const c_void,
        scale: f64,
    ) -> *mut c_char;
    /// `csrc/fused_ops.cpp`: RMSNorm, after a residual add when `residual` is not NULL (the
    /// sum into `sum`, else `sum` is set to NULL); NULL or an error text.
    fn rl_rms_norm(
        sum: *mut *mut c_void,
        out: *mut *mut c_void,
        x: *const c_void,
        residual: *const c_void,
        weight: *const c_void,
        eps: f64,
    ) -> *mut c_char;
    /// Rotary embedding of q (returned) and k (into `k_dst`), v copied into `v_dst` when both
    /// are not NULL; NULL or an error text.
    fn rl_rope_qkv(
        out: *mut *mut c_void,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        cos: *const c_void,
        sin: *const c_void,
        k_dst: *const c_void,
        v_dst: *const c_void,
        heads: i64,
        kv_heads: i64,
    ) -> *mut c_char;
    /// `silu(gate) * up`; NULL or an error text.
    fn rl_silu_mul(out: *mut *mut c_void, gate: *const c_void, up: *const c_void) -> *mut c_char;
    /// Greedy tokens into `tokens`, their log-probs into `out`; NULL or an error text.
    fn rl_greedy_pick(
        out: *mut *mut c_void,
        logits: *const c_void,
        tokens: *const c_void,
    ) -> *mut c_char;
    fn rl_sample_pick(
        out: *mut *mut c_void,
        logits: *const c_void,
        uniforms: *const c_void,
        temperature: f64,
        tokens: *const c_void,
    ) -> *mut c_char;
    fn rl_grad_mode_enabled() -> bool;
    fn rl_onednn_free(text: *mut c_char);
}

fn raw(t: &Tensor) -> *const c_void {
    t.as_ptr() as *const c_void
}

fn raw_opt(t: Option<&Tensor>) -> *const c_void {
    t.map_or(std::ptr::null(), raw)
}

/// Runs one shim function that writes a new tensor into its first argument or returns an
/// error text.
///
/// # Safety
/// `call` must pass only live `at::Tensor`s (owned by tch for the whole call; the shim keeps its
/// own references) and return the shim's status: NULL with `out` set to a fresh `at::Tensor*`
/// allocated with `new`, or a NUL-terminated text malloc'd by the shim.
unsafe fn new_tensor(call: impl FnOnce(*mut *mut c_void) -> *mut c_char) -> Result<Tensor, String> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: as this function's contract.
    unsafe { status(call(&mut out))? };
    // SAFETY: on success `out` is a fresh `at::Tensor*`, which `Tensor::from_ptr` takes over
    // and tch frees with `delete`.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

/// The shim's status: `Ok` for NULL, else its error text (freed here).
///
/// # Safety
/// `err` is NULL or a NUL-terminated text malloc'd by the shim, not used after this call.
unsafe fn status(err: *mut c_char) -> Result<(), String> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-NULL status is the shim's malloc'd text, read once and freed by the shim's
    // allocator.
    let text = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    unsafe { rl_onednn_free(err) };
    Err(text)
}

/// The product through the shim's autograd node, or the C++ exception's text.
pub(crate) fn onednn_linear(
    xs: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor, String> {
    // SAFETY: the three inputs are live tensors borrowed for the call (see `new_tensor`).
    unsafe { new_tensor(|out| rl_onednn_linear(out, raw(xs), raw(weight), raw_opt(bias))) }
}

/// `weight` reordered into oneDNN's blocked layout (a copy; gradients do not flow to it).
pub(crate) fn onednn_pack(weight: &Tensor) -> Result<Tensor, String> {
    // SAFETY: as above.
    unsafe { new_tensor(|out| rl_onednn_pack(out, raw(weight))) }
}

/// `xs · weightᵀ + bias` with `packed` from [`onednn_pack`]; refused while gradients are on.
pub(crate) fn onednn_linear_packed(
    xs: &Tensor,
    packed: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor, String> {
    // SAFETY: as above.
    unsafe { new_tensor(|out| rl_onednn_linear_packed(out, raw(xs), raw(packed), raw_opt(bias))) }
}

/// Autograd's version counter of `t` (it moves with every in-place change), or `None` where `t`
/// is not a contiguous tensor owning all of its memory (a view).
pub(crate) fn packable_version(t: &Tensor) -> Option<i64> {
    // SAFETY: reads the metadata of a live tensor.
    let v = unsafe { rl_packable_version(raw(t)) };
    (v >= 0).then_some(v)
}

/// A decode step's attention, one query per row (see `csrc/decode_attention.cpp` for the
/// shapes), or the C++ exception's text.
pub(crate) fn one_query_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> Result<Tensor, String> {
    // SAFETY: as above.
    unsafe {
        new_tensor(|out| rl_one_query_attention(out, raw(q), raw(k), raw(v), raw(mask), scale))
    }
}

/// RMSNorm of `x` (see `csrc/fused_ops.cpp`), after adding `residual` when given: `(the sum
/// when a residual was given, the normalised rows)`, or the C++ exception's text.
pub(crate) fn rms_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
) -> Result<(Option<Tensor>, Tensor), String> {
    let (mut sum, mut out): (*mut c_void, *mut c_void) =
        (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: live tensors borrowed for the call (see `new_tensor`); on success `out` is a
    // fresh `at::Tensor*` and `sum` one or NULL (NULL exactly when no residual was given),
    // each taken over by `Tensor::from_ptr`.
    unsafe {
        status(rl_rms_norm(
            &mut sum,
            &mut out,
            raw(x),
            raw_opt(residual),
            raw(weight),
            eps,
        ))?;
        let sum = (!sum.is_null()).then(|| Tensor::from_ptr(sum as *mut _));
        Ok((sum, Tensor::from_ptr(out as *mut _)))
    }
}

/// Rotary embedding of `q` (returned as `[batch, heads, seq_len, head_dim]`) and of `k` into
/// `k_dst`, and `v` copied into `v_dst` (see `csrc/fused_ops.cpp` for the shapes), or the C++
/// exception's text.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_qkv(
    q: &Tensor,
    k: &Tensor,
    v: Option<(&Tensor, &Tensor)>,
    cos: &Tensor,
    sin: &Tensor,
    k_dst: &Tensor,
    heads: i64,
    kv_heads: i64,
) -> Result<Tensor, String> {
    let (v, v_dst) = (raw_opt(v.map(|p| p.0)), raw_opt(v.map(|p| p.1)));
    // SAFETY: as above.
    unsafe {
        new_tensor(|out| {
            rl_rope_qkv(
                out,
                raw(q),
                raw(k),
                v,
                raw(cos),
                raw(sin),
                raw(k_dst),
                v_dst,
                heads,
                kv_heads,
            )
        })
    }
}

/// `silu(gate) * up`, or the C++ exception's text.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor, String> {
    // SAFETY: as above.
    unsafe { new_tensor(|out| rl_silu_mul(out, raw(gate), raw(up))) }
}

/// Greedy decoding's `(tokens, log_probs)` from `logits` `[rows, vocab]`, or the C++
/// exception's text.
pub(crate) fn greedy_pick(logits: &Tensor) -> Result<(Tensor, Tensor), String> {
    let tokens = Tensor::empty([logits.size()[0]], (tch::Kind::Int64, tch::Device::Cpu));
    // SAFETY: as above; `tokens` is a fresh contiguous tensor the shim writes into.
    let log_probs = unsafe { new_tensor(|out| rl_greedy_pick(out, raw(logits), raw(&tokens)))? };
    Ok((tokens, log_probs))
}

/// Sampled decoding's tokens and log-probs from `logits` `[rows, vocab]` f32 at `temperature`
/// with `uniforms` (f64, one a row); see `sample_rows` in csrc/fused_ops.cpp.
pub(crate) fn sample_pick(
    logits: &Tensor,
    uniforms: &Tensor,
    temperature: f64,
) -> Result<(Tensor, Tensor), String> {
    let tokens = Tensor::empty([logits.size()[0]], (tch::Kind::Int64, tch::Device::Cpu));
    // SAFETY: as above; `tokens` is a fresh contiguous tensor the shim writes into.
    let log_probs = unsafe {
        new_tensor(|out| {
            rl_sample_pick(out, raw(logits), raw(uniforms), temperature, raw(&tokens))
        })?
    };
    Ok((tokens, log_probs))
}

/// Whether autograd records operations on this thread now (libtorch's `GradMode`).
pub(crate) fn grad_mode_enabled() -> bool {
    // SAFETY: reads a thread-local flag.
    unsafe { rl_grad_mode_enabled() }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
unsafe extern "C" {
    /// glibc's allocator settings (`mallopt(3)`); 1 on success.
    fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    /// glibc's allocator statistics (`mallinfo2(3)`).
    #[cfg(test)]
    fn mallinfo2() -> MallInfo2;
}

/// `struct mallinfo2`.
#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
#[repr(C)]
struct MallInfo2 {
    arena: usize,
    ordblks: usize,
    smblks: usize,
    hblks: usize,
    /// Bytes in blocks mapped straight from the kernel.
    hblkhd: usize,
    usmblks: usize,
    fsmblks: usize,
    uordblks: usize,
    fordblks: usize,
    keepcost: usize,
}

/// The bytes glibc's allocator holds in blocks mapped straight from the kernel.
#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
pub(crate) fn malloc_mapped_bytes() -> usize {
    // SAFETY: reads the allocator's statistics into a struct of glibc's layout.
    unsafe { mallinfo2() }.hblkhd
}

/// Tells glibc's allocator to serve every block from its heap (`M_MMAP_MAX` 0) and never to
/// give freed memory back to the kernel (`M_TRIM_THRESHOLD` -1); whether it took both. Not
/// glibc: false, nothing done.
pub(crate) fn malloc_keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const M_TRIM_THRESHOLD: std::ffi::c_int = -1;
        const M_MMAP_MAX: std::ffi::c_int = -4;
        // SAFETY: mallopt only changes the allocator's parameters; any value is allowed.
        unsafe { mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, -1) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
