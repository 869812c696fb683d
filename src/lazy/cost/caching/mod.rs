//! A replay model of libtorch 2.11's CUDA caching allocator, written from its source:
//! `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`), `c10/core/AllocatorConfig.{h,cpp}`
//! and `c10/cuda/CUDAAllocatorConfig.h`.
//!
//! It knows nothing of tensors or ops: it takes allocation and free events (bytes and a stream)
//! and answers what the allocator would hold, segment by segment, and where it would fail.
//!
//! - A request is rounded ([`Config::round_size`]), goes to the small pool (≤ 1 MiB) or the large
//!   one, and is served by the best-fitting cached free block of its pool and stream, ordered
//!   by (stream, size, address) as `BlockComparatorSize` orders them, or by a new segment
//!   ([`Config::allocation_size`]: 2 MiB, 20 MiB, or the request rounded to 2 MiB).
//! - A found block is split when `should_split` says so; the remainder stays free in the same
//!   segment. A freed block merges with free neighbours of its own segment only.
//! - When the card cannot back a new segment, libtorch frees cached blocks and tries again
//!   (`release_available_cached_blocks`, then `release_cached_blocks`); what still fails is an
//!   [`Oom`], which says why: the card left, the cached pieces and the largest of them.
//! - `expandable_segments:True` grows one reserved address range per pool and stream in pages
//!   of 2 MiB (small pool) or `large_segment_size` (20 MiB, large pool), and unmaps free pages on
//!   release.
//! - Under a memory fraction, reserved bytes are capped, and `garbage_collection_threshold`
//!   frees long-unused cached segments before a new one is made.
//!
//! The card is explicit ([`Card`]): the bytes it can still give to new segments. A replay can
//! start from a filled card: [`Allocator::from_snapshot`] takes the segments
//! `torch.cuda.memory_snapshot()` lists.
//!
//! The source read is a stored main-branch revision (its commit unrecorded) whose API, constants
//! and messages match the 2.11.0 wheel's headers and `libc10_cuda.so`.
//!
//! Not modelled: CUDA graphs' private pools and mempools, `recordStream` (blocks used on other
//! streams wait for events before they are free), free-memory callbacks, IPC. Addresses of new
//! segments are assigned upwards in order of creation, where `cudaMalloc` chooses its own; they
//! only break ties between free blocks of equal size.

mod alloc;
mod block;
mod config;
mod expandable;
mod oom;
mod parse;
mod release;
mod replay;
mod snapshot;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use block::{BlockPool, Idx, Slab};
pub(crate) use block::{PoolKind, Stream};
pub(crate) use config::Config;
use expandable::ExpandableSegment;
pub(crate) use oom::{format_bytes, Oom};
pub(crate) use replay::{Event, Failure, Replay};
pub(crate) use snapshot::{BlockState, SegmentState};

/// The device as the allocator meets it: the memory it can still give to new segments.
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

/// A live allocation, as [`Allocator::alloc`] and [`Allocator::from_snapshot`] hand them out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockId(u64);

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
    fn add_reserved(&mut self, bytes: u64) {
        self.reserved += bytes;
        self.peak_reserved = self.peak_reserved.max(self.reserved);
        self.num_device_alloc += 1;
    }

    fn sub_reserved(&mut self, bytes: u64) {
        self.reserved -= bytes;
        self.num_device_free += 1;
    }
}

/// Where addresses of the first new segment start (a plausible CUDA virtual address).
const FIRST_ADDRESS: u64 = 0x7f00_0000_0000;

/// One device's `DeviceCachingAllocator`: its two pools, its segments and the card under them.
#[derive(Clone, Debug)]
pub(crate) struct Allocator {
    config: Config,
    card: Card,
    /// Every block, free, allocated or unmapped, linked to its segment neighbours.
    blocks: Slab,
    /// `small_blocks` and `large_blocks`, indexed by [`PoolKind`].
    pools: [BlockPool; 2],
    /// `expandable_segments_`; released ones are `None` so indices stay valid.
    segments: Vec<Option<ExpandableSegment>>,
    /// `active_blocks` that are allocated, by the id handed out.
    live: BTreeMap<BlockId, Idx>,
    next_id: u64,
    next_addr: u64,
    stats: Stats,
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
    fn allowed_memory_maximum(&self) -> Option<u64> {
        self.config.allowed_memory_maximum(self.card.total)
    }

    /// Garbage collection (and the reuse counter it needs) runs only under a memory fraction:
    /// `malloc` and `get_free_block` test `allowed_memory_maximum.has_value()` first.
    fn gc_enabled(&self) -> bool {
        self.allowed_memory_maximum().is_some() && self.config.garbage_collection_threshold > 0.0
    }

    /// A fresh address range for a new segment or an expandable reservation.
    fn reserve_address(&mut self, bytes: u64) -> u64 {
        let addr = self.next_addr;
        self.next_addr = addr + bytes.div_ceil(config::ROUND_LARGE).max(1) * config::ROUND_LARGE;
        addr
    }
}
