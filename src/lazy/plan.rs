//! The planner: the peak memory of a schedule of the forward (and backward) pass at a given
//! micro-batch, and the largest micro-batch whose peak fits the budget.
//!
//! # The memory model
//!
//! The schedule is the executor's: ops run in recording order (a topological order); the
//! executor drops each value after its last use. Each tensor costs its bytes rounded up to
//! 512 B (the CUDA caching allocator's block size); views cost nothing and keep their base
//! alive. Inputs and parameters are already in memory and cost nothing.
//!
//! In a backward plan, a tensor that autograd saves for an op's backward (what each op saves
//! is in [`ops`](super::ops)) lives until that op's backward has run, together with extras such
//! as max-pooling indices and dropout masks. The backward runs in reverse order: each op's
//! output gradient lives until its backward has run, and produces gradients for its inputs
//! (views of the output gradient where autograd makes them views); parameter gradients live
//! to the end, and parameters whose `.grad()` is not yet defined get one. Ops with scratch
//! space (im2col of a convolution, broadcast copies of a batched product) count it while they
//! run; on CUDA that is what [`scratch`](super::scratch) found libtorch's kernels take (the
//! reduction kernel's staging buffers, not linear in the micro-batch, and cuDNN's workspace).
//!
//! The peak is the largest sum over this schedule, not the sum of all tensors.

use std::borrow::Cow;
use std::cell::OnceCell;
use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasherDefault;
use std::rc::Rc;

use tch::{Device, Kind};

use super::cost::cuda::ReduceStaging;
use super::cost::{CostModel, Price, Work};
use super::error::LazyError;
use super::graph::{Bytes, Flow, LazyTensor, Node, ParamKey, Source};
use super::options::Options;

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

/// The graph of one output, compiled for planning and running: nodes in topological order
/// and everything about them that does not depend on the micro-batch size.
pub(crate) struct Compiled {
    pub(crate) nodes: Vec<Rc<Node>>,
    /// `inputs[offsets[i]..offsets[i + 1]]` are node `i`'s inputs, as positions.
    offsets: Vec<u32>,
    inputs: Vec<u32>,
    /// Position of each node's last consumer; `n` for the output (held to the end).
    pub(crate) last_use: Vec<u32>,
    /// Storage each node's value lives in (its own position, or its view base's).
    root: Vec<u32>,
    /// Per-node facts the schedules read often: the `F_*` bits.
    flags: Vec<u8>,
    /// For parameters that require a gradient: the position of the first leaf holding the
    /// same tensor (so that one parameter used twice has one gradient).
    pub(crate) param: Vec<Option<u32>>,
    /// First leaves of the parameters that receive a gradient, and their gradients' bytes.
    reached_params: Vec<u32>,
    param_grad_bytes: u64,
    /// Bytes of gradients that parameters without a `.grad()` will get: asking libtorch costs
    /// ~0.5 µs a parameter, so it is asked only when the answer can change the plan.
    undefined_grad_bytes: OnceCell<u64>,
    /// Whether a backward of the whole batch accumulates straight into `.grad`: see
    /// [`Compiled::accumulates_in_place`].
    in_place: OnceCell<bool>,
    /// Full batch size (1 when nothing is batched).
    pub(crate) batch: i64,
    /// How the device prices kernel calls, and the block its allocator counts in.
    model: CostModel,
    block: u64,
    pub(crate) fingerprint: u64,
    /// Sum-flow nodes that feed the output linearly (combined over micro-batches).
    pub(crate) global: Vec<bool>,
    /// The schedules of both modes, built when first asked for.
    schedules: [OnceCell<Schedule>; 2],
}

/// The node requires a gradient.
const F_REQUIRES_GRAD: u8 = 1;
/// Autograd keeps the node's output for its backward.
const F_SAVES_OUTPUT: u8 = 2;
/// An input or a fixed leaf (already in memory).
const F_LEAF: u8 = 4;
/// The op takes part in autograd.
const F_DIFFERENTIABLE: u8 = 8;
/// Gradients of inputs past the 64th are views of the output's.
const F_ALIAS_REST: u8 = 16;
/// The output is a new allocation (not a view, an input or a parameter).
const F_ALLOCATES: u8 = 32;

impl Compiled {
    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    pub(crate) fn inputs(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.inputs[self.offsets[i] as usize..self.offsets[i + 1] as usize].iter().map(|&j| j as usize)
    }

