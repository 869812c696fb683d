//! Fault injection: bodies that fail by a generated schedule — above a threshold, transiently,
//! at random attempts, with out-of-memory and other failures, as errors and as panics — and
//! the promises that must hold for every schedule (10,000 of them across batch, range and
//! chunked).

use std::panic::{self, AssertUnwindSafe};

use proptest::prelude::*;
use toma::{Batch, CacheKind, OutOfMemory, Range};

/// How one attempt fails, if it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    OomError,
    OomPanic,
    OtherError,
    OtherPanic,
}

impl Fault {
    fn is_oom(self) -> bool {
        matches!(self, Fault::OomError | Fault::OomPanic)
    }
}

/// A failure schedule.
#[derive(Clone, Debug)]
struct Schedule {
    /// Every attempt with a size above this runs out of memory (as `threshold_fault`).
    threshold: usize,
    threshold_panics: bool,
    /// Extra faults by attempt number, whatever the size: transient out-of-memories (the same
    /// size works when tried again), and now and then a failure that is not one.
    by_attempt: Vec<Option<Fault>>,
}

impl Schedule {
    fn fault(&self, attempt: usize, size: usize) -> Option<Fault> {
        if let Some(Some(fault)) = self.by_attempt.get(attempt) {
            return Some(*fault);
        }
        (size > self.threshold).then_some(if self.threshold_panics { Fault::OomPanic } else { Fault::OomError })
    }
}

fn schedule() -> impl Strategy<Value = Schedule> {
    let fault = prop_oneof![
        12 => Just(None),
        3 => Just(Some(Fault::OomError)),
        3 => Just(Some(Fault::OomPanic)),
        1 => Just(Some(Fault::OtherError)),
        1 => Just(Some(Fault::OtherPanic)),
    ];
    (0usize..300, any::<bool>(), prop::collection::vec(fault, 0..40))
        .prop_map(|(threshold, threshold_panics, by_attempt)| Schedule { threshold, threshold_panics, by_attempt })
}

/// The error a failing attempt returns; it names its attempt so the caller can tell it is
/// exactly the one that stopped the call.
#[derive(Debug, PartialEq, Eq)]
struct Failed {
    attempt: usize,
    oom: bool,
}

impl OutOfMemory for Failed {
    fn is_out_of_memory(&self) -> bool {
        self.oom
    }
}

/// A panic payload naming its attempt.
fn panic_text(attempt: usize, oom: bool) -> String {
    if oom {
        format!("attempt {attempt}: CUDA out of memory. Tried to allocate 2.00 MiB")
    } else {
        format!("attempt {attempt}: CUDA error: device-side assert triggered")
    }
}

/// Runs one attempt of the schedule: the fault's error or panic, or `Ok`.
fn attempt(schedule: &Schedule, attempt: usize, size: usize) -> Result<(), Failed> {
    match schedule.fault(attempt, size) {
        None => Ok(()),
        Some(Fault::OomError) => Err(Failed { attempt, oom: true }),
        Some(Fault::OtherError) => Err(Failed { attempt, oom: false }),
        Some(Fault::OomPanic) => panic::panic_any(panic_text(attempt, true)),
        Some(Fault::OtherPanic) => panic::panic_any(panic_text(attempt, false)),
    }
}

/// How a whole call ended, with errors and panics told apart.
#[derive(Debug, PartialEq, Eq)]
enum Ending {
    Ok,
    Error(Failed),
    Panic(String),
}

fn ending(run: impl FnOnce() -> Result<(), Failed>) -> Ending {
    match panic::catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => Ending::Ok,
        Ok(Err(failed)) => Ending::Error(failed),
        Err(payload) => Ending::Panic(payload.downcast_ref::<String>().cloned().unwrap_or_default()),
    }
}

/// What the last attempt's fault must have turned into.
fn expected_ending(schedule: &Schedule, last: usize, size: usize) -> Ending {
    match schedule.fault(last, size) {
        None => Ending::Ok,
        Some(Fault::OomError) => Ending::Error(Failed { attempt: last, oom: true }),
        Some(Fault::OtherError) => Ending::Error(Failed { attempt: last, oom: false }),
        Some(Fault::OomPanic) => Ending::Panic(panic_text(last, true)),
        Some(Fault::OtherPanic) => Ending::Panic(panic_text(last, false)),
    }
}

fn ceil_log2(n: usize) -> u32 {
    usize::BITS - (n.max(1) - 1).leading_zeros()
}

/// Failures here print nothing: thousands of schedules panic on purpose.
fn silence_panics() {
    panic::set_hook(Box::new(|_| {}));
}

