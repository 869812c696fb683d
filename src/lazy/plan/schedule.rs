//! The schedule of one mode: which tensors are allocated and freed at each step, as the
//! executor runs them, and its evaluation at a micro-batch size.

use std::rc::Rc;

use super::compiled::Compiled;
use super::recompute::{Segments, HELD};
use crate::lazy::cost::cuda::ReduceStaging;
use crate::lazy::cost::measured::Calibrated;
use crate::lazy::cost::{Price, Work};

/// What a plan covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Computing the value only (no gradients recorded).
    Forward,
    /// Forward and backward, accumulating parameter gradients.
    Backward,
}

pub use crate::lazy::phase::Phase;

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
/// Table entry `k` just became a parameter's gradient. A later micro-batch that accumulates in
/// place adds it into `.grad` as its step ends and frees it (see [`Outcome::later`]).
const GRAD: u32 = 6 << 29;
/// Nothing: a [`GRAD`] event moved to a later contribution of the same gradient.
const NOP: u32 = 7 << 29;
const KIND: u32 = 7 << 29;

/// A node whose op names no kernel call: nothing to price.
const NOT_PRICED: u32 = u32::MAX;

/// The schedule of one mode: which tensors are allocated and freed at each step. It does not
/// depend on the micro-batch size — only the bytes do — so it is built once and then
/// evaluated for each candidate size by a tight loop.
#[derive(Clone, Debug, Default)]
pub(crate) struct Schedule {
    // Shared, not copied: a plan reused for a graph recorded again clones its schedule.
    /// Bytes the events refer to.
    table: Rc<[Work]>,
    /// Staging buffers, whose bytes are not linear in the micro-batch.
    staged: Rc<[ReduceStaging]>,
    /// Events: `ADD | k` (table entry `k` is allocated), `FREE | k`, `TRANSIENT | k`,
    /// `STAGE | k` (staging buffer `k`), `RUN`, `END`.
    events: Rc<[u32]>,
    /// Node and phase of each step.
    pub(crate) steps: Rc<[(u32, Phase)]>,
    training: bool,
    /// The block its device's allocator counts in.
    block: u64,
    /// Table entries of the leaves' gradients: what `.grad` holds after a backward.
    grads: Rc<[u32]>,
    /// The whole batch: a micro-batch of more than half of it is followed by one smaller one.
    batch: u64,
}

/// Builds a schedule's events, node by node: the forward of an op (with or without autograd)
/// and its backward, so that the plain schedule and the recomputing one share every rule.
struct Builder<'c> {
    c: &'c Compiled,
    /// Bytes the events refer to: each value's at `i` (its output's allocation, when it
    /// allocates, and its gradient's), then extras and scratch space as they come.
    table: Vec<Work>,
    staged: Vec<ReduceStaging>,
    events: Vec<u32>,
    steps: Vec<(u32, Phase)>,
    prices: &'c Prices,
    /// A kept extra's table entry, by node (training only).
    extra_at: Vec<Option<u32>>,
    /// Pins: how many holders keep a storage alive (the executor's values, autograd's saves).
    /// Outputs are storages `0..n`; gradients `n..2n` (`n + i`: the gradient of value `i`).
    pins: Vec<u32>,
    /// The storage of each value's gradient, once one arrived.
    grad_of: Vec<Option<u32>>,
    /// Leaves whose gradient so far is a view (see `OpFacts::grad_view`): autograd sums the
    /// next contribution out of place. The sum is a fresh tensor: later ones go in place.
    held_view: Vec<bool>,
    /// The contributions of the step summed out of place (their nodes).
    out_of_place: Vec<u32>,
    /// Table entries of the leaves' gradients ([`GRAD`] events).
    grads: Vec<u32>,
    /// Where each leaf's [`GRAD`] event is, by node.
    grad_event: Vec<Option<usize>>,
    /// Nodes that require a gradient the backward never brings (upstream of a `detach`), by
    /// the step after which eager autograd's graph lets go of what they saved: the last use
    /// of the last value that holds their `grad_fn` ([`Builder::hold_unreached`]).
    unreached: Vec<(u32, u32)>,
    /// How many of `unreached` were let go.
    let_go: usize,
}