    fn input_slice(&self, i: usize) -> &[u32] {
        &self.inputs[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }

    pub(crate) fn output(&self) -> &Rc<Node> {
        self.nodes.last().expect("a graph has its output")
    }

    /// The device the computation runs on: the first input's, or the output's.
    pub(crate) fn device(&self) -> Device {
        device_of(&self.nodes)
    }

    /// The first op that mixes samples, if any.
    pub(crate) fn first_mixing(&self) -> Option<(usize, &Rc<Node>)> {
        self.nodes.iter().enumerate().find(|(_, n)| n.meta.mixes.is_some())
    }

    /// Bytes of the gradients parameters without a `.grad()` will get (asked once).
    fn undefined_grad_bytes(&self) -> u64 {
        *self.undefined_grad_bytes.get_or_init(|| {
            self.reached_params
                .iter()
                .map(|&i| &self.nodes[i as usize])
                .filter(|node| match node.op.source() {
                    // A non-leaf's gradient is summed in a buffer of toma's (see exec).
                    Some(Source::Leaf { tensor, param: Some(p) }) => !p.is_leaf || !tensor.grad().defined(),
                    _ => false,
                })
                .map(|node| Work::from(node.cost.grad).at(1, self.block))
                .sum()
        })
    }

    /// Whether one micro-batch of the whole batch can let autograd accumulate straight into
    /// `.grad`, with no second copy of the gradients: every parameter is a leaf without a
    /// gradient yet (the first step, or after `opt.zero_grad()`), and no input requires a
    /// gradient of its own. The executor does exactly this then, and the plan counts it so.
    pub(crate) fn accumulates_in_place(&self) -> bool {
        *self.in_place.get_or_init(|| {
            self.nodes.iter().enumerate().all(|(i, node)| match node.op.source() {
                Some(Source::Leaf { tensor, param: Some(_) }) => {
                    self.param[i].is_none_or(|first| first as usize != i)
                        || (tensor.is_leaf() && !tensor.grad().defined())
                }
                Some(Source::Input { tensor, .. }) => !tensor.requires_grad(),
                _ => true,
            })
        })
    }

    fn schedule(&self, mode: Mode) -> &Schedule {
        self.schedules[mode as usize].get_or_init(|| Schedule::build(self, mode))
    }
}

/// The device a graph runs on: its first input's, or its output's.
fn device_of(nodes: &[Rc<Node>]) -> Device {
    let output = nodes.last().expect("a graph has its output");
    nodes
        .iter()
        .find(|n| matches!(n.op.source(), Some(Source::Input { .. })))
        .map_or(output.meta.device, |n| n.meta.device)
}

/// Where the planner found each node of one traversal (1-based; 0: not yet), by id. Ids are
/// given in creation order, so a graph's ids mostly lie just below its output's: a dense table
/// there, a map for the rare node far older (a constant recorded long before).
struct Index {
    top: u64,
    near: Vec<u32>,
    far: HashMap<u64, u32, BuildHasherDefault<crate::hash::PassThrough>>,
}

impl Index {
    /// The dense table's largest span of ids (4 MiB of slots).
    const NEAR: usize = 1 << 20;

    fn new(top: u64) -> Self {
        Index { top, near: Vec::with_capacity(4096), far: HashMap::default() }
    }

    fn slot(&mut self, id: u64) -> &mut u32 {
        let offset = (self.top - id) as usize;
        if offset < Self::NEAR {
            if offset >= self.near.len() {
                self.near.resize((offset + 1).next_power_of_two().min(Self::NEAR), 0);
            }
            &mut self.near[offset]
        } else {
            // Mixed: the map's hasher passes keys through.
            self.far.entry(crate::hash::mix(id)).or_insert(0)
        }
    }
}

/// Collects the graph of `output` in topological order and precomputes what planning needs.
pub(crate) fn compile(output: &LazyTensor) -> Result<Compiled, LazyError> {
    // Depth-first collection; ids give the order (inputs are always created first). The
    // planner's own index says where each visited node was found.
    let mut index = Index::new(output.node.id);
    *index.slot(output.node.id) = 1;
    let mut seen: Vec<(u64, &Rc<Node>)> = vec![(output.node.id, &output.node)];
    let mut stack: Vec<&Rc<Node>> = vec![&output.node];
    while let Some(node) = stack.pop() {
        for input in &node.inputs {
            let slot = index.slot(input.id);
            if *slot == 0 {
                seen.push((input.id, input));
                *slot = seen.len() as u32;
                stack.push(input);
            }
        }
    }
    // Sorting by id gives the order; `position[k]` is where the node found `k`-th lands.
    let mut order: Vec<(u64, u32)> = seen.iter().enumerate().map(|(k, &(id, _))| (id, k as u32)).collect();
    order.sort_unstable_by_key(|&(id, _)| id);
    let mut position = vec![0u32; order.len()];
    for (pos, &(_, k)) in order.iter().enumerate() {
        position[k as usize] = pos as u32;
    }
    let mut pos = |node: &Node| position[*index.slot(node.id) as usize - 1];
    let found: Vec<Rc<Node>> = order.iter().map(|&(_, k)| seen[k as usize].1.clone()).collect();
    drop(seen);
    let n = found.len();
    let mut offsets = Vec::with_capacity(n + 1);
    let mut inputs = Vec::with_capacity(2 * n);
    let mut last_use = vec![0u32; n];
    let mut root = Vec::with_capacity(n);
    let mut flags = Vec::with_capacity(n);
    let mut param = vec![None; n];
    let mut batch: Option<i64> = None;
    let mut fingerprint = 0x6c61_7a79u64;
    let leaves = found.iter().filter(|x| x.inputs.is_empty()).count();
    let mut params_seen: HashMap<&ParamKey, u32, BuildHasherDefault<crate::hash::PassThrough>> =
        HashMap::with_capacity_and_hasher(leaves, BuildHasherDefault::default());
    for (i, node) in found.iter().enumerate() {
        offsets.push(inputs.len() as u32);
        for input in &node.inputs {
            let from = pos(input);
            last_use[from as usize] = i as u32;
            inputs.push(from);
        }
        root.push(if node.meta.alias { root[pos(&node.inputs[0]) as usize] } else { i as u32 });
        let cost = &node.cost;
        flags.push(
            (u8::from(cost.out != Bytes::default()) * F_ALLOCATES)
                | (u8::from(node.meta.requires_grad) * F_REQUIRES_GRAD)
                | (u8::from(node.meta.requires_grad && node.op.saves_output()) * F_SAVES_OUTPUT)
                | (u8::from(node.inputs.is_empty()) * F_LEAF)
                | (u8::from(node.op.differentiable()) * F_DIFFERENTIABLE)
                | (u8::from(cost.alias_rest) * F_ALIAS_REST),
        );
        fingerprint = crate::hash::mix(fingerprint ^ node.cost.hash);
        match node.op.source() {
            Some(Source::Input { .. }) => {
                let size = node.meta.batch().map_or(1, |bd| bd.size);
                match batch {
                    None => batch = Some(size),
                    Some(b) if b != size => {
                        return Err(LazyError::Batch {
                            op: "lazy".into(),
                            lhs: vec![b],
                            rhs: node.meta.shape.clone(),
                            reason: format!("inputs with batch sizes {b} and {size} meet in one graph"),
                        })
                    }
                    _ => {}
                }
            }
            Some(Source::Leaf { param: Some(p), .. }) => {
                param[i] = Some(*params_seen.entry(&p.key).or_insert(i as u32));
            }
            _ => {}
        }
    }
    offsets.push(inputs.len() as u32);
    last_use[n - 1] = n as u32;
    let edges = |i: usize| &inputs[offsets[i] as usize..offsets[i + 1] as usize];
    // Sum-flow nodes that reach the output only through linear ops are combined over
    // micro-batches; others (only with allow_batch_mixing) are per-micro-batch statistics.
    let mut global = vec![false; n];
    let mut consumers_global = vec![true; n];
    for i in (0..n).rev() {
        global[i] = found[i].meta.flow == Flow::Sum && consumers_global[i];
        for &j in edges(i) {
            consumers_global[j as usize] &= global[i];
        }
    }
    // Which parameters receive a gradient: the backward's reach, which the batch does not change.
    let mut reach = vec![false; n];
    reach[n - 1] = found[n - 1].meta.requires_grad;
    for i in (0..n).rev() {
        if !reach[i] || flags[i] & (F_LEAF | F_DIFFERENTIABLE) != F_DIFFERENTIABLE {
            continue;
        }
        for &j in edges(i) {
            let j = j as usize;
            if flags[j] & F_REQUIRES_GRAD != 0 {
                reach[param[j].map_or(j, |p| p as usize)] = true;
            }
        }
    }
    let reached_params: Vec<u32> =
        (0..n).filter(|&i| reach[i] && param[i] == Some(i as u32)).map(|i| i as u32).collect();
    let model = CostModel::of(device_of(&found));
    let block = model.block();
    let param_grad_bytes = reached_params.iter().map(|&i| Work::from(found[i as usize].cost.grad).at(1, block)).sum();
    let compiled = Compiled {
        nodes: found,
        offsets,
        inputs,
        last_use,
        root,
        flags,
        param,
        reached_params,
        param_grad_bytes,
        undefined_grad_bytes: OnceCell::new(),
        in_place: OnceCell::new(),
        batch: batch.unwrap_or(1),
        model,
        block,
        fingerprint,
        global,
        schedules: [OnceCell::new(), OnceCell::new()],
    };
    snapshot::write(&compiled);
    Ok(compiled)
}

/// `TOMA_PLAN_SNAPSHOT=<file>`: every compiled graph's schedules, appended to the file, to show
/// that a change to the planner's code leaves its plans byte-identical (DEVELOPERS.md).
mod snapshot {
    use std::io::Write;
    use std::sync::{Mutex, OnceLock};

