//! Blocks and the pools of free ones (`struct Block`, `struct BlockPool`).
//!
//! libtorch links a segment's blocks by `prev`/`next` pointers and keeps free blocks in ordered
//! sets; here blocks live in a slab and the sets are `BTreeMap`s keyed as its comparators order.

use std::collections::BTreeMap;
use std::ops::{Index, IndexMut};

use super::PoolKind;

/// A CUDA stream. Pools order blocks by stream first (`BlockComparatorSize` compares the
/// `cudaStream_t` handles), and a free block serves only requests of its own stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Stream(pub(crate) u64);

/// A slab index.
pub(super) type Idx = usize;

/// `struct Block`: a piece of a segment, allocated, free, or (expandable segments) unmapped.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Block {
    pub(super) stream: Stream,
    pub(super) pool: PoolKind,
    pub(super) addr: u64,
    pub(super) size: u64,
    /// The bytes asked for, before rounding (0 when free).
    pub(super) requested: u64,
    pub(super) allocated: bool,
    /// Backed by physical pages; always true outside expandable segments.
    pub(super) mapped: bool,
    pub(super) prev: Option<Idx>,
    pub(super) next: Option<Idx>,
    /// Index into `Allocator::segments` for blocks of an expandable segment.
    pub(super) expandable: Option<usize>,
    /// `gc_count_base`: the pool's `get_free_blocks_call_count` when it was cached.
    pub(super) gc_count_base: u64,
}

/// `BlockComparatorSize`: stream, then size, then address.
pub(super) type SizeKey = (Stream, u64, u64);
/// `BlockComparatorAddress`: stream, then address.
pub(super) type AddrKey = (Stream, u64);

impl Block {
    pub(super) fn new(stream: Stream, pool: PoolKind, addr: u64, size: u64) -> Block {
        Block {
            stream,
            pool,
            addr,
            size,
            requested: 0,
            allocated: false,
            mapped: true,
            prev: None,
            next: None,
            expandable: None,
            gc_count_base: 0,
        }
    }

    pub(super) fn size_key(&self) -> SizeKey {
        (self.stream, self.size, self.addr)
    }

    pub(super) fn addr_key(&self) -> AddrKey {
        (self.stream, self.addr)
    }

    /// `is_split`: it shares its segment with other blocks.
    pub(super) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// `struct BlockPool`: the cached free blocks of one pool, and its unmapped address ranges.
#[derive(Clone, Debug, Default)]
pub(super) struct BlockPool {
    pub(super) blocks: BTreeMap<SizeKey, Idx>,
    pub(super) unmapped: BTreeMap<AddrKey, Idx>,
    /// Searches of this pool since the start, counted only while garbage collection is on.
    pub(super) get_free_blocks_call_count: u64,
}

impl BlockPool {
    pub(super) fn new() -> BlockPool {
        BlockPool::default()
    }
}

/// Owns every block; freed slots are reused (last freed first), which keeps runs deterministic.
#[derive(Clone, Debug, Default)]
pub(super) struct Slab {
    slots: Vec<Option<Block>>,
    vacant: Vec<Idx>,
}

impl Slab {
    pub(super) fn insert(&mut self, block: Block) -> Idx {
        match self.vacant.pop() {
            Some(i) => {
                self.slots[i] = Some(block);
                i
            }
            None => {
                self.slots.push(Some(block));
                self.slots.len() - 1
            }
        }
    }

    pub(super) fn remove(&mut self, i: Idx) -> Block {
        let block = self.slots[i].take().expect("removing a block twice");
        self.vacant.push(i);
        block
    }

    /// Every block with its index, in slab order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (Idx, &Block)> {
        self.slots.iter().enumerate().filter_map(|(i, b)| b.as_ref().map(|b| (i, b)))
    }
}

impl Index<Idx> for Slab {
    type Output = Block;
    fn index(&self, i: Idx) -> &Block {
        self.slots[i].as_ref().expect("a removed block")
    }
}

impl IndexMut<Idx> for Slab {
    fn index_mut(&mut self, i: Idx) -> &mut Block {
        self.slots[i].as_mut().expect("a removed block")
    }
}
