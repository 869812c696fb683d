//! A replay model of libtorch 2.11's CUDA caching allocator, written from its source:
//! `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`), `c10/core/AllocatorConfig.{h,cpp}`
//! and `c10/cuda/CUDAAllocatorConfig.h`.
//!
//! It knows nothing of tensors or ops: it takes allocation and free events (bytes and a stream)
//! and answers what the allocator would hold, segment by segment, and where it would fail.
//!
//! - A request is rounded ([`Config::round_size`]), goes to the small pool (≤ 1 MiB) or the large
//!   one, and is served by the best-fitting cached free block of its pool and stream, ordered
//!   by (stream, size, address) as `BlockComparatorSize` orders them, or by a new segment
//!   ([`Config::allocation_size`]: 2 MiB, 20 MiB, or the request rounded to 2 MiB).
//! - A found block is split when `should_split` says so; the remainder stays free in the same
//!   segment. A freed block merges with free neighbours of its own segment only.
//! - When the card cannot back a new segment, libtorch frees cached blocks and tries again
//!   (`release_available_cached_blocks`, then `release_cached_blocks`); what still fails is an
//!   [`Oom`], which says why: the card left, the cached pieces and the largest of them.
//! - `expandable_segments:True` grows one reserved address range per pool and stream in pages
//!   of 2 MiB (small pool) or `large_segment_size` (20 MiB, large pool), and unmaps free pages on
//!   release.
//! - Under a memory fraction, reserved bytes are capped, and `garbage_collection_threshold`
//!   frees long-unused cached segments before a new one is made.
//!
//! The card is explicit ([`Card`]): the bytes it can still give to new segments. A replay can
//! start from a filled card: [`Allocator::from_snapshot`] takes the segments
//! `torch.cuda.memory_snapshot()` lists.
//!
//! The source read is a stored main-branch revision (its commit unrecorded) whose API, constants
//! and messages match the 2.11.0 wheel's headers and `libc10_cuda.so`.
//!
//! Not modelled: CUDA graphs' private pools and mempools, `recordStream` (blocks used on other
//! streams wait for events before they are free), free-memory callbacks, IPC. Addresses of new
//! segments are assigned upwards in order of creation, where `cudaMalloc` chooses its own; they
//! only break ties between free blocks of equal size.
//!
//! Files, each importing only ones listed before it (`scripts/layers.py` checks for cycles):
//! `sizes` (libtorch's constants, [`PoolKind`]) and `card` ([`Card`]), leaves; `block` (blocks,
//! free-block pools, the slab); `config` and `parse` (the settings); `expandable` (one reserved
//! range and its pages); `state` ([`Allocator`]'s members); `oom` ([`Oom`], data only); then the
//! code that runs on the state, each file an `impl Allocator`: `alloc` (`malloc`, `free`),
//! `release`, `pages` (expandable segments), `snapshot`, `replay`.

mod alloc;
mod block;
mod card;
mod config;
mod expandable;
mod oom;
mod pages;
mod parse;
mod release;
mod replay;
mod sizes;
mod snapshot;
mod state;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod trace;

// The types the files share, named through here (`super::Allocator`). This file defines nothing,
// so importing through it depends only on the file that defines each type. The replay's own
// vocabulary (`replay::{Event, Replay, Failure}`) joins them when something outside uses it: an
// unused re-export is an error in the crate's build.
pub(crate) use block::Stream;
pub(crate) use card::Card;
pub(crate) use config::Config;
pub(crate) use oom::{format_bytes, Oom};
pub(crate) use sizes::PoolKind;
pub(crate) use snapshot::{BlockState, SegmentState};
pub(crate) use state::{Allocator, BlockId};
