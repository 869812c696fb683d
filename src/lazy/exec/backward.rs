//! A training step's forward and backward in micro-batches, and the replans after a real
//! out-of-memory of a step that cannot be split.

use tch::{Kind, TchError, Tensor};

use super::chunks::{denominators, prepare, record_time, run_chunks, Prepared};
use super::forward::{forward_chunk, value_of, Held};
use super::grads::Wrt;
use super::recompute::recompute_chunk;
use super::{torch, Chunk};
use crate::lazy::cost::caching::format_bytes as human;
use crate::lazy::error::LazyError;
use crate::lazy::graph::LazyTensor;
use crate::lazy::options::Options;
use crate::lazy::plan::{Compiled, Mode};
use crate::oom::OutOfMemory;

/// Plans of a step that may not be split, tried after a real out-of-memory: each under the last
/// one's peak less what the card lacked for the block that failed (3/4 of it where the error
/// does not say), or the lowest peak any plan reaches.
pub(super) const REPLANS: usize = 3;

/// Runs forward and backward in micro-batches, accumulating parameter gradients.
///
/// A real out-of-memory in a step whose batch may not be split (its samples mix, so the retry
/// engine has no micro-batch to halve) plans the step again under a lower budget (or the
/// lowest peak any plan reaches, where that is higher), recomputing more, up to [`REPLANS`]
/// times. On CUDA the budget is lowered by what the card lacked for the block libtorch names
/// ("Tried to allocate 904 MiB ... of which 135 MiB is free"), and the warning names the block;
/// the new plan is one the allocator's model places. On a GPU the caching allocator can refuse a
/// large block while enough memory is free in pieces; on any device the budget may have been
/// read before other work took memory. The failed attempt leaves nothing behind: what it filled
/// into `.grad` is zeroed, running statistics and the generator are as they were. When no lower
/// plan exists or runs, the first error is returned.
pub(crate) fn backward(output: &LazyTensor, options: &Options) -> Result<f64, LazyError> {
    // The graph carries its casts: libtorch's autocast must not cast again while it runs.
    let _suspended = crate::autocast::Suspended::new();
    let first = match backward_once(output, options) {
        Err(err) if options.retry && err.is_out_of_memory() => err,
        other => return other,
    };
    let mut options = options.clone();
    // On CUDA, libtorch's message names the block it could not place and what the card had.
    let report = crate::oom::cuda_oom_text(&first.to_string());
    for attempt in 1..=REPLANS {
        let Ok(p) = prepare(output, Mode::Backward, &options) else { break };
        if p.d.splittable {
            // The retry engine halved its micro-batches down to one sample already.
            break;
        }
        // Below the failed peak by what the card lacked for the block (at least 1/16), or by
        // a quarter where the message does not say; or the lowest peak any plan reaches.
        let mut budget = match report {
            Some(r) if r.tried > r.free => p.d.peak.saturating_sub((r.tried - r.free).max(p.d.peak / 16)),
            _ => p.d.peak / 4 * 3,
        };
        if let Err(LazyError::DoesNotFit { peak: lowest, .. }) =
            prepare(output, Mode::Backward, &options.clone().budget(budget))
        {
            if lowest >= p.d.peak {
                break;
            }
            budget = lowest;
        }
        match report {
            Some(r) => tracing::warn!(
                attempt,
                peak = p.d.peak,
                budget,
                block = r.tried,
                card_free = r.free,
                reserved_unallocated = r.reserved_unallocated,
                "toma::lazy: the CUDA caching allocator could not place a {} block ({} free on the card{}); \
                 planning the step again under {}",
                human(r.tried),
                human(r.free),
                r.reserved_unallocated.map_or(String::new(), |b| format!(", {} free in cached pieces", human(b))),
                human(budget)
            ),
            None => tracing::warn!(
                attempt,
                peak = p.d.peak,
                budget,
                error = %first,
                "toma::lazy: a step that cannot be split ran out of memory; planning it again under 3/4 of its peak or the lowest any plan reaches"
            ),
        }
        options = options.budget(budget);
        match backward_once(output, &options) {
            Err(err) if err.is_out_of_memory() => continue,
            // No plan reaches that low: the first error says what ran out.
            Err(LazyError::DoesNotFit { .. }) => break,
            other => return other,
        }
    }
    Err(first)
}

