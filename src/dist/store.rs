//! c10d's `TCPStore` through the shim (`src/shim/toma_dist.cpp`): the only place that calls it.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::time::Duration;

use super::error::DistError;

/// A shim call that did not succeed: its code and c10d's message.
#[derive(Debug)]
pub(super) struct ShimError {
    pub(super) timeout: bool,
    pub(super) message: String,
}

impl ShimError {
    pub(super) fn store(self, op: &'static str) -> DistError {
        DistError::Store { op, message: self.message }
    }
}

#[cfg(toma_dist_shim)]
mod ffi {
    use super::*;

    pub(super) const OK: c_int = 0;
    pub(super) const TIMEOUT: c_int = 2;
    pub(super) const NO_GLOO: c_int = 3;

    #[repr(C)]
    pub(super) struct RawStore {
        _private: [u8; 0],
    }

    #[repr(C)]
    pub(super) struct RawGroup {
        _private: [u8; 0],
    }

    pub(super) type Sink = extern "C" fn(ctx: *mut c_void, index: usize, data: *const u8, len: usize);

    unsafe extern "C" {
        pub(super) fn toma_dist_store_connect(
            host: *const c_char,
            port: u16,
            is_server: c_int,
            timeout_ms: i64,
            out: *mut *mut RawStore,
        ) -> c_int;
        pub(super) fn toma_dist_store_free(store: *mut RawStore);
        pub(super) fn toma_dist_store_set(
            store: *mut RawStore,
            key: *const c_char,
            value: *const u8,
            len: usize,
        ) -> c_int;
        pub(super) fn toma_dist_store_add(
            store: *mut RawStore,
            key: *const c_char,
            delta: i64,
            value: *mut i64,
        ) -> c_int;
        pub(super) fn toma_dist_store_wait(
            store: *mut RawStore,
            keys: *const *const c_char,
            n: usize,
            timeout_ms: i64,
        ) -> c_int;
        pub(super) fn toma_dist_store_check(
            store: *mut RawStore,
            keys: *const *const c_char,
            n: usize,
            all_exist: *mut c_int,
        ) -> c_int;
        pub(super) fn toma_dist_store_delete(store: *mut RawStore, key: *const c_char) -> c_int;
        pub(super) fn toma_dist_store_multi_get(
            store: *mut RawStore,
            keys: *const *const c_char,
            n: usize,
            sink: Sink,
            ctx: *mut c_void,
        ) -> c_int;
        pub(super) fn toma_dist_gloo_new(
            store: *mut RawStore,
            prefix: *const c_char,
            rank: i64,
            world_size: i64,
            timeout_ms: i64,
            out: *mut *mut RawGroup,
        ) -> c_int;
        pub(super) fn toma_dist_group_free(group: *mut RawGroup);
        pub(super) fn toma_dist_all_reduce_sum(group: *mut RawGroup, tensors: *const *mut c_void, n: usize) -> c_int;
        pub(super) fn toma_dist_last_error() -> *const c_char;
    }
}

/// Turns a shim return code into a `Result`, with c10d's message on failure.
#[cfg(toma_dist_shim)]
fn check(code: c_int) -> Result<(), ShimError> {
    if code == ffi::OK {
        return Ok(());
    }
    // SAFETY: the shim returns a NUL-terminated thread-local string, valid until its next call
    // on this thread; it is copied at once.
    let message = unsafe { CStr::from_ptr(ffi::toma_dist_last_error()) }.to_string_lossy().into_owned();
    let message = if code == ffi::NO_GLOO { format!("{message} (no gloo)") } else { message };
    Err(ShimError { timeout: code == ffi::TIMEOUT, message })
}

#[cfg(not(toma_dist_shim))]
fn not_built() -> ShimError {
    ShimError {
        timeout: false,
        message: "toma was built without c10d (feature `dist` needs libtorch's headers)".into(),
    }
}

