//! Segments in and out, as `torch.cuda.memory_snapshot()` (`DeviceCachingAllocator::snapshot`)
//! lists them: one entry per `cudaMalloc` segment, and one per contiguous mapped range of an
//! expandable segment.

use std::collections::BTreeMap;

use super::block::{Block, Idx};
use super::expandable::ExpandableSegment;
use super::sizes::{MIN_BLOCK_SIZE, ROUND_LARGE};
use super::{Allocator, BlockId, Card, Config, PoolKind, Stream};

/// One block of a [`SegmentState`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockState {
    /// `size`.
    pub(crate) size: u64,
    /// `state == "active_allocated"` (count `active_pending_free` as allocated: it is not
    /// reusable until its stream's events complete).
    pub(crate) allocated: bool,
}

/// One segment of a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SegmentState {
    /// `address`. Required for expandable segments (their gaps are unmapped pages); else `None`
    /// places the segment after the others.
    pub(crate) address: Option<u64>,
    /// `stream`.
    pub(crate) stream: Stream,
    /// `segment_type`: `"small"` or `"large"`.
    pub(crate) pool: PoolKind,
    /// `is_expandable`.
    pub(crate) expandable: bool,
    /// `blocks`, in address order.
    pub(crate) blocks: Vec<BlockState>,
}

impl SegmentState {
    /// `total_size`.
    pub(crate) fn total(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }

    /// `allocated_size`.
    pub(crate) fn allocated(&self) -> u64 {
        self.blocks.iter().filter(|b| b.allocated).map(|b| b.size).sum()
    }
}

impl Allocator {
    /// `snapshot`: every segment, or mapped range of an expandable one, by address.
    pub(crate) fn snapshot(&self) -> Vec<SegmentState> {
        let heads = self.blocks.iter().filter(|(_, b)| b.mapped && b.prev.is_none_or(|p| !self.blocks[p].mapped));
        let mut out: Vec<SegmentState> = heads
            .map(|(i, head)| {
                let mut blocks = Vec::new();
                let mut b = Some(i);
                while let Some(j) = b.filter(|&j| self.blocks[j].mapped) {
                    blocks.push(BlockState { size: self.blocks[j].size, allocated: self.blocks[j].allocated });
                    b = self.blocks[j].next;
                }
                SegmentState {
                    address: Some(head.addr),
                    stream: head.stream,
                    pool: head.pool,
                    expandable: head.expandable.is_some(),
                    blocks,
                }
            })
            .collect();
        out.sort_by_key(|s| s.address);
        out
    }

