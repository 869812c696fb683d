//! The last plan of this thread, reused when the next graph is the same graph planned from the
//! same evidence: a training loop records its step anew each time, and planning it again
//! (building its schedule, simulating it) would give the same decision.
//!
//! Planning is a function of the graph, the machine and the evidence, so the key holds what it
//! reads of each: the graph's structure hash ([`Compiled::structure`]) and which parameters
//! hold a `.grad`, the mode and options, the evidence's measured prices, reserve and speeds.
//! The machine's budget moves from step to step (free memory read again); a plan that runs the
//! whole batch as it is stays the plan under any budget that its peak, the reserve and the
//! optimizer's step fit (a smaller micro-batch or recomputation is chosen only where the whole
//! batch does not fit), and any other plan is reused only under the same budget.

use std::cell::RefCell;

use tch::Device;

use super::compiled::Compiled;
use super::evidence::{Evidence, Machine};
use super::schedule::Mode;
use super::search::Decision;
use crate::lazy::options::Options;

/// What a decision was made from, besides the budget.
struct Key {
    structure: u64,
    device: Device,
    mode: Mode,
    options: Options,
    in_place: bool,
    undefined_grads: Option<u64>,
    replays: bool,
    /// The allocator's settings, the card's size and whether leaves are placed (its free
    /// memory is the budget's, compared apart).
    allocator: Option<(crate::lazy::cost::caching::Config, u64, bool)>,
    evidence: Evidence,
}

impl Key {
    fn of(c: &Compiled, mode: Mode, options: &Options, machine: &Machine, evidence: &Evidence) -> Key {
        let in_place = c.accumulates_in_place();
        Key {
            structure: c.structure,
            device: c.device(),
            mode,
            options: options.clone(),
            in_place,
            // Asked only where some parameter holds a gradient (the plan reads it there).
            undefined_grads: (!in_place).then(|| c.undefined_grad_bytes()),
            replays: machine.replays,
            allocator: allocator_key(machine),
            evidence: evidence.clone(),
        }
    }

    fn matches(&self, c: &Compiled, mode: Mode, options: &Options, machine: &Machine, evidence: &Evidence) -> bool {
        let in_place = c.accumulates_in_place();
        self.structure == c.structure
            && self.device == c.device()
            && self.mode == mode
            && self.in_place == in_place
            && self.replays == machine.replays
            && self.allocator == allocator_key(machine)
            && self.options == *options
            && self.evidence.reserve == evidence.reserve
            && self.evidence.speed == evidence.speed
            && self.evidence.calibrated.training() == evidence.calibrated.training()
            && self.evidence.calibrated.by_node() == evidence.calibrated.by_node()
            && (in_place || self.undefined_grads == Some(c.undefined_grad_bytes()))
    }
}

fn allocator_key(machine: &Machine) -> Option<(crate::lazy::cost::caching::Config, u64, bool)> {
    machine.allocator.as_ref().map(|s| (s.config.clone(), s.card.total, s.place_leaves))
}

struct Last {
    key: Key,
    decision: Decision,
}

thread_local! {
    static LAST: RefCell<Option<Last>> = const { RefCell::new(None) };
}

/// The last decision, when it is the one planning `c` now would make.
pub(super) fn find(
    c: &Compiled,
    mode: Mode,
    options: &Options,
    machine: &Machine,
    evidence: &Evidence,
) -> Option<Decision> {
    LAST.with(|last| {
        let last = last.borrow();
        let last = last.as_ref()?;
        if !last.key.matches(c, mode, options, machine, evidence) {
            return None;
        }
        let d = &last.decision;
        let whole = d.micro_batch as i64 >= c.batch && d.segments.is_none() && options.micro_batch.is_none();
        if machine.budget != d.budget && !(whole && d.whole_fits(machine.budget)) {
            return None;
        }
        let mut reused = d.clone();
        reused.budget = machine.budget;
        reused.evidence = evidence.clone();
        Some(reused)
    })
}

/// Keeps `decision` as the last one.
pub(super) fn keep(
    c: &Compiled,
    mode: Mode,
    options: &Options,
    machine: &Machine,
    evidence: &Evidence,
    decision: &Decision,
) {
    let key = Key::of(c, mode, options, machine, evidence);
    LAST.with(|last| *last.borrow_mut() = Some(Last { key, decision: decision.clone() }));
}

