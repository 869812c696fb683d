//! The native shim's C interface (`src/shim/toma_shim.h`, feature `tch`), and why it could
//! not answer: the one place `memory` calls into C++.

/// Why libtorch's allocator figures could not be read.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocatorError {
    /// toma was built without feature `tch`, or its libtorch shim failed to compile (the build
    /// printed a `toma:` warning).
    #[error("toma was built without its libtorch shim (feature `tch`; a failed compile prints a build warning)")]
    NotBuilt,
    /// The libtorch in use has no CUDA support loaded, or sees no CUDA device; the reason.
    #[error("no CUDA in libtorch: {0}")]
    NoCuda(String),
    /// The ordinal is not one of libtorch's CUDA devices.
    #[error("CUDA device {0} is not one of libtorch's devices")]
    BadDevice(usize),
    /// CPU figures were asked for before [`track_cpu_allocations`](super::track_cpu_allocations).
    #[error("CPU allocations are not counted: call toma::memory::track_cpu_allocations first")]
    NotTracking,
    /// libtorch threw; its message.
    #[error("libtorch failed: {0}")]
    Torch(String),
}

impl AllocatorError {
    /// Reports the error: expected absences at debug level, libtorch's failures as warnings.
    pub(in crate::memory) fn log(self, doing: &str) {
        match self {
            AllocatorError::Torch(_) => tracing::warn!(error = %self, "toma: {doing}"),
            _ => tracing::debug!(error = %self, "toma: {doing}"),
        }
    }
}

/// The leaf a view was made from ([`view_base`](super::view_base)), and both storage offsets.
#[cfg(feature = "tch")]
pub(crate) struct ViewBase {
    pub(crate) base: tch::Tensor,
    pub(crate) offset: i64,
    pub(crate) base_offset: i64,
}

pub(super) use imp::*;

/// Counts of the counting CPU allocator (`toma_shim_cpu_counts`).
#[repr(C)]
#[derive(Debug, Default)]
pub(super) struct RawCpuStats {
    pub(super) allocated: i64,
    pub(super) peak_allocated: i64,
    pub(super) allocations: i64,
}

/// What a lazy leaf records of a tensor, read in one call (`toma_shim_tensor_info`).
#[cfg(feature = "tch")]
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct RawTensorFacts {
    pub(crate) dim: i64,
    pub(crate) sizes: [i64; 8],
    pub(crate) strides: [i64; 8],
    /// `c10::ScalarType` and `c10::DeviceType`, as numbered there.
    pub(crate) dtype: i32,
    pub(crate) device_type: i32,
    pub(crate) device_index: i64,
    pub(crate) requires_grad: i32,
    pub(crate) is_leaf: i32,
    /// 0 unless the tensor requires a gradient.
    pub(crate) data_ptr: usize,
}

/// Figures of the CUDA caching allocator (`toma_shim_allocator_stats`).
#[repr(C)]
#[derive(Debug, Default)]
pub(super) struct RawStats {
    pub(super) allocated: i64,
    pub(super) reserved: i64,
    pub(super) peak_allocated: i64,
    pub(super) peak_reserved: i64,
    pub(super) alloc_retries: i64,
    pub(super) ooms: i64,
    pub(super) allocations: i64,
    pub(super) frees: i64,
    pub(super) initialized: i32,
}

/// The caching allocator's settings as libtorch parsed them (`toma_shim_allocator_config`);
/// sizes in bytes, `max_split_size` negative when unset.
#[cfg(feature = "tch")]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RawAllocatorConfig {
    pub(crate) large_segment_size: i64,
    pub(crate) max_split_size: i64,
    pub(crate) max_non_split_rounding_size: i64,
    pub(crate) garbage_collection_threshold: f64,
    pub(crate) expandable_segments: i32,
    pub(crate) roundup_power2_divisions: [i64; 16],
}

/// One segment of the CUDA caching allocator (`toma_shim_segment`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RawSegment {
    pub(super) address: u64,
    pub(super) stream: u64,
    pub(super) first_block: i64,
    pub(super) block_count: i64,
    pub(super) is_large: i32,
    pub(super) is_expandable: i32,
    pub(super) is_private: i32,
    pub(super) reserved: i32,
}