fn c_string(text: &str) -> CString {
    // Keys and hosts are toma's own or come from the environment; a NUL cannot reach c10d.
    CString::new(text.replace('\0', "")).expect("NULs were removed")
}

fn millis(timeout: Duration) -> i64 {
    i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// A connection to a c10d `TCPStore` (and, on the rank that hosts it, the server).
#[derive(Debug)]
pub(super) struct Store {
    #[cfg(toma_dist_shim)]
    raw: *mut ffi::RawStore,
}

// SAFETY: c10d's TCPStore client serialises its operations under its own lock, and the handle is
// freed once, by Drop.
unsafe impl Send for Store {}
// SAFETY: as above: every operation goes through the store's lock.
unsafe impl Sync for Store {}

impl Store {
    /// Connects (retrying until `timeout`), or hosts the store on `port` and connects to it.
    pub(super) fn connect(host: &str, port: u16, host_it: bool, timeout: Duration) -> Result<Store, ShimError> {
        #[cfg(toma_dist_shim)]
        {
            let host = c_string(host);
            let mut raw = std::ptr::null_mut();
            // SAFETY: valid C string and out-pointer; the shim catches every exception.
            check(unsafe {
                ffi::toma_dist_store_connect(host.as_ptr(), port, c_int::from(host_it), millis(timeout), &mut raw)
            })?;
            Ok(Store { raw })
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = (host, port, host_it, timeout, c_string, millis);
            Err(not_built())
        }
    }

    pub(super) fn set(&self, key: &str, value: &[u8]) -> Result<(), ShimError> {
        #[cfg(toma_dist_shim)]
        {
            let key = c_string(key);
            // SAFETY: live handle, valid key and byte slice.
            check(unsafe { ffi::toma_dist_store_set(self.raw, key.as_ptr(), value.as_ptr(), value.len()) })
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = (key, value);
            Err(not_built())
        }
    }

    pub(super) fn add(&self, key: &str, delta: i64) -> Result<i64, ShimError> {
        #[cfg(toma_dist_shim)]
        {
            let key = c_string(key);
            let mut value = 0;
            // SAFETY: live handle, valid key and out-pointer.
            check(unsafe { ffi::toma_dist_store_add(self.raw, key.as_ptr(), delta, &mut value) })?;
            Ok(value)
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = (key, delta);
            Err(not_built())
        }
    }

    pub(super) fn wait(&self, keys: &[String], timeout: Duration) -> Result<(), ShimError> {
        #[cfg(toma_dist_shim)]
        {
            let owned: Vec<CString> = keys.iter().map(|k| c_string(k)).collect();
            let ptrs: Vec<*const c_char> = owned.iter().map(|k| k.as_ptr()).collect();
            // SAFETY: live handle; `ptrs` points into `owned`, alive for the call.
            check(unsafe { ffi::toma_dist_store_wait(self.raw, ptrs.as_ptr(), ptrs.len(), millis(timeout)) })
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = (keys, timeout);
            Err(not_built())
        }
    }

    pub(super) fn exists(&self, key: &str) -> Result<bool, ShimError> {
        #[cfg(toma_dist_shim)]
        {
            let key = c_string(key);
            let ptrs = [key.as_ptr()];
            let mut all = 0;
            // SAFETY: live handle; one valid key; out-pointer.
            check(unsafe { ffi::toma_dist_store_check(self.raw, ptrs.as_ptr(), 1, &mut all) })?;
            Ok(all != 0)
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = key;
            Err(not_built())
        }
    }

    pub(super) fn delete(&self, key: &str) -> Result<(), ShimError> {
        #[cfg(toma_dist_shim)]
        {
            let key = c_string(key);
            // SAFETY: live handle, valid key.
            check(unsafe { ffi::toma_dist_store_delete(self.raw, key.as_ptr()) })
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = key;
            Err(not_built())
        }
    }

    /// The values of `keys`, in order (each must exist).
    pub(super) fn multi_get(&self, keys: &[String]) -> Result<Vec<Vec<u8>>, ShimError> {
        #[cfg(toma_dist_shim)]
        {
            extern "C" fn sink(ctx: *mut c_void, index: usize, data: *const u8, len: usize) {
                // SAFETY: `ctx` is the `Vec` below, alive and exclusively ours for the call;
                // `data` holds `len` bytes for the duration of this callback.
                let values = unsafe { &mut *ctx.cast::<Vec<Vec<u8>>>() };
                let bytes = if len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(data, len) } };
                if let Some(slot) = values.get_mut(index) {
                    *slot = bytes.to_vec();
                }
            }
            let owned: Vec<CString> = keys.iter().map(|k| c_string(k)).collect();
            let ptrs: Vec<*const c_char> = owned.iter().map(|k| k.as_ptr()).collect();
            let mut values: Vec<Vec<u8>> = vec![Vec::new(); keys.len()];
            let ctx = (&mut values as *mut Vec<Vec<u8>>).cast::<c_void>();
            // SAFETY: live handle; `ptrs` points into `owned`; `sink` only writes into `values`.
            check(unsafe { ffi::toma_dist_store_multi_get(self.raw, ptrs.as_ptr(), ptrs.len(), sink, ctx) })?;
            Ok(values)
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = keys;
            Err(not_built())
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        #[cfg(toma_dist_shim)]
        // SAFETY: created by toma_dist_store_connect and freed only here.
        unsafe {
            ffi::toma_dist_store_free(self.raw)
        };
    }
}

