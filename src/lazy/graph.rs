//! The recorded graph: nodes, what is known about each output before anything runs, and how
//! the batch flows through them.

use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::{Device, Kind, TchError, Tensor};

use crate::dims::Dims;

use super::facts::OpFacts;
use super::shape;
use super::size::{Bytes, Elements};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

#[cfg(test)]
thread_local! {
    /// Nodes made on this thread, for tests of what records nothing.
    pub(crate) static RECORDED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Where the batch sits in a per-sample value: dimension `dim` has `size * factor` entries,
/// `factor` consecutive ones per sample (a flattened `[N, T, C] -> [N * T, C]` has factor `T`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BatchDim {
    pub(crate) dim: usize,
    /// The full batch size N.
    pub(crate) size: i64,
    pub(crate) factor: i64,
}

/// How the value of a node is put together from micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    /// Per-sample rows along a batch dimension: micro-batch values are concatenated.
    PerSample(BatchDim),
    /// Does not depend on the batch at all (parameters, constants).
    Fixed,
    /// A linear function of sums over the batch: micro-batch values add up (a mean-reduced
    /// loss is recorded as such, with each micro-batch weighted by its share).
    Sum,
    /// A maximum over the batch: micro-batch values combine by an elementwise maximum
    /// (forward only).
    Max,
    /// Depends on the batch in a way micro-batches cannot reproduce.
    Opaque,
}

/// What is known about a node's output before anything runs, at the full batch size.
#[derive(Clone, Debug)]
pub(crate) struct Meta {
    pub(crate) shape: Dims,
    pub(crate) strides: Dims,
    pub(crate) kind: Kind,
    pub(crate) device: Device,
    pub(crate) flow: Flow,
    pub(crate) requires_grad: bool,
    /// The output is a view of input 0's storage (no allocation).
    pub(crate) alias: bool,
    /// Why this op mixes samples of the batch (splitting would change its result), if it does.
    pub(crate) mixes: Option<String>,
}

impl Meta {
    /// Whether anything here holds memory of its own.
    pub(crate) fn owns_memory(&self) -> bool {
        self.shape.on_heap() || self.strides.on_heap() || self.mixes.is_some()
    }

    pub(crate) fn batch(&self) -> Option<BatchDim> {
        match self.flow {
            Flow::PerSample(bd) => Some(bd),
            _ => None,
        }
    }

    /// The shape at a micro-batch of `b` samples.
    pub(crate) fn shape_at(&self, b: i64) -> Dims {
        let mut shape = self.shape.clone();
        if let Some(bd) = self.batch() {
            shape[bd.dim] = b * bd.factor;
        }
        shape
    }

    /// Whether `actual` is [`Meta::shape_at`]`(b)`, without building it.
    pub(crate) fn matches_at(&self, b: i64, actual: &[i64]) -> bool {
        let batch_dim = self.batch().map(|bd| (bd.dim, b * bd.factor));
        actual.len() == self.shape.len()
            && actual.iter().zip(&self.shape).enumerate().all(|(d, (&a, &s))| match batch_dim {
                Some((dim, size)) if dim == d => a == size,
                _ => a == s,
            })
    }

    /// Its elements at a micro-batch: per sample, or fixed when nothing is batched.
    pub(crate) fn elements(&self) -> Elements {
        let total = shape::numel(&self.shape).max(0) as u64;
        match self.batch() {
            Some(bd) if bd.size > 0 => Elements::line(total / bd.size as u64, 0),
            _ => Elements::line(0, total),
        }
    }
}

/// One recorded op and its inputs.
pub(crate) struct Node {
    /// Creation order: inputs always have smaller ids, so sorting by id is a topological order.
    pub(crate) id: u64,
    pub(crate) kind: NodeKind,
    pub(crate) inputs: Vec<Rc<Node>>,
    pub(crate) meta: Meta,
    /// What its op declared when it was recorded (a source's: none of note).
    pub(crate) facts: OpFacts,
    pub(crate) cost: Cost,
    /// What identifies the node's measurement in the cost layer's calibration, worked out the
    /// first time a plan asks (recording does not pay for it).
    pub(crate) calibration_key: std::cell::OnceCell<u64>,
    /// Whether the op names any kernel call ([`Operation::kernels`]): the others need no
    /// pricing when a plan is made. Kept by the first look at the node's calls (calibration's,
    /// which lists them anyway), not worked out when recorded.
    kernel_calls: std::cell::OnceCell<bool>,
    /// The value the last backward pass of this node computed (a loss after its step):
    /// evaluating the node returns it instead of running the forward again with parameters the
    /// step has since updated.
    pub(crate) stepped: std::cell::Cell<Option<f64>>,
    /// The source standing for this node's value once a read during recording computed it
    /// (`exec::read`): every later walk of a graph takes it in the node's place, so nothing
    /// before it runs again.
    computed: std::cell::OnceCell<Rc<Node>>,
    /// Whether its meta or facts hold memory of their own (a shape past [`Dims`]' inline
    /// length, a `mixes` reason, a reshape's sizes, inputs from 64 on): only then are they
    /// freed when the node is pooled ([`Node::vacate`]).
    owns: bool,
}

/// What a node is: a value already in memory, or an op over other nodes.
pub(crate) enum NodeKind {
    Source(Source),
    Op(Box<dyn Operation>),
}

impl NodeKind {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            NodeKind::Source(Source::Input { .. }) => "input",
            NodeKind::Source(Source::Leaf { .. }) => "leaf",
            NodeKind::Op(op) => op.name(),
        }
    }
}

