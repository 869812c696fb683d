//! The out-of-memory answer: what `malloc` reports once every release and retry failed, with
//! what the model can add about why.
//!
//! Data only: `malloc` ([`super::alloc`]) fills an [`Oom`] from the allocator's state, so this
//! file imports neither that state nor `malloc`'s request, and both sides can import it.

use std::fmt;

use super::{PoolKind, Stream};

/// A request no cached block could serve and no new segment could be made for, after
/// `release_available_cached_blocks` and `release_cached_blocks` (libtorch's "CUDA out of
/// memory"). The state is the one after those releases, as in libtorch's message.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Oom {
    /// The bytes asked for.
    pub(crate) requested: u64,
    /// After `round_size`.
    pub(crate) rounded: u64,
    /// `get_allocation_size`: the new segment a `cudaMalloc` needed ("Tried to allocate").
    pub(crate) segment: u64,
    /// The request's stream and pool: only their cached blocks could have served it.
    pub(crate) stream: Stream,
    /// See `stream`.
    pub(crate) pool: PoolKind,
    /// The largest cached free block of that pool and stream.
    pub(crate) largest_usable: u64,
    /// The largest cached free block anywhere (`cacheInfo`).
    pub(crate) largest_cached: u64,
    /// Cached free bytes, all pools and streams: reserved but unallocated.
    pub(crate) cached_free: u64,
    /// What the card could still give to new segments.
    pub(crate) card_free: u64,
    /// The memory fraction's cap on reserved bytes, if one is set.
    pub(crate) allowed: Option<u64>,
    /// Reserved bytes (segments and mapped pages) at the failure.
    pub(crate) reserved: u64,
    /// Allocated bytes at the failure.
    pub(crate) allocated: u64,
}

impl fmt::Display for Oom {
    /// E.g. "904 MiB request: 1.4 GiB free in cached pieces, none ≥ 904 MiB; 135 MiB left on
    /// the card".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = format_bytes;
        write!(f, "{} request: {} free in cached pieces", b(self.requested), b(self.cached_free))?;
        if self.largest_usable >= self.rounded {
            // Large enough, yet refused: only the max_split_size rules refuse a fitting block.
            write!(f, ", the largest ({}) too large to serve it under max_split_size", b(self.largest_usable))?;
        } else if self.largest_cached >= self.rounded {
            write!(f, ", none ≥ {} on its stream and pool", b(self.rounded))?;
        } else {
            write!(f, ", none ≥ {}", b(self.rounded))?;
        }
        write!(f, "; {} left on the card", b(self.card_free))?;
        if let Some(cap) = self.allowed.filter(|&cap| self.reserved + self.segment > cap) {
            write!(f, "; {} reserved of the {} the memory fraction allows", b(self.reserved), b(cap))?;
        }
        Ok(())
    }
}

/// Bytes in the largest binary unit they reach, with at most two decimals: "512 B", "904 MiB",
/// "1.37 GiB".
pub(crate) fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1 << (10 * (unit + 1)) {
        unit += 1;
    }
    let value = bytes as f64 / (1u64 << (10 * unit)) as f64;
    let text = format!("{value:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text} {}", UNITS[unit])
}
