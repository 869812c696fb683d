//! Reuse and release: best fit, merging, release-and-retry, oversize blocks, expandable pages and
//! garbage collection. Each test names the function of CUDACachingAllocator.cpp it encodes.

use super::*;

/// `get_free_block` with `BlockComparatorSize`: the smallest cached block that fits, the lowest
/// address among equals; only blocks of the request's stream.
#[test]
fn best_fit_smallest_then_lowest_address() {
    let mut a = unlimited();
    let ids: Vec<BlockId> = [30, 40, 30].iter().map(|&m| a.alloc(m * MIB, S0).unwrap()).collect();
    let addrs: Vec<u64> = ids.iter().map(|&id| a.placed(id).unwrap().addr).collect();
    ids.into_iter().for_each(|id| a.free(id));
    let first = a.alloc(25 * MIB, S0).unwrap();
    assert_eq!(a.placed(first).unwrap().addr, addrs[0], "30 MiB at the lower address");
    let second = a.alloc(25 * MIB, S0).unwrap();
    assert_eq!(a.placed(second).unwrap().addr, addrs[2], "the 5 MiB rest is too small; the other 30 MiB");
    let third = a.alloc(35 * MIB, S0).unwrap();
    assert_eq!(a.placed(third).unwrap().addr, addrs[1]);
    assert_eq!(a.stats().reserved, 100 * MIB, "no new segment");
    let other = a.alloc(MIB * 4, S1).unwrap();
    assert_ne!(a.stats().reserved, 100 * MIB, "stream 0's cached pieces do not serve stream 1");
    assert_eq!(a.placed(other).unwrap().stream, S1);
}

/// `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of its segment
/// (prev/next links), never with the adjacent free memory of another segment.
#[test]
fn merging_stays_within_a_segment() {
    let mut a = unlimited();
    let x = a.alloc(8 * MIB, S0).unwrap(); // 20 MiB segment: [x 8][12 free]
    let y = a.alloc(8 * MIB, S0).unwrap(); // [x 8][y 8][4 free]
    let z = a.alloc(12 * MIB, S0).unwrap(); // its own 12 MiB segment, right after
    let seg1 = a.placed(x).unwrap().addr;
    assert_eq!(a.placed(z).unwrap().addr, seg1 + 20 * MIB, "the two segments touch");
    a.free(y);
    assert_eq!(cached(&a), vec![(seg1 + 8 * MIB, 12 * MIB)]);
    a.free(z);
    assert_eq!(cached(&a), vec![(seg1 + 8 * MIB, 12 * MIB), (seg1 + 20 * MIB, 12 * MIB)]);
    a.free(x);
    assert_eq!(cached(&a), vec![(seg1, 20 * MIB), (seg1 + 20 * MIB, 12 * MIB)]);
    assert_eq!(a.snapshot().len(), 2);
    check(&a, conserved(&a));
}

/// `malloc`'s last resort: `release_cached_blocks` frees every unsplit cached segment and
/// `alloc_block` runs again (`num_alloc_retries`).
#[test]
fn release_and_retry_frees_unsplit_segments() {
    let mut a = on_card(Config::default(), 100 * MIB);
    let x = a.alloc(60 * MIB, S0).unwrap();
    a.free(x);
    let y = a.alloc(70 * MIB, S0).unwrap(); // 60 cached + 40 on the card: free the 60, retry
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!((a.stats().reserved, a.card().free), (70 * MIB, 30 * MIB));
    assert_eq!(a.placed(y).unwrap().size, 70 * MIB);
}

/// `release_cached_blocks` frees only segments without live blocks: a cached piece split from a
/// segment holding a live block stays, and the request fails.
#[test]
fn release_keeps_split_segments() {
    let mut a = on_card(Config::default(), 100 * MIB);
    let _x = a.alloc(8 * MIB, S0).unwrap(); // 20 MiB segment: [x 8][12 free]
    let y = a.alloc(60 * MIB, S0).unwrap();
    a.free(y);
    let oom = a.alloc(90 * MIB, S0).unwrap_err();
    assert_eq!((a.stats().reserved, a.card().free), (20 * MIB, 80 * MIB), "the 60 MiB segment went back");
    assert_eq!((oom.cached_free, oom.largest_usable, oom.card_free), (12 * MIB, 12 * MIB, 80 * MIB));
    assert_eq!(a.stats().num_ooms, 1);
}

