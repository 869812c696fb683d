//! [`Range`]: a body run over consecutive sub-ranges, the step shrunk on out-of-memory.

use std::future::Future;
use std::panic::Location;

use super::sizer::Sizer;
use super::unwind::{catch_attempt, classify, CatchUnwind};
use super::{Report, Settings};
use crate::cache::{self, CacheKind, CallSite, Operation};
use crate::error::{nonzero, ConfigError};
use crate::oom::OutOfMemory;

/// Runs a body over `[start, end)` in consecutive sub-ranges of at most `step` indices,
/// shrinking the step on out-of-memory.
///
/// A failed sub-range is retried with the policy's smaller length (half of it by default);
/// finished sub-ranges are never redone, and the smaller step holds for the rest of the call
/// (unless the policy [grows](crate::Policy::grow)).
///
/// ```
/// use toma::{CacheKind, Range};
/// let mut seen = Vec::new();
/// Range::new(0, 100, 64).cache(CacheKind::None).run(|start, end| {
///     if end - start > 20 { return Err("CUDA out of memory.".to_string()) }
///     seen.push((start, end));
///     Ok(())
/// }).unwrap();
/// assert_eq!(seen, [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80), (80, 96), (96, 100)]);
/// ```
#[derive(Clone, Copy, Debug)]
#[must_use = "a builder does nothing until `run` is called"]
pub struct Range {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) initial: usize,
    pub(crate) settings: Settings,
}

super::settings_methods!(Range, settings, "step");

impl Range {
    /// A range retry over `[start, end)` starting with sub-ranges of `initial_step`.
    ///
    /// # Panics
    /// When `initial_step` is 0 or `start > end`; [`Range::try_new`] reports them instead.
    #[track_caller]
    pub fn new(start: usize, end: usize, initial_step: usize) -> Self {
        Self::try_new(start, end, initial_step).unwrap_or_else(|err| panic!("{err}"))
    }

    /// Like [`Range::new`], with bad input reported as a [`ConfigError`].
    pub fn try_new(start: usize, end: usize, initial_step: usize) -> Result<Self, ConfigError> {
        let initial = nonzero(initial_step, "initial step")?;
        if start > end {
            return Err(ConfigError::StartAfterEnd { start, end });
        }
        Ok(Range { start, end, initial, settings: Settings::default() })
    }

    /// Keys the cache on `id` (with `name` in logs) instead of a function: `toma::lazy` keys
    /// on the graph's shape.
    #[cfg(feature = "tch")]
    pub(crate) fn identity(mut self, id: u64, name: &'static str) -> Self {
        self.settings.identity = Some((id, name));
        self
    }

    /// The initial step is a plan's choice: see [`Settings::planned`].
    #[cfg(feature = "tch")]
    pub(crate) fn planned(mut self) -> Self {
        self.settings.planned = true;
        self
    }

    #[doc(hidden)]
    #[track_caller]
    pub fn start(self) -> RangeAttempts {
        self.start_as(Operation::Range, Location::caller(), false)
    }

    pub(crate) fn start_as(self, op: Operation, caller: &'static Location<'static>, report: bool) -> RangeAttempts {
        let site = CallSite { identity: self.settings.identity, caller };
        // An empty range never runs, so it need not pay for a key.
        let kind = if self.start == self.end {
            CacheKind::None
        } else {
            self.settings.cache.unwrap_or_else(cache::default_cache)
        };
        let sizer = Sizer::start(op, self.initial, kind, self.settings, site, report);
        RangeAttempts { sizer, position: self.start, end: self.end }
    }

    /// Calls `body(start, end)` on consecutive sub-ranges covering `[start, end)` once each, in
    /// order. An empty range calls nothing and returns `Ok(())`.
    ///
    /// Returns `Ok(())` once every index is covered, the body's first error that is not an
    /// out-of-memory, or its out-of-memory on a sub-range of length 1. Panics are handled as
    /// in [`Batch::run`](crate::Batch::run).
    #[track_caller]
    pub fn run<E, F>(self, body: F) -> Result<(), E>
    where
        E: OutOfMemory,
        F: FnMut(usize, usize) -> Result<(), E>,
    {
        self.start_as(Operation::Range, Location::caller(), false).drive(body)
    }

