//! Grouped calls (feature `dist`): the builders' attempts, with one agreement round among the
//! ranks after each (see [`crate::dist`] for the protocol and what it guarantees).

use std::panic::Location;

use super::batch::Batch;
use super::range::{Range, RangeAttempts};
use super::unwind::{classify, Failure};
use super::Report;
use crate::cache::Operation;
use crate::dist::{DistError, Group, GroupError, Reduce};
use crate::oom::{panic_message, OutOfMemory};

/// What an attempt did, as the round carries it.
const OK: i64 = 0;
const OUT_OF_MEMORY: i64 = 1;
const FATAL: i64 = 2;
/// "No constraint" in a round's `Min` fields.
const NONE: i64 = i64::MAX;

/// The namespace of a call site: the same on every rank running the same binary.
fn namespace(caller: &Location<'_>) -> String {
    format!("{}:{}:{}", caller.file(), caller.line(), caller.column())
}

/// The text peers see for a failure.
fn describe<E: OutOfMemory>(failure: &Failure<E>) -> String {
    let text = match failure {
        Failure::Error(err) => err.message(),
        Failure::Panic(payload) => panic_message(payload.as_ref()).map(|m| format!("panicked: {m}")),
    };
    text.unwrap_or_else(|| {
        format!("an error of type {} (it gives no OutOfMemory::message)", std::any::type_name::<E>())
    })
}

/// The ranks' records of one round, read.
struct Round {
    /// The lowest rank that failed for good: its message and whether it was an out-of-memory.
    fatal: Option<(usize, String, bool)>,
    /// Some rank ran out of memory (and can retry).
    out_of_memory: bool,
    /// Each field's smallest value over the ranks.
    min: Vec<i64>,
}

fn agree(group: &Group, namespace: &str, record: &[i64], message: &str) -> Result<Round, DistError> {
    let all = group.exchange_checked(namespace, record, message)?;
    let mut round = Round { fatal: None, out_of_memory: false, min: record.to_vec() };
    for (rank, (values, message)) in all.into_iter().enumerate() {
        match values[0] {
            FATAL if round.fatal.is_none() => round.fatal = Some((rank, message, values.get(2) == Some(&1))),
            OUT_OF_MEMORY => round.out_of_memory = true,
            _ => {}
        }
        for (m, v) in round.min.iter_mut().zip(&values) {
            *m = (*m).min(*v);
        }
    }
    Ok(round)
}

/// Reads a round for the end of the call: `Err` with what this rank returns when the round
/// failed or some rank failed for good, `Ok` to go on. `own` is this rank's failure for good,
/// if it had one (a panic is resumed rather than returned).
fn settle<E: OutOfMemory>(round: Result<Round, DistError>, own: Option<Failure<E>>) -> Result<Round, GroupError<E>> {
    match round {
        Err(err) => {
            if let Some(Failure::Panic(payload)) = own {
                std::panic::resume_unwind(payload);
            }
            Err(GroupError::Dist(err))
        }
        Ok(mut round) => match (round.fatal.take(), own) {
            (_, Some(failure)) => Err(GroupError::Local(failure.give_back())),
            (Some((rank, message, out_of_memory)), None) => Err(GroupError::Peer { rank, message, out_of_memory }),
            (None, None) => Ok(round),
        },
    }
}

/// A [`Batch`] whose ranks agree after every attempt: see [`Batch::group`].
#[derive(Clone, Copy, Debug)]
#[must_use = "a builder does nothing until `run` is called"]
pub struct GroupedBatch<'g> {
    batch: Batch,
    group: &'g Group,
}

impl Batch {
    /// Runs the call on every rank of `group` in step (feature `dist`): every attempt runs at
    /// the same size on every rank; when any rank runs out of memory, every rank runs again at
    /// the same smaller size, and when any rank fails for good, every rank returns an error
    /// that names it. See [`toma::dist`](crate::dist).
    pub fn group(self, group: &Group) -> GroupedBatch<'_> {
        GroupedBatch { batch: self, group }
    }
}