/// What each node's kernel calls take on the graph's device, priced once for every schedule of
/// the graph (the plain one and each recomputing one the search tries). Most ops make no
/// kernel call: they are not asked.
pub(crate) struct Prices {
    priced: Vec<Price>,
    slot: Vec<u32>,
}

impl Prices {
    /// The prices of `c`'s nodes: by their rules, or by what `calibrated` measured of them.
    pub(crate) fn of(c: &Compiled, calibrated: &Calibrated) -> Prices {
        let mut calls = Vec::new();
        // Measured nodes, by position: walked alongside the nodes.
        let mut measured = calibrated.by_node().iter().peekable();
        let mut priced: Vec<Price> = Vec::with_capacity(c.nodes.iter().filter(|x| x.kernel_calls()).count());
        let slot: Vec<u32> = c
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let m = measured.next_if(|(at, _)| *at as usize == i).map(|(_, m)| m);
                let has_calls = node.kernel_calls();
                if !has_calls && m.is_none() {
                    return NOT_PRICED;
                }
                let rule = if has_calls { c.model.price(node, &mut calls) } else { Price::default() };
                priced.push(match m {
                    Some(m) => m.price(rule, calibrated.training()),
                    None => rule,
                });
                (priced.len() - 1) as u32
            })
            .collect();
        Prices { priced, slot }
    }

    fn get(&self, i: usize) -> &Price {
        static NONE: Price = Price {
            kept: Work::ZERO,
            unsaved: Work::ZERO,
            forward: Work::ZERO,
            backward: Work::ZERO,
            staged: Vec::new(),
        };
        self.priced.get(self.slot[i] as usize).unwrap_or(&NONE)
    }
}

