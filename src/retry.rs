//! The retry engine: run a body, and on an out-of-memory halve the size and run it again.
//!
//! [`Batch`], [`Range`] and [`Chunked`](crate::Chunked) are small builders; the attributes and
//! [`execute`](crate::execute) lower to them. Each attempt ends in one of three ways:
//!
//! - **ok**: the size is remembered in the cache and the result returned;
//! - **out of memory** (an `Err` whose [`OutOfMemory::is_out_of_memory`] is true, or a panic
//!   whose message is an out-of-memory): everything of the attempt is dropped, the size goes
//!   to `size / 2`, and the body runs again; at size 1 the error is returned, or the panic
//!   resumed;
//! - **anything else**: the error is returned, or the panic resumed, at once and unchanged.
//!
//! Nothing loops forever: each retry halves a size of at least 2, so a body runs at most
//! `⌊log2(initial)⌋ + 1` times per (sub-)range.

use std::cell::Cell;
use std::future::Future;
use std::ops::ControlFlow;
use std::panic::{self, AssertUnwindSafe, Location};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::task::{Context, Poll};

use std::time::{Duration, Instant};

use crate::cache::{self, CacheKind, CallSite, Entry, Operation};
use crate::oom::{first_line, is_out_of_memory_panic, panic_message, Decide, OutOfMemory};
use crate::policy::Policy;

/// A configuration that cannot run, reported by the builders' `try_new`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An initial batch size or step of 0: no attempt could ever run.
    #[error("toma: the initial {what} must be at least 1, got 0")]
    ZeroSize {
        /// `"batch size"` or `"step"`.
        what: &'static str,
    },
    /// A range whose start lies after its end.
    #[error("toma: range start {start} is after its end {end}")]
    StartAfterEnd {
        /// The range's start.
        start: usize,
        /// The range's end.
        end: usize,
    },
    /// A [`Policy::factor`](crate::Policy::factor) outside (0, 1): it would not shrink.
    #[error("toma: a shrink factor must be strictly between 0 and 1, got {factor}")]
    InvalidFactor {
        /// The factor asked for.
        factor: f64,
    },
    /// A chunking dimension the tensor does not have.
    #[error("toma: dimension {dimension} is out of range for a tensor with {ndim} dimension(s)")]
    DimensionOutOfRange {
        /// The dimension asked for.
        dimension: i64,
        /// The number of dimensions the tensor has.
        ndim: usize,
    },
}

fn nonzero(size: usize, what: &'static str) -> Result<usize, ConfigError> {
    if size == 0 {
        Err(ConfigError::ZeroSize { what })
    } else {
        Ok(size)
    }
}

// ---------------------------------------------------------------------------------------------
// Quiet panics: a caught out-of-memory panic should not print a backtrace for every retry.

thread_local! {
    /// How many retryable attempts enclose the current code on this thread.
    static RETRYABLE_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether caught out-of-memory panics are silenced: [`quiet_caught_panics`].
static QUIET: AtomicBool = AtomicBool::new(true);

/// Whether toma silences the message of an out-of-memory panic that it catches and retries (on
/// by default): tch's plain methods panic on an out-of-memory, and the default hook would print
/// a message and a backtrace for every retry.
///
/// To do that, the first retryable attempt wraps the process's panic hook once
/// ([`std::panic::set_hook`]): an out-of-memory panic inside a retryable attempt is then not
/// passed on; every other panic reaches the previous hook unchanged. `quiet_caught_panics(false)`
/// before the first call keeps toma's hook out entirely; later, it makes the wrapper pass every
/// panic on. A hook you set after toma's replaces it (caught panics then print again): install
/// your hook first, and toma wraps it.
///
/// ```
/// toma::quiet_caught_panics(false); // every caught panic reaches the panic hook
/// # toma::quiet_caught_panics(true);
/// ```
pub fn quiet_caught_panics(on: bool) {
    QUIET.store(on, Ordering::Relaxed);
}

/// Wraps the panic hook once, while quieting is on (see [`quiet_caught_panics`]).
fn install_quiet_hook() {
    static INSTALL: Once = Once::new();
    if !QUIET.load(Ordering::Relaxed) {
        return;
    }
    INSTALL.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let quiet = QUIET.load(Ordering::Relaxed)
                && RETRYABLE_DEPTH.with(Cell::get) > 0
                && is_out_of_memory_panic(info.payload());
            if !quiet {
                previous(info);
            }
        }));
    });
}

