//! A counting wrapper around libtorch's CPU allocator, through the native shim (`src/shim`,
//! feature `tch`): libtorch's CPU allocator keeps no figures of its own.

use super::shim::{self as torch, bytes};

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
/// bytes in use and their peak, for [`cpu_allocator_stats`] (what [`cuda_allocator_stats`](super::cuda_allocator_stats)
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
    let raw = torch::cpu_stats().map_err(|err| err.log("CPU allocator statistics")).ok()?;
    Some(CpuAllocatorStats {
        allocated: bytes(raw.allocated),
        peak_allocated: bytes(raw.peak_allocated),
        allocations: bytes(raw.allocations),
    })
}

/// Resets the CPU peak of [`cpu_allocator_stats`] to the bytes in use now. `false` before
/// [`track_cpu_allocations`].
pub fn reset_cpu_peak() -> bool {
    torch::cpu_reset_peak().map_err(|err| err.log("resetting the CPU peak")).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::shim::AllocatorError;

    #[test]
    fn cpu_figures_need_tracking() {
        assert_eq!(cpu_allocator_stats(), None);
        assert!(!reset_cpu_peak());
        let expected = if cfg!(toma_shim) { AllocatorError::NotTracking } else { AllocatorError::NotBuilt };
        assert_eq!(torch::cpu_stats().unwrap_err(), expected);
    }
}
