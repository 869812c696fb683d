//! What a price is made of: a size in bytes (`crate::lazy::size::Bytes`) as the planner reads
//! it, rounded to the allocator's blocks and, where calibration measured it, following the
//! measurement between sizes; and the scratch space the convolution models work out in elements.

use crate::lazy::graph::Meta;
use crate::lazy::size::{Bytes, Elements};

/// Bytes a kernel takes at a micro-batch of `b` samples, as the planner reads them: a [`Bytes`]
/// size (`per * b + fixed`, and `single` at one sample when not 0) with, for a measured price,
/// its [`Curve`]: then the bytes between its sizes follow the measurement (and the line, an
/// upper bound, serves what reads only `per` and `fixed`). Kept flat and `Copy` for the
/// planner's inner loop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Work {
    pub(crate) per: u64,
    pub(crate) fixed: u64,
    pub(crate) single: u64,
    pub(crate) curve: Option<&'static Curve>,
}

impl Work {
    /// No bytes.
    pub(crate) const ZERO: Work = Work { per: 0, fixed: 0, single: 0, curve: None };

    /// A line: `per * b + fixed`, the same at one sample.
    pub(crate) const fn line(per: u64, fixed: u64) -> Work {
        Work { per, fixed, single: 0, curve: None }
    }

    /// Both taken at once.
    pub(crate) fn plus(self, other: Work) -> Work {
        let single = if self.single == 0 && other.single == 0 { 0 } else { self.at(1, 1) + other.at(1, 1) };
        let curve = match (self.curve, other.curve) {
            (None, None) => None,
            (a, b) => {
                let mut sizes: Vec<u64> = a.iter().chain(b.iter()).flat_map(|c| c.0.iter().map(|p| p.0)).collect();
                sizes.sort_unstable();
                sizes.dedup();
                Curve::intern(sizes.into_iter().map(|b| (b, self.bytes(b) + other.bytes(b))).collect())
            }
        };
        Work { per: self.per + other.per, fixed: self.fixed + other.fixed, single, curve }
    }

    /// Bytes at micro-batch `b`, as they are.
    #[inline]
    fn bytes(self, b: u64) -> u64 {
        if b == 1 && self.single != 0 {
            self.single
        } else if let Some(curve) = self.curve {
            curve.at(b, self.per)
        } else {
            self.per * b + self.fixed
        }
    }

    /// Bytes at micro-batch `b`, rounded up to the allocator's `block` (a power of two).
    #[inline]
    pub(crate) fn at(self, b: u64, block: u64) -> u64 {
        let bytes = self.bytes(b);
        // A mask, not a division: the planner's inner loop.
        debug_assert!(block.is_power_of_two());
        (bytes + block - 1) & !(block - 1)
    }
}

/// What a measured price took at the sizes it was measured at, from two samples on, in order of
/// size: between two sizes the bytes are interpolated, beyond the largest they grow by the line's
/// slope. Interned for the process, so that a price stays `Copy` and shares its points.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct Curve(Vec<(u64, u64)>);

/// Curves kept at most: past this many distinct ones, measured prices keep only their line
/// (which is above every measured size).
const CURVES: usize = 1 << 16;

impl Curve {
    /// The process's one copy of `points` (sizes from 2 on, ascending); `None` when there are
    /// none or the store is full.
    pub(crate) fn intern(points: Vec<(u64, u64)>) -> Option<&'static Curve> {
        use std::collections::HashSet;
        use std::sync::{Mutex, OnceLock};
        static STORE: OnceLock<Mutex<HashSet<&'static Curve>>> = OnceLock::new();
        if points.is_empty() {
            return None;
        }
        let curve = Curve(points);
        let mut store = STORE.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(&found) = store.get(&curve) {
            return Some(found);
        }
        if store.len() >= CURVES {
            return None;
        }
        let leaked: &'static Curve = Box::leak(Box::new(curve));
        store.insert(leaked);
        Some(leaked)
    }

    /// The points, `(size, bytes)`.
    pub(crate) fn points(&self) -> &[(u64, u64)] {
        &self.0
    }

    /// Bytes at `b` samples; `per`, the slope beyond the largest size.
    #[inline]
    fn at(&self, b: u64, per: u64) -> u64 {
        let points = &self.0;
        match points.iter().position(|&(size, _)| size >= b) {
            // Below the smallest size (one sample, where no `single` says): the smallest's.
            Some(0) => points[0].1,
            Some(i) if points[i].0 == b => points[i].1,
            Some(i) => {
                let ((b0, m0), (b1, m1)) = (points[i - 1], points[i]);
                if m1 >= m0 {
                    m0 + ((m1 - m0) * (b - b0)).div_ceil(b1 - b0)
                } else {
                    // Less at more samples (threads split otherwise): the larger holds.
                    m0
                }
            }
            None => {
                let (last, m) = points[points.len() - 1];
                m + per * (b - last)
            }
        }
    }
}

impl From<Bytes> for Work {
    /// A size as priced: its value at one sample kept. `single` 0 says there is none, so a
    /// value of 0 at one sample is kept as 1 byte (a native 1×1 convolution at one sample, beside
    /// oneDNN's scratch from two samples on, took the line's 30 KiB without it).
    fn from(bytes: Bytes) -> Work {
        Work { single: bytes.one.map_or(0, |one| one.max(1)), ..Work::line(bytes.per, bytes.fixed) }
    }
}

/// Scratch space in elements of the node's input kind, forward and backward, each with its
/// value at one sample where a single sample runs another way: what the convolution models
/// compute (their rules are in elements; bytes come last, as the allocator sees them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Scratch {
    pub(crate) forward: Elements,
    pub(crate) backward: Elements,
}

impl Scratch {
    /// The same in both passes.
    pub(crate) fn both(elements: Elements) -> Scratch {
        Scratch { forward: elements, backward: elements }
    }

    /// Both taken at once.
    pub(crate) fn plus(self, other: Scratch) -> Scratch {
        Scratch { forward: self.forward.plus(other.forward), backward: self.backward.plus(other.backward) }
    }
}

/// A cost that is not linear in the micro-batch (`at(k)` at `k` samples: the larger of linear
/// costs, convex from two samples on), as the chord of its graph between two samples and the
/// full batch `n`, exact at both ends and above it in between, where micro-batches fall, with
/// its value at one sample apart (a single sample may take more than the chord says: threads
/// split one sample otherwise).
pub(crate) fn chord(n: u64, at: impl Fn(u64) -> u64) -> Elements {
    let one = at(1);
    if n <= 2 {
        let slope = if n == 2 { at(2).saturating_sub(one) } else { 0 };
        return Elements::line(slope, one.saturating_sub(slope)).with_one(one);
    }
    let two = at(2);
    let slope = at(n).saturating_sub(two).div_ceil(n - 2);
    Elements::line(slope, two.saturating_sub(2 * slope)).with_one(one)
}

/// The batch a cost is planned at (1 when the value has no batch dimension).
pub(crate) fn batch_of(meta: &Meta) -> u64 {
    meta.batch().map_or(1, |bd| bd.size.max(1)) as u64
}