/// Most nodes' allocations kept for the next graph's, up to [`POOL_CAP`] per thread. A step
/// makes dozens of nodes of one size and frees them together: beyond glibc's seven cached
/// chunks a size, each went through `_int_malloc` and `_int_free` (a fifth of a lazy VAE step's
/// extra instructions, cachegrind).
const POOL_CAP: usize = 256;

thread_local! {
    static POOL: std::cell::RefCell<Vec<Rc<Node>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A pooled node's op: nothing that owns memory (no tensor, an op of no size).
struct Vacant;

impl Operation for Vacant {
    fn name(&self) -> &'static str {
        "vacant"
    }
}

impl Run for Vacant {
    fn run(&self, _ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        Err(TchError::Torch("toma::lazy: a vacant node was run".into()))
    }
}

impl Node {
    pub(crate) fn new(kind: NodeKind, inputs: Vec<Rc<Node>>, meta: Meta, facts: OpFacts, cost: Cost) -> Rc<Node> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        #[cfg(test)]
        RECORDED.with(|n| n.set(n.get() + 1));
        let owns = meta.owns_memory() || facts.owns_memory();
        let node = Node {
            id,
            kind,
            inputs,
            meta,
            facts,
            cost,
            calibration_key: std::cell::OnceCell::new(),
            kernel_calls: std::cell::OnceCell::new(),
            stepped: std::cell::Cell::new(None),
            computed: std::cell::OnceCell::new(),
            owns,
        };
        let pooled = POOL.try_with(|p| p.try_borrow_mut().ok()?.pop()).ok().flatten();
        match pooled {
            Some(mut rc) => match Rc::get_mut(&mut rc) {
                Some(slot) => {
                    // A pooled node owns nothing (`vacate`): written over, not dropped first.
                    // Dropping it read each of its fields, cold by the next step, to find
                    // nothing to free: two thirds of recording's misses of the L2 cache
                    // (callgrind's cache model, min-gpt tiny).
                    debug_assert!(slot.is_vacant());
                    std::mem::forget(std::mem::replace(slot, node));
                    rc
                }
                None => Rc::new(node),
            },
            None => Rc::new(node),
        }
    }

    /// Keeps the allocation of a node no one else holds (its inputs already taken) for
    /// [`Node::new`], its contents dropped now (its inputs' buffer kept for [`input_list`]).
    fn recycle(mut rc: Rc<Node>) {
        let _ = POOL.try_with(move |p| {
            // A full pool, or one borrowed already, takes nothing: the node is freed as it is,
            // not emptied first.
            let Ok(mut pool) = p.try_borrow_mut() else { return };
            if pool.len() < POOL_CAP {
                if let Some(node) = Rc::get_mut(&mut rc) {
                    node.vacate();
                    pool.push(rc);
                }
            }
        });
    }

    /// Drops the node's op (or its source's tensor), and a computed value standing for it;
    /// its inputs' buffer goes to the lists the next ops' inputs take ([`inputs_of`]). Its
    /// meta and facts are emptied only where they own memory: the rest is overwritten by the
    /// next node made in its place, without being read.
    fn vacate(&mut self) {
        self.kind = NodeKind::Op(Box::new(Vacant));
        give_back_list(std::mem::take(&mut self.inputs));
        drop(self.computed.take());
        if self.owns {
            self.meta.shape = Dims::new();
            self.meta.strides = Dims::new();
            self.meta.mixes = None;
            self.facts = OpFacts::new(0);
            self.owns = false;
        }
    }

    /// Whether nothing in the node owns memory: what a pooled node must be.
    fn is_vacant(&self) -> bool {
        matches!(self.kind, NodeKind::Op(ref op) if op.name() == "vacant")
            && self.inputs.capacity() == 0
            && self.computed.get().is_none()
            && !self.meta.owns_memory()
            && !self.facts.owns_memory()
    }

    /// A leaf: a batched input (`batch = Some(dim)`) or a fixed tensor (parameters, constants;
    /// `eager` for one standing for a value computed at once).
    pub(crate) fn leaf(tensor: &Tensor, batch: Option<usize>, eager: bool) -> Rc<Node> {
        // Every step records its parameters anew: their facts in one call into libtorch.
        Node::leaf_of(tensor.shallow_clone(), crate::memory::tensor_facts(tensor), batch, eager)
    }

    /// [`leaf`](Self::leaf) of a tensor held already, whose facts were read.
    pub(crate) fn leaf_of(
        tensor: Tensor,
        facts: crate::memory::TensorFacts,
        batch: Option<usize>,
        eager: bool,
    ) -> Rc<Node> {
        let meta_flow = match batch {
            Some(dim) => Flow::PerSample(BatchDim { dim, size: facts.shape[dim], factor: 1 }),
            None => Flow::Fixed,
        };
        let meta = Meta {
            strides: facts.strides,
            kind: facts.kind,
            device: facts.device,
            flow: meta_flow,
            requires_grad: facts.requires_grad,
            alias: false,
            mixes: None,
            shape: facts.shape,
        };
        let kind = NodeKind::Source(match batch {
            Some(dim) => Source::Input { tensor, dim },
            None => {
                let param = meta
                    .requires_grad
                    .then(|| Param { key: ParamKey::of(facts.data_ptr, &meta), is_leaf: facts.is_leaf });
                Source::Leaf { tensor, param, eager }
            }
        });
        let facts = OpFacts::new(0).recorded(meta.requires_grad);
        let cost = Cost::of(&kind, &facts, &[], &meta);
        Node::new(kind, Vec::new(), meta, facts, cost)
    }

    /// The node as graphs take it now: the source holding its value where a read computed
    /// it, else itself.
    #[inline]
    pub(crate) fn resolved(self: &Rc<Node>) -> &Rc<Node> {
        self.computed.get().unwrap_or(self)
    }

    /// Keeps `tensor`, this node's value computed whole by a read during recording, as the
    /// source later graphs take in its place ([`Node::resolved`]). The source has the node's
    /// id (its place in creation order) and meta: a per-sample value is an input narrowed to
    /// each micro-batch; any other is a fixed leaf, which marks the step unsplittable when the
    /// value depends on the batch (a sum over it can only be counted once, whole).
    pub(crate) fn keep_computed(&self, tensor: Tensor, read: &str) {
        let requires_grad = tensor.requires_grad();
        let mut meta = Meta { alias: false, requires_grad, ..self.meta.clone() };
        let kind = match meta.flow {
            Flow::PerSample(bd) => Source::Input { tensor, dim: bd.dim },
            flow => {
                if !matches!(flow, Flow::Fixed) && meta.mixes.is_none() {
                    meta.mixes = Some(format!(
                        "its `{}` was read whole while recording (`{read}`): a micro-batch cannot count it again",
                        self.name()
                    ));
                }
                let param = requires_grad
                    .then(|| Param { key: ParamKey::of(tensor.data_ptr() as usize, &meta), is_leaf: tensor.is_leaf() });
                Source::Leaf { tensor, param, eager: false }
            }
        };
        let kind = NodeKind::Source(kind);
        let facts = OpFacts::new(0).recorded(requires_grad);
        let cost = Cost::of(&kind, &facts, &[], &meta);
        let mut source = Node::new(kind, Vec::new(), meta, facts, cost);
        Rc::get_mut(&mut source).expect("a node just made is held once").id = self.id;
        // A node computed twice keeps its first value: a read takes computed nodes as sources.
        let _ = self.computed.set(source);
    }

    /// The value of a node whose inputs are fixed leaves (and the casts an autocast region put
    /// before its op), run now, whole, as eager code would run it.
    pub(crate) fn run_at_once(&self) -> Result<Tensor, TchError> {
        // The graph carries its casts: libtorch's autocast must not cast again.
        let _suspended = crate::autocast::Suspended::new();
        self.value_now()
    }

    fn value_now(&self) -> Result<Tensor, TchError> {
        let ins = self.inputs.iter().map(|x| x.resolved().value_now()).collect::<Result<Vec<_>, _>>()?;
        let ins: Vec<&Tensor> = ins.iter().collect();
        self.run(&ins, &RunCx { meta: &self.meta, start: 0, b: 1 })
    }

    /// The op's name, as tch calls the method (`input` and `leaf` for sources).
    pub(crate) fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// Where the value comes from, for inputs and fixed leaves (`None` for ops).
    pub(crate) fn source(&self) -> Option<&Source> {
        match &self.kind {
            NodeKind::Source(source) => Some(source),
            NodeKind::Op(_) => None,
        }
    }

    /// The op, for nodes that are not sources.
    pub(crate) fn op(&self) -> Option<&dyn Operation> {
        match &self.kind {
            NodeKind::Source(_) => None,
            NodeKind::Op(op) => Some(&**op),
        }
    }

    /// A fixed leaf standing for a value computed at once.
    pub(crate) fn is_eager(&self) -> bool {
        matches!(self.kind, NodeKind::Source(Source::Leaf { eager: true, .. }))
    }

    /// A fixed leaf: a parameter, a constant or a value computed at once.
    pub(crate) fn is_fixed_leaf(&self) -> bool {
        matches!(self.kind, NodeKind::Source(Source::Leaf { .. }))
    }

    /// An input or a fixed leaf: already in memory.
    pub(crate) fn is_source(&self) -> bool {
        matches!(self.kind, NodeKind::Source(_))
    }

    /// A source's tensor as the micro-batch of `b` samples from `start` reads it, unnarrowed: a
    /// fixed leaf's, or an input's when the micro-batch is all of it (a narrow would be a view,
    /// autograd's view metadata and code a plain step never runs, of all of it).
    pub(crate) fn whole(&self, start: i64, b: i64) -> Option<&Tensor> {
        match &self.kind {
            NodeKind::Source(Source::Leaf { tensor, .. }) => Some(tensor),
            NodeKind::Source(Source::Input { tensor, dim })
                if start == 0 && self.meta.shape.get(*dim) == Some(&self.rows(b)) =>
            {
                Some(tensor)
            }
            _ => None,
        }
    }

    /// Its value on one micro-batch, from its inputs'.
    pub(crate) fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        if let Some(tensor) = self.whole(cx.start, cx.b) {
            return Ok(tensor.shallow_clone());
        }
        match &self.kind {
            NodeKind::Source(Source::Input { tensor, dim }) => {
                tensor.f_narrow(*dim as i64, self.rows(cx.start), self.rows(cx.b))
            }
            NodeKind::Source(Source::Leaf { tensor, .. }) => Ok(tensor.shallow_clone()),
            NodeKind::Op(op) => op.run(ins, cx),
        }
    }

    /// Rows of the batch dimension that `samples` samples take (a computed input may hold
    /// several a sample: a flattened `[N * T, C]`).
    #[inline]
    pub(crate) fn rows(&self, samples: i64) -> i64 {
        samples * self.meta.batch().map_or(1, |bd| bd.factor)
    }

    /// The shape its backward views its output's gradient as (`None`: as it comes).
    pub(crate) fn grad_reshape(&self) -> Option<&[i64]> {
        self.facts.grad_reshape.shape(self.inputs.first().map(|x| &x.meta.shape[..]))
    }

    /// What its kernels do besides computing the output (nothing, for sources).
    pub(crate) fn kernels<'a>(&'a self, calls: &mut Vec<KernelCall<'a>>) {
        if let NodeKind::Op(op) = &self.kind {
            op.kernels(&self.inputs, &self.meta, calls);
        }
    }

    /// Whether the op names any kernel call (asked once).
    pub(crate) fn kernel_calls(&self) -> bool {
        *self.kernel_calls.get_or_init(|| {
            let mut calls = Vec::new();
            self.kernels(&mut calls);
            !calls.is_empty()
        })
    }

    /// Keeps [`Node::kernel_calls`]'s answer, where a caller listed the calls anyway.
    pub(crate) fn note_kernel_calls(&self, any: bool) {
        let _ = self.kernel_calls.set(any);
    }
}

