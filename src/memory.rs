//! Free memory of CUDA devices and of the CPU.
//!
//! CUDA figures come from the driver API, loaded at run time through cudarc (feature `cuda`):
//! a build needs no CUDA toolkit, and on a machine without a driver or device every probe
//! returns `None`, never a panic.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Free and total bytes of one CUDA device, as the driver reports them (`cuMemGetInfo`).
///
/// `free` is what the driver could still hand out. Memory that libtorch's caching allocator
/// holds in reserve counts as used here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes the driver could still allocate on the device.
    pub free: u64,
    /// Bytes of memory the device has.
    pub total: u64,
}

/// Free and total memory of CUDA device `device` (an ordinal, 0 for the first).
///
/// `None` when toma was built without the `cuda` feature, when no CUDA driver library can be
/// loaded, when the driver fails to initialise, or when there is no such device. Never panics.
/// The first call on a device retains its primary context (the one libtorch uses too).
///
/// ```
/// match toma::memory::cuda_memory(0) {
///     Some(m) => println!("GPU 0: {} of {} bytes free", m.free, m.total),
///     None => println!("no CUDA device 0"),
/// }
/// ```
pub fn cuda_memory(device: usize) -> Option<DeviceMemory> {
    cuda::memory(device)
}

/// Number of CUDA devices the driver sees; 0 without a driver (or without the `cuda` feature).
pub fn cuda_device_count() -> usize {
    cuda::device_count()
}

/// Bytes of CPU memory available to this process now; see
/// [`available_cpu_memory`](crate::cpu_memory::available_cpu_memory).
pub fn cpu_available() -> u64 {
    crate::cpu_memory::available_cpu_memory()
}

/// How old a free-memory reading used for cache keys may be.
const SNAPSHOT_MAX_AGE: Duration = Duration::from_secs(1);
const NO_READING: u64 = u64::MAX;

/// A free-memory reading shared by all threads, refreshed at most about once a second:
/// reading `/proc/meminfo` costs ~15 µs, too much for every call of a wrapped function.
struct Snapshot {
    /// Nanoseconds after `epoch()` when the reading was taken; 0 = never.
    taken_at: AtomicU64,
    cpu_free: AtomicU64,
    gpu_free: AtomicU64,
}

static SNAPSHOT: Snapshot = Snapshot {
    taken_at: AtomicU64::new(0),
    cpu_free: AtomicU64::new(NO_READING),
    gpu_free: AtomicU64::new(NO_READING),
};

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Free memory as used in cache keys: CPU available bytes, and GPU 0's free bytes when a
/// device is present. Up to about a second old.
pub(crate) fn free_memory_reading() -> (u64, Option<u64>) {
    let epoch = epoch();
    // +1 keeps "taken at the epoch" distinct from "never taken".
    let now = epoch.elapsed().as_nanos() as u64 + 1;
    let taken_at = SNAPSHOT.taken_at.load(Ordering::Acquire);
    if taken_at == 0 || now.saturating_sub(taken_at) > SNAPSHOT_MAX_AGE.as_nanos() as u64 {
        // Several threads may refresh at once; each stores a valid reading, so no lock.
        let cpu = cpu_available();
        let gpu = cuda_memory(0).map_or(NO_READING, |m| m.free);
        SNAPSHOT.cpu_free.store(cpu, Ordering::Relaxed);
        SNAPSHOT.gpu_free.store(gpu, Ordering::Relaxed);
        SNAPSHOT.taken_at.store(now, Ordering::Release);
        return (cpu, (gpu != NO_READING).then_some(gpu));
    }
    let cpu = SNAPSHOT.cpu_free.load(Ordering::Relaxed);
    let gpu = SNAPSHOT.gpu_free.load(Ordering::Relaxed);
    (cpu, (gpu != NO_READING).then_some(gpu))
}

