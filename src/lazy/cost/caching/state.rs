//! The allocator's state (`DeviceCachingAllocator`'s members) and the few answers read straight
//! off it. The code that runs on it is in the files beside this one, each an `impl Allocator`
//! block (`alloc`, `release`, `pages`, `snapshot`, `replay`): they import this file, never the
//! other way round. Fields are `pub(super)` for them.

use std::collections::BTreeMap;

use super::block::{BlockPool, Idx, Slab};
use super::expandable::ExpandableSegment;
use super::sizes::ROUND_LARGE;
use super::{Card, Config, PoolKind, Stream};

/// A live allocation, as [`Allocator::alloc`] and [`Allocator::from_snapshot`] hand them out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockId(pub(super) u64);

impl BlockId {
    /// A zero-byte allocation: `NativeCachingAllocator::allocate(0)` returns a null pointer
    /// without calling `malloc`, and `free(nullptr)` returns at once.
    pub(crate) const NULL: BlockId = BlockId(u64::MAX);
}

/// Where a live block sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placed {
    /// Its address.
    pub(crate) addr: u64,
    /// Its size: the rounded request, or more when the block was not split.
    pub(crate) size: u64,
    /// Its stream.
    pub(crate) stream: Stream,
    /// Its pool.
    pub(crate) pool: PoolKind,
}

/// The aggregate counters of `DeviceStats` the model keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stats {
    /// `allocated_bytes`: bytes of live blocks (block sizes, not requests).
    pub(crate) allocated: u64,
    /// Highest `allocated` since the start or the last [`Allocator::reset_peaks`].
    pub(crate) peak_allocated: u64,
    /// `reserved_bytes` (= `total_allocated_memory`): bytes of segments and mapped pages.
    pub(crate) reserved: u64,
    /// Highest `reserved` since the start or the last [`Allocator::reset_peaks`].
    pub(crate) peak_reserved: u64,
    /// `num_alloc_retries`: allocations that needed `release_cached_blocks` first.
    pub(crate) num_alloc_retries: u64,
    /// `num_ooms`.
    pub(crate) num_ooms: u64,
    /// `num_device_alloc`: `cudaMalloc`s and page mappings.
    pub(crate) num_device_alloc: u64,
    /// `num_device_free`: `cudaFree`s and page unmappings.
    pub(crate) num_device_free: u64,
}

impl Stats {
    pub(super) fn add_reserved(&mut self, bytes: u64) {
        self.reserved += bytes;
        self.peak_reserved = self.peak_reserved.max(self.reserved);
        self.num_device_alloc += 1;
    }

    pub(super) fn sub_reserved(&mut self, bytes: u64) {
        self.reserved -= bytes;
        self.num_device_free += 1;
    }
}

/// Where addresses of the first new segment start (a plausible CUDA virtual address).
const FIRST_ADDRESS: u64 = 0x7f00_0000_0000;

/// One device's `DeviceCachingAllocator`: its two pools, its segments and the card under them.
#[derive(Clone, Debug)]
pub(crate) struct Allocator {
    pub(super) config: Config,
    pub(super) card: Card,
    /// Every block, free, allocated or unmapped, linked to its segment neighbours.
    pub(super) blocks: Slab,
    /// `small_blocks` and `large_blocks`, indexed by [`PoolKind`].
    pub(super) pools: [BlockPool; 2],
    /// `expandable_segments_`; released ones are `None` so indices stay valid.
    pub(super) segments: Vec<Option<ExpandableSegment>>,
    /// `active_blocks` that are allocated, by the id handed out.
    pub(super) live: BTreeMap<BlockId, Idx>,
    /// The next [`BlockId`] to hand out.
    pub(super) next_id: u64,
    /// Where the next segment or expandable reservation starts.
    pub(super) next_addr: u64,
    pub(super) stats: Stats,
}

impl Allocator {
    /// An empty allocator on `card`.
    pub(crate) fn new(config: Config, card: Card) -> Allocator {
        Allocator {
            config,
            card,
            blocks: Slab::default(),
            pools: [BlockPool::new(), BlockPool::new()],
            segments: Vec::new(),
            live: BTreeMap::new(),
            next_id: 0,
            next_addr: FIRST_ADDRESS,
            stats: Stats::default(),
        }
    }

    /// The settings.
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// The card as it stands.
    pub(crate) fn card(&self) -> Card {
        self.card
    }

    /// The counters.
    pub(crate) fn stats(&self) -> Stats {
        self.stats
    }

    /// `resetPeakStats`: peaks restart from the current values.
    pub(crate) fn reset_peaks(&mut self) {
        self.stats.peak_allocated = self.stats.allocated;
        self.stats.peak_reserved = self.stats.reserved;
    }

    /// Where live block `id` sits, if it is live.
    pub(crate) fn placed(&self, id: BlockId) -> Option<Placed> {
        let b = &self.blocks[*self.live.get(&id)?];
        Some(Placed { addr: b.addr, size: b.size, stream: b.stream, pool: b.pool })
    }

    /// `emptyCache`: `release_cached_blocks`, every unsplit cached segment and every free
    /// page of an expandable segment goes back to the card.
    pub(crate) fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }

    /// `allowed_memory_maximum`: set only by a memory fraction below 1.
    pub(super) fn allowed_memory_maximum(&self) -> Option<u64> {
        self.config.allowed_memory_maximum(self.card.total)
    }

    /// Garbage collection (and the reuse counter it needs) runs only under a memory fraction:
    /// `malloc` and `get_free_block` test `allowed_memory_maximum.has_value()` first.
    pub(super) fn gc_enabled(&self) -> bool {
        self.allowed_memory_maximum().is_some() && self.config.garbage_collection_threshold > 0.0
    }

    /// A fresh address range for a new segment or an expandable reservation.
    pub(super) fn reserve_address(&mut self, bytes: u64) -> u64 {
        let addr = self.next_addr;
        self.next_addr = addr + bytes.div_ceil(ROUND_LARGE).max(1) * ROUND_LARGE;
        addr
    }
}
