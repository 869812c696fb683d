//! A plan the caching allocator's model would not place, as users read it: data only, below
//! the planner, so that errors can carry it.

use crate::lazy::phase::Phase;

/// A plan whose tensors fit the budget but whose step the caching allocator would not place: the
/// first such plan the search made on a CUDA card ([`Plan::unplaced`](crate::lazy::Plan::unplaced)),
/// and the block request that failed in the replay of the allocator's model. The plan given
/// instead was made under a lower budget.
///
/// Printed, it reads as libtorch's "CUDA out of memory" would, before the step runs: "the plan
/// of 3.57 GiB allocated (micro-batch 903, 3 recomputed segments) is not placed: op #9 `relu`
/// (forward, micro-batch of 903): 903 MiB request: 1.5 GiB free in cached pieces, none ≥
/// 903 MiB; 70.4 MiB left on the card".
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct UnplacedRequest {
    /// The allocated peak of the plan refused, in bytes.
    pub plan_peak: u64,
    /// Its micro-batch.
    pub micro_batch: usize,
    /// Its recomputed segments (0: none).
    pub segments: usize,
    /// The position of the op whose request failed.
    pub op: usize,
    /// That op's name.
    pub op_name: String,
    /// The pass it failed in.
    pub phase: Phase,
    /// The size of the micro-batch it ran in (the remainder's, for the last).
    pub op_micro_batch: usize,
    /// The bytes asked for.
    pub requested: u64,
    /// The segment a `cudaMalloc` would have needed for them ("Tried to allocate").
    pub segment: u64,
    /// Reserved but unallocated bytes at the failure (cached free pieces).
    pub cached_free: u64,
    /// The largest cached free piece.
    pub largest_cached: u64,
    /// What the card could still give to new segments.
    pub card_free: u64,
    /// The allocator's answer in words.
    pub why: String,
}

impl std::fmt::Display for UnplacedRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = |bytes: u64| crate::svg::bytes(bytes as f64);
        write!(
            f,
            "the plan of {} ({} B) allocated (micro-batch {}",
            b(self.plan_peak),
            self.plan_peak,
            self.micro_batch
        )?;
        if self.segments > 0 {
            write!(f, ", {} recomputed segments", self.segments)?;
        }
        let phase = self.phase.name();
        write!(
            f,
            ") is not placed: op #{} `{}` ({phase}, micro-batch of {}): {}",
            self.op, self.op_name, self.op_micro_batch, self.why
        )
    }
}
