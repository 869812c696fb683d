//! Where toma remembers the sizes that worked.
//!
//! One process-wide concurrent map holds, per key, the largest size not known to fail. Which key
//! a call uses depends on its [`CacheKind`]:
//!
//! | kind | key | use it when |
//! |---|---|---|
//! | [`StacktraceMemory`](CacheKind::StacktraceMemory) (default) | exact call site + chain of enclosing functions + free memory (256 MiB buckets) | the same function is called from places with different memory needs |
//! | [`Global`](CacheKind::Global) | the decorated function, or the `execute`/builder call site | one size fits every caller |
//! | [`None`](CacheKind::None) | nothing is remembered | every call should start at the initial size |
//!
//! An entry holds the size to start from (the largest that worked) and the smallest size that
//! ran out of memory, and keeps the first below the second. A call never starts at or above a
//! size that failed under its key, so a slow thread that succeeded with a stale, larger size
//! cannot undo another thread's failure. More free memory gives a new key (for
//! `StacktraceMemory`), which starts again at the initial size.
//!
//! A `toma::lazy` step's key names its graph (the shape fingerprint its plan was made for)
//! instead of a call site: under `StacktraceMemory` its key is the graph and the free memory,
//! with no stack walked, since the graph, not the code around it, decides what fits.
//!
//! The map is bounded ([`MAX_ENTRIES`]); when it is full it starts over, which costs at most
//! one round of retries per key.

use std::hash::BuildHasherDefault;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;

use dashmap::DashMap;

use crate::hash::{hash_bytes, location_hash, mix, stack_hash, PassThrough};

/// Which cache a call consults and updates. See the [module docs](self) for the keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CacheKind {
    /// Key: the exact call site, the chain of enclosing functions (a bounded stack walk without
    /// symbol resolution) and the free memory in 256 MiB buckets. The default.
    #[default]
    StacktraceMemory,
    /// Key: the decorated function, or the call site of `execute::*` / a builder's `run`.
    Global,
    /// Nothing is remembered: every call starts at the initial size.
    None,
}

impl CacheKind {
    const fn to_u8(self) -> u8 {
        match self {
            CacheKind::StacktraceMemory => 0,
            CacheKind::Global => 1,
            CacheKind::None => 2,
        }
    }

    const fn from_u8(v: u8) -> Self {
        match v {
            1 => CacheKind::Global,
            2 => CacheKind::None,
            _ => CacheKind::StacktraceMemory,
        }
    }
}

static DEFAULT_KIND: AtomicU8 = AtomicU8::new(CacheKind::StacktraceMemory.to_u8());

/// Sets the cache kind used by every later call that does not name one (process-wide).
///
/// Calls that name a kind (`cache = Global` on an attribute, `.cache(..)` on a builder) keep it.
///
/// ```
/// toma::set_default_cache(toma::CacheKind::Global);
/// assert_eq!(toma::default_cache(), toma::CacheKind::Global);
/// # toma::set_default_cache(toma::CacheKind::StacktraceMemory);
/// ```
pub fn set_default_cache(kind: CacheKind) {
    DEFAULT_KIND.store(kind.to_u8(), Ordering::Relaxed);
    tracing::debug!(?kind, "toma: default cache kind set");
}

/// The cache kind used by calls that do not name one; [`CacheKind::StacktraceMemory`] unless
/// [`set_default_cache`] changed it.
pub fn default_cache() -> CacheKind {
    CacheKind::from_u8(DEFAULT_KIND.load(Ordering::Relaxed))
}

/// The most keys the cache holds before it starts over.
pub const MAX_ENTRIES: usize = 16_384;

/// Free memory is bucketed so that small fluctuations keep the same key.
pub(crate) const MEMORY_BUCKET_BYTES: u64 = 256 << 20;

/// What the cache knows about one key.
///
/// Invariant: `ok < failed`. A call with the key never starts at or above `failed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The size to start from: the largest size that worked (or, right after an
    /// out-of-memory, the size the policy moved to).
    pub(crate) ok: usize,
    /// The smallest size that ran out of memory; `usize::MAX` when none did.
    pub(crate) failed: usize,
}

impl Entry {
    pub(crate) const NO_FAILURE: usize = usize::MAX;
}

struct Store {
    map: DashMap<u64, Entry, BuildHasherDefault<PassThrough>>,
    len: AtomicUsize,
}

fn store() -> &'static Store {
    static STORE: OnceLock<Store> = OnceLock::new();
    STORE.get_or_init(|| Store { map: DashMap::default(), len: AtomicUsize::new(0) })
}

