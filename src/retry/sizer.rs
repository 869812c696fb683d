//! The size a call is at: where it starts (the cache, the policy, a plan), how it moves after
//! a success or an out-of-memory, and the report of what happened.

use std::time::Instant;

use super::unwind::Failure;
use super::Attempt;
use super::{Report, Settings};
use crate::cache::{self, CacheKind, CallSite, Entry, Operation};
use crate::memory::PeakCounter;
use crate::oom::{first_line, panic_message, Decide, OutOfMemory};
use crate::policy::Policy;

/// The size a call is at, what the cache knows, and what happened so far.
#[derive(Debug)]
pub(super) struct Sizer {
    pub(super) op: Operation,
    /// The call's override of the out-of-memory decision.
    pub(super) decide: Option<Decide>,
    pub(super) name: &'static str,
    pub(super) key: Option<u64>,
    pub(super) hint: cache::Hint,
    pub(super) policy: Policy,
    pub(super) cap: usize,
    /// The cache entry as this call last saw or wrote it.
    pub(super) seen: Option<Entry>,
    /// Size of the next attempt.
    pub(super) size: usize,
    /// Largest size that worked in this call or before (0: none known).
    pub(super) ok: usize,
    /// Smallest size that failed in this call or before.
    pub(super) failed: usize,
    pub(super) report: Report,
    /// Clock for the report: only read when someone will see the times.
    pub(super) timed: Option<Instant>,
    pub(super) attempt_started: Option<Instant>,
    pub(super) concluded: bool,
    /// What only some calls pay for (`None` for the rest: a cache hit stays small and fast).
    pub(super) extras: Option<Box<Extras>>,
}

/// A call's span, when a subscriber wants it, and its history, when its caller asked for a
/// report.
#[derive(Debug, Default)]
pub(super) struct Extras {
    /// `toma.batch`, `toma.range` or `toma.chunked`, entered around each attempt and its outcome.
    span: Option<tracing::Span>,
    history: Option<History>,
}

impl Extras {
    #[cold]
    #[inline(never)]
    fn start(
        op: Operation,
        name: &'static str,
        caller: &'static std::panic::Location<'static>,
        initial: usize,
        settings: &Settings,
        report_wanted: bool,
    ) -> Option<Box<Extras>> {
        let span = match op {
            Operation::Batch => tracing::info_span!("toma.batch", function = name, site = %caller, initial),
            Operation::Range => tracing::info_span!("toma.range", function = name, site = %caller, initial),
            #[cfg(feature = "tch")]
            Operation::Chunked => tracing::info_span!("toma.chunked", function = name, site = %caller, initial),
        };
        let span = (!span.is_disabled()).then_some(span);
        // Only a caller who asked for the report pays for the history.
        let history = report_wanted.then(|| {
            let counter = PeakCounter::for_device(settings.device.unwrap_or_else(crate::memory::work_device));
            let available = counter.and_then(PeakCounter::available);
            History {
                counter,
                start: 0,
                previous_peak: 0,
                measuring: false,
                attempts: Vec::new(),
                dropped: 0,
                available,
            }
        });
        (span.is_some() || history.is_some()).then(|| Box::new(Extras { span, history }))
    }
}

impl History {
    /// Gives the counter back the peak it had before this attempt's measurement (see
    /// [`PeakCounter::end`]); once per measurement.
    fn end_measurement(&mut self) {
        if let Some(counter) = self.counter {
            if std::mem::take(&mut self.measuring) {
                counter.end(self.previous_peak);
            }
        }
    }
}

#[derive(Debug)]
struct History {
    /// The counter that measures each attempt's peak, and what was allocated when the current
    /// attempt started.
    counter: Option<PeakCounter>,
    start: u64,
    /// The counter's peak before this attempt's measurement reset it, and whether that
    /// measurement is still open.
    previous_peak: u64,
    measuring: bool,
    attempts: Vec<Attempt>,
    dropped: u64,
    available: Option<u64>,
}