/// What a node costs in memory whatever the device, worked out when it is recorded: its
/// output, its gradient, and what autograd saves. What its kernels take besides is the cost
/// layer's to say, per plan (see [`KernelCall`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct Cost {
    /// Its output's new allocation (0 for views, inputs and parameters).
    pub(crate) out: Bytes,
    /// Its value as a fresh tensor: what its gradient costs.
    pub(crate) grad: Bytes,
    /// The output is a view of input 0 with its dimensions reordered (a transpose, a permute):
    /// its backward hands the gradient on permuted.
    pub(crate) permutes: bool,
    /// Hash of op, kind, shape, strides and whether a gradient flows, for graph fingerprints.
    pub(crate) hash: u64,
}

impl Cost {
    /// What a node costs in memory whatever the device, from its op's rules: worked out once,
    /// when it is recorded.
    pub(crate) fn of(kind: &NodeKind, facts: &OpFacts, inputs: &[Rc<Node>], meta: &Meta) -> Cost {
        let elements = meta.elements();
        let grad = elements.bytes(meta.kind);
        let out = if matches!(kind, NodeKind::Source(_)) || meta.alias { Bytes::default() } else { grad };
        // What the plan depends on: the op, kind, shape, layout (a transposed operand takes
        // another matmul path) and whether a gradient flows (frozen layers save nothing).
        let tag = crate::hash::hash_bytes(facts.sizing, kind.name().as_bytes());
        let mut hash = crate::hash::mix(tag ^ meta.kind as u64 ^ (u64::from(meta.requires_grad) << 32));
        for (&s, &st) in meta.shape.iter().zip(&meta.strides) {
            // A size and its stride in one word (each below 2³² tells them apart): one mix.
            hash = crate::hash::mix(hash ^ s as u64 ^ (st as u64).rotate_left(32));
        }
        // And what the op's kernel calls name of its settings (a triplet loss's `swap`, a
        // convolution's padding): two graphs alike but there plan apart, and never share a
        // calibration, even over parameters at the same addresses.
        if let NodeKind::Op(op) = kind {
            let mut calls = call_list();
            op.kernels(inputs, meta, &mut calls);
            for call in &calls {
                hash = crate::hash::mix(hash ^ crate::hash::hash_of(call));
            }
            keep_call_list(calls);
        }
        let permutes = meta.alias
            && inputs
                .first()
                .is_some_and(|x| shape::permutes(&x.meta.shape, &x.meta.strides, &meta.shape, &meta.strides));
        Cost { out, grad, permutes, hash }
    }
}