#[cfg(all(test, feature = "tch"))]
mod tests {
    use super::{find, keep};
    use crate::lazy::options::Options;
    use crate::lazy::plan::{compile, search, Evidence, Machine, Mode};
    use crate::lazy::LazyTensor;
    use tch::{Device, Kind, Tensor};

    fn loss(x: &Tensor, w: &Tensor, v: &Tensor, crossed: bool) -> LazyTensor {
        let h = crate::lazy::lazy(x, 0).matmul(w).relu();
        let g = crate::lazy::lazy(x, 0).matmul(v).relu();
        // Same ops, shapes and order either way; only which value feeds the product differs.
        let (a, b) = if crossed { (g, h) } else { (h, g) };
        (a.matmul(w) * b).sum(None)
    }

    #[test]
    fn the_same_graph_recorded_again_reuses_its_plan() {
        let p = |shape: [i64; 2]| Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (w, v, other) = (p([32, 32]), p([32, 32]), p([32, 32]));
        let x = Tensor::randn([64, 32], (Kind::Float, Device::Cpu));
        let options = Options::new();
        let evidence = Evidence::none(Mode::Backward);
        let machine = |budget: u64| Machine::with_budget(budget, true);
        let c = compile(&loss(&x, &w, &v, false)).unwrap();
        let d = search::plan(&c, Mode::Backward, &options, &machine(1 << 40), &evidence).unwrap();
        assert_eq!(d.micro_batch, 64);
        keep(&c, Mode::Backward, &options, &machine(1 << 40), &evidence, &d);
        // Recorded anew: found, under its budget or a larger one, with the budget of now.
        let again = compile(&loss(&x, &w, &v, false)).unwrap();
        for budget in [1u64 << 40, 1 << 41] {
            let found = find(&again, Mode::Backward, &options, &machine(budget), &evidence).expect("reused");
            assert_eq!((found.micro_batch, found.peak, found.budget), (d.micro_batch, d.peak, budget));
        }
        // A smaller budget its peak still fits: found too; one it does not: planned anew (the
        // search then splits or recomputes).
        assert!(find(&again, Mode::Backward, &options, &machine((1 << 40) - 1), &evidence).is_some());
        let found = find(&again, Mode::Backward, &options, &machine(d.peak), &evidence).expect("reused");
        assert_eq!((found.micro_batch, found.budget), (d.micro_batch, d.peak));
        assert!(find(&again, Mode::Backward, &options, &machine(d.peak - 1), &evidence).is_none());
        let under = search::plan(&again, Mode::Backward, &options, &machine(d.peak - 1), &evidence);
        assert!(under.is_err() || under.is_ok_and(|u| u.micro_batch < 64 || u.segments.is_some()));
        // Other wiring, another parameter, another mode or options: planned anew.
        let crossed = compile(&loss(&x, &w, &v, true)).unwrap();
        assert_eq!(crossed.fingerprint, c.fingerprint, "the fingerprint does not see the wiring");
        assert!(find(&crossed, Mode::Backward, &options, &machine(1 << 40), &evidence).is_none());
        let swapped = compile(&loss(&x, &w, &other, false)).unwrap();
        assert!(find(&swapped, Mode::Backward, &options, &machine(1 << 40), &evidence).is_none());
        assert!(find(&again, Mode::Forward, &options, &machine(1 << 40), &evidence).is_none());
        let split = Options::new().micro_batch(16);
        assert!(find(&again, Mode::Backward, &split, &machine(1 << 40), &evidence).is_none());
        // Another reserve (an earlier run measured above the plan).
        let mut over = evidence.clone();
        over.reserve.add(64, 1 << 20);
        assert!(find(&again, Mode::Backward, &options, &machine(1 << 40), &over).is_none());
        // A parameter that holds a gradient now (each compiled graph asks again).
        (&w * 1.0).sum(Kind::Float).backward();
        let later = compile(&loss(&x, &w, &v, false)).unwrap();
        assert!(find(&later, Mode::Backward, &options, &machine(1 << 40), &evidence).is_none());
    }
}
