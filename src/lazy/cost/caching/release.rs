//! Giving cached memory back to the card: what `malloc` does before it reports an out-of-memory,
//! what `emptyCache` does, and the garbage collection of `garbage_collection_threshold`.

use super::alloc::Params;
use super::block::Idx;
use super::{Allocator, PoolKind};

impl Allocator {
    /// `release_block`: `cudaFree` of a whole (unsplit, not expandable) cached segment.
    fn release_block(&mut self, idx: Idx) {
        let b = self.blocks.remove(idx);
        debug_assert!(b.expandable.is_none() && !b.is_split(), "only whole segments are freed");
        self.pools[b.pool.index()].blocks.remove(&b.size_key());
        self.card.free += b.size;
        self.stats.sub_reserved(b.size);
    }

    /// A cached block `release_block` may take: libtorch calls it only on unsplit segments,
    /// which holds for oversize blocks built by the allocator itself; a snapshot could break it.
    fn releasable(&self, idx: Idx) -> bool {
        let b = &self.blocks[idx];
        b.expandable.is_none() && !b.is_split()
    }

    /// `release_available_cached_blocks`: with `max_split_size` set, free the smallest oversize
    /// cached block of the request's pool and stream that is at least as large as the request
    /// (or `max_split_size`); failing one, the largest ones downwards until their sum reaches it.
    pub(super) fn release_available_cached_blocks(&mut self, p: &Params) -> bool {
        let mss = self.config.max_split_size;
        if mss == u64::MAX {
            return false;
        }
        let key = p.size.max(mss);
        let pool = &self.pools[p.pool.index()];
        let single = pool.blocks.range((p.stream, key, 0)..).next().map(|(&(s, _, _), &i)| (s, i));
        if let Some((_, i)) = single.filter(|&(s, i)| s == p.stream && self.blocks[i].expandable.is_none()) {
            if self.releasable(i) {
                self.release_block(i);
            }
            return true;
        }
        // Backwards from just below the key, while the blocks are oversize and of this stream.
        let below: Vec<(u64, Idx)> = pool
            .blocks
            .range(..(p.stream, key, 0))
            .rev()
            .take_while(|&(&(s, size, _), _)| s == p.stream && size >= mss)
            .map(|(&(_, size, _), &i)| (size, i))
            .collect();
        let mut released = 0;
        for (size, i) in below {
            if released >= key {
                break;
            }
            if self.releasable(i) {
                released += size;
                self.release_block(i);
            }
        }
        released >= key
    }

    /// `release_cached_blocks`: every unsplit cached segment of both pools is freed, and every
    /// whole free page of an expandable segment unmapped. Cached pieces of segments that still
    /// hold a live block stay.
    pub(super) fn release_cached_blocks(&mut self) {
        self.release_blocks(PoolKind::Large);
        self.release_blocks(PoolKind::Small);
    }

    /// `release_blocks`: one pool, in (stream, size, address) order; expandable blocks after.
    fn release_blocks(&mut self, pool: PoolKind) {
        let cached: Vec<Idx> = self.pools[pool.index()].blocks.values().copied().collect();
        let mut to_unmap = Vec::new();
        for i in cached {
            if self.blocks[i].expandable.is_some() {
                to_unmap.push(i);
            } else if !self.blocks[i].is_split() {
                self.release_block(i);
            }
        }
        for i in to_unmap {
            self.unmap_block(i);
            if !self.blocks[i].is_split() {
                self.release_expandable_segment(i);
            }
        }
    }

    /// `garbage_collect_cached_blocks`: when reserved memory is above `garbage_collection_threshold`
    /// of the memory fraction's cap, free unsplit large-pool segments that have waited longer than
    /// average (counted in searches of the pool), pass after pass, until enough is freed.
    pub(super) fn garbage_collect_cached_blocks(&mut self) {
        let Some(cap) = self.allowed_memory_maximum() else { return };
        let threshold = (self.config.garbage_collection_threshold * cap as f64) as u64;
        if self.stats.reserved <= threshold {
            return;
        }
        let target = self.stats.reserved - threshold;
        let large = PoolKind::Large.index();
        let now = self.pools[large].get_free_blocks_call_count;
        let age = |s: &Self, i: Idx| now - s.blocks[i].gc_count_base;
        let unsplit: Vec<Idx> =
            self.pools[large].blocks.values().copied().filter(|&i| !self.blocks[i].is_split()).collect();
        let (mut total_age, mut count) = (unsplit.iter().map(|&i| age(self, i)).sum::<u64>(), unsplit.len() as u64);
        let (mut reclaimed, mut freed) = (0, true);
        while reclaimed < target && freed && count > 0 {
            let threshold_age = total_age as f64 / count as f64;
            freed = false;
            // Within a pass every old enough block goes, past the target: GC should not recur soon.
            let pass: Vec<Idx> = self.pools[large].blocks.values().copied().collect();
            for i in pass {
                let b = &self.blocks[i];
                if !b.is_split() && b.expandable.is_none() && age(self, i) as f64 >= threshold_age {
                    freed = true;
                    reclaimed += b.size;
                    total_age -= age(self, i);
                    count -= 1;
                    self.release_block(i);
                }
            }
        }
    }
}
