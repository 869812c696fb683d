//! `expandable_segments:True` (Note [Expandable Segments]): per pool and stream, one address range
//! of 1 1/8 the card, mapped page by page (2 MiB small, `large_segment_size` large) as blocks need
//! it, and unmapped page by page when whole free pages are released.
//!
//! This file holds the range itself (`class ExpandableSegment`); the allocator's paths through
//! it (finding room, mapping and unmapping blocks' pages) are in [`super::pages`], as the
//! allocator's state holds these ranges and must not import the code that runs on that state.

use super::Card;

/// `struct ExpandableSegment`: the reserved range and which of its pages are mapped.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct ExpandableSegment {
    pub(super) base: u64,
    /// `segment_size_`: the page.
    pub(super) page: u64,
    /// `max_handles_`: pages in the range.
    pub(super) pages: u64,
    /// `handles_`: mapped pages, trimmed of unmapped ones at the end (`trimHandles`).
    pub(super) mapped: Vec<bool>,
}

impl ExpandableSegment {
    /// The range for a card of `total` bytes: `numSegments(totalGlobalMem + totalGlobalMem / 8)`.
    pub(super) fn new(base: u64, page: u64, total: u64) -> ExpandableSegment {
        let pages = total.saturating_add(total / 8).div_ceil(page);
        ExpandableSegment { base, page, pages, mapped: Vec::new() }
    }

    /// `size()`: the whole range.
    pub(super) fn size(&self) -> u64 {
        self.pages * self.page
    }

    /// `map`: the pages covering [addr, addr + size), all or none (`cuMemCreate` of a page fails
    /// when the card cannot back it, and the pages created so far are released). Returns the
    /// bytes mapped, 0 on failure.
    pub(super) fn map(&mut self, card: &mut Card, addr: u64, size: u64) -> u64 {
        debug_assert_eq!((addr - self.base) % self.page, 0, "maps start on a page");
        let begin = (addr - self.base) / self.page;
        let end = (addr + size - self.base).div_ceil(self.page);
        let bytes = (end - begin) * self.page;
        if begin == end || bytes > card.free {
            return 0;
        }
        if self.mapped.len() < end as usize {
            self.mapped.resize(end as usize, false);
        }
        for i in begin..end {
            debug_assert!(!self.mapped[i as usize], "mapping a mapped page");
            self.mapped[i as usize] = true;
        }
        card.free -= bytes;
        bytes
    }

    /// `unmap`: the pages wholly inside [addr, addr + size). Returns (start, bytes) unmapped.
    pub(super) fn unmap(&mut self, card: &mut Card, addr: u64, size: u64) -> (u64, u64) {
        let begin = (addr - self.base).div_ceil(self.page);
        let end = (addr + size - self.base) / self.page;
        if begin >= end {
            return (addr, 0);
        }
        for i in begin..end {
            self.mapped[i as usize] = false;
        }
        while self.mapped.last() == Some(&false) {
            self.mapped.pop();
        }
        let bytes = (end - begin) * self.page;
        card.free += bytes;
        (self.base + begin * self.page, bytes)
    }
}
