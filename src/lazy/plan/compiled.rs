//! A graph compiled for planning and running: its nodes in topological order, and everything
//! about them that does not depend on the micro-batch.

use std::cell::OnceCell;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::rc::Rc;

use tch::Device;

use crate::dims::Dims;
use crate::lazy::cost::{CostModel, Work};
use crate::lazy::error::LazyError;
use crate::lazy::graph::{Flow, LazyTensor, Node, ParamKey, Source};
use crate::lazy::shape;
use crate::lazy::size::Bytes;

/// The graph of one output, compiled for planning and running: nodes in topological order
/// and everything about them that does not depend on the micro-batch size (its [`Form`],
/// shared with earlier graphs of the same form).
pub(crate) struct Compiled {
    pub(crate) nodes: Vec<Rc<Node>>,
    form: Rc<Form>,
    /// Bytes of gradients that parameters without a `.grad()` will get: asking libtorch costs
    /// ~0.5 µs a parameter, so it is asked only when the answer can change the plan.
    pub(super) undefined_grad_bytes: OnceCell<u64>,
    /// Whether a backward of the whole batch accumulates straight into `.grad`: see
    /// [`Compiled::accumulates_in_place`].
    pub(super) in_place: OnceCell<bool>,
}

/// What a graph's compiled form holds besides its nodes: how they connect and what planning
/// reads of them, none of it a tensor. A training loop records the same graph every step; its
/// form is worked out once and found again (see [`compile`]).
#[derive(Clone)]
pub(crate) struct Form {
    /// `inputs[offsets[i]..offsets[i + 1]]` are node `i`'s inputs, as positions.
    pub(super) offsets: Vec<u32>,
    pub(super) inputs: Vec<u32>,
    /// Position of each node's last consumer; `n` for the output (held to the end).
    pub(crate) last_use: Vec<u32>,
    /// Storage each node's value lives in (its own position, or its view base's).
    pub(super) root: Vec<u32>,
    /// Per-node facts the schedules read often.
    pub(super) flags: Vec<Flags>,
    /// For parameters that require a gradient: the position of the first leaf holding the
    /// same tensor (so that one parameter used twice has one gradient).
    pub(crate) param: Vec<Option<u32>>,
    /// First leaves of the parameters that receive a gradient, and their gradients' bytes.
    pub(super) reached_params: Vec<u32>,
    pub(super) param_grad_bytes: u64,
    /// Full batch size (1 when nothing is batched).
    pub(crate) batch: i64,
    /// How the device prices kernel calls, and the block its allocator counts in.
    pub(super) model: CostModel,
    pub(super) block: u64,
    pub(crate) fingerprint: u64,
    /// The fingerprint with what else a plan reads of the graph: how nodes connect, where the
    /// batch flows, what each op declared, which tensor each parameter is. Two graphs that
    /// share it plan alike (the key of the last plan reused, `plan::decide`).
    pub(crate) structure: u64,
    /// Sum-flow nodes that feed the output linearly (combined over micro-batches).
    pub(crate) global: Vec<bool>,
    /// What tells a graph of this form ([`Form::gather`]): the consumer and input slot each
    /// node is first reached through, and what each node is beyond its edges.
    via: Vec<(u32, u32)>,
    kinds: Vec<NodeForm>,
}

/// What a node is to its graph's form, beyond how it connects: its op, output and layout (its
/// price's hash), what its op declared, how the batch flows through it, whether it is a view,
/// its device, and which tensor a parameter is, in one word. Hashed, as the key a plan is
/// reused by ([`Form::structure`]) is: the words of the form found again are read, not the
/// whole of each node's form (a fifth of a kilobyte, cold by the next step), which were most
/// of the cache misses of finding a step's form (callgrind's cache model, min-gpt tiny).
#[derive(Clone, Copy, Debug, PartialEq)]
struct NodeForm(u64);

impl NodeForm {
    fn of(node: &Node) -> NodeForm {
        use crate::hash::mix;
        let meta = &node.meta;
        let flow = match meta.flow {
            Flow::PerSample(bd) => crate::hash::weigh(&[5, bd.dim as u64, bd.size as u64, bd.factor as u64]),
            Flow::Fixed => 1,
            Flow::Sum => 2,
            Flow::Max => 3,
            Flow::Opaque => 4,
        };
        let device = match meta.device {
            Device::Cpu => 0,
            Device::Cuda(i) => 4 + i as u64,
            Device::Mps => 1,
            Device::Vulkan => 2,
        };
        let place = device ^ u64::from(meta.alias) << 48;
        let param = param_key(node).map_or(0, ParamKey::word);
        NodeForm(mix(crate::hash::weigh(&[node.cost.hash, node.facts.fingerprint(), flow, place, param])))
    }