    /// An allocator holding `segments`, on a card with `card.free` bytes left beside them, and
    /// the ids of their allocated blocks in the order listed. Expandable segments of one pool and
    /// stream are taken as the mapped ranges of one reserved range starting at the lowest.
    /// Errors on blocks that are not whole 512-byte units, or segments that overlap.
    pub(crate) fn from_snapshot(
        config: Config,
        card: Card,
        segments: &[SegmentState],
    ) -> Result<(Allocator, Vec<BlockId>), String> {
        let mut a = Allocator::new(config, card);
        let mut starts = Vec::with_capacity(segments.len());
        // Address ranges taken, to catch overlaps.
        let mut used: Vec<(u64, u64)> = Vec::new();
        // Segments without an address go above every other, expandable reservations included.
        let reach = |s: &SegmentState| match s.expandable {
            true => ExpandableSegment::new(0, a.config.expandable_page(s.pool), a.card.total).size(),
            false => s.total(),
        };
        let top = segments.iter().filter_map(|s| s.address.map(|addr| addr + reach(s))).max().unwrap_or(0);
        a.next_addr = a.next_addr.max(top.div_ceil(ROUND_LARGE) * ROUND_LARGE);
        let mut groups: BTreeMap<(Stream, PoolKind), Vec<&SegmentState>> = BTreeMap::new();
        for s in segments {
            check_blocks(s)?;
            if s.expandable {
                starts.push(s.address.ok_or("an expandable segment needs its address")?);
                groups.entry((s.stream, s.pool)).or_default().push(s);
                continue;
            }
            let addr = s.address.unwrap_or_else(|| a.reserve_address(s.total()));
            starts.push(addr);
            used.push((addr, s.total()));
            a.stats.reserved += s.total();
            a.link(layout(s, addr).collect());
        }
        for ((stream, pool), mut ranges) in groups {
            ranges.sort_by_key(|s| s.address);
            let page = a.config.expandable_page(pool);
            let base = ranges[0].address.unwrap_or_default();
            let mut es = ExpandableSegment::new(base, page, a.card.total);
            let end = base + es.size();
            a.next_addr = a.next_addr.max(end.div_ceil(ROUND_LARGE) * ROUND_LARGE);
            used.push((base, es.size()));
            let (mut chain, mut at) = (Vec::new(), base);
            for s in ranges {
                let addr = s.address.unwrap_or_default();
                if addr < at || (addr - base) % page != 0 || s.total() % page != 0 || addr + s.total() > end {
                    return Err(format!("expandable range at {addr:#x} does not fit pages of {page} from {base:#x}"));
                }
                if addr > at {
                    chain.push(unmapped(stream, pool, at, addr - at));
                }
                for p in (addr - base) / page..(addr + s.total() - base) / page {
                    if es.mapped.len() <= p as usize {
                        es.mapped.resize(p as usize + 1, false);
                    }
                    es.mapped[p as usize] = true;
                }
                a.stats.reserved += s.total();
                chain.extend(layout(s, addr));
                at = addr + s.total();
            }
            if at < end {
                chain.push(unmapped(stream, pool, at, end - at));
            }
            chain.iter_mut().for_each(|b| b.expandable = Some(a.segments.len()));
            a.segments.push(Some(es));
            a.link(chain);
        }
        used.sort();
        if used.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err("snapshot segments overlap".into());
        }
        // Ids in listing order: allocated blocks found again by address.
        let live: BTreeMap<u64, Idx> = a.blocks.iter().filter(|(_, b)| b.allocated).map(|(i, b)| (b.addr, i)).collect();
        let mut ids = Vec::new();
        for (s, &start) in segments.iter().zip(&starts) {
            let offsets = s.blocks.iter().scan(start, |at, b| Some((std::mem::replace(at, *at + b.size), b)));
            for (addr, _) in offsets.filter(|(_, b)| b.allocated) {
                let id = BlockId(a.next_id);
                a.next_id += 1;
                a.live.insert(id, live[&addr]);
                ids.push(id);
            }
        }
        a.stats.peak_reserved = a.stats.reserved;
        a.stats.peak_allocated = a.stats.allocated;
        Ok((a, ids))
    }

    /// Stores one segment's blocks linked in order: allocated ones live, free ones cached
    /// (adjacent free ones merged, as the allocator never leaves them apart), unmapped ones aside.
    fn link(&mut self, chain: Vec<Block>) {
        let mut prev: Option<Idx> = None;
        for mut b in chain {
            let alike = |p: Idx| !b.allocated && !self.blocks[p].allocated && self.blocks[p].mapped == b.mapped;
            if let Some(p) = prev.filter(|&p| alike(p)) {
                self.blocks[p].size += b.size;
                continue;
            }
            b.prev = prev;
            let i = self.blocks.insert(b);
            if let Some(p) = prev {
                self.blocks[p].next = Some(i);
            }
            prev = Some(i);
        }
        let mut b = prev;
        while let Some(i) = b {
            b = self.blocks[i].prev;
            let block = &self.blocks[i];
            if block.allocated {
                self.stats.allocated += block.size;
            } else if block.mapped {
                self.insert_into_blocks(i);
            } else {
                self.pools[block.pool.index()].unmapped.insert(block.addr_key(), i);
            }
        }
    }
}

/// Sizes a snapshot can hold: blocks are multiples of 512 bytes.
fn check_blocks(s: &SegmentState) -> Result<(), String> {
    if s.blocks.is_empty() || s.blocks.iter().any(|b| b.size == 0 || b.size % MIN_BLOCK_SIZE != 0) {
        return Err("a snapshot segment needs blocks of whole 512-byte units".into());
    }
    Ok(())
}

/// A segment's blocks at their addresses, unlinked.
fn layout(s: &SegmentState, addr: u64) -> impl Iterator<Item = Block> + '_ {
    s.blocks.iter().scan(addr, move |at, b| {
        let mut block = Block::new(s.stream, s.pool, *at, b.size);
        block.allocated = b.allocated;
        block.requested = if b.allocated { b.size } else { 0 };
        *at += b.size;
        Some(block)
    })
}

fn unmapped(stream: Stream, pool: PoolKind, addr: u64, size: u64) -> Block {
    let mut b = Block::new(stream, pool, addr, size);
    b.mapped = false;
    b
}
