//! libtorch's CUDA caching allocator, through the native shim (`src/shim`, feature `tch`):
//! its figures, peak and cache, and the bytes a tensor could still get. Without the shim, or
//! without CUDA in libtorch, these report `None` or `false`.

use std::sync::OnceLock;

use super::cuda::{cuda_device_count, cuda_memory};
use super::shim::{self as torch, bytes, AllocatorError, RawStats};

/// Figures of libtorch's CUDA caching allocator for one device (`torch.cuda.memory_stats`),
/// summed over its small and large pools.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Bytes in live tensors (`torch.cuda.memory_allocated`).
    pub allocated: u64,
    /// Bytes the allocator holds from the driver, in use or cached
    /// (`torch.cuda.memory_reserved`).
    pub reserved: u64,
    /// The most `allocated` has been since the process started or [`reset_cuda_peak`].
    pub peak_allocated: u64,
    /// The most `reserved` has been since the process started or [`reset_cuda_peak`].
    pub peak_reserved: u64,
    /// Times a driver allocation failed and the allocator recovered by freeing its cache.
    pub alloc_retries: u64,
    /// Out-of-memory errors the allocator raised.
    pub ooms: u64,
}

impl AllocatorStats {
    /// Bytes held from the driver without a tensor in them: `reserved − allocated`.
    pub fn cached(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }
}

/// libtorch's caching-allocator figures for CUDA device `device` (libtorch's ordinal).
///
/// All zero before libtorch's first CUDA allocation. `None` without feature `tch`, when the
/// libtorch in use has no CUDA support loaded (a CPU build, or a binary whose linker dropped
/// `libtorch_cuda`), when it sees no such device, or when libtorch fails (logged as a
/// `tracing` warning). Never panics.
///
/// ```
/// match toma::memory::cuda_allocator_stats(0) {
///     Some(s) => println!("GPU 0: {} bytes in tensors, {} cached", s.allocated, s.cached()),
///     None => println!("libtorch has no CUDA device 0"),
/// }
/// ```
pub fn cuda_allocator_stats(device: usize) -> Option<AllocatorStats> {
    try_cuda_allocator_stats(device).map_err(|err| err.log("allocator statistics")).ok()
}

/// As [`cuda_allocator_stats`], saying why there are none.
///
/// # Errors
/// [`AllocatorError::NotBuilt`] without feature `tch`; [`AllocatorError::NoCuda`] when the
/// libtorch in use has no CUDA support loaded or sees no device; [`AllocatorError::BadDevice`]
/// for an ordinal libtorch does not have; [`AllocatorError::Torch`] when libtorch throws.
pub fn try_cuda_allocator_stats(device: usize) -> Result<AllocatorStats, AllocatorError> {
    torch::stats(device).map(AllocatorStats::from)
}

impl From<RawStats> for AllocatorStats {
    fn from(raw: RawStats) -> Self {
        AllocatorStats {
            allocated: bytes(raw.allocated),
            reserved: bytes(raw.reserved),
            peak_allocated: bytes(raw.peak_allocated),
            peak_reserved: bytes(raw.peak_reserved),
            alloc_retries: bytes(raw.alloc_retries),
            ooms: bytes(raw.ooms),
        }
    }
}

/// Resets the peaks of [`cuda_allocator_stats`] for `device` to the current figures
/// (`torch.cuda.reset_peak_memory_stats`). `false` where [`cuda_allocator_stats`] is `None`.
pub fn reset_cuda_peak(device: usize) -> bool {
    torch::reset_peak(device).map_err(|err| err.log("resetting the peak")).is_ok()
}

/// Hands the blocks libtorch's CUDA allocator caches without a tensor in them back to the
/// driver, on every device (`torch.cuda.empty_cache`), so that other processes and
/// non-libtorch allocations can have them. Waits for the devices' pending work first.
///
/// `true` when libtorch has a CUDA device (emptying a cache that holds nothing is a success);
/// `false` without feature `tch`, without CUDA in libtorch, or when libtorch fails.
pub fn empty_cuda_cache() -> bool {
    torch::empty_cache().map_err(|err| err.log("emptying the cache")).is_ok()
}

/// For the retry engine, between attempts after an out-of-memory: empties libtorch's CUDA
/// cache ([`empty_cuda_cache`]) when it holds any unused bytes, and returns how many bytes it
/// gave back to the driver (over all devices). `0`, at once and without touching a device,
/// when libtorch has no CUDA device or nothing is cached.
///
/// libtorch already frees its cache before it reports an out-of-memory; emptying it between
/// attempts also returns the blocks split for the failed attempt's sizes, so that the next,
/// smaller attempt starts from unfragmented memory, as Python toma does.
pub fn release_cached_blocks() -> u64 {
    let devices = torch_device_count();
    if devices == 0 {
        return 0;
    }
    let totals = || {
        (0..devices).filter_map(|d| try_cuda_allocator_stats(d).ok()).fold((0u64, 0u64), |(reserved, cached), s| {
            (reserved.saturating_add(s.reserved), cached.saturating_add(s.cached()))
        })
    };
    let (before, cached) = totals();
    if cached == 0 {
        return 0;
    }
    if let Err(err) = torch::empty_cache() {
        err.log("emptying the cache between retries");
        return 0;
    }
    let released = before.saturating_sub(totals().0);
    tracing::debug!(cached_bytes = cached, released_bytes = released, "toma: emptied libtorch's CUDA cache");
    released
}