pub(super) fn backward_once(output: &LazyTensor, options: &Options) -> Result<f64, LazyError> {
    if output.numel() != 1 {
        return Err(LazyError::NotScalar { op: output.op_name().into(), shape: output.size() });
    }
    let span = tracing::info_span!("toma.lazy", mode = "backward", op = output.op_name());
    let _entered = span.enter();
    let p = prepare(output, Mode::Backward, options)?;
    let n = p.c.batch;
    let wrt = Wrt::of(&p.c);
    // Where `.grad` starts as none, the micro-batches need no second copy of the gradients:
    // autograd accumulates straight into `.grad`, as plain tch does (the plan counts it so). A
    // micro-batch that fails leaves a sum that cannot be undone: `.grad` is set back to none
    // and the step starts again from its first sample, at the smaller size.
    let direct = p.c.accumulates_in_place();
    let mut through: Vec<Option<Tensor>> = wrt.params.iter().map(|_| None).collect();
    let err = torch(p.c.len() - 1, "backward");
    let mut total = 0.0;
    // One rank of several: every share is of the global batch, every denominator global.
    let global = group_weights(&p.c, options)?;
    let n_all = global.as_ref().map_or(n, |g| g.batch);
    let mut dens: Option<Vec<Option<f64>>> = global.map(|g| g.dens);
    let started = std::time::Instant::now();
    run_chunks(&p, options, direct, |start, b| {
        if start == 0 {
            total = 0.0;
        }
        if b < n && dens.is_none() {
            dens = Some(tch::no_grad(|| denominators(&p.c, true, options))?);
        }
        let dens = dens.as_deref().unwrap_or_default();
        let sliced = wrt.sliced(start, b).map_err(&err)?;
        let (stand_ins, params) = sliced.as_ref().map_or((&wrt.stand_ins, &wrt.params), |(s, p)| (s, p));
        let chunk = Chunk { start, b, split: b < n_all, frac: b as f64 / n_all as f64, dens, stand_ins };
        let (value, grads) = micro_batch(&p, &chunk, params, direct)?;
        wrt.add(&grads, &mut through, start, b).map_err(&err)?;
        total += value;
        Ok(())
    })?;
    record_time(&p, started);
    wrt.send_through(&through).map_err(&err)?;
    #[cfg(feature = "dist")]
    if let Some(group) = options.group.as_ref().filter(|g| g.world_size() > 1) {
        total = wrt.all_reduce(group, total)?;
    }
    // The micro-batches' sum, in the loss's kind: what reading the loss gives, and what one
    // whole-batch step computes.
    let total = in_kind(total, output.node().meta.kind).map_err(&err)?;
    output.node().stepped.set(Some(total));
    Ok(total)
}

/// Runs one micro-batch's forward and backward at once: returns the loss and, unless `direct`
/// (autograd accumulated into `.grad`), the parameters' gradients.
pub(super) fn plain_chunk(
    c: &Compiled,
    chunk: &Chunk<'_>,
    params: &[Held<'_>],
    direct: bool,
) -> Result<(f64, Vec<Tensor>), LazyError> {
    let err = torch(c.len() - 1, "backward");
    tch::with_grad(|| -> Result<(f64, Vec<Tensor>), LazyError> {
        let loss = forward_chunk(c, chunk, None)?;
        // The value is read after the backward, as a plain step reads it: on a GPU, reading
        // it first would wait for the forward before the backward's kernels are queued.
        if direct && !params.is_empty() && loss.requires_grad() {
            loss.f_backward().map_err(&err)?;
            return Ok((value_of(&loss).map_err(&err)?, Vec::new()));
        }
        let grads = if params.is_empty() || !loss.requires_grad() {
            Vec::new()
        } else {
            Tensor::f_run_backward(&[&loss], params, false, false).map_err(&err)?
        };
        Ok((value_of(&loss).map_err(&err)?, grads))
    })
}

/// One micro-batch's forward and backward, as planned (plain or recomputing): its loss share
/// and the gradients not accumulated into `.grad`.
pub(super) fn micro_batch(
    p: &Prepared,
    chunk: &Chunk<'_>,
    params: &[Held<'_>],
    direct: bool,
) -> Result<(f64, Vec<Tensor>), LazyError> {
    let result = match &p.d.segments {
        Some(segs) => recompute_chunk(&p.c, segs, chunk, params, direct),
        None => plain_chunk(&p.c, chunk, params, direct),
    };
    if result.is_err() && direct {
        // `.grad` was none when the step began: so it is again, its memory freed for the
        // smaller micro-batches.
        clear_grads(params);
    }
    result
}

/// Sets the parameters' `.grad` back to none (zeroes it where the shim is missing).
pub(super) fn clear_grads(params: &[Held<'_>]) {
    let _no_grad = tch::no_grad_guard();
    for param in params {
        let mut grad = param.grad();
        if grad.defined() && crate::memory::clear_grad(param).is_err() {
            let _ = grad.f_zero_();
        }
    }
}

/// `value` rounded to `kind`, as a scalar tensor of that kind holds it.
pub(super) fn in_kind(value: f64, kind: Kind) -> Result<f64, TchError> {
    match kind {
        Kind::Double => Ok(value),
        Kind::Float => Ok(value as f32 as f64),
        _ => Tensor::f_from_slice(&[value])?.f_to_kind(kind)?.f_double_value(&[]),
    }
}

/// The global batch and denominators of a step run as one rank of [`Options::group`].
pub(super) struct Global {
    pub(super) batch: i64,
    pub(super) dens: Vec<Option<f64>>,
}

#[cfg(feature = "dist")]
pub(super) fn group_weights(c: &Compiled, options: &Options) -> Result<Option<Global>, LazyError> {
    let Some(group) = options.group.as_ref().filter(|g| g.world_size() > 1) else { return Ok(None) };
    let mut dens = tch::no_grad(|| denominators(c, true, options))?;
    let mut local: Vec<f64> = vec![c.batch as f64];
    local.extend(dens.iter().flatten());
    let sums = group.all_reduce_f64("toma.lazy/weights", crate::dist::Reduce::Sum, &local)?;
    for (d, sum) in dens.iter_mut().flatten().zip(&sums[1..]) {
        *d = *sum;
    }
    Ok(Some(Global { batch: sums[0].round() as i64, dens }))
}

#[cfg(not(feature = "dist"))]
pub(super) fn group_weights(_: &Compiled, _: &Options) -> Result<Option<Global>, LazyError> {
    Ok(None)
}
