//! An accelerator's memory as PyTorch's caching allocator counts it: what tensors hold now and
//! at their peak (`torch.cuda.max_memory_allocated`), and what the allocator has reserved from
//! the device (`max_memory_reserved`, the figure that decides whether a run fits). verl logs the
//! peaks of each update as `perf/max_memory_allocated_gb` / `perf/max_memory_reserved_gb`.
//!
//! Read through c10's device-generic allocator interface by a small C++ shim
//! (`csrc/device_memory.cpp`, compiled by `build.rs`), which needs no CUDA headers, so it
//! builds against the CPU libtorch too; there the CPU has no caching allocator and
//! [`stats`] answers `None`.

use tch::{Device, TchError};

use crate::{Error, Result};

/// The caching allocator's counters of one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes held by live tensors now.
    pub allocated: u64,
    /// The most bytes held by live tensors since the start or the last [`reset_peak`].
    pub peak_allocated: u64,
    /// Bytes the allocator holds from the device now (tensors plus its cache).
    pub reserved: u64,
    /// The most bytes reserved since the start or the last [`reset_peak`].
    pub peak_reserved: u64,
}

#[cfg(rl_core_device_memory)]
#[allow(unsafe_code)]
mod ffi {
    use std::ffi::{CStr, c_char, c_int};

    unsafe extern "C" {
        fn rl_core_cuda_memory(device: c_int, out: *mut i64) -> *mut c_char;
        fn rl_core_cuda_reset_peak(device: c_int) -> *mut c_char;
        fn rl_core_free_error(error: *mut c_char);
    }

    /// The shim's error string (NULL = success), copied and freed.
    fn check(error: *mut c_char) -> Result<(), String> {
        if error.is_null() {
            return Ok(());
        }
        // SAFETY: a non-null return is a NUL-terminated string malloc'd by the shim, read once
        // and then freed by the shim's own `free`.
        let message = unsafe { CStr::from_ptr(error) }
            .to_string_lossy()
            .into_owned();
        unsafe { rl_core_free_error(error) };
        Err(message)
    }

    pub(super) fn cuda_memory(device: usize) -> Result<[i64; 4], String> {
        let mut out = [0i64; 4];
        let index = c_int::try_from(device).map_err(|_| format!("device index {device}"))?;
        // SAFETY: `out` has the four slots the shim writes.
        check(unsafe { rl_core_cuda_memory(index, out.as_mut_ptr()) })?;
        Ok(out)
    }

    pub(super) fn cuda_reset_peak(device: usize) -> Result<(), String> {
        let index = c_int::try_from(device).map_err(|_| format!("device index {device}"))?;
        // SAFETY: takes a plain integer; errors come back as a string.
        check(unsafe { rl_core_cuda_reset_peak(index) })
    }
}

#[cfg(not(rl_core_device_memory))]
mod ffi {
    const MISSING: &str = "rl-core was built without its device-memory shim (no libtorch headers were found at build time)";

    pub(super) fn cuda_memory(_device: usize) -> Result<[i64; 4], String> {
        Err(MISSING.to_owned())
    }

    pub(super) fn cuda_reset_peak(_device: usize) -> Result<(), String> {
        Err(MISSING.to_owned())
    }
}

fn torch_error(what: &str, device: Device, message: String) -> Error {
    Error::Tch(TchError::Torch(format!("{what} of {device:?}: {message}")))
}

fn bytes(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The allocator's counters of `device`; `None` for the CPU (no caching allocator) and for
/// devices without one here.
pub fn stats(device: Device) -> Result<Option<DeviceMemory>> {
    let Device::Cuda(index) = device else {
        return Ok(None);
    };
    let [allocated, peak_allocated, reserved, peak_reserved] =
        ffi::cuda_memory(index).map_err(|m| torch_error("reading the memory", device, m))?;
    Ok(Some(DeviceMemory {
        allocated: bytes(allocated),
        peak_allocated: bytes(peak_allocated),
        reserved: bytes(reserved),
        peak_reserved: bytes(peak_reserved),
    }))
}

/// Starts the peaks of `device` afresh from the current figures (no-op on the CPU).
pub fn reset_peak(device: Device) -> Result<()> {
    match device {
        Device::Cuda(index) => ffi::cuda_reset_peak(index)
            .map_err(|m| torch_error("resetting the peak memory", device, m)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_has_no_caching_allocator() {
        assert_eq!(stats(Device::Cpu).unwrap(), None);
        reset_peak(Device::Cpu).unwrap();
    }

    /// Without a CUDA libtorch the shim answers with an error, never a made-up figure.
    #[test]
    fn a_cuda_device_without_cuda_is_an_error_or_real_figures() {
        match stats(Device::Cuda(0)) {
            Ok(Some(m)) => {
                assert!(tch::Cuda::is_available(), "figures without CUDA: {m:?}");
                assert!(m.peak_allocated >= m.allocated && m.peak_reserved >= m.reserved);
            }
            Ok(None) => panic!("a CUDA device answered None"),
            Err(e) => {
                assert!(!tch::Cuda::is_available(), "CUDA is available but: {e}");
                assert!(e.to_string().contains("Cuda(0)"), "{e}");
            }
        }
    }

    /// On a GPU: a tensor's bytes show in `allocated` and in the peak, which stays after the
    /// tensor is freed until `reset_peak`.
    #[test]
    fn cuda_counts_a_tensor_and_keeps_its_peak() {
        if !tch::Cuda::is_available() {
            return;
        }
        let device = Device::Cuda(0);
        reset_peak(device).unwrap();
        let before = stats(device).unwrap().unwrap();
        let t = tch::Tensor::zeros([1 << 20], (tch::Kind::Float, device));
        let held = stats(device).unwrap().unwrap();
        assert!(
            held.allocated >= before.allocated + (4 << 20),
            "{before:?} -> {held:?}"
        );
        drop(t);
        let after = stats(device).unwrap().unwrap();
        assert!(after.peak_allocated >= held.allocated, "{after:?}");
        reset_peak(device).unwrap();
        let reset = stats(device).unwrap().unwrap();
        assert!(reset.peak_allocated < held.allocated, "{reset:?}");
    }
}