/// Marks the current thread as inside a retryable attempt while it lives.
struct QuietGuard {
    active: bool,
}

impl QuietGuard {
    fn new(retryable: bool) -> Self {
        if retryable {
            install_quiet_hook();
            RETRYABLE_DEPTH.with(|d| d.set(d.get() + 1));
        }
        QuietGuard { active: retryable }
    }
}

impl Drop for QuietGuard {
    fn drop(&mut self) {
        if self.active {
            RETRYABLE_DEPTH.with(|d| d.set(d.get() - 1));
        }
    }
}

/// Runs one attempt, catching its panic. `AssertUnwindSafe` is sound in the sense that
/// matters here: after a caught panic the body runs again only when the panic was an
/// out-of-memory, which libtorch raises before it changes any tensor.
fn catch_attempt<R>(retryable: bool, body: impl FnOnce() -> R) -> std::thread::Result<R> {
    let _quiet = QuietGuard::new(retryable);
    panic::catch_unwind(AssertUnwindSafe(body))
}

/// A future that catches a panic of the future it wraps, silencing out-of-memory panics
/// while it is polled when its attempt is retryable.
#[doc(hidden)]
pub struct CatchUnwind<F> {
    future: F,
    retryable: bool,
}

impl<F: Future> CatchUnwind<F> {
    #[doc(hidden)]
    pub fn new(future: F, retryable: bool) -> Self {
        CatchUnwind { future, retryable }
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // SAFETY: `future` is structurally pinned: it is never moved out of `self`.
        let this = unsafe { self.get_unchecked_mut() };
        let retryable = this.retryable;
        let future = unsafe { Pin::new_unchecked(&mut this.future) };
        match catch_attempt(retryable, || future.poll(cx)) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The shared size state.

/// How one attempt failed, as the engine sees it.
enum Failure<E> {
    Error(E),
    Panic(Box<dyn std::any::Any + Send>),
}

impl<E: OutOfMemory> Failure<E> {
    /// Whether this is an out-of-memory: by the call's own `decide` where it says so (see the
    /// builders' `when`), else by toma's decision.
    fn is_out_of_memory(&self, decide: Option<Decide>) -> bool {
        if let Some(decide) = decide {
            let text = match self {
                Failure::Error(err) => err.message(),
                Failure::Panic(payload) => panic_message(payload.as_ref()),
            };
            if let Some(own) = text.and_then(|text| decide(&text)) {
                return own;
            }
        }
        match self {
            Failure::Error(err) => err.is_out_of_memory(),
            Failure::Panic(payload) => is_out_of_memory_panic(payload.as_ref()),
        }
    }

    /// Gives the failure back to the caller unchanged: an error is returned, a panic resumed.
    fn give_back(self) -> E {
        match self {
            Failure::Error(err) => err,
            Failure::Panic(payload) => panic::resume_unwind(payload),
        }
    }
}

/// Splits an attempt's outcome into success and failure.
fn classify<T, E>(outcome: std::thread::Result<Result<T, E>>) -> Result<T, Failure<E>> {
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(Failure::Error(err)),
        Err(payload) => Err(Failure::Panic(payload)),
    }
}

/// What one call did: returned by the builders' `run_with_report`, and summarised in an `info`
/// event when a call caught out-of-memories.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Times the body ran.
    pub attempts: u32,
    /// Attempts that ran out of memory (and were retried, or ended the call at size 1).
    pub out_of_memory: u32,
    /// The size of the first attempt.
    pub first_size: usize,
    /// Whether the first size came from the cache.
    pub from_cache: bool,
    /// The size the call ended at (for range and chunked: the last step).
    pub final_size: usize,
    /// Wall time spent in attempts that ran out of memory.
    pub failed_time: Duration,
    /// Wall time of the whole call.
    pub total_time: Duration,
}

