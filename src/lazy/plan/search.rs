//! The search: the budget, the largest micro-batch whose peak fits it, and whether the batch
//! may be split at all.

use super::compiled::Compiled;
use super::evidence::{Evidence, Machine};
use super::placement::{replay, unplaced_request, Placement, Start};
use super::recompute::{Cuts, Segments};
use super::schedule::{Mode, Outcome, Prices, Schedule};
use super::time;
use crate::lazy::cost::measured::Calibrated;
use crate::lazy::error::LazyError;
use crate::lazy::graph::Flow;
use crate::lazy::options::{Options, Recompute};
use crate::lazy::unplaced::UnplacedRequest;

/// What planning decided for one output and mode: the budget, the micro-batch and the peak
/// there, whether a micro-batch that runs out of memory may be halved, and the schedule that
/// prices other micro-batches.
#[derive(Clone)]
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
    /// The segments a recomputing plan cuts the graph into (`None`: nothing is recomputed).
    pub(crate) segments: Option<Segments>,
    /// Why this plan, in a sentence for the printed plan.
    pub(crate) why: String,
    /// Estimated seconds of the step as planned, and of a plain step of the whole batch.
    pub(crate) seconds: (f64, f64),
    /// The optimizer's step after the backward (`Options::step`): its name, and the peak it
    /// reaches (the gradients, the state it creates, its temporaries).
    pub(crate) optimizer: Option<(&'static str, u64)>,
    /// What the plan was made with: calibration, the reserve, measured speeds.
    pub(crate) evidence: Evidence,
    /// On a CUDA card: the replay of the caching allocator that placed the plan
    /// ([`super::placement`]).
    pub(crate) placement: Option<Placement>,
    /// On a CUDA card: the first plan the replay refused, where this one was made under a
    /// lower budget for it.
    pub(crate) unplaced: Option<UnplacedRequest>,
}

impl Decision {
    /// Whether this plan of the whole batch is the one planning would make under `budget` too:
    /// the search keeps the whole batch exactly where its peak fits the budget less the reserve,
    /// and the optimizer's step fits the budget.
    pub(crate) fn whole_fits(&self, budget: u64) -> bool {
        budget >= self.peak.saturating_add(self.reserved)
            && self.optimizer.is_none_or(|(_, peak)| budget >= peak)
            // Placed in no more than the budget: a card with as much left places it again.
            && self.placement.as_ref().is_none_or(|p| p.placed() && budget >= p.step_reserved())
    }

    /// The peak at micro-batch `b`, as the search computes it.
    pub(crate) fn peak_at(&self, c: &Compiled, b: u64) -> u64 {
        if b as usize == self.micro_batch {
            return self.peak;
        }
        self.schedule.peak_at(c, b)
    }
}

/// The plan of `c` in `mode` under `options`, on `machine`, with `evidence`: the budget, the
/// micro-batch, recomputation and the split check. A function of its arguments: it runs no
/// kernel and reads no store (gathering the evidence does that, before). A correction learned
/// from earlier runs of the same graph (`evidence.reserve`) shrinks the budget the schedule is
/// held to.
pub(crate) fn plan(
    c: &Compiled,
    mode: Mode,
    options: &Options,
    machine: &Machine,
    evidence: &Evidence,
) -> Result<Decision, LazyError> {
    let step = options.step.as_ref().filter(|_| mode == Mode::Backward);
    // The optimizer's step runs once the backward has let its activations go: beside the
    // gradients it made, the state a first step creates and the step's temporaries.
    let step_peak = step.map(|step| {
        let reached: std::collections::HashSet<usize> = c
            .reached_params
            .iter()
            .filter_map(|&i| match c.nodes[i as usize].source() {
                Some(crate::lazy::graph::Source::Leaf { tensor, .. }) => Some(tensor.data_ptr() as usize),
                _ => None,
            })
            .collect();
        (step.name, c.undefined_grad_bytes() + step.bytes(|a| reached.contains(&a)))
    });
    let mut d = match plan_pass(c, mode, options, machine, evidence) {
        // What the whole step needs, not less: the optimizer's peak where it is the higher.
        Err(LazyError::DoesNotFit { peak, budget, .. }) if step_peak.is_some_and(|(_, p)| p > peak) => {
            let (name, p) = step_peak.expect("checked");
            return Err(step_does_not_fit(c, name, p, budget));
        }
        other => other?,
    };
    let Some((name, peak)) = step_peak else { return Ok(d) };
    if peak > d.budget {
        return Err(step_does_not_fit(c, name, peak, d.budget));
    }
    d.optimizer = Some((name, peak));
    Ok(d)
}

