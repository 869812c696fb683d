//! The search held to reserved bytes: on a CUDA card, a plan is given only where the replay of
//! the caching allocator ([`super::placement`]) places every request of its step.

use super::compiled::Compiled;
use super::evidence::{Evidence, Machine};
use super::placement::{replay, Placement};
use super::schedule::Mode;
use super::search::{self, Decision};
use crate::lazy::error::LazyError;
use crate::lazy::options::Options;

/// The plan of `c` that the allocator places: the search's plan under the machine's budget,
/// replayed from its start; where a request is not placed, the search again under a budget
/// lowered by what the allocator held beyond the tensors at the failure, until one is placed.
/// A function of its arguments, as the search is.
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
    let mut last: Option<(Decision, Placement)> = None;
    // Each try lowers the budget by at least 1/16 of the peak: 64 reach 1/60 of it.
    for _ in 0..64 {
        let d = match search::plan(c, mode, options, &lowered, evidence) {
            Ok(d) => d,
            // Nothing fits the lowered budget: the last plan's failure is the answer.
            Err(e) => return Err(last.map_or(e, |(d, p)| not_placed(c, &d, p, machine.budget))),
        };
        let p = replay(c, &d.schedule, d.micro_batch as u64, d.outcome.1, start);
        if p.placed() {
            let mut d = d;
            if lowered.budget < machine.budget {
                d.why = format!(
                    "{}; held to {} of the {} budget so that the caching allocator places every block",
                    d.why,
                    human(lowered.budget),
                    human(machine.budget)
                );
            }
            d.budget = machine.budget;
            d.placement = Some(p);
            return Ok(d);
        }
        let oom = &p.unplaced.as_ref().expect("not placed").oom;
        // What the allocator held beyond the tensors when it failed, and the request itself
        // where the card could not back it.
        let excess = oom.reserved.saturating_sub(oom.allocated).max(oom.segment.saturating_sub(oom.card_free));
        let next = d.peak.saturating_sub(excess.max(d.peak / 16));
        lowered.budget = next.min(lowered.budget.saturating_sub(lowered.budget / 16));
        last = Some((d, p));
        if lowered.budget == 0 {
            break;
        }
    }
    let (d, p) = last.expect("at least one try");
    Err(not_placed(c, &d, p, machine.budget))
}

/// The error of a plan whose smallest try the allocator could not place.
fn not_placed(c: &Compiled, d: &Decision, p: Placement, budget: u64) -> LazyError {
    let u = p.unplaced.expect("not placed");
    LazyError::NotPlaced {
        op: c.output().name().into(),
        node: u.node,
        node_op: c.nodes[u.node].name().into(),
        micro_batch: u.micro_batch as usize,
        peak: d.peak,
        budget,
        expandable: p.expandable,
        why: u.oom.to_string(),
    }
}

fn human(bytes: u64) -> String {
    crate::lazy::cost::caching::format_bytes(bytes)
}
