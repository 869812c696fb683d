//! [`Range`]: a body run over consecutive sub-ranges, the step shrunk on out-of-memory.

use std::future::Future;
use std::panic::Location;

use super::auto::{Auto, AutoSettings, Objective};
use super::sizer::Sizer;
use super::unwind::{catch_attempt, classify, CatchUnwind};
use super::{Report, Settings};
use crate::cache::{self, CacheKind, CallSite, Operation};
use crate::error::{nonzero, ConfigError};
use crate::oom::OutOfMemory;
use crate::progress::{Bar, Progress};

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
    /// `Some` for [`Range::auto`]: the step comes from measured peaks.
    pub(crate) auto: Option<AutoSettings>,
    pub(crate) progress: Progress,
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
        Ok(Range { start, end, initial, settings: Settings::default(), auto: None, progress: Progress::Off })
    }

    /// A range whose step is sized from measurement instead of a guess: the first chunks are
    /// probes (real work, never redone), each chunk's allocator peak above the call's baseline
    /// is measured on the CPU (libtorch's allocator, counted from the first `auto` call on:
    /// [`track_cpu_allocations`](crate::memory::track_cpu_allocations), about +0.8 µs per CPU
    /// allocation for the rest of the process) and on every CUDA device libtorch has, a line
    /// `fixed + per_item · n` is fitted per device, and each next step is the largest that keeps
    /// every device under its budget. Every chunk is measured again and refines the fit. A real
    /// out-of-memory goes through the retry engine (the step shrinks by the policy) and the
    /// step stays below the size that failed. The fit is remembered under the call's cache key:
    /// the next call starts at the fitted step, with no probes.
    ///
    /// The budget per device is [`budget`](Self::budget), or its free memory now (CUDA: driver
    /// free + libtorch's cached bytes; CPU: [`available_cpu_memory`](crate::cpu_memory::available_cpu_memory),
    /// which honours a cap) less the [`safety_margin`](Self::safety_margin) (10%).
    ///
    /// The model is a line: a body whose peak grows faster than its length (an `n × n`
    /// product of the chunk with itself) can go over the budget at a step the line allowed.
    /// The 16-fold growth cap keeps such a miss small, the fit is raised to cover it at once,
    /// and [`AutoReport::over_budget`](crate::AutoReport::over_budget) counts it.
    ///
    /// The peak counters are process-wide: two `auto` loops running at once on one device
    /// measure each other's peaks too (safe, but smaller steps). Without feature `tch` nothing
    /// can be measured, and the step grows 16-fold per chunk up to [`max_step`](Self::max_step).
    ///
    /// ```
    /// # #[cfg(feature = "tch")] {
    /// use tch::{Device, Kind, Tensor};
    /// let data = Tensor::ones([10_000, 256], (Kind::Float, Device::Cpu));
    /// let weights = Tensor::ones([256, 1024], (Kind::Float, Device::Cpu));
    /// let mut total = 0.0;
    /// let (result, report) = toma::Range::auto(0, 10_000).budget(16 << 20).run_with_report(|start, end| {
    ///     let part = data.f_narrow(0, start as i64, (end - start) as i64)?;
    ///     total += part.f_matmul(&weights)?.f_relu()?.f_sum(Kind::Float)?.f_double_value(&[])?;
    ///     Ok::<(), tch::TchError>(())
    /// });
    /// result.unwrap();
    /// let auto = report.auto.unwrap();
    /// assert_eq!(auto.over_budget, 0); // no chunk went over 16 MiB once the fit existed
    /// # }
    /// ```
    ///
    /// # Panics
    /// When `start > end`; [`Range::try_auto`] reports it instead.
    #[track_caller]
    pub fn auto(start: usize, end: usize) -> Self {
        Self::try_auto(start, end).unwrap_or_else(|err| panic!("{err}"))
    }

    /// Like [`Range::auto`], with bad input reported as a [`ConfigError`].
    pub fn try_auto(start: usize, end: usize) -> Result<Self, ConfigError> {
        let mut range = Self::try_new(start, end, 1)?;
        range.auto = Some(AutoSettings::default());
        Ok(range)
    }

    /// `auto` only: the bytes the body may add at its peak, on each device, over what is in
    /// use when the call starts (instead of the free memory less the margin).
    ///
    /// # Panics
    /// When `bytes` is 0, or on a range that is not [`auto`](Self::auto).
    #[track_caller]
    pub fn budget(mut self, bytes: u64) -> Self {
        if bytes == 0 {
            panic!("{}", ConfigError::ZeroSize { what: "budget (bytes)" });
        }
        self.auto_settings().budget = Some(bytes);
        self
    }

    /// `auto` only: the fraction of free memory kept back when no budget is given (0.1).
    ///
    /// # Panics
    /// When `fraction` is not in `[0, 1)`, or on a range that is not [`auto`](Self::auto).
    #[track_caller]
    pub fn safety_margin(mut self, fraction: f64) -> Self {
        if !(0.0..1.0).contains(&fraction) {
            panic!("{}", ConfigError::OutOfRange { what: "safety margin", range: "[0, 1)", value: fraction });
        }
        self.auto_settings().margin = fraction;
        self
    }

    /// `auto` only: the largest step to use, whatever fits.
    ///
    /// # Panics
    /// When `step` is 0, or on a range that is not [`auto`](Self::auto).
    #[track_caller]
    pub fn max_step(mut self, step: usize) -> Self {
        if step == 0 {
            panic!("{}", ConfigError::ZeroSize { what: "max_step" });
        }
        self.auto_settings().max_step = Some(step);
        self
    }

    /// Shows the call's progress on stderr (see [`Progress`]): `true` draws a bar when stderr
    /// is a terminal. Needs feature `progress`; without it nothing is drawn.
    pub fn progress(mut self, progress: impl Into<Progress>) -> Self {
        self.progress = progress.into();
        self
    }

    /// `auto` only: settle on the largest step that fits (the default) or the fastest one
    /// measured. `Fastest` times every full chunk, explores doubling steps up to the largest
    /// that fits, times each candidate three times and takes the median (the first run of a
    /// new size pays allocator and kernel warm-up), prefers a larger step only when it is at
    /// least 5% faster, and explores again when throughput at the chosen step drops below 80%.
    /// It pays where time per item falls with the step and then flattens (GPU kernels
    /// saturate; on a CPU a transformer block's time per sample is flat from batch 2 to 64):
    /// the smaller step leaves memory to other work at no cost in speed. Exploring costs a few
    /// chunks at sizes that turn out slower.
    ///
    /// # Panics
    /// On a range that is not [`auto`](Self::auto).
    #[track_caller]
    pub fn objective(mut self, objective: Objective) -> Self {
        self.auto_settings().objective = objective;
        self
    }

    #[track_caller]
    fn auto_settings(&mut self) -> &mut AutoSettings {
        self.auto.as_mut().unwrap_or_else(|| {
            panic!("toma: budget, safety_margin, max_step and objective are options of Range::auto / Chunked::auto")
        })
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
        let mut sizer = Sizer::start(op, self.initial, kind, self.settings, site, report);
        let auto = self.auto.map(|settings| {
            let mut auto = Auto::start(settings, sizer.key);
            sizer.size = auto.first_step(sizer.failed);
            sizer.report.first_size = sizer.size;
            sizer.report.from_cache = auto.started_from_remembered_fit();
            Box::new(auto)
        });
        let label = match op {
            Operation::Batch | Operation::Range => "range",
            #[cfg(feature = "tch")]
            Operation::Chunked => "chunked",
        };
        let bar = Bar::start(self.progress, self.start, self.end, label);
        RangeAttempts { sizer, first: self.start, position: self.start, end: self.end, auto, bar }
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
    pub(super) sizer: Sizer,
    /// Where the range starts: [`RangeAttempts::restart`] goes back to it.
    first: usize,
    position: usize,
    end: usize,
    auto: Option<Box<Auto>>,
    bar: Option<Box<Bar>>,
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
        if let Some(auto) = self.auto.as_mut() {
            auto.before_chunk();
        }
    }

    /// Runs one attempt, catching its panic.
    pub fn attempt<R>(&mut self, body: impl FnOnce() -> R) -> std::thread::Result<R> {
        let span = self.sizer.span();
        let _entered = span.as_ref().map(tracing::Span::enter);
        self.begin();
        catch_attempt(self.retryable(), body)
    }

    /// Wraps one attempt's future so that its panic is caught.
    pub fn attempt_async<F: Future>(&mut self, future: F) -> CatchUnwind<F> {
        self.begin();
        CatchUnwind::new(future, self.retryable()).in_span(self.sizer.span())
    }

    /// Takes an attempt's outcome: `Ok` to go on (with the next sub-range or a smaller one),
    /// `Err` to stop with the body's error. Resumes a panic that is not to be retried.
    ///
    /// # Panics
    /// When called after [`next_range`](Self::next_range) returned `None`.
    pub fn finish<E: OutOfMemory>(&mut self, outcome: std::thread::Result<Result<(), E>>) -> Result<(), E> {
        let span = self.sizer.span();
        let _entered = span.as_ref().map(tracing::Span::enter);
        let (start, end) = self.next_range().expect("toma: RangeAttempts::finish after the range was done");
        match classify(outcome) {
            Ok(()) => {
                self.succeeded(start, end);
                Ok(())
            }
            Err(failure) => {
                if failure.is_out_of_memory(self.sizer.decide) && self.sizer.out_of_memory(end - start, &failure) {
                    drop(failure);
                    self.shrunk(start);
                    Ok(())
                } else {
                    self.stop();
                    Err(failure.give_back())
                }
            }
        }
    }

    /// The chunk `[start, end)` succeeded: move past it, at the next step.
    pub(super) fn succeeded(&mut self, start: usize, end: usize) {
        let len = end - start;
        let (step, full) = (self.sizer.size, len == self.sizer.size);
        // `auto` reads the chunk's peak before the history's measurement ends (which
        // gives the counter back its earlier peak).
        let next = self.auto.as_mut().map(|auto| auto.after_chunk(len, step, full, self.sizer.failed));
        self.sizer.succeeded(len, full);
        if let Some(next) = next {
            self.sizer.size = next;
        }
        self.position = end;
        if let Some(bar) = self.bar.as_mut() {
            bar.advance(end, self.sizer.size);
        }
        if self.position == self.end {
            self.stop();
        }
    }

    /// Goes back to the range's start, keeping the (smaller) step: for a body whose chunks
    /// build one result in place, which a failed chunk spoiled (toma::lazy's gradients).
    #[cfg_attr(not(feature = "tch"), allow(dead_code))]
    pub(crate) fn restart(&mut self) {
        tracing::debug!(from = self.position, to = self.first, step = self.sizer.size, "toma: range restarts");
        self.position = self.first;
    }

    /// The chunk at `start` ran out of memory and will be retried at the (smaller) step.
    pub(super) fn shrunk(&mut self, start: usize) {
        if let Some(bar) = self.bar.as_mut() {
            bar.out_of_memory(start, self.sizer.size);
        }
    }

    /// The call ends (done, or with an error).
    pub(super) fn stop(&mut self) {
        self.sizer.conclude();
        if let Some(bar) = self.bar.as_mut() {
            bar.finish();
        }
    }

    /// What the call did so far.
    pub fn report(&self) -> Report {
        let mut report = self.sizer.report();
        report.auto = self.auto.as_ref().map(|auto| auto.report());
        report
    }
}