    use super::{Compiled, Mode, Step};

    fn file() -> Option<&'static Mutex<std::fs::File>> {
        static FILE: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
        FILE.get_or_init(|| {
            let path = std::env::var_os("TOMA_PLAN_SNAPSHOT")?;
            let file = std::fs::OpenOptions::new().create(true).append(true).open(path).ok()?;
            Some(Mutex::new(file))
        })
        .as_ref()
    }

    /// One line per graph: its structure, then for both modes and several micro-batches the
    /// resolved peak and every step's bytes.
    pub(super) fn write(c: &Compiled) {
        let Some(file) = file() else { return };
        let mut line = String::new();
        for (i, node) in c.nodes.iter().enumerate() {
            let inputs: Vec<usize> = c.inputs(i).collect();
            line.push_str(&format!(
                "{}{:?}{:?}{:?}{:?}{:?};",
                node.op.name(),
                node.meta.shape,
                node.meta.kind,
                node.meta.device,
                node.meta.flow,
                inputs
            ));
        }
        let structure = crate::hash::hash_bytes(0, line.as_bytes());
        let n = c.batch.max(1) as u64;
        let mut sizes: Vec<u64> =
            [1, 2, 3, 4, 7, 8, 16, n / 2, n.saturating_sub(1), n].into_iter().filter(|&b| b >= 1 && b <= n).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut out = format!("{structure:016x} n={n} ops={}", c.len());
        for mode in [Mode::Forward, Mode::Backward] {
            for &b in &sizes {
                let mut steps: Vec<Step> = Vec::new();
                c.schedule(mode).eval(b, Some(&mut steps));
                let peak = super::peak_at(c, mode, b);
                let mut h = 0u64;
                for s in &steps {
                    h = crate::hash::mix(h ^ crate::hash::mix(s.node as u64 ^ (s.phase as u64) << 40));
                    h = crate::hash::mix(h ^ s.bytes);
                    h = crate::hash::mix(h ^ s.during);
                    h = crate::hash::mix(h ^ s.live);
                }
                out.push_str(&format!(" {mode:?}@{b}={peak}/{h:016x}"));
            }
        }
        out.push('\n');
        let mut f = file.lock().unwrap_or_else(|p| p.into_inner());
        let _ = f.write_all(out.as_bytes());
    }
}

