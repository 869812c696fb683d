//! What a plan costs in time, estimated to rank plans against each other: the ops a step
//! runs and the bytes they make, priced by the device's cost model
//! ([`CostModel::op_seconds`](crate::lazy::cost::CostModel::op_seconds)).

use super::compiled::Compiled;
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
            if c.flags[i].leaf {
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

/// The kinds of plan a backward chooses between when the whole batch does not fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Choice {
    /// Micro-batches, nothing recomputed.
    Split,
    /// Recomputed segments (in micro-batches or not).
    Recompute,
}

/// How much slower (or faster) steps of one graph ran than estimated, per kind of plan: the
/// executor times each step it runs and records it; the search scales its estimates by what
/// was measured, so that the choice between splitting and recomputing follows this machine
/// once it has run the graph either way (unmeasured, the prior stands).
pub(crate) struct Timings {
    by_graph: std::sync::Mutex<std::collections::HashMap<(u64, Choice), f64>>,
}

/// Graphs remembered before the map starts over (as corrections do).
const CAPACITY: usize = 4096;

impl Timings {
    pub(crate) fn process() -> &'static Timings {
        static PROCESS: std::sync::OnceLock<Timings> = std::sync::OnceLock::new();
        PROCESS.get_or_init(|| Timings { by_graph: std::sync::Mutex::new(std::collections::HashMap::new()) })
    }

    /// Measured over estimated seconds for `choice` on this graph. Never measured, the other
    /// kind's factor stands in (the prior's scale on this machine, so that one measured kind
    /// is not made to look slower than an unmeasured one), else 1.
    pub(crate) fn factor(&self, c: &Compiled, choice: Choice) -> f64 {
        let map = self.by_graph.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let other = match choice {
            Choice::Split => Choice::Recompute,
            Choice::Recompute => Choice::Split,
        };
        map.get(&(c.fingerprint, choice)).or_else(|| map.get(&(c.fingerprint, other))).copied().unwrap_or(1.0)
    }

    /// Whether a step of this graph was measured as `choice`.
    pub(crate) fn measured(&self, c: &Compiled, choice: Choice) -> bool {
        let map = self.by_graph.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        map.contains_key(&(c.fingerprint, choice))
    }

    /// A step of this graph planned as `choice` ran in `measured` seconds where `estimated`
    /// were expected; the factor moves halfway to the new ratio (one slow step is damped).
    pub(crate) fn record(&self, c: &Compiled, choice: Choice, measured: f64, estimated: f64) {
        if !(measured > 0.0 && estimated > 0.0 && measured.is_finite()) {
            return;
        }
        let ratio = measured / estimated;
        let mut map = self.by_graph.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if map.len() >= CAPACITY {
            map.clear();
        }
        map.entry((c.fingerprint, choice)).and_modify(|f| *f = 0.5 * (*f + ratio)).or_insert(ratio);
    }
}

#[cfg(all(test, feature = "tch"))]
mod tests {
    use super::{Choice, Timings};
    use crate::lazy::options::{Options, Recompute};
    use crate::lazy::plan::{compile, decide, Measure, Mode};
    use tch::{Device, Kind, Tensor};

    /// Measured step times steer the choice between splitting and recomputing for their graph.
    #[test]
    fn measured_times_steer_the_choice() {
        let w = Tensor::randn([32, 32], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([1024, 32], (Kind::Float, Device::Cpu));
        // Unlike any other test's graph: 9 layers of 32 over 1024 samples.
        let mut h = crate::lazy::lazy(&x, 0);
        for _ in 0..9 {
            h = h.matmul(&w).tanh();
        }
        let loss = h.sum(None);
        let c = compile(&loss).unwrap();
        let whole = decide(&c, Mode::Backward, &Options::new().budget(u64::MAX / 4), Measure::Never).unwrap().peak;
        let options = Options::new().budget(whole * 8 / 10).recompute(Recompute::Auto);
        let timings = Timings::process();
        assert_eq!(timings.factor(&c, Choice::Split), 1.0);
        // One kind measured: its factor is the machine's scale for both.
        timings.record(&c, Choice::Split, 3.0, 1.0);
        assert_eq!((timings.factor(&c, Choice::Split), timings.factor(&c, Choice::Recompute)), (3.0, 3.0));
        let prior = decide(&c, Mode::Backward, &options, Measure::Never).unwrap();
        // Splitting measured 100 times slower than recomputing: recompute.
        timings.record(&c, Choice::Recompute, 0.01, 1.0);
        timings.record(&c, Choice::Recompute, 0.01, 1.0);
        timings.record(&c, Choice::Split, 300.0, 1.0);
        let slow_split = decide(&c, Mode::Backward, &options, Measure::Never).unwrap();
        assert!(slow_split.segments.is_some(), "{}", slow_split.why);
        assert!(slow_split.why.contains("measured"), "{}", slow_split.why);
        // And the other way round.
        for _ in 0..8 {
            timings.record(&c, Choice::Recompute, 1000.0, 1.0);
            timings.record(&c, Choice::Split, 0.01, 1.0);
        }
        let slow_recompute = decide(&c, Mode::Backward, &options, Measure::Never).unwrap();
        assert!(slow_recompute.segments.is_none() && slow_recompute.micro_batch < 1024, "{}", slow_recompute.why);
        // The prior's choice was one of the two.
        assert!(prior.segments.is_some() || prior.micro_batch < 1024);
    }
}