impl GroupedBatch<'_> {
    /// [`Batch::run`], in step with the group's other ranks.
    ///
    /// A body that succeeded on this rank runs again when another rank ran out of memory in
    /// the same attempt (the batch is one unit of work on every rank), so it must be safe to
    /// run again, as any retried body must.
    #[track_caller]
    pub fn run<T, E, F>(self, body: F) -> Result<T, GroupError<E>>
    where
        E: OutOfMemory,
        F: FnMut(usize) -> Result<T, E>,
    {
        self.drive(Location::caller(), false, body).0
    }

    /// [`GroupedBatch::run`], also returning what the call did on this rank.
    #[track_caller]
    pub fn run_with_report<T, E, F>(self, body: F) -> (Result<T, GroupError<E>>, Report)
    where
        E: OutOfMemory,
        F: FnMut(usize) -> Result<T, E>,
    {
        self.drive(Location::caller(), true, body)
    }

    fn drive<T, E, F>(
        self,
        caller: &'static Location<'static>,
        report: bool,
        mut body: F,
    ) -> (Result<T, GroupError<E>>, Report)
    where
        E: OutOfMemory,
        F: FnMut(usize) -> Result<T, E>,
    {
        let ns = namespace(caller);
        let mut attempts = self.batch.start_at(caller, report);
        let sizer = &mut attempts.sizer;
        // Start where every rank can: the smallest size any cache or plan allows.
        match self.group.all_reduce(&ns, Reduce::Min, &[sizer.size as i64]) {
            Ok(first) => {
                sizer.size = first[0].max(1) as usize;
                sizer.report.first_size = sizer.size;
            }
            Err(err) => return (Err(err.into()), attempts.report()),
        }
        let result = loop {
            let size = attempts.size();
            let outcome = attempts.attempt(|| body(size));
            let sizer = &mut attempts.sizer;
            let local = classify(outcome);
            let (code, message, oom) = match &local {
                Ok(_) => (OK, String::new(), false),
                Err(f) if f.is_out_of_memory(sizer.decide) && size > 1 => (OUT_OF_MEMORY, String::new(), true),
                Err(f) => (FATAL, describe(f), f.is_out_of_memory(sizer.decide)),
            };
            let proposal = if size > 1 { sizer.next_below(size) } else { 1 };
            let round = agree(self.group, &ns, &[code, proposal as i64, i64::from(oom)], &message);
            let (value, failure) = match local {
                Ok(value) => (Some(value), None),
                Err(failure) => (None, Some(failure)),
            };
            let (failure, own) = if code == FATAL { (None, failure) } else { (failure, None) };
            let round = match settle(round, own) {
                Ok(round) => round,
                Err(end) => {
                    sizer.conclude();
                    break Err(end);
                }
            };
            match (round.out_of_memory, value) {
                (false, Some(value)) => {
                    sizer.succeeded(size, true);
                    sizer.conclude();
                    break Ok(value);
                }
                (_, value) => {
                    // Some rank ran out of memory: every rank runs the batch again, this one's
                    // result (if it had one) is dropped.
                    drop(value);
                    match failure {
                        Some(failure) => sizer.out_of_memory(size, &failure),
                        None => {
                            sizer.out_of_memory_with(size, || ("peer", "another rank ran out of memory".to_owned()))
                        }
                    };
                    sizer.agree_on(round.min[1].max(1) as usize, Some(size));
                }
            }
        };
        (result, attempts.report())
    }
}

/// A [`Range`] whose ranks agree on the step after every chunk: see [`Range::group`].
#[derive(Clone, Copy, Debug)]
#[must_use = "a builder does nothing until `run` is called"]
pub struct GroupedRange<'g> {
    range: Range,
    group: &'g Group,
}

impl Range {
    /// Runs the call on every rank of `group` in step (feature `dist`): each rank covers its
    /// own range (they may differ in length), every chunk uses the step the ranks agreed on,
    /// a rank that runs out of memory makes every rank shrink to the same smaller step, and a
    /// rank that fails for good makes every rank return an error that names it. Chunks that
    /// succeeded are never run again. See [`toma::dist`](crate::dist).
    pub fn group(self, group: &Group) -> GroupedRange<'_> {
        GroupedRange { range: self, group }
    }
}

impl GroupedRange<'_> {
    /// [`Range::run`], in step with the group's other ranks.
    #[track_caller]
    pub fn run<E, F>(self, body: F) -> Result<(), GroupError<E>>
    where
        E: OutOfMemory,
        F: FnMut(usize, usize) -> Result<(), E>,
    {
        let mut attempts = self.range.start_as(Operation::Range, Location::caller(), false);
        drive_range(self.group, &namespace(Location::caller()), &mut attempts, body)
    }

    /// [`GroupedRange::run`], also returning what the call did on this rank.
    #[track_caller]
    pub fn run_with_report<E, F>(self, body: F) -> (Result<(), GroupError<E>>, Report)
    where
        E: OutOfMemory,
        F: FnMut(usize, usize) -> Result<(), E>,
    {
        let mut attempts = self.range.start_as(Operation::Range, Location::caller(), true);
        let result = drive_range(self.group, &namespace(Location::caller()), &mut attempts, body);
        (result, attempts.report())
    }
}

