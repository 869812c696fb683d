//! Tests of the model: each rule of the allocator's source on a small case (`rules_size`,
//! `rules_reuse`), properties of random replays (`props`), and the case that motivated the
//! model (`scenario`). `check` verifies the model's own bookkeeping after every step.

mod props;
mod rules_reuse;
mod rules_size;
mod scenario;

use std::collections::BTreeSet;

// What the facade does not re-export yet (see `mod.rs`), for these files to name.
pub(super) use super::replay::{Event, Failure, Replay};
pub(super) use super::snapshot::{BlockState, SegmentState};
pub(super) use super::state::{Placed, Stats};
use super::*;

pub(super) const MIB: u64 = 1 << 20;
pub(super) const GIB: u64 = 1 << 30;
pub(super) const S0: Stream = Stream(0);
pub(super) const S1: Stream = Stream(1);

/// An allocator with `config` on an 80 GiB card with `free` bytes free.
pub(super) fn on_card(config: Config, free: u64) -> Allocator {
    Allocator::new(config, Card::new(80 * GIB, free))
}

/// An allocator with libtorch's defaults on a card that never runs out.
pub(super) fn unlimited() -> Allocator {
    Allocator::new(Config::default(), Card::unlimited())
}

/// A config from a `PYTORCH_ALLOC_CONF` string libtorch accepts.
pub(super) fn conf(s: &str) -> Config {
    Config::parse(s).unwrap()
}

/// Cached free blocks as (address, size), by address.
pub(super) fn cached(a: &Allocator) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> =
        a.pools.iter().flat_map(|p| p.blocks.keys().map(|&(_, size, addr)| (addr, size))).collect();
    v.sort();
    v
}

/// The model's bookkeeping: links, pools, counters, pages and the card all agree. `conserved` is
/// the card's free bytes plus the reserved bytes at the start, which no step changes.
pub(super) fn check(a: &Allocator, conserved: u64) {
    let (mut allocated, mut reserved) = (0, 0);
    let (mut free, mut unmapped) = (BTreeSet::new(), BTreeSet::new());
    for (i, b) in a.blocks.iter() {
        if let Some(n) = b.next {
            let n_ = &a.blocks[n];
            assert_eq!(n_.prev, Some(i), "next's prev points back");
            assert_eq!(b.addr + b.size, n_.addr, "segment neighbours touch");
            assert_eq!((b.stream, b.pool, b.expandable), (n_.stream, n_.pool, n_.expandable));
            let both_free = !b.allocated && !n_.allocated && b.mapped == n_.mapped;
            assert!(!both_free, "free neighbours alike are merged");
        }
        if let Some(p) = b.prev {
            assert_eq!(a.blocks[p].next, Some(i), "prev's next points back");
        }
        assert!(b.mapped || (!b.allocated && b.expandable.is_some()), "only expandable free blocks are unmapped");
        if b.allocated {
            allocated += b.size;
        }
        if b.mapped {
            reserved += b.size;
        }
        match (b.allocated, b.mapped) {
            (false, true) => free.insert((b.pool, b.size_key(), i)),
            (false, false) => unmapped.insert((b.pool, b.addr_key(), i)),
            _ => true,
        };
    }
    let pooled: BTreeSet<_> = [PoolKind::Small, PoolKind::Large]
        .into_iter()
        .flat_map(|k| a.pools[k.index()].blocks.iter().map(move |(&key, &i)| (k, key, i)))
        .collect();
    assert_eq!(pooled, free, "the pools hold exactly the free mapped blocks");
    let pooled: BTreeSet<_> = [PoolKind::Small, PoolKind::Large]
        .into_iter()
        .flat_map(|k| a.pools[k.index()].unmapped.iter().map(move |(&key, &i)| (k, key, i)))
        .collect();
    assert_eq!(pooled, unmapped, "the unmapped sets hold exactly the unmapped blocks");
    let live: BTreeSet<_> = a.live.values().copied().collect();
    let alive: BTreeSet<_> = a.blocks.iter().filter(|(_, b)| b.allocated).map(|(i, _)| i).collect();
    assert_eq!(live, alive, "ids name exactly the allocated blocks");
    assert_eq!(a.stats.allocated, allocated);
    assert_eq!(a.stats.reserved, reserved);
    assert!(a.stats.reserved >= a.stats.allocated);
    assert!(a.stats.peak_reserved >= a.stats.reserved && a.stats.peak_allocated >= a.stats.allocated);
    assert_eq!(a.card.free + a.stats.reserved, conserved, "the card gets back what segments give up");
    for (k, es) in a.segments.iter().enumerate() {
        let Some(es) = es else { continue };
        let pages = es.mapped.iter().filter(|&&m| m).count() as u64;
        let mapped: u64 =
            a.blocks.iter().filter(|(_, b)| b.expandable == Some(k) && b.mapped).map(|(_, b)| b.size).sum();
        assert_eq!(pages * es.page, mapped, "mapped blocks cover exactly the mapped pages");
        let span: u64 = a.blocks.iter().filter(|(_, b)| b.expandable == Some(k)).map(|(_, b)| b.size).sum();
        assert_eq!(span, es.size(), "an expandable segment's blocks cover its range");
    }
}

/// `check` from the allocator's current state.
pub(super) fn conserved(a: &Allocator) -> u64 {
    a.card.free + a.stats.reserved
}
