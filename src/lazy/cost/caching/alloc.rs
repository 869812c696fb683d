//! Serving and returning a block: `DeviceCachingAllocator::malloc` and `free`, step by step in
//! libtorch's order, and the [`Oom`] a request gets when nothing can serve it.

use super::block::{Block, Idx};
use super::sizes::{MIN_BLOCK_SIZE, SMALL_SIZE};
use super::{Allocator, BlockId, Oom, PoolKind, Stream};

/// `AllocParams`: one request as `malloc` carries it through the search.
#[derive(Clone, Copy, Debug)]
pub(super) struct Params {
    /// `round_size` of the request.
    pub(super) size: u64,
    pub(super) stream: Stream,
    pub(super) pool: PoolKind,
    /// `get_allocation_size`: the segment a `cudaMalloc` would take.
    pub(super) alloc_size: u64,
    /// `is_expandable_segments_active`.
    pub(super) expandable: bool,
}

impl Allocator {
    /// `malloc`: a block of at least `bytes` for `stream`, or why there is none.
    ///
    /// A cached block first (`get_free_block`); else garbage collection when it is on, a new
    /// segment (`alloc_block`), then the same after freeing oversize cached blocks
    /// (`release_available_cached_blocks`), then after freeing every unsplit cached segment
    /// (`release_cached_blocks`). The found block is split when `should_split` says so.
    /// (`trigger_free_memory_callbacks` is left out: its callbacks free CUDA IPC memory.)
    ///
    /// As `NativeCachingAllocator::allocate`: 0 bytes give [`BlockId::NULL`] and touch nothing;
    /// 1 EiB or more fails at once.
    pub(crate) fn alloc(&mut self, bytes: u64, stream: Stream) -> Result<BlockId, Oom> {
        if bytes == 0 {
            return Ok(BlockId::NULL);
        }
        let size = self.config.round_size(bytes);
        let pool = PoolKind::for_size(size);
        let alloc_size = self.config.allocation_size(size);
        let p = Params { size, stream, pool, alloc_size, expandable: self.config.expandable_segments };
        if bytes >= 1 << 60 {
            return Err(self.oom(&p, bytes));
        }
        let block = match self.get_free_block(&p) {
            Some(b) => b,
            None => {
                if self.gc_enabled() {
                    self.garbage_collect_cached_blocks();
                }
                let mut found = self.alloc_block(&p, false);
                if found.is_none() && self.release_available_cached_blocks(&p) {
                    found = self.alloc_block(&p, false);
                }
                if found.is_none() {
                    self.release_cached_blocks();
                    found = self.alloc_block(&p, true);
                }
                match found {
                    Some(b) => b,
                    None => {
                        self.stats.num_ooms += 1;
                        return Err(self.oom(&p, bytes));
                    }
                }
            }
        };
        let split = self.should_split(block, p.size, p.expandable);
        let idx = self.alloc_found_block(block, &p, bytes, split);
        let id = BlockId(self.next_id);
        self.next_id += 1;
        self.live.insert(id, idx);
        Ok(id)
    }

    /// `free`: the block goes back to its pool, merged with free neighbours of its segment.
    ///
    /// Panics when `id` is not live (libtorch: "invalid device pointer"); [`BlockId::NULL`] is a
    /// no-op.
    pub(crate) fn free(&mut self, id: BlockId) {
        if id == BlockId::NULL {
            return;
        }
        let idx = self.live.remove(&id).unwrap_or_else(|| panic!("{id:?} is not a live block"));
        let b = &mut self.blocks[idx];
        b.allocated = false;
        b.requested = 0;
        self.stats.allocated -= b.size;
        self.free_block(idx);
    }

    /// `get_free_block`: the first block of the pool at or after (stream, size, address 0),
    /// unless the `max_split_size` rules refuse it. Blocks of expandable segments are weighed by
    /// what they could grow to, or skipped when expandable segments are off.
    fn get_free_block(&mut self, p: &Params) -> Option<Idx> {
        let gc = self.gc_enabled();
        let pool = &mut self.pools[p.pool.index()];
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        let blocks = &self.blocks;
        let mut it = pool.blocks.range((p.stream, p.size, 0)..).map(|(&(s, _, _), &i)| (s, i));
        let (s, mut found) = it.next()?;
        if s != p.stream {
            return None;
        }
        if blocks[found].expandable.is_some() {
            if p.expandable {
                // A block followed by unmapped space counts as large as it could grow.
                let grows_to = |i: Idx| {
                    let b = &blocks[i];
                    b.size + b.next.filter(|&n| !blocks[n].mapped).map_or(0, |n| blocks[n].size)
                };
                while blocks[found].expandable.is_some() {
                    match it.next() {
                        Some((s, n)) if s == p.stream && grows_to(n) < grows_to(found) => found = n,
                        _ => break,
                    }
                }
            } else {
                match it.find(|&(s, n)| s != p.stream || blocks[n].expandable.is_none()) {
                    Some((s, n)) if s == p.stream => found = n,
                    _ => return None,
                }
            }
        }
        let (mss, size) = (self.config.max_split_size, blocks[found].size);
        // An oversize block (≥ max_split_size) never serves a request below it ...
        if p.size < mss && size >= mss {
            return None;
        }
        // ... and serves one above it only within max_non_split_rounding.
        if p.size >= mss && size >= p.size.saturating_add(self.config.max_non_split_rounding) {
            return None;
        }
        pool.blocks.remove(&blocks[found].size_key());
        Some(found)
    }