/// One block of a [`RawSegment`] (`toma_shim_block`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RawBlock {
    pub(super) size: i64,
    /// 1: in a tensor; 2: freed, waiting for another stream; 0: free.
    pub(super) state: i32,
    pub(super) reserved: i32,
}

/// Bytes from the shim's signed counts (negative: none).
pub(super) fn bytes(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

#[cfg(toma_shim)]
mod imp {
    #[cfg(feature = "tch")]
    use super::RawTensorFacts;
    use super::{AllocatorError, RawAllocatorConfig, RawBlock, RawCpuStats, RawSegment, RawStats};
    use std::ffi::{c_char, c_int, CStr, CString};

    const OK: c_int = 0;
    const NO_CUDA: c_int = 1;
    const BAD_DEVICE: c_int = 2;
    const NOT_TRACKING: c_int = 4;

    unsafe extern "C" {
        fn toma_shim_cuda_device_count(count: *mut i64) -> c_int;
        fn toma_shim_cuda_current_device(device: *mut i64) -> c_int;
        fn toma_shim_cuda_allocator_stats(device: i64, stats: *mut RawStats) -> c_int;
        fn toma_shim_cuda_reset_peak(device: i64) -> c_int;
        fn toma_shim_cuda_empty_cache() -> c_int;
        fn toma_shim_allocator_config_get(out: *mut RawAllocatorConfig) -> c_int;
        fn toma_shim_allocator_settings_set(settings: *const c_char) -> c_int;
        fn toma_shim_cuda_snapshot(
            device: i64,
            segments: *mut RawSegment,
            segment_cap: i64,
            segments_out: *mut i64,
            blocks: *mut RawBlock,
            block_cap: i64,
            blocks_out: *mut i64,
        ) -> c_int;
        fn toma_shim_cpu_track() -> c_int;
        fn toma_shim_cpu_stats(stats: *mut RawCpuStats) -> c_int;
        fn toma_shim_cpu_reset_peak() -> c_int;
        fn toma_shim_cpu_raise_peak(value: i64) -> c_int;
        fn toma_shim_cpu_scope_begin(slot: *mut i64) -> c_int;
        fn toma_shim_cpu_scope_end(slot: i64) -> c_int;
        fn toma_shim_cpu_scope_stats(slot: i64, stats: *mut RawCpuStats) -> c_int;
        fn toma_shim_cpu_scope_reset_peak(slot: i64) -> c_int;
        fn toma_shim_cpu_scope_events(slot: i64, all: *mut i64, own: *mut i64) -> c_int;
        fn toma_shim_cpu_onednn_checks(bf16: *mut i32, fp16: *mut i32) -> c_int;
        fn toma_shim_generator_state(device: i64, buf: *mut u8, cap: i64, size: *mut i64) -> c_int;
        fn toma_shim_set_generator_state(device: i64, buf: *const u8, size: i64) -> c_int;
        fn toma_shim_cpu_capability(buf: *mut c_char, cap: i64, size: *mut i64) -> c_int;
        fn toma_shim_clear_grad(tensor: *mut std::ffi::c_void) -> c_int;
        fn toma_shim_grad_enabled() -> c_int;
        fn toma_shim_backward(
            tensors: *const *mut std::ffi::c_void,
            grads: *const *mut std::ffi::c_void,
            n: i64,
        ) -> c_int;
        fn toma_shim_tensor_facts(tensor: *mut std::ffi::c_void, out: *mut RawTensorFacts) -> c_int;
        fn toma_shim_grad_defined(tensor: *mut std::ffi::c_void, defined: *mut c_int) -> c_int;
        fn toma_shim_storage_use(tensor: *mut std::ffi::c_void, use_count: *mut i64, nbytes: *mut i64) -> c_int;
        fn toma_shim_view_base(
            tensor: *mut std::ffi::c_void,
            base: *mut *mut std::ffi::c_void,
            offset: *mut i64,
            base_offset: *mut i64,
        ) -> c_int;
        fn toma_shim_autocast_state(device_type: c_int, enabled: *mut c_int, dtype: *mut c_int) -> c_int;
        fn toma_shim_autocast_set(device_type: c_int, enabled: c_int, dtype: c_int, nest: c_int) -> c_int;
        fn toma_shim_last_error() -> *const c_char;
    }

    fn check(code: c_int, device: usize) -> Result<(), AllocatorError> {
        if code == OK {
            return Ok(());
        }
        // SAFETY: the shim returns a NUL-terminated string owned by this thread, valid until
        // its next call on this thread; it is copied out at once. Only the codes that carry
        // it read it: "not tracking" is asked every lazy step where nothing counts.
        let message = || unsafe { CStr::from_ptr(toma_shim_last_error()) }.to_string_lossy().into_owned();
        Err(match code {
            NO_CUDA => AllocatorError::NoCuda(message()),
            BAD_DEVICE => AllocatorError::BadDevice(device),
            NOT_TRACKING => AllocatorError::NotTracking,
            _ => AllocatorError::Torch(message()),
        })
    }

    /// libtorch's ordinal for `device`, or `BadDevice` when it cannot be one.
    fn index(device: usize) -> Result<i64, AllocatorError> {
        i64::try_from(device).map_err(|_| AllocatorError::BadDevice(device))
    }

    pub(in crate::memory) fn device_count() -> Result<usize, AllocatorError> {
        let mut count = 0;
        // SAFETY: the shim catches every C++ exception; the out-pointer is ours.
        check(unsafe { toma_shim_cuda_device_count(&mut count) }, 0)?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    pub(in crate::memory) fn current_device() -> Result<usize, AllocatorError> {
        let mut device = -1;
        // SAFETY: as above.
        check(unsafe { toma_shim_cuda_current_device(&mut device) }, 0)?;
        usize::try_from(device).map_err(|_| AllocatorError::NoCuda(format!("libtorch's current device is {device}")))
    }

    pub(in crate::memory) fn stats(device: usize) -> Result<RawStats, AllocatorError> {
        let mut raw = RawStats::default();
        // SAFETY: as above; `raw` has the C struct's layout.
        check(unsafe { toma_shim_cuda_allocator_stats(index(device)?, &mut raw) }, device)?;
        Ok(raw)
    }

    pub(in crate::memory) fn reset_peak(device: usize) -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cuda_reset_peak(index(device)?) }, device)
    }

    pub(in crate::memory) fn empty_cache() -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cuda_empty_cache() }, 0)
    }

    pub(in crate::memory) fn allocator_config() -> Result<RawAllocatorConfig, AllocatorError> {
        let mut raw = RawAllocatorConfig::default();
        // SAFETY: as above; `raw` has the C struct's layout.
        check(unsafe { toma_shim_allocator_config_get(&mut raw) }, 0)?;
        Ok(raw)
    }

    pub(in crate::memory) fn set_allocator_settings(settings: &str) -> Result<(), AllocatorError> {
        let settings =
            CString::new(settings).map_err(|_| AllocatorError::Torch("settings contain a NUL byte".into()))?;
        // SAFETY: as above; the shim copies the string before returning.
        check(unsafe { toma_shim_allocator_settings_set(settings.as_ptr()) }, 0)
    }

    pub(in crate::memory) fn snapshot(device: usize) -> Result<(Vec<RawSegment>, Vec<RawBlock>), AllocatorError> {
        let ordinal = index(device)?;
        let (mut segments, mut blocks) = (vec![RawSegment::default(); 64], vec![RawBlock::default(); 512]);
        // Segments come and go between calls (other threads allocate): a few tries with room
        // for what the last one counted.
        for _ in 0..8 {
            let (mut n, mut b) = (0i64, 0i64);
            // SAFETY: as above; the shim writes at most the given counts into the buffers.
            check(
                unsafe {
                    toma_shim_cuda_snapshot(
                        ordinal,
                        segments.as_mut_ptr(),
                        segments.len() as i64,
                        &mut n,
                        blocks.as_mut_ptr(),
                        blocks.len() as i64,
                        &mut b,
                    )
                },
                device,
            )?;
            let (n, b) = (usize::try_from(n).unwrap_or(0), usize::try_from(b).unwrap_or(0));
            if n <= segments.len() && b <= blocks.len() {
                segments.truncate(n);
                blocks.truncate(b);
                return Ok((segments, blocks));
            }
            segments.resize(n.max(segments.len()) * 2, RawSegment::default());
            blocks.resize(b.max(blocks.len()) * 2, RawBlock::default());
        }
        Err(AllocatorError::Torch("the allocator's segments kept growing while they were read".into()))
    }

    pub(in crate::memory) fn cpu_track() -> Result<(), AllocatorError> {
        // SAFETY: as above; the shim installs the counter once, under a once-flag.
        check(unsafe { toma_shim_cpu_track() }, 0)
    }

    pub(in crate::memory) fn cpu_stats() -> Result<RawCpuStats, AllocatorError> {
        let mut raw = RawCpuStats::default();
        // SAFETY: as above; `raw` has the C struct's layout.
        check(unsafe { toma_shim_cpu_stats(&mut raw) }, 0)?;
        Ok(raw)
    }

    pub(in crate::memory) fn cpu_reset_peak() -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cpu_reset_peak() }, 0)
    }

    pub(in crate::memory) fn cpu_raise_peak(value: u64) -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cpu_raise_peak(value as i64) }, 0)
    }

    pub(in crate::memory) fn cpu_scope_begin() -> Result<i64, AllocatorError> {
        let mut slot = 0i64;
        // SAFETY: as above; the shim writes `slot` only.
        check(unsafe { toma_shim_cpu_scope_begin(&mut slot) }, 0)?;
        Ok(slot)
    }

    pub(in crate::memory) fn cpu_scope_end(slot: i64) {
        // SAFETY: as above; ending a scope the thread does not hold does nothing.
        let _ = unsafe { toma_shim_cpu_scope_end(slot) };
    }

    pub(in crate::memory) fn cpu_scope_stats(slot: i64) -> Result<RawCpuStats, AllocatorError> {
        let mut raw = RawCpuStats::default();
        // SAFETY: as above; `raw` has the C struct's layout.
        check(unsafe { toma_shim_cpu_scope_stats(slot, &mut raw) }, 0)?;
        Ok(raw)
    }

    pub(in crate::memory) fn cpu_scope_reset_peak(slot: i64) -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cpu_scope_reset_peak(slot) }, 0)
    }

    pub(in crate::memory) fn cpu_scope_events(slot: i64) -> Result<(i64, i64), AllocatorError> {
        let (mut all, mut own) = (0i64, 0i64);
        // SAFETY: as above; the shim writes the two integers only.
        check(unsafe { toma_shim_cpu_scope_events(slot, &mut all, &mut own) }, 0)?;
        Ok((all, own))
    }

    pub(in crate::memory) fn cpu_onednn_checks() -> Result<(bool, bool), AllocatorError> {
        let (mut bf16, mut fp16) = (0i32, 0i32);
        // SAFETY: as above; the shim writes the two integers only.
        check(unsafe { toma_shim_cpu_onednn_checks(&mut bf16, &mut fp16) }, 0)?;
        Ok((bf16 != 0, fp16 != 0))
    }

    /// libtorch's ordinal for a generator: -1 for the CPU's.
    fn generator(device: Option<usize>) -> Result<i64, AllocatorError> {
        device.map_or(Ok(-1), index)
    }

    pub(in crate::memory) fn generator_state(device: Option<usize>) -> Result<Vec<u8>, AllocatorError> {
        let ordinal = generator(device)?;
        let mut buf = vec![0u8; 8192];
        loop {
            let mut size = 0i64;
            // SAFETY: as above; the shim writes at most `cap` bytes into `buf`.
            check(
                unsafe { toma_shim_generator_state(ordinal, buf.as_mut_ptr(), buf.len() as i64, &mut size) },
                device.unwrap_or(0),
            )?;
            let size = usize::try_from(size).unwrap_or(0);
            if size <= buf.len() {
                buf.truncate(size);
                return Ok(buf);
            }
            buf.resize(size, 0);
        }
    }

    pub(in crate::memory) fn cpu_capability() -> Result<String, AllocatorError> {
        let mut buf = [0u8; 64];
        let mut size = 0i64;
        // SAFETY: as above; the shim writes at most `cap` bytes into `buf`.
        check(unsafe { toma_shim_cpu_capability(buf.as_mut_ptr().cast(), buf.len() as i64, &mut size) }, 0)?;
        let size = usize::try_from(size).unwrap_or(0);
        let bytes =
            buf.get(..size).ok_or_else(|| AllocatorError::Torch(format!("a CPU capability of {size} bytes")))?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    pub(in crate::memory) fn grad_enabled() -> Option<bool> {
        // SAFETY: reads the calling thread's grad mode; no arguments, nothing thrown.
        Some(unsafe { toma_shim_grad_enabled() } != 0)
    }

    pub(in crate::memory) fn clear_grad(tensor: &tch::Tensor) -> Result<(), AllocatorError> {
        // SAFETY: `as_ptr` is the `at::Tensor*` tch owns, alive for the borrow; the shim only
        // resets the autograd metadata's gradient slot (libtorch locks nothing else for it).
        check(unsafe { toma_shim_clear_grad(tensor.as_ptr() as *mut std::ffi::c_void) }, 0)
    }

    pub(in crate::memory) fn backward(tensors: &[&tch::Tensor], grads: &[&tch::Tensor]) -> Result<(), AllocatorError> {
        let roots: Vec<*mut std::ffi::c_void> = tensors.iter().map(|t| t.as_ptr() as *mut std::ffi::c_void).collect();
        let seeds: Vec<*mut std::ffi::c_void> = grads.iter().map(|t| t.as_ptr() as *mut std::ffi::c_void).collect();
        let n = roots.len().min(seeds.len()) as i64;
        // SAFETY: each pointer is an `at::Tensor*` tch owns, alive for the borrows; the shim
        // copies the handles, reads `n` of each list, and autograd writes only `.grad`s.
        check(unsafe { toma_shim_backward(roots.as_ptr(), seeds.as_ptr(), n) }, 0)
    }

    pub(in crate::memory) fn tensor_facts(tensor: &tch::Tensor) -> Result<RawTensorFacts, AllocatorError> {
        let mut out = RawTensorFacts::default();
        // SAFETY: as above; the shim only reads the tensor, and writes `out` (sizes and strides
        // for at most 8 dimensions, else it fails).
        check(unsafe { toma_shim_tensor_facts(tensor.as_ptr() as *mut std::ffi::c_void, &mut out) }, 0)?;
        Ok(out)
    }

    pub(in crate::memory) fn grad_defined(tensor: &tch::Tensor) -> Result<bool, AllocatorError> {
        let mut defined = 0;
        // SAFETY: as above; the shim only reads the tensor's gradient slot.
        check(unsafe { toma_shim_grad_defined(tensor.as_ptr() as *mut std::ffi::c_void, &mut defined) }, 0)?;
        Ok(defined != 0)
    }

    pub(in crate::memory) fn storage_use(tensor: &tch::Tensor) -> Result<(i64, i64), AllocatorError> {
        let (mut uses, mut bytes) = (0, 0);
        // SAFETY: as above; the shim only reads the tensor's storage, and writes two integers.
        check(unsafe { toma_shim_storage_use(tensor.as_ptr() as *mut std::ffi::c_void, &mut uses, &mut bytes) }, 0)?;
        Ok((uses, bytes))
    }

    pub(in crate::memory) fn view_base(tensor: &tch::Tensor) -> Result<Option<super::ViewBase>, AllocatorError> {
        let (mut base, mut offset, mut base_offset) = (std::ptr::null_mut(), 0, 0);
        // SAFETY: as above; the shim only reads the tensor, and writes a new `at::Tensor*` (or
        // NULL) and two integers.
        let tensor = tensor.as_ptr() as *mut std::ffi::c_void;
        check(unsafe { toma_shim_view_base(tensor, &mut base, &mut offset, &mut base_offset) }, 0)?;
        if base.is_null() {
            return Ok(None);
        }
        // SAFETY: the shim made it with `new at::Tensor(..)`, as tch makes the tensors it owns
        // (and frees them with `delete`): tch owns it from here.
        let base = unsafe { tch::Tensor::from_ptr(base.cast()) };
        Ok(Some(super::ViewBase { base, offset, base_offset }))
    }

    pub(in crate::memory) fn autocast_state(device_type: i32) -> Result<(bool, i32), AllocatorError> {
        let (mut enabled, mut dtype) = (0, 0);
        // SAFETY: as above; the shim writes both integers.
        check(unsafe { toma_shim_autocast_state(device_type, &mut enabled, &mut dtype) }, 0)?;
        Ok((enabled != 0, dtype))
    }

    pub(in crate::memory) fn set_autocast(
        device_type: i32,
        enabled: bool,
        dtype: i32,
        nest: i32,
    ) -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_autocast_set(device_type, c_int::from(enabled), dtype, nest) }, 0)
    }

    pub(in crate::memory) fn set_generator_state(device: Option<usize>, state: &[u8]) -> Result<(), AllocatorError> {
        // SAFETY: as above; the shim reads `state.len()` bytes.
        check(
            unsafe { toma_shim_set_generator_state(generator(device)?, state.as_ptr(), state.len() as i64) },
            device.unwrap_or(0),
        )
    }
}

