//! The device as the allocator meets it.
//!
//! A leaf of its own: the allocator's state holds a card, and an expandable segment maps its
//! pages from one, so neither can own the type without importing the other.

/// The memory the device can still give to new segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Card {
    /// `totalGlobalMem`: sizes the address range of an expandable segment (1 1/8 of it) and
    /// the cap a memory fraction sets.
    pub(crate) total: u64,
    /// Bytes a `cudaMalloc` (or `cuMemCreate` of a page) can still take. Starting from a
    /// snapshot, the snapshot's segments are already out of it, as `cudaMemGetInfo` reports.
    pub(crate) free: u64,
}

impl Card {
    /// A card of `total` bytes with `free` of them available.
    pub(crate) fn new(total: u64, free: u64) -> Card {
        Card { total, free: free.min(total) }
    }

    /// A card that never refuses a segment (1 PiB).
    pub(crate) fn unlimited() -> Card {
        Card { total: 1 << 50, free: 1 << 50 }
    }
}