/// One step of the schedule, as recorded for a plan's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Position of the op in [`Plan::ops`].
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

/// The schedule of one mode: which tensors are allocated and freed at each step. It does not
/// depend on the micro-batch size — only the bytes do — so it is built once and then
/// evaluated for each candidate size by a tight loop.
#[derive(Clone, Debug, Default)]
struct Schedule {
    /// Bytes the events refer to.
    table: Vec<Work>,
    /// Staging buffers, whose bytes are not linear in the micro-batch.
    staged: Vec<ReduceStaging>,
    /// Events: `ADD | k` (table entry `k` is allocated), `FREE | k`, `TRANSIENT | k`,
    /// `STAGE | k` (staging buffer `k`), `RUN`, `END`.
    events: Vec<u32>,
    /// Node and phase of each step.
    steps: Vec<(u32, Phase)>,
    training: bool,
    /// The block its device's allocator counts in.
    block: u64,
}

impl Schedule {
    // Positions index several arrays at once: a range loop says so best.
    #[allow(clippy::needless_range_loop)]
    fn build(c: &Compiled, mode: Mode) -> Schedule {
        let n = c.len();
        let training = mode == Mode::Backward;
        // The table: each value's bytes at `i` (its output's allocation, when it allocates, and
        // its gradient's), then extras and scratch space as they come.
        let mut table: Vec<Work> = c.nodes.iter().map(|x| x.cost.grad.into()).collect();
        let add_entry = |table: &mut Vec<Work>, bytes: Work| {
            (bytes != Work::default()).then(|| {
                table.push(bytes);
                (table.len() - 1) as u32
            })
        };
        // What each node's kernel calls take on this device.
        let mut calls = Vec::new();
        let prices: Vec<Price> = c.nodes.iter().map(|node| c.model.price(node, &mut calls)).collect();
        let mut staged: Vec<ReduceStaging> = Vec::new();
        // The staging buffers node `i` takes in one pass, as transient events.
        let stage = |staged: &mut Vec<ReduceStaging>, events: &mut Vec<u32>, i: usize, backward: bool| {
            for (_, s) in prices[i].staged.iter().filter(|(b, _)| *b == backward) {
                staged.push(s.clone());
                events.push(STAGE | (staged.len() - 1) as u32);
            }
        };
        let mut extra_at: Vec<Option<u32>> = vec![None; if training { n } else { 0 }];
        let mut events = Vec::with_capacity(6 * n);
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
                if let Some(k) = add_entry(&mut table, prices[i].kept) {
                    extra_at[i] = Some(k);
                    events.push(ADD | k);
                }
            }
            if let Some(k) = add_entry(&mut table, prices[i].forward) {
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
            let alias_mask = c.nodes[i].cost.grad_alias;
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
                } else if alias {
                    grad_of[target] = Some(g);
                    pins[g as usize] += 1;
                } else {
                    grad_of[target] = Some((n + target) as u32);
                    pins[n + target] = 1;
                    events.push(ADD | j as u32);
                }
            }
            if let Some(k) = add_entry(&mut table, prices[i].backward) {
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
            events.push(END);
            steps.push((i as u32, Phase::Backward));
        }
        Schedule { table, staged, events, steps, training, block: c.block }
    }

    /// The peak at micro-batch `b` (the accumulation step aside); records the steps when asked.
    fn eval(&self, b: u64, mut record: Option<&mut Vec<Step>>) -> Outcome {
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
                    during = live + transient;
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
struct Outcome {
    peak: u64,
    peak_step: usize,
    /// Per-sample bytes live at the peak (unrounded), for the scaling/fixed split.
    peak_per_sample: u64,
    /// Bytes live before the accumulation step, its per-sample part and its step number.
    accumulate: Option<(u64, u64, usize)>,
}

impl Outcome {
    /// Peak, step and per-sample bytes when the accumulation allocates `new_grads` bytes.
    fn with(self, new_grads: u64) -> Outcome {
        match self.accumulate {
            Some((live, per, step)) if live + new_grads > self.peak => {
                Outcome { peak: live + new_grads, peak_step: step, peak_per_sample: per, ..self }
            }
            _ => self,
        }
    }

    /// The exact outcome, asking which gradients exist only when the answer changes the peak.
    /// `whole`: the micro-batch is the whole batch (see [`Compiled::accumulates_in_place`]).
    fn resolve(self, c: &Compiled, whole: bool) -> (Outcome, u64) {
        if whole && c.accumulates_in_place() {
            return (self.with(0), 0);
        }
        let (low, high) = (self.with(0), self.with(c.param_grad_bytes));
        if low.peak == high.peak {
            return (high, c.param_grad_bytes);
        }
        let exact = c.undefined_grad_bytes();
        (self.with(exact), exact)
    }

    /// Whether the peak fits `budget`, asking which gradients exist only when needed.
    fn fits(self, c: &Compiled, budget: u64, whole: bool) -> (bool, Outcome) {
        if whole && c.accumulates_in_place() {
            let in_place = self.with(0);
            return (in_place.peak <= budget, in_place);
        }
        let high = self.with(c.param_grad_bytes);
        if high.peak <= budget {
            return (true, high);
        }
        let low = self.with(0);
        if low.peak > budget {
            return (false, low);
        }
        let exact = self.with(c.undefined_grad_bytes());
        (exact.peak <= budget, exact)
    }
}

/// Simulates the schedule at micro-batch `b`.
fn simulate(c: &Compiled, mode: Mode, b: u64) -> Outcome {
    c.schedule(mode).eval(b, None)
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
pub(crate) struct Choice {
    pub(crate) micro_batch: usize,
    pub(crate) peak: u64,
    pub(crate) full_peak: u64,
    /// The simulation at the chosen size, and the gradient bytes its accumulation step counts.
    outcome: Option<(Outcome, u64)>,
}

impl Choice {
    /// A choice made elsewhere (to ask `check_split` about another size).
    pub(crate) fn at(micro_batch: usize, like: &Choice) -> Choice {
        Choice { micro_batch, peak: like.peak, full_peak: like.full_peak, outcome: None }
    }
}

/// The largest micro-batch that fits: the whole batch when it does, else the largest power of
/// two whose peak fits (from two samples on, the peak never decreases with the micro-batch, so
/// a binary search; one sample, which may run another way, is tried last).
pub(crate) fn choose(
    c: &Compiled,
    mode: Mode,
    budget: u64,
    correction: f64,
    options: &Options,
) -> Result<Choice, LazyError> {
    let n = c.batch.max(1) as u64;
    // The budget the schedule at `b` is held to, less what measurement found the plan misses.
    let held = |b: u64| budget.saturating_sub((correction * b as f64).ceil() as u64);
    let full = simulate(c, mode, n);
    let full_resolved = full.resolve(c, true);
    let full_peak = full_resolved.0.peak;
    if let Some(forced) = options.micro_batch {
        let b = (forced.max(1) as u64).min(n);
        let resolved = simulate(c, mode, b).resolve(c, b == n);
        return Ok(Choice { micro_batch: b as usize, peak: resolved.0.peak, full_peak, outcome: Some(resolved) });
    }
    if full.fits(c, held(n), true).0 {
        return Ok(Choice { micro_batch: n as usize, peak: full_peak, full_peak, outcome: Some(full_resolved) });
    }
    // Exponents e with 2^e < n: find the largest that fits (1 is checked last, if at all).
    let (mut lo, mut hi) = (0u32, 63 - (n - 1).leading_zeros());
    let mut best = None;
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        let outcome = simulate(c, mode, 1 << mid);
        if outcome.fits(c, held(1 << mid), false).0 {
            lo = mid;
            best = Some(outcome);
        } else {
            hi = mid - 1;
        }
    }
    let best = match best {
        Some(outcome) => outcome,
        None => {
            let at_one = simulate(c, mode, 1);
            let (fits, seen) = at_one.fits(c, held(1), n == 1);
            if !fits {
                let (node, _) = step_node(c, mode, seen.peak_step);
                return Err(LazyError::DoesNotFit {
                    op: c.output().op.name().into(),
                    peak: seen.peak,
                    peak_node: node,
                    peak_op: c.nodes[node].op.name().into(),
                    budget,
                });
            }
            at_one
        }
    };
    let resolved = best.resolve(c, (1u64 << lo) == n);
    Ok(Choice { micro_batch: 1 << lo, peak: resolved.0.peak, full_peak, outcome: Some(resolved) })
}

/// The node and phase of a step number.
fn step_node(c: &Compiled, mode: Mode, step: usize) -> (usize, Phase) {
    c.schedule(mode).steps.get(step).map_or((c.len() - 1, Phase::Accumulate), |&(node, phase)| (node as usize, phase))
}

/// Refuses to split what cannot be split; `Ok` when splitting is not needed or is allowed.
pub(crate) fn check_split(
    c: &Compiled,
    mode: Mode,
    choice: &Choice,
    budget: u64,
    options: &Options,
) -> Result<(), LazyError> {
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

/// One op of a plan, at the micro-batch size.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOp {
    /// The op's name.
    pub name: Cow<'static, str>,
    /// Its output shape at the micro-batch size.
    pub shape: Vec<i64>,
    /// Its output kind.
    pub kind: Kind,
    /// Where the batch dimension is, if the value is per-sample.
    pub batch_dim: Option<usize>,
    /// Bytes its output allocates at the micro-batch size (0 for views, inputs, parameters).
    pub bytes: u64,
    /// Whether the output is a view of its first input.
    pub view: bool,
    /// Position of the op whose allocation the value lives in (its own, or a view's base).
    pub base: usize,
}

/// A memory plan: the micro-batch chosen for one output, the schedule's peak, and the
/// per-op table. Displays as a readable table.
#[derive(Clone, Debug)]
pub struct Plan {
    mode: Mode,
    batch_size: usize,
    micro_batch: usize,
    budget: u64,
    peak: u64,
    peak_step: usize,
    full_batch_peak: u64,
    per_sample_at_peak: u64,
    facts: Vec<OpFacts>,
    shapes: Vec<i64>,
    ops: OnceCell<Vec<PlanOp>>,
    /// The schedule, evaluated into steps when they are asked for.
    schedule: Schedule,
    new_grads: u64,
    steps: OnceCell<Vec<Step>>,
    last_use: Vec<u32>,
    /// Bytes per sample earlier runs of this graph measured above their plans (0: none did).
    correction: f64,
}

impl Plan {
    /// Forward only, or forward and backward.
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// The full batch size N.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }
    /// The micro-batch size: N when the whole batch fits, else a power of two.
    pub fn micro_batch(&self) -> usize {
        self.micro_batch
    }
    /// How many micro-batches cover the batch.
    pub fn chunks(&self) -> usize {
        self.batch_size.div_ceil(self.micro_batch.max(1))
    }
    /// Whether the batch is split.
    pub fn splits(&self) -> bool {
        self.micro_batch < self.batch_size
    }
    /// The memory budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }
    /// Bytes per sample an earlier run of this graph measured above its plan (on CUDA, or on
    /// the CPU with [`track_cpu_allocations`](crate::memory::track_cpu_allocations)): the
    /// micro-batch is chosen with that much more per sample held in reserve. 0 when no run
    /// measured more than planned.
    pub fn correction_bytes_per_sample(&self) -> u64 {
        self.correction.ceil() as u64
    }
    /// Peak bytes of the schedule at the micro-batch size.
    pub fn peak_bytes(&self) -> u64 {
        self.peak
    }
    /// Peak bytes the whole batch would need.
    pub fn full_batch_peak_bytes(&self) -> u64 {
        self.full_batch_peak
    }
    /// Bytes live at the peak that scale with the batch: per sample (the peak is about
    /// `per_sample_bytes() * micro_batch() + fixed_bytes()`).
    pub fn per_sample_bytes(&self) -> u64 {
        self.per_sample_at_peak
    }
    /// Bytes live at the peak that do not scale with the batch (parameter gradients,
    /// activations of fixed operands, rounding).
    pub fn fixed_bytes(&self) -> u64 {
        self.peak.saturating_sub(self.per_sample_at_peak * self.micro_batch as u64)
    }
    /// The step at the peak.
    pub fn peak_step(&self) -> &Step {
        &self.steps()[self.peak_step]
    }
    /// The op at the peak: its position, name and phase.
    pub fn peak_op(&self) -> (usize, &str, Phase) {
        let s = self.peak_step();
        (s.node, &self.ops()[s.node].name, s.phase)
    }
    /// The ops, in the order they run.
    pub fn ops(&self) -> &[PlanOp] {
        self.ops.get_or_init(|| {
            self.facts
                .iter()
                .map(|f| {
                    let name = Cow::Borrowed(f.name);
                    let start = f.shape_start as usize;
                    PlanOp {
                        name,
                        shape: self.shapes[start..start + f.shape_len as usize].to_vec(),
                        kind: f.kind,
                        batch_dim: f.batch_dim.map(|d| d as usize),
                        bytes: f.bytes,
                        view: f.view,
                        base: f.base as usize,
                    }
                })
                .collect()
        })
    }
    /// The schedule at the micro-batch size: forward steps (one per op), then backward steps
    /// and the gradient accumulation in a backward plan.
    pub fn steps(&self) -> &[Step] {
        self.steps.get_or_init(|| {
            let mut steps = Vec::with_capacity(self.schedule.steps.len() + 1);
            let raw = self.schedule.eval(self.micro_batch as u64, Some(&mut steps));
            if let Some((live, _, _)) = raw.accumulate {
                // Counted for all parameters that get a gradient unless that could change the
                // peak: then for those without a `.grad()` only.
                let during = live + self.new_grads;
                let node = self.facts.len() - 1;
                steps.push(Step {
                    node,
                    phase: Phase::Accumulate,
                    bytes: self.new_grads,
                    during,
                    live: self.new_grads,
                });
            }
            steps
        })
    }
    /// The plan as a picture: a self-contained SVG (no scripts, inline styles) of the bytes
    /// live during each step of the schedule at the chosen micro-batch, beside the same
    /// schedule at the whole batch (dashed) when the batch is split; the forward and backward
    /// passes shaded; the peak marked with its op; and the budget when it is within the
    /// picture's scale (else it is named in the title).
    ///
    /// Each series is a `<g data-series="..">`: `forward`, `backward`, `micro-batch`,
    /// `whole batch` (when split), `peak`, `budget` (when drawn).
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, Mode, Options};
    ///
    /// let w = Tensor::randn([64, 32], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let x = Tensor::randn([256, 64], (Kind::Float, Device::Cpu));
    /// let loss = lazy(&x, 0).matmul(&w).relu().sum(None);
    /// let plan = loss.plan(Mode::Backward, &Options::new().budget(64 << 10))?;
    /// let svg = plan.to_svg();
    /// assert!(svg.starts_with("<svg") && svg.contains("data-series=\"peak\""));
    /// // std::fs::write("plan.svg", svg)?;
    /// # Ok::<(), toma::lazy::LazyError>(())
    /// ```
    pub fn to_svg(&self) -> String {
        use crate::svg::{bytes, Chart, Unit};
        let steps = self.steps();
        let curve = |steps: &[Step]| -> Vec<(f64, f64)> {
            steps.iter().enumerate().map(|(k, s)| (k as f64, s.during as f64)).collect()
        };
        let micro = curve(steps);
        let whole = self.splits().then(|| {
            let mut full = Vec::with_capacity(self.schedule.steps.len());
            self.schedule.eval(self.batch_size as u64, Some(&mut full));
            curve(&full)
        });
        let top = micro.iter().chain(whole.iter().flatten()).fold(0.0f64, |m, &(_, y)| m.max(y));
        let budget_drawn = (self.budget as f64) <= 2.0 * top.max(1.0);
        let y_max = if budget_drawn { top.max(self.budget as f64) } else { top };
        let mode = match self.mode {
            Mode::Forward => "forward",
            Mode::Backward => "forward + backward",
        };
        let mut title = format!(
            "toma::lazy plan ({mode}): batch {} in {} micro-batch(es) of {}; peak {}",
            self.batch_size,
            self.chunks(),
            self.micro_batch,
            bytes(self.peak as f64)
        );
        if !budget_drawn {
            title.push_str(&format!(", budget {} (off scale)", bytes(self.budget as f64)));
        }
        let mut chart =
            Chart::new(&title, "schedule step (ops in the order they run)", micro.len() as f64, y_max, Unit::Bytes);
        let backward_from = steps.iter().position(|s| s.phase != Phase::Forward).unwrap_or(steps.len());
        chart.band("forward", 0.0, backward_from as f64, "#2a6fdb", "forward");
        if backward_from < steps.len() {
            chart.band("backward", backward_from as f64, steps.len() as f64, "#d9822b", "backward");
        }
        if let Some(whole) = &whole {
            let label = format!("whole batch of {} (peak {})", self.batch_size, bytes(self.full_batch_peak as f64));
            chart.steps("whole batch", &label, whole, "#888", true);
        }
        let label = format!("micro-batch of {}", self.micro_batch);
        chart.steps("micro-batch", &label, &micro, "#1f5fbf", false);
        if budget_drawn {
            chart.hline("budget", &format!("budget {}", bytes(self.budget as f64)), self.budget as f64, "#c0392b");
        }
        let peak = &steps[self.peak_step.min(steps.len().saturating_sub(1))];
        let phase = match peak.phase {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Accumulate => "accumulate",
        };
        let op = &self.ops()[peak.node].name;
        let label = format!("peak {} at #{} {op} ({phase})", bytes(self.peak as f64), peak.node);
        chart.marker("peak", self.peak_step as f64, peak.during as f64, &label, "#c0392b");
        chart.finish()
    }

    /// Positions of the values the executor holds after forward step `op` (its output, and
    /// earlier values still to be used), as the plan schedules them.
    pub fn held_after(&self, op: usize) -> Vec<usize> {
        (0..=op.min(self.facts.len().saturating_sub(1))).filter(|&j| self.last_use[j] as usize > op).collect()
    }
}

