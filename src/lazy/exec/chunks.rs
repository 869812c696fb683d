//! The micro-batches of one run: the plan, the full batch's denominators, the retry engine's
//! loop, and in-place updates (running statistics) summed by share.

use tch::{Kind, Tensor};

use super::torch;
use crate::lazy::error::LazyError;
use crate::lazy::graph::{LazyTensor, Source};
use crate::lazy::options::Options;
use crate::lazy::plan::{self, cuda_ordinal, Compiled, Corrections, Decision, Measure, Mode, Segments};
use crate::retry::Range;

/// The tensors the graph's ops update in place (batch norm's running statistics).
pub(super) fn updated_tensors(c: &Compiled) -> Vec<Tensor> {
    let mut tensors = Vec::new();
    for node in &c.nodes {
        for k in node.facts.updated.clone() {
            if let Some(Source::Leaf { tensor, .. }) = node.inputs[k].source() {
                tensors.push(tensor.shallow_clone());
            }
        }
    }
    tensors
}

/// A compiled graph, and what planning decided for one run of it.
pub(super) struct Prepared {
    pub(super) c: Compiled,
    pub(super) d: Decision,
}

pub(super) fn prepare(output: &LazyTensor, mode: Mode, options: &Options) -> Result<Prepared, LazyError> {
    let c = plan::compile(output)?;
    let d = plan::decide(&c, mode, options, Measure::Now)?;
    // The plan was placed only after the cached segments go back to the card.
    if let Some(p) = d.placement.as_ref().filter(|p| p.emptied > 0) {
        let emptied = crate::memory::empty_cuda_cache();
        tracing::info!(
            bytes = p.emptied,
            emptied,
            "toma::lazy: emptied libtorch's CUDA cache before the step, as planned"
        );
    }
    let chunks = (c.batch as usize).div_ceil(d.micro_batch);
    let calibration = d.evidence.calibration();
    tracing::info!(
        mode = ?mode,
        op = c.output().name(),
        batch = c.batch,
        micro_batch = d.micro_batch,
        chunks,
        segments = d.segments.as_ref().map_or(0, Segments::count),
        why = %d.why,
        peak = d.peak,
        full_batch_peak = d.full_peak,
        budget = d.budget,
        nodes = c.len(),
        calibrated = calibration.measured,
        calibration_ms = calibration.elapsed.as_secs_f64() * 1e3,
        uncalibrated = calibration.unmeasured,
        "toma::lazy: plan"
    );
    Ok(Prepared { c, d })
}

/// Full-batch denominators of the mean-reduced class losses that a split must divide by.
pub(super) fn denominators(c: &Compiled, split: bool, options: &Options) -> Result<Vec<Option<f64>>, LazyError> {
    let mut dens = vec![None; c.len()];
    if !split {
        return Ok(dens);
    }
    for (i, node) in c.nodes.iter().enumerate() {
        let Some(ignore) = node.facts.counted_targets else {
            continue;
        };
        if !c.global[i] {
            continue;
        }
        // The targets are usually an input: evaluating them costs a narrow per micro-batch.
        let targets = LazyTensor::from_node(node.inputs[1].clone()).to_tensor_with(options)?;
        let err = torch(i, "nll_loss denominator");
        let counted = targets.f_ne(ignore).map_err(&err)?;
        let den = match node.inputs.get(2) {
            Some(w) => {
                let w = LazyTensor::from_node(w.clone()).to_tensor_with(options)?;
                let picked = w.f_index_select(0, &targets.f_clamp_min(0).map_err(&err)?).map_err(&err)?;
                picked
                    .f_mul(&counted.f_to_kind(w.kind()).map_err(&err)?)
                    .map_err(&err)?
                    .f_sum(Kind::Double)
                    .map_err(&err)?
            }
            None => counted.f_sum(Kind::Double).map_err(&err)?,
        };
        dens[i] = Some(den.f_double_value(&[]).map_err(&err)?);
    }
    Ok(dens)
}

/// Calls `body(start, end)` over the batch in micro-batches of `micro_batch`, halving on
/// out-of-memory when the result allows it.
pub(super) fn run_chunks(
    p: &Prepared,
    options: &Options,
    restart: bool,
    mut body: impl FnMut(i64, i64) -> Result<(), LazyError>,
) -> Result<(), LazyError> {
    // Each micro-batch is measured against its plan where an allocator counts: on the CPU by
    // this thread's own count, so that another thread's step is not taken for this one's.
    let own = crate::memory::PeakCounter::own(cuda_ordinal(p.c.device()));
    let counter = own.as_ref().map(|(c, _)| *c);
    let mut body = |start: i64, b: i64| -> Result<(), LazyError> {
        let Some(counter) = counter else { return body(start, b) };
        let mark = counter.mark();
        let Some((before, outer_peak)) = counter.start() else { return body(start, b) };
        let result = body(start, b);
        let peak = counter.peak();
        counter.end(outer_peak);
        result?;
        // What another thread's work reached says nothing of this plan.
        let peak = peak.filter(|_| !counter.interfered(mark));
        if let Some(peak) = peak {
            let measured = peak.saturating_sub(before);
            let planned = p.d.peak_at(&p.c, b as u64);
            if let Some(reserve) = Corrections::process().record(
                &p.c,
                (p.d.mode, p.d.evidence.calibrated_any()),
                b as u64,
                planned,
                measured,
            ) {
                tracing::warn!(
                    micro_batch = b,
                    planned,
                    measured,
                    reserve,
                    "toma::lazy: a micro-batch peaked above its plan; later plans of this graph hold the excess in reserve"
                );
            }
        }
        Ok(())
    };
    let n = p.c.batch.max(1) as usize;
    let mut updated = Updated::of(p);
    let result = run_chunk_loop(p, options, n, restart, |start: i64, b: i64| -> Result<(), LazyError> {
        if start == 0 {
            // The first micro-batch, or the step started again.
            updated.clear();
        }
        updated.restore();
        body(start, b)?;
        updated.add(b as f64 / n as f64);
        Ok(())
    });
    // A failed step leaves them as they were.
    if result.is_ok() {
        updated.apply();
    } else {
        updated.restore();
    }
    result
}