impl Sizer {
    /// `device`: the CUDA device the work runs on, if known (`None`: libtorch's current one).
    #[inline]
    pub(super) fn start(
        op: Operation,
        initial: usize,
        kind: CacheKind,
        settings: Settings,
        site: CallSite,
        report_wanted: bool,
    ) -> Self {
        let timed = (report_wanted || tracing::enabled!(tracing::Level::INFO)).then(Instant::now);
        // Only StacktraceMemory keys read free memory, so only they need the device.
        let device = match kind {
            CacheKind::StacktraceMemory => settings.device.unwrap_or_else(crate::memory::work_device),
            _ => None,
        };
        let key = cache::key(kind, op, site, device, settings.planned);
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
        // Without a subscriber at INFO and without a report, a call pays for neither span nor
        // history: `timed` already asked both.
        let extras = if timed.is_some() {
            Extras::start(op, name, site.caller, initial, &settings, report_wanted)
        } else {
            None
        };
        let span = extras.as_ref().and_then(|e| e.span.clone());
        let _entered = span.as_ref().map(tracing::Span::enter);
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
            extras,
        }
    }

    pub(super) fn begin_attempt(&mut self) {
        self.report.attempts += 1;
        if self.extras.is_some() {
            self.measure_from_here();
        }
        if self.timed.is_some() {
            self.attempt_started = Some(Instant::now());
        }
    }

    /// The call's span, to enter around an attempt or its outcome (a clone: the sizer stays
    /// free to change while it is entered).
    #[inline]
    pub(super) fn span(&self) -> Option<tracing::Span> {
        self.extras.as_ref().and_then(|e| e.span.clone())
    }

    #[cold]
    #[inline(never)]
    fn measure_from_here(&mut self) {
        if let Some(History { counter: Some(counter), start, previous_peak, measuring, .. }) =
            self.extras.as_mut().and_then(|e| e.history.as_mut())
        {
            (*start, *previous_peak) = counter.start().unwrap_or((0, 0));
            *measuring = true;
        }
    }

    /// Adds the attempt that just ended to the history, when there is one.
    #[inline]
    fn record(&mut self, size: usize, out_of_memory: bool) {
        if self.extras.is_some() {
            self.record_attempt(size, out_of_memory);
        }
    }

    #[cold]
    #[inline(never)]
    fn record_attempt(&mut self, size: usize, out_of_memory: bool) {
        let Some(history) = self.extras.as_mut().and_then(|e| e.history.as_mut()) else { return };
        let peak = history.counter.and_then(PeakCounter::peak).map(|p| p.saturating_sub(history.start));
        history.end_measurement();
        if history.attempts.len() >= Report::HISTORY_MAX {
            history.dropped += 1;
            return;
        }
        let duration = self.attempt_started.map(|t| t.elapsed()).unwrap_or_default();
        history.attempts.push(Attempt { size, out_of_memory, duration, peak });
    }

    /// Records a success with `len` (the size the attempt really used). `full` is false for a
    /// clipped last sub-range, which says nothing about the step.
    pub(super) fn succeeded(&mut self, len: usize, full: bool) {
        self.record(len, false);
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
    pub(super) fn out_of_memory<E>(&mut self, failed: usize, failure: &Failure<E>) -> bool
    where
        E: OutOfMemory,
    {
        self.out_of_memory_with(failed, || match failure {
            Failure::Panic(payload) => ("panic", panic_message(payload.as_ref()).unwrap_or_default()),
            Failure::Error(err) => ("error", err.message().unwrap_or_default()),
        })
    }

    /// [`out_of_memory`](Self::out_of_memory) with the failure described lazily, as
    /// `(caught, text)` (only read when an `info` event is logged).
    pub(super) fn out_of_memory_with(
        &mut self,
        failed: usize,
        describe: impl FnOnce() -> (&'static str, String),
    ) -> bool {
        self.report.out_of_memory += 1;
        self.record(failed, true);
        if let Some(started) = self.attempt_started.take() {
            self.report.failed_time += started.elapsed();
        }
        self.failed = self.failed.min(failed);
        if failed <= 1 {
            tracing::info!(op = ?self.op, function = self.name, size = failed, "toma: out of memory at size 1, giving up");
            return false;
        }
        let next = self.next_below(failed);
        if let Some(key) = self.key {
            self.seen = Some(cache::record_out_of_memory(key, failed, next, self.hint));
        }
        if tracing::enabled!(tracing::Level::INFO) {
            let (caught, text) = describe();
            tracing::info!(
                op = ?self.op,
                function = self.name,
                from = failed,
                to = next,
                caught,
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

    /// The size the policy goes to after an out-of-memory at `failed` (≥ 2): the current size
    /// shrunk as often as it takes to fall below `failed`.
    pub(super) fn next_below(&self, failed: usize) -> usize {
        let mut next = self.size.max(failed);
        while next >= failed && next > 1 {
            // `shrink` goes down and stays at least 1: this ends.
            next = self.policy.shrink(next, self.ok);
        }
        next
    }

    /// A size the ranks of a group agreed on (feature `dist`). After a round in which some rank
    /// ran out of memory, `failed` is the smallest size that failed on any rank: it is recorded
    /// with the agreed size, so every rank's cache entry says the same.
    #[cfg(feature = "dist")]
    pub(super) fn agree_on(&mut self, size: usize, failed: Option<usize>) {
        self.size = size;
        if let Some(failed) = failed {
            self.failed = self.failed.min(failed);
            if let (Some(key), true) = (self.key, size < self.failed) {
                self.seen = Some(cache::record_out_of_memory(key, self.failed, size, self.hint));
            }
        }
    }

    /// The report of the call so far.
    pub(super) fn report(&self) -> Report {
        let mut report = self.report.clone();
        report.final_size = self.size;
        if let Some(history) = self.extras.as_ref().and_then(|e| e.history.as_ref()) {
            report.history = history.attempts.clone();
            report.history_dropped = history.dropped;
            report.available = history.available;
        }
        if let Some(clock) = self.timed {
            report.total_time = clock.elapsed();
        }
        report
    }

    /// Ends the call: logs a summary when it caught out-of-memories.
    pub(super) fn conclude(&mut self) {
        // An attempt that ended the call with another error was measured but not recorded.
        if let Some(history) = self.extras.as_mut().and_then(|e| e.history.as_mut()) {
            history.end_measurement();
        }
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