/// Checks a range-like call: `attempts` holds (start, end) of every attempt, in order.
fn check_range_call(
    schedule: &Schedule,
    (start, end, initial): (usize, usize, usize),
    attempts: &[(usize, usize)],
    processed: &[usize],
    ended: Ending,
) -> Result<(), TestCaseError> {
    let mut position = start;
    let mut per_position = 0u32;
    let mut step = initial;
    for (i, &(s, e)) in attempts.iter().enumerate() {
        // Never redone, never skipped: every attempt starts where the work stands.
        prop_assert_eq!(s, position, "attempt {} {:?}", i, attempts);
        prop_assert!(s < e && e <= end);
        per_position += 1;
        prop_assert!(per_position <= ceil_log2(initial) + 1, "too many attempts at {}: {:?}", s, attempts);
        let fault = schedule.fault(i, e - s);
        match fault {
            None => {
                position = e;
                per_position = 0;
            }
            Some(f) if f.is_oom() && e - s > 1 => {
                // The step halves, and halves again while it would not be shorter than the
                // failed sub-range (a clipped last one).
                while step >= e - s {
                    step = (step / 2).max(1);
                }
                let next = attempts.get(i + 1).copied();
                prop_assert_eq!(next, Some((s, (s + step).min(end))), "after {:?}", (s, e));
            }
            Some(_) => prop_assert_eq!(i, attempts.len() - 1, "a final failure must end the call"),
        }
    }
    // Every index processed successfully exactly once, in order; the call's ending is the last
    // attempt's.
    prop_assert_eq!(processed.to_vec(), (start..position).collect::<Vec<_>>());
    match attempts.last() {
        None => prop_assert!(start == end && ended == Ending::Ok),
        Some(&(s, e)) => {
            let expected = expected_ending(schedule, attempts.len() - 1, e - s);
            if expected == Ending::Ok {
                prop_assert_eq!(position, end);
            }
            prop_assert_eq!(ended, expected);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn batch_under_any_schedule(initial in 1usize..5000, schedule in schedule()) {
        silence_panics();
        let mut sizes = Vec::new();
        let ended = ending(|| {
            Batch::new(initial).cache(CacheKind::None).run(|size| {
                sizes.push(size);
                attempt(&schedule, sizes.len() - 1, size)
            })
        });
        prop_assert!(!sizes.is_empty() && sizes[0] == initial);
        prop_assert!(sizes.len() as u32 <= ceil_log2(initial) + 1, "{:?}", sizes);
        for (i, pair) in sizes.windows(2).enumerate() {
            // Only out-of-memories are retried, and each halves.
            prop_assert!(schedule.fault(i, pair[0]).is_some_and(Fault::is_oom));
            prop_assert_eq!(pair[1], pair[0] / 2);
        }
        let last = sizes.len() - 1;
        if let Some(fault) = schedule.fault(last, sizes[last]) {
            // A failure ends the call only when it is not an out-of-memory, or at size 1.
            prop_assert!(!fault.is_oom() || sizes[last] == 1);
        }
        prop_assert_eq!(ended, expected_ending(&schedule, last, sizes[last]));
    }

    #[test]
    fn range_under_any_schedule(
        start in 0usize..100,
        len in 0usize..400,
        initial in 1usize..300,
        schedule in schedule(),
    ) {
        silence_panics();
        let end = start + len;
        let mut attempts = Vec::new();
        let mut processed = Vec::new();
        let ended = ending(|| {
            Range::new(start, end, initial).cache(CacheKind::None).run(|s, e| {
                attempts.push((s, e));
                attempt(&schedule, attempts.len() - 1, e - s)?;
                processed.extend(s..e);
                Ok(())
            })
        });
        check_range_call(&schedule, (start, end, initial), &attempts, &processed, ended)?;
    }
}

#[cfg(feature = "tch")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn chunked_under_any_schedule(
        rows in 0i64..200,
        dimension in 0i64..2,
        initial in 1usize..150,
        schedule in schedule(),
    ) {
        use tch::{Device, Kind, Tensor};
        silence_panics();
        let shape = if dimension == 0 { [rows, 2] } else { [2, rows] };
        let t = Tensor::zeros(shape, (Kind::Int64, Device::Cpu));
        let mut attempts = Vec::new();
        let mut processed = Vec::new();
        let ended = ending(|| {
            toma::Chunked::new(&t, initial).dimension(dimension).cache(CacheKind::None).run(|mut chunk, s, e| {
                attempts.push((s, e));
                attempt(&schedule, attempts.len() - 1, e - s)?;
                // Writes land in the tensor: each processed index gets exactly one +1.
                let _ = chunk.g_add_scalar_(1);
                processed.extend(s..e);
                Ok(())
            })
        });
        check_range_call(&schedule, (0, rows as usize, initial), &attempts, &processed, ended)?;
        let written = t.sum_dim_intlist(1 - dimension, false, Kind::Int64);
        let expected: Vec<i64> = (0..rows as usize).map(|i| if processed.contains(&i) { 2 } else { 0 }).collect();
        prop_assert_eq!(Vec::<i64>::try_from(&written).unwrap(), expected);
    }
}