thread_local! {
    /// An emptied list of kernel calls kept between recorded ops: [`Cost::of`] lists each op's
    /// calls, and a list of its own was an allocation per op (a tenth of a small step's).
    static CALLS: std::cell::Cell<Vec<KernelCall<'static>>> = const { std::cell::Cell::new(Vec::new()) };
}

/// An empty list for kernel calls: the thread's kept one where it has it.
fn call_list<'a>() -> Vec<KernelCall<'a>> {
    recast(CALLS.try_with(std::cell::Cell::take).unwrap_or_default())
}

/// Keeps `calls`' buffer, emptied, for the next [`call_list`].
fn keep_call_list(mut calls: Vec<KernelCall<'_>>) {
    calls.clear();
    let calls = recast(calls);
    let _ = CALLS.try_with(|kept| kept.set(calls));
}

/// An empty list as a list of calls of another lifetime (one layout): collected in place, so
/// its buffer is kept.
fn recast<'b>(calls: Vec<KernelCall<'_>>) -> Vec<KernelCall<'b>> {
    debug_assert!(calls.is_empty());
    calls.into_iter().map(|_| unreachable!("the list is empty")).collect()
}

/// What identifies one parameter among several leaves holding it (shallow clones of one
/// tensor): its data, kind, and a hash of its sizes and strides (two views of one storage at
/// one address differ there). Hashed once, when recorded; nothing allocated.
#[derive(Clone, Debug)]
pub(crate) struct ParamKey {
    hash: u64,
    ptr: usize,
    dims: u64,
    kind: Kind,
}

impl ParamKey {
    /// The key as one word (what [`Hash`] writes).
    pub(crate) fn word(&self) -> u64 {
        self.hash
    }

    /// The key of a tensor whose data is at `ptr` and whose sizes, strides and kind `meta` read.
    pub(crate) fn of(ptr: usize, meta: &Meta) -> Self {
        let mut dims = crate::hash::mix(meta.shape.len() as u64);
        for &v in meta.shape.iter().chain(&meta.strides) {
            dims = crate::hash::mix(dims ^ v as u64);
        }
        let hash = crate::hash::mix(ptr as u64 ^ meta.kind as u64 ^ dims);
        ParamKey { hash, ptr, dims, kind: meta.kind }
    }
}