/// The optimizer's step (`name`, `peak` bytes) does not fit `budget`: no micro-batch lowers
/// it, and the error says what budget it needs.
fn step_does_not_fit(c: &Compiled, name: &str, peak: u64, budget: u64) -> LazyError {
    let whole = c.batch.max(1) as usize;
    let mut e = fits_nowhere(c, peak, (c.len() - 1, format!("{name} step")), budget, 0, whole, None, None);
    if let LazyError::DoesNotFit { step_floor, .. } = &mut e {
        *step_floor = true;
    }
    e
}

/// [`plan`] for the forward and backward passes.
fn plan_pass(
    c: &Compiled,
    mode: Mode,
    options: &Options,
    machine: &Machine,
    evidence: &Evidence,
) -> Result<Decision, LazyError> {
    let schedule = Schedule::build(c, mode, &evidence.calibrated);
    let budget = machine.budget;
    let correction = &evidence.reserve;
    let n = c.batch.max(1) as u64;
    let may_recompute = mode == Mode::Backward
        && options.recompute != Recompute::Never
        && options.micro_batch.is_none()
        && machine.replays;
    if may_recompute && !schedule.simulate(n).fits(c, budget.saturating_sub(correction.at(n)), n).0 {
        return recomputing(c, mode, options, schedule, budget, evidence, machine.allocator.as_ref());
    }
    let why = if options.micro_batch.is_some() {
        "the micro-batch was asked for (Options::micro_batch)"
    } else if mode == Mode::Forward {
        "a forward keeps no activations: the largest micro-batch that fits"
    } else {
        "the largest micro-batch that fits, recomputing nothing"
    };
    split_decision(c, mode, options, schedule, None, budget, evidence, why.into())
}

/// A recomputing plan the segment search found: the segments, their schedule and the
/// simulation at the whole batch.
type Found = (Segments, Schedule, (Outcome, u64));

/// The plan of a backward whose whole batch does not fit as it is: micro-batches, recomputed
/// segments, or both, by [`Options::recompute`] and the estimated step time.
fn recomputing(
    c: &Compiled,
    mode: Mode,
    options: &Options,
    schedule: Schedule,
    budget: u64,
    evidence: &Evidence,
    place: Option<&Start>,
) -> Result<Decision, LazyError> {
    let n = c.batch.max(1) as u64;
    let held = budget.saturating_sub(evidence.reserve.at(n));
    let one = Fit { micro_batch: 1, peak: 0, full_peak: 0, outcome: None };
    let refused = check_split(c, mode, &one, budget, options).err().map(|e| split_refusal(&e));
    let (mut fit, lowest, unplaced) = search_segments(c, &evidence.calibrated, n, held, place);
    // A call calibration saw take more than the budget alone at the whole batch takes it
    // recomputing too: where the batch may be split, only split plans are left.
    if refused.is_none() && evidence.calibrated.limit().is_some_and(|l| l <= n) {
        fit = None;
    }
    // What the whole batch would peak at as it is: the plan's "whole batch" figure.
    let plain = schedule.simulate(n).resolve(c, n).0;
    let strategies = Strategies {
        c,
        mode,
        options,
        budget,
        evidence,
        n,
        full_peak: plain.peak,
        plain_seconds: time::step_seconds(c, n, None),
        split_allowed: refused.is_none() && options.retry,
        schedule,
    };
    let decision = match refused {
        Some(refused) => strategies.unsplit(fit, lowest, plain, refused),
        None => strategies.choose(fit, lowest),
    };
    // A faster cut the allocator would not place, where the plan recomputes another.
    decision.map(|mut d| {
        if d.segments.is_some() {
            d.unplaced = unplaced;
        }
        d
    })
}