/// A Gloo process group over a [`Store`].
#[derive(Debug)]
pub(super) struct Gloo {
    #[cfg(toma_dist_shim)]
    raw: *mut ffi::RawGroup,
}

// SAFETY: c10d process groups are used from any thread; toma serialises calls on a group behind
// a mutex (see `Group::all_reduce_sum`), and the handle is freed once, by Drop.
unsafe impl Send for Gloo {}

impl Gloo {
    /// Joins the group (a collective: every rank calls it), its keys under `prefix`.
    pub(super) fn new(
        store: &Store,
        prefix: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Gloo, ShimError> {
        #[cfg(toma_dist_shim)]
        {
            let prefix = c_string(prefix);
            let mut raw = std::ptr::null_mut();
            // SAFETY: live store handle, valid prefix and out-pointer.
            check(unsafe {
                ffi::toma_dist_gloo_new(
                    store.raw,
                    prefix.as_ptr(),
                    rank as i64,
                    world as i64,
                    millis(timeout),
                    &mut raw,
                )
            })?;
            Ok(Gloo { raw })
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = (store, prefix, rank, world, timeout);
            Err(not_built())
        }
    }

    /// Sums `tensors` across the ranks, in place.
    pub(super) fn all_reduce_sum(&mut self, tensors: &[&tch::Tensor]) -> Result<(), ShimError> {
        #[cfg(toma_dist_shim)]
        {
            let ptrs: Vec<*mut c_void> = tensors.iter().map(|t| t.as_ptr() as *mut c_void).collect();
            // SAFETY: live group; each pointer is a live tch tensor handle (an at::Tensor*) that
            // the borrow keeps alive for the call; the sum writes into the tensors' storage in
            // place, as tch's own in-place ops do through a shared reference.
            check(unsafe { ffi::toma_dist_all_reduce_sum(self.raw, ptrs.as_ptr(), ptrs.len()) })
        }
        #[cfg(not(toma_dist_shim))]
        {
            let _ = tensors;
            Err(not_built())
        }
    }
}

impl Drop for Gloo {
    fn drop(&mut self) {
        #[cfg(toma_dist_shim)]
        // SAFETY: created by toma_dist_gloo_new and freed only here.
        unsafe {
            ffi::toma_dist_group_free(self.raw)
        };
    }
}