/// Settings shared by the three builders.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Settings {
    pub(crate) cache: Option<CacheKind>,
    pub(crate) policy: Policy,
    /// What the call belongs to beyond its line: see [`CallSite::identity`].
    pub(crate) identity: Option<(u64, &'static str)>,
    /// The wrapped function's lock-free copy of its `Global` entry.
    pub(crate) hint: cache::Hint,
    /// Where the work runs, when the builder knows (chunked: the tensor's device): `Some(None)`
    /// for the CPU, `Some(Some(i))` for CUDA device `i`.
    pub(crate) device: Option<Option<usize>>,
    /// The call's own say on what is an out-of-memory: see the builders' `when`.
    pub(crate) decide: Option<Decide>,
    /// The initial size was worked out to fit (a `toma::lazy` plan): the cache may only lower
    /// it below a size that failed, not to a smaller size that merely worked before.
    pub(crate) planned: bool,
}

/// The size a call is at, what the cache knows, and what happened so far.
#[derive(Debug)]
struct Sizer {
    op: Operation,
    /// The call's override of the out-of-memory decision.
    decide: Option<Decide>,
    name: &'static str,
    key: Option<u64>,
    hint: cache::Hint,
    policy: Policy,
    cap: usize,
    /// The cache entry as this call last saw or wrote it.
    seen: Option<Entry>,
    /// Size of the next attempt.
    size: usize,
    /// Largest size that worked in this call or before (0: none known).
    ok: usize,
    /// Smallest size that failed in this call or before.
    failed: usize,
    report: Report,
    /// Clock for the report: only read when someone will see the times.
    timed: Option<Instant>,
    attempt_started: Option<Instant>,
    concluded: bool,
}

impl Sizer {
    /// `device`: the CUDA device the work runs on, if known (`None`: libtorch's current one).
    #[inline]
    fn start(op: Operation, initial: usize, kind: CacheKind, settings: Settings, site: CallSite, report: bool) -> Self {
        let timed = (report || tracing::enabled!(tracing::Level::INFO)).then(Instant::now);
        // Only StacktraceMemory keys read free memory, so only they need the device.
        let device = match kind {
            CacheKind::StacktraceMemory => settings.device.unwrap_or_else(crate::memory::work_device),
            _ => None,
        };
        let key = cache::key(kind, op, site, device);
        // A function's Global key is its identity alone, which its hint mirrors.
        let hint = if kind == CacheKind::Global { settings.hint } else { None };
        let seen = key.and_then(|key| cache::lookup(key, hint));
        let policy = settings.policy;
        let cap = policy.cap(initial);
        let (ok, failed) = seen.map_or((0, Entry::NO_FAILURE), |e| (e.ok, e.failed));
        let size = match seen {
            None => initial,
            // A plan's size stands unless it failed before: a smaller size that worked under a
            // tighter budget says nothing about this one.
            Some(e) if settings.planned && e.failed > initial => initial,
            // Always below the smallest size that failed under this key.
            Some(e) if policy.grows() => policy.after_success(e.ok.min(cap), e.failed, cap),
            Some(e) => e.ok.min(initial),
        };
        let name = site.identity.map_or("execute", |(_, name)| name);
        if let Some(entry) = seen {
            tracing::debug!(op = ?op, function = name, size, ok = entry.ok, failed = entry.failed, "toma: starting from the cache");
        }
        let report = Report { first_size: size, from_cache: seen.is_some(), ..Report::default() };
        Sizer {
            op,
            decide: settings.decide,
            name,
            key,
            hint,
            policy,
            cap,
            seen,
            size,
            ok,
            failed,
            report,
            timed,
            attempt_started: None,
            concluded: false,
        }
    }

    fn begin_attempt(&mut self) {
        self.report.attempts += 1;
        if self.timed.is_some() {
            self.attempt_started = Some(Instant::now());
        }
    }

