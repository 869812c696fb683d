//! Mixed precision on the CPU and on CUDA: a region where libtorch's autocast runs products and
//! convolutions in `BFloat16` or `Half`, for plain tensors and lazy graphs alike.
//!
//! tch 0.24's `tch::autocast(enabled, f)` covers CUDA in `Half` only. [`autocast`] takes the
//! device and the kind: `BFloat16` or `Half` on the CPU and on CUDA. Inside the region:
//!
//! - **plain tensors** go through libtorch's own autocast (its per-device lists of ops cast to
//!   the lower precision, kept in `f32`, or promoted; its cache of cast weights);
//! - **lazy values** record the casts libtorch would insert as ops of the graph, from the same
//!   lists ([`crate::lazy`]'s module docs: "Mixed precision"). The graph runs later, at
//!   `backward()`, usually after the region has closed: with the casts in it, it computes what
//!   eager autocast computes, and the plan counts the 16-bit copies that autograd saves.
//!
//! ```
//! use tch::{Device, Kind, Tensor};
//!
//! let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
//! let w = Tensor::randn([8, 8], (Kind::Float, Device::Cpu));
//! let y = toma::autocast(Device::Cpu, Kind::BFloat16, || x.matmul(&w));
//! assert_eq!(y.kind(), Kind::BFloat16);
//! assert_eq!(x.matmul(&w).kind(), Kind::Float, "outside the region, as before");
//! ```
//!
//! A region inside another of the same device replaces its kind until it ends. Regions are
//! per thread, as libtorch's are.

use std::cell::Cell;

use tch::{Device, Kind};

use crate::memory::AllocatorError;

/// Why a region could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AutocastError {
    /// Autocast lowers to `BFloat16` or `Half` only.
    #[error("toma::autocast: {kind:?} is not a lower precision autocast runs in; use Kind::BFloat16 or Kind::Half")]
    Kind {
        /// The kind asked for.
        kind: Kind,
    },
    /// Devices other than the CPU and CUDA have no autocast here.
    #[error("toma::autocast: no autocast for {device:?}; the CPU and CUDA have one")]
    Device {
        /// The device asked for.
        device: Device,
    },
    /// libtorch's autocast could not be set (the shim did not build: see the build's warnings).
    #[error("toma::autocast: libtorch's autocast state could not be set: {0}")]
    Shim(#[from] AllocatorError),
}

/// The devices autocast distinguishes, as libtorch does: by type, not ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum DeviceType {
    Cpu,
    Cuda,
}

impl DeviceType {
    pub(crate) fn of(device: Device) -> Option<DeviceType> {
        match device {
            Device::Cpu => Some(DeviceType::Cpu),
            Device::Cuda(_) => Some(DeviceType::Cuda),
            _ => None,
        }
    }

    /// c10's `DeviceType` number.
    fn c10(self) -> i32 {
        match self {
            DeviceType::Cpu => 0,
            DeviceType::Cuda => 1,
        }
    }

    fn slot(self) -> usize {
        self as usize
    }
}

/// c10's `ScalarType` numbers of the kinds autocast uses.
fn c10_kind(kind: Kind) -> Option<i32> {
    match kind {
        Kind::Half => Some(5),
        Kind::Float => Some(6),
        Kind::BFloat16 => Some(15),
        _ => None,
    }
}

fn kind_of_c10(n: i32) -> Option<Kind> {
    match n {
        5 => Some(Kind::Half),
        15 => Some(Kind::BFloat16),
        _ => None,
    }
}

thread_local! {
    /// The kind of this thread's open region, per device type (`None`: none open).
    static REGIONS: Cell<[Option<Kind>; 2]> = const { Cell::new([None, None]) };
}

/// The lower precision lazy ops record their casts for on `device`: toma's open region, else
/// libtorch's own state where something else enabled it (tch's `tch::autocast` on CUDA).
pub(crate) fn active(device: Device) -> Option<Kind> {
    let t = DeviceType::of(device)?;
    region(t).or_else(|| opened_by_tch(t))
}

/// toma's open region on `device`, if any: a thread-local read.
pub(crate) fn region(device: DeviceType) -> Option<Kind> {
    REGIONS.with(|r| r.get()[device.slot()])
}

/// A CUDA region that tch's own `tch::autocast` opened (libtorch's state; a call into it).
pub(crate) fn opened_by_tch(device: DeviceType) -> Option<Kind> {
    if device != DeviceType::Cuda {
        return None;
    }
    match crate::memory::autocast_state(device.c10()) {
        Ok((true, dtype)) => kind_of_c10(dtype),
        _ => None,
    }
}

