//! Sizes: rounding, pools, segments, splitting, and how the config string sets them. Each test
//! names the function or constant of CUDACachingAllocator.cpp / AllocatorConfig.cpp it encodes.

use super::super::config::roundup_power2_next_division;
use super::super::oom::format_bytes;
use super::*;

/// `round_size`, `kMinBlockSize`: below 512 bytes, 512; then multiples of 512.
#[test]
fn round_size_to_512() {
    let c = Config::default();
    for (asked, got) in [(0, 512), (1, 512), (511, 512), (512, 512), (513, 1024), (MIB + 1, MIB + 512)] {
        assert_eq!(c.round_size(asked), got, "{asked}");
    }
}

/// `roundup_power2_next_division`, with the example of its comment (1200 in 4 divisions: 1280);
/// powers of two stay; too fine a division rounds to the next power of two.
#[test]
fn power2_next_division() {
    assert_eq!(roundup_power2_next_division(1200, 4), 1280);
    assert_eq!(roundup_power2_next_division(1024, 4), 1024);
    assert_eq!(roundup_power2_next_division(1025, 8), 1152);
    assert_eq!(roundup_power2_next_division(1280, 4), 1280);
    assert_eq!(roundup_power2_next_division(3, 8), 4); // power2_divison == 0
}

/// `round_size` with `roundup_power2_divisions:4` (the single-value form fills every interval):
/// only sizes above 512 × divisions use the divisions.
#[test]
fn round_size_single_division_value() {
    let c = conf("roundup_power2_divisions:4");
    assert_eq!(c.roundup_power2_divisions, [4; 16]);
    assert_eq!(c.round_size(1200), 1536); // 1200 ≤ 2048: plain 512 rounding
    assert_eq!(c.round_size(5000), 5120);
    assert_eq!(c.round_size(300 * MIB + 1), 320 * MIB); // [256, 512) MiB in steps of 64 MiB
    assert_eq!(c.round_size(5 * GIB), 5 * GIB);
    assert_eq!(c.round_size(5 * GIB + 1), 6 * GIB);
}

