//! The counter that measures one attempt's peak: libtorch's CUDA caching allocator, or the
//! counting CPU allocator.

use super::cuda_allocator::cuda_usable_memory;
use super::shim::{self as torch, bytes};

/// The allocator counter that measures one attempt's peak, for reports: the CUDA device the
/// work runs on, or libtorch's CPU allocator when [`track_cpu_allocations`] is on. Quiet:
/// no counter is no measurement, not a warning.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "tch"), allow(dead_code))]
pub(crate) enum PeakCounter {
    Cpu,
    /// The process's CPU count, read by a thread that knows whether another thread's work
    /// reached it ([`interfered`](Self::interfered); [`OwnCount`] holds the scope).
    Thread(i64),
    /// The calling thread's own CPU count: what it allocates and frees, from what was in use when
    /// it began. Never reached by another thread, nor by the workers of its own parallel ops.
    ThreadOwn(i64),
    Cuda(usize),
}

/// A thread's own CPU count while it lives: measurements through it see what this thread's work
/// allocates and frees, never another thread's. Ended on drop.
#[derive(Debug)]
#[cfg_attr(not(feature = "tch"), allow(dead_code))]
pub(crate) struct OwnCount {
    slot: i64,
    // The scope belongs to the thread that began it.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Drop for OwnCount {
    fn drop(&mut self) {
        torch::cpu_scope_end(self.slot);
    }
}

impl PeakCounter {
    /// The counter for work on `device` (`None`: the CPU), if one can be read.
    pub(crate) fn for_device(device: Option<usize>) -> Option<PeakCounter> {
        match device {
            Some(d) => torch::stats(d).is_ok().then_some(PeakCounter::Cuda(d)),
            None => torch::cpu_stats().is_ok().then_some(PeakCounter::Cpu),
        }
    }

    /// The counter for work on `device` that this thread alone runs: on the CPU, the process's
    /// count with a scope of the thread's own (held by the returned guard, which must outlive
    /// the counter's use) that tells whether another thread allocated meanwhile; where the thread
    /// counts already, or on CUDA, [`for_device`](Self::for_device)'s. On CUDA the caching
    /// allocator counts per device: another thread's work on the same device reaches it.
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) fn own(device: Option<usize>) -> Option<(PeakCounter, Option<OwnCount>)> {
        if device.is_none() {
            if let Ok(slot) = torch::cpu_scope_begin() {
                let guard = OwnCount { slot, _thread: std::marker::PhantomData };
                return Some((PeakCounter::Thread(slot), Some(guard)));
            }
        }
        PeakCounter::for_device(device).map(|c| (c, None))
    }

    /// Starts measuring: resets the peak to what is in use now. Returns what is in use, and
    /// the peak before the reset (for [`end`](Self::end)).
    pub(crate) fn start(self) -> Option<(u64, u64)> {
        match self {
            PeakCounter::Cpu => {
                let before = torch::cpu_stats().ok()?;
                torch::cpu_reset_peak().ok()?;
                Some((bytes(before.allocated), bytes(before.peak_allocated)))
            }
            PeakCounter::Thread(_) => PeakCounter::Cpu.start(),
            PeakCounter::ThreadOwn(slot) => {
                let before = torch::cpu_scope_stats(slot).ok()?;
                torch::cpu_scope_reset_peak(slot).ok()?;
                Some((bytes(before.allocated), bytes(before.peak_allocated)))
            }
            PeakCounter::Cuda(d) => {
                let before = torch::stats(d).ok()?;
                torch::reset_peak(d).ok()?;
                Some((bytes(before.allocated), bytes(before.peak_allocated)))
            }
        }
    }

    /// The peak since [`start`](Self::start).
    pub(crate) fn peak(self) -> Option<u64> {
        match self {
            PeakCounter::Cpu | PeakCounter::Thread(_) => torch::cpu_stats().ok().map(|s| bytes(s.peak_allocated)),
            PeakCounter::ThreadOwn(slot) => torch::cpu_scope_stats(slot).ok().map(|s| bytes(s.peak_allocated)),
            PeakCounter::Cuda(d) => torch::stats(d).ok().map(|s| bytes(s.peak_allocated)),
        }
    }

    /// The bytes in use now.
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) fn in_use(self) -> Option<u64> {
        match self {
            PeakCounter::Cpu | PeakCounter::Thread(_) => torch::cpu_stats().ok().map(|s| bytes(s.allocated)),
            PeakCounter::ThreadOwn(slot) => torch::cpu_scope_stats(slot).ok().map(|s| bytes(s.allocated)),
            PeakCounter::Cuda(d) => torch::stats(d).ok().map(|s| bytes(s.allocated)),
        }
    }

    /// Ends a measurement: gives the counter back the peak it had before [`start`](Self::start)
    /// if that was higher, so that a measurement around this one (an `auto` chunk whose body
    /// runs a lazy step) still sees it. On the CPU only: libtorch's CUDA peaks can be reset,
    /// not raised; a thread's own count touches no one else's peak.
    pub(crate) fn end(self, previous_peak: u64) {
        if let PeakCounter::Cpu | PeakCounter::Thread(_) = self {
            let _ = torch::cpu_raise_peak(previous_peak);
        }
    }

    /// Where the thread's events stand, for [`interfered`](Self::interfered): `None` where this
    /// counter cannot tell.
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) fn mark(self) -> Option<(i64, i64)> {
        match self {
            PeakCounter::Thread(slot) => torch::cpu_scope_events(slot).ok(),
            _ => None,
        }
    }

    /// Whether another thread allocated, freed or reset the peak since `mark` (outside libtorch's
    /// parallel regions, where an op's own workers run): a measurement of the process's count
    /// since then may hold its work. `false` where this counter cannot tell.
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) fn interfered(self, mark: Option<(i64, i64)>) -> bool {
        match (mark, self.mark()) {
            (Some((all, own)), Some((all_now, own_now))) => all_now - all > own_now - own,
            _ => false,
        }
    }

    /// Every thread's allocations and frees so far, where only a whole device's can be read
    /// (CUDA's caching allocator counts per device): a call measured twice that saw as many
    /// of them and the same figures both times was not reached by another thread's work.
    /// `None` elsewhere (the CPU's count tells its own thread apart: [`mark`](Self::mark)).
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) fn device_events(self) -> Option<i64> {
        match self {
            PeakCounter::Cuda(d) => torch::stats(d).ok().map(|s| s.allocations.saturating_add(s.frees)),
            _ => None,
        }
    }

    /// The same thread's own count, which no other thread reaches (it misses what the workers of
    /// its parallel ops allocate): for when the process's count never stays its own.
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) fn own_only(self) -> PeakCounter {
        match self {
            PeakCounter::Thread(slot) => PeakCounter::ThreadOwn(slot),
            other => other,
        }
    }

    /// The bytes the work could still take: [`cuda_usable_memory`], or on the CPU
    /// [`available_cpu_memory`](crate::cpu_memory::available_cpu_memory).
    pub(crate) fn available(self) -> Option<u64> {
        match self {
            PeakCounter::Cpu | PeakCounter::Thread(_) | PeakCounter::ThreadOwn(_) => {
                Some(crate::memory::cpu::available_cpu_memory())
            }
            PeakCounter::Cuda(d) => cuda_usable_memory(d),
        }
    }
}
