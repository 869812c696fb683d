//! `auto` steps for [`Range`](super::Range) and [`Chunked`](super::Chunked): the step is sized
//! from the allocator peaks of the call's own chunks instead of a guess.
//!
//! Every chunk is real work and nothing is redone. Before a chunk the peak counters of every
//! device in use are reset; after it, its peak above the call's baseline is one measurement.
//! Per device, a line `fixed + per_item · n` is fitted to the measurements (weighted to the
//! largest chunks, then raised until it covers every one), and the next step is the largest
//! whose predicted peak stays under that device's budget on every device, at most 16 times
//! the largest chunk measured so far (a line fitted on small chunks under-predicts models
//! whose per-item cost grows with the size, such as convolutions). A real out-of-memory still
//! goes through the retry engine, and the step stays below the size that failed.

use std::sync::OnceLock;
use std::time::Instant;

use dashmap::DashMap;

use crate::hash::PassThrough;
use crate::memory;

/// Which step an `auto` call settles on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Objective {
    /// The largest step whose predicted peak fits the budget (the default).
    #[default]
    Largest,
    /// The step with the best measured items per second, among those that fit.
    Fastest,
}

/// The `auto` options of a range or chunked call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AutoSettings {
    pub(crate) budget: Option<u64>,
    pub(crate) margin: f64,
    pub(crate) max_step: Option<usize>,
    pub(crate) objective: Objective,
}

impl Default for AutoSettings {
    fn default() -> Self {
        AutoSettings { budget: None, margin: 0.1, max_step: None, objective: Objective::Largest }
    }
}

/// How much larger than the largest measured chunk the next step may be.
const GROWTH: usize = 16;
/// A larger step must beat a smaller one by this much to be preferred by `Fastest`.
const FASTER_BY: f64 = 1.05;
/// `Fastest` explores again when throughput at the settled step falls below this share.
const DROP: f64 = 0.8;
/// Timings per candidate step before `Fastest` compares them.
const TIMINGS: usize = 3;

/// Where a measurement was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MeasuredDevice {
    /// libtorch's CPU allocator (counted by [`memory::track_cpu_allocations`]).
    Cpu,
    /// CUDA device `i` (libtorch's caching allocator).
    Cuda(usize),
}

/// The fitted memory model of one device, as a report shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceFit {
    /// The device.
    pub device: MeasuredDevice,
    /// Bytes the body may add at its peak on this device.
    pub budget: u64,
    /// Fitted bytes a chunk takes whatever its length.
    pub fixed_bytes: u64,
    /// Fitted bytes per item (rounded up).
    pub bytes_per_item: u64,
    /// The largest measured peak of a chunk above the call's baseline.
    pub max_measured: u64,
    /// The fit's prediction for the chunk with the largest measured peak.
    pub predicted_at_max: u64,
}

/// What an `auto` call measured and decided: in [`Report::auto`](super::Report::auto).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AutoReport {
    /// One fitted model per device measured.
    pub devices: Vec<DeviceFit>,
    /// Probes: chunks whose step was set by the 16-fold growth cap, before the fitted limit
    /// was reached (0 when the call started from a remembered fit).
    pub probes: u32,
    /// Chunks whose measured peak went over their device's budget.
    pub over_budget: u32,
    /// The last step chosen.
    pub step: usize,
    /// Why: `"probe"`, `"largest that fits"`, `"fastest measured"`, `"max_step"`, `"below a
    /// failed size"`, or `"remembered"`.
    pub reason: &'static str,
}

/// A device's measurements and fit.
#[derive(Clone, Debug)]
struct Device {
    id: MeasuredDevice,
    baseline: u64,
    budget: u64,
    /// (items, peak above the baseline) per chunk.
    samples: Vec<(usize, u64)>,
    fit: Option<Line>,
}

/// `fixed + per_item · n`, in bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Line {
    fixed: f64,
    per_item: f64,
}

impl Line {
    fn at(self, n: usize) -> f64 {
        self.fixed + self.per_item * n as f64
    }

    /// The largest `n` whose prediction is at most `budget`; `None` when any `n` is.
    fn largest_under(self, budget: u64) -> Option<usize> {
        if self.per_item <= 0.0 {
            return None;
        }
        let room = budget as f64 - self.fixed;
        Some(if room < self.per_item { 0 } else { (room / self.per_item).floor().min(usize::MAX as f64) as usize })
    }
}