/// No shim: built without feature `tch`, or its compile failed (a build warning said so).
#[cfg(not(toma_shim))]
mod imp {
    #[cfg(feature = "tch")]
    use super::RawAllocatorConfig;
    use super::{AllocatorError, RawBlock, RawCpuStats, RawSegment, RawStats};

    pub(in crate::memory) fn snapshot(_device: usize) -> Result<(Vec<RawSegment>, Vec<RawBlock>), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn allocator_config() -> Result<RawAllocatorConfig, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn set_allocator_settings(_settings: &str) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }

    pub(in crate::memory) fn device_count() -> Result<usize, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn current_device() -> Result<usize, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn stats(_device: usize) -> Result<RawStats, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn reset_peak(_device: usize) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn empty_cache() -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn cpu_track() -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn cpu_stats() -> Result<RawCpuStats, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn cpu_reset_peak() -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }

    pub(in crate::memory) fn cpu_raise_peak(_value: u64) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn cpu_scope_begin() -> Result<i64, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn cpu_scope_end(_slot: i64) {}
    pub(in crate::memory) fn cpu_scope_stats(_slot: i64) -> Result<RawCpuStats, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn cpu_scope_reset_peak(_slot: i64) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(in crate::memory) fn cpu_scope_events(_slot: i64) -> Result<(i64, i64), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn cpu_onednn_checks() -> Result<(bool, bool), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn generator_state(_device: Option<usize>) -> Result<Vec<u8>, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn set_generator_state(_device: Option<usize>, _state: &[u8]) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn cpu_capability() -> Result<String, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn grad_enabled() -> Option<bool> {
        None
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn clear_grad(_tensor: &tch::Tensor) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn backward(
        _tensors: &[&tch::Tensor],
        _grads: &[&tch::Tensor],
    ) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn storage_use(_tensor: &tch::Tensor) -> Result<(i64, i64), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn view_base(_tensor: &tch::Tensor) -> Result<Option<super::ViewBase>, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn autocast_state(_device_type: i32) -> Result<(bool, i32), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn tensor_facts(_tensor: &tch::Tensor) -> Result<super::RawTensorFacts, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn grad_defined(_tensor: &tch::Tensor) -> Result<bool, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    #[cfg(feature = "tch")]
    pub(in crate::memory) fn set_autocast(_: i32, _: bool, _: i32, _: i32) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
}

