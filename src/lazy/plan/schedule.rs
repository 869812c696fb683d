//! The schedule of one mode: which tensors are allocated and freed at each step, as the
//! executor runs them, and its evaluation at a micro-batch size.

use super::compiled::{
    Compiled, F_ALIAS_REST, F_ALLOCATES, F_DIFFERENTIABLE, F_GRAD_COPY, F_GRAD_DENSE, F_LEAF, F_REQUIRES_GRAD,
    F_SAVES_OUTPUT,
};
use crate::lazy::cost::cuda::ReduceStaging;
use crate::lazy::cost::{Price, Work};

/// What a plan covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Computing the value only (no gradients recorded).
    Forward,
    /// Forward and backward, accumulating parameter gradients.
    Backward,
}

/// Which pass a step of the schedule belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Running an op.
    Forward,
    /// Running an op's backward.
    Backward,
    /// Adding the micro-batch's parameter gradients into `.grad()`.
    Accumulate,
}

/// One step of the schedule, as recorded for a plan's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Position of the op in [`Plan::ops`](super::Plan::ops).
    pub node: usize,
    /// The pass.
    pub phase: Phase,
    /// Bytes newly allocated by the step (rounded), scratch space excluded. For the
    /// accumulation step: the gradients parameters get — all parameters' when that cannot change
    /// the peak, else only those without a `.grad()` yet (asking libtorch costs time).
    pub bytes: u64,
    /// Bytes live while the step runs (its peak: inputs, outputs and scratch space).
    pub during: u64,
    /// Bytes live after the step, once what it released is freed.
    pub live: u64,
}

/// Kinds of schedule events, in the top 3 bits of a `u32`; the rest indexes the table.
const ADD: u32 = 0 << 29;
/// A tensor is freed.
const FREE: u32 = 1 << 29;
/// Bytes that live only while the step runs (scratch space, a gradient being added).
const TRANSIENT: u32 = 2 << 29;
/// The step runs: its inputs, outputs and scratch space are live together.
const RUN: u32 = 3 << 29;
/// The step is over (what it released is freed).
const END: u32 = 4 << 29;
/// A CUDA reduction's staging buffer lives while the step runs (an index into `staged`).
const STAGE: u32 = 5 << 29;
const KIND: u32 = 7 << 29;

/// A node whose op names no kernel call: nothing to price.
const NOT_PRICED: u32 = u32::MAX;

/// The schedule of one mode: which tensors are allocated and freed at each step. It does not
/// depend on the micro-batch size — only the bytes do — so it is built once and then
/// evaluated for each candidate size by a tight loop.
#[derive(Clone, Debug, Default)]
pub(crate) struct Schedule {
    /// Bytes the events refer to.
    table: Vec<Work>,
    /// Staging buffers, whose bytes are not linear in the micro-batch.
    staged: Vec<ReduceStaging>,
    /// Events: `ADD | k` (table entry `k` is allocated), `FREE | k`, `TRANSIENT | k`,
    /// `STAGE | k` (staging buffer `k`), `RUN`, `END`.
    events: Vec<u32>,
    /// Node and phase of each step.
    pub(crate) steps: Vec<(u32, Phase)>,
    training: bool,
    /// The block its device's allocator counts in.
    block: u64,
}

