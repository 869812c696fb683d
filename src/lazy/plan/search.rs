//! The search: the budget, the largest micro-batch whose peak fits it, and whether the batch
//! may be split at all.

use tch::Device;

use super::compiled::Compiled;
use super::correction::Corrections;
use super::schedule::{Mode, Outcome, Schedule};
use crate::lazy::error::LazyError;
use crate::lazy::graph::Flow;
use crate::lazy::options::Options;

/// What planning decided for one output and mode: the budget, the micro-batch and the peak
/// there, whether a micro-batch that runs out of memory may be halved, and the schedule that
/// prices other micro-batches.
pub(crate) struct Decision {
    pub(crate) mode: Mode,
    pub(crate) budget: u64,
    pub(crate) micro_batch: usize,
    /// The peak at `micro_batch`, and the whole batch's.
    pub(crate) peak: u64,
    pub(crate) full_peak: u64,
    /// Whether a micro-batch that runs out of memory may be halved (the result allows it).
    pub(crate) splittable: bool,
    /// Bytes held in reserve at `micro_batch`: what earlier runs of the graph measured above
    /// their plans ([`Corrections`]).
    pub(crate) reserved: u64,
    /// The simulation at `micro_batch`, and the gradient bytes its accumulation step counts.
    pub(crate) outcome: (Outcome, u64),
    pub(crate) schedule: Schedule,
}

impl Decision {
    /// The peak at micro-batch `b`, as the search computes it.
    pub(crate) fn peak_at(&self, c: &Compiled, b: u64) -> u64 {
        if b as usize == self.micro_batch {
            return self.peak;
        }
        self.schedule.peak_at(c, b)
    }
}

/// The budget, the micro-batch and the split check: what planning and running both decide.
/// A correction learned from earlier runs of the same graph ([`Corrections`]) shrinks the
/// budget the schedule is held to.
pub(crate) fn decide(c: &Compiled, mode: Mode, options: &Options) -> Result<Decision, LazyError> {
    let schedule = Schedule::build(c, mode);
    let budget = budget(options, c.device());
    let correction = Corrections::process().of(c, mode);
    // Held whole at fewer samples (an excess may be fixed); where nothing fits so, the excess
    // is taken as per-sample, and the run measures which it was.
    let (choice, reserved) = match choose(c, &schedule, budget, &|b| correction.at(b), options) {
        Err(LazyError::DoesNotFit { .. }) if correction.at(1) > 0 => {
            let choice = choose(c, &schedule, budget, &|b| correction.proportional(b), options)?;
            let reserved = correction.proportional(choice.micro_batch as u64);
            (choice, reserved)
        }
        chosen => {
            let choice = chosen?;
            let reserved = correction.at(choice.micro_batch as u64);
            (choice, reserved)
        }
    };
    check_split(c, mode, &choice, budget, options)?;
    let splittable = splittable(c, mode, &choice, budget, options);
    let b = choice.micro_batch as u64;
    let outcome = choice.outcome.unwrap_or_else(|| schedule.simulate(b).resolve(c, b));
    Ok(Decision {
        mode,
        budget,
        micro_batch: choice.micro_batch,
        peak: choice.peak,
        full_peak: choice.full_peak,
        splittable,
        reserved,
        outcome,
        schedule,
    })
}

/// The budget in bytes: the user's, or the free memory of the device less the margin.
pub(crate) fn budget(options: &Options, device: Device) -> u64 {
    if let Some(b) = options.budget {
        return b;
    }
    let free = match device {
        // The driver's free bytes plus what libtorch's caching allocator holds unused.
        Device::Cuda(i) => crate::memory::cuda_usable_memory(i).unwrap_or_else(crate::cpu_memory::available_cpu_memory),
        _ => crate::cpu_memory::available_cpu_memory(),
    };
    (free as f64 * (1.0 - options.margin)) as u64
}

/// The chosen micro-batch and the peak there.
struct Choice {
    micro_batch: usize,
    peak: u64,
    full_peak: u64,
    /// The simulation at the chosen size, and the gradient bytes its accumulation step counts.
    outcome: Option<(Outcome, u64)>,
}