impl PartialEq for ParamKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.ptr == other.ptr && self.kind == other.kind && self.dims == other.dims
    }
}

impl Eq for ParamKey {}

impl Hash for ParamKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// A fixed leaf that requires a gradient: a parameter, or a tensor computed from parameters.
#[derive(Debug)]
pub(crate) struct Param {
    pub(crate) key: ParamKey,
    /// Whether the tensor is an autograd leaf (else its gradient goes back through its graph).
    pub(crate) is_leaf: bool,
}

/// The largest inputs' buffer kept for another op (elements): a node with hundreds of inputs
/// (a `cat` of many) is rare, and its list not worth keeping.
const KEPT_CAP: usize = 8;

thread_local! {
    /// Emptied inputs' buffers of pooled nodes, up to [`POOL_CAP`]: each recorded op takes one
    /// ([`inputs_of`]) where it would allocate a list of its own. Freed, a dropped graph's
    /// dozens of them would overflow glibc's per-thread cache of small chunks (seven a size)
    /// into the bins it later consolidates.
    static LISTS: std::cell::RefCell<Vec<Vec<Rc<Node>>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An empty list for an op's inputs: a pooled node's buffer, else a new one.
pub(crate) fn input_list() -> Vec<Rc<Node>> {
    LISTS.try_with(|lists| lists.try_borrow_mut().ok()?.pop()).ok().flatten().unwrap_or_default()
}

/// Keeps `list`'s buffer for [`input_list`], emptied (it is already), where worth keeping.
fn give_back_list(mut list: Vec<Rc<Node>>) {
    if list.capacity() == 0 || list.capacity() > KEPT_CAP {
        return;
    }
    list.clear();
    let _ = LISTS.try_with(|lists| {
        if let Ok(mut lists) = lists.try_borrow_mut() {
            if lists.len() < POOL_CAP {
                lists.push(list);
            }
        }
    });
}

/// An op's inputs, `inputs_of([a, b])` for `vec![a.clone(), b.clone()]`, in a buffer a pooled
/// node gave up where one is free.
pub(crate) fn inputs_of<'a>(nodes: impl IntoIterator<Item = &'a Rc<Node>>) -> Vec<Rc<Node>> {
    let mut list = input_list();
    list.extend(nodes.into_iter().cloned());
    list
}

impl Drop for Node {
    fn drop(&mut self) {
        // Iterative: a deep model's graph would overflow the stack if dropped recursively.
        // A node held only here gives up its inputs in place (not moved out of its `Rc`: a
        // copy of the whole node each), then goes to the pool with none.
        let mut stack = std::mem::take(&mut self.inputs);
        while let Some(mut rc) = stack.pop() {
            if let Some(node) = Rc::get_mut(&mut rc) {
                stack.append(&mut node.inputs);
                Node::recycle(rc);
            }
        }
    }
}

/// A tensor that is recorded, not computed: a node of a graph of tch operations whose shapes,
/// kinds and batch dimension are known, and whose values are computed — in micro-batches when
/// the batch does not fit — only when asked for.
///
/// Cloning is cheap (a reference count; for the eager form a closure gets on a `Tensor`, a
/// shallow clone of it). Not `Send`: a graph belongs to one thread.
pub struct LazyTensor {
    repr: Repr,
}

/// A recorded node, or a value computed at once: a closure written over `&LazyTensor` (toma's
/// `nn::func`) applied to a `Tensor` runs each op as tch would, recording nothing and
/// allocating nothing of its own.
enum Repr {
    Recorded(Rc<Node>),
    /// The value, and the leaf that stands for it if a recorded op takes it (made once).
    Eager {
        tensor: Tensor,
        leaf: std::cell::OnceCell<Rc<Node>>,
    },
}

impl Clone for LazyTensor {
    fn clone(&self) -> Self {
        let repr = match &self.repr {
            Repr::Recorded(node) => Repr::Recorded(node.clone()),
            Repr::Eager { tensor, leaf } => Repr::Eager { tensor: tensor.shallow_clone(), leaf: leaf.clone() },
        };
        LazyTensor { repr }
    }
}

impl LazyTensor {
    pub(crate) fn from_node(node: Rc<Node>) -> LazyTensor {
        LazyTensor { repr: Repr::Recorded(node) }
    }

    /// A value computed at once: ops on it run at once, as on a `Tensor`.
    #[inline]
    pub(crate) fn from_eager(tensor: Tensor) -> LazyTensor {
        LazyTensor { repr: Repr::Eager { tensor, leaf: std::cell::OnceCell::new() } }
    }

    /// The value, when it was computed at once.
    #[inline]
    pub(crate) fn eager_value(&self) -> Option<&Tensor> {
        match &self.repr {
            Repr::Eager { tensor, .. } => Some(tensor),
            Repr::Recorded(_) => None,
        }
    }

    /// The node as recorded, even where a read has since computed it (its name and costs).
    pub(crate) fn recorded(&self) -> &Rc<Node> {
        match &self.repr {
            Repr::Recorded(node) => node,
            Repr::Eager { .. } => self.node(),
        }
    }

    /// The node as graphs take it: for a value computed at once, a fixed leaf holding it; for
    /// one a read computed, the source holding its value ([`Node::resolved`]).
    #[inline]
    pub(crate) fn node(&self) -> &Rc<Node> {
        match &self.repr {
            Repr::Recorded(node) => node.resolved(),
            Repr::Eager { tensor, leaf } => leaf.get_or_init(|| Node::leaf(tensor, None, true)),
        }
    }
}