/// What the cache knows about `key`. The entry is copied out: no map guard outlives this call,
/// so user code never runs while a shard is locked.
#[inline]
pub(crate) fn lookup(key: u64, hint: Hint) -> Option<Entry> {
    if let Some(entry) = hint.and_then(|h| unpack(h.load(Ordering::Acquire))) {
        return Some(entry);
    }
    store().map.get(&key).map(|entry| *entry)
}

/// Records that `size` worked: raises `ok` to it, unless `size` has since failed (a slow
/// thread's stale success must not undo another thread's failure).
pub(crate) fn record_success(key: u64, size: usize, hint: Hint) -> Entry {
    update(key, hint, Entry { ok: size, failed: Entry::NO_FAILURE }, |entry| {
        if size < entry.failed {
            entry.ok = entry.ok.max(size);
        }
    })
}

/// Records that `failed` ran out of memory and that the call moved on to `next` (< `failed`).
pub(crate) fn record_out_of_memory(key: u64, failed: usize, next: usize, hint: Hint) -> Entry {
    debug_assert!(next < failed && next > 0);
    update(key, hint, Entry { ok: next, failed }, |entry| {
        entry.failed = entry.failed.min(failed);
        if entry.ok >= entry.failed {
            entry.ok = next.min(entry.failed - 1);
        }
    })
}

/// Applies `change` to the entry under the shard's lock (or inserts `new`), and returns it.
fn update(key: u64, hint: Hint, new: Entry, change: impl FnOnce(&mut Entry)) -> Entry {
    let store = store();
    let mut inserted = false;
    let slot = store.map.entry(key).and_modify(change).or_insert_with(|| {
        inserted = true;
        new
    });
    let entry = *slot.value();
    // Still under the shard's lock: hints change in the order entries do.
    if let Some(hint) = hint {
        hint.store(pack(entry), Ordering::Release);
    }
    drop(slot);
    if inserted && store.len.fetch_add(1, Ordering::Relaxed) + 1 > MAX_ENTRIES {
        // Starting over is the simplest bound; losing entries only costs retries.
        clear();
        tracing::debug!(max = MAX_ENTRIES, "toma: size cache full, cleared");
    }
    entry
}

/// Forgets every remembered size (all kinds, all keys).
pub fn clear() {
    let store = store();
    store.map.clear();
    store.len.store(0, Ordering::Relaxed);
    // After the map: a hint written meanwhile carries the old generation and is ignored.
    bump_generation();
}

/// Number of remembered sizes; at most [`MAX_ENTRIES`].
pub fn len() -> usize {
    store().map.len()
}

/// Identity of a function wrapped by a toma attribute: one `static` per function, built at
/// compile time, so that `Global` keys cost nothing at run time.
#[doc(hidden)]
#[derive(Debug)]
pub struct Site {
    name: &'static str,
    id: u64,
    /// The function's `Global` entry, readable without the map's lock (see [`Hint`]).
    hint: AtomicU64,
}

impl Site {
    /// `name` is the function's path (`concat!(module_path!(), "::", "f")`), `file`/`line`
    /// where it is defined: two functions of one name in one module differ by line.
    pub const fn new(name: &'static str, file: &'static str, line: u32) -> Self {
        let id = mix(hash_bytes(hash_bytes(0x746f_6d61, name.as_bytes()), file.as_bytes()) ^ line as u64);
        Site { name, id, hint: AtomicU64::new(0) }
    }

    /// The function's path.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// Where a call comes from, as far as keys are concerned.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallSite {
    /// What the call belongs to, when it is more than a line: the wrapped function (an
    /// attribute's `Site`), or a graph shape (`toma::lazy`). Its id and a name for logs.
    pub(crate) identity: Option<(u64, &'static str)>,
    /// The exact line that called it (or that called `execute`/`run`).
    pub(crate) caller: &'static Location<'static>,
}

impl Site {
    pub(crate) fn identity(&'static self) -> (u64, &'static str) {
        (self.id, self.name)
    }

