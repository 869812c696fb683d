//! The settings as libtorch parsed them (`AcceleratorAllocatorConfig` in
//! `c10/core/AllocatorConfig.h`, `CUDAAllocatorConfig` in `c10/cuda/CUDAAllocatorConfig.h`), and
//! the size rules of `CUDACachingAllocator.cpp` that depend on them. The constants those rules
//! share with the blocks are in [`super::sizes`].

use super::sizes::{LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE};
use super::PoolKind;

/// `kRoundUpPowerOfTwoIntervals`: `roundup_power2_divisions` has one entry per power of two
/// from 1 MiB (entry 0 also covers everything smaller) to 32 GiB (entry 15, and beyond).
pub(crate) const ROUNDUP_INTERVALS: usize = 16;

/// The allocator's settings, as `AcceleratorAllocatorConfig::parseArgs` leaves them. `Default` is
/// libtorch's: nothing set. [`Config::parse`] reads a `PYTORCH_ALLOC_CONF` string.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Config {
    /// `max_split_size_mb` in bytes: blocks at least this large are never split, and serve only
    /// requests at least this large. Unset: `u64::MAX`.
    pub(crate) max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes: how much larger than a request (of at least
    /// `max_split_size`) an unsplittable cached block may be and still serve it. Defaults to
    /// `large_segment_size`.
    pub(crate) max_non_split_rounding: u64,
    /// `roundup_power2_divisions`, one entry per size interval (see [`ROUNDUP_INTERVALS`]);
    /// 0 or 1: plain 512-byte rounding.
    pub(crate) roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `garbage_collection_threshold`, in (0, 1); 0: off. Acts only under a memory fraction.
    pub(crate) garbage_collection_threshold: f64,
    /// `expandable_segments`.
    pub(crate) expandable_segments: bool,
    /// `large_segment_size_mb` in bytes: the segment of large requests below 10 MiB, and the
    /// page of large expandable segments. 20 MiB (`kLargeBuffer`).
    pub(crate) large_segment_size: u64,
    /// `per_process_memory_fraction` (or `torch.cuda.set_per_process_memory_fraction`): below
    /// 1, reserved memory may not exceed this fraction of the card's total.
    pub(crate) per_process_memory_fraction: f64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            max_split_size: u64::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            large_segment_size: LARGE_BUFFER,
            per_process_memory_fraction: 1.0,
        }
    }
}

impl Config {
    /// The settings libtorch runs with now (`AcceleratorAllocatorConfig`, through the shim);
    /// `None` without the shim. A memory fraction is CUDA's own setting and stays 1 here.
    pub(crate) fn libtorch() -> Option<Config> {
        let raw = crate::memory::allocator_config().ok()?;
        let bytes = |v: i64| u64::try_from(v).ok();
        let mut roundup_power2_divisions = [0; ROUNDUP_INTERVALS];
        for (to, &from) in roundup_power2_divisions.iter_mut().zip(raw.roundup_power2_divisions.iter()) {
            *to = bytes(from).unwrap_or(0);
        }
        Some(Config {
            max_split_size: bytes(raw.max_split_size).unwrap_or(u64::MAX),
            max_non_split_rounding: bytes(raw.max_non_split_rounding_size).unwrap_or(LARGE_BUFFER),
            roundup_power2_divisions,
            garbage_collection_threshold: raw.garbage_collection_threshold,
            expandable_segments: raw.expandable_segments != 0,
            large_segment_size: bytes(raw.large_segment_size).filter(|&b| b > 0).unwrap_or(LARGE_BUFFER),
            per_process_memory_fraction: 1.0,
        })
    }

    /// `AcceleratorAllocatorConfig::roundup_power2_divisions(size)`: the entry of the power-of-two
    /// interval `size` falls in, counted from 1 MiB and clamped to the table.
    pub(crate) fn divisions_for(&self, size: u64) -> u64 {
        let log_size = 63 - u64::from(size.max(1).leading_zeros());
        let start = 20; // log2(kRoundUpPowerOfTwoStart = 1 MiB)
        let index = log_size.saturating_sub(start).min(ROUNDUP_INTERVALS as u64 - 1);
        self.roundup_power2_divisions[index as usize]
    }

    /// `round_size`: below 512 bytes, 512; with more than one division for the size's interval
    /// and a size above 512 × divisions, the next power-of-two division; else a multiple of 512.
    pub(crate) fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let divisions = self.divisions_for(size);
        if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
            roundup_power2_next_division(size, divisions)
        } else {
            size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
        }
    }

    /// `get_allocation_size`: the segment a rounded request gets when nothing cached fits.
    pub(crate) fn allocation_size(&self, size: u64) -> u64 {
        if size <= SMALL_SIZE {
            SMALL_BUFFER
        } else if size < MIN_LARGE_ALLOC {
            self.large_segment_size
        } else {
            size.div_ceil(ROUND_LARGE) * ROUND_LARGE
        }
    }

    /// The page of an expandable segment of `pool` (`find_expandable_block`: `kSmallBuffer` or
    /// `large_segment_size`).
    pub(crate) fn expandable_page(&self, pool: PoolKind) -> u64 {
        match pool {
            PoolKind::Small => SMALL_BUFFER,
            PoolKind::Large => self.large_segment_size,
        }
    }

    /// `setMemoryFraction`: a cap only when the fraction is below 1.
    pub(crate) fn allowed_memory_maximum(&self, total: u64) -> Option<u64> {
        let f = self.per_process_memory_fraction;
        (f < 1.0).then_some((f * total as f64) as u64)
    }
}

/// `roundup_power2_next_division`: rounds `size` up to the next of `divisions` equal steps
/// between the powers of two around it (1200 in 4 divisions: 1280). Powers of two stay.
pub(crate) fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let rounded = size & !(step - 1);
    if rounded == size {
        size
    } else {
        rounded + step
    }
}