impl Schedule {
    // Positions index several arrays at once: a range loop says so best.
    #[allow(clippy::needless_range_loop)]
    pub(crate) fn build(c: &Compiled, mode: Mode) -> Schedule {
        let n = c.len();
        let training = mode == Mode::Backward;
        // The table: each value's bytes at `i` (its output's allocation, when it allocates, and
        // its gradient's), then extras and scratch space as they come.
        // Capacities are sized up front: a vector doubled and freed at the top of the heap makes
        // the allocator hand pages back and fault them in again on every plan.
        let mut table: Vec<Work> = Vec::with_capacity(n + n / 4 + 16);
        table.extend(c.nodes.iter().map(|x| Work::from(x.cost.grad)));
        let add_entry = |table: &mut Vec<Work>, bytes: Work| {
            (bytes != Work::default()).then(|| {
                table.push(bytes);
                (table.len() - 1) as u32
            })
        };
        // What each node's kernel calls take on this device, for the nodes that make any (most
        // ops make none: they are not asked).
        let mut calls = Vec::new();
        let mut priced: Vec<Price> = Vec::with_capacity(c.nodes.iter().filter(|x| x.cost.kernel_calls).count());
        let slot: Vec<u32> = c
            .nodes
            .iter()
            .map(|node| {
                if !node.cost.kernel_calls {
                    return NOT_PRICED;
                }
                priced.push(c.model.price(node, &mut calls));
                (priced.len() - 1) as u32
            })
            .collect();
        let none = Price::default();
        let price = |i: usize| priced.get(slot[i] as usize).unwrap_or(&none);
        let mut staged: Vec<ReduceStaging> = Vec::new();
        // The staging buffers node `i` takes in one pass, as transient events.
        let stage = |staged: &mut Vec<ReduceStaging>, events: &mut Vec<u32>, i: usize, backward: bool| {
            for (_, s) in price(i).staged.iter().filter(|(b, _)| *b == backward) {
                staged.push(s.clone());
                events.push(STAGE | (staged.len() - 1) as u32);
            }
        };
        let mut extra_at: Vec<Option<u32>> = vec![None; if training { n } else { 0 }];
        let mut events = Vec::with_capacity(if training { 6 * n } else { 3 * n });
        let mut steps = Vec::with_capacity(if training { 2 * n } else { n });
        let requires = |i: usize| c.flags[i] & F_REQUIRES_GRAD != 0;
        let saves_output = |i: usize| training && c.flags[i] & F_SAVES_OUTPUT != 0;
        let saved = |i: usize, k: usize| training && k < 64 && c.nodes[i].cost.saved & (1 << k) != 0;
        // A value's storage, freed: its bytes, if it allocated them.
        let free = |events: &mut Vec<u32>, r: usize| {
            if c.flags[r] & F_ALLOCATES != 0 {
                events.push(FREE | r as u32);
            }
        };
        // Pins: how many holders keep a storage alive (the executor's values, autograd's saves).
        // Outputs are storages `0..n`; gradients `n..2n` (`n + i`: the gradient of value `i`).
        let mut pins = vec![0u32; 2 * n];
        // ---- forward
        for i in 0..n {
            let r = c.root[i] as usize;
            if r == i && c.flags[i] & F_ALLOCATES != 0 {
                events.push(ADD | i as u32);
            }
            if training {
                if let Some(k) = add_entry(&mut table, price(i).kept) {
                    extra_at[i] = Some(k);
                    events.push(ADD | k);
                }
            }
            // Without autograd, what it would keep is freed as the op returns.
            let forward = if training { price(i).forward } else { price(i).forward.plus(price(i).unsaved) };
            if let Some(k) = add_entry(&mut table, forward) {
                events.push(TRANSIENT | k);
            }
            stage(&mut staged, &mut events, i, false);
            events.push(RUN);
            // The executor holds the value until its last use; views hold their base.
            pins[r] += 1;
            if saves_output(i) {
                pins[r] += 1;
            }
            let ins = c.input_slice(i);
            for (k, &j) in ins.iter().enumerate() {
                if saved(i, k) {
                    pins[c.root[j as usize] as usize] += 1;
                }
            }
            // Release inputs whose last use this was (once, even if used twice: `x * x`).
            for (k, &j) in ins.iter().enumerate() {
                if c.last_use[j as usize] as usize == i && !ins[..k].contains(&j) {
                    let r = c.root[j as usize] as usize;
                    pins[r] -= 1;
                    if pins[r] == 0 {
                        free(&mut events, r);
                    }
                }
            }
            events.push(END);
            steps.push((i as u32, Phase::Forward));
        }
        if !training {
            return Schedule { table, staged, events, steps, training, block: c.block };
        }
        // ---- backward: gradients flow from the output in reverse order.
        let mut grad_of: Vec<Option<u32>> = vec![None; n];
        // Leaves whose gradient so far is a view (see `Operation::grad_view`): autograd sums
        // the next contribution out of place. The sum is a fresh tensor: later ones go in place.
        let mut held_view = vec![false; n];
        // The contributions of the step summed out of place (their nodes).
        let mut out_of_place: Vec<u32> = Vec::new();
        let out = n - 1;
        if requires(out) {
            grad_of[out] = Some((n + out) as u32);
            pins[n + out] = 1;
            events.push(ADD | out as u32);
        }
        for i in (0..n).rev() {
            let Some(g) = grad_of[i] else {
                continue;
            };
            if c.flags[i] & F_LEAF != 0 {
                continue;
            }
            // A permuted gradient copied to be viewed as the op needs, before its kernels run
            // (in a view's backward of its own): the copy replaces the gradient.
            if c.flags[i] & F_GRAD_COPY != 0 {
                events.push(TRANSIENT | i as u32);
                events.push(RUN);
            }
            // A broadcast gradient's dense copy, made by the backward itself: it lives while
            // the backward runs, beside what it allocates.
            if c.flags[i] & F_GRAD_DENSE != 0 {
                events.push(TRANSIENT | i as u32);
            }
            let alias_mask = c.nodes[i].cost.grad_alias;
            let view_mask = alias_mask | c.nodes[i].cost.grad_view;
            let differentiable = c.flags[i] & F_DIFFERENTIABLE != 0;
            let ins = c.input_slice(i);
            for (k, &j) in ins.iter().enumerate() {
                let j = j as usize;
                if !requires(j) || !differentiable {
                    continue;
                }
                let target = c.param[j].map_or(j, |p| p as usize);
                let alias = if k < 64 { alias_mask & (1 << k) != 0 } else { c.flags[i] & F_ALIAS_REST != 0 };
                if grad_of[target].is_some() {
                    // A second contribution: computed, then added into the first.
                    events.push(TRANSIENT | j as u32);
                    if std::mem::take(&mut held_view[target]) {
                        out_of_place.push(j as u32);
                    }
                    continue;
                }
                if c.flags[target] & F_LEAF != 0 {
                    held_view[target] = if k < 64 { view_mask & (1 << k) != 0 } else { alias };
                }
                if alias {
                    grad_of[target] = Some(g);
                    pins[g as usize] += 1;
                } else {
                    grad_of[target] = Some((n + target) as u32);
                    pins[n + target] = 1;
                    events.push(ADD | j as u32);
                }
            }
            if let Some(k) = add_entry(&mut table, price(i).backward) {
                events.push(TRANSIENT | k);
            }
            stage(&mut staged, &mut events, i, true);
            events.push(RUN);
            // The output gradient and what was saved for this op are released.
            let mut release = |events: &mut Vec<u32>, s: usize| {
                pins[s] -= 1;
                if pins[s] == 0 {
                    if s >= n {
                        events.push(FREE | (s - n) as u32);
                    } else {
                        free(events, s);
                    }
                }
            };
            release(&mut events, g as usize);
            if requires(i) {
                for (k, &j) in ins.iter().enumerate() {
                    if saved(i, k) {
                        release(&mut events, c.root[j as usize] as usize);
                    }
                }
                if saves_output(i) {
                    release(&mut events, c.root[i] as usize);
                }
                if let Some(k) = extra_at[i] {
                    events.push(FREE | k);
                }
            }
            // Once the backward returned (its input gradient and scratch space released), a
            // contribution summed out of place: the contribution and the sum live beside the
            // first, which is freed after.
            for j in out_of_place.drain(..) {
                events.push(TRANSIENT | j);
                events.push(TRANSIENT | j);
                events.push(RUN);
            }
            events.push(END);
            steps.push((i as u32, Phase::Backward));
        }
        Schedule { table, staged, events, steps, training, block: c.block }
    }

