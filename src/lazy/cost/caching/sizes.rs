//! The size constants of `CUDACachingAllocator.cpp` and the pool a size belongs to.
//!
//! A leaf: the blocks ([`super::block`]) and the settings' size rules ([`super::config`]) both
//! route requests by these numbers, so they live below both rather than in either.

/// One mebibyte.
pub(crate) const MIB: u64 = 1 << 20;
/// `kMinBlockSize`: every request is rounded up to a multiple of 512 bytes.
pub(crate) const MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize`: the largest request of the small pool, 1 MiB.
pub(crate) const SMALL_SIZE: u64 = MIB;
/// `kSmallBuffer`: small requests are packed in 2 MiB segments (and 2 MiB expandable pages).
pub(crate) const SMALL_BUFFER: u64 = 2 * MIB;
/// `kMinLargeAlloc`: large requests below 10 MiB share a `large_segment_size` segment.
pub(crate) const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// `kRoundLarge`: larger requests get a segment of their size rounded up to 2 MiB.
pub(crate) const ROUND_LARGE: u64 = 2 * MIB;
/// `kLargeBuffer`: the default `large_segment_size` (20 MiB) and the floor of the options
/// measured against it.
pub(crate) const LARGE_BUFFER: u64 = 20 * MIB;

/// The pool a request and its segment belong to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum PoolKind {
    /// `small_blocks`: requests of at most 1 MiB, in 2 MiB segments.
    Small,
    /// `large_blocks`: everything else.
    Large,
}

impl PoolKind {
    /// `get_pool`: a request of at most `kSmallSize` (1 MiB) after rounding is small.
    pub(crate) fn for_size(rounded: u64) -> PoolKind {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// The pool's slot in `Allocator::pools`.
    pub(super) fn index(self) -> usize {
        match self {
            PoolKind::Small => 0,
            PoolKind::Large => 1,
        }
    }
}