/// `get_free_block`'s `max_split_size` rules: an oversize cached block (≥ max_split_size) never
/// serves a request below max_split_size, serves a larger one only when it is less than
/// `max_non_split_rounding` (20 MiB) bigger, and is then taken whole.
#[test]
fn oversize_blocks_reuse_rule() {
    let mut a = on_card(conf("max_split_size_mb:100"), 80 * GIB);
    let x = a.alloc(200 * MIB, S0).unwrap();
    let at = a.placed(x).unwrap().addr;
    a.free(x);
    let y = a.alloc(180 * MIB + 512, S0).unwrap(); // 200 < 180.0005 + 20: reused, unsplit
    assert_eq!(a.placed(y).unwrap(), Placed { addr: at, size: 200 * MIB, stream: S0, pool: PoolKind::Large });
    assert_eq!(a.stats().allocated, 200 * MIB);
    a.free(y);
    let z = a.alloc(180 * MIB, S0).unwrap(); // 200 ≥ 180 + 20: refused, new segment
    assert_ne!(a.placed(z).unwrap().addr, at);
    a.free(z);
    let w = a.alloc(50 * MIB, S0).unwrap(); // below max_split_size: oversize blocks refused
    assert_eq!(a.stats().reserved, 430 * MIB);
    assert_eq!(a.placed(w).unwrap().size, 50 * MIB);
}

/// `release_available_cached_blocks`: before freeing everything, free the smallest oversize
/// cached block at least as large as the request; failing one, the largest ones downwards until
/// they add up to it.
#[test]
fn oversize_blocks_released_first() {
    let mut a = on_card(conf("max_split_size_mb:100"), 600 * MIB);
    let ids: Vec<BlockId> = [150, 120, 300].iter().map(|&m| a.alloc(m * MIB, S0).unwrap()).collect();
    ids.into_iter().for_each(|id| a.free(id));
    let x = a.alloc(130 * MIB, S0).unwrap(); // 150 ≥ 130 + 20: not reusable; freeing it suffices
    assert_eq!(a.stats().num_alloc_retries, 0, "release_cached_blocks not needed");
    assert_eq!(cached(&a).iter().map(|c| c.1).collect::<Vec<_>>(), vec![120 * MIB, 300 * MIB]);
    a.free(x);
    let mut a = on_card(conf("max_split_size_mb:100"), 300 * MIB);
    let ids: Vec<BlockId> = [150, 120].iter().map(|&m| a.alloc(m * MIB, S0).unwrap()).collect();
    ids.into_iter().for_each(|id| a.free(id));
    a.alloc(250 * MIB, S0).unwrap(); // none ≥ 250: 150 then 120 go, 270 ≥ 250
    assert_eq!((a.stats().num_alloc_retries, a.stats().reserved), (0, 250 * MIB));
    assert!(cached(&a).is_empty());
}

/// Expandable segments (`try_allocate_expandable_block`, `map_block`): pages of 2 MiB (small)
/// and 20 MiB (large) mapped as requests need them, one growing range per pool and stream.
#[test]
fn expandable_pages() {
    let mut a = Allocator::new(conf("expandable_segments:True"), Card::unlimited());
    assert!(a.config().expandable_segments);
    let s = a.alloc(100, S0).unwrap();
    assert_eq!(a.stats().reserved, 2 * MIB);
    let l = a.alloc(5 * MIB, S0).unwrap();
    assert_eq!(a.stats().reserved, 22 * MIB);
    let m = a.alloc(30 * MIB, S0).unwrap(); // 15 MiB free + one more 20 MiB page
    assert_eq!(a.stats().reserved, 42 * MIB);
    assert_eq!(a.placed(m).unwrap().addr, a.placed(l).unwrap().addr + 5 * MIB, "the range grows in place");
    let large: Vec<SegmentState> = a.snapshot().into_iter().filter(|s| s.pool == PoolKind::Large).collect();
    assert_eq!((large.len(), large[0].total()), (1, 40 * MIB));
    check(&a, conserved(&a));
    let big = Allocator::new(conf("expandable_segments:True,large_segment_size_mb:64"), Card::unlimited());
    let mut big = big;
    big.alloc(5 * MIB, S0).unwrap();
    assert_eq!(big.stats().reserved, 64 * MIB, "large pages are large_segment_size");
    let _ = (s, l);
}

/// `release_blocks` / `unmap_block`: only whole free pages are unmapped; a range with nothing
/// mapped is given up (`release_expandable_segment`).
#[test]
fn expandable_unmap_whole_pages() {
    let mut a = Allocator::new(conf("expandable_segments:True"), Card::unlimited());
    let start = conserved(&a);
    let s = a.alloc(100, S0).unwrap();
    let l = a.alloc(5 * MIB, S0).unwrap();
    let m = a.alloc(30 * MIB, S0).unwrap();
    a.free(m);
    a.empty_cache(); // [5, 40) MiB free: page [20, 40) goes, page [0, 20) holds l
    assert_eq!(a.stats().reserved, 22 * MIB);
    check(&a, start);
    a.free(l);
    a.free(s);
    a.empty_cache();
    assert_eq!(a.stats().reserved, 0);
    assert!(a.segments.iter().all(Option::is_none), "empty ranges are released");
    assert_eq!(a.card(), Card::unlimited());
    check(&a, start);
}