/// An open autocast region; it closes when dropped, restoring what was before. Not `Send`:
/// regions are per thread.
#[derive(Debug)]
#[must_use = "the region closes when the guard is dropped"]
pub struct AutocastGuard {
    device: DeviceType,
    before: Option<Kind>,
    libtorch_before: (bool, i32),
    _not_send: std::marker::PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Opens a region on `device`'s type in `kind` (`BFloat16` or `Half`).
    ///
    /// # Errors
    /// [`AutocastError::Kind`] or [`AutocastError::Device`] for what autocast does not do;
    /// [`AutocastError::Shim`] when libtorch's state cannot be set.
    pub fn new(device: Device, kind: Kind) -> Result<AutocastGuard, AutocastError> {
        let t = DeviceType::of(device).ok_or(AutocastError::Device { device })?;
        let dtype = c10_kind(kind).filter(|_| matches!(kind, Kind::BFloat16 | Kind::Half));
        let dtype = dtype.ok_or(AutocastError::Kind { kind })?;
        let libtorch_before = crate::memory::autocast_state(t.c10())?;
        crate::memory::set_autocast(t.c10(), true, dtype, 1)?;
        let before = REGIONS.with(|r| {
            let mut all = r.get();
            let before = all[t.slot()].replace(kind);
            r.set(all);
            before
        });
        tracing::debug!(device = ?t, ?kind, "toma::autocast: region opens");
        Ok(AutocastGuard { device: t, before, libtorch_before, _not_send: std::marker::PhantomData })
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        REGIONS.with(|r| {
            let mut all = r.get();
            all[self.device.slot()] = self.before;
            r.set(all);
        });
        let (enabled, dtype) = self.libtorch_before;
        // Nothing to report to from a drop; the state was set when the region opened.
        let _ = crate::memory::set_autocast(self.device.c10(), enabled, dtype, -1);
    }
}

/// Runs `f` in an autocast region of `device`'s type in `kind`: libtorch's autocast for plain
/// tensors, recorded casts for lazy values (see the [module docs](self)).
///
/// # Panics
/// When the region cannot open ([`AutocastGuard::new`]'s errors: a kind other than
/// `BFloat16` or `Half`, a device other than the CPU or CUDA, a shim that did not build).
#[track_caller]
pub fn autocast<R>(device: Device, kind: Kind, f: impl FnOnce() -> R) -> R {
    let _guard = AutocastGuard::new(device, kind).unwrap_or_else(|err| panic!("{err}"));
    f()
}

/// Disables libtorch's autocast for both device types while a lazy graph runs, restoring it
/// after: the graph carries its casts as ops, so a run inside a region must not cast again.
pub(crate) struct Suspended {
    before: [(bool, i32); 2],
}

impl Suspended {
    pub(crate) fn new() -> Option<Suspended> {
        let cpu = crate::memory::autocast_state(0).ok()?;
        let cuda = crate::memory::autocast_state(1).ok()?;
        if !cpu.0 && !cuda.0 {
            return None;
        }
        for (t, (_, dtype)) in [(0, cpu), (1, cuda)] {
            let _ = crate::memory::set_autocast(t, false, dtype, 0);
        }
        Some(Suspended { before: [cpu, cuda] })
    }
}

impl Drop for Suspended {
    fn drop(&mut self) {
        for (t, (enabled, dtype)) in self.before.into_iter().enumerate() {
            let _ = crate::memory::set_autocast(t as i32, enabled, dtype, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_devices_autocast_does_not_do_are_errors() {
        let err = AutocastGuard::new(Device::Cpu, Kind::Float).unwrap_err();
        assert!(matches!(err, AutocastError::Kind { kind: Kind::Float }), "{err}");
        assert!(err.to_string().contains("Kind::BFloat16"), "{err}");
        let err = AutocastGuard::new(Device::Mps, Kind::Half).unwrap_err();
        assert!(matches!(err, AutocastError::Device { .. }), "{err}");
    }

    /// tch's own `tch::autocast` enables libtorch's CUDA autocast in `Half` (on a machine with
    /// CUDA; elsewhere it does nothing): lazy recording on CUDA reads that state. Set here as
    /// tch sets it (a thread-local flag: no device needed).
    #[test]
    fn a_cuda_region_opened_outside_toma_is_read() {
        assert_eq!(active(Device::Cuda(0)), None);
        let before = crate::memory::autocast_state(1).unwrap();
        crate::memory::set_autocast(1, true, 5, 0).unwrap();
        assert_eq!(active(Device::Cuda(0)), Some(Kind::Half));
        assert_eq!(active(Device::Cpu), None, "that region is CUDA's only");
        crate::memory::set_autocast(1, before.0, before.1, 0).unwrap();
        assert_eq!(active(Device::Cuda(0)), None);
    }

    #[test]
    fn regions_nest_and_restore() {
        assert_eq!(active(Device::Cpu), None);
        {
            let _outer = AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
            assert_eq!(active(Device::Cpu), Some(Kind::BFloat16));
            assert_eq!(crate::memory::autocast_state(0).unwrap(), (true, 15));
            {
                let _inner = AutocastGuard::new(Device::Cpu, Kind::Half).unwrap();
                assert_eq!(active(Device::Cpu), Some(Kind::Half));
            }
            assert_eq!(active(Device::Cpu), Some(Kind::BFloat16));
            assert_eq!(crate::memory::autocast_state(0).unwrap(), (true, 15));
        }
        assert_eq!(active(Device::Cpu), None);
        assert!(!crate::memory::autocast_state(0).unwrap().0, "libtorch's CPU autocast is off again");
    }
}
