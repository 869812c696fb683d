//! Properties of random allocation sequences, from a small deterministic PRNG: the model's
//! bookkeeping holds after every event, merges stay in their segment, replays are repeatable,
//! an unlimited card never runs out, and `empty_cache` keeps exactly the segments in use.

use std::collections::BTreeMap;

use super::*;

/// xorshift64*: deterministic, no crates.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `n` events mixing small, medium, large and huge requests on two streams, frees of live
/// allocations, and now and then an `emptyCache`. Tags start at `first_tag`.
fn events(seed: u64, n: usize, first_tag: u64) -> Vec<Event> {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let (mut live, mut out, mut tag) = (Vec::new(), Vec::with_capacity(n), first_tag);
    while out.len() < n {
        let roll = rng.below(100);
        if roll < 2 {
            out.push(Event::EmptyCache);
        } else if live.is_empty() || roll < 55 {
            let bytes = match rng.below(100) {
                0..40 => 1 + rng.below(MIB),
                40..70 => MIB + rng.below(9 * MIB),
                70..95 => 10 * MIB + rng.below(190 * MIB),
                _ => 200 * MIB + rng.below(800 * MIB),
            };
            let stream = if rng.below(5) == 0 { S1 } else { S0 };
            out.push(Event::Alloc { tag, bytes, stream });
            live.push(tag);
            tag += 1;
        } else {
            let k = rng.below(live.len() as u64) as usize;
            out.push(Event::Free { tag: live.swap_remove(k) });
        }
    }
    out
}

/// The settings the properties run under.
fn configs() -> Vec<Config> {
    [
        "",
        "max_split_size_mb:64",
        "expandable_segments:True",
        "roundup_power2_divisions:[256:1,512:2,>:4],max_split_size_mb:200,max_non_split_rounding_mb:40",
        "per_process_memory_fraction:0.9,garbage_collection_threshold:0.5",
        "expandable_segments:True,large_segment_size_mb:64,roundup_power2_divisions:8",
    ]
    .iter()
    .map(|s| conf(s))
    .collect()
}

/// The range a block's free memory may cover: its segment, or its expandable range.
fn segment_of(a: &Allocator, id: BlockId) -> (u64, u64) {
    let mut i = a.live[&id];
    if let Some(es) = a.blocks[i].expandable {
        let es = a.segments[es].as_ref().unwrap();
        return (es.base, es.base + es.size());
    }
    while let Some(p) = a.blocks[i].prev {
        i = p;
    }
    let start = a.blocks[i].addr;
    let mut end = start;
    let mut b = Some(i);
    while let Some(j) = b {
        end += a.blocks[j].size;
        b = a.blocks[j].next;
    }
    (start, end)
}

/// Non-expandable segments as (address, size).
fn whole_segments(a: &Allocator) -> Vec<(u64, u64)> {
    a.snapshot().iter().filter(|s| !s.expandable).map(|s| (s.address.unwrap(), s.total())).collect()
}

/// Runs `events` step by step on a 6 GiB card, checking after each; failed allocations are
/// skipped, with their frees. Returns the number of failures.
fn run_checked(config: Config, events: &[Event]) -> usize {
    let mut a = Allocator::new(config, Card::new(8 * GIB, 6 * GIB));
    let start = conserved(&a);
    let (mut tags, mut fails) = (BTreeMap::new(), 0);
    for e in events {
        match *e {
            Event::Alloc { tag, bytes, stream } => match a.alloc(bytes, stream) {
                Ok(id) => {
                    assert!(a.placed(id).unwrap().size >= bytes);
                    tags.insert(tag, id);
                }
                Err(oom) => {
                    assert!(oom.largest_usable < oom.rounded || a.config.max_split_size < u64::MAX, "{oom}");
                    fails += 1;
                }
            },
            Event::Free { tag } => {
                let Some(id) = tags.remove(&tag) else { continue };
                let (lo, hi) = segment_of(&a, id);
                let (addr, segments) = (a.placed(id).unwrap().addr, whole_segments(&a));
                a.free(id);
                let (at, size) = *cached(&a).iter().rfind(|c| c.0 <= addr).unwrap();
                assert!(lo <= at && at + size <= hi, "the freed block merged past its segment");
                assert_eq!(whole_segments(&a), segments, "a free changes no segment");
            }
            Event::FreeBlock(id) => a.free(id),
            Event::EmptyCache => a.empty_cache(),
        }
        check(&a, start);
    }
    fails
}

