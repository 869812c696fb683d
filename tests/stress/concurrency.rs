//! Many threads sharing the caches: no deadlock, no lost update, no poisoning.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use toma::{Batch, CacheKind};

use crate::support;

const THREADS: usize = 16;
const CALLS: usize = 10_000;
const INITIAL: usize = 64;

/// What one shared key has seen: the smallest size that failed in a call that has finished.
struct KeyState {
    min_failed: AtomicUsize,
    limit: usize,
}

/// A tiny deterministic generator per thread (xorshift), so failures differ by thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One call through a given line (one line per key), checking where it started.
fn call(site: usize, kind: CacheKind, state: &KeyState, rng: &mut Rng, violations: &AtomicUsize) {
    let before = state.min_failed.load(Ordering::SeqCst);
    let mut first = None;
    let mut smallest_failure = usize::MAX;
    let transient = rng.next() % 1000 == 0;
    let panics = rng.next() % 500 == 0;
    let mut body = |size: usize| -> Result<usize, String> {
        first.get_or_insert(size);
        if panics {
            panic!("CUDA error: an illegal memory access was encountered");
        }
        if size > state.limit || (transient && size == *first.as_ref().unwrap()) {
            smallest_failure = smallest_failure.min(size);
            return Err("CUDA out of memory. Tried to allocate 2.00 MiB".to_string());
        }
        Ok(size)
    };
    // One line per key: the key of a builder call is the line that calls `run`.
    let result = panic::catch_unwind(AssertUnwindSafe(|| match site {
        0 => Batch::new(INITIAL).cache(kind).run(&mut body),
        1 => Batch::new(INITIAL).cache(kind).run(&mut body),
        _ => Batch::new(INITIAL).cache(kind).run(&mut body),
    }));
    let first = first.expect("the body ran");
    // A later call never starts at or above a size that failed under its key. A
    // StacktraceMemory key also holds free memory, which may move to a new bucket (a new key
    // starting at the initial size).
    let fresh_key = kind == CacheKind::StacktraceMemory && first == INITIAL;
    if kind != CacheKind::None && !fresh_key && first >= before && first > 1 {
        violations.fetch_add(1, Ordering::SeqCst);
    }
    match result {
        Ok(Ok(size)) => assert!(size <= state.limit && size >= 1),
        Ok(Err(_)) => assert!(state.limit == 0 || transient),
        Err(payload) => {
            assert!(panics, "only the planted panic escapes");
            assert!(payload.downcast_ref::<&str>().is_some_and(|m| m.contains("illegal memory access")));
        }
    }
    if smallest_failure != usize::MAX {
        state.min_failed.fetch_min(smallest_failure, Ordering::SeqCst);
    }
}

fn hammer(kind: CacheKind) {
    // Limits per key; 0 means even size 1 fails.
    let keys: Arc<Vec<KeyState>> = Arc::new(
        [20, 7, 0].iter().map(|&limit| KeyState { min_failed: AtomicUsize::new(usize::MAX), limit }).collect(),
    );
    let violations = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    // A deadlock shows as a test that does not end: fail it loudly instead.
    let watchdog = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let started = Instant::now();
            while !done.load(Ordering::SeqCst) {
                if started.elapsed() > Duration::from_secs(300) {
                    eprintln!("concurrency test ({kind:?}) still running after 300 s: deadlock?");
                    std::process::abort();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let keys = Arc::clone(&keys);
            let violations = Arc::clone(&violations);
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1000_0001));
                for i in 0..CALLS {
                    // Threads share keys, and each thread uses every key.
                    let site = (i + t) % keys.len();
                    call(site, kind, &keys[site], &mut rng, &violations);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("no thread panicked outside the bodies");
    }
    done.store(true, Ordering::SeqCst);
    watchdog.join().unwrap();
    assert_eq!(violations.load(Ordering::SeqCst), 0, "{kind:?}: calls started above a size that had failed");
    assert!(toma::cache::len() <= toma::cache::MAX_ENTRIES);
}

#[test]
fn sixteen_threads_global() {
    let _serial = support::serial();
    panic::set_hook(Box::new(|_| {}));
    hammer(CacheKind::Global);
}

#[test]
fn sixteen_threads_stacktrace_memory() {
    let _serial = support::serial();
    panic::set_hook(Box::new(|_| {}));
    hammer(CacheKind::StacktraceMemory);
}

#[test]
fn sixteen_threads_no_cache() {
    let _serial = support::serial();
    panic::set_hook(Box::new(|_| {}));
    hammer(CacheKind::None);
}
