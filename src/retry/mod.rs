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

mod auto;
mod batch;
#[cfg(feature = "tch")]
mod chunked;
#[cfg(feature = "dist")]
mod grouped;
mod range;
mod sizer;
mod unwind;

use std::future::Future;
use std::time::Duration;

pub use auto::{AutoReport, DeviceFit, MeasuredDevice, Objective};
pub use batch::{Batch, BatchAttempts};
#[cfg(feature = "tch")]
pub use chunked::{Chunked, ChunkedAttempts};
#[cfg(all(feature = "dist", feature = "tch"))]
pub use grouped::GroupedChunked;
#[cfg(feature = "dist")]
pub use grouped::{GroupedBatch, GroupedRange};
pub use range::{Range, RangeAttempts};
pub use unwind::{quiet_caught_panics, CatchUnwind};

use crate::cache::{self, CacheKind};
use crate::oom::Decide;
use crate::policy::Policy;

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
    /// For `auto` steps: the fitted models, budgets, the step chosen and why.
    pub auto: Option<AutoReport>,
    /// Each attempt, in order: recorded by `run_with_report` (empty otherwise), at most
    /// [`Report::HISTORY_MAX`] of them (`history_dropped` counts the rest).
    pub history: Vec<Attempt>,
    /// Attempts past [`Report::HISTORY_MAX`], counted but not kept.
    pub history_dropped: u64,
    /// The bytes the work could take when the call started, on the device whose peaks
    /// [`Attempt::peak`] measures (`run_with_report` only; `None` without a counter). An
    /// `auto` call's own budget is in [`AutoReport`].
    pub available: Option<u64>,
}

impl Report {
    /// The most attempts a report keeps (a long `range` runs one attempt per chunk).
    pub const HISTORY_MAX: usize = 4096;

    /// The call as a picture: a self-contained SVG with one bar per attempt of
    /// [`history`](Self::history), red where it ran out of memory. Bars show each attempt's
    /// measured peak against the memory available when the call started, when a counter
    /// measured them (CUDA, or the CPU with
    /// [`track_cpu_allocations`](crate::memory::track_cpu_allocations)); else its size. Sizes
    /// label the bars when there are few enough to read.
    ///
    /// Series (`<g data-series="..">`): `attempts`, and `available` when drawn.
    ///
    /// ```
    /// let (result, report) = toma::Batch::new(64).run_with_report(|size| {
    ///     if size > 16 { Err("CUDA out of memory".to_string()) } else { Ok(size) }
    /// });
    /// assert_eq!(result, Ok(16));
    /// assert_eq!(report.history.iter().map(|a| (a.size, a.out_of_memory)).collect::<Vec<_>>(),
    ///            [(64, true), (32, true), (16, false)]);
    /// let svg = report.to_svg("simulated");
    /// assert!(svg.contains("data-series=\"attempts\""));
    /// // std::fs::write("run.svg", svg)?;
    /// ```
    pub fn to_svg(&self, title: &str) -> String {
        use crate::svg::{bytes, Chart, Unit};
        const FITS: &str = "#3a9d5d";
        const OOM: &str = "#d64541";
        let measured = self.history.iter().any(|a| a.peak.is_some());
        let value = |a: &Attempt| if measured { a.peak.unwrap_or(0) as f64 } else { a.size as f64 };
        let top = self.history.iter().map(value).fold(0.0f64, f64::max);
        let available = self.available.filter(|&b| measured && b as f64 <= 2.0 * top.max(1.0));
        let y_max = available.map_or(top, |b| top.max(b as f64));
        let mut heading = format!(
            "{title}: {} attempt(s), {} out of memory; size {} -> {}",
            self.attempts, self.out_of_memory, self.first_size, self.final_size
        );
        if self.history_dropped > 0 {
            heading.push_str(&format!(" (first {} shown)", self.history.len()));
        }
        let (x_label, unit) = if measured {
            ("attempt (bar: peak above what was in use when it started; label: size)", Unit::Bytes)
        } else {
            ("attempt (bar: size)", Unit::Count)
        };
        let mut chart = Chart::new(&heading, x_label, self.history.len() as f64, y_max, unit);
        let labelled = self.history.len() <= 40;
        let bars: Vec<(f64, f64, &str, Option<String>)> = self
            .history
            .iter()
            .enumerate()
            .map(|(k, a)| {
                let color = if a.out_of_memory { OOM } else { FITS };
                (k as f64, value(a), color, labelled.then(|| a.size.to_string()))
            })
            .collect();
        chart.bars("attempts", &bars);
        chart.legend("fits", FITS);
        chart.legend("out of memory", OOM);
        if let Some(b) = available {
            chart.hline("available", &format!("available at the start: {}", bytes(b as f64)), b as f64, "#555");
        }
        chart.finish()
    }
}

/// One attempt of a call, as [`Report::history`] keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attempt {
    /// Its size: the batch size, or the length of the chunk (`range`, `chunked`).
    pub size: usize,
    /// Whether it ran out of memory.
    pub out_of_memory: bool,
    /// Its wall time.
    pub duration: Duration,
    /// The allocator's peak above what was allocated when it started, on the device the work
    /// runs on: CUDA, or the CPU once [`track_cpu_allocations`](crate::memory::track_cpu_allocations)
    /// is on. `None` without such a counter.
    pub peak: Option<u64>,
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
use settings_methods;

/// The weight of the chunk `[start, end)` of a range of `len` items: `(end - start) / len`.
///
/// For exact gradient accumulation over chunks: scale each chunk's *mean*-reduced loss by its
/// share before `backward`, and the summed gradients equal one backward over the whole range.
/// Dividing by the number of chunks instead is wrong whenever the last chunk is shorter, or
/// when the step changes mid-range, as it does under `auto` or after an out-of-memory.
/// A sum-reduced loss needs no weight. `0.0` when `len` is 0.
///
/// ```
/// assert_eq!(toma::share(0, 256, 1000), 0.256);
/// assert_eq!(toma::share(768, 1000, 1000), 0.232);
/// ```
pub fn share(start: usize, end: usize, len: usize) -> f64 {
    if len == 0 {
        return 0.0;
    }
    end.saturating_sub(start) as f64 / len as f64
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