/// Bookkeeping holds, reserved ≥ allocated, after every event, OOMs included, and a freed block
/// merges only within its segment (`try_merge_blocks`).
#[test]
fn every_event_keeps_the_books_and_merges_in_segment() {
    let mut fails = 0;
    for (k, config) in configs().into_iter().enumerate() {
        for seed in 0..6 {
            fails += run_checked(config.clone(), &events(seed * 31 + k as u64, 400, 0));
        }
    }
    assert!(fails > 0, "the 6 GiB card should run out now and then, to exercise the release paths");
}

/// The model is deterministic: the same events from the same state give the same segments,
/// whether the state is a copy or rebuilt from its snapshot.
#[test]
fn replays_are_repeatable() {
    for (k, config) in configs().into_iter().enumerate() {
        for seed in 0..4 {
            let mut a = Allocator::new(config.clone(), Card::new(8 * GIB, 6 * GIB));
            let prefix = events(seed + 100 * k as u64, 150, 0);
            let mut ok = prefix.clone();
            if let Some(f) = a.clone().replay(&prefix).failure {
                ok.truncate(f.event);
            }
            a.replay(&ok);
            let suffix = events(seed + 7, 200, 1_000_000);
            let (mut x, mut y) = (a.clone(), a.clone());
            assert_eq!(x.replay(&suffix), y.replay(&suffix));
            assert_eq!(x.snapshot(), y.snapshot());
            let (mut x, ids) = Allocator::from_snapshot(config.clone(), a.card(), &a.snapshot()).unwrap();
            assert_eq!(x.snapshot(), a.snapshot(), "snapshot round trip");
            let (mut y, _) = Allocator::from_snapshot(config.clone(), a.card(), &a.snapshot()).unwrap();
            let frees: Vec<Event> = ids.iter().step_by(2).map(|&id| Event::FreeBlock(id)).collect();
            let events: Vec<Event> = frees.into_iter().chain(suffix).collect();
            assert_eq!(x.replay(&events), y.replay(&events));
            assert_eq!(x.snapshot(), y.snapshot());
        }
    }
}

/// With a card that never runs out (and no memory fraction), nothing fails.
#[test]
fn unlimited_card_never_fails() {
    for config in configs().into_iter().filter(|c| c.per_process_memory_fraction == 1.0) {
        for seed in 0..6 {
            let mut a = Allocator::new(config.clone(), Card::unlimited());
            let r = a.replay(&events(seed, 600, 0));
            assert_eq!(r.failure, None);
            assert!(r.peak_reserved >= r.peak_allocated);
        }
    }
}

/// `emptyCache` leaves exactly the segments (mapped ranges) that hold a live block.
#[test]
fn empty_cache_keeps_segments_in_use() {
    for config in configs() {
        for seed in 0..4 {
            let mut a = Allocator::new(config.clone(), Card::new(8 * GIB, 6 * GIB));
            let evs = events(seed + 50, 300, 0);
            let upto = a.clone().replay(&evs).failure.map_or(evs.len(), |f| f.event);
            a.replay(&evs[..upto]);
            a.empty_cache();
            let segments = a.snapshot();
            assert!(segments.iter().all(|s| s.allocated() > 0), "a segment without live blocks survived");
            assert_eq!(a.stats().reserved, segments.iter().map(SegmentState::total).sum::<u64>());
            check(&a, conserved(&a));
        }
    }
}
