//! Chunking a tensor along one dimension, with the step halved on out-of-memory.

use std::future::Future;
use std::panic::Location;

use tch::Tensor;

use super::auto::AutoSettings;
use super::{CatchUnwind, Range, RangeAttempts, Report};
use crate::cache::Operation;
use crate::error::ConfigError;
use crate::oom::OutOfMemory;

/// Runs a body on consecutive chunks of a tensor along one dimension, halving the chunk
/// length on out-of-memory.
///
/// Each chunk is `tensor.narrow(dimension, start, end - start)`: a view, so writes into it
/// land in `tensor`. Finished chunks are never redone; a failed chunk is retried with half its
/// length, and the smaller step holds for the rest of the call.
///
/// ```
/// use tch::{Kind, Tensor};
/// use toma::{CacheKind, Chunked};
/// let t = Tensor::zeros([10, 3], (Kind::Float, tch::Device::Cpu));
/// Chunked::new(&t, 4).cache(CacheKind::None).run(|mut chunk, start, _end| {
///     let _ = chunk.fill_(start as f64);
///     Ok::<(), tch::TchError>(())
/// }).unwrap();
/// assert_eq!(t.double_value(&[9, 0]), 8.0);
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `run` is called"]
pub struct Chunked<'a> {
    pub(super) tensor: &'a Tensor,
    pub(super) dimension: i64,
    /// Over `[0, length of the dimension)`.
    pub(super) range: Range,
}

super::settings_methods!(Chunked<'_>, range.settings, "step");

impl<'a> Chunked<'a> {
    /// Chunks of `initial_step` along dimension 0 of `tensor`.
    ///
    /// # Panics
    /// When `initial_step` is 0 or `tensor` has no dimension (a scalar);
    /// [`Chunked::try_new`] reports them instead.
    #[track_caller]
    pub fn new(tensor: &'a Tensor, initial_step: usize) -> Self {
        Self::try_new(tensor, initial_step, 0).unwrap_or_else(|err| panic!("{err}"))
    }

    /// Chunks of `initial_step` along `dimension` (negative counts from the last, as in tch).
    pub fn try_new(tensor: &'a Tensor, initial_step: usize, dimension: i64) -> Result<Self, ConfigError> {
        let (dimension, len) = dimension_len(tensor, dimension)?;
        let mut range = Range::try_new(0, len, initial_step)?;
        // Keys read the free memory of the device the tensor lives on.
        range.settings.device = Some(match tensor.device() {
            tch::Device::Cuda(index) => Some(index),
            _ => None,
        });
        Ok(Chunked { tensor, dimension, range })
    }

    /// Chunks along dimension 0 with a step sized from measurement: see [`Range::auto`] (the
    /// options [`budget`](Self::budget), [`safety_margin`](Self::safety_margin),
    /// [`max_step`](Self::max_step) and [`objective`](Self::objective) are the same).
    ///
    /// # Panics
    /// When `tensor` is a scalar; [`Chunked::try_auto`] reports it instead.
    #[track_caller]
    pub fn auto(tensor: &'a Tensor) -> Self {
        Self::try_auto(tensor, 0).unwrap_or_else(|err| panic!("{err}"))
    }

    /// Like [`Chunked::auto`] along `dimension`, with bad input reported as a [`ConfigError`].
    pub fn try_auto(tensor: &'a Tensor, dimension: i64) -> Result<Self, ConfigError> {
        let mut chunked = Self::try_new(tensor, 1, dimension)?;
        chunked.range.auto = Some(AutoSettings::default());
        Ok(chunked)
    }

    /// As [`Range::budget`].
    #[track_caller]
    pub fn budget(mut self, bytes: u64) -> Self {
        self.range = self.range.budget(bytes);
        self
    }

    /// As [`Range::safety_margin`].
    #[track_caller]
    pub fn safety_margin(mut self, fraction: f64) -> Self {
        self.range = self.range.safety_margin(fraction);
        self
    }

    /// As [`Range::max_step`].
    #[track_caller]
    pub fn max_step(mut self, step: usize) -> Self {
        self.range = self.range.max_step(step);
        self
    }

    /// As [`Range::objective`].
    #[track_caller]
    pub fn objective(mut self, objective: crate::Objective) -> Self {
        self.range = self.range.objective(objective);
        self
    }

    /// Shows the call's progress on stderr: see [`Range::progress`].
    pub fn progress(mut self, progress: impl Into<crate::Progress>) -> Self {
        self.range = self.range.progress(progress);
        self
    }

    /// Chunks along `dimension` instead of 0 (negative counts from the last, as in tch).
    ///
    /// # Panics
    /// When `tensor` has no such dimension; [`Chunked::try_new`] reports it instead.
    #[track_caller]
    pub fn dimension(mut self, dimension: i64) -> Self {
        let (dimension, len) = dimension_len(self.tensor, dimension).unwrap_or_else(|err| panic!("{err}"));
        self.dimension = dimension;
        self.range.end = len;
        self
    }

    /// Runs the call on every rank of `group` in step (feature `dist`), as
    /// [`Range::group`](crate::Range::group): each rank chunks its own tensor, and the ranks agree
    /// on the step.
    #[cfg(feature = "dist")]
    pub fn group(self, group: &crate::dist::Group) -> super::GroupedChunked<'a, '_> {
        super::GroupedChunked { chunked: self, group }
    }

    #[doc(hidden)]
    #[track_caller]
    pub fn start(self) -> ChunkedAttempts<'a> {
        self.start_at(Location::caller(), false)
    }

    fn start_at(self, caller: &'static Location<'static>, report: bool) -> ChunkedAttempts<'a> {
        let attempts = self.range.start_as(Operation::Chunked, caller, report);
        ChunkedAttempts { tensor: self.tensor, dimension: self.dimension, attempts }
    }

    /// Calls `body(chunk, start, end)` on consecutive chunks covering the dimension once each,
    /// in order; `chunk` spans indices `[start, end)`. A zero-length dimension calls nothing.
    ///
    /// Returns as [`Range::run`] does.
    #[track_caller]
    pub fn run<E, F>(self, body: F) -> Result<(), E>
    where
        E: OutOfMemory,
        F: FnMut(Tensor, usize, usize) -> Result<(), E>,
    {
        self.start_at(Location::caller(), false).drive(body)
    }

    /// [`Chunked::run`], also returning what the call did.
    #[track_caller]
    pub fn run_with_report<E, F>(self, body: F) -> (Result<(), E>, Report)
    where
        E: OutOfMemory,
        F: FnMut(Tensor, usize, usize) -> Result<(), E>,
    {
        let mut attempts = self.start_at(Location::caller(), true);
        let result = attempts.drive(body);
        (result, attempts.report())
    }

    /// [`Chunked::run`] for a body that returns a future.
    #[track_caller]
    pub fn run_async<E, F, Fut>(self, mut body: F) -> impl Future<Output = Result<(), E>> + 'a
    where
        E: OutOfMemory + 'a,
        F: FnMut(Tensor, usize, usize) -> Fut + 'a,
        Fut: Future<Output = Result<(), E>> + 'a,
    {
        let mut attempts = self.start_at(Location::caller(), false);
        async move {
            while let Some((chunk, start, end)) = attempts.next_chunk() {
                let outcome = attempts.attempt_async(body(chunk, start, end)).await;
                attempts.finish(outcome)?;
            }
            Ok(())
        }
    }
}