/// Plans `output` in `mode` under `options`.
pub(crate) fn plan(output: &LazyTensor, mode: Mode, options: &Options) -> Result<Plan, LazyError> {
    let c = compile(output)?;
    if mode == Mode::Backward && !output.node.meta.shape.is_empty() && output.numel() != 1 {
        return Err(LazyError::NotScalar { op: output.op_name().into(), shape: output.size() });
    }
    let (choice, budget) = decide(&c, mode, options)?;
    Ok(detail(c, mode, &choice, budget))
}

/// The budget, the micro-batch and the split check: what planning and running both decide.
/// A correction learned from earlier runs of the same graph (see [`verify`]) shrinks the
/// budget the schedule is held to.
pub(crate) fn decide(c: &Compiled, mode: Mode, options: &Options) -> Result<(Choice, u64), LazyError> {
    let budget = budget(options, c.device());
    let choice = choose(c, mode, budget, correction(c, mode), options)?;
    check_split(c, mode, &choice, budget, options)?;
    Ok((choice, budget))
}

/// The schedule's peak at micro-batch `b`, as [`choose`] computes it.
pub(crate) fn peak_at(c: &Compiled, mode: Mode, b: u64) -> u64 {
    let n = c.batch.max(1) as u64;
    simulate(c, mode, b).resolve(c, b == n).0.peak
}