/// The ways a backward whose whole batch does not fit may run, each a decision: the whole
/// batch recomputing segments, micro-batches, or both; and which of the first two is faster.
struct Strategies<'a> {
    c: &'a Compiled,
    mode: Mode,
    options: &'a Options,
    budget: u64,
    evidence: &'a Evidence,
    /// The whole batch, its peak as it is, and the estimated seconds of its plain step.
    n: u64,
    full_peak: u64,
    plain_seconds: f64,
    /// Whether a micro-batch that runs out of memory may be halved.
    split_allowed: bool,
    /// The plain schedule.
    schedule: Schedule,
}

impl Strategies<'_> {
    /// Recomputing or micro-batches, by [`Options::recompute`] and the estimated step time.
    fn choose(&self, fit: Option<Found>, lowest: Option<Found>) -> Result<Decision, LazyError> {
        let strategies = self;
        match (self.options.recompute, fit) {
            (Recompute::Always, Some(fit)) => {
                let why =
                    format!("Recompute::Always: {} segments recomputed instead of splitting the batch", fit.0.count());
                Ok(strategies.whole(fit, why))
            }
            // Recomputing in micro-batches first; where that fails too, plain micro-batches.
            (Recompute::Always, None) => match strategies.both(lowest) {
                Some(Ok(d)) => Ok(d),
                Some(Err(e)) => strategies.split().map_err(|s| lower(e, s)),
                None => strategies.split(),
            },
            (_, None) => match strategies.split() {
                Ok(d) => Ok(d),
                Err(e @ LazyError::DoesNotFit { .. }) => match strategies.both(lowest) {
                    Some(result) => result.map_err(|b| lower(b, e)),
                    None => Err(e),
                },
                Err(e) => Err(e),
            },
            (_, Some(fit)) => strategies.fastest(fit),
        }
    }

    /// The whole batch, recomputing `fit`'s segments.
    fn whole(&self, (segments, schedule, outcome): Found, why: String) -> Decision {
        let n = self.n;
        let seconds = time::step_seconds(self.c, n, Some(&segments));
        Decision {
            mode: self.mode,
            budget: self.budget,
            micro_batch: n as usize,
            peak: outcome.0.peak,
            full_peak: self.full_peak,
            // A micro-batch that runs out of memory may be halved where the result allows it.
            splittable: self.split_allowed && n > 1,
            reserved: self.evidence.reserve.at(n),
            outcome,
            schedule,
            segments: Some(segments),
            why,
            seconds: (seconds, self.plain_seconds),
            optimizer: None,
            evidence: self.evidence.clone(),
            placement: None,
            unplaced: None,
        }
    }

    /// Micro-batches, recomputing nothing.
    fn split(&self) -> Result<Decision, LazyError> {
        let why = "the largest micro-batch that fits, recomputing nothing";
        split_decision(
            self.c,
            self.mode,
            self.options,
            self.schedule.clone(),
            None,
            self.budget,
            self.evidence,
            why.into(),
        )
    }

    /// Both, where neither alone fits: the recomputing plan with the lowest peak, split.
    fn both(&self, lowest: Option<Found>) -> Option<Result<Decision, LazyError>> {
        lowest.map(|(segments, sched, _)| {
            let count = segments.count();
            let why = format!(
                "neither micro-batches nor recomputing alone fits: {count} segments recomputed, in micro-batches"
            );
            split_decision(self.c, self.mode, self.options, sched, Some(segments), self.budget, self.evidence, why)
        })
    }

    /// Splitting is ruled out (`refused` says why): the whole batch recomputing, or the lowest
    /// peak of the plans allowed.
    fn unsplit(
        &self,
        fit: Option<Found>,
        lowest: Option<Found>,
        plain: Outcome,
        refused: String,
    ) -> Result<Decision, LazyError> {
        if let Some(fit) = fit {
            let why = format!(
                "the whole batch does not fit and splitting is ruled out ({refused}): {} segments recomputed keep the batch together",
                fit.0.count()
            );
            return Ok(self.whole(fit, why));
        }
        let (peak, step, sched, segments) = match &lowest {
            Some((seg, sched, o)) if o.0.peak < plain.peak => {
                (o.0.peak, o.0.peak_step, sched, Some(seg.count() as u32))
            }
            _ => (plain.peak, plain.peak_step, &self.schedule, None),
        };
        let (n, reserved) = (self.n as usize, self.evidence.reserve.at(self.n));
        Err(does_not_fit(self.c, sched, peak, step, self.budget, reserved, n, segments, Some(refused)))
    }

    /// Recomputing `fit` or micro-batches, whichever is estimated faster; estimates scaled by
    /// what earlier steps of this graph measured, where they did.
    fn fastest(&self, fit: Found) -> Result<Decision, LazyError> {
        let speed = &self.evidence.speed;
        let recompute_prior = time::step_seconds(self.c, self.n, Some(&fit.0));
        let Ok(mut d) = self.split() else {
            let why = format!("only recomputing fits: {} segments", fit.0.count());
            return Ok(self.whole(fit, why));
        };
        let split_prior = time::step_seconds(self.c, d.micro_batch as u64, None);
        // Ratios to one reference, the prior's plain whole-batch step (what
        // `Plan::estimated_time_ratio` reports); what measured steps of this graph showed
        // scales the comparison, and is said apart.
        let measured = if speed.measured {
            format!(
                ", scaled by what earlier steps of this graph measured ({:.2}x and {:.2}x the estimates)",
                speed.split, speed.recompute
            )
        } else {
            String::new()
        };
        let (split_ratio, recompute_ratio) = (split_prior / self.plain_seconds, recompute_prior / self.plain_seconds);
        if split_prior * speed.split <= recompute_prior * speed.recompute {
            d.why = format!(
                "micro-batches of {} are estimated faster ({split_ratio:.2}x a plain whole-batch step) than \
                 recomputing {} segments ({recompute_ratio:.2}x){measured}",
                d.micro_batch,
                fit.0.count(),
            );
            return Ok(d);
        }
        let why = format!(
            "recomputing {} segments is estimated faster ({recompute_ratio:.2}x a plain whole-batch step) \
             than micro-batches of {} ({split_ratio:.2}x){measured}",
            fit.0.count(),
            d.micro_batch,
        );
        Ok(self.whole(fit, why))
    }
}