    pub(crate) fn hint(&'static self) -> Hint {
        Some(&self.hint)
    }
}

/// A copy of one key's entry beside the map, for `Global` keys of attribute-wrapped functions:
/// a cache hit then costs one atomic load instead of a shard lock and a probe.
///
/// It is written only under the map's shard lock, right after the entry changes, so hints
/// change in the same order as entries. It packs a generation (16 bits) and `ok`/`failed`
/// (24 bits each); entries that do not fit, and hints from before a [`clear`], are not used,
/// and the map decides.
pub(crate) type Hint = Option<&'static AtomicU64>;

/// Bumped by every clear; 0 never matches, so a zeroed hint is empty.
static GENERATION: AtomicU64 = AtomicU64::new(1);
const HINT_BITS: u32 = 24;
const HINT_MAX: u64 = (1 << HINT_BITS) - 1;

fn pack(entry: Entry) -> u64 {
    let generation = GENERATION.load(Ordering::Acquire) & 0xffff;
    let failed = if entry.failed == Entry::NO_FAILURE { HINT_MAX } else { entry.failed as u64 };
    if entry.ok as u64 >= HINT_MAX || (failed >= HINT_MAX && entry.failed != Entry::NO_FAILURE) {
        return 0;
    }
    generation << (2 * HINT_BITS) | (entry.ok as u64) << HINT_BITS | failed
}

fn unpack(hint: u64) -> Option<Entry> {
    let generation = hint >> (2 * HINT_BITS);
    if generation == 0 || generation != GENERATION.load(Ordering::Acquire) & 0xffff {
        return None;
    }
    let ok = ((hint >> HINT_BITS) & HINT_MAX) as usize;
    let failed = hint & HINT_MAX;
    Some(Entry { ok, failed: if failed == HINT_MAX { Entry::NO_FAILURE } else { failed as usize } })
}

fn bump_generation() {
    // Skip 0 when the 16 bits wrap: a zeroed hint must never look current.
    let next = GENERATION.fetch_add(1, Ordering::AcqRel) + 1;
    if next & 0xffff == 0 {
        GENERATION.fetch_add(1, Ordering::AcqRel);
    }
}

/// Mixes an operation tag into keys so that batch, range and chunked never share entries.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Operation {
    Batch = 1,
    Range = 2,
    #[cfg(feature = "tch")]
    Chunked = 3,
}