/// Fits a line to `(n, peak)`, weighted by `n`, then raised until it covers every sample.
fn fit(samples: &[(usize, u64)]) -> Line {
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(n, peak) in samples {
        let (x, y, w) = (n as f64, peak as f64, n as f64);
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    let det = sw * sxx - sx * sx;
    let proportional = || {
        // Through the origin: every sample's bytes per item, the largest (conservative).
        let per_item = samples.iter().map(|&(n, p)| p as f64 / n.max(1) as f64).fold(0.0, f64::max);
        Line { fixed: 0.0, per_item }
    };
    let mut line = if det.abs() <= f64::EPSILON * sxx.max(1.0) * sw {
        proportional()
    } else {
        let per_item = (sw * sxy - sx * sy) / det;
        let fixed = (sy - per_item * sx) / sw;
        if per_item <= 0.0 || fixed < 0.0 {
            proportional()
        } else {
            Line { fixed, per_item }
        }
    };
    // Never below a measurement: shift up to the worst one.
    let short = samples.iter().map(|&(n, p)| p as f64 - line.at(n)).fold(0.0, f64::max);
    line.fixed += short;
    line
}

/// Fits remembered per call key, so that the next call starts at the right step with no
/// probes. Bounded like the size cache.
type Fits = DashMap<u64, Vec<(MeasuredDevice, Line)>, std::hash::BuildHasherDefault<PassThrough>>;

fn remembered() -> &'static Fits {
    static MAP: OnceLock<Fits> = OnceLock::new();
    MAP.get_or_init(DashMap::default)
}

/// Throughput samples of one step, for `Fastest`.
#[derive(Clone, Debug)]
struct Timing {
    step: usize,
    /// Items per second of each full chunk at `step`.
    rates: Vec<f64>,
}

impl Timing {
    fn median(&self) -> f64 {
        let mut r = self.rates.clone();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    }
}

/// One `auto` call's measuring and fitting.
#[derive(Debug)]
pub(crate) struct Auto {
    settings: AutoSettings,
    key: Option<u64>,
    devices: Vec<Device>,
    report: AutoReport,
    started: Option<Instant>,
    /// `Fastest`: throughput per step tried, and the step settled on.
    timings: Vec<Timing>,
    settled: Option<(usize, f64)>,
}

impl Auto {
    /// Starts measuring: turns on the CPU allocator's counting (once per process), reads each
    /// device's baseline and budget. `key` is the call's cache key, if it has one.
    pub(crate) fn start(settings: AutoSettings, key: Option<u64>) -> Self {
        let mut devices = Vec::new();
        let keep = 1.0 - settings.margin;
        let budget_of = |free: u64| settings.budget.unwrap_or((free as f64 * keep) as u64);
        if memory::track_cpu_allocations() {
            if let Some(stats) = memory::cpu_allocator_stats() {
                devices.push(Device {
                    id: MeasuredDevice::Cpu,
                    baseline: stats.allocated,
                    budget: budget_of(memory::cpu::available_cpu_memory()),
                    samples: Vec::new(),
                    fit: None,
                });
            }
        }
        for d in 0..memory::torch_device_count() {
            if let Some(stats) = memory::cuda_allocator_stats(d) {
                devices.push(Device {
                    id: MeasuredDevice::Cuda(d),
                    baseline: stats.allocated,
                    budget: budget_of(memory::cuda_usable_memory(d).unwrap_or(0)),
                    samples: Vec::new(),
                    fit: None,
                });
            }
        }
        if devices.is_empty() {
            tracing::warn!("toma: auto step: no allocator can be measured (libtorch's shim is missing); steps grow by 16x up to max_step");
        }
        let mut auto = Auto {
            settings,
            key,
            devices,
            report: AutoReport { reason: "probe", ..AutoReport::default() },
            started: None,
            timings: Vec::new(),
            settled: None,
        };
        if let Some(lines) = key.and_then(|k| remembered().get(&k).map(|v| v.clone())) {
            for (id, line) in lines {
                if let Some(device) = auto.devices.iter_mut().find(|d| d.id == id) {
                    device.fit = Some(line);
                }
            }
        }
        auto
    }

    /// The first step: from a remembered fit, or a probe of 1.
    pub(crate) fn first_step(&mut self, failed: usize) -> usize {
        if self.devices.iter().any(|d| d.fit.is_some()) {
            let step = self.limit(usize::MAX, failed);
            self.report.reason = "remembered";
            self.report.step = step;
            step
        } else {
            self.report.step = 1;
            1
        }
    }

    /// Whether the call started from a fit remembered under its key (no probes).
    pub(crate) fn started_from_remembered_fit(&self) -> bool {
        self.report.reason == "remembered"
    }

    /// Before a chunk: resets the peaks.
    pub(crate) fn before_chunk(&mut self) {
        for device in &self.devices {
            match device.id {
                MeasuredDevice::Cpu => memory::reset_cpu_peak(),
                MeasuredDevice::Cuda(d) => memory::reset_cuda_peak(d),
            };
        }
        self.started = Some(Instant::now());
    }