impl<'c> Builder<'c> {
    fn new(c: &'c Compiled, prices: &'c Prices, training: bool) -> Builder<'c> {
        let n = c.len();
        // Capacities are sized up front: a vector doubled and freed at the top of the heap makes
        // the allocator hand pages back and fault them in again on every plan.
        let mut table: Vec<Work> = Vec::with_capacity(n + n / 4 + 16);
        table.extend(c.nodes.iter().map(|x| Work::from(x.cost.grad)));
        Builder {
            c,
            table,
            staged: Vec::new(),
            events: Vec::with_capacity(if training { 6 * n } else { 3 * n }),
            steps: Vec::with_capacity(if training { 2 * n } else { n }),
            prices,
            extra_at: vec![None; if training { n } else { 0 }],
            pins: vec![0u32; 2 * n],
            grad_of: vec![None; if training { n } else { 0 }],
            held_view: vec![false; if training { n } else { 0 }],
            out_of_place: Vec::new(),
            grads: Vec::new(),
            grad_event: vec![None; if training { n } else { 0 }],
            unreached: Vec::new(),
            let_go: 0,
        }
    }

    /// Schedules the release of what the nodes of `range` that the backward never reaches
    /// saved: a node's `grad_fn` is held by its output and by the `grad_fn`s of the values
    /// computed from it that require a gradient, so what it saved lives until the last of those
    /// values is let go (`last`: each value's last use, [`HELD`] for one held past the range).
    /// Without this the saves would be held to the end.
    fn hold_unreached(&mut self, range: std::ops::Range<usize>, last: &[u32]) {
        let c = self.c;
        let unreached = |i: usize| c.flags[i].requires_grad && !c.flags[i].reached && !c.flags[i].leaf;
        self.unreached.clear();
        self.let_go = 0;
        if !range.clone().any(unreached) {
            return;
        }
        let mut hold: Vec<u32> = last[range.clone()].to_vec();
        let start = range.start;
        for i in range.clone().rev() {
            if unreached(i) {
                for j in c.inputs(i) {
                    if j >= start && unreached(j) {
                        hold[j - start] = hold[j - start].max(hold[i - start]);
                    }
                }
                self.unreached.push((hold[i - start], i as u32));
            }
        }
        self.unreached.sort_unstable();
    }

    /// Lets go of what the unreached nodes still pinned saved (their values held past the
    /// range were let go).
    fn let_go_all_unreached(&mut self) {
        self.let_go_unreached(usize::MAX - 1);
    }

    /// Lets go of what unreached nodes saved once step `i` is their last ([`Self::hold_unreached`]).
    fn let_go_unreached(&mut self, i: usize) {
        while let Some(&(until, node)) = self.unreached.get(self.let_go) {
            if until as usize > i {
                break;
            }
            self.let_go += 1;
            self.release_saved(node as usize);
        }
    }

    /// What autograd saved for node `i` is let go.
    fn release_saved(&mut self, i: usize) {
        let c = self.c;
        for (k, &j) in c.input_slice(i).iter().enumerate() {
            if c.nodes[i].facts.saved.contains(k) {
                self.release(c.root[j as usize] as usize);
            }
        }
        if c.flags[i].saves_output {
            self.release(c.root[i] as usize);
        }
        if let Some(k) = self.extra_at[i] {
            self.events.push(FREE | k);
        }
    }

    fn finish(self, training: bool) -> Schedule {
        let Builder { table, staged, events, steps, c, grads, .. } = self;
        Schedule {
            table: table.into(),
            staged: staged.into(),
            events: events.into(),
            steps: steps.into(),
            training,
            block: c.block,
            grads: grads.into(),
            batch: c.batch.max(1) as u64,
        }
    }

    fn add_entry(&mut self, bytes: Work) -> Option<u32> {
        (bytes != Work::default()).then(|| {
            self.table.push(bytes);
            (self.table.len() - 1) as u32
        })
    }

    /// The staging buffers node `i` takes in one pass, as transient events.
    fn stage(&mut self, price: &'c Price, backward: bool) {
        for (_, s) in price.staged.iter().filter(|(b, _)| *b == backward) {
            self.staged.push(s.clone());
            self.events.push(STAGE | (self.staged.len() - 1) as u32);
        }
    }

    /// A storage, freed: its bytes, if it allocated them (`r < n`), or a gradient's.
    fn free(&mut self, s: usize) {
        let n = self.c.len();
        if s >= n {
            self.events.push(FREE | (s - n) as u32);
        } else if self.c.flags[s].allocates {
            self.events.push(FREE | s as u32);
        }
    }

    /// One holder of storage `s` lets go.
    fn release(&mut self, s: usize) {
        self.pins[s] -= 1;
        if self.pins[s] == 0 {
            self.free(s);
        }
    }

    /// Runs node `i` forward (autograd keeping what it saves when `training`); each input
    /// whose last use (`last[j]`) this is is released.
    fn forward(&mut self, i: usize, training: bool, last: &[u32], phase: Phase) {
        let c = self.c;
        let r = c.root[i] as usize;
        if r == i && c.flags[i].allocates {
            self.events.push(ADD | i as u32);
        }
        let price = self.prices.get(i);
        if training {
            if let Some(k) = self.add_entry(price.kept) {
                self.extra_at[i] = Some(k);
                self.events.push(ADD | k);
            }
        }
        // Without autograd, what it would keep is freed as the op returns.
        let forward = if training { price.forward } else { price.forward.plus(price.unsaved) };
        if let Some(k) = self.add_entry(forward) {
            self.events.push(TRANSIENT | k);
        }
        self.stage(price, false);
        self.events.push(RUN);
        // The executor holds the value until its last use; views hold their base.
        self.pins[r] += 1;
        if training && c.flags[i].saves_output {
            self.pins[r] += 1;
        }
        let ins = c.input_slice(i);
        for (k, &j) in ins.iter().enumerate() {
            if training && c.nodes[i].facts.saved.contains(k) {
                self.pins[c.root[j as usize] as usize] += 1;
            }
        }
        // Release inputs whose last use this was (once, even if used twice: `x * x`).
        for (k, &j) in ins.iter().enumerate() {
            if last[j as usize] as usize == i && !ins[..k].contains(&j) {
                self.release(c.root[j as usize] as usize);
            }
        }
        if training {
            self.let_go_unreached(i);
        }
        self.events.push(END);
        self.steps.push((i as u32, phase));
    }

    /// The output's gradient: the backward starts from it.
    fn seed(&mut self) {
        let n = self.c.len();
        let out = n - 1;
        if self.c.flags[out].requires_grad {
            self.grad_of[out] = Some((n + out) as u32);
            self.pins[n + out] = 1;
            self.events.push(ADD | out as u32);
        }
    }

    /// Runs node `i`'s backward, if a gradient reached it.
    fn backward(&mut self, i: usize) {
        let c = self.c;
        let n = c.len();
        let requires = |i: usize| c.flags[i].requires_grad;
        let Some(g) = self.grad_of[i] else {
            return;
        };
        if c.flags[i].leaf {
            return;
        }
        // A permuted gradient copied to be viewed as the op needs, before its kernels run
        // (in a view's backward of its own): the copy replaces the gradient.
        if c.flags[i].grad_copy {
            self.events.push(TRANSIENT | i as u32);
            self.events.push(RUN);
        }
        // A broadcast gradient's dense copy, made by the backward itself: it lives while the
        // backward runs, beside what it allocates.
        if c.flags[i].grad_dense {
            self.events.push(TRANSIENT | i as u32);
        }
        let facts = &c.nodes[i].facts;
        let ins = c.input_slice(i);
        for (k, &j) in ins.iter().enumerate() {
            let j = j as usize;
            // Only ops whose output requires a gradient get one: `argmax`, the comparisons and
            // the other ops outside autograd record outputs that require none.
            if !requires(j) {
                continue;
            }
            let target = c.param[j].map_or(j, |p| p as usize);
            let alias = facts.grad_alias.contains(k);
            if self.grad_of[target].is_some() {
                // A second contribution: computed, then added into the first.
                self.events.push(TRANSIENT | j as u32);
                // A leaf's contributions are summed before autograd adds them into `.grad`:
                // the sum is added with the last of them.
                if let Some(at) = self.grad_event[target] {
                    let event = std::mem::replace(&mut self.events[at], NOP);
                    self.grad_event[target] = Some(self.events.len());
                    self.events.push(event);
                }
                if std::mem::take(&mut self.held_view[target]) {
                    self.out_of_place.push(j as u32);
                }
                continue;
            }
            if c.flags[target].leaf {
                self.held_view[target] = alias || facts.grad_view.contains(k);
            }
            if alias {
                self.grad_of[target] = Some(g);
                self.pins[g as usize] += 1;
            } else {
                self.grad_of[target] = Some((n + target) as u32);
                self.pins[n + target] = 1;
                self.events.push(ADD | j as u32);
            }
            if c.flags[target].leaf {
                let k = self.grad_of[target].expect("set above") - n as u32;
                self.grad_event[target] = Some(self.events.len());
                self.events.push(GRAD | k);
                self.grads.push(k);
            }
        }
        let price = self.prices.get(i);
        if let Some(k) = self.add_entry(price.backward) {
            self.events.push(TRANSIENT | k);
        }
        self.stage(price, true);
        self.events.push(RUN);
        // The output gradient and what was saved for this op are released.
        self.release(g as usize);
        if requires(i) {
            self.release_saved(i);
        }
        // Once the backward returned (its input gradient and scratch space released), a
        // contribution summed out of place: the contribution and the sum live beside the
        // first, which is freed after.
        for j in std::mem::take(&mut self.out_of_place) {
            self.events.push(TRANSIENT | j);
            self.events.push(TRANSIENT | j);
            self.events.push(RUN);
        }
        self.events.push(END);
        self.steps.push((i as u32, Phase::Backward));
    }
}

