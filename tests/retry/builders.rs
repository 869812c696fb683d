//! The builders and `execute` on their own, with a simulated out-of-memory.

use crate::support;

use std::cell::RefCell;

use support::{block_on, oom, yield_now};
use toma::{Batch, CacheKind, ConfigError, Range};

fn fits_up_to(limit: usize, calls: &RefCell<Vec<usize>>) -> impl FnMut(usize) -> Result<usize, String> + '_ {
    move |size| {
        calls.borrow_mut().push(size);
        if size > limit {
            Err(oom())
        } else {
            Ok(size)
        }
    }
}

#[test]
fn batch_exact_sequence() {
    let calls = RefCell::new(Vec::new());
    assert_eq!(Batch::new(64).cache(CacheKind::None).run(fits_up_to(16, &calls)), Ok(16));
    assert_eq!(calls.take(), [64, 32, 16]);
    // Odd sizes halve with floor.
    assert_eq!(Batch::new(100).cache(CacheKind::None).run(fits_up_to(10, &calls)), Ok(6));
    assert_eq!(calls.take(), [100, 50, 25, 12, 6]);
}

#[test]
fn each_cache_kind_in_a_loop_and_from_another_line() {
    let calls = RefCell::new(Vec::new());
    for kind in [CacheKind::StacktraceMemory, CacheKind::Global, CacheKind::None] {
        let mut seen = Vec::new();
        for _ in 0..3 {
            Batch::new(64).cache(kind).run(fits_up_to(16, &calls)).unwrap();
            seen.push(calls.take());
        }
        Batch::new(64).cache(kind).run(fits_up_to(16, &calls)).unwrap();
        let other_line = calls.take();
        let full = vec![64, 32, 16];
        match kind {
            CacheKind::None => {
                assert_eq!(seen, [full.clone(), full.clone(), full.clone()]);
                assert_eq!(other_line, full);
            }
            // Builders have no function identity: both kinds key on the line that calls `run`.
            _ => {
                assert_eq!(seen, [full.clone(), vec![16], vec![16]], "{kind:?}");
                assert_eq!(other_line, full, "{kind:?}");
            }
        }
    }
}