/// Tensors the graph's ops update in place (batch norm's running statistics), kept so that a
/// split step updates them once: each micro-batch starts from the values before the step, and
/// the micro-batches' updates are summed by share. A micro-batch that fails and is retried
/// leaves nothing behind. One micro-batch of the whole batch is the plain update.
pub(super) struct Updated {
    /// Each tensor, its value before the step, and the weighted sum of the updates so far.
    pub(super) tensors: Vec<(Tensor, Tensor, Option<Tensor>)>,
    /// Whether the last micro-batch was the whole batch: its update is the step's, as is.
    pub(super) whole: bool,
}

impl Updated {
    pub(super) fn of(p: &Prepared) -> Updated {
        let updated = updated_tensors(&p.c);
        if updated.is_empty() {
            return Updated { tensors: Vec::new(), whole: false };
        }
        let _guard = tch::no_grad_guard();
        let tensors = updated.into_iter().map(|t| (t.copy(), t, None)).map(|(b, t, s)| (t, b, s)).collect();
        Updated { tensors, whole: false }
    }

    pub(super) fn restore(&mut self) {
        if self.tensors.is_empty() {
            return;
        }
        let _guard = tch::no_grad_guard();
        for (t, before, _) in &mut self.tensors {
            t.copy_(before);
        }
    }

    /// Forgets the updates summed so far.
    pub(super) fn clear(&mut self) {
        for (_, _, sum) in &mut self.tensors {
            *sum = None;
        }
    }

    pub(super) fn add(&mut self, share: f64) {
        self.whole = share >= 1.0;
        if self.whole || self.tensors.is_empty() {
            return;
        }
        let _guard = tch::no_grad_guard();
        for (t, before, sum) in &mut self.tensors {
            let update = (&*t - &*before) * share;
            *sum = Some(match sum.take() {
                Some(s) => s + update,
                None => update,
            });
        }
    }

    pub(super) fn apply(&mut self) {
        if self.whole {
            return;
        }
        let _guard = tch::no_grad_guard();
        for (t, before, sum) in &mut self.tensors {
            match sum {
                Some(s) => t.copy_(&(&*before + &*s)),
                None => t.copy_(before),
            }
        }
    }
}

/// [`run_chunks`]'s loop: fixed micro-batches, or the retry engine's. With `restart`, a
/// micro-batch that runs out of memory after the first starts the whole range again (at the
/// smaller size) instead of going on from where it failed.
pub(super) fn run_chunk_loop(
    p: &Prepared,
    options: &Options,
    n: usize,
    restart: bool,
    mut body: impl FnMut(i64, i64) -> Result<(), LazyError>,
) -> Result<(), LazyError> {
    if !p.d.splittable || !options.retry {
        let step = if p.d.splittable { p.d.micro_batch } else { n };
        let mut start = 0;
        while start < n {
            let end = (start + step).min(n);
            body(start as i64, (end - start) as i64)?;
            start = end;
        }
        return Ok(());
    }
    // Keyed by the graph's shape: the size one graph's micro-batches settled on is its own.
    let mut range = Range::new(0, n, p.d.micro_batch).identity(p.c.fingerprint, "toma::lazy").planned();
    if let Some(kind) = options.cache {
        range = range.cache(kind);
    }
    let mut attempts = range.start();
    while let Some((start, end)) = attempts.next_range() {
        tracing::debug!(start, end, "toma::lazy: micro-batch");
        let outcome = attempts.attempt(|| body(start as i64, (end - start) as i64));
        attempts.finish(outcome)?;
        let retried = attempts.next_range().is_some_and(|(at, _)| at == start);
        if restart && retried && start > 0 {
            // Micro-batches accumulate into `.grad` in place: a failed one spoiled the sum, so
            // the step starts again from no gradients, at the smaller size.
            tracing::info!(
                failed_at = start,
                micro_batch = attempts.step(),
                "toma::lazy: a micro-batch ran out of memory; the step starts again from its first sample"
            );
            attempts.restart();
        }
    }
    Ok(())
}

/// The step's time against its estimate, as evidence: later choices between splitting and
/// recomputing for this graph follow what this machine measured.
pub(super) fn record_time(p: &Prepared, started: std::time::Instant) {
    let choice = match (&p.d.segments, p.d.micro_batch < p.c.batch as usize) {
        (Some(_), _) => plan::Choice::Recompute,
        (None, true) => plan::Choice::Split,
        (None, false) => return,
    };
    plan::Timings::process().record(&p.c, choice, started.elapsed().as_secs_f64(), p.d.seconds.0);
}
