//! The allocator's paths through expandable segments ([`super::expandable`]): finding room for a
//! request in a range's unmapped pages (or reserving a new range), mapping the pages under a
//! block, unmapping a free block's whole pages, and giving up a range with nothing mapped.

use super::block::{Block, Idx};
use super::expandable::ExpandableSegment;
use super::{Allocator, PoolKind, Stream};

impl Allocator {
    /// `find_expandable_block`: the lowest unmapped range of this pool and stream which, with the
    /// free block just before it and what follows, has room for `size`; else a new segment.
    fn find_expandable_block(&mut self, stream: Stream, pool: PoolKind, size: u64) -> Idx {
        let blocks = &self.blocks;
        let allocatable = |b: Option<Idx>| b.is_some_and(|b| !blocks[b].allocated);
        let has_room = |mut b: Option<Idx>| {
            let mut bytes = 0;
            while bytes < size && allocatable(b) {
                bytes += blocks[b.unwrap()].size;
                b = blocks[b.unwrap()].next;
            }
            bytes >= size
        };
        let unmapped = self.pools[pool.index()].unmapped.range((stream, 0)..);
        for (_, &c) in unmapped.take_while(|&(&(s, _), _)| s == stream) {
            let c = if allocatable(blocks[c].prev) { blocks[c].prev.unwrap() } else { c };
            if has_room(Some(c)) {
                return c;
            }
        }
        let page = self.config.expandable_page(pool);
        let mut es = ExpandableSegment::new(0, page, self.card.total);
        es.base = self.reserve_address(es.size());
        let mut candidate = Block::new(stream, pool, es.base, es.size());
        candidate.mapped = false;
        candidate.expandable = Some(self.segments.len());
        self.segments.push(Some(es));
        let idx = self.blocks.insert(candidate);
        self.pools[pool.index()].unmapped.insert(self.blocks[idx].addr_key(), idx);
        idx
    }

    /// `map_block`: map the pages under the front `size` bytes of unmapped block `idx`; the
    /// unmapped rest becomes a block of its own, and the mapped part merges with free neighbours.
    fn map_block(&mut self, idx: Idx, size: u64) -> bool {
        let b = &self.blocks[idx];
        let es = b.expandable.expect("an expandable block");
        let mapped = self.segments[es].as_mut().expect("a live segment").map(&mut self.card, b.addr, size);
        if mapped == 0 {
            return false;
        }
        let pool = b.pool.index();
        self.pools[pool].unmapped.remove(&b.addr_key());
        self.blocks[idx].mapped = true;
        if mapped < self.blocks[idx].size {
            let b = &self.blocks[idx];
            let mut rest = Block::new(b.stream, b.pool, b.addr + mapped, b.size - mapped);
            rest.mapped = false;
            rest.expandable = b.expandable;
            rest.prev = Some(idx);
            rest.next = b.next;
            let rest = self.blocks.insert(rest);
            if let Some(n) = self.blocks[rest].next {
                self.blocks[n].prev = Some(rest);
            }
            self.blocks[idx].next = Some(rest);
            self.blocks[idx].size = mapped;
            self.pools[pool].unmapped.insert(self.blocks[rest].addr_key(), rest);
        }
        let (prev, next) = (self.blocks[idx].prev, self.blocks[idx].next);
        self.try_merge_blocks(idx, prev);
        self.try_merge_blocks(idx, next);
        self.insert_into_blocks(idx);
        self.stats.add_reserved(mapped);
        true
    }

    /// `try_allocate_expandable_block`: map pages at the found place until the free block there
    /// holds `size` (the rounded request, not a whole segment). A mapping that fails leaves what
    /// was mapped before it cached.
    pub(super) fn try_allocate_expandable_block(&mut self, stream: Stream, pool: PoolKind, size: u64) -> Option<Idx> {
        let c = self.find_expandable_block(stream, pool, size);
        if !self.blocks[c].mapped && !self.map_block(c, self.blocks[c].size.min(size)) {
            return None;
        }
        let mut c = c;
        while self.blocks[c].size < size {
            let next = self.blocks[c].next?;
            let remaining = size - self.blocks[c].size;
            if !self.map_block(next, remaining.min(self.blocks[next].size)) {
                return None;
            }
            c = next;
        }
        self.pools[pool.index()].blocks.remove(&self.blocks[c].size_key());
        Some(c)
    }

    /// `unmap_block`: unmap the whole pages inside free block `idx`; the free fringes on either
    /// side stay cached as blocks of their own.
    pub(super) fn unmap_block(&mut self, idx: Idx) {
        let b = &self.blocks[idx];
        let es = b.expandable.expect("an expandable block");
        let (start, bytes) = self.segments[es].as_mut().expect("a live segment").unmap(&mut self.card, b.addr, b.size);
        if bytes == 0 {
            return;
        }
        let (addr, size, stream, pool) = (b.addr, b.size, b.stream, b.pool);
        self.pools[pool.index()].blocks.remove(&b.size_key());
        if start > addr {
            let mut before = Block::new(stream, pool, addr, start - addr);
            before.expandable = Some(es);
            before.prev = self.blocks[idx].prev;
            before.next = Some(idx);
            let before = self.blocks.insert(before);
            if let Some(p) = self.blocks[before].prev {
                self.blocks[p].next = Some(before);
            }
            self.blocks[idx].prev = Some(before);
            self.insert_into_blocks(before);
        }
        let after = addr + size - (start + bytes);
        if after > 0 {
            let mut tail = Block::new(stream, pool, start + bytes, after);
            tail.expandable = Some(es);
            tail.prev = Some(idx);
            tail.next = self.blocks[idx].next;
            let tail = self.blocks.insert(tail);
            if let Some(n) = self.blocks[tail].next {
                self.blocks[n].prev = Some(tail);
            }
            self.blocks[idx].next = Some(tail);
            self.insert_into_blocks(tail);
        }
        let b = &mut self.blocks[idx];
        (b.addr, b.size, b.mapped) = (start, bytes, false);
        let (prev, next) = (b.prev, b.next);
        self.try_merge_blocks(idx, prev);
        self.try_merge_blocks(idx, next);
        self.pools[pool.index()].unmapped.insert(self.blocks[idx].addr_key(), idx);
        self.stats.sub_reserved(bytes);
    }

    /// `release_expandable_segment`: a range with nothing mapped is given up.
    pub(super) fn release_expandable_segment(&mut self, idx: Idx) {
        let b = self.blocks.remove(idx);
        let es = b.expandable.expect("an expandable block");
        debug_assert!(!b.mapped && Some(b.size) == self.segments[es].as_ref().map(|s| s.size()));
        self.pools[b.pool.index()].unmapped.remove(&b.addr_key());
        self.segments[es] = None;
    }
}