/// Corrections learned by measuring runs: the most bytes per sample a micro-batch of a graph
/// (its fingerprint), mode and device measured above its plan. Bounded: starting over costs
/// one more measurement.
fn corrections() -> &'static std::sync::Mutex<HashMap<u64, f64>> {
    static CORRECTIONS: std::sync::OnceLock<std::sync::Mutex<HashMap<u64, f64>>> = std::sync::OnceLock::new();
    CORRECTIONS.get_or_init(Default::default)
}

fn correction_key(c: &Compiled, mode: Mode) -> u64 {
    let device = match c.device() {
        Device::Cuda(i) => i as u64 + 1,
        _ => 0,
    };
    crate::hash::mix(c.fingerprint ^ crate::hash::mix(device << 1 | mode as u64))
}

/// The bytes per sample this graph's plans add (0 until a run measured more than planned).
pub(crate) fn correction(c: &Compiled, mode: Mode) -> f64 {
    let map = corrections().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    map.get(&correction_key(c, mode)).copied().unwrap_or(0.0)
}

/// After a micro-batch of `b` samples: the allocator measured `measured` bytes above what was
/// in use when it started, where the plan said `planned`. A measurement more than 2% over the
/// plan raises the graph's correction to the excess per sample (what a hidden temporary of a
/// per-sample op costs), so that later plans of the graph hold; returns the new correction
/// when it changed.
pub(crate) fn verify(c: &Compiled, mode: Mode, b: u64, planned: u64, measured: u64) -> Option<f64> {
    if (measured as f64) <= planned as f64 * 1.02 {
        return None;
    }
    let per_sample = (measured - planned) as f64 / b.max(1) as f64;
    let mut map = corrections().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if map.len() >= 4096 {
        map.clear();
    }
    let slot = map.entry(correction_key(c, mode)).or_insert(0.0);
    (per_sample > *slot).then(|| {
        *slot = per_sample;
        per_sample
    })
}