/// Nothing fits: the lowest peak a plan reaches (at `step` of `schedule`), and how it ran.
#[allow(clippy::too_many_arguments)]
fn does_not_fit(
    c: &Compiled,
    schedule: &Schedule,
    peak: u64,
    step: usize,
    budget: u64,
    reserved: u64,
    micro_batch: usize,
    segments: Option<u32>,
    split_refused: Option<String>,
) -> LazyError {
    let (node, _) = schedule.step_node(c, step);
    let at = (node, c.nodes[node].name().to_owned());
    fits_nowhere(c, peak, at, budget, reserved, micro_batch, segments, split_refused)
}

/// The one place a [`LazyError::DoesNotFit`] is made: the lowest peak, where (node and what
/// peaks there) and how the plan that reaches it runs.
#[allow(clippy::too_many_arguments)]
fn fits_nowhere(
    c: &Compiled,
    peak: u64,
    (peak_node, peak_op): (usize, String),
    budget: u64,
    reserved: u64,
    micro_batch: usize,
    segments: Option<u32>,
    split_refused: Option<String>,
) -> LazyError {
    LazyError::DoesNotFit {
        op: c.output().name().into(),
        peak,
        peak_node,
        peak_op,
        budget,
        reserved,
        micro_batch,
        batch: u32::try_from(c.batch.max(1)).unwrap_or(u32::MAX),
        segments,
        split_refused: split_refused.map(String::into_boxed_str),
        step_floor: false,
    }
}

/// Of two `DoesNotFit` errors, the one with the lower peak (any other error as it is).
fn lower(a: LazyError, b: LazyError) -> LazyError {
    match (&a, &b) {
        (LazyError::DoesNotFit { peak: pa, .. }, LazyError::DoesNotFit { peak: pb, .. }) if pb < pa => b,
        (LazyError::DoesNotFit { .. }, _) => a,
        _ => a,
    }
}