    /// Records a success with `len` (the size the attempt really used). `full` is false for a
    /// clipped last sub-range, which says nothing about the step.
    fn succeeded(&mut self, len: usize, full: bool) {
        if len < self.failed && len > self.ok {
            self.ok = len;
        }
        // Only a full step says what fits: a clipped last sub-range of 10 must not pin later
        // calls to 10. Skipping the write when the cache already knows keeps hits read-only.
        if let (Some(key), true) = (self.key, full && self.seen.is_none_or(|e| e.ok < len && len < e.failed)) {
            self.seen = Some(cache::record_success(key, len, self.hint));
        }
        if full {
            self.size = self.policy.after_success(self.size, self.failed, self.cap);
        }
    }

    /// Records an out-of-memory at `failed` (the size the failed attempt really used) and moves
    /// to the policy's next size: the current size shrunk, as often as it takes to fall below
    /// `failed` (a clipped last sub-range of 40 at step 64 goes on at step 32, as Python toma
    /// does, not at 20; at 10 it goes on at 8, not three times at 10). `false` when there is
    /// nothing smaller to try.
    fn out_of_memory<E>(&mut self, failed: usize, failure: &Failure<E>) -> bool
    where
        E: OutOfMemory,
    {
        self.report.out_of_memory += 1;
        if let Some(started) = self.attempt_started.take() {
            self.report.failed_time += started.elapsed();
        }
        self.failed = self.failed.min(failed);
        if failed <= 1 {
            tracing::info!(op = ?self.op, function = self.name, size = failed, "toma: out of memory at size 1, giving up");
            return false;
        }
        let mut next = self.size.max(failed);
        while next >= failed {
            // `shrink` goes down and stays at least 1, and `failed` ≥ 2 here: this ends.
            next = self.policy.shrink(next, self.ok);
        }
        if let Some(key) = self.key {
            self.seen = Some(cache::record_out_of_memory(key, failed, next, self.hint));
        }
        if tracing::enabled!(tracing::Level::INFO) {
            let text = match failure {
                Failure::Panic(payload) => panic_message(payload.as_ref()).unwrap_or_default(),
                Failure::Error(err) => err.message().unwrap_or_default(),
            };
            tracing::info!(
                op = ?self.op,
                function = self.name,
                from = failed,
                to = next,
                caught = if matches!(failure, Failure::Panic(_)) { "panic" } else { "error" },
                error = first_line(&text),
                "toma: out of memory, retrying with a smaller size"
            );
        }
        // Give libtorch's cached CUDA blocks back before the smaller attempt, as Python toma
        // does; free at once without CUDA.
        crate::memory::release_cached_blocks();
        self.size = next;
        true
    }

    /// The report of the call so far.
    fn report(&self) -> Report {
        let mut report = self.report.clone();
        report.final_size = self.size;
        if let Some(clock) = self.timed {
            report.total_time = clock.elapsed();
        }
        report
    }

