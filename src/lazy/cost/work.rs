//! What a price is made of: bytes that grow with the micro-batch (and may differ at one
//! sample), and the element counts the convolution models work in.

use crate::lazy::graph::{Bytes, Meta};

/// Bytes a kernel takes at a micro-batch of `b` samples: `per * b + fixed`, except at one
/// sample when `single` is set (not 0): a single sample may run with another kernel (libtorch's
/// native convolution where oneDNN runs a batch), or split among threads otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Work {
    pub(crate) per: u64,
    pub(crate) fixed: u64,
    pub(crate) single: u64,
}

impl Work {
    /// No bytes.
    pub(crate) const ZERO: Work = Work { per: 0, fixed: 0, single: 0 };

    /// Both taken at once.
    pub(crate) fn plus(self, other: Work) -> Work {
        let single = if self.single == 0 && other.single == 0 { 0 } else { self.at(1, 1) + other.at(1, 1) };
        Work { per: self.per + other.per, fixed: self.fixed + other.fixed, single }
    }

    /// Bytes at micro-batch `b`, rounded up to the allocator's `block` (a power of two).
    #[inline]
    pub(crate) fn at(self, b: u64, block: u64) -> u64 {
        let bytes = if b == 1 && self.single != 0 { self.single } else { self.per * b + self.fixed };
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
/// backward, and what it is at one sample when the line does not say (a single sample runs
/// another way): what the convolution models compute (their rules are in elements; bytes come last, as
/// the allocator sees them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Scratch {
    pub(crate) forward: (u64, u64),
    pub(crate) backward: (u64, u64),
    pub(crate) single: Option<(u64, u64)>,
}

impl Scratch {
    /// Scratch of two chords ([`chord`]), forward and backward.
    pub(crate) fn of(forward: ((u64, u64), u64), backward: ((u64, u64), u64)) -> Scratch {
        Scratch { forward: forward.0, backward: backward.0, single: Some((forward.1, backward.1)) }
    }

    /// `(per, fixed)` elements added to both passes.
    pub(crate) fn add(&mut self, forward: (u64, u64), backward: (u64, u64)) {
        self.forward = (self.forward.0 + forward.0, self.forward.1 + forward.1);
        self.backward = (self.backward.0 + backward.0, self.backward.1 + backward.1);
    }
}

/// A cost that is not linear in the micro-batch (`at(k)` at `k` samples: the larger of linear
/// costs, convex from two samples on), as the chord of its graph between two samples and the
/// full batch `n`, exact at both ends and above it in between, where micro-batches fall, and its
/// value at one sample apart (a single sample may take more than the chord says: threads split
/// one sample otherwise). `((per sample, fixed), at one sample)`.
pub(crate) fn chord(n: u64, at: impl Fn(u64) -> u64) -> ((u64, u64), u64) {
    let one = at(1);
    if n <= 2 {
        let slope = if n == 2 { at(2).saturating_sub(one) } else { 0 };
        return ((slope, one.saturating_sub(slope)), one);
    }
    let two = at(2);
    let slope = at(n).saturating_sub(two).div_ceil(n - 2);
    ((slope, two.saturating_sub(2 * slope)), one)
}

/// The batch a cost is planned at (1 when the value has no batch dimension).
pub(crate) fn batch_of(meta: &Meta) -> u64 {
    meta.batch().map_or(1, |bd| bd.size.max(1)) as u64
}