/// `garbage_collect_cached_blocks`: under a memory fraction, once reserved memory passes
/// `garbage_collection_threshold` of the cap, unsplit cached segments older than average (in
/// searches of the large pool) are freed before a new segment is made.
#[test]
fn garbage_collection_threshold() {
    let run = |config: &str| {
        let mut a = Allocator::new(conf(config), Card::new(2000 * MIB, 2000 * MIB));
        let ids: Vec<BlockId> = (0..3).map(|_| a.alloc(200 * MIB, S0).unwrap()).collect();
        let oldest = a.placed(ids[0]).unwrap().addr;
        a.free(ids[0]); // cached at search 3
        a.alloc(30 * MIB, S1).unwrap(); // searches 4 and 5: 630 MiB ≤ 650 MiB, no GC yet
        a.alloc(30 * MIB, S1).unwrap();
        a.free(ids[1]); // cached at search 5
        a.free(ids[2]);
        a.alloc(250 * MIB, S0).unwrap(); // search 6 misses; 660 > 650: GC frees ages ≥ 5/3
        (a, oldest)
    };
    let (a, oldest) = run("per_process_memory_fraction:0.5,garbage_collection_threshold:0.65");
    let left = cached(&a);
    assert_eq!(left.iter().map(|c| c.1).collect::<Vec<_>>(), vec![200 * MIB, 200 * MIB]);
    assert!(left.iter().all(|c| c.0 != oldest), "the oldest went");
    assert_eq!(a.stats().reserved, 710 * MIB);
    let (a, _) = run("garbage_collection_threshold:0.65"); // no fraction: GC never runs
    assert_eq!(cached(&a).len(), 3);
    assert_eq!(a.stats().reserved, 910 * MIB);
}

/// The memory fraction caps reserved bytes in `alloc_block` whatever the card has left.
#[test]
fn memory_fraction_caps_segments() {
    let mut a = Allocator::new(conf("per_process_memory_fraction:0.25"), Card::new(1000 * MIB, 1000 * MIB));
    a.alloc(200 * MIB, S0).unwrap();
    let oom = a.alloc(100 * MIB, S0).unwrap_err();
    assert_eq!((oom.allowed, oom.card_free), (Some(250 * MIB), 800 * MIB));
    assert!(oom.to_string().contains("the memory fraction allows"), "{oom}");
}

/// `from_snapshot` then `snapshot` gives the segments back, expandable ones included.
#[test]
fn snapshot_round_trip() {
    let seg = |address, expandable, pool, blocks: &[(u64, bool)]| SegmentState {
        address: Some(address),
        stream: S0,
        pool,
        expandable,
        blocks: blocks.iter().map(|&(size, allocated)| BlockState { size, allocated }).collect(),
    };
    let base = 1 << 44;
    let mut segments = vec![
        seg(base, false, PoolKind::Large, &[(10 * MIB, true), (10 * MIB, false)]),
        seg(base + 64 * MIB, false, PoolKind::Small, &[(512, false), (MIB, true), (MIB - 512, false)]),
        seg(1 << 45, true, PoolKind::Large, &[(30 * MIB, true), (10 * MIB, false)]),
        seg((1 << 45) + 80 * MIB, true, PoolKind::Large, &[(20 * MIB, true)]),
    ];
    let (a, ids) = Allocator::from_snapshot(Config::default(), Card::new(80 * GIB, 10 * GIB), &segments).unwrap();
    assert_eq!(ids.len(), 4);
    assert_eq!(a.snapshot(), segments);
    assert_eq!(a.stats().reserved, 20 * MIB + 2 * MIB + 60 * MIB);
    assert_eq!(a.placed(ids[3]).unwrap().addr, (1 << 45) + 80 * MIB);
    check(&a, conserved(&a));
    // A segment without an address goes past the expandable reservation, not into it.
    segments.push(SegmentState { address: None, ..segments[0].clone() });
    let (a, ids) = Allocator::from_snapshot(Config::default(), Card::new(80 * GIB, 10 * GIB), &segments).unwrap();
    assert!(a.placed(ids[4]).unwrap().addr >= (1 << 45) + 90 * GIB);
    check(&a, conserved(&a));
}