/// What an op is, for the planner: its name, the facts it declares once when recorded, and
/// the kernel calls it makes. How it runs is [`Run`].
pub(crate) trait Operation: Run {
    /// The op's name, as tch calls the method.
    fn name(&self) -> &'static str;

    /// What the op declares about itself, once, when it is recorded (see [`OpFacts`]). The
    /// default: it saves nothing, makes a fresh gradient for each input and updates none.
    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
    }

    /// What the op's kernels do besides computing the output, for the cost layer to price on
    /// the device a plan is made for: buffers autograd keeps, temporaries, reductions,
    /// convolutions.
    fn kernels<'a>(&'a self, _inputs: &'a [Rc<Node>], _meta: &'a Meta, _calls: &mut Vec<KernelCall<'a>>) {}
}

/// How an op runs, for the executor: on one micro-batch, and in a split run its share of a
/// value summed over micro-batches.
pub(crate) trait Run {
    /// Runs the op on one micro-batch.
    fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError>;

    /// In a split run, when the op's value is summed over micro-batches: its share of the
    /// full batch's value, or `None` to run it as is.
    fn run_share(&self, _ins: &[&Tensor], _node: &Node, _share: &Share) -> Option<Result<Tensor, TchError>> {
        None
    }
}

/// What a running op needs besides its inputs.
pub(crate) struct RunCx<'a> {
    /// The node's facts at the full batch.
    pub(crate) meta: &'a Meta,
    /// First sample of the micro-batch.
    pub(crate) start: i64,
    /// Samples in the micro-batch.
    pub(crate) b: i64,
}

/// What a split run tells an op whose value is summed over micro-batches.
pub(crate) struct Share<'a> {
    pub(crate) cx: RunCx<'a>,
    /// The micro-batch's fraction of the batch.
    pub(crate) frac: f64,
    /// The full batch's count, for ops with `OpFacts::counted_targets`.
    pub(crate) den: Option<f64>,
    /// Whether an input is per-sample (the op reduces over the batch here).
    pub(crate) reduces_batch: bool,
}

/// A kernel call an op makes besides computing its output, as the cost layer needs to know it:
/// what it computes, on which shapes, not what it costs (that depends on the device, its
/// library and its threads: the cost layer's models).
pub(crate) enum KernelCall<'a> {
    /// Autograd keeps a tensor the op makes until the op's backward (max-pooling's indices, a
    /// norm's statistics): its elements, of `kind`. Only when the output
    /// requires a gradient.
    Keeps { elements: Elements, kind: Kind },
    /// A copy of an operand the op makes for its kernel and autograd saves for the op's
    /// backward (`matmul`'s operand folded or batched by a copy): kept until the backward when
    /// the output requires a gradient, freed as the op returns in a run without autograd.
    SavedCopy { elements: Elements, kind: Kind },
    /// Temporaries of a composite kernel, while the forward runs and while the backward runs:
    /// elements of the op's first input's kind. Composite kernels are
    /// libtorch's formulas over other ops: as large on every device.
    Temporaries { forward: Elements, backward: Elements },
    /// A reduction of a tensor shaped like `of` over the dimensions whose bit is set in `mask`,
    /// in the forward, or in the backward (of the output's gradient).
    Reduction { of: &'a Meta, mask: u64, backward: bool },
    /// A mean over some dimensions of a `Half`/`BFloat16` tensor of `elements`: libtorch's CPU
    /// kernel sums a `Float` copy of it (CUDA accumulates in registers).
    ReducedPrecisionMean { elements: Elements },
    /// A convolution, plain or transposed.
    Convolution(Convolution<'a>),
    /// A matrix product (`mm`, `addmm`, `bmm`) and, when the output requires a gradient, the
    /// products of its backward.
    Product(Product<'a>),
    /// libtorch's fused attention kernel (and its backward, when the output requires a
    /// gradient): `l` query rows against `s` keys, values `ev` wide, in `kind`. Its scratch is
    /// the device's (per thread on the CPU).
    FusedAttention { l: i64, s: i64, ev: i64, kind: Kind },
}

/// What a call's memory depends on besides its operands' shapes (which calibration's key hashes
/// apart, the batch size aside): which call it is and its settings.
impl std::hash::Hash for KernelCall<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self).hash(h);
        match self {
            KernelCall::Keeps { elements, kind } | KernelCall::SavedCopy { elements, kind } => (elements, kind).hash(h),
            KernelCall::Temporaries { forward, backward } => (forward, backward).hash(h),
            KernelCall::Reduction { mask, backward, of: _ } => (mask, backward).hash(h),
            KernelCall::ReducedPrecisionMean { elements } => elements.hash(h),
            KernelCall::Convolution(c) => c.settings().hash(h),
            KernelCall::Product(p) => (p.k, p.batched, p.b_column_major, p.grads).hash(h),
            KernelCall::FusedAttention { l, s, ev, kind } => (l, s, ev, kind).hash(h),
        }
    }
}

/// A convolution as a kernel call: its operands' facts and its settings over the spatial
/// dimensions.
pub(crate) struct Convolution<'a> {
    pub(crate) input: &'a Meta,
    /// The weight (`[O, C / groups, k..]`; transposed: `[C, O / groups, k..]`).
    pub(crate) weight: &'a Meta,
    pub(crate) output: &'a Meta,
    pub(crate) stride: &'a [i64],
    pub(crate) padding: &'a [i64],
    pub(crate) dilation: &'a [i64],
    pub(crate) groups: i64,
    pub(crate) transposed: bool,
    /// Whether it adds a bias, and whether the input requires a gradient.
    pub(crate) bias: bool,
    pub(crate) input_grad: bool,
    /// Whether the bias requires a gradient and the weight does not (a frozen weight): some
    /// kernels make the weight's gradient anyway, and drop it.
    pub(crate) bias_grad_only: bool,
}

