//! libtorch's own allocators, through the native shim (`src/shim`, feature `tch`): the CUDA
//! caching allocator's figures, peak and cache, and a counting wrapper around the CPU
//! allocator. Without the shim, or without CUDA in libtorch, these report `None` or `false`.

use std::sync::OnceLock;

use super::cuda::{cuda_device_count, cuda_memory};

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
    torch::stats(device)
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

/// Figures of libtorch's CPU allocations, counted by [`track_cpu_allocations`]'s wrapper
/// (libtorch's CPU allocator keeps none). There is no cache on the CPU: freed bytes go back
/// at once.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuAllocatorStats {
    /// Bytes in live allocations made since tracking began.
    pub allocated: u64,
    /// The most `allocated` has been since tracking began or [`reset_cpu_peak`].
    pub peak_allocated: u64,
    /// Allocations made since tracking began.
    pub allocations: u64,
}

/// Starts counting libtorch's CPU allocations: wraps its CPU allocator in one that keeps
/// bytes in use and their peak, for [`cpu_allocator_stats`] (what [`cuda_allocator_stats`]
/// gives for CUDA). Once per process; later calls do nothing. Allocations made before the
/// first call are not counted, and neither are their frees.
///
/// Call it early, before other threads allocate tensors: libtorch's switch of allocator is not
/// synchronised. Each CPU allocation then also takes one of 16 shard locks and a hash-table
/// entry (measured +0.8 µs per `Tensor::empty` + drop in a debug build, against 1.0 µs): a
/// tool for measuring, not for hot loops of tiny tensors. `false` without feature `tch` or
/// when libtorch fails (logged).
///
/// With `TOMA_TRACE_CPU_ALLOCATIONS` set when it is first called, every counted allocation and
/// release is also printed to stderr (`toma-alloc +bytes` / `toma-alloc -bytes`): a developer's
/// tool for reading what a kernel allocates.
///
/// ```
/// # #[cfg(feature = "tch")] {
/// if toma::memory::track_cpu_allocations() {
///     toma::memory::reset_cpu_peak();
///     let before = toma::memory::cpu_allocator_stats().unwrap().allocated;
///     let t = tch::Tensor::zeros([1024], (tch::Kind::Float, tch::Device::Cpu));
///     let peak = toma::memory::cpu_allocator_stats().unwrap().peak_allocated;
///     assert!(peak >= before + 4096);
///     drop(t);
/// }
/// # }
/// ```
pub fn track_cpu_allocations() -> bool {
    torch::cpu_track().map_err(|err| err.log("counting CPU allocations")).is_ok()
}

/// The counts of [`track_cpu_allocations`]; `None` before it (or where it returned `false`).
pub fn cpu_allocator_stats() -> Option<CpuAllocatorStats> {
    torch::cpu_stats().map_err(|err| err.log("CPU allocator statistics")).ok()
}

/// Resets the CPU peak of [`cpu_allocator_stats`] to the bytes in use now. `false` before
/// [`track_cpu_allocations`].
pub fn reset_cpu_peak() -> bool {
    torch::cpu_reset_peak().map_err(|err| err.log("resetting the CPU peak")).is_ok()
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
        (0..devices).filter_map(|d| torch::stats(d).ok()).fold((0u64, 0u64), |(reserved, cached), s| {
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

/// The allocator counter that measures one attempt's peak, for reports: the CUDA device the
/// work runs on, or libtorch's CPU allocator when [`track_cpu_allocations`] is on. Quiet:
/// no counter is no measurement, not a warning.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PeakCounter {
    Cpu,
    Cuda(usize),
}

impl PeakCounter {
    /// The counter for work on `device` (`None`: the CPU), if one can be read.
    pub(crate) fn for_device(device: Option<usize>) -> Option<PeakCounter> {
        match device {
            Some(d) => torch::stats(d).is_ok().then_some(PeakCounter::Cuda(d)),
            None => torch::cpu_stats().is_ok().then_some(PeakCounter::Cpu),
        }
    }

    /// Starts measuring: resets the peak to what is in use now. Returns what is in use, and
    /// the peak before the reset (for [`end`](Self::end)).
    pub(crate) fn start(self) -> Option<(u64, u64)> {
        match self {
            PeakCounter::Cpu => {
                let before = torch::cpu_stats().ok()?;
                torch::cpu_reset_peak().ok()?;
                Some((before.allocated, before.peak_allocated))
            }
            PeakCounter::Cuda(d) => {
                let before = torch::stats(d).ok()?;
                torch::reset_peak(d).ok()?;
                Some((before.allocated, before.peak_allocated))
            }
        }
    }

    /// The peak since [`start`](Self::start).
    pub(crate) fn peak(self) -> Option<u64> {
        match self {
            PeakCounter::Cpu => torch::cpu_stats().ok().map(|s| s.peak_allocated),
            PeakCounter::Cuda(d) => torch::stats(d).ok().map(|s| s.peak_allocated),
        }
    }

    /// Ends a measurement: gives the counter back the peak it had before [`start`](Self::start)
    /// if that was higher, so that a measurement around this one (an `auto` chunk whose body
    /// runs a lazy step) still sees it. On the CPU only: libtorch's CUDA peaks can be reset,
    /// not raised.
    pub(crate) fn end(self, previous_peak: u64) {
        if let PeakCounter::Cpu = self {
            let _ = torch::cpu_raise_peak(previous_peak);
        }
    }

    /// The bytes the work could still take: [`cuda_usable_memory`], or on the CPU
    /// [`available_cpu_memory`](crate::cpu_memory::available_cpu_memory).
    pub(crate) fn available(self) -> Option<u64> {
        match self {
            PeakCounter::Cpu => Some(crate::memory::cpu::available_cpu_memory()),
            PeakCounter::Cuda(d) => cuda_usable_memory(d),
        }
    }
}

/// libtorch's CUDA device count, asked once: libtorch fixes it at its first answer too.
pub(crate) fn torch_device_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| torch::device_count().map_err(|err| err.log("counting CUDA devices")).unwrap_or(0))
}

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
    /// CPU figures were asked for before [`track_cpu_allocations`].
    #[error("CPU allocations are not counted: call toma::memory::track_cpu_allocations first")]
    NotTracking,
    /// libtorch threw; its message.
    #[error("libtorch failed: {0}")]
    Torch(String),
}