impl Schedule {
    /// The plain schedule of `c` in `mode`, its kernel calls priced as `calibrated` says.
    pub(crate) fn build(c: &Compiled, mode: Mode, calibrated: &Calibrated) -> Schedule {
        let n = c.len();
        let training = mode == Mode::Backward;
        let prices = Prices::of(c, calibrated);
        let mut b = Builder::new(c, &prices, training);
        if training {
            b.hold_unreached(0..n, &c.last_use);
        }
        for i in 0..n {
            b.forward(i, training, &c.last_use, Phase::Forward);
        }
        if training {
            // Gradients flow from the output in reverse order.
            b.seed();
            for i in (0..n).rev() {
                b.backward(i);
            }
        }
        b.finish(training)
    }

    /// The schedule of a backward that recomputes: segment `k` is `starts[k]..starts[k + 1]`
    /// (the last runs to the end). Every segment but the last runs first without autograd,
    /// keeping only the values later segments read; then, from the last segment back, each runs
    /// again with autograd and its backward follows at once, from the gradients later
    /// segments sent to its values (`sum(value · gradient)`, whose gradient is that one).
    pub(crate) fn build_recompute(c: &Compiled, segments: &Segments, prices: &Prices) -> Schedule {
        let n = c.len();
        let count = segments.count();
        let held = &segments.held;
        let mut b = Builder::new(c, prices, true);
        for i in 0..segments.starts[count - 1] as usize {
            b.forward(i, false, held, Phase::Forward);
        }
        for s in (0..count).rev() {
            let range = segments.range(s, n);
            let phase = if s + 1 == count { Phase::Forward } else { Phase::Recompute };
            b.hold_unreached(range.clone(), held);
            for i in range.clone() {
                b.forward(i, true, held, phase);
            }
            if s + 1 == count {
                b.seed();
            } else {
                // `value · gradient`, one value at a time: a temporary of the value's size.
                for o in range.clone() {
                    if held[o] == HELD && b.grad_of[o].is_some() && !c.flags[o].leaf {
                        b.events.push(TRANSIENT | o as u32);
                        b.events.push(RUN);
                        b.events.push(END);
                        b.steps.push((o as u32, Phase::Recompute));
                    }
                }
            }
            // The segment's values read later are let go once their products are summed, before
            // the backward (autograd keeps what the segment's ops saved of them).
            for j in range.clone() {
                if held[j] == HELD && j + 1 < n {
                    b.release(c.root[j] as usize);
                }
            }
            b.let_go_all_unreached();
            for i in range.clone().rev() {
                b.backward(i);
            }
            // So are earlier segments' values whose first reader (the last to run again) this
            // segment was.
            for j in 0..range.start {
                if segments.first_reader[j] == s as u32 && !c.flags[j].leaf {
                    b.release(c.root[j] as usize);
                }
            }
        }
        b.finish(true)
    }