impl Convolution<'_> {
    /// Its settings, operands aside.
    #[allow(clippy::type_complexity)]
    fn settings(&self) -> (&[i64], &[i64], &[i64], i64, [bool; 4]) {
        let flags = [self.transposed, self.bias, self.input_grad, self.bias_grad_only];
        (self.stride, self.padding, self.dilation, self.groups, flags)
    }

    pub(crate) fn strided(&self) -> bool {
        self.stride.iter().any(|&s| s != 1)
    }

    pub(crate) fn dilated(&self) -> bool {
        self.dilation.iter().any(|&d| d != 1)
    }

    /// The kernel's spatial sizes.
    pub(crate) fn kernel(&self) -> &[i64] {
        &self.weight.shape[2..]
    }

    /// Whether the input has a batch dimension (`[N, C, ..]`, not `[C, ..]`).
    pub(crate) fn batched(&self) -> bool {
        self.output.shape.len() == self.stride.len() + 2
    }

    /// Whether the kernel covers the whole unpadded input, one output position per sample (a
    /// DCGAN discriminator's last layer): oneDNN runs it as an inner product.
    pub(crate) fn covers_input(&self) -> bool {
        let d = self.stride.len();
        let spatial = |m: &Meta| m.shape[m.shape.len().saturating_sub(d)..].to_vec();
        !self.transposed
            && self.groups == 1
            && !self.dilated()
            && self.padding.iter().all(|&p| p == 0)
            && spatial(self.output).iter().all(|&s| s == 1)
            && spatial(self.input) == spatial(self.weight)
    }
}

/// A matrix product as a kernel call: `out` (`[.., M, N]`) is `[M, K] @ [K, N]`, one product
/// over rows folded into `M` (`mm`, `addmm`), or one per leading index (`bmm`).
pub(crate) struct Product<'a> {
    pub(crate) out: &'a Meta,
    /// The contracted size.
    pub(crate) k: i64,
    /// One product per leading index (`bmm`), not one over the folded rows.
    pub(crate) batched: bool,
    /// Whether the right operand is a transposed view (column-major: `linear`'s `weightᵀ`):
    /// `mm`'s backward then computes its gradient as `(gradᵀ @ a)ᵀ`.
    pub(crate) b_column_major: bool,
    /// Whether each operand requires a gradient.
    pub(crate) grads: [bool; 2],
}

impl Product<'_> {
    /// `(batch, M, K, N)` at micro-batch `b`.
    pub(crate) fn dims_at(&self, b: i64) -> (u64, u64, u64, u64) {
        let out = self.out.shape_at(b);
        let n = out.last().copied().unwrap_or(1).max(0) as u64;
        let all = shape::numel(&out).max(0) as u64;
        let m = if self.batched && out.len() >= 2 { out[out.len() - 2].max(0) as u64 } else { all / n.max(1) };
        (all / (m * n).max(1), m, self.k.max(0) as u64, n)
    }
}

/// Where values come from: batched inputs, narrowed to each micro-batch, and fixed tensors
/// (parameters and constants). Both are already in memory: they cost the plan nothing.
pub(crate) enum Source {
    /// A batched input, narrowed to each micro-batch along `dim` ([`Node::rows`] a sample).
    Input { tensor: Tensor, dim: usize },
    /// A fixed tensor: a parameter (`param` when it requires a gradient) or a constant.
    Leaf {
        tensor: Tensor,
        param: Option<Param>,
        /// A value computed at once ([`LazyTensor`]'s eager form): an op taking only such
        /// values and other leaves runs as soon as it is recorded.
        eager: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// An op that counts how often one of its kind was dropped.
    struct Counting(Rc<Cell<u32>>);

    impl Drop for Counting {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }

    impl Operation for Counting {
        fn name(&self) -> &'static str {
            "counting"
        }
    }

    impl Run for Counting {
        fn run(&self, _ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
            Err(TchError::Torch("not run".into()))
        }
    }

    fn pooled() -> usize {
        POOL.with(|p| p.borrow().len())
    }

    #[test]
    fn a_dropped_graph_lends_its_nodes_to_the_next_holding_nothing() {
        POOL.with(|p| p.borrow_mut().clear());
        let dropped = Rc::new(Cell::new(0));
        let op = |input: Rc<Node>| {
            let meta = input.meta.clone();
            Node::new(
                NodeKind::Op(Box::new(Counting(dropped.clone()))),
                vec![input],
                meta,
                OpFacts::new(1),
                Cost::default(),
            )
        };
        let leaf = Node::leaf(&Tensor::ones([3, 2], (Kind::Float, Device::Cpu)), None, false);
        // Dropped last (inputs after their consumers): pooled last, taken first.
        let leaf_at = Rc::as_ptr(&leaf);
        let inner = op(leaf);
        let outer = op(inner);
        drop(outer);
        // The output's own allocation is freed as usual; its input and the leaf are pooled,
        // their contents (the op, the leaf's tensor) dropped already.
        assert_eq!(dropped.get(), 2);
        assert_eq!(pooled(), 2);
        let again = Node::leaf(&Tensor::zeros([1], (Kind::Float, Device::Cpu)), None, false);
        assert_eq!(pooled(), 1);
        assert_eq!(Rc::as_ptr(&again), leaf_at);
        assert_eq!(again.name(), "leaf");
        assert_eq!(again.meta.shape, vec![1]);
    }

