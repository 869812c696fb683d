//! The CUDA driver, loaded at run time through cudarc (feature `cuda`): free and total memory
//! of a device, the device count, and the facts the planner sizes kernels from. A build needs
//! no CUDA toolkit; without a driver or device every probe answers `None` or 0, never a panic.

use std::sync::OnceLock;

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
    driver::memory(device)
}

/// Number of CUDA devices the driver sees; 0 without a driver (or without the `cuda` feature).
pub fn cuda_device_count() -> usize {
    driver::device_count()
}

/// Streaming multiprocessors of CUDA device `device` and the most threads each keeps
/// resident, asked once per device: ATen's reduction kernels size their grids (and the staging
/// buffers the planner counts) from them. `None` without the `cuda` feature, driver or device.
#[cfg_attr(not(feature = "tch"), allow(dead_code))] // the lazy planner's, which needs tch
pub(crate) fn cuda_multiprocessors(device: usize) -> Option<(u32, u32)> {
    const DEVICES: usize = 64;
    static ANSWERS: [OnceLock<Option<(u32, u32)>>; DEVICES] = [const { OnceLock::new() }; DEVICES];
    match ANSWERS.get(device) {
        Some(answer) => *answer.get_or_init(|| driver::multiprocessors(device)),
        None => driver::multiprocessors(device),
    }
}

/// Whether this machine has the CUDA driver library (found by `dlopen`, not initialised);
/// false without the `cuda` feature.
pub(crate) fn cuda_driver_present() -> bool {
    driver::driver_present()
}

#[cfg(feature = "cuda")]
mod driver {
    use super::DeviceMemory;
    use cudarc::driver::sys;
    use std::sync::OnceLock;

    /// Whether the driver library can be loaded; probed once, since a failed `dlopen` costs
    /// tens of microseconds.
    pub(super) fn driver_present() -> bool {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        // SAFETY: only tries to dlopen the driver library; touches no symbol.
        *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
    }

    /// Whether the driver library loads and initialises; probed once, since cudarc panics on
    /// a missing library.
    fn driver_ready() -> bool {
        static READY: OnceLock<bool> = OnceLock::new();
        *READY.get_or_init(|| {
            if !driver_present() {
                // Expected on every machine without a GPU: trace, not debug.
                tracing::trace!("toma: no CUDA driver library; CUDA probes report None");
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

    /// Streaming multiprocessors and the most resident threads on each (`cuDeviceGetAttribute`).
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(super) fn multiprocessors(device: usize) -> Option<(u32, u32)> {
        if device >= device_count() {
            return None;
        }
        let attribute = |attr: sys::CUdevice_attribute| {
            let (mut dev, mut value) = (0, 0);
            // SAFETY: the driver is initialised and `device` < device count; out-pointers are ours.
            let ok = unsafe {
                sys::cuDeviceGet(&mut dev, device as i32) == sys::CUresult::CUDA_SUCCESS
                    && sys::cuDeviceGetAttribute(&mut value, attr, dev) == sys::CUresult::CUDA_SUCCESS
            };
            (ok && value > 0).then_some(value as u32)
        };
        use sys::CUdevice_attribute::*;
        Some((
            attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?,
        ))
    }
}

#[cfg(not(feature = "cuda"))]
mod driver {
    use super::DeviceMemory;

    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(super) fn multiprocessors(_device: usize) -> Option<(u32, u32)> {
        None
    }

    pub(super) fn device_count() -> usize {
        0
    }
    pub(super) fn driver_present() -> bool {
        false
    }
    pub(super) fn memory(_device: usize) -> Option<DeviceMemory> {
        None
    }
}
