//! [`Batch`]: one body run with a batch size, retried smaller on out-of-memory.

use std::future::Future;
use std::ops::ControlFlow;
use std::panic::Location;

use super::sizer::Sizer;
use super::unwind::{catch_attempt, classify, CatchUnwind};
use super::{Report, Settings};
use crate::cache::{self, CallSite, Operation};
use crate::error::{nonzero, ConfigError};
use crate::oom::OutOfMemory;

/// Runs a body with a batch size, shrinking it on out-of-memory.
///
/// ```
/// use toma::{Batch, CacheKind};
/// // A body that runs out of memory above 100 items.
/// let out = Batch::new(512).cache(CacheKind::None).run(|batchsize| {
///     if batchsize > 100 { Err("CUDA out of memory. Tried to allocate 2.00 GiB".to_string()) }
///     else { Ok(batchsize) }
/// });
/// assert_eq!(out, Ok(64));
/// ```
#[derive(Clone, Copy, Debug)]
#[must_use = "a builder does nothing until `run` is called"]
pub struct Batch {
    initial: usize,
    settings: Settings,
}

super::settings_methods!(Batch, settings, "size");

impl Batch {
    /// A batch retry starting at `initial_batchsize`.
    ///
    /// # Panics
    /// When `initial_batchsize` is 0; [`Batch::try_new`] reports it as an error instead.
    #[track_caller]
    pub fn new(initial_batchsize: usize) -> Self {
        Self::try_new(initial_batchsize).unwrap_or_else(|err| panic!("{err}"))
    }

    /// Like [`Batch::new`], with a 0 size reported as [`ConfigError::ZeroSize`].
    pub fn try_new(initial_batchsize: usize) -> Result<Self, ConfigError> {
        Ok(Batch { initial: nonzero(initial_batchsize, "initial batch size")?, settings: Settings::default() })
    }

    /// Starts the attempts by hand, for callers that drive the loop themselves (the
    /// attributes on `async fn` do). Most code wants [`Batch::run`].
    #[doc(hidden)]
    #[track_caller]
    pub fn start(self) -> BatchAttempts {
        self.start_at(Location::caller(), false)
    }

    pub(super) fn start_at(self, caller: &'static Location<'static>, report: bool) -> BatchAttempts {
        let site = CallSite { identity: self.settings.identity, caller };
        let kind = self.settings.cache.unwrap_or_else(cache::default_cache);
        BatchAttempts { sizer: Sizer::start(Operation::Batch, self.initial, kind, self.settings, site, report) }
    }

    /// Runs `body(batchsize)` until it succeeds, shrinking `batchsize` on every out-of-memory.
    ///
    /// Returns the body's first success, its first error that is not an out-of-memory, or its
    /// out-of-memory at batch size 1. Panics of the body are caught when they are
    /// out-of-memories (and retried like errors); other panics are resumed unchanged.
    #[track_caller]
    pub fn run<T, E, F>(self, body: F) -> Result<T, E>
    where
        E: OutOfMemory,
        F: FnMut(usize) -> Result<T, E>,
    {
        self.start_at(Location::caller(), false).drive(body)
    }

    /// [`Batch::run`], also returning what the call did.
    #[track_caller]
    pub fn run_with_report<T, E, F>(self, body: F) -> (Result<T, E>, Report)
    where
        E: OutOfMemory,
        F: FnMut(usize) -> Result<T, E>,
    {
        let mut attempts = self.start_at(Location::caller(), true);
        let result = attempts.drive(body);
        (result, attempts.report())
    }

    /// [`Batch::run`] for a body that returns a future; each attempt awaits a new one.
    #[track_caller]
    pub fn run_async<T, E, F, Fut>(self, mut body: F) -> impl Future<Output = Result<T, E>>
    where
        E: OutOfMemory,
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut attempts = self.start_at(Location::caller(), false);
        async move {
            loop {
                let size = attempts.size();
                let outcome = attempts.attempt_async(body(size)).await;
                if let ControlFlow::Break(result) = attempts.finish(outcome) {
                    return result;
                }
            }
        }
    }
}

/// The attempts of one batch call, driven by hand (see [`Batch::start`]).
#[doc(hidden)]
#[derive(Debug)]
pub struct BatchAttempts {
    pub(super) sizer: Sizer,
}

impl BatchAttempts {
    fn drive<T, E, F>(&mut self, mut body: F) -> Result<T, E>
    where
        E: OutOfMemory,
        F: FnMut(usize) -> Result<T, E>,
    {
        loop {
            let size = self.size();
            let outcome = self.attempt(|| body(size));
            if let ControlFlow::Break(result) = self.finish(outcome) {
                return result;
            }
        }
    }

    /// The batch size of the next attempt.
    pub fn size(&self) -> usize {
        self.sizer.size
    }

    /// Whether an out-of-memory in the next attempt would be retried.
    pub fn retryable(&self) -> bool {
        self.sizer.size > 1
    }

    /// Runs one attempt, catching its panic.
    pub fn attempt<R>(&mut self, body: impl FnOnce() -> R) -> std::thread::Result<R> {
        let span = self.sizer.span();
        let _entered = span.as_ref().map(tracing::Span::enter);
        tracing::debug!(op = "batch", function = self.sizer.name, size = self.sizer.size, "toma: attempt");
        self.sizer.begin_attempt();
        catch_attempt(self.retryable(), body)
    }

    /// Wraps one attempt's future so that its panic is caught.
    pub fn attempt_async<F: Future>(&mut self, future: F) -> CatchUnwind<F> {
        tracing::debug!(op = "batch", function = self.sizer.name, size = self.sizer.size, "toma: attempt");
        self.sizer.begin_attempt();
        CatchUnwind::new(future, self.retryable()).in_span(self.sizer.span())
    }

    /// Takes an attempt's outcome: `Break` with the call's result, or `Continue` to try again
    /// at the new [`size`](Self::size). Resumes a panic that is not to be retried.
    pub fn finish<T, E: OutOfMemory>(
        &mut self,
        outcome: std::thread::Result<Result<T, E>>,
    ) -> ControlFlow<Result<T, E>> {
        let span = self.sizer.span();
        let _entered = span.as_ref().map(tracing::Span::enter);
        match classify(outcome) {
            Ok(value) => {
                self.sizer.succeeded(self.sizer.size, true);
                self.sizer.conclude();
                ControlFlow::Break(Ok(value))
            }
            Err(failure) => {
                if failure.is_out_of_memory(self.sizer.decide) && self.sizer.out_of_memory(self.sizer.size, &failure) {
                    drop(failure);
                    ControlFlow::Continue(())
                } else {
                    self.sizer.conclude();
                    ControlFlow::Break(Err(failure.give_back()))
                }
            }
        }
    }

    /// What the call did so far.
    pub fn report(&self) -> Report {
        self.sizer.report()
    }
}