impl Choice {
    /// A choice made elsewhere (to ask `check_split` about another size).
    fn at(micro_batch: usize, like: &Choice) -> Choice {
        Choice { micro_batch, peak: like.peak, full_peak: like.full_peak, outcome: None }
    }
}

/// The largest micro-batch that fits: the whole batch when it does, else the largest power of
/// two whose peak fits (from two samples on, the peak never decreases with the micro-batch, so
/// a binary search; one sample, which may run another way, is tried last).
fn choose(
    c: &Compiled,
    schedule: &Schedule,
    budget: u64,
    reserve: &dyn Fn(u64) -> u64,
    options: &Options,
) -> Result<Choice, LazyError> {
    let n = c.batch.max(1) as u64;
    // The budget the schedule at `b` is held to, less what measurement found the plan misses.
    let held = |b: u64| budget.saturating_sub(reserve(b));
    let full = schedule.simulate(n);
    let full_resolved = full.resolve(c, n);
    let full_peak = full_resolved.0.peak;
    if let Some(forced) = options.micro_batch {
        let b = (forced.max(1) as u64).min(n);
        let resolved = schedule.simulate(b).resolve(c, b);
        return Ok(Choice { micro_batch: b as usize, peak: resolved.0.peak, full_peak, outcome: Some(resolved) });
    }
    if full.fits(c, held(n), n).0 {
        return Ok(Choice { micro_batch: n as usize, peak: full_peak, full_peak, outcome: Some(full_resolved) });
    }
    // Exponents e with 2^e < n: find the largest that fits (1 is checked last, if at all).
    let (mut lo, mut hi) = (0u32, 63 - (n - 1).leading_zeros());
    let mut best = None;
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        let outcome = schedule.simulate(1 << mid);
        if outcome.fits(c, held(1 << mid), 1 << mid).0 {
            lo = mid;
            best = Some(outcome);
        } else {
            hi = mid - 1;
        }
    }
    let best = match best {
        Some(outcome) => outcome,
        None => {
            let at_one = schedule.simulate(1);
            let (fits, seen) = at_one.fits(c, held(1), 1);
            if !fits {
                let (node, _) = schedule.step_node(c, seen.peak_step);
                return Err(LazyError::DoesNotFit {
                    op: c.output().op.name().into(),
                    peak: seen.peak,
                    peak_node: node,
                    peak_op: c.nodes[node].op.name().into(),
                    budget,
                    reserved: reserve(1),
                });
            }
            at_one
        }
    };
    let resolved = best.resolve(c, 1u64 << lo);
    Ok(Choice { micro_batch: 1 << lo, peak: resolved.0.peak, full_peak, outcome: Some(resolved) })
}

/// Refuses to split what cannot be split; `Ok` when splitting is not needed or is allowed.
fn check_split(c: &Compiled, mode: Mode, choice: &Choice, budget: u64, options: &Options) -> Result<(), LazyError> {
    if choice.micro_batch as i64 >= c.batch {
        return Ok(());
    }
    let out = c.output();
    if let Some((pos, node)) = c.first_mixing() {
        if !options.allow_batch_mixing {
            return Err(LazyError::MixesBatch {
                node: pos,
                op: node.op.name().into(),
                reason: node.meta.mixes.clone().unwrap_or_default(),
                batch: c.batch as usize,
                peak: choice.full_peak,
                budget,
                requested: options.micro_batch,
            });
        }
    }
    let refuse = |reason: &str| {
        Err(LazyError::NotSplittable { op: out.op.name().into(), shape: out.meta.shape.clone(), reason: reason.into() })
    };
    match (out.meta.flow, mode) {
        (Flow::Opaque, _) => refuse("its value depends on the whole batch at once"),
        (Flow::Max, Mode::Backward) => {
            refuse("a maximum over the batch can be evaluated in micro-batches, but not differentiated")
        }
        _ => Ok(()),
    }
}

/// Whether a micro-batch that runs out of memory may be halved. A choice that already splits
/// passed `check_split`, whose verdict does not depend on the size, so only a whole-batch
/// choice needs asking again.
fn splittable(c: &Compiled, mode: Mode, choice: &Choice, budget: u64, options: &Options) -> bool {
    c.batch > 1
        && ((choice.micro_batch as i64) < c.batch
            || check_split(c, mode, &Choice::at(1, choice), budget, options).is_ok())
}