    /// `should_split`: in the small pool, or in expandable segments, when at least 512 bytes
    /// would remain; in the large pool only for requests below `max_split_size` and when more
    /// than 1 MiB (`kSmallSize`) would remain. Otherwise the request takes the whole block.
    pub(super) fn should_split(&self, block: Idx, size: u64, expandable: bool) -> bool {
        let b = &self.blocks[block];
        let remaining = b.size - size;
        if b.pool == PoolKind::Small || expandable {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// `alloc_found_block`: when splitting, the request takes the front of the block and the
    /// rest stays cached as a free block of the same segment.
    fn alloc_found_block(&mut self, block: Idx, p: &Params, requested: u64, split: bool) -> Idx {
        let mut block = block;
        if split {
            let rest = block;
            let r = &self.blocks[rest];
            let mut front = Block::new(p.stream, r.pool, r.addr, p.size);
            front.expandable = r.expandable;
            front.prev = r.prev;
            front.next = Some(rest);
            let prev = r.prev;
            block = self.blocks.insert(front);
            if let Some(prev) = prev {
                self.blocks[prev].next = Some(block);
            }
            let r = &mut self.blocks[rest];
            r.prev = Some(block);
            r.addr += p.size;
            r.size -= p.size;
            self.insert_into_blocks(rest);
        }
        let b = &mut self.blocks[block];
        b.allocated = true;
        b.requested = requested;
        self.stats.allocated += b.size;
        self.stats.peak_allocated = self.stats.peak_allocated.max(self.stats.allocated);
        block
    }

    /// `alloc_block`: a new segment of `alloc_size` from the card (`cudaMalloc`), or pages of an
    /// expandable segment; refused past the memory fraction's cap.
    fn alloc_block(&mut self, p: &Params, retry: bool) -> Option<Idx> {
        if retry {
            self.stats.num_alloc_retries += 1;
        }
        if self.allowed_memory_maximum().is_some_and(|cap| self.stats.reserved + p.alloc_size > cap) {
            return None;
        }
        if p.expandable {
            return self.try_allocate_expandable_block(p.stream, p.pool, p.size);
        }
        if p.alloc_size > self.card.free {
            return None;
        }
        self.card.free -= p.alloc_size;
        let addr = self.reserve_address(p.alloc_size);
        self.stats.add_reserved(p.alloc_size);
        Some(self.blocks.insert(Block::new(p.stream, p.pool, addr, p.alloc_size)))
    }

    /// `free_block`: merge with the free neighbours of the segment, then cache.
    pub(super) fn free_block(&mut self, idx: Idx) {
        let (prev, next) = (self.blocks[idx].prev, self.blocks[idx].next);
        self.try_merge_blocks(idx, prev);
        self.try_merge_blocks(idx, next);
        self.insert_into_blocks(idx);
    }

    /// `try_merge_blocks`: `dst` absorbs its segment neighbour `src` when `src` is free and
    /// mapped alike. Neighbours are `prev`/`next` links, so blocks of different segments never
    /// merge, however close their addresses. Returns the bytes absorbed.
    pub(super) fn try_merge_blocks(&mut self, dst: Idx, src: Option<Idx>) -> u64 {
        let Some(src) = src else { return 0 };
        if self.blocks[src].allocated || self.blocks[src].mapped != self.blocks[dst].mapped {
            return 0;
        }
        let s = self.blocks.remove(src);
        let pool = &mut self.pools[s.pool.index()];
        if s.mapped {
            pool.blocks.remove(&s.size_key());
        } else {
            pool.unmapped.remove(&s.addr_key());
        }
        if self.blocks[dst].prev == Some(src) {
            self.blocks[dst].addr = s.addr;
            self.blocks[dst].prev = s.prev;
            if let Some(pp) = s.prev {
                self.blocks[pp].next = Some(dst);
            }
        } else {
            self.blocks[dst].next = s.next;
            if let Some(nn) = s.next {
                self.blocks[nn].prev = Some(dst);
            }
        }
        self.blocks[dst].size += s.size;
        s.size
    }

    /// `BlockPool::insert_into_blocks`: cache a free block, stamping its garbage-collection age.
    pub(super) fn insert_into_blocks(&mut self, idx: Idx) {
        let b = &mut self.blocks[idx];
        let pool = &mut self.pools[b.pool.index()];
        b.gc_count_base = pool.get_free_blocks_call_count;
        let fresh = pool.blocks.insert(b.size_key(), idx).is_none();
        debug_assert!(fresh, "a block cached twice");
    }

    /// The out-of-memory of request `p` (`bytes` before rounding) in the current state.
    fn oom(&self, p: &Params, bytes: u64) -> Oom {
        let (mut largest_usable, mut largest_cached, mut cached_free) = (0, 0, 0);
        for (kind, pool) in [PoolKind::Small, PoolKind::Large].into_iter().zip(&self.pools) {
            for &(stream, size, _) in pool.blocks.keys() {
                cached_free += size;
                largest_cached = largest_cached.max(size);
                if kind == p.pool && stream == p.stream {
                    largest_usable = largest_usable.max(size);
                }
            }
        }
        Oom {
            requested: bytes,
            rounded: p.size,
            segment: p.alloc_size,
            stream: p.stream,
            pool: p.pool,
            largest_usable,
            largest_cached,
            cached_free,
            card_free: self.card.free,
            allowed: self.allowed_memory_maximum(),
            reserved: self.stats.reserved,
            allocated: self.stats.allocated,
        }
    }
}