    /// [`Range::run`], also returning what the call did.
    #[track_caller]
    pub fn run_with_report<E, F>(self, body: F) -> (Result<(), E>, Report)
    where
        E: OutOfMemory,
        F: FnMut(usize, usize) -> Result<(), E>,
    {
        let mut attempts = self.start_as(Operation::Range, Location::caller(), true);
        let result = attempts.drive(body);
        (result, attempts.report())
    }

    /// [`Range::run`] for a body that returns a future.
    #[track_caller]
    pub fn run_async<E, F, Fut>(self, mut body: F) -> impl Future<Output = Result<(), E>>
    where
        E: OutOfMemory,
        F: FnMut(usize, usize) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        let mut attempts = self.start_as(Operation::Range, Location::caller(), false);
        async move {
            while let Some((start, end)) = attempts.next_range() {
                let outcome = attempts.attempt_async(body(start, end)).await;
                attempts.finish(outcome)?;
            }
            Ok(())
        }
    }
}

/// The attempts of one range call, driven by hand (see [`Range::start`]).
#[doc(hidden)]
#[derive(Debug)]
pub struct RangeAttempts {
    sizer: Sizer,
    position: usize,
    end: usize,
}

impl RangeAttempts {
    pub(crate) fn drive<E, F>(&mut self, mut body: F) -> Result<(), E>
    where
        E: OutOfMemory,
        F: FnMut(usize, usize) -> Result<(), E>,
    {
        while let Some((start, end)) = self.next_range() {
            let outcome = self.attempt(|| body(start, end));
            self.finish(outcome)?;
        }
        Ok(())
    }

    /// The sub-range of the next attempt, or `None` when the whole range is done.
    pub fn next_range(&self) -> Option<(usize, usize)> {
        (self.position < self.end).then(|| (self.position, self.position.saturating_add(self.sizer.size).min(self.end)))
    }

    /// The current step.
    pub fn step(&self) -> usize {
        self.sizer.size
    }

    /// Whether an out-of-memory in the next attempt would be retried.
    pub fn retryable(&self) -> bool {
        self.next_range().is_some_and(|(start, end)| end - start > 1)
    }

    fn begin(&mut self) {
        if let Some((start, end)) = self.next_range() {
            tracing::debug!(op = ?self.sizer.op, function = self.sizer.name, start, end, "toma: attempt");
        }
        self.sizer.begin_attempt();
    }

    /// Runs one attempt, catching its panic.
    pub fn attempt<R>(&mut self, body: impl FnOnce() -> R) -> std::thread::Result<R> {
        self.begin();
        catch_attempt(self.retryable(), body)
    }

    /// Wraps one attempt's future so that its panic is caught.
    pub fn attempt_async<F: Future>(&mut self, future: F) -> CatchUnwind<F> {
        self.begin();
        CatchUnwind::new(future, self.retryable())
    }

    /// Takes an attempt's outcome: `Ok` to go on (with the next sub-range or a smaller one),
    /// `Err` to stop with the body's error. Resumes a panic that is not to be retried.
    ///
    /// # Panics
    /// When called after [`next_range`](Self::next_range) returned `None`.
    pub fn finish<E: OutOfMemory>(&mut self, outcome: std::thread::Result<Result<(), E>>) -> Result<(), E> {
        let (start, end) = self.next_range().expect("toma: RangeAttempts::finish after the range was done");
        match classify(outcome) {
            Ok(()) => {
                let len = end - start;
                self.sizer.succeeded(len, len == self.sizer.size);
                self.position = end;
                if self.position == self.end {
                    self.sizer.conclude();
                }
                Ok(())
            }
            Err(failure) => {
                if failure.is_out_of_memory(self.sizer.decide) && self.sizer.out_of_memory(end - start, &failure) {
                    drop(failure);
                    Ok(())
                } else {
                    self.sizer.conclude();
                    Err(failure.give_back())
                }
            }
        }
    }

    /// What the call did so far.
    pub fn report(&self) -> Report {
        self.sizer.report()
    }
}