/// What rules out a split, in a phrase.
fn split_refusal(e: &LazyError) -> String {
    match e {
        LazyError::MixesBatch { node, op, reason, .. } => format!("op #{node} `{op}` {reason}"),
        LazyError::NotSplittable { op, reason, .. } => format!("`{op}`: {reason}"),
        other => other.to_string(),
    }
}

/// The recomputing plan that fits `held` at `b` with the lowest estimated time, and the plan
/// with the lowest peak among those tried. For each size of the last segment (the one that
/// does not run twice) against the others', the fewest segments that fit recompute the least.
/// On a CUDA card (`place`), a cut fits only where the caching allocator's replay places it:
/// the same peak cut elsewhere frees other blocks, and leaves other pieces cached.
fn search_segments(
    c: &Compiled,
    calibrated: &Calibrated,
    b: u64,
    held: u64,
    place: Option<&Start>,
) -> (Option<Found>, Option<Found>, Option<UnplacedRequest>) {
    let cuts = Cuts::new(c);
    let prices = Prices::of(c, calibrated);
    // Past about 2·sqrt(n) segments, the boundaries outweigh what a segment saves.
    let most = (2.0 * (c.len() as f64).sqrt()) as usize + 4;
    let mut lowest: Option<Found> = None;
    let mut best: Option<(f64, Found)> = None;
    // The fastest cut whose tensors fit but whose blocks the allocator would not place: the
    // answer where none is placed, so that the caller's replay says which request failed.
    let mut unplaced: Option<(f64, Found)> = None;
    // The cut chosen by tensors alone (the fastest of each size's fewest that fit), and its
    // failed request where the allocator refused it: what the plan says it was chosen over.
    let mut by_tensors: Option<(f64, Option<UnplacedRequest>)> = None;
    let mut tried: Vec<Vec<u32>> = Vec::new();
    // A larger last segment leaves less to the others: it needs at least as many segments as
    // equal shares did, so its counts start where theirs fit.
    let mut first = 2;
    for last in [1.0, 2.0, 4.0] {
        // The fewest segments whose tensors fit, placed or not: where larger last segments start.
        let mut fitted = None;
        for count in first..=most {
            let starts = cuts.starts(count, last);
            if starts.len() < 2 || tried.contains(&starts) {
                continue;
            }
            tried.push(starts.clone());
            let segments = Segments::new(c, starts);
            let schedule = Schedule::build_recompute(c, &segments, &prices);
            let outcome = schedule.simulate(b);
            let (fits, _) = outcome.fits(c, held, b);
            let resolved = outcome.resolve(c, b);
            if fits {
                let seconds = time::step_seconds(c, b, Some(&segments));
                let refused = place.and_then(|start| replay(c, &schedule, b, resolved.1, start).unplaced);
                if fitted.is_none() && by_tensors.as_ref().is_none_or(|(s, _)| seconds < *s) {
                    let request =
                        refused.as_ref().map(|u| unplaced_request(c, resolved.0.peak, b as usize, segments.count(), u));
                    by_tensors = Some((seconds, request));
                }
                fitted = fitted.or(Some(count));
                if refused.is_some() {
                    if unplaced.as_ref().is_none_or(|(s, _)| seconds < *s) {
                        unplaced = Some((seconds, (segments, schedule, resolved)));
                    }
                    continue;
                }
                if best.as_ref().is_none_or(|(s, _)| seconds < *s) {
                    best = Some((seconds, (segments, schedule, resolved)));
                }
                break;
            }
            if lowest.as_ref().is_none_or(|l| resolved.0.peak < l.2 .0.peak) {
                lowest = Some((segments, schedule, resolved));
            }
        }
        if last == 1.0 {
            first = fitted.unwrap_or(first);
        }
    }
    let refused = by_tensors.and_then(|(_, request)| request);
    match (best, unplaced) {
        (Some((_, fit)), _) => (Some(fit), None, refused),
        (None, Some((_, fit))) => (Some(fit), None, None),
        (None, None) => (None, lowest, None),
    }
}