#[cfg(all(test, feature = "tch"))]
mod tests {
    #[cfg(toma_shim)]
    use super::*;
    #[cfg(toma_shim)]
    use crate::memory::try_cuda_allocator_stats;

    #[test]
    #[cfg(feature = "tch")]
    fn shim_is_built_with_tch() {
        #[cfg(not(toma_shim))]
        panic!("build.rs did not compile src/shim/toma_shim.cpp: see its cargo warnings");
        // Reaching libtorch through the shim links and answers, device or not.
        #[cfg(toma_shim)]
        {
            assert!(device_count().is_ok());
            assert!(matches!(
                try_cuda_allocator_stats(usize::MAX),
                Err(AllocatorError::BadDevice(_) | AllocatorError::NoCuda(_))
            ));
        }
    }

    #[test]
    #[cfg(toma_shim)]
    fn a_generator_state_set_back_replays_the_draws() {
        // Other tests of this binary draw from the same generator meanwhile: a few tries, and
        // one of them must replay the draw.
        let replayed = (0..5).any(|_| {
            let state = generator_state(None).expect("the CPU generator's state");
            assert!(!state.is_empty());
            let first = tch::Tensor::rand([64], (tch::Kind::Double, tch::Device::Cpu));
            set_generator_state(None, &state).expect("set back");
            let again = tch::Tensor::rand([64], (tch::Kind::Double, tch::Device::Cpu));
            let later = tch::Tensor::rand([64], (tch::Kind::Double, tch::Device::Cpu));
            first.equal(&again) && !first.equal(&later)
        });
        assert!(replayed, "a state set back did not replay the draws");
        // A state from something else is refused, not applied.
        assert!(set_generator_state(None, &[1, 2, 3]).is_err());
    }
}
