//! Replaying a sequence of events and reporting its peaks and its first failure.

use std::collections::BTreeMap;

use super::{Allocator, BlockId, Oom, Stream};

/// One allocator call. Allocations carry a caller's tag so that later frees can name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// `malloc` of `bytes` on `stream`, known afterwards as `tag`.
    Alloc { tag: u64, bytes: u64, stream: Stream },
    /// `free` of the allocation tagged `tag`.
    Free { tag: u64 },
    /// `free` of a block the starting state held ([`Allocator::from_snapshot`]'s ids).
    FreeBlock(BlockId),
    /// `emptyCache`.
    EmptyCache,
}

/// What a replay did.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Replay {
    /// Highest reserved bytes (segments and mapped pages), counting the starting state.
    pub(crate) peak_reserved: u64,
    /// Highest allocated bytes, counting the starting state.
    pub(crate) peak_allocated: u64,
    /// Reserved bytes when the replay ended.
    pub(crate) reserved: u64,
    /// Allocated bytes when the replay ended.
    pub(crate) allocated: u64,
    /// The first allocation that failed; the replay stops there, as the program would.
    pub(crate) failure: Option<Failure>,
}

/// The first allocation of a replay that could not be placed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Failure {
    /// Its position among the events.
    pub(crate) event: usize,
    /// Its tag.
    pub(crate) tag: u64,
    /// Why.
    pub(crate) oom: Oom,
}

impl Allocator {
    /// Runs `events` from the current state, peaks counted from it.
    ///
    /// Panics on a free of a tag not allocated (or already freed) in this replay.
    pub(crate) fn replay(&mut self, events: &[Event]) -> Replay {
        self.reset_peaks();
        let mut tags: BTreeMap<u64, BlockId> = BTreeMap::new();
        let mut failure = None;
        for (event, e) in events.iter().enumerate() {
            match *e {
                Event::Alloc { tag, bytes, stream } => match self.alloc(bytes, stream) {
                    Ok(id) => {
                        let reused = tags.insert(tag, id);
                        assert!(reused.is_none(), "tag {tag} allocated twice without a free");
                    }
                    Err(oom) => {
                        failure = Some(Failure { event, tag, oom });
                        break;
                    }
                },
                Event::Free { tag } => {
                    let id = tags.remove(&tag).unwrap_or_else(|| panic!("free of tag {tag}, which is not live"));
                    self.free(id);
                }
                Event::FreeBlock(id) => self.free(id),
                Event::EmptyCache => self.empty_cache(),
            }
        }
        let s = self.stats;
        Replay {
            peak_reserved: s.peak_reserved,
            peak_allocated: s.peak_allocated,
            reserved: s.reserved,
            allocated: s.allocated,
            failure,
        }
    }
}