    /// The peak at micro-batch `b` (the accumulation step aside); records the steps when asked.
    pub(crate) fn eval(&self, b: u64, mut record: Option<&mut Vec<Step>>) -> Outcome {
        let table = &self.table;
        let (mut live, mut per) = (0u64, 0u64);
        let (mut transient, mut transient_per, mut allocated, mut during) = (0u64, 0u64, 0u64, 0u64);
        let mut best = Outcome { peak: 0, peak_step: 0, peak_per_sample: 0, accumulate: None };
        let mut step = 0usize;
        for &event in &self.events {
            let bytes = table.get((event & !KIND) as usize).copied().unwrap_or_default();
            match event & KIND {
                ADD => {
                    let at = bytes.at(b, self.block);
                    live += at;
                    per += bytes.per;
                    allocated += at;
                }
                FREE => {
                    live -= bytes.at(b, self.block);
                    per -= bytes.per;
                }
                TRANSIENT => {
                    transient += bytes.at(b, self.block);
                    transient_per += bytes.per;
                }
                STAGE => {
                    // Not linear in `b`: its whole size counts as per-sample bytes here.
                    let at = self.staged[(event & !KIND) as usize].at(b);
                    transient += at;
                    transient_per += at / b.max(1);
                }
                RUN => {
                    // A step may run twice (a gradient's copy, then the op): its larger.
                    during = during.max(live + transient);
                    if during > best.peak {
                        best.peak = during;
                        best.peak_step = step;
                        best.peak_per_sample = per + transient_per;
                    }
                    transient = 0;
                    transient_per = 0;
                }
                _ => {
                    if let Some(steps) = record.as_deref_mut() {
                        let (node, phase) = self.steps[step];
                        steps.push(Step { node: node as usize, phase, bytes: allocated, during, live });
                    }
                    allocated = 0;
                    during = 0;
                    step += 1;
                }
            }
        }
        if self.training {
            // Parameters without a `.grad()` get one (bytes the caller decides), then the
            // micro-batch's gradients are added in place.
            best.accumulate = Some((live, per, step));
        }
        best
    }
}