    fn matches(&self, node: &Node) -> bool {
        *self == NodeForm::of(node)
    }
}

fn param_key(node: &Node) -> Option<&ParamKey> {
    match node.source() {
        Some(Source::Leaf { param: Some(p), .. }) => Some(&p.key),
        _ => None,
    }
}

impl std::ops::Deref for Compiled {
    type Target = Form;

    fn deref(&self) -> &Form {
        &self.form
    }
}

/// Per-node facts the schedules read often, worked out when the graph is compiled.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Flags {
    /// The node requires a gradient.
    pub(super) requires_grad: bool,
    /// Autograd keeps the node's output for its backward.
    pub(super) saves_output: bool,
    /// An input or a fixed leaf (already in memory).
    pub(super) leaf: bool,
    /// The output is a new allocation (not a view, an input or a parameter).
    pub(super) allocates: bool,
    /// The backward copies the output's gradient: it arrives permuted (through a transpose
    /// downstream) and the op views it in a shape those strides do not allow.
    pub(super) grad_copy: bool,
    /// The backward reads the output's gradient densely and it arrives broadcast (below a
    /// `sum`), or contiguous and it arrives permuted (a convolution read as tokens): a copy
    /// lives while the backward runs.
    pub(super) grad_dense: bool,
    /// The backward reaches the node: a gradient arrives at it. A node that requires one and
    /// is not reached (a target network's forward before its `detach`) keeps what autograd
    /// saved only as long as eager autograd's graph holds it.
    pub(super) reached: bool,
}

impl Form {
    pub(crate) fn inputs(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.input_slice(i).iter().map(|&j| j as usize)
    }