/// Forgets the shared reading so that the next key takes a fresh one (tests, and after a cap
/// changes).
pub(crate) fn refresh_free_memory_reading() {
    SNAPSHOT.taken_at.store(0, Ordering::Release);
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::DeviceMemory;
    use cudarc::driver::sys;
    use std::sync::OnceLock;

    /// Whether the driver library loads and initialises; probed once, since a failed
    /// `dlopen` costs tens of microseconds and cudarc panics on a missing library.
    fn driver_ready() -> bool {
        static READY: OnceLock<bool> = OnceLock::new();
        *READY.get_or_init(|| {
            // SAFETY: only tries to dlopen the driver library; touches no symbol.
            if !unsafe { sys::is_culib_present() } {
                tracing::debug!("toma: no CUDA driver library; CUDA probes report None");
                return false;
            }
            // SAFETY: the library is present, so cudarc resolves cuInit from it.
            let ok = unsafe { sys::cuInit(0) } == sys::CUresult::CUDA_SUCCESS;
            if !ok {
                tracing::debug!("toma: cuInit failed; CUDA probes report None");
            }
            ok
        })
    }

    pub(super) fn device_count() -> usize {
        if !driver_ready() {
            return 0;
        }
        let mut count = 0;
        // SAFETY: the driver is initialised; the out-pointer is ours.
        if unsafe { sys::cuDeviceGetCount(&mut count) } != sys::CUresult::CUDA_SUCCESS {
            return 0;
        }
        count.max(0) as usize
    }

    /// The primary context of a device, retained once for the life of the process.
    fn primary_context(device: usize) -> Option<sys::CUcontext> {
        const MAX_DEVICES: usize = 64;
        // Contexts are stored as addresses: raw pointers are not Sync.
        static CONTEXTS: [OnceLock<Option<usize>>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
        if device >= MAX_DEVICES || device >= device_count() {
            return None;
        }
        let ctx = CONTEXTS[device].get_or_init(|| {
            let mut dev = 0;
            let mut ctx = std::ptr::null_mut();
            // SAFETY: the driver is initialised and `device` < device count.
            unsafe {
                if sys::cuDeviceGet(&mut dev, device as i32) != sys::CUresult::CUDA_SUCCESS {
                    return None;
                }
                if sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) != sys::CUresult::CUDA_SUCCESS {
                    return None;
                }
            }
            Some(ctx as usize)
        });
        ctx.map(|addr| addr as sys::CUcontext)
    }

    pub(super) fn memory(device: usize) -> Option<DeviceMemory> {
        let ctx = primary_context(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: `ctx` is a retained primary context. Push/pop leaves the thread's current
        // context as the caller had it.
        let ok = unsafe {
            if sys::cuCtxPushCurrent_v2(ctx) != sys::CUresult::CUDA_SUCCESS {
                return None;
            }
            let ok = sys::cuMemGetInfo_v2(&mut free, &mut total) == sys::CUresult::CUDA_SUCCESS;
            let mut popped = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut popped);
            ok
        };
        ok.then_some(DeviceMemory { free: free as u64, total: total as u64 })
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::DeviceMemory;

    pub(super) fn device_count() -> usize {
        0
    }
    pub(super) fn memory(_device: usize) -> Option<DeviceMemory> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_never_panic_and_agree() {
        let count = cuda_device_count();
        for device in 0..count {
            let m = cuda_memory(device).expect("a counted device reports memory");
            assert!(m.free <= m.total && m.total > 0, "{m:?}");
        }
        assert_eq!(cuda_memory(count), None);
        assert_eq!(cuda_memory(usize::MAX), None);
    }

    #[test]
    fn reading_is_reused_within_a_second() {
        refresh_free_memory_reading();
        let first = free_memory_reading();
        assert!(first.0 > 0);
        let taken = SNAPSHOT.taken_at.load(Ordering::Acquire);
        let second = free_memory_reading();
        // Taken well within a second of the first, so it is the same stored reading.
        assert_eq!(SNAPSHOT.taken_at.load(Ordering::Acquire), taken);
        assert_eq!(first, second);
        assert_eq!(first.1.is_some(), cuda_memory(0).is_some());
    }
}
