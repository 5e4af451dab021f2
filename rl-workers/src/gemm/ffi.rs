//! The only unsafe code in the crate: the binding to the oneDNN linear layer of
//! `csrc/onednn_linear.cpp`.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_void};

use tch::Tensor;

unsafe extern "C" {
    /// `csrc/onednn_linear.cpp`: `x · wᵀ + b` as one autograd node; NULL or an error text.
    fn rl_onednn_linear(
        out: *mut *mut c_void,
        x: *const c_void,
        w: *const c_void,
        b: *const c_void,
    ) -> *mut c_char;
    fn rl_onednn_free(text: *mut c_char);
}

/// The product through the shim's autograd node, or the C++ exception's text.
pub(super) fn onednn_linear(
    xs: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor, String> {
    let mut out: *mut c_void = std::ptr::null_mut();
    let b = bias.map_or(std::ptr::null(), |b| b.as_ptr() as *const c_void);
    // SAFETY: the three inputs are live `at::Tensor`s owned by tch for the whole call (the shim
    // reads them and keeps its own references); on success `out` is a fresh `at::Tensor*`
    // allocated with `new`, which `Tensor::from_ptr` takes over and tch frees with `delete`.
    let err = unsafe {
        rl_onednn_linear(
            &mut out,
            xs.as_ptr() as *const c_void,
            weight.as_ptr() as *const c_void,
            b,
        )
    };
    if !err.is_null() {
        // SAFETY: a non-NULL status is a NUL-terminated string malloc'd by the shim, read once
        // here and then freed by the shim's allocator.
        let text = unsafe { CStr::from_ptr(err) }
            .to_string_lossy()
            .into_owned();
        unsafe { rl_onednn_free(err) };
        return Err(text);
    }
    // SAFETY: see above.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}