impl AllocatorError {
    /// Reports the error: expected absences at debug level, libtorch's failures as warnings.
    fn log(self, doing: &str) {
        match self {
            AllocatorError::Torch(_) => tracing::warn!(error = %self, "toma: {doing}"),
            _ => tracing::debug!(error = %self, "toma: {doing}"),
        }
    }
}

/// The shim's C interface (`src/shim/toma_shim.h`).
#[cfg(toma_shim)]
mod torch {
    use super::{AllocatorError, AllocatorStats, CpuAllocatorStats};
    use std::ffi::{c_char, c_int, CStr};

    const OK: c_int = 0;
    const NO_CUDA: c_int = 1;
    const BAD_DEVICE: c_int = 2;
    const NOT_TRACKING: c_int = 4;

    /// `toma_shim_cpu_counts`.
    #[repr(C)]
    #[derive(Default)]
    struct RawCpuStats {
        allocated: i64,
        peak_allocated: i64,
        allocations: i64,
    }

    /// `toma_shim_allocator_stats`.
    #[repr(C)]
    #[derive(Default)]
    struct RawStats {
        allocated: i64,
        reserved: i64,
        peak_allocated: i64,
        peak_reserved: i64,
        alloc_retries: i64,
        ooms: i64,
        initialized: i32,
    }

    extern "C" {
        fn toma_shim_cuda_device_count(count: *mut i64) -> c_int;
        fn toma_shim_cuda_current_device(device: *mut i64) -> c_int;
        fn toma_shim_cuda_allocator_stats(device: i64, stats: *mut RawStats) -> c_int;
        fn toma_shim_cuda_reset_peak(device: i64) -> c_int;
        fn toma_shim_cuda_empty_cache() -> c_int;
        fn toma_shim_cpu_track() -> c_int;
        fn toma_shim_cpu_stats(stats: *mut RawCpuStats) -> c_int;
        fn toma_shim_cpu_reset_peak() -> c_int;
        fn toma_shim_cpu_raise_peak(value: i64) -> c_int;
        fn toma_shim_last_error() -> *const c_char;
    }

    fn check(code: c_int, device: usize) -> Result<(), AllocatorError> {
        if code == OK {
            return Ok(());
        }
        // SAFETY: the shim returns a NUL-terminated string owned by this thread, valid until
        // its next call on this thread; it is copied out at once.
        let message = unsafe { CStr::from_ptr(toma_shim_last_error()) }.to_string_lossy().into_owned();
        Err(match code {
            NO_CUDA => AllocatorError::NoCuda(message),
            BAD_DEVICE => AllocatorError::BadDevice(device),
            NOT_TRACKING => AllocatorError::NotTracking,
            _ => AllocatorError::Torch(message),
        })
    }

    /// libtorch's ordinal for `device`, or `BadDevice` when it cannot be one.
    fn index(device: usize) -> Result<i64, AllocatorError> {
        i64::try_from(device).map_err(|_| AllocatorError::BadDevice(device))
    }

    fn bytes(value: i64) -> u64 {
        u64::try_from(value).unwrap_or(0)
    }