/// Whether a micro-batch that runs out of memory may be halved. A choice that already splits
/// passed `check_split`, whose verdict does not depend on the size, so only a whole-batch
/// choice needs asking again.
pub(crate) fn splittable(c: &Compiled, mode: Mode, choice: &Choice, budget: u64, options: &Options) -> bool {
    c.batch > 1
        && ((choice.micro_batch as i64) < c.batch
            || check_split(c, mode, &Choice::at(1, choice), budget, options).is_ok())
}

/// The full plan (table included) for a choice.
pub(crate) fn detail(mut c: Compiled, mode: Mode, choice: &Choice, budget: u64) -> Plan {
    let b = choice.micro_batch as u64;
    let (outcome, new_grads) =
        choice.outcome.unwrap_or_else(|| simulate(&c, mode, b).resolve(&c, b == c.batch.max(1) as u64));
    // The per-op table is materialized only when asked for: planning copies flat facts.
    let mut shapes = Vec::with_capacity(2 * c.len());
    let mut facts = Vec::with_capacity(c.len());
    for (node, &root) in c.nodes.iter().zip(&c.root) {
        let start = shapes.len();
        shapes.extend_from_slice(&node.meta.shape);
        let batch = node.meta.batch();
        if let Some(bd) = batch {
            shapes[start + bd.dim] = b as i64 * bd.factor;
        }
        let name = node.op.name();
        facts.push(OpFacts {
            name,
            shape_start: start as u32,
            shape_len: node.meta.shape.len() as u32,
            bytes: Work::from(node.cost.out).at(b, c.block),
            base: root,
            batch_dim: batch.map(|bd| bd.dim as u32),
            kind: node.meta.kind,
            view: node.meta.alias,
        });
    }
    Plan {
        mode,
        batch_size: c.batch as usize,
        micro_batch: choice.micro_batch,
        budget,
        peak: outcome.peak,
        peak_step: outcome.peak_step,
        full_batch_peak: choice.full_peak,
        per_sample_at_peak: outcome.peak_per_sample,
        facts,
        shapes,
        ops: OnceCell::new(),
        schedule: c.schedules[mode as usize].take().unwrap_or_default(),
        new_grads,
        steps: OnceCell::new(),
        last_use: std::mem::take(&mut c.last_use),
        correction: correction(&c, mode),
    }
}

