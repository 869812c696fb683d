//! The counter that measures one attempt's peak: libtorch's CUDA caching allocator, or the
//! counting CPU allocator.

use super::cuda_allocator::cuda_usable_memory;
use super::shim::{self as torch, bytes};

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
            PeakCounter::Cpu => torch::cpu_stats().ok().map(|s| bytes(s.peak_allocated)),
            PeakCounter::Cuda(d) => torch::stats(d).ok().map(|s| bytes(s.peak_allocated)),
        }
    }

    /// The bytes in use now.
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) fn in_use(self) -> Option<u64> {
        match self {
            PeakCounter::Cpu => torch::cpu_stats().ok().map(|s| bytes(s.allocated)),
            PeakCounter::Cuda(d) => torch::stats(d).ok().map(|s| bytes(s.allocated)),
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