    /// After a chunk of `len` items that succeeded (`full`: at the whole step, not a clipped
    /// last one): measures, refits, and returns the next step, below `failed`.
    pub(crate) fn after_chunk(&mut self, len: usize, step: usize, full: bool, failed: usize) -> usize {
        let elapsed = self.started.take().map(|t| t.elapsed().as_secs_f64());
        let fitted_before = self.devices.iter().any(|d| d.fit.is_some());
        for device in &mut self.devices {
            let peak = match device.id {
                MeasuredDevice::Cpu => memory::cpu_allocator_stats().map(|s| s.peak_allocated),
                MeasuredDevice::Cuda(d) => memory::cuda_allocator_stats(d).map(|s| s.peak_allocated),
            };
            let Some(peak) = peak else { continue };
            let above = peak.saturating_sub(device.baseline);
            if fitted_before && above > device.budget {
                self.report.over_budget += 1;
                tracing::warn!(device = ?device.id, items = len, peak_bytes = above, budget_bytes = device.budget, "toma: auto step: a chunk went over its budget");
            }
            // Keep the largest chunks: they say most about large steps.
            device.samples.push((len, above));
            if device.samples.len() > 8 {
                let smallest = (0..device.samples.len()).min_by_key(|&i| device.samples[i].0).unwrap_or(0);
                device.samples.remove(smallest);
            }
            device.fit = Some(fit(&device.samples));
        }
        // A probe: a chunk whose step the growth cap chose, not the fit.
        if self.report.reason == "probe" {
            self.report.probes += 1;
        }
        if let Some(key) = self.key {
            let map = remembered();
            if map.len() >= crate::cache::MAX_ENTRIES {
                map.clear();
            }
            map.insert(key, self.devices.iter().filter_map(|d| Some((d.id, d.fit?))).collect());
        }
        let largest_seen =
            self.devices.iter().flat_map(|d| d.samples.iter().map(|s| s.0)).max().unwrap_or(len).max(len);
        let growth_cap = largest_seen.saturating_mul(GROWTH);
        let reason = self.report.reason;
        let mut next = self.limit(growth_cap, failed);
        if self.settings.objective == Objective::Fastest {
            match elapsed.filter(|&s| s > 0.0 && full) {
                Some(seconds) => next = self.fastest(step, len as f64 / seconds, next),
                // A clipped last chunk's time says nothing about its step.
                None => {
                    next = step.min(next);
                    self.report.reason = reason;
                }
            }
        }
        self.report.step = next;
        if next != step {
            tracing::info!(from = step, to = next, reason = self.report.reason, "toma: auto step changed");
        }
        self.trace(len);
        next
    }

    /// The largest step that fits every device's budget, capped by `cap`, `max_step` and
    /// `failed`; records why.
    fn limit(&mut self, cap: usize, failed: usize) -> usize {
        let mut step = cap;
        let mut reason = if cap == usize::MAX { "remembered" } else { "probe" };
        for device in &self.devices {
            if let Some(limit) = device.fit.and_then(|line| line.largest_under(device.budget)) {
                if limit <= step {
                    step = limit;
                    reason = if cap == usize::MAX { "remembered" } else { "largest that fits" };
                }
            }
        }
        if let Some(max) = self.settings.max_step.filter(|&m| m < step) {
            step = max;
            reason = "max_step";
        }
        if step >= failed {
            step = failed - 1;
            reason = "below a failed size";
        }
        if step == 0 {
            tracing::warn!("toma: auto step: one item is predicted over the budget; running single items");
        }
        self.report.reason = reason;
        step.max(1)
    }