/// What the simulation found at one micro-batch size, the accumulation step aside: its value
/// depends on which parameters already have a `.grad()`, which is asked only when it matters.
#[derive(Clone, Copy)]
pub(crate) struct Outcome {
    pub(crate) peak: u64,
    pub(crate) peak_step: usize,
    /// Per-sample bytes live at the peak (unrounded), for the scaling/fixed split.
    pub(crate) peak_per_sample: u64,
    /// Bytes live before the accumulation step, its per-sample part and its step number.
    pub(crate) accumulate: Option<(u64, u64, usize)>,
}

impl Outcome {
    /// Peak, step and per-sample bytes when the accumulation allocates `new_grads` bytes of
    /// `.grad` that did not exist (tch's `zero_grad()` sets them to none). The first
    /// micro-batch creates them at its accumulation; when the batch is split (`!whole`), every
    /// later micro-batch runs with them live, its whole schedule that much higher.
    pub(crate) fn with(self, new_grads: u64, whole: bool) -> Outcome {
        match self.accumulate {
            Some(_) if !whole && new_grads > 0 => Outcome { peak: self.peak + new_grads, ..self },
            Some((live, per, step)) if live + new_grads > self.peak => {
                Outcome { peak: live + new_grads, peak_step: step, peak_per_sample: per, ..self }
            }
            _ => self,
        }
    }

    /// The exact outcome at micro-batch `b`, asking which gradients exist only when the answer
    /// changes the peak. At the whole batch, see [`Compiled::accumulates_in_place`].
    pub(crate) fn resolve(self, c: &Compiled, b: u64) -> (Outcome, u64) {
        let whole = b >= c.batch.max(1) as u64;
        let (outcome, new_grads) = if whole && c.accumulates_in_place() {
            (self.with(0, whole), 0)
        } else {
            let (low, high) = (self.with(0, whole), self.with(c.param_grad_bytes, whole));
            if low.peak == high.peak {
                (high, c.param_grad_bytes)
            } else {
                let exact = c.undefined_grad_bytes();
                (self.with(exact, whole), exact)
            }
        };
        (outcome.holding_outputs(c, b), new_grads)
    }

    /// Whether the peak at micro-batch `b` fits `budget`, asking which gradients exist only
    /// when needed.
    pub(crate) fn fits(self, c: &Compiled, budget: u64, b: u64) -> (bool, Outcome) {
        let whole = b >= c.batch.max(1) as u64;
        let outcome = if whole && c.accumulates_in_place() {
            self.with(0, whole)
        } else {
            let high = self.with(c.param_grad_bytes, whole).holding_outputs(c, b);
            if high.peak <= budget {
                return (true, high);
            }
            let low = self.with(0, whole).holding_outputs(c, b);
            if low.peak > budget {
                return (false, low);
            }
            self.with(c.undefined_grad_bytes(), whole)
        };
        let outcome = outcome.holding_outputs(c, b);
        (outcome.peak <= budget, outcome)
    }

    /// A value evaluated in micro-batches of `b` (a per-sample output): each micro-batch runs
    /// with the outputs of the earlier ones held (a view's copied first, so that its base is
    /// freed), and their concatenation takes the whole output twice.
    fn holding_outputs(self, c: &Compiled, b: u64) -> Outcome {
        match c.output_parts(b) {
            Some((during, concatenation)) => Outcome { peak: (self.peak + during).max(concatenation), ..self },
            None => self,
        }
    }
}

impl Schedule {
    /// The peak at micro-batch `b`, the accumulation step aside.
    pub(crate) fn simulate(&self, b: u64) -> Outcome {
        self.eval(b, None)
    }

    /// The peak at micro-batch `b` of a graph of `c`, the accumulation step included, as the
    /// search computes it.
    pub(crate) fn peak_at(&self, c: &Compiled, b: u64) -> u64 {
        self.simulate(b).resolve(c, b).0.peak
    }

    /// The node and phase of a step number.
    pub(crate) fn step_node(&self, c: &Compiled, step: usize) -> (usize, Phase) {
        self.steps.get(step).map_or((c.len() - 1, Phase::Accumulate), |&(node, phase)| (node as usize, phase))
    }
}