    /// The peak at micro-batch `b` (the accumulation step aside); records the steps when asked.
    pub(crate) fn eval(&self, b: u64, mut record: Option<&mut Vec<Step>>) -> Outcome {
        let table = &self.table;
        let (mut live, mut per) = (0u64, 0u64);
        let (mut transient, mut transient_per, mut allocated, mut during) = (0u64, 0u64, 0u64, 0u64);
        let mut best = Outcome { peak: 0, peak_step: 0, peak_per_sample: 0, accumulate: None, later: None, rest: None };
        let mut step = 0usize;
        // A later micro-batch accumulating in place: `.grad` is whole from its start, and each
        // leaf gradient is added into it and freed once its step ends (`done` of them so far).
        let grads: u64 = self.grads.iter().map(|&k| table[k as usize].at(b, self.block)).sum();
        let (mut done, mut arrived) = (0u64, 0u64);
        let mut later = (0u64, 0usize, 0u64);
        for &event in self.events.iter() {
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
                GRAD => arrived += bytes.at(b, self.block),
                NOP => {}
                RUN => {
                    // A step may run twice (a gradient's copy, then the op): its larger.
                    during = during.max(live + transient);
                    if during > best.peak {
                        best.peak = during;
                        best.peak_step = step;
                        best.peak_per_sample = per + transient_per;
                    }
                    let in_place = live.saturating_sub(done) + grads + transient;
                    if in_place > later.0 {
                        later = (in_place, step, per + transient_per);
                    }
                    transient = 0;
                    transient_per = 0;
                }
                _ => {
                    done += std::mem::take(&mut arrived);
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
            best.later = Some(later);
        }
        best
    }
}

/// One allocator call of a schedule ([`Schedule::requests`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Request {
    /// Table entry `entry` is allocated, at step `step`.
    Alloc { entry: u32, bytes: u64, step: usize },
    /// A live allocation of table entry `entry` is freed (or, where the schedule names a
    /// parameter's gradient by another use of the parameter, one of the same bytes).
    Free { entry: u32, bytes: u64 },
    /// Scratch space or a staging buffer while step `step` runs.
    Scratch { bytes: u64, step: usize },
    /// The kernels ran: the scratch since the last run is freed.
    Ran,
    /// Table entry `entry` is a leaf's gradient, complete once this step ends.
    Grad { entry: u32 },
    /// The step is over.
    Ended,
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
    /// A backward's peak, step and per-sample bytes in a micro-batch after the first when
    /// micro-batches accumulate into `.grad` in place: the whole `.grad` live throughout, and
    /// each gradient autograd computes live only until it is added in (as plain tch's
    /// accumulation). The first micro-batch is the plain schedule: autograd keeps the
    /// gradients it computed as `.grad`.
    pub(crate) later: Option<(u64, usize, u64)>,
    /// Where the micro-batch does not divide the batch, the smaller last micro-batch's figures
    /// (its remainder): kernels can take more at fewer samples (a convolution's algorithm).
    pub(crate) rest: Option<Rest>,
}

