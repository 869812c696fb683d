//! The search held to reserved bytes: on a CUDA card, a plan is given only where the replay of
//! the caching allocator ([`super::placement`]) places every request of its step.

use super::compiled::Compiled;
use super::evidence::{Evidence, Machine};
use super::placement::{replay, unplaced_request, Placement, Start, Unplaced};
use super::schedule::Mode;
use super::search::{self, Decision};
use crate::lazy::cost::caching::format_bytes as human;
use crate::lazy::error::LazyError;
use crate::lazy::options::Options;
use crate::lazy::unplaced::UnplacedRequest;

/// The plan of `c` that the allocator places: the search's plan under the machine's budget,
/// replayed from its start; where a request is not placed, the search again under a lower
/// budget, until one is placed. The budget is first lowered by what the allocator held beyond
/// the tensors at the failure; where nothing fits that lower budget, the tries bisect between
/// it and the last refused plan's peak. A function of its arguments, as the search is.
pub(crate) fn plan(
    c: &Compiled,
    mode: Mode,
    options: &Options,
    machine: &Machine,
    evidence: &Evidence,
) -> Result<Decision, LazyError> {
    let Some(start) = &machine.allocator else {
        return search::plan(c, mode, options, machine, evidence);
    };
    let mut lowered = machine.clone();
    let mut first: Option<UnplacedRequest> = None;
    let mut last: Option<(Decision, Placement)> = None;
    // Budgets at or below `lo` plan nothing; the last refused plan's peak is `hi`.
    let (mut lo, mut hi) = (0u64, machine.budget);
    for _ in 0..48 {
        let mut excess = 0;
        match search::plan(c, mode, options, &lowered, evidence) {
            Err(e) => match &last {
                None => return Err(e),
                Some(_) => lo = lowered.budget,
            },
            Ok(mut d) => {
                let mut p = replay(c, &d.schedule, d.micro_batch as u64, d.outcome.1, start);
                if let Some(emptied) = (!p.placed()).then(|| emptying_places(c, &d, start)).flatten() {
                    // The same plan, after `emptyCache`: cheaper than a smaller one.
                    let refused = request_of(c, &d, p.unplaced.as_ref().expect("not placed"));
                    d.why = format!(
                        "{}; empties the cache first ({} of cached segments back to the card): without, {refused}",
                        d.why,
                        human(emptied.emptied)
                    );
                    p = emptied;
                }
                if p.placed() {
                    let first = first.or(d.unplaced.take());
                    if let Some(refused) = &first {
                        let instead = match lowered.budget < machine.budget {
                            true => {
                                format!("held to {} of the {} budget", human(lowered.budget), human(machine.budget))
                            }
                            false => "another cut".into(),
                        };
                        d.why = format!("{}; {instead}: {refused}", d.why);
                    }
                    d.budget = machine.budget;
                    d.placement = Some(p);
                    d.unplaced = first;
                    return Ok(d);
                }
                let u = p.unplaced.as_ref().expect("not placed");
                first.get_or_insert_with(|| request_of(c, &d, u));
                // What the allocator held beyond the tensors when it failed, and the request
                // itself where the card could not back it.
                excess =
                    u.oom.reserved.saturating_sub(u.oom.allocated).max(u.oom.segment.saturating_sub(u.oom.card_free));
                hi = d.peak.min(lowered.budget);
                last = Some((d, p));
            }
        }
        // Bisection ends at a 1/256 of the budget (and at least a MiB).
        if hi.saturating_sub(lo) <= (machine.budget / 256).max(1 << 20) {
            break;
        }
        let below = hi.saturating_sub(excess.max(hi / 16));
        lowered.budget = if below > lo { below } else { lo + (hi - lo) / 2 };
    }
    let (d, p) = last.expect("at least one try refused");
    // The smallest change that places it, where there is one: the same plan in expandable
    // segments, whose freed pages rejoin.
    let with_expandable = (!start.config.expandable_segments)
        .then(|| {
            let mut start = start.clone();
            start.config.expandable_segments = true;
            replay(c, &d.schedule, d.micro_batch as u64, d.outcome.1, &start)
        })
        .filter(Placement::placed)
        .map(|p| p.step_reserved());
    Err(not_placed(c, &d, p, machine.budget, with_expandable))
}

/// The replay of `d` from `start` after an `emptyCache`, where that places it: a cached
/// segment split for a small request pins memory that the allocator's own release (on a failed
/// `cudaMalloc`) cannot give back. `None` where nothing is cached or it still does not place.
fn emptying_places(c: &Compiled, d: &Decision, start: &Start) -> Option<Placement> {
    if start.segments.is_empty() || start.empty_cache {
        return None;
    }
    let emptied = Start { empty_cache: true, ..start.clone() };
    let p = replay(c, &d.schedule, d.micro_batch as u64, d.outcome.1, &emptied);
    (p.placed() && p.emptied > 0).then_some(p)
}

/// The error of a plan whose smallest try the allocator could not place.
fn not_placed(c: &Compiled, d: &Decision, p: Placement, budget: u64, with_expandable: Option<u64>) -> LazyError {
    let u = p.unplaced.expect("not placed");
    LazyError::NotPlaced {
        op: c.output().name().into(),
        budget,
        request: Box::new(request_of(c, d, &u)),
        expandable: p.expandable,
        with_expandable,
    }
}

/// The request `u` that failed in the replay of decision `d`, as users read it.
fn request_of(c: &Compiled, d: &Decision, u: &Unplaced) -> UnplacedRequest {
    unplaced_request(c, d.peak, d.micro_batch, d.segments.as_ref().map_or(0, |s| s.count()), u)
}
