//! What a price is made of: bytes that grow with the micro-batch (and may differ at one
//! sample), and the element counts the convolution models work in.

use crate::lazy::graph::{Bytes, Meta};

/// Bytes a kernel takes at a micro-batch of `b` samples: `per * b + fixed`, and at least
/// `single` at one sample, where a library runs a single sample with another kernel
/// (libtorch's native convolution where oneDNN runs a batch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Work {
    pub(crate) per: u64,
    pub(crate) fixed: u64,
    pub(crate) single: u64,
}

impl Work {
    /// Bytes at micro-batch `b`, rounded up to the allocator's `block` (a power of two).
    #[inline]
    pub(crate) fn at(self, b: u64, block: u64) -> u64 {
        let bytes = self.per * b + self.fixed;
        let bytes = if b == 1 { bytes.max(self.single) } else { bytes };
        // A mask, not a division: the planner's inner loop.
        debug_assert!(block.is_power_of_two());
        (bytes + block - 1) & !(block - 1)
    }
}

impl From<Bytes> for Work {
    fn from(bytes: Bytes) -> Work {
        Work { per: bytes.per, fixed: bytes.fixed, single: 0 }
    }
}

/// Scratch space in elements of the node's input kind, `(per sample, fixed)`, forward and
/// backward, and at one sample where a single sample runs another way: what the convolution
/// models compute (their rules are in elements; bytes come last, as the allocator sees them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Scratch {
    pub(crate) forward: (u64, u64),
    pub(crate) backward: (u64, u64),
    pub(crate) single: Option<(u64, u64)>,
}

impl Scratch {
    /// `(per, fixed)` elements added to both passes.
    pub(crate) fn add(&mut self, forward: (u64, u64), backward: (u64, u64)) {
        self.forward = (self.forward.0 + forward.0, self.forward.1 + forward.1);
        self.backward = (self.backward.0 + backward.0, self.backward.1 + backward.1);
    }
}

/// A cost that is not linear in the micro-batch (`at(k)` at `k` samples, convex: the larger of
/// linear costs), as the chord of its graph between one sample and the full batch `n`: exact at
/// both ends, above it in between, where micro-batches fall. `(per sample, fixed)`.
pub(crate) fn chord(n: u64, at: impl Fn(u64) -> u64) -> (u64, u64) {
    if n <= 1 {
        return (0, at(1));
    }
    let slope = at(n).saturating_sub(at(1)).div_ceil(n - 1);
    (slope, at(1).saturating_sub(slope))
}

/// The batch a cost is planned at (1 when the value has no batch dimension).
pub(crate) fn batch_of(meta: &Meta) -> u64 {
    meta.batch().map_or(1, |bd| bd.size.max(1)) as u64
}