/// The smaller micro-batch that ends a split whose micro-batch does not divide the batch: its
/// plain peak and step, its peak accumulating in place (as [`Outcome::later`]), and whether it
/// is the only micro-batch after the first (the first is more than half the batch).
#[derive(Clone, Copy)]
pub(crate) struct Rest {
    peak: u64,
    step: usize,
    later: Option<(u64, usize, u64)>,
    only: bool,
}

impl Outcome {
    /// Peak, step and per-sample bytes when the accumulation allocates `new_grads` bytes of
    /// `.grad` that did not exist (tch's `zero_grad()` sets them to none). The first
    /// micro-batch creates them at its accumulation; when the batch is split (`!whole`), every
    /// later micro-batch runs with them live, its whole schedule that much higher.
    pub(crate) fn with(self, new_grads: u64, whole: bool) -> Outcome {
        match self.accumulate {
            Some((live, per, step)) if !whole && new_grads > 0 => match self.rest {
                None => Outcome { peak: self.peak + new_grads, ..self },
                // Later micro-batches of the full size and the remainder, all with them.
                Some(rest) if !rest.only => {
                    let o = Outcome { peak: self.peak + new_grads, ..self };
                    if rest.peak + new_grads > o.peak {
                        Outcome { peak: rest.peak + new_grads, peak_step: rest.step, peak_per_sample: 0, ..o }
                    } else {
                        o
                    }
                }
                // One smaller micro-batch follows: the first creates the gradients as it
                // accumulates, the remainder runs with them (batch 17 in micro-batches of 16 was
                // planned 12.8% over as if a second 16 ran so).
                Some(rest) => {
                    let mut o = self;
                    if live + new_grads > o.peak {
                        o = Outcome { peak: live + new_grads, peak_step: step, peak_per_sample: per, ..o };
                    }
                    if rest.peak + new_grads > o.peak {
                        // Set by the remainder, which shrinks as the micro-batch grows.
                        o = Outcome { peak: rest.peak + new_grads, peak_step: rest.step, peak_per_sample: 0, ..o };
                    }
                    o
                }
            },
            Some((live, per, step)) if live + new_grads > self.peak => {
                Outcome { peak: live + new_grads, peak_step: step, peak_per_sample: per, ..self }
            }
            _ => self,
        }
    }