    pub(super) fn input_slice(&self, i: usize) -> &[u32] {
        &self.inputs[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }

    /// The nodes of `output`'s graph in this form's order, when the graph has this form: as
    /// many nodes, each input the node the form has there, each node the same ([`NodeForm`]),
    /// and the order theirs by creation (what sorting them would give). `None` at the first
    /// difference.
    fn gather(self: &Rc<Form>, output: &Rc<Node>) -> Option<Compiled> {
        let n = self.via.len();
        // From the output down, each node through a consumer gathered before it (a consumer
        // comes later in the order): `rev[n - 1 - i]` is node `i`.
        // Each node is compared as it is reached: another graph is told apart at once.
        let same =
            |i: usize, node: &Node| node.inputs.len() == self.input_slice(i).len() && self.kinds[i].matches(node);
        if !same(n - 1, output) {
            return None;
        }
        let mut rev: Vec<Rc<Node>> = Vec::with_capacity(n);
        rev.push(output.clone());
        for i in (0..n - 1).rev() {
            let (consumer, slot) = self.via[i];
            let node = rev[n - 1 - consumer as usize].inputs[slot as usize].resolved();
            if node.id >= rev.last().expect("the output at least").id || !same(i, node) {
                return None;
            }
            rev.push(node.clone());
        }
        rev.reverse();
        for (i, node) in rev.iter().enumerate() {
            if node
                .inputs
                .iter()
                .zip(self.input_slice(i))
                .any(|(input, &j)| !Rc::ptr_eq(input.resolved(), &rev[j as usize]))
            {
                return None;
            }
        }
        Some(Compiled {
            nodes: rev,
            form: self.clone(),
            undefined_grad_bytes: OnceCell::new(),
            in_place: OnceCell::new(),
        })
    }
}

/// Forms kept per thread, the latest found first: enough for the graphs one loop alternates
/// between (a GAN's two steps, training and evaluation).
const FORMS_KEPT: usize = 4;

/// Nodes the kept forms may hold together (a form holds ~300 bytes a node): beyond it, only
/// the latest is kept.
const FORM_NODES_KEPT: usize = 1 << 16;

thread_local! {
    static FORMS: std::cell::RefCell<Vec<Rc<Form>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Keeps `form` first among the thread's forms (found again or new).
fn keep_first(form: &Rc<Form>) {
    FORMS.with(|forms| kept_first(&mut forms.borrow_mut(), form, FORMS_KEPT, FORM_NODES_KEPT));
}

/// Puts `form` first in `forms`, the others after it as long as they are at most `most` forms
/// holding at most `nodes` nodes together. The first is kept whatever its size.
fn kept_first(forms: &mut Vec<Rc<Form>>, form: &Rc<Form>, most: usize, nodes: usize) {
    forms.retain(|kept| !Rc::ptr_eq(kept, form));
    forms.insert(0, form.clone());
    let mut held = 0;
    let fits = forms
        .iter()
        .take(most)
        .take_while(|kept| {
            held += kept.via.len();
            held <= nodes
        })
        .count();
    forms.truncate(fits.max(1));
}

impl Compiled {
    /// The graph priced for a CUDA card of `gpu` (multiprocessors, threads each) instead of its
    /// own device: a described card ([`Options::card`](crate::lazy::Options::card)). Its
    /// structure changes with it, so that no plan of the graph on its device is taken for it.
    pub(crate) fn for_cuda(self, gpu: (u32, u32)) -> Compiled {
        let model = CostModel::Cuda(crate::lazy::cost::cuda::Cuda { gpu });
        let block = model.block();
        let mut form = (*self.form).clone();
        form.param_grad_bytes = param_grad_bytes(&self.nodes, &form.reached_params, form.batch, block);
        let salt = (u64::from(gpu.0) << 32 | u64::from(gpu.1)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        form.structure ^= salt;
        form.fingerprint ^= salt;
        form.model = model;
        form.block = block;
        Compiled {
            nodes: self.nodes,
            form: Rc::new(form),
            undefined_grad_bytes: OnceCell::new(),
            in_place: OnceCell::new(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Everything of the compiled graph in words: its nodes (by id) and all of its form.
    #[cfg(debug_assertions)]
    fn summary(&self) -> String {
        let ids: Vec<u64> = self.nodes.iter().map(|n| n.id).collect();
        let lists = (&self.offsets, &self.inputs, &self.last_use, &self.root, &self.reached_params, &self.flags);
        let figures = (self.batch, self.param_grad_bytes, self.block, self.fingerprint, self.structure);
        format!("{ids:?} {lists:?} {:?} {:?} {figures:?} {:?}", self.param, self.global, (&self.via, &self.kinds))
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
    pub(super) fn undefined_grad_bytes(&self) -> u64 {
        *self.undefined_grad_bytes.get_or_init(|| self.new_grads(true, self.block).sum())
    }

    /// The bytes of each gradient the accumulation step creates, in `block`s: those of the
    /// parameters (and inputs) without a `.grad()` yet where `undefined_only`, else all.
    pub(super) fn new_grads(&self, undefined_only: bool, block: u64) -> impl Iterator<Item = u64> + '_ {
        let whole = self.batch.max(1) as u64;
        let params = self
            .reached_params
            .iter()
            .map(|&i| &self.nodes[i as usize])
            .filter(move |node| match node.source() {
                // A non-leaf's gradient is summed in a buffer of toma's (see exec).
                Some(Source::Leaf { tensor, param: Some(p), .. }) => {
                    !undefined_only || !p.is_leaf || !crate::memory::grad_defined(tensor)
                }
                _ => false,
            })
            .map(move |node| Work::from(node.cost.grad).at(1, block));
        let inputs = input_grads(&self.nodes)
            .filter(move |node| match node.source() {
                Some(Source::Input { tensor, .. }) => {
                    !undefined_only || !tensor.is_leaf() || !crate::memory::grad_defined(tensor)
                }
                _ => false,
            })
            .map(move |node| Work::from(node.cost.grad).at(whole, block));
        params.chain(inputs)
    }

    /// The bytes of each tensor the graph starts from (parameters, buffers, inputs and
    /// constants), once per tensor: what a card holds before the step, beside it.
    pub(super) fn leaf_bytes(&self) -> Vec<u64> {
        let mut seen = std::collections::HashSet::new();
        self.nodes
            .iter()
            .filter_map(|node| {
                let tensor = match node.source() {
                    Some(Source::Leaf { tensor, .. } | Source::Input { tensor, .. }) => tensor,
                    _ => return None,
                };
                let bytes =
                    crate::lazy::shape::numel(&node.meta.shape) as u64 * node.meta.kind.elt_size_in_bytes() as u64;
                seen.insert(tensor.data_ptr() as usize).then_some(bytes)
            })
            .filter(|&bytes| bytes > 0)
            .collect()
    }

    /// A per-sample output evaluated in micro-batches of `b`: the bytes of earlier micro-batches'
    /// outputs a later one runs with (and, for a view, its copy), and the concatenation's peak
    /// (the parts and the whole output). `None` unsplit, or for a value that is not per-sample.
    pub(crate) fn output_parts(&self, b: u64) -> Option<(u64, u64)> {
        let n = self.batch.max(1) as u64;
        let out = self.output();
        if b >= n || out.meta.batch().is_none() {
            return None;
        }
        let bytes = Work::from(out.cost.grad);
        let held = bytes.per * (n - b) + if out.meta.alias { bytes.at(b, self.block) } else { 0 };
        Some((held, 2 * bytes.at(n, self.block)))
    }

    /// Whether every micro-batch can let autograd accumulate straight into `.grad`, with no
    /// second copy of the gradients: every parameter is a leaf without a gradient yet (the first
    /// step, or after `opt.zero_grad()`), and no input requires a gradient of its own. Nothing is
    /// lost when a micro-batch fails: the step starts again from none. The executor does
    /// exactly this then, and the plan counts it so. Otherwise each micro-batch's gradients
    /// are computed apart and added once its backward is complete, so that a failed one leaves
    /// the earlier gradients in `.grad` as they were.
    pub(crate) fn accumulates_in_place(&self) -> bool {
        *self.in_place.get_or_init(|| {
            self.nodes.iter().enumerate().all(|(i, node)| match node.source() {
                Some(Source::Leaf { tensor, param: Some(p), .. }) => {
                    self.param[i].is_none_or(|first| first as usize != i)
                        || (p.is_leaf && !crate::memory::grad_defined(tensor))
                }
                // As recorded: the plan read the same.
                Some(Source::Input { .. }) => !node.meta.requires_grad,
                _ => true,
            })
        })
    }
}

/// The device a graph runs on: its first input's, or its output's.
fn device_of(nodes: &[Rc<Node>]) -> Device {
    let output = nodes.last().expect("a graph has its output");
    nodes
        .iter()
        .find(|n| matches!(n.source(), Some(Source::Input { .. })))
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
        Index { top, near: Vec::with_capacity(128), far: HashMap::default() }
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

/// The inputs that require their own gradient (the executor fills theirs, see exec).
/// The bytes of every gradient a backward gives `.grad` (the reached parameters', and inputs'
/// that require one), in `block`s.
fn param_grad_bytes(nodes: &[Rc<Node>], reached_params: &[u32], batch: i64, block: u64) -> u64 {
    // An input that requires its gradient gets one of the whole batch's size, created by the
    // first micro-batch and held through the others, as a parameter's is.
    let whole = batch.max(1) as u64;
    reached_params.iter().map(|&i| Work::from(nodes[i as usize].cost.grad).at(1, block)).sum::<u64>()
        + input_grads(nodes).map(|node| Work::from(node.cost.grad).at(whole, block)).sum::<u64>()
}

fn input_grads(nodes: &[Rc<Node>]) -> impl Iterator<Item = &Rc<Node>> {
    nodes.iter().filter(|node| matches!(node.source(), Some(Source::Input { .. })) && node.meta.requires_grad)
}

/// Collects the graph of `output` in topological order and precomputes what planning needs.
/// A graph of a form compiled recently on this thread (a training step recorded again) takes
/// that form as it is, once checked node by node: the search for its nodes, their sorting and
/// everything worked out from them are not done again.
pub(crate) fn compile(output: &LazyTensor) -> Result<Compiled, LazyError> {
    let found = FORMS
        .with(|forms| forms.borrow().iter().enumerate().find_map(|(k, form)| Some((k, form.gather(output.node())?))));
    if let Some((k, c)) = found {
        // Unoptimised builds (the test suites) check every form found against compiling anew.
        #[cfg(debug_assertions)]
        assert_eq!(c.summary(), compile_anew(output)?.summary(), "a form found differs from compiling anew");
        if k > 0 {
            keep_first(&c.form);
        }
        return Ok(c);
    }
    let c = compile_anew(output)?;
    keep_first(&c.form);
    Ok(c)
}

fn compile_anew(output: &LazyTensor) -> Result<Compiled, LazyError> {
    // Depth-first collection; ids give the order (inputs are always created first). The
    // planner's own index says where each visited node was found.
    let mut index = Index::new(output.node().id);
    *index.slot(output.node().id) = 1;
    // Sized for a typical step's graph: growing them would allocate four times each.
    let mut seen: Vec<(u64, &Rc<Node>)> = Vec::with_capacity(64);
    seen.push((output.node().id, output.node()));
    let mut stack: Vec<&Rc<Node>> = Vec::with_capacity(32);
    stack.push(output.node());
    while let Some(node) = stack.pop() {
        for input in &node.inputs {
            let input = input.resolved();
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
    let mut starts = Vec::new();
    let mut param = vec![None; n];
    let mut batch: Option<i64> = None;
    let mut fingerprint = 0x6c61_7a79u64;
    let mut structure = 0u64;
    let leaves = found.iter().filter(|x| x.inputs.is_empty()).count();
    let mut params_seen: HashMap<&ParamKey, u32, BuildHasherDefault<crate::hash::PassThrough>> =
        HashMap::with_capacity_and_hasher(leaves, BuildHasherDefault::default());
    for (i, node) in found.iter().enumerate() {
        offsets.push(inputs.len() as u32);
        for input in &node.inputs {
            let from = pos(input.resolved());
            last_use[from as usize] = i as u32;
            inputs.push(from);
            structure = crate::hash::mix(structure ^ u64::from(from));
        }
        let batch_at = node.meta.batch().map_or(0, |bd| (bd.dim as u64 + 1) << 40 ^ bd.factor as u64);
        structure = crate::hash::mix(structure ^ node.facts.fingerprint() ^ batch_at);
        root.push(if node.meta.alias { root[pos(node.inputs[0].resolved()) as usize] } else { i as u32 });
        let cost = &node.cost;
        flags.push(Flags {
            requires_grad: node.meta.requires_grad,
            saves_output: node.facts.saves_output,
            leaf: node.inputs.is_empty(),
            allocates: cost.out != Bytes::default(),
            grad_copy: false,
            grad_dense: false,
            reached: false,
        });
        if cost.permutes || broadcasts_grad(node) {
            starts.push(i as u32);
        }
        fingerprint = crate::hash::mix(fingerprint ^ node.cost.hash);
        match node.source() {
            Some(Source::Input { .. }) => {
                let size = node.meta.batch().map_or(1, |bd| bd.size);
                if size == 0 {
                    let dim = node.meta.batch().map_or(0, |bd| bd.dim);
                    return Err(LazyError::EmptyBatch { shape: node.meta.shape.to_vec(), dim });
                }
                match batch {
                    None => batch = Some(size),
                    Some(b) if b != size => {
                        return Err(LazyError::Batch {
                            op: "lazy".into(),
                            lhs: vec![b],
                            rhs: node.meta.shape.to_vec(),
                            reason: format!("inputs with batch sizes {b} and {size} meet in one graph"),
                        })
                    }
                    _ => {}
                }
            }
            Some(Source::Leaf { param: Some(p), .. }) => {
                structure = crate::hash::mix(structure ^ crate::hash::hash_of(&p.key));
                param[i] = Some(*params_seen.entry(&p.key).or_insert(i as u32));
            }
            _ => {}
        }
    }
    offsets.push(inputs.len() as u32);
    last_use[n - 1] = n as u32;
    let edges = |i: usize| &inputs[offsets[i] as usize..offsets[i + 1] as usize];
    grad_copies(&found, &inputs, &offsets, &mut flags, &starts);
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
    let mut reach = consumers_global;
    reach.fill(false);
    reach[n - 1] = found[n - 1].meta.requires_grad;
    for i in (0..n).rev() {
        if !reach[i] || flags[i].leaf {
            continue;
        }
        for &j in edges(i) {
            let j = j as usize;
            if flags[j].requires_grad {
                reach[param[j].map_or(j, |p| p as usize)] = true;
            }
        }
    }
    for (flags, &reach) in flags.iter_mut().zip(&reach) {
        flags.reached = reach;
    }
    let mut reached_params: Vec<u32> = Vec::with_capacity(params_seen.len());
    reached_params.extend((0..n).filter(|&i| reach[i] && param[i] == Some(i as u32)).map(|i| i as u32));
    let model = CostModel::of(device_of(&found));
    let block = model.block();
    let param_grad_bytes = param_grad_bytes(&found, &reached_params, batch.unwrap_or(1), block);
    let mut via = vec![(u32::MAX, 0); n];
    for i in 0..n {
        for (slot, &j) in edges(i).iter().enumerate() {
            if via[j as usize].0 == u32::MAX {
                via[j as usize] = (i as u32, slot as u32);
            }
        }
    }
    let form = Form {
        kinds: found.iter().map(|node| NodeForm::of(node)).collect(),
        via,
        offsets,
        inputs,
        last_use,
        root,
        flags,
        param,
        reached_params,
        param_grad_bytes,
        batch: batch.unwrap_or(1),
        model,
        block,
        structure: crate::hash::mix(structure ^ fingerprint),
        fingerprint,
        global,
    };
    Ok(Compiled { nodes: found, form: Rc::new(form), undefined_grad_bytes: OnceCell::new(), in_place: OnceCell::new() })
}

/// Whether a node hands its input a broadcast gradient: a reduction whose backward expands
/// its own (`sum`: a view of the output's gradient, stride 0 where it reduced).
fn broadcasts_grad(node: &Node) -> bool {
    node.inputs.len() == 1
        && !node.meta.alias
        && node.facts.grad_alias.contains(0)
        && shape::numel(&node.inputs[0].meta.shape) > shape::numel(&node.meta.shape)
}

/// Marks the nodes whose backward copies its output's gradient ([`Flags::grad_copy`],
/// [`Flags::grad_dense`]). A value used once gets its gradient as its consumer makes it: a transpose or permute hands on its
/// own gradient reordered, a reduction that expands its gradient a broadcast one, a view its
/// own viewed (when the strides allow), a pass-through op (an addition) its own; every other
/// op makes a new, contiguous one. So gradients arrive permuted where attention's heads were
/// split by a transpose, and an op that views its gradient as a batch of matrices (`matmul`,
/// `linear`, `view`) must copy it first; they arrive broadcast below a `sum`, and an op whose
/// backward reads its gradient densely copies that one.
fn grad_copies(found: &[Rc<Node>], inputs: &[u32], offsets: &[u32], flags: &mut [Flags], starts: &[u32]) {
    if starts.is_empty() {
        return;
    }
    let n = found.len();
    let mut uses = vec![0u32; n];
    for &j in inputs {
        uses[j as usize] += 1;
    }
    // Only what a transpose or permute reaches, consumer before producer: the strides of each
    // gradient that does not arrive contiguous (the rest do).
    let mut strides: HashMap<usize, Dims> = HashMap::new();
    let mut visited = vec![false; n];
    let mut work = Vec::new();
    for &start in starts.iter().rev() {
        work.push(start as usize);
        while let Some(k) = work.pop() {
            if std::mem::replace(&mut visited[k], true) || !flags[k].requires_grad {
                continue;
            }
            let node = &found[k];
            let out = &node.meta;
            // Its gradient's strides, read once (every consumer of them is this node).
            let own = strides.remove(&k);
            let viewed =
                |g: &[i64]| node.grad_reshape().is_none_or(|to| shape::view_strides(&out.shape, g, to).is_some());
            let broadcast = |g: &[i64]| g.iter().zip(&out.shape).any(|(&st, &size)| st == 0 && size > 1);
            let permuted = |g: &[i64]| !shape::is_contiguous(&out.shape, g);
            let dense = node.facts.grad_dense && own.as_deref().is_some_and(broadcast);
            if !out.alias && (dense || node.facts.grad_contiguous && own.as_deref().is_some_and(permuted)) {
                flags[k].grad_dense = true;
                continue;
            }
            if own.as_deref().is_some_and(|g| !viewed(g)) {
                // The copy is contiguous: nothing permuted is handed on.
                flags[k].grad_copy = true;
                continue;
            }
            let expands = broadcasts_grad(node);
            for (e, &j) in inputs[offsets[k] as usize..offsets[k + 1] as usize].iter().enumerate() {
                let j = j as usize;
                if uses[j] != 1 || !flags[j].requires_grad {
                    continue;
                }
                let input = &node.inputs[e].meta;
                let passes = node.facts.grad_alias.contains(e);
                let handed = if node.cost.permutes && e == 0 {
                    shape::permutation(&input.shape, &input.strides, &out.shape, &out.strides).map(|p| {
                        let g = own.clone().unwrap_or_else(|| shape::contiguous_strides(&out.shape));
                        let mut handed = Dims::zeros(g.len());
                        for (o, &d) in p.iter().enumerate() {
                            handed[d] = g[o];
                        }
                        handed
                    })
                } else if expands {
                    Some(Dims::zeros(input.shape.len()))
                } else if let Some(g) = &own {
                    if out.alias && e == 0 {
                        // A view's backward views the gradient as its input's shape.
                        let view = node.grad_reshape() == Some(&input.shape[..]);
                        view.then(|| shape::view_strides(&out.shape, g, &input.shape)).flatten()
                    } else {
                        (passes && input.shape == out.shape).then(|| g.clone())
                    }
                } else {
                    None
                };
                if let Some(g) = handed.filter(|g| !shape::is_contiguous(&input.shape, g)) {
                    strides.insert(j, g);
                    work.push(j);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{compile, Index};
    use crate::lazy::LazyTensor;
    use tch::{Device, Kind, Tensor};

    /// Graphs that plan differently never share a fingerprint (the key of corrections and of
    /// the remembered micro-batch): a transposed weight of the same shape, a frozen one.
    #[test]
    fn fingerprints_tell_layouts_and_frozen_weights_apart() {
        let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([16, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let wt = Tensor::randn([16, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true).tr();
        let frozen = w.detach();
        let loss = |w: &Tensor| crate::lazy::lazy(&x, 0).matmul(w).sum(None);
        let print = |l: &LazyTensor| compile(l).expect("compiles").fingerprint;
        let (a, b, c) = (print(&loss(&w)), print(&loss(&wt)), print(&loss(&frozen)));
        assert_eq!(a, print(&loss(&w)), "the same graph, the same fingerprint");
        assert_ne!(a, b, "a transposed weight");
        assert_ne!(a, c, "a frozen weight");
        // CTC's buffers are sized by the longest target, which no output shape shows.
        let lp = Tensor::randn([12, 4, 5], (Kind::Float, Device::Cpu)).log_softmax(-1, Kind::Float);
        let targets = Tensor::ones([4, 6], (Kind::Int64, Device::Cpu));
        let ctc = |longest: i64| {
            let lp = LazyTensor::batched(&lp, 1).expect("batched");
            let tg = LazyTensor::batched(&targets, 0).expect("batched");
            let l = LazyTensor::f_ctc_loss(&lp, &tg, [12i64; 4], [2, 3, longest, 1], 0, tch::Reduction::Sum, false);
            print(&l.expect("records"))
        };
        assert_eq!(ctc(4), ctc(4));
        assert_ne!(ctc(4), ctc(6), "a longer target");
        // A setting that changes what the op keeps, over the same tensors (the same parameters
        // at the same addresses): in one process, measured `swap = false` priced `swap = true`
        // 14% under.
        let triplet = |swap: bool| {
            let (a, p, n) = crate::lazy::lazy((&x, &x, &x), 0);
            let a = a.matmul(&w);
            print(&LazyTensor::triplet_margin_loss(&a, &p, &n, 1.0, 2.0, 1e-6, swap, tch::Reduction::Mean))
        };
        assert_eq!(triplet(true), triplet(true));
        assert_ne!(triplet(false), triplet(true), "a triplet loss with swap");
    }

    /// Everything of a compiled graph but its nodes, to compare two.
    fn arrays(c: &super::Compiled) -> String {
        let ids: Vec<&str> = c.nodes.iter().map(|n| n.name()).collect();
        let lists = (&c.offsets, &c.inputs, &c.last_use, &c.root, &c.reached_params, &c.flags);
        format!(
            "{lists:?} {:?} {:?} {:?} {ids:?}",
            c.param,
            c.global,
            (c.batch, c.param_grad_bytes, c.fingerprint, c.structure)
        )
    }

    #[test]
    fn a_graph_recorded_again_takes_the_last_form_and_no_other_graph_does() {
        let p = |shape: [i64; 2]| Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (w, v) = (p([16, 16]), p([16, 16]));
        let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
        let recorded = |w: &Tensor, crossed: bool, rows: i64, g_first: bool| {
            let x = crate::lazy::lazy(&x.narrow(0, 0, rows), 0);
            let g = |x: &LazyTensor| x.matmul(&v).sigmoid();
            let (h, g) = if g_first {
                let g = g(&x);
                (x.matmul(w).relu().dropout(0.5, true), g)
            } else {
                (x.matmul(w).relu().dropout(0.5, true), g(&x))
            };
            let (a, b) = if crossed { (g, h) } else { (h, g) };
            (a * &b + b.exp()).sum(None)
        };
        let step = |w: &Tensor, crossed: bool, rows: i64| recorded(w, crossed, rows, false);
        let first = compile(&step(&w, false, 8)).expect("compiles");
        // Recorded anew, the same graph: the same form, worked out once.
        let again = compile(&step(&w, false, 8)).expect("compiles");
        assert!(std::rc::Rc::ptr_eq(&first.form, &again.form));
        assert_eq!(arrays(&again), arrays(&first));
        assert!(again.nodes.iter().zip(&first.nodes).all(|(a, b)| a.name() == b.name() && a.id > b.id));
        // Two graphs in turn (a GAN's steps): each finds its own form again.
        let crossed = compile(&step(&w, true, 8)).expect("compiles");
        assert!(std::rc::Rc::ptr_eq(&compile(&step(&w, false, 8)).expect("compiles").form, &first.form));
        assert!(std::rc::Rc::ptr_eq(&compile(&step(&w, true, 8)).expect("compiles").form, &crossed.form));
        // Other wiring, another parameter, another batch, a frozen weight, the same ops recorded
        // in another order: each compiled anew, as it would be with no form kept.
        let frozen = w.detach();
        let others = [
            step(&w, true, 8),
            step(&v, false, 8),
            step(&w, false, 4),
            step(&frozen, false, 8),
            recorded(&w, false, 8, true),
        ];
        for other in &others {
            let c = compile(other).expect("compiles");
            assert!(!std::rc::Rc::ptr_eq(&c.form, &first.form));
            assert_eq!(arrays(&c), arrays(&super::compile_anew(other).expect("compiles")));
        }
        assert_ne!(compile(&others[0]).unwrap().structure, first.structure, "the wiring");
    }

    #[test]
    fn the_kept_forms_are_the_latest_within_both_limits() {
        use super::{kept_first, Form};
        use std::rc::Rc;
        let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([16, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        // Graphs of 2, 3, ... ops: a form of each, of as many nodes.
        let form = |ops: usize| {
            let mut y = crate::lazy::lazy(&x, 0).matmul(&w);
            for _ in 1..ops {
                y = y.relu();
            }
            super::compile_anew(&y.sum(None)).expect("compiles").form.clone()
        };
        let forms: Vec<Rc<Form>> = (1..=6).map(form).collect();
        let order = |kept: &[Rc<Form>]| -> Vec<usize> {
            kept.iter().map(|k| forms.iter().position(|f| Rc::ptr_eq(f, k)).expect("one of them")).collect()
        };
        let mut kept = Vec::new();
        for f in &forms[..5] {
            kept_first(&mut kept, f, 4, usize::MAX);
        }
        assert_eq!(order(&kept), [4, 3, 2, 1], "the oldest of five goes");
        kept_first(&mut kept, &forms[2], 4, usize::MAX);
        assert_eq!(order(&kept), [2, 4, 3, 1], "one found again comes first, none lost");
        // The node bound: the latest forms up to it, and the first whatever its size.
        let nodes = forms[2].via.len() + forms[4].via.len();
        kept_first(&mut kept, &forms[2], 4, nodes);
        assert_eq!(order(&kept), [2, 4]);
        kept_first(&mut kept, &forms[5], 4, 1);
        assert_eq!(order(&kept), [5], "a form larger than the bound is still kept alone");
        // The thread's own limits, through `compile`: four graphs in turn each find their form;
        // a fifth pushes the oldest out, and it is compiled anew.
        let step = |ops: usize| {
            let mut y = crate::lazy::lazy(&x, 0).matmul(&w);
            for _ in 1..ops {
                y = y.exp();
            }
            y.sum(None)
        };
        let first: Vec<_> = (1..=4).map(|ops| compile(&step(ops)).expect("compiles").form.clone()).collect();
        for (k, f) in first.iter().enumerate() {
            assert!(Rc::ptr_eq(&compile(&step(k + 1)).expect("compiles").form, f), "graph {k} found");
        }
        compile(&step(5)).expect("compiles");
        assert!(!Rc::ptr_eq(&compile(&step(1)).expect("compiles").form, &first[0]), "the oldest went");
        assert!(Rc::ptr_eq(&compile(&step(4)).expect("compiles").form, &first[3]));
    }

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
