//! The lost-update race, forced: slow calls succeed at a size that a fast call has meanwhile
//! seen fail under the same key. Afterwards no call may start at or above the failed size.
//! It holds `support::serial()`: it empties the process-wide cache between rounds.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use toma::{Batch, CacheKind};

use crate::support;

const INITIAL: usize = 64;

type Body<'a> = &'a mut dyn FnMut(usize) -> Result<usize, String>;

/// Every call uses this one line, so every call shares one key.
fn builder_call(body: Body<'_>) -> Result<usize, String> {
    Batch::new(INITIAL).cache(CacheKind::Global).run(body)
}

/// The same through an attribute: its Global entry is also read without the map's lock.
#[cfg(feature = "macros")]
#[toma::batch(initial_batchsize = 64, cache = Global)]
fn attribute_call(batchsize: usize, body: Body<'_>) -> Result<usize, String> {
    body(batchsize)
}

#[test]
fn stale_successes_never_undo_a_failure() {
    let _serial = support::serial();
    // One test, so that the rounds' `clear()` never runs under another test's calls.
    race(builder_call);
    #[cfg(feature = "macros")]
    race(|body| attribute_call(body));
}

fn race(call: fn(Body<'_>) -> Result<usize, String>) {
    let mut violations = Vec::new();
    for _round in 0..20 {
        toma::cache::clear();
        let min_failed = Arc::new(AtomicUsize::new(usize::MAX));
        let stop = Arc::new(AtomicBool::new(false));
        let starts_seen = Arc::new(AtomicUsize::new(0));
        let slow: Vec<_> = (0..6)
            .map(|_| {
                let (min_failed, stop, starts_seen) = (min_failed.clone(), stop.clone(), starts_seen.clone());
                std::thread::spawn(move || {
                    let mut bad = Vec::new();
                    // At least one call each, however late the thread starts.
                    loop {
                        let before = min_failed.load(Ordering::SeqCst);
                        let mut first = None;
                        call(&mut |size| {
                            first.get_or_insert(size);
                            // Slow: the fast thread's failure lands while this one still runs.
                            std::thread::sleep(Duration::from_micros(200));
                            Ok(size)
                        })
                        .unwrap();
                        starts_seen.fetch_add(1, Ordering::SeqCst);
                        let first = first.unwrap();
                        if first >= before && first > 1 {
                            bad.push((first, before));
                        }
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                    }
                    bad
                })
            })
            .collect();
        // The fast thread: its first attempt at each call fails, then it records the failure.
        for _ in 0..7 {
            let mut failed_at = None;
            let _ = call(&mut |size| {
                if failed_at.is_none() {
                    failed_at = Some(size);
                    return Err("CUDA out of memory. Tried to allocate 2.00 MiB".to_string());
                }
                Ok(size)
            });
            if let Some(size) = failed_at {
                min_failed.fetch_min(size, Ordering::SeqCst);
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        std::thread::sleep(Duration::from_millis(2));
        stop.store(true, Ordering::SeqCst);
        for thread in slow {
            violations.extend(thread.join().unwrap());
        }
        assert!(starts_seen.load(Ordering::SeqCst) > 0);
    }
    assert!(violations.is_empty(), "calls started at or above a failed size (start, failed): {violations:?}");
}