/// The largest micro-batch of `schedule` that fits (recomputing `segments`, when given).
#[allow(clippy::too_many_arguments)]
fn split_decision(
    c: &Compiled,
    mode: Mode,
    options: &Options,
    schedule: Schedule,
    segments: Option<Segments>,
    budget: u64,
    evidence: &Evidence,
    why: String,
) -> Result<Decision, LazyError> {
    let correction = &evidence.reserve;
    // What calibration saw take more than the budget alone rules out that many samples, where
    // the batch may be split at all (a split that is refused keeps the plan it had).
    let mut limit = evidence.calibrated.limit();
    if limit.is_some_and(|l| l <= c.batch.max(1) as u64) {
        let one = Fit { micro_batch: 1, peak: 0, full_peak: 0, outcome: None };
        if check_split(c, mode, &one, budget, options).is_err() {
            limit = None;
        }
    }
    let choose = |c: &Compiled, schedule: &Schedule, budget: u64, reserve: &dyn Fn(u64) -> u64, options: &Options| {
        choose(c, schedule, budget, reserve, options, limit)
    };
    // Held whole at fewer samples (an excess may be fixed); where nothing fits so, the excess
    // is taken as per-sample, and the run measures which it was.
    let chosen = match choose(c, &schedule, budget, &|b| correction.at(b), options) {
        // No micro-batch fits, and splitting is ruled out anyway: that is the truer error.
        Err(LazyError::DoesNotFit { .. }) if c.batch > 1 => {
            let one =
                Fit { micro_batch: 1, peak: 0, full_peak: schedule.peak_at(c, c.batch.max(1) as u64), outcome: None };
            check_split(c, mode, &one, budget, options)?;
            choose(c, &schedule, budget, &|b| correction.at(b), options)
        }
        chosen => chosen,
    };
    let (choice, reserved) = match chosen {
        Err(LazyError::DoesNotFit { .. }) if correction.at(1) > 0 => {
            let choice = choose(c, &schedule, budget, &|b| correction.proportional(b), options)?;
            let reserved = correction.proportional(choice.micro_batch as u64);
            (choice, reserved)
        }
        chosen => {
            let choice = chosen.map_err(|mut e| {
                if let LazyError::DoesNotFit { segments: counted @ None, .. } = &mut e {
                    *counted = segments.as_ref().map(|s| s.count() as u32);
                }
                e
            })?;
            let reserved = correction.at(choice.micro_batch as u64);
            (choice, reserved)
        }
    };
    check_split(c, mode, &choice, budget, options)?;
    let splittable = splittable(c, mode, &choice, budget, options);
    let b = choice.micro_batch as u64;
    let outcome = choice.outcome.unwrap_or_else(|| schedule.simulate(b).resolve(c, b));
    let n = c.batch.max(1) as u64;
    let seconds = (time::step_seconds(c, b, segments.as_ref()), time::step_seconds(c, n, None));
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
        segments,
        why,
        seconds,
        optimizer: None,
        evidence: evidence.clone(),
        placement: None,
        unplaced: None,
    })
}

/// The micro-batch a search settled on (the largest that fits) and the peak there.
struct Fit {
    micro_batch: usize,
    peak: u64,
    full_peak: u64,
    /// The simulation at the chosen size, and the gradient bytes its accumulation step counts.
    outcome: Option<(Outcome, u64)>,
}