    /// A pooled node is written over without being dropped: whatever its meta and facts
    /// held (a long shape, a reason the batch mixes, a reshape's sizes) was freed when it was
    /// pooled, and one that held nothing is not read again.
    #[test]
    fn a_pooled_node_holds_nothing_that_writing_over_it_would_lose() {
        use super::super::facts::GradReshape;
        POOL.with(|p| p.borrow_mut().clear());
        let eight = Tensor::ones([1, 1, 1, 1, 1, 1, 1, 2], (Kind::Float, Device::Cpu));
        let leaf = Node::leaf(&eight, None, false);
        assert!(leaf.meta.owns_memory() && leaf.owns);
        let mut meta = leaf.meta.clone();
        meta.mixes = Some("a reason".into());
        let facts = OpFacts::new(1).grad_reshape(GradReshape::As(vec![2, 3]));
        assert!(facts.owns_memory());
        let op = Node::new(NodeKind::Op(Box::new(Vacant)), vec![leaf], meta, facts, Cost::default());
        let plain = Node::leaf(&Tensor::ones([2], (Kind::Float, Device::Cpu)), None, false);
        assert!(!plain.owns);
        let consumer =
            |ins| Node::new(NodeKind::Op(Box::new(Vacant)), ins, plain.meta.clone(), OpFacts::new(2), Cost::default());
        drop(consumer(vec![op, plain.clone()]));
        assert_eq!(pooled(), 2);
        assert!(POOL.with(|p| p.borrow().iter().all(|n| n.is_vacant() && !n.owns)));
        // Taken again, each is the node written in it, whole.
        let again = Node::leaf(&eight, None, false);
        assert_eq!((again.meta.shape.len(), again.name(), again.owns), (8, "leaf", true));
    }

    #[test]
    fn a_kernel_call_list_keeps_its_buffer_between_ops() {
        let meta = Node::leaf(&Tensor::ones([4, 3], (Kind::Float, Device::Cpu)), None, false).meta.clone();
        let mut calls = call_list();
        calls.push(KernelCall::Reduction { of: &meta, mask: 1, backward: false });
        let buffer = calls.as_ptr();
        keep_call_list(calls);
        let again = call_list();
        assert!(again.is_empty());
        assert_eq!((again.as_ptr(), again.capacity() > 0), (buffer, true));
        // Taken, none is kept: a call meanwhile gets a new list.
        assert_eq!(call_list().capacity(), 0);
        keep_call_list(again);
    }

    #[test]
    fn a_pooled_nodes_inputs_buffer_goes_to_the_next_ops_inputs() {
        POOL.with(|p| p.borrow_mut().clear());
        LISTS.with(|l| l.borrow_mut().clear());
        let leaf = |shape: &[i64]| Node::leaf(&Tensor::ones(shape, (Kind::Float, Device::Cpu)), None, false);
        let op =
            |inputs, meta| Node::new(NodeKind::Op(Box::new(Vacant)), inputs, meta, OpFacts::new(1), Cost::default());
        let many: Vec<Rc<Node>> = (0..=KEPT_CAP).map(|_| leaf(&[1])).collect();
        let meta = leaf(&[4, 3]).meta.clone();
        let mid = op(vec![leaf(&[2])], meta.clone());
        let mid_list = mid.inputs.as_ptr();
        let wide = op(many, meta.clone());
        drop(op(vec![mid, wide], meta));
        // Pooled (all but the output), each vacated: no op or tensor, no inputs' buffer.
        assert_eq!(pooled(), 3 + KEPT_CAP + 1);
        let emptied = |n: &Rc<Node>| n.name() == "vacant" && n.inputs.capacity() == 0;
        assert!(POOL.with(|p| p.borrow().iter().all(emptied)));
        // Of the inputs' buffers, `mid`'s is kept, and `wide`'s (longer than short lists are)
        // freed: the next op's inputs take it, the one after a new one.
        assert_eq!(LISTS.with(|l| l.borrow().len()), 1);
        let a = leaf(&[5]);
        let taken = inputs_of([&a]);
        assert_eq!((taken.as_ptr(), taken.len()), (mid_list, 1));
        assert_eq!(input_list().capacity(), 0);
    }

    #[test]
    fn a_full_pool_frees_what_it_cannot_take_with_its_contents() {
        let dropped = Rc::new(Cell::new(0));
        let counting = || NodeKind::Op(Box::new(Counting(dropped.clone())));
        let leaf = || Node::leaf(&Tensor::ones([1], (Kind::Float, Device::Cpu)), None, false);
        let meta = leaf().meta.clone();
        let inner = Node::new(counting(), vec![leaf()], meta.clone(), OpFacts::new(1), Cost::default());
        let outer = Node::new(counting(), vec![inner], meta.clone(), OpFacts::new(1), Cost::default());
        // An op over as many leaves as the pool holds fills it when dropped.
        let leaves: Vec<Rc<Node>> = (0..POOL_CAP).map(|_| leaf()).collect();
        let wide = Node::new(counting(), leaves, meta, OpFacts::new(1), Cost::default());
        POOL.with(|p| p.borrow_mut().clear());
        drop(wide);
        assert_eq!((dropped.get(), pooled()), (1, POOL_CAP));
        // Then an input no one else holds is freed, its op dropped with it.
        drop(outer);
        assert_eq!((dropped.get(), pooled()), (3, POOL_CAP));
    }
}