/// libtorch's current CUDA device on this thread (CUDA's thread-local current device; tch never
/// changes it, so 0 unless other code did). `None` where [`cuda_allocator_stats`] would be.
///
/// Cheap enough for every call of a wrapped function: one atomic load without a device, one
/// `cudaGetDevice` with one.
pub fn cuda_current_device() -> Option<usize> {
    if torch_device_count() == 0 {
        return None;
    }
    torch::current_device().map_err(|err| err.log("reading the current device")).ok()
}

/// The CUDA device that work without a stated device runs on, for cache keys: libtorch's
/// current one, or device 0 where the driver sees devices but libtorch's cannot be asked
/// (built without `tch`, or its shim did not compile).
pub(crate) fn work_device() -> Option<usize> {
    static DRIVER_DEVICES: OnceLock<bool> = OnceLock::new();
    cuda_current_device().or_else(|| DRIVER_DEVICES.get_or_init(|| cuda_device_count() > 0).then_some(0))
}

/// libtorch's CUDA device count, asked once: libtorch fixes it at its first answer too.
pub(crate) fn torch_device_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| torch::device_count().map_err(|err| err.log("counting CUDA devices")).unwrap_or(0))
}

/// Bytes a tensor on CUDA device `device` could get now: the driver's free bytes plus the
/// bytes libtorch's caching allocator holds without a tensor in them (reserved − allocated),
/// which libtorch hands out first and frees itself before it reports an out-of-memory.
///
/// This is the figure toma's cache keys use: it stays put while libtorch caches what a call
/// freed, where the driver's free bytes drop. It can overstate by the cached blocks too
/// fragmented for one large request. `None` when [`cuda_memory`] is `None` (no `cuda` feature,
/// driver or device); the driver's free bytes alone when libtorch's allocator cannot be read
/// (no `tch` feature, or a libtorch without CUDA).
///
/// ```
/// if let Some(bytes) = toma::memory::cuda_usable_memory(0) {
///     println!("GPU 0: {bytes} bytes usable by libtorch");
/// }
/// ```
pub fn cuda_usable_memory(device: usize) -> Option<u64> {
    let driver = cuda_memory(device)?;
    let cached = cuda_allocator_stats(device).map_or(0, |stats| stats.cached());
    Some(driver.free.saturating_add(cached).min(driver.total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::free_memory_reading_for;

    #[test]
    fn probes_never_panic_and_agree() {
        let count = cuda_device_count();
        for device in 0..count {
            let m = cuda_memory(device).expect("a counted device reports memory");
            assert!(m.free <= m.total && m.total > 0, "{m:?}");
            let usable = cuda_usable_memory(device).expect("a counted device reports usable memory");
            assert!(m.free <= usable && usable <= m.total, "{usable} outside [{}, {}]", m.free, m.total);
        }
        assert_eq!(cuda_memory(count), None);
        assert_eq!(cuda_memory(usize::MAX), None);
        assert_eq!(cuda_usable_memory(count), None);
    }

    #[test]
    fn allocator_functions_answer_none_without_a_device() {
        let torch_devices = torch::device_count().unwrap_or(0);
        if cuda_device_count() == 0 && torch_devices == 0 {
            match try_cuda_allocator_stats(0) {
                Err(AllocatorError::NoCuda(why)) if cfg!(feature = "tch") => println!("no CUDA: {why}"),
                Err(AllocatorError::NotBuilt) if !cfg!(feature = "tch") => {}
                other => panic!("expected no CUDA, got {other:?}"),
            }
            assert_eq!(cuda_allocator_stats(0), None);
            assert_eq!(cuda_allocator_stats(usize::MAX), None);
            assert!(!reset_cuda_peak(0));
            assert!(!empty_cuda_cache());
            assert_eq!(release_cached_blocks(), 0);
            assert_eq!(cuda_current_device(), None);
            assert_eq!(cuda_usable_memory(0), None);
            assert_eq!(free_memory_reading_for(Some(0)).1, None);
            return;
        }
        for device in 0..torch_devices {
            let stats = cuda_allocator_stats(device).expect("libtorch's device has statistics");
            assert!(stats.allocated <= stats.reserved && stats.allocated <= stats.peak_allocated, "{stats:?}");
            assert!(reset_cuda_peak(device));
        }
        assert_eq!(cuda_allocator_stats(torch_devices), None);
        assert!(!reset_cuda_peak(torch_devices));
        assert_eq!(cuda_allocator_stats(usize::MAX), None);
        assert!(cuda_current_device().is_some_and(|d| d < torch_devices) || torch_devices == 0);
    }

    #[test]
    fn cached_is_reserved_less_allocated() {
        let stats = AllocatorStats { allocated: 3, reserved: 10, ..AllocatorStats::default() };
        assert_eq!(stats.cached(), 7);
        assert_eq!(AllocatorStats { allocated: 5, reserved: 4, ..stats }.cached(), 0);
    }
}
