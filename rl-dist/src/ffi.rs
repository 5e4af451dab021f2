//! The only unsafe code in the crate: raw bindings to the C++ shim in `csrc/` and an owning handle.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr::NonNull;
use std::time::Duration;

use tch::Tensor;

#[repr(C)]
struct RawGroup {
    _private: [u8; 0],
}

#[repr(C)]
struct RawWork {
    _private: [u8; 0],
}

pub(crate) const BACKEND_GLOO: c_int = 0;
pub(crate) const BACKEND_NCCL: c_int = 1;
pub(crate) const OP_SUM: c_int = 0;
pub(crate) const OP_MAX: c_int = 1;
pub(crate) const OP_MIN: c_int = 2;

unsafe extern "C" {
    fn rl_c10d_has_nccl() -> c_int;
    fn rl_c10d_group_new(
        backend: c_int,
        addr: *const c_char,
        port: u16,
        rank: c_int,
        world_size: c_int,
        timeout_ms: i64,
        gloo_iface: *const c_char,
        gloo_host: *const c_char,
        out: *mut *mut RawGroup,
    ) -> *mut c_char;
    fn rl_c10d_group_free(group: *mut RawGroup);
    fn rl_c10d_all_reduce(
        group: *mut RawGroup,
        tensor: *mut c_void,
        op: c_int,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn rl_c10d_broadcast(
        group: *mut RawGroup,
        tensor: *mut c_void,
        src: c_int,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn rl_c10d_all_gather(
        group: *mut RawGroup,
        outputs: *const *mut c_void,
        n_outputs: c_int,
        input: *mut c_void,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn rl_c10d_reduce_scatter(
        group: *mut RawGroup,
        output: *mut c_void,
        input: *mut c_void,
        op: c_int,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn rl_c10d_all_gather_flat(
        group: *mut RawGroup,
        output: *mut c_void,
        input: *mut c_void,
        timeout_ms: i64,
    ) -> *mut c_char;
    fn rl_c10d_all_gather_flat_start(
        group: *mut RawGroup,
        output: *mut c_void,
        input: *mut c_void,
        timeout_ms: i64,
        out: *mut *mut RawWork,
    ) -> *mut c_char;
    fn rl_c10d_work_wait(work: *mut RawWork) -> *mut c_char;
    fn rl_c10d_work_free(work: *mut RawWork);
    fn rl_c10d_barrier(group: *mut RawGroup, timeout_ms: i64) -> *mut c_char;
    fn rl_c10d_set_timeout(group: *mut RawGroup, timeout_ms: i64) -> *mut c_char;
    fn rl_c10d_free_error(error: *mut c_char);
}

/// Whether the shim was compiled with the NCCL backend.
pub(crate) fn has_nccl() -> bool {
    // SAFETY: returns a constant fixed when the shim was compiled.
    unsafe { rl_c10d_has_nccl() != 0 }
}

/// Turns the shim's status (NULL or an owned message) into a `Result`.
fn status(raw: *mut c_char) -> Result<(), String> {
    if raw.is_null() {
        return Ok(());
    }
    // SAFETY: a non-NULL status is a NUL-terminated string malloc'd by the shim that nothing else
    // references; it is read once here and then freed by the shim's own allocator.
    let message = unsafe { CStr::from_ptr(raw) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: see above; `raw` is not used after this call.
    unsafe { rl_c10d_free_error(raw) };
    Err(message)
}

fn millis(timeout: Duration) -> i64 {
    i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX / 4)
}

fn c_string(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?} contains a NUL byte"))
}

/// `at::Tensor*` behind a tch tensor, as the shim takes it.
fn tensor_ptr(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

/// An owned c10d store plus backend; freed (joining the backend's threads) on drop.
pub(crate) struct Group(NonNull<RawGroup>);

// SAFETY: the handle owns its c10d objects exclusively; c10d stores and backends may be used from
// any thread as long as calls are not concurrent, which `&mut`/`!Sync` access guarantees.
unsafe impl Send for Group {}

/// Where the Gloo backend binds: an interface name, a local address, or libtorch's default.
pub(crate) enum GlooDevice<'a> {
    Interface(&'a str),
    Host(&'a str),
    Default,
}

impl Group {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        backend: c_int,
        addr: &str,
        port: u16,
        rank: c_int,
        world_size: c_int,
        timeout: Duration,
        device: GlooDevice<'_>,
    ) -> Result<Self, String> {
        let addr = c_string(addr)?;
        let (iface, host) = match device {
            GlooDevice::Interface(i) => (c_string(i)?, c_string("")?),
            GlooDevice::Host(h) => (c_string("")?, c_string(h)?),
            GlooDevice::Default => (c_string("")?, c_string("")?),
        };
        let mut out: *mut RawGroup = std::ptr::null_mut();
        // SAFETY: all strings are valid NUL-terminated and outlive the call; `out` is a valid
        // place the shim writes a fresh group into (or NULL on error).
        let raw = unsafe {
            rl_c10d_group_new(
                backend,
                addr.as_ptr(),
                port,
                rank,
                world_size,
                millis(timeout),
                iface.as_ptr(),
                host.as_ptr(),
                &mut out,
            )
        };
        status(raw)?;
        NonNull::new(out)
            .map(Group)
            .ok_or_else(|| "the shim returned no group".to_owned())
    }

    pub(crate) fn all_reduce(
        &mut self,
        tensor: &mut Tensor,
        op: c_int,
        timeout: Duration,
    ) -> Result<(), String> {
        // SAFETY: `self.0` is a live group; the tensor pointer is a valid `at::Tensor*` for the
        // duration of the call (the shim copies the handle, sharing storage).
        status(unsafe {
            rl_c10d_all_reduce(self.0.as_ptr(), tensor_ptr(tensor), op, millis(timeout))
        })
    }

    pub(crate) fn broadcast(
        &mut self,
        tensor: &mut Tensor,
        src: c_int,
        timeout: Duration,
    ) -> Result<(), String> {
        // SAFETY: as in `all_reduce`.
        status(unsafe {
            rl_c10d_broadcast(self.0.as_ptr(), tensor_ptr(tensor), src, millis(timeout))
        })
    }

    pub(crate) fn all_gather(
        &mut self,
        outputs: &mut [Tensor],
        input: &Tensor,
        timeout: Duration,
    ) -> Result<(), String> {
        let ptrs: Vec<*mut c_void> = outputs.iter().map(tensor_ptr).collect();
        let n = c_int::try_from(ptrs.len()).map_err(|_| "too many outputs".to_owned())?;
        // SAFETY: `ptrs` holds `n` valid `at::Tensor*` that outlive the call; the input is only
        // read by the backend.
        status(unsafe {
            rl_c10d_all_gather(
                self.0.as_ptr(),
                ptrs.as_ptr(),
                n,
                tensor_ptr(input),
                millis(timeout),
            )
        })
    }

    pub(crate) fn reduce_scatter(
        &mut self,
        output: &mut Tensor,
        input: &Tensor,
        op: c_int,
        timeout: Duration,
    ) -> Result<(), String> {
        // SAFETY: as in `all_reduce`; the input is only read by the backend.
        status(unsafe {
            rl_c10d_reduce_scatter(
                self.0.as_ptr(),
                tensor_ptr(output),
                tensor_ptr(input),
                op,
                millis(timeout),
            )
        })
    }

    pub(crate) fn all_gather_flat(
        &mut self,
        output: &mut Tensor,
        input: &Tensor,
        timeout: Duration,
    ) -> Result<(), String> {
        // SAFETY: as in `all_reduce`; the input is only read by the backend.
        status(unsafe {
            rl_c10d_all_gather_flat(
                self.0.as_ptr(),
                tensor_ptr(output),
                tensor_ptr(input),
                millis(timeout),
            )
        })
    }

    /// [`Group::all_gather_flat`] started: the returned work completes it. The backend holds
    /// `output` and `input` (sharing their storage) until the collective completes.
    pub(crate) fn all_gather_flat_start(
        &mut self,
        output: &mut Tensor,
        input: &Tensor,
        timeout: Duration,
    ) -> Result<Work, String> {
        let mut out: *mut RawWork = std::ptr::null_mut();
        // SAFETY: as in `all_reduce`; the backend copies the tensor handles (sharing storage),
        // so the tensors stay alive for the collective whatever Rust does with its handles.
        status(unsafe {
            rl_c10d_all_gather_flat_start(
                self.0.as_ptr(),
                tensor_ptr(output),
                tensor_ptr(input),
                millis(timeout),
                &mut out,
            )
        })?;
        NonNull::new(out)
            .map(Work)
            .ok_or_else(|| "the shim returned no work".to_owned())
    }

    pub(crate) fn barrier(&mut self, timeout: Duration) -> Result<(), String> {
        // SAFETY: `self.0` is a live group.
        status(unsafe { rl_c10d_barrier(self.0.as_ptr(), millis(timeout)) })
    }
}

impl Group {
    pub(crate) fn set_timeout(&mut self, timeout: Duration) -> Result<(), String> {
        // SAFETY: `self.0` is a live group.
        status(unsafe { rl_c10d_set_timeout(self.0.as_ptr(), millis(timeout)) })
    }
}

/// An owned asynchronous collective in flight; freeing it does not cancel the collective.
pub(crate) struct Work(NonNull<RawWork>);

// SAFETY: c10d's `Work` may be waited on from any thread; the handle is owned exclusively.
unsafe impl Send for Work {}

impl Work {
    /// Blocks until the collective completes (bounded by its group's timeout).
    pub(crate) fn wait(&mut self) -> Result<(), String> {
        // SAFETY: `self.0` is a live work from `rl_c10d_all_gather_flat_start`.
        status(unsafe { rl_c10d_work_wait(self.0.as_ptr()) })
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from the shim and is freed exactly once, here.
        unsafe { rl_c10d_work_free(self.0.as_ptr()) }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `rl_c10d_group_new` and is freed exactly once, here.
        unsafe { rl_c10d_group_free(self.0.as_ptr()) }
    }
}