    pub(super) fn device_count() -> Result<usize, AllocatorError> {
        let mut count = 0;
        // SAFETY: the shim catches every C++ exception; the out-pointer is ours.
        check(unsafe { toma_shim_cuda_device_count(&mut count) }, 0)?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    pub(super) fn current_device() -> Result<usize, AllocatorError> {
        let mut device = -1;
        // SAFETY: as above.
        check(unsafe { toma_shim_cuda_current_device(&mut device) }, 0)?;
        usize::try_from(device).map_err(|_| AllocatorError::NoCuda(format!("libtorch's current device is {device}")))
    }

    pub(super) fn stats(device: usize) -> Result<AllocatorStats, AllocatorError> {
        let mut raw = RawStats::default();
        // SAFETY: as above; `raw` has the C struct's layout.
        check(unsafe { toma_shim_cuda_allocator_stats(index(device)?, &mut raw) }, device)?;
        Ok(AllocatorStats {
            allocated: bytes(raw.allocated),
            reserved: bytes(raw.reserved),
            peak_allocated: bytes(raw.peak_allocated),
            peak_reserved: bytes(raw.peak_reserved),
            alloc_retries: bytes(raw.alloc_retries),
            ooms: bytes(raw.ooms),
        })
    }

    pub(super) fn reset_peak(device: usize) -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cuda_reset_peak(index(device)?) }, device)
    }

    pub(super) fn empty_cache() -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cuda_empty_cache() }, 0)
    }

    pub(super) fn cpu_track() -> Result<(), AllocatorError> {
        // SAFETY: as above; the shim installs the counter once, under a once-flag.
        check(unsafe { toma_shim_cpu_track() }, 0)
    }

    pub(super) fn cpu_stats() -> Result<CpuAllocatorStats, AllocatorError> {
        let mut raw = RawCpuStats::default();
        // SAFETY: as above; `raw` has the C struct's layout.
        check(unsafe { toma_shim_cpu_stats(&mut raw) }, 0)?;
        Ok(CpuAllocatorStats {
            allocated: bytes(raw.allocated),
            peak_allocated: bytes(raw.peak_allocated),
            allocations: bytes(raw.allocations),
        })
    }

    pub(super) fn cpu_reset_peak() -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cpu_reset_peak() }, 0)
    }

    pub(super) fn cpu_raise_peak(value: u64) -> Result<(), AllocatorError> {
        // SAFETY: as above.
        check(unsafe { toma_shim_cpu_raise_peak(value as i64) }, 0)
    }
}

/// No shim: built without feature `tch`, or its compile failed (a build warning said so).
#[cfg(not(toma_shim))]
mod torch {
    use super::{AllocatorError, AllocatorStats, CpuAllocatorStats};

    pub(super) fn device_count() -> Result<usize, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(super) fn current_device() -> Result<usize, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(super) fn stats(_device: usize) -> Result<AllocatorStats, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(super) fn reset_peak(_device: usize) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(super) fn empty_cache() -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(super) fn cpu_track() -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(super) fn cpu_stats() -> Result<CpuAllocatorStats, AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
    pub(super) fn cpu_reset_peak() -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }

    pub(super) fn cpu_raise_peak(_value: u64) -> Result<(), AllocatorError> {
        Err(AllocatorError::NotBuilt)
    }
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

    /// The allocator functions agree with libtorch's device count, and on a machine without
    /// CUDA (CI) they all say "nothing" without panicking.
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

    /// With feature `tch` the shim must really be built and linked: build.rs only warns when
    /// it fails to compile, and this is what turns that warning into a failure in CI.
    #[test]
    #[cfg(feature = "tch")]
    fn shim_is_built_with_tch() {
        #[cfg(not(toma_shim))]
        panic!("build.rs did not compile src/shim/toma_shim.cpp: see its cargo warnings");
        // Reaching libtorch through the shim links and answers, device or not.
        #[cfg(toma_shim)]
        {
            assert!(torch::device_count().is_ok());
            assert!(matches!(
                try_cuda_allocator_stats(usize::MAX),
                Err(AllocatorError::BadDevice(_) | AllocatorError::NoCuda(_))
            ));
        }
    }

    /// This binary never calls `track_cpu_allocations` (tests/lazy_peak.rs does, alone): the
    /// CPU figures are absent until it is called, and say why.
    #[test]
    fn cpu_figures_need_tracking() {
        assert_eq!(cpu_allocator_stats(), None);
        assert!(!reset_cpu_peak());
        let expected = if cfg!(toma_shim) { AllocatorError::NotTracking } else { AllocatorError::NotBuilt };
        assert_eq!(torch::cpu_stats().unwrap_err(), expected);
    }

    #[test]
    fn cached_is_reserved_less_allocated() {
        let stats = AllocatorStats { allocated: 3, reserved: 10, ..AllocatorStats::default() };
        assert_eq!(stats.cached(), 7);
        assert_eq!(AllocatorStats { allocated: 5, reserved: 4, ..stats }.cached(), 0);
    }
}