#[test]
fn execute_batch_and_range_key_on_their_line() {
    let calls = RefCell::new(Vec::new());
    for _ in 0..2 {
        toma::execute::batch(64, fits_up_to(8, &calls)).unwrap();
    }
    assert_eq!(calls.take(), [64, 32, 16, 8, 8]);
    let mut ranges = Vec::new();
    for _ in 0..2 {
        toma::execute::range(0, 40, 32, |start, end| {
            ranges.push((start, end));
            if end - start > 10 {
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    }
    let first = [(0, 32), (0, 16), (0, 8), (8, 16), (16, 24), (24, 32), (32, 40)];
    let second = [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)];
    assert_eq!(ranges, [&first[..], &second[..]].concat());
}

/// A clipped sub-range that fails halves the step, as Python toma does, not its own length:
/// `range(0, 40)` at step 64 failing at (0, 40) goes on at (0, 32), not (0, 20).
#[test]
fn a_failing_clipped_sub_range_halves_the_step() {
    let mut calls = Vec::new();
    Range::new(0, 40, 64)
        .cache(CacheKind::None)
        .run(|start, end| {
            calls.push((start, end));
            if end - start > 32 {
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(calls, [(0, 40), (0, 32), (32, 40)]);
}

/// The halved step is halved again until it is shorter than the failed sub-range: a failure at
/// a clipped 6 with step 64 goes on at step 4 (64 → 32 → 16 → 8 → 4), never repeating 6.
#[test]
fn a_short_clipped_failure_skips_steps_that_would_repeat_it() {
    let mut calls = Vec::new();
    Range::new(0, 70, 64)
        .cache(CacheKind::None)
        .run(|start, end| {
            calls.push((start, end));
            // Only the tail is expensive.
            if start >= 64 && end - start > 2 {
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(calls, [(0, 64), (64, 70), (64, 68), (64, 66), (66, 68), (68, 70)]);
}

#[test]
fn range_never_redoes_finished_sub_ranges_and_keeps_the_smaller_step() {
    let mut calls = Vec::new();
    let mut failed_once = false;
    Range::new(0, 10, 4)
        .cache(CacheKind::None)
        .run(|start, end| {
            calls.push((start, end));
            // A transient failure in the middle: the step stays halved afterwards.
            if start == 4 && !failed_once {
                failed_once = true;
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(calls, [(0, 4), (4, 8), (4, 6), (6, 8), (8, 10)]);
}

#[test]
fn non_oom_errors_and_the_last_oom_come_back_unchanged() {
    let mut calls = 0;
    let err = Range::new(0, 8, 8)
        .cache(CacheKind::None)
        .run(|_, _| {
            calls += 1;
            Err(std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"))
        })
        .unwrap_err();
    assert_eq!((err.kind(), calls), (std::io::ErrorKind::NotFound, 1));
    let mut sizes = Vec::new();
    let err = Batch::new(5)
        .cache(CacheKind::None)
        .run(|size| -> Result<(), String> {
            sizes.push(size);
            Err(format!("HIP out of memory at {size}"))
        })
        .unwrap_err();
    assert_eq!((err.as_str(), sizes), ("HIP out of memory at 1", vec![5, 2, 1]));
}

#[test]
fn failed_attempts_are_dropped_before_the_next_one() {
    use std::rc::Rc;
    let token = Rc::new(());
    let mut strong_counts = Vec::new();
    Batch::new(8)
        .cache(CacheKind::None)
        .run(|size| {
            strong_counts.push(Rc::strong_count(&token));
            let held = Rc::clone(&token);
            if size > 2 {
                // The error carries a clone: it must be gone before the next attempt starts.
                return Err(Held(held, oom()));
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(strong_counts, [1, 1, 1]);
}

#[derive(Debug)]
struct Held(#[allow(dead_code)] std::rc::Rc<()>, String);
impl toma::OutOfMemory for Held {
    fn is_out_of_memory(&self) -> bool {
        self.1.is_out_of_memory()
    }
}

#[test]
fn bad_configuration_is_a_typed_error() {
    assert_eq!(Batch::try_new(0).unwrap_err(), ConfigError::ZeroSize { what: "initial batch size" });
    assert_eq!(Range::try_new(0, 10, 0).unwrap_err(), ConfigError::ZeroSize { what: "initial step" });
    assert_eq!(Range::try_new(5, 4, 1).unwrap_err(), ConfigError::StartAfterEnd { start: 5, end: 4 });
    let message = std::panic::catch_unwind(|| Batch::new(0)).unwrap_err();
    assert!(message.downcast_ref::<String>().unwrap().contains("at least 1"));
}

#[test]
fn empty_ranges_call_nothing_and_huge_ones_do_not_overflow() {
    Range::new(7, 7, 3).run(|_, _| -> Result<(), String> { panic!("called on an empty range") }).unwrap();
    let mut calls = Vec::new();
    Range::new(usize::MAX - 5, usize::MAX, usize::MAX)
        .cache(CacheKind::None)
        .run(|start, end| {
            calls.push(end - start);
            if end - start > 2 {
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    // The step halves from usize::MAX (2^64 - 1) down through 2^k - 1 to 3, the first below
    // the failed 5; 3 fails too and halves to 1.
    assert_eq!(calls, [5, 3, 1, 1, 1, 1, 1]);
}

#[test]
fn async_builders() {
    let mut sizes = Vec::new();
    let out = block_on(Batch::new(16).cache(CacheKind::None).run_async(|size| {
        sizes.push(size);
        async move {
            yield_now().await;
            if size > 4 {
                panic!("CUDA out of memory. Tried to allocate 1 GiB");
            }
            Ok::<_, String>(size)
        }
    }));
    assert_eq!((out, sizes), (Ok(4), vec![16, 8, 4]));
    let mut ranges = Vec::new();
    block_on(Range::new(0, 6, 4).cache(CacheKind::None).run_async(|start, end| {
        ranges.push((start, end));
        async move {
            yield_now().await;
            if end - start > 2 {
                return Err(oom());
            }
            Ok(())
        }
    }))
    .unwrap();
    assert_eq!(ranges, [(0, 4), (0, 2), (2, 4), (4, 6)]);
}

#[test]
fn a_dropped_async_call_leaves_the_cache_usable() {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Waker};
    // One key for every call: the `run_async` line below.
    fn call(limit: usize, log: &RefCell<Vec<usize>>) -> impl Future<Output = Result<usize, String>> + '_ {
        Batch::new(64).cache(CacheKind::Global).run_async(move |size| async move {
            log.borrow_mut().push(size);
            yield_now().await;
            if size > limit {
                return Err(oom());
            }
            Ok(size)
        })
    }
    let log = RefCell::new(Vec::new());
    for _ in 0..3 {
        // Poll once (the first attempt is suspended at its await), then drop mid-attempt.
        let mut fut = pin!(call(16, &log));
        assert!(fut.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending());
    }
    assert_eq!(log.take(), [64, 64, 64]);
    for _ in 0..2 {
        assert_eq!(block_on(call(16, &log)), Ok(16));
    }
    assert_eq!(log.take(), [64, 32, 16, 16]);
}

#[test]
fn factor_policy_ends_closer_to_the_limit() {
    use toma::Policy;
    let calls = RefCell::new(Vec::new());
    let out = Batch::new(65).cache(CacheKind::None).policy(Policy::factor(0.9)).run(fits_up_to(60, &calls));
    assert_eq!((out, calls.take()), (Ok(58), vec![65, 58]));
    // A factor that would round to the same size still moves down by at least 1.
    let out = Batch::new(3).cache(CacheKind::None).policy(Policy::factor(0.99)).run(fits_up_to(1, &calls));
    assert_eq!((out, calls.take()), (Ok(1), vec![3, 2, 1]));
}

#[test]
fn grow_finds_the_largest_size_across_calls_and_remembers_it() {
    use toma::Policy;
    let calls = RefCell::new(Vec::new());
    let mut finals = Vec::new();
    for _ in 0..10 {
        finals
            .push(Batch::new(100).cache(CacheKind::Global).policy(Policy::grow()).run(fits_up_to(70, &calls)).unwrap());
    }
    // Halving first (100, 50), then each call probes halfway between the largest size that
    // worked and the smallest that failed, until they meet at the limit.
    assert_eq!(finals, [50, 62, 68, 69, 70, 70, 70, 70, 70, 70]);
    assert_eq!(calls.take(), [100, 50, 75, 62, 68, 71, 69, 70, 70, 70, 70, 70, 70]);
}

#[test]
fn grow_lets_a_range_step_recover_within_one_call() {
    use toma::Policy;
    let mut calls = Vec::new();
    let mut failed_once = false;
    Range::new(0, 200, 32)
        .cache(CacheKind::None)
        .policy(Policy::grow())
        .run(|start, end| {
            calls.push((start, end));
            // One transient failure at the start; afterwards everything up to 32 fits.
            if !failed_once {
                failed_once = true;
                return Err(oom());
            }
            Ok(())
        })
        .unwrap();
    let lengths: Vec<usize> = calls.iter().map(|(s, e)| e - s).collect();
    // 32 failed once, so the search stays below it: 16, then 24, 28, 30, 31, 31, ...
    assert_eq!(&lengths[..7], [32, 16, 24, 28, 30, 31, 31]);
    assert_eq!(calls.last().unwrap().1, 200);
}

#[test]
fn reports_count_attempts_and_failures() {
    let calls = RefCell::new(Vec::new());
    let (out, report) = Batch::new(64).cache(CacheKind::None).run_with_report(fits_up_to(16, &calls));
    assert_eq!(out, Ok(16));
    assert_eq!((report.attempts, report.out_of_memory, report.first_size, report.final_size), (3, 2, 64, 16));
    assert!(!report.from_cache);
    assert!(report.total_time >= report.failed_time);
    let (out, report) = Range::new(0, 10, 4).cache(CacheKind::None).run_with_report(|_, _| Ok::<(), String>(()));
    assert_eq!(out, Ok(()));
    assert_eq!((report.attempts, report.out_of_memory, report.final_size), (3, 0, 4));
    // A cache hit shows where it started: the same line, run twice, fills the entry and then
    // hits it.
    let reports: Vec<_> =
        (0..2).map(|_| Batch::new(64).cache(CacheKind::Global).run_with_report(fits_up_to(16, &calls)).1).collect();
    assert!(reports[1].from_cache, "{reports:?}");
    assert_eq!((reports[1].attempts, reports[1].first_size), (1, 16));
}

#[test]
fn a_clipped_last_sub_range_does_not_pin_the_cache() {
    // The same line: first a range shorter than the step (one clipped attempt of 10), then a
    // long one, which must still start at the step rather than at 10.
    let firsts: Vec<_> = [(0, 10), (0, 1000)]
        .into_iter()
        .map(|(start, end)| {
            Range::new(start, end, 64)
                .cache(CacheKind::Global)
                .run_with_report(|_, _| Ok::<(), String>(()))
                .1
                .first_size
        })
        .collect();
    assert_eq!(firsts, [64, 64]);
}

/// toma's panic hook silences a caught out-of-memory panic, unless told not to; either way the
/// hook set before it sees every other panic. In a child process: the hook is process-wide.
#[test]
fn caught_panics_reach_the_hook_only_when_not_quiet() {
    const TEST: &str = "builders::caught_panics_reach_the_hook_only_when_not_quiet";
    const ENV: &str = "TOMA_HOOK_CHILD";
    if let Ok(mode) = std::env::var(ENV) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static SEEN: AtomicUsize = AtomicUsize::new(0);
        std::panic::set_hook(Box::new(|_| {
            SEEN.fetch_add(1, Ordering::SeqCst);
        }));
        if mode == "loud" {
            toma::quiet_caught_panics(false);
        }
        let out = Batch::new(4).cache(CacheKind::None).run(|bs| -> Result<usize, String> {
            if bs > 2 {
                panic!("CUDA out of memory. Tried to allocate 1.00 GiB");
            }
            Ok(bs)
        });
        assert_eq!(out, Ok(2));
        let other = std::panic::catch_unwind(|| panic!("not a memory problem"));
        assert!(other.is_err());
        // On a line of its own: the test harness has just printed `test .. ... ` without a newline.
        println!("\nTOMA_HOOK_DONE seen={}", SEEN.load(Ordering::SeqCst));
        return;
    }
    // Quiet: only the other panic reaches the hook; loud: the caught one too.
    for (mode, seen) in [("quiet", "1"), ("loud", "2")] {
        let child = support::child::run(TEST, ENV, mode);
        let fields = child.assert_finished("TOMA_HOOK_DONE ");
        assert_eq!(fields["seen"], seen, "{mode}: {}", child.report);
    }
}

/// `when` overrides toma's decision for one call: `Some(true)` retries a text toma does not
/// know, `Some(false)` gives back one it would retry, `None` leaves it to toma.
#[test]
fn when_overrides_the_decision_for_one_call() {
    fn arena(text: &str) -> Option<bool> {
        text.contains("arena exhausted").then_some(true)
    }
    let mut sizes = Vec::new();
    let out = Batch::new(16).cache(CacheKind::None).when(arena).run(|bs| {
        sizes.push(bs);
        if bs > 4 {
            return Err(format!("my_allocator: arena exhausted at {bs}"));
        }
        Ok(bs)
    });
    assert_eq!((out, sizes), (Ok(4), vec![16, 8, 4]));

    // The same text as a panic.
    let out = Batch::new(16).cache(CacheKind::None).when(arena).run(|bs| -> Result<usize, String> {
        if bs > 4 {
            panic!("my_allocator: arena exhausted at {bs}");
        }
        Ok(bs)
    });
    assert_eq!(out, Ok(4));

    // Without `when` the text is another error: one attempt.
    let mut attempts = 0;
    let out = Batch::new(16).cache(CacheKind::None).run(|_| {
        attempts += 1;
        Err::<usize, _>("my_allocator: arena exhausted".to_string())
    });
    assert_eq!((out.is_err(), attempts), (true, 1));

    // `Some(false)`: an out-of-memory this call wants back at once, on a range.
    let mut calls = Vec::new();
    let out = Range::new(0, 8, 8).cache(CacheKind::None).when(|_| Some(false)).run(|s, e| {
        calls.push((s, e));
        Err::<(), _>(oom())
    });
    assert_eq!((out, calls), (Err(oom()), vec![(0, 8)]));

    // `None`: toma decides as usual.
    let mut calls = Vec::new();
    let out = Range::new(0, 8, 8).cache(CacheKind::None).when(|_| None).run(|s, e| {
        calls.push((s, e));
        if e - s > 2 {
            return Err(oom());
        }
        Ok(())
    });
    assert_eq!((out, calls.len()), (Ok(()), 6));
}