    /// Ends the call: logs a summary when it caught out-of-memories.
    fn conclude(&mut self) {
        if self.report.out_of_memory > 0 && !std::mem::replace(&mut self.concluded, true) {
            let report = self.report();
            tracing::info!(
                op = ?self.op,
                function = self.name,
                attempts = report.attempts,
                out_of_memory = report.out_of_memory,
                first_size = report.first_size,
                final_size = report.final_size,
                failed_ms = report.failed_time.as_secs_f64() * 1e3,
                "toma: call done"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Batch

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

/// The builder methods that every retry builder shares, over its [`Settings`] at `$settings`.
macro_rules! settings_methods {
    ($builder:ty, $($settings:ident).+, $moves:literal) => {
        impl $builder {
            /// Which cache to use; without this, the process default ([`crate::default_cache`]).
            pub fn cache(mut self, kind: $crate::CacheKind) -> Self {
                self.$($settings).+.cache = Some(kind);
                self
            }

            #[doc = concat!("How the ", $moves, " moves; [`Policy::halve`](crate::Policy::halve) without this.")]
            pub fn policy(mut self, policy: $crate::Policy) -> Self {
                self.$($settings).+.policy = policy;
                self
            }

            /// Overrides toma's decision ([`toma::oom`](crate::oom)) for this call: `decide` gets
            /// each failure's text (an error's [`message`](crate::OutOfMemory::message), a panic's
            /// text) and answers `Some(true)` to retry it as an out-of-memory, `Some(false)` to
            /// give it back at once, or `None` to leave it to toma. A plain `fn` or a closure
            /// that captures nothing; for every call in the process, see
            /// [`oom::add_out_of_memory_marker`](crate::oom::add_out_of_memory_marker). A panic
            /// retried only because `decide` said so still reaches the panic hook (see
            /// [`quiet_caught_panics`](crate::quiet_caught_panics)).
            ///
            /// ```
            /// let out = toma::Batch::new(8)
            ///     .cache(toma::CacheKind::None)
            ///     .when(|text| text.contains("arena exhausted").then_some(true))
            ///     .run(|bs| if bs > 2 { Err(format!("my_allocator: arena exhausted at {bs}")) } else { Ok(bs) });
            /// assert_eq!(out, Ok(2));
            /// ```
            pub fn when(mut self, decide: $crate::oom::Decide) -> Self {
                self.$($settings).+.decide = Some(decide);
                self
            }

            #[doc(hidden)]
            pub fn site(mut self, site: &'static $crate::cache::Site) -> Self {
                self.$($settings).+.identity = Some(site.identity());
                self.$($settings).+.hint = site.hint();
                self
            }
        }
    };
}
#[cfg(feature = "tch")]
pub(crate) use settings_methods;

settings_methods!(Batch, settings, "size");
settings_methods!(Range, settings, "step");

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
        Ok(Batch { initial: nonzero(initial_batchsize, "batch size")?, settings: Settings::default() })
    }

    /// Starts the attempts by hand, for callers that drive the loop themselves (the
    /// attributes on `async fn` do). Most code wants [`Batch::run`].
    #[doc(hidden)]
    #[track_caller]
    pub fn start(self) -> BatchAttempts {
        self.start_at(Location::caller(), false)
    }

    fn start_at(self, caller: &'static Location<'static>, report: bool) -> BatchAttempts {
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
    sizer: Sizer,
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
        tracing::debug!(op = "batch", function = self.sizer.name, size = self.sizer.size, "toma: attempt");
        self.sizer.begin_attempt();
        catch_attempt(self.retryable(), body)
    }

    /// Wraps one attempt's future so that its panic is caught.
    pub fn attempt_async<F: Future>(&mut self, future: F) -> CatchUnwind<F> {
        tracing::debug!(op = "batch", function = self.sizer.name, size = self.sizer.size, "toma: attempt");
        self.sizer.begin_attempt();
        CatchUnwind::new(future, self.retryable())
    }

    /// Takes an attempt's outcome: `Break` with the call's result, or `Continue` to try again
    /// at the new [`size`](Self::size). Resumes a panic that is not to be retried.
    pub fn finish<T, E: OutOfMemory>(
        &mut self,
        outcome: std::thread::Result<Result<T, E>>,
    ) -> ControlFlow<Result<T, E>> {
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

// ---------------------------------------------------------------------------------------------
// Range

/// Runs a body over `[start, end)` in consecutive sub-ranges of at most `step` indices,
/// shrinking the step on out-of-memory.
///
/// A failed sub-range is retried with the policy's smaller length (half of it by default);
/// finished sub-ranges are never redone, and the smaller step holds for the rest of the call
/// (unless the policy [grows](Policy::grow)).
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
        let initial = nonzero(initial_step, "step")?;
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
    /// in [`Batch::run`].
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

// ---------------------------------------------------------------------------------------------
// Sugar used by generated code.

/// Turns an infallible body's value into the `Result` the engine takes.
#[doc(hidden)]
#[inline(always)]
pub fn infallible<T>(value: T) -> Result<T, std::convert::Infallible> {
    Ok(value)
}

/// Takes the value back out of an engine result whose error type is uninhabited.
#[doc(hidden)]
#[inline(always)]
pub fn unwrap_infallible<T>(result: Result<T, std::convert::Infallible>) -> T {
    match result {
        Ok(value) => value,
        Err(never) => match never {},
    }
}

/// Fixes an async block's output type before it is awaited, so that `?` inside the body
/// knows which error to convert into.
#[doc(hidden)]
#[inline(always)]
pub fn typed_future<R, F: Future<Output = R>>(future: F) -> F {
    future
}