/// A [`Chunked`](crate::Chunked) whose ranks agree on the step: see
/// [`Chunked::group`](crate::Chunked::group).
#[cfg(feature = "tch")]
#[derive(Debug)]
#[must_use = "a builder does nothing until `run` is called"]
pub struct GroupedChunked<'a, 'g> {
    pub(super) chunked: super::Chunked<'a>,
    pub(super) group: &'g Group,
}

#[cfg(feature = "tch")]
impl GroupedChunked<'_, '_> {
    /// [`Chunked::run`](crate::Chunked::run), in step with the group's other ranks (as
    /// [`GroupedRange::run`]).
    #[track_caller]
    pub fn run<E, F>(self, body: F) -> Result<(), GroupError<E>>
    where
        E: OutOfMemory,
        F: FnMut(tch::Tensor, usize, usize) -> Result<(), E>,
    {
        self.drive(Location::caller(), false, body).0
    }

    /// [`GroupedChunked::run`], also returning what the call did on this rank.
    #[track_caller]
    pub fn run_with_report<E, F>(self, body: F) -> (Result<(), GroupError<E>>, Report)
    where
        E: OutOfMemory,
        F: FnMut(tch::Tensor, usize, usize) -> Result<(), E>,
    {
        self.drive(Location::caller(), true, body)
    }

    fn drive<E, F>(
        self,
        caller: &'static Location<'static>,
        report: bool,
        mut body: F,
    ) -> (Result<(), GroupError<E>>, Report)
    where
        E: OutOfMemory,
        F: FnMut(tch::Tensor, usize, usize) -> Result<(), E>,
    {
        let (tensor, dimension) = (self.chunked.tensor, self.chunked.dimension);
        let mut attempts = self.chunked.range.start_as(Operation::Chunked, caller, report);
        let result = drive_range(self.group, &namespace(caller), &mut attempts, |start, end| {
            body(tensor.narrow(dimension, start as i64, (end - start) as i64), start, end)
        });
        (result, attempts.report())
    }
}

/// The grouped range loop: one round per chunk, until every rank's range is done.
///
/// A round's record: `[what happened, finished, next step if all went well, next step if some
/// rank ran out of memory, the length that ran out of memory]`; the step fields are `Min`-ed,
/// and a rank with nothing to say sends [`NONE`].
fn drive_range<E, F>(group: &Group, ns: &str, attempts: &mut RangeAttempts, mut body: F) -> Result<(), GroupError<E>>
where
    E: OutOfMemory,
    F: FnMut(usize, usize) -> Result<(), E>,
{
    match group.all_reduce(ns, Reduce::Min, &[attempts.sizer.size as i64]) {
        Ok(first) => {
            attempts.sizer.size = first[0].max(1) as usize;
            attempts.sizer.report.first_size = attempts.sizer.size;
        }
        Err(err) => return Err(err.into()),
    }
    loop {
        let chunk = attempts.next_range();
        let mut local = None;
        let record = match chunk {
            // Done here: keep answering until every rank is.
            None => [OK, 1, NONE, NONE, NONE],
            Some((start, end)) => {
                let outcome = attempts.attempt(|| body(start, end));
                let len = end - start;
                match classify(outcome) {
                    Ok(()) => {
                        let step = attempts.sizer.size;
                        attempts.succeeded(start, end);
                        let finished = i64::from(attempts.next_range().is_none());
                        let if_peer_failed = if step > 1 { attempts.sizer.next_below(step) } else { 1 };
                        [OK, finished, attempts.sizer.size as i64, if_peer_failed as i64, NONE]
                    }
                    Err(failure) if failure.is_out_of_memory(attempts.sizer.decide) && len > 1 => {
                        attempts.sizer.out_of_memory(len, &failure);
                        attempts.shrunk(start);
                        [OUT_OF_MEMORY, 0, NONE, attempts.sizer.size as i64, len as i64]
                    }
                    Err(failure) => {
                        // As in a batch's record, field 2 of a fatal one says whether it was an
                        // out-of-memory (nobody reads the steps of a round that ends the call).
                        let oom = failure.is_out_of_memory(attempts.sizer.decide);
                        local = Some(failure);
                        [FATAL, 0, i64::from(oom), NONE, NONE]
                    }
                }
            }
        };
        let message = local.as_ref().map(describe).unwrap_or_default();
        let round = match settle(agree(group, ns, &record, &message), local) {
            Ok(round) => round,
            Err(end) => {
                attempts.stop();
                return Err(end);
            }
        };
        if round.out_of_memory {
            attempts.sizer.agree_on(round.min[3].max(1) as usize, Some(round.min[4].max(1) as usize));
            continue;
        }
        if round.min[1] == 1 {
            // Every rank is done.
            return Ok(());
        }
        attempts.sizer.agree_on(round.min[2].max(1) as usize, None);
    }
}