/// The cache key of a call, or `None` for [`CacheKind::None`].
///
/// `device` is the CUDA device the work runs on (`None` for the CPU): its free memory goes into
/// `StacktraceMemory` keys. A `planned` call (a `toma::lazy` step, whose identity is its graph)
/// walks no stack.
#[inline]
pub(crate) fn key(kind: CacheKind, op: Operation, site: CallSite, device: Option<usize>, planned: bool) -> Option<u64> {
    let base = mix(op as u64 ^ 0x5eed_0000);
    match kind {
        CacheKind::None => None,
        CacheKind::Global => Some(mix(base ^ site.identity.map_or_else(|| location_hash(site.caller), |(id, _)| id))),
        CacheKind::StacktraceMemory => {
            let (cpu, gpu) = crate::memory::free_memory_reading_for(device);
            let mut h = mix(base ^ 0x57ac_4000 ^ device.map_or(0, |d| d as u64 + 1));
            h = mix(h ^ site.identity.map_or(0, |(id, _)| id));
            h = mix(h ^ location_hash(site.caller));
            if !planned {
                h = mix(h ^ stack_hash());
            }
            h = mix(h ^ (cpu / MEMORY_BUCKET_BYTES));
            h = mix(h ^ gpu.map_or(u64::MAX, |free| free / MEMORY_BUCKET_BYTES));
            Some(h)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The store is process-wide and filling it clears it: tests that read back what they
    /// wrote must not run beside the one that overfills it.
    static STORE_TESTS: Mutex<()> = Mutex::new(());

    fn exclusive() -> std::sync::MutexGuard<'static, ()> {
        STORE_TESTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[test]
    fn entries_keep_ok_below_the_smallest_failure() {
        let _store = exclusive();
        let key = mix(0xdead_beef);
        assert_eq!(lookup(key, None), None);
        assert_eq!(record_success(key, 64, None), Entry { ok: 64, failed: Entry::NO_FAILURE });
        assert_eq!(record_out_of_memory(key, 64, 32, None), Entry { ok: 32, failed: 64 });
        // A stale success above the failure changes nothing; one below it raises `ok`.
        assert_eq!(record_success(key, 64, None), Entry { ok: 32, failed: 64 });
        assert_eq!(record_success(key, 48, None), Entry { ok: 48, failed: 64 });
        // A failure below `ok` pulls it under the failure.
        assert_eq!(record_out_of_memory(key, 40, 20, None), Entry { ok: 20, failed: 40 });
        assert_eq!(record_out_of_memory(key, 56, 28, None), Entry { ok: 20, failed: 40 });
        let fresh = mix(0xfeed);
        assert_eq!(record_out_of_memory(fresh, 10, 5, None), Entry { ok: 5, failed: 10 });
    }

    #[test]
    fn hints_follow_entries_and_clear() {
        let _store = exclusive();
        static SITE: Site = Site::new("m::hinted", "src/h.rs", 7);
        let key = mix(SITE.id ^ 0x41);
        let hint = SITE.hint();
        assert_eq!(lookup(key, hint), None);
        record_out_of_memory(key, 64, 32, hint);
        assert_eq!(unpack(SITE.hint.load(Ordering::Acquire)), Some(Entry { ok: 32, failed: 64 }));
        assert_eq!(lookup(key, hint), Some(Entry { ok: 32, failed: 64 }));
        record_success(key, 40, hint);
        assert_eq!(lookup(key, hint), Some(Entry { ok: 40, failed: 64 }));
        // Entries too large for a hint fall back to the map.
        record_success(key, 63, hint);
        record_out_of_memory(key, usize::MAX - 1, 1 << 40, None);
        assert_eq!(pack(Entry { ok: 1 << 30, failed: Entry::NO_FAILURE }), 0);
        assert_eq!(
            unpack(pack(Entry { ok: 5, failed: Entry::NO_FAILURE })),
            Some(Entry { ok: 5, failed: Entry::NO_FAILURE })
        );
        // A clear makes every hint stale.
        let before = SITE.hint.load(Ordering::Acquire);
        clear();
        assert_eq!(unpack(before), None);
        assert_eq!(lookup(key, hint), None);
    }

    #[test]
    fn a_million_distinct_keys_stay_bounded() {
        let _store = exclusive();
        for i in 0..1_000_000u64 {
            record_success(mix(i ^ 0xb0b0_0000_0000), 1 + (i as usize % 7), None);
            if i % 65_536 == 0 {
                assert!(len() <= MAX_ENTRIES, "{} entries", len());
            }
        }
        assert!(len() <= MAX_ENTRIES, "{} entries", len());
        assert!(store().len.load(Ordering::Relaxed) <= MAX_ENTRIES);
    }

    #[test]
    fn sites_differ_by_name_and_line() {
        let a = Site::new("m::f", "src/a.rs", 1);
        let b = Site::new("m::g", "src/a.rs", 1);
        let c = Site::new("m::f", "src/a.rs", 2);
        assert_ne!(a.id, b.id);
        assert_ne!(a.id, c.id);
        assert_eq!(a.id, Site::new("m::f", "src/a.rs", 1).id);
        assert_eq!(a.name(), "m::f");
    }

    #[track_caller]
    fn here() -> &'static Location<'static> {
        Location::caller()
    }

    #[test]
    fn keys_by_kind() {
        static SITE: Site = Site::new("m::f", "src/a.rs", 1);
        let (l1, l2) = (here(), here());
        let cs = |caller| CallSite { identity: Some(SITE.identity()), caller };
        assert_eq!(key(CacheKind::None, Operation::Batch, cs(l1), None, false), None);
        // Global: the function decides, not the line.
        assert_eq!(
            key(CacheKind::Global, Operation::Batch, cs(l1), None, false),
            key(CacheKind::Global, Operation::Batch, cs(l2), None, false)
        );
        assert_ne!(
            key(CacheKind::Global, Operation::Batch, cs(l1), None, false),
            key(CacheKind::Global, Operation::Range, cs(l1), None, false)
        );
        // StacktraceMemory: the line decides.
        let mut same = Vec::new();
        for _ in 0..2 {
            same.push(key(CacheKind::StacktraceMemory, Operation::Batch, cs(l1), None, false));
        }
        assert_eq!(same[0], same[1]);
        assert_ne!(same[0], key(CacheKind::StacktraceMemory, Operation::Batch, cs(l2), None, false));
        assert_ne!(same[0], key(CacheKind::Global, Operation::Batch, cs(l1), None, false));
    }

    /// A key computed one frame deeper: another chain of enclosing functions.
    #[inline(never)]
    fn key_deeper(site: CallSite, planned: bool) -> Option<u64> {
        std::hint::black_box(key(CacheKind::StacktraceMemory, Operation::Range, site, None, planned))
    }

    #[test]
    fn a_planned_key_is_its_graph_not_its_stack() {
        let site = CallSite { identity: Some((0x6a7a, "toma::lazy")), caller: here() };
        let shallow = |planned| key(CacheKind::StacktraceMemory, Operation::Range, site, None, planned);
        // Another chain of functions: another key, unless the call was planned.
        assert_ne!(shallow(false), key_deeper(site, false));
        assert_eq!(shallow(true), key_deeper(site, true));
        // The graph still decides.
        let other = CallSite { identity: Some((0x6a7b, "toma::lazy")), ..site };
        assert_ne!(shallow(true), key(CacheKind::StacktraceMemory, Operation::Range, other, None, true));
    }
}
