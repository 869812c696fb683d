//! What a plan costs in time, estimated to rank plans against each other: the ops a step
//! runs and the bytes they make, priced by the device's cost model
//! ([`CostModel::op_seconds`](crate::lazy::cost::CostModel::op_seconds)).

use super::compiled::{Compiled, F_LEAF};
use super::recompute::Segments;
use crate::lazy::cost::Work;

/// Estimated seconds of one step over the whole batch in micro-batches of `b`, recomputing
/// `segments` when given. A backward counts as twice its forward.
pub(crate) fn step_seconds(c: &Compiled, b: u64, segments: Option<&Segments>) -> f64 {
    let n = c.batch.max(1) as u64;
    let b = b.clamp(1, n);
    let chunk = |b: u64| -> f64 {
        let mut launches = 0.0;
        let mut bytes = 0.0;
        let mut again = (0.0, 0.0);
        let recompute_before = segments.map_or(0, |s| *s.starts.last().expect("one") as usize);
        for (i, node) in c.nodes.iter().enumerate() {
            if c.flags[i] & F_LEAF != 0 {
                continue;
            }
            let out = Work::from(node.cost.out).at(b, 1) as f64;
            launches += 1.0;
            bytes += out;
            if i < recompute_before {
                again.0 += 1.0;
                again.1 += out;
            }
        }
        3.0 * c.model.op_seconds(launches, bytes) + c.model.op_seconds(again.0, again.1)
    };
    let full = n / b;
    let rest = n % b;
    full as f64 * chunk(b) + if rest > 0 { chunk(rest) } else { 0.0 }
}