/// The attempts of one chunked call, driven by hand (see [`Chunked::start`]).
#[doc(hidden)]
#[derive(Debug)]
pub struct ChunkedAttempts<'a> {
    tensor: &'a Tensor,
    dimension: i64,
    attempts: RangeAttempts,
}

impl ChunkedAttempts<'_> {
    fn drive<E, F>(&mut self, mut body: F) -> Result<(), E>
    where
        E: OutOfMemory,
        F: FnMut(Tensor, usize, usize) -> Result<(), E>,
    {
        let (tensor, dimension) = (self.tensor, self.dimension);
        self.attempts.drive(|start, end| body(tensor.narrow(dimension, start as i64, (end - start) as i64), start, end))
    }

    /// The next chunk (a view) and its range, or `None` when done.
    pub fn next_chunk(&self) -> Option<(Tensor, usize, usize)> {
        let (start, end) = self.attempts.next_range()?;
        Some((self.tensor.narrow(self.dimension, start as i64, (end - start) as i64), start, end))
    }

    /// Whether an out-of-memory in the next attempt would be retried.
    pub fn retryable(&self) -> bool {
        self.attempts.retryable()
    }

    /// Runs one attempt, catching its panic.
    pub fn attempt<R>(&mut self, body: impl FnOnce() -> R) -> std::thread::Result<R> {
        self.attempts.attempt(body)
    }

    /// Wraps one attempt's future so that its panic is caught.
    pub fn attempt_async<F: Future>(&mut self, future: F) -> CatchUnwind<F> {
        self.attempts.attempt_async(future)
    }

    /// What the call did so far.
    pub fn report(&self) -> Report {
        self.attempts.report()
    }

    /// As [`RangeAttempts::finish`].
    pub fn finish<E: OutOfMemory>(&mut self, outcome: std::thread::Result<Result<(), E>>) -> Result<(), E> {
        self.attempts.finish(outcome)
    }
}

/// Normalises `dimension` like tch and returns it with its length.
fn dimension_len(tensor: &Tensor, dimension: i64) -> Result<(i64, usize), ConfigError> {
    let sizes = tensor.size();
    let ndim = sizes.len();
    let normalised = if dimension < 0 { dimension + ndim as i64 } else { dimension };
    if normalised < 0 || normalised >= ndim as i64 {
        return Err(ConfigError::DimensionOutOfRange { dimension, ndim });
    }
    Ok((normalised, sizes[normalised as usize] as usize))
}