/// What a plan keeps of each op until its table is asked for (compact: a large graph's plan
/// is built often and read rarely).
#[derive(Clone, Debug)]
struct OpFacts {
    /// The op's name (custom ops' names are interned: static too).
    name: &'static str,
    shape_start: u32,
    shape_len: u32,
    bytes: u64,
    base: u32,
    batch_dim: Option<u32>,
    kind: Kind,
    view: bool,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (peak_node, peak_name, peak_phase) = self.peak_op();
        let mode = match self.mode {
            Mode::Forward => "forward",
            Mode::Backward => "forward + backward",
        };
        writeln!(
            f,
            "toma::lazy plan ({mode}): batch {} -> micro-batch {} x {} chunk(s); peak {} at #{peak_node} {peak_name} ({}); \
             budget {}; whole batch would peak at {}",
            self.batch_size,
            self.micro_batch,
            self.chunks(),
            crate::svg::bytes(self.peak as f64),
            match peak_phase {
                Phase::Forward => "forward",
                Phase::Backward => "backward",
                Phase::Accumulate => "gradient accumulation",
            },
            crate::svg::bytes(self.budget as f64),
            crate::svg::bytes(self.full_batch_peak as f64),
        )?;
        if self.correction > 0.0 {
            writeln!(
                f,
                "verified: an earlier run of this graph measured {} per sample above its plan; held in reserve: {}",
                crate::svg::bytes(self.correction.ceil()),
                crate::svg::bytes((self.correction * self.micro_batch as f64).ceil())
            )?;
        }
        writeln!(
            f,
            "peak = {} per sample x {} + {} fixed",
            crate::svg::bytes(self.per_sample_at_peak as f64),
            self.micro_batch,
            crate::svg::bytes(self.fixed_bytes() as f64)
        )?;
        writeln!(
            f,
            "{:>5}  {:<9} {:<26} {:<24} {:>10} {:>10} {:>10}",
            "#", "phase", "op", "shape", "bytes", "peak", "live"
        )?;
        for (k, s) in self.steps().iter().enumerate() {
            let op = &self.ops()[s.node];
            let phase = match s.phase {
                Phase::Forward => "fwd",
                Phase::Backward => "bwd",
                Phase::Accumulate => "acc",
            };
            let mut name = op.name.to_string();
            if op.view {
                name.push_str(" (view)");
            }
            if let Some(d) = op.batch_dim {
                name.push_str(&format!(" [b@{d}]"));
            }
            let marker = if k == self.peak_step { "  <- peak" } else { "" };
            let shape = format!("{:?}", op.shape);
            let (node, name) = if s.phase == Phase::Accumulate {
                (String::new(), "grad += micro-batch".to_string())
            } else {
                (s.node.to_string(), name)
            };
            writeln!(
                f,
                "{node:>5}  {phase:<9} {name:<26} {shape:<24} {:>10} {:>10} {:>10}{marker}",
                crate::svg::bytes(s.bytes as f64),
                crate::svg::bytes(s.during as f64),
                crate::svg::bytes(s.live as f64)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Index;

    #[test]
    fn the_index_keeps_near_and_far_ids_apart() {
        let top = 10 * Index::NEAR as u64;
        let mut index = Index::new(top);
        let ids = [top, top - 1, top - 4096, top - Index::NEAR as u64 + 1, top - Index::NEAR as u64, 3, 2];
        for (k, &id) in ids.iter().enumerate() {
            assert_eq!(*index.slot(id), 0, "id {id} starts unvisited");
            *index.slot(id) = k as u32 + 1;
        }
        for (k, &id) in ids.iter().enumerate() {
            assert_eq!(*index.slot(id), k as u32 + 1, "id {id}");
        }
        assert_eq!(index.far.len(), 3, "ids past the dense span go to the map");
        assert!(index.near.len() <= Index::NEAR);
    }
}