    /// Micro-batches of a split accumulating into `.grad` in place: the larger of the first
    /// micro-batch and a later one.
    fn in_place(self, whole: bool) -> Outcome {
        match self.rest {
            // The remainder is the one micro-batch after the first.
            Some(Rest { later: Some((peak, step, _)), only: true, .. }) if !whole && peak > self.peak => {
                Outcome { peak, peak_step: step, peak_per_sample: 0, ..self }
            }
            Some(Rest { only: true, .. }) => self,
            // Later micro-batches of the full size, then the remainder.
            Some(rest) => {
                let o = Outcome { rest: None, ..self }.in_place(whole);
                match rest.later {
                    Some((peak, step, _)) if !whole && peak > o.peak => {
                        Outcome { peak, peak_step: step, peak_per_sample: 0, rest: Some(rest), ..o }
                    }
                    _ => Outcome { rest: Some(rest), ..o },
                }
            }
            None => match self.later {
                Some((peak, step, per)) if !whole && peak > self.peak => {
                    Outcome { peak, peak_step: step, peak_per_sample: per, ..self }
                }
                _ => self,
            },
        }
    }

    /// The exact outcome at micro-batch `b`, asking which gradients exist only when the answer
    /// changes the peak. See [`Compiled::accumulates_in_place`].
    pub(crate) fn resolve(self, c: &Compiled, b: u64) -> (Outcome, u64) {
        let whole = b >= c.batch.max(1) as u64;
        let (outcome, new_grads) = if c.accumulates_in_place() {
            (self.in_place(whole), 0)
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
        let outcome = if c.accumulates_in_place() {
            self.in_place(whole)
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
    /// The peak at micro-batch `b`, the accumulation step aside; where `b` does not divide
    /// the batch, with the smaller micro-batch that ends it ([`Outcome::rest`]).
    pub(crate) fn simulate(&self, b: u64) -> Outcome {
        let mut outcome = self.eval(b, None);
        let r = if b > 0 { self.batch % b } else { 0 };
        if self.training && b < self.batch && r > 0 {
            let rest = self.eval(r, None);
            let only = self.batch < 2 * b;
            outcome.rest = Some(Rest { peak: rest.peak, step: rest.peak_step, later: rest.later, only });
        }
        outcome
    }

    /// The peak at micro-batch `b` of a graph of `c`, the accumulation step included, as the
    /// search computes it.
    pub(crate) fn peak_at(&self, c: &Compiled, b: u64) -> u64 {
        self.simulate(b).resolve(c, b).0.peak
    }

    /// The allocator calls of the schedule at micro-batch `b`, in order, for a replay through
    /// the caching allocator's model ([`super::placement`]): bytes as asked (the allocator
    /// rounds), scratch and staging freed once their step has run.
    pub(crate) fn requests(&self, b: u64, mut call: impl FnMut(Request)) {
        let mut step = 0usize;
        for &event in self.events.iter() {
            let k = event & !KIND;
            let bytes = || self.table.get(k as usize).copied().unwrap_or_default().at(b, 1);
            match event & KIND {
                ADD => call(Request::Alloc { entry: k, bytes: bytes(), step }),
                FREE => call(Request::Free { entry: k, bytes: bytes() }),
                TRANSIENT => call(Request::Scratch { bytes: bytes(), step }),
                STAGE => call(Request::Scratch { bytes: self.staged[k as usize].at(b), step }),
                GRAD => call(Request::Grad { entry: k }),
                NOP => {}
                RUN => call(Request::Ran),
                _ => {
                    call(Request::Ended);
                    step += 1
                }
            }
        }
    }

    /// Whether the schedule runs a backward.
    pub(crate) fn training(&self) -> bool {
        self.training
    }

    /// The table entries of the leaves' gradients: what autograd leaves as `.grad`.
    pub(crate) fn grad_entries(&self) -> &[u32] {
        &self.grads
    }

    /// The bytes of table entry `k` at micro-batch `b`, as asked (unrounded).
    pub(crate) fn entry_bytes(&self, k: u32, b: u64) -> u64 {
        self.table.get(k as usize).copied().unwrap_or_default().at(b, 1)
    }

    /// The node and phase of a step number.
    pub(crate) fn step_node(&self, c: &Compiled, step: usize) -> (usize, Phase) {
        self.steps.get(step).map_or((c.len() - 1, Phase::Accumulate), |&(node, phase)| (node as usize, phase))
    }
}