/// `parseRoundUpPower2Divisions`, list form: MiB boundaries index the table by log2, the first
/// entry also fills the intervals below it, `>` fills those after the previous entry;
/// `AcceleratorAllocatorConfig::roundup_power2_divisions(size)` reads it by log2(size) − 20.
#[test]
fn round_size_per_interval_divisions() {
    let c = conf("roundup_power2_divisions:[256:1,512:2,>:4]");
    let mut want = [1; 16];
    want[9] = 2;
    want[10..].fill(4);
    assert_eq!(c.roundup_power2_divisions, want);
    assert_eq!(c.round_size(300 * MIB + 1), 300 * MIB + 512); // 1 division: plain rounding
    assert_eq!(c.round_size(600 * MIB), 768 * MIB); // [512 MiB, 1 GiB) in 2
    assert_eq!(c.round_size(1536 * MIB), 1536 * MIB); // [1, 2) GiB in 4: on a step
    assert_eq!(c.round_size(1536 * MIB + 1), 1792 * MIB);
    // Past 32 GiB: the last entry, 4 ([64, 128) GiB in steps of 16 GiB).
    assert_eq!(c.round_size(100 * GIB), 112 * GIB);

    // libtorch's AllocatorConfigTest.allocator_config_test: (MiB, divisions) it expects.
    let c = conf("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]");
    for (mb, d) in [(32, 8), (64, 8), (128, 2), (256, 4), (512, 2), (1024, 4), (2048, 1), (4096, 1), (8192, 1)] {
        assert_eq!(c.divisions_for(mb * MIB), d, "{mb} MiB");
    }
    let c = conf("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
    for (mb, d) in [(64, 8), (128, 8), (256, 16), (512, 1), (1024, 0), (2048, 8), (4096, 2)] {
        assert_eq!(c.divisions_for(mb * MIB), d, "{mb} MiB");
    }
    // A leading `>` fills from last_index + 1 = 1: entry 0 keeps its 0.
    assert_eq!(conf("roundup_power2_divisions:[>:8]").roundup_power2_divisions[..2], [0, 8]);
}

/// `AcceleratorAllocatorConfig::parseArgs` and `CUDAAllocatorConfig::parseArgs`: what they take,
/// the defaults they keep, and what they refuse.
#[test]
fn parse_config_string() {
    assert_eq!(conf(""), Config::default());
    let c = conf("max_split_size_mb:128, garbage_collection_threshold:0.6,expandable_segments:True,backend:native");
    assert_eq!((c.max_split_size, c.garbage_collection_threshold, c.expandable_segments), (128 * MIB, 0.6, true));
    assert_eq!(c.max_non_split_rounding, 20 * MIB, "defaults to large_segment_size");
    let c = conf("max_split_size_mb:256,large_segment_size_mb:64,per_process_memory_fraction:0.5");
    assert_eq!(
        (c.large_segment_size, c.max_non_split_rounding, c.per_process_memory_fraction),
        (64 * MIB, 64 * MIB, 0.5)
    );
    // AllocatorConfigTest: large_segment_size_mb lowers the floor of max_split_size_mb.
    let c = conf("large_segment_size_mb:15,max_split_size_mb:20,max_non_split_rounding_mb:40");
    assert_eq!((c.large_segment_size, c.max_split_size, c.max_non_split_rounding), (15 * MIB, 20 * MIB, 40 * MIB));
    for bad in [
        "max_split_size_mb:19",                          // below kLargeBuffer
        "max_split_size_mb:20,large_segment_size_mb:25", // below large_segment_size, read first
        "large_segment_size_mb:10",                      // must be > kMinLargeAlloc
        "garbage_collection_threshold:1.0",
        "roundup_power2_divisions:3",
        "roundup_power2_divisions:[100:2]",
        "expandable_segments:true",
        "foo:123,bar:456",
        "roundup_power2_divisions:[64:8", // unterminated list
        "max_split_size_mb:",
    ] {
        assert!(Config::parse(bad).is_err(), "{bad}");
    }
}

/// `NativeCachingAllocator::allocate`: a zero-byte request reaches no pool (`size != 0`), and
/// freeing its null pointer does nothing.
#[test]
fn zero_bytes_allocate_nothing() {
    let mut a = unlimited();
    let id = a.alloc(0, S0).unwrap();
    assert_eq!((id, a.stats()), (BlockId::NULL, Stats::default()));
    a.free(id);
    assert!(a.snapshot().is_empty());
    assert!(a.alloc(1 << 60, S0).is_err(), "1 EiB: refused before malloc");
}

/// `get_pool`: at most `kSmallSize` (1 MiB) after rounding is small.
#[test]
fn pool_choice() {
    let c = Config::default();
    assert_eq!(PoolKind::for_size(c.round_size(MIB)), PoolKind::Small);
    assert_eq!(PoolKind::for_size(c.round_size(MIB + 1)), PoolKind::Large);
    let mut a = unlimited();
    let s = a.alloc(MIB, S0).unwrap();
    let l = a.alloc(MIB + 1, S0).unwrap();
    assert_eq!((a.placed(s).unwrap().pool, a.placed(l).unwrap().pool), (PoolKind::Small, PoolKind::Large));
}

/// `get_allocation_size`: `kSmallBuffer` (2 MiB) for small requests, `large_segment_size`
/// (`kLargeBuffer`, 20 MiB) below `kMinLargeAlloc` (10 MiB), else rounded to `kRoundLarge`.
#[test]
fn segment_sizes() {
    let c = Config::default();
    for (size, seg) in [(512, 2), (MIB, 2), (MIB + 512, 20), (10 * MIB - 512, 20), (10 * MIB, 10), (11 * MIB + 512, 12)]
    {
        assert_eq!(c.allocation_size(size), seg * MIB, "{size}");
    }
    assert_eq!(conf("large_segment_size_mb:64").allocation_size(5 * MIB), 64 * MIB);
    let mut a = unlimited();
    a.alloc(100, S0).unwrap();
    assert_eq!(a.stats().reserved, 2 * MIB);
    a.alloc(5 * MIB, S0).unwrap();
    assert_eq!(a.stats().reserved, 22 * MIB);
    a.alloc(25 * MIB + 1, S0).unwrap();
    assert_eq!(a.stats().reserved, 48 * MIB);
}

/// `should_split`, small pool: split when at least `kMinBlockSize` (512 B) remains.
#[test]
fn split_small_pool() {
    let mut a = unlimited();
    let x = a.alloc(MIB, S0).unwrap();
    let y = a.alloc(MIB - 512, S0).unwrap(); // the rest of the 2 MiB segment, 512 B to spare
    assert_eq!(a.placed(y).unwrap().addr, a.placed(x).unwrap().addr + MIB);
    assert_eq!(cached(&a), vec![(a.placed(y).unwrap().addr + MIB - 512, 512)]);
    let z = a.alloc(1, S0).unwrap();
    assert_eq!(a.placed(z).unwrap().size, 512);
    assert_eq!(a.stats().reserved, 2 * MIB);
    assert!(cached(&a).is_empty());
}

/// `should_split`, large pool: split only when more than `kSmallSize` (1 MiB) remains and the
/// request is below `max_split_size`; else the request takes the whole block.
#[test]
fn split_large_pool() {
    let mut a = unlimited();
    let whole = a.alloc(19 * MIB, S0).unwrap(); // 1 MiB would remain: not > kSmallSize
    assert_eq!(a.placed(whole).unwrap().size, 20 * MIB);
    assert_eq!(a.stats().allocated, 20 * MIB);
    let split = a.alloc(19 * MIB - 512, S0).unwrap(); // 1 MiB + 512 remains
    assert_eq!(a.placed(split).unwrap().size, 19 * MIB - 512);
    assert_eq!(cached(&a).last().unwrap().1, MIB + 512);
    let mut a = on_card(conf("max_split_size_mb:100"), 80 * GIB);
    let below = a.alloc(98 * MIB + MIB / 2, S0).unwrap(); // 100 MiB segment, 1.5 MiB remains
    assert_eq!(a.placed(below).unwrap().size, 98 * MIB + MIB / 2);
    let above = a.alloc(150 * MIB + MIB / 2, S0).unwrap(); // ≥ max_split_size: never split
    assert_eq!(a.placed(above).unwrap().size, 152 * MIB);
}

/// `should_split` with expandable segments: any remainder of at least 512 B is split off.
#[test]
fn split_expandable() {
    let mut a = unlimited();
    a.config.expandable_segments = true;
    let x = a.alloc(19 * MIB, S0).unwrap();
    assert_eq!(a.placed(x).unwrap().size, 19 * MIB);
    assert_eq!(cached(&a).iter().map(|c| c.1).collect::<Vec<_>>(), vec![MIB]);
}

/// The OOM message's sizes (`format_size` in spirit, trimmed).
#[test]
fn bytes_formatting() {
    assert_eq!(format_bytes(512), "512 B");
    assert_eq!(format_bytes(904 * MIB), "904 MiB");
    assert_eq!(format_bytes(1400 * MIB), "1.37 GiB");
    assert_eq!(format_bytes(3 * GIB / 2), "1.5 GiB");
}