    /// `Fastest`: records `rate` for `step`, explores doubling steps up to `largest` (the
    /// largest that fits), and settles on the best by the median of a few timings each.
    fn fastest(&mut self, step: usize, rate: f64, largest: usize) -> usize {
        match self.timings.iter_mut().find(|t| t.step == step) {
            Some(t) => {
                t.rates.push(rate);
                if t.rates.len() > 2 * TIMINGS {
                    t.rates.remove(0);
                }
            }
            None => self.timings.push(Timing { step, rates: vec![rate] }),
        }
        if let Some((settled, best)) = self.settled {
            if step == settled {
                let now = self.timings.iter().find(|t| t.step == step).map_or(rate, Timing::median);
                if now >= best * DROP {
                    self.report.reason = "fastest measured";
                    return settled.min(largest);
                }
                tracing::info!(
                    step,
                    items_per_second = now,
                    before = best,
                    "toma: auto step: throughput dropped, exploring again"
                );
                // Time the settled step and its neighbours afresh, then decide again.
                self.settled = None;
                let near = [step / 2, step, step.saturating_mul(2)];
                self.timings.retain(|t| near.contains(&t.step));
                for t in &mut self.timings {
                    t.rates.clear();
                }
            }
        }
        // Each candidate needs its timings; the next one to time is the smallest short of them.
        if let Some(t) = self.timings.iter().find(|t| t.rates.len() < TIMINGS && t.step <= largest) {
            self.report.reason = "fastest: timing";
            return t.step;
        }
        let best = self.best();
        let top = self.timings.iter().map(|t| t.step).max().unwrap_or(step);
        let doubled = top.saturating_mul(2).min(largest);
        // Explore upward while the largest step timed so far is still the best.
        if top < largest && best.0 == top && doubled > top {
            self.timings.push(Timing { step: doubled, rates: Vec::new() });
            self.report.reason = "fastest: exploring";
            return doubled;
        }
        // Before settling, time the best and its neighbours again: one stalled chunk among
        // three timings must not decide.
        let near = [best.0 / 2, best.0, best.0.saturating_mul(2)];
        if let Some(t) = self.timings.iter().find(|t| near.contains(&t.step) && t.rates.len() < 2 * TIMINGS) {
            self.report.reason = "fastest: re-timing";
            return t.step;
        }
        let best = self.best();
        tracing::debug!(step = best.0, items_per_second = best.1, "toma: auto step: settled on the fastest");
        self.settled = Some(best);
        self.report.reason = "fastest measured";
        best.0
    }

    /// The best (step, median rate): a larger step must beat a smaller one by 5%.
    fn best(&self) -> (usize, f64) {
        let mut timed: Vec<(usize, f64)> =
            self.timings.iter().filter(|t| t.rates.len() >= TIMINGS).map(|t| (t.step, t.median())).collect();
        timed.sort_by_key(|t| t.0);
        let mut best = timed.first().copied().unwrap_or((1, 0.0));
        for &(step, rate) in &timed[1.min(timed.len())..] {
            if rate >= best.1 * FASTER_BY {
                best = (step, rate);
            }
        }
        best
    }

    fn trace(&self, len: usize) {
        if tracing::enabled!(tracing::Level::DEBUG) {
            for device in &self.devices {
                if let (Some(line), Some(&(_, measured))) = (device.fit, device.samples.last()) {
                    tracing::debug!(
                        device = ?device.id,
                        items = len,
                        measured_bytes = measured,
                        predicted_bytes = line.at(len) as u64,
                        fixed_bytes = line.fixed as u64,
                        bytes_per_item = line.per_item,
                        budget_bytes = device.budget,
                        step = self.report.step,
                        reason = self.report.reason,
                        "toma: auto step"
                    );
                }
            }
        }
    }

    /// What was measured and decided so far.
    pub(crate) fn report(&self) -> AutoReport {
        let mut report = self.report.clone();
        report.devices = self
            .devices
            .iter()
            .map(|d| {
                let line = d.fit.unwrap_or(Line { fixed: 0.0, per_item: 0.0 });
                let (n, max_measured) = d.samples.iter().copied().max_by_key(|s| s.1).unwrap_or((0, 0));
                DeviceFit {
                    device: d.id,
                    budget: d.budget,
                    fixed_bytes: line.fixed.ceil() as u64,
                    bytes_per_item: line.per_item.ceil() as u64,
                    max_measured,
                    predicted_at_max: line.at(n).ceil() as u64,
                }
            })
            .collect();
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_affine_peak_is_fitted_exactly_and_covers_every_sample() {
        let samples: Vec<(usize, u64)> = [1, 16, 256].iter().map(|&n| (n, 1000 + 24 * n as u64)).collect();
        let line = fit(&samples);
        assert!((line.per_item - 24.0).abs() < 1e-6 && (line.fixed - 1000.0).abs() < 1e-3, "{line:?}");
        assert_eq!(line.largest_under(1000 + 24 * 100), Some(100));
        // Superlinear samples: the line is raised to cover the worst.
        let curved: Vec<(usize, u64)> = [1usize, 16, 256].iter().map(|&n| (n, (n * n) as u64 + 10)).collect();
        let line = fit(&curved);
        assert!(curved.iter().all(|&(n, p)| line.at(n) >= p as f64 - 1e-6), "{line:?}");
    }

    #[test]
    fn one_sample_is_proportional_and_flat_peaks_do_not_limit() {
        let line = fit(&[(4, 400)]);
        assert_eq!(line.largest_under(1000), Some(10));
        assert_eq!(fit(&[(4, 0), (8, 0)]).largest_under(1000), None);
        // Over budget at one item: 0, which the caller turns into single items.
        assert_eq!(fit(&[(1, 5000)]).largest_under(1000), Some(0));
    }
}