impl Fit {
    /// A choice made elsewhere (to ask `check_split` about another size).
    fn at(micro_batch: usize, like: &Fit) -> Fit {
        Fit { micro_batch, peak: like.peak, full_peak: like.full_peak, outcome: None }
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
    limit: Option<u64>,
) -> Result<Fit, LazyError> {
    let n = c.batch.max(1) as u64;
    // Below the fewest samples calibration saw take more than the budget alone.
    let below_limit = |b: u64| limit.is_none_or(|l| b < l);
    // The budget the schedule at `b` is held to, less what measurement found the plan misses.
    let held = |b: u64| budget.saturating_sub(reserve(b));
    let full = schedule.simulate(n);
    let full_resolved = full.resolve(c, n);
    let full_peak = full_resolved.0.peak;
    // A split runs `b`, then the remainder: kernels that pad to their blocks (oneDNN's AMX
    // tiles) may take more at the remainder than at `b` (a BFloat16 MLP at 488 samples of
    // 1000 peaked 2.6% above 512), so the higher of the two is the split's.
    let remainder = |b: u64| Some(n % b).filter(|&r| r > 0 && r < b);
    let split_peak = |b: u64, resolved: (Outcome, u64)| match remainder(b) {
        Some(r) => {
            let at_r = schedule.simulate(r).resolve(c, r);
            if at_r.0.peak > resolved.0.peak {
                at_r
            } else {
                resolved
            }
        }
        None => resolved,
    };
    let fits_split = |b: u64| {
        let outcome = schedule.simulate(b);
        let fits = below_limit(b)
            && outcome.fits(c, held(b), b).0
            && remainder(b).is_none_or(|r| schedule.simulate(r).fits(c, held(r), r).0);
        (fits, outcome)
    };
    if let Some(forced) = options.micro_batch {
        let b = (forced.max(1) as u64).min(n);
        let resolved = split_peak(b, schedule.simulate(b).resolve(c, b));
        return Ok(Fit { micro_batch: b as usize, peak: resolved.0.peak, full_peak, outcome: Some(resolved) });
    }
    if below_limit(n) && full.fits(c, held(n), n).0 {
        return Ok(Fit { micro_batch: n as usize, peak: full_peak, full_peak, outcome: Some(full_resolved) });
    }
    // A batch of one that does not fit has nothing smaller to try.
    if n == 1 {
        return Err(does_not_fit(c, schedule, full_peak, full_resolved.0.peak_step, budget, reserve(1), 1, None, None));
    }
    // Exponents e with 2^e < n: find the largest that fits (1 is checked last, if at all).
    let (mut lo, mut hi) = (0u32, 63 - (n - 1).leading_zeros());
    let mut best = None;
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        let (fits, outcome) = fits_split(1 << mid);
        if fits {
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
                return Err(does_not_fit(c, schedule, seen.peak, seen.peak_step, budget, reserve(1), 1, None, None));
            }
            at_one
        }
    };
    let resolved = split_peak(1 << lo, best.resolve(c, 1u64 << lo));
    Ok(Fit { micro_batch: 1 << lo, peak: resolved.0.peak, full_peak, outcome: Some(resolved) })
}

/// Refuses to split what cannot be split; `Ok` when splitting is not needed or is allowed.
fn check_split(c: &Compiled, mode: Mode, choice: &Fit, budget: u64, options: &Options) -> Result<(), LazyError> {
    if choice.micro_batch as i64 >= c.batch {
        return Ok(());
    }
    let out = c.output();
    // What no option splits: the output's value needs the whole batch at once.
    let whole_only = match (out.meta.flow, mode) {
        (Flow::Opaque, _) => Some("its value depends on the whole batch at once"),
        (Flow::Max, Mode::Backward) => {
            Some("a maximum over the batch can be evaluated in micro-batches, but not differentiated")
        }
        _ => None,
    };
    if let Some((pos, node)) = c.first_mixing() {
        if !options.allow_batch_mixing {
            return Err(LazyError::MixesBatch {
                node: pos,
                op: node.name().into(),
                reason: node.meta.mixes.clone().unwrap_or_default(),
                batch: c.batch as usize,
                peak: choice.full_peak,
                budget,
                requested: options.micro_batch,
                splits_anyway: whole_only.is_none(),
            });
        }
    }
    match whole_only {
        Some(reason) => Err(LazyError::NotSplittable {
            op: out.name().into(),
            shape: out.meta.shape.to_vec(),
            reason: reason.into(),
        }),
        None => Ok(()),
    }
}

/// Whether a micro-batch that runs out of memory may be halved. A choice that already splits
/// passed `check_split`, whose verdict does not depend on the size, so only a whole-batch
/// choice needs asking again.
fn splittable(c: &Compiled, mode: Mode, choice: &Fit, budget: u64, options: &Options) -> bool {
    c.batch > 1
        && ((choice.micro_batch as i64) < c.batch || check_split(c, mode, &Fit::at(1, choice), budget, options).is_ok())
}
