//! The recorded graph: nodes, what is known about each output before anything runs, and how
//! the batch flows through them.

use std::cell::Cell;
use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::{Device, Kind, Tensor};

use super::error::LazyError;
use super::ops::Op;
use super::scratch::ReduceStaging;
use super::shape;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

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
    pub(crate) shape: Vec<i64>,
    pub(crate) strides: Vec<i64>,
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
    pub(crate) fn batch(&self) -> Option<BatchDim> {
        match self.flow {
            Flow::PerSample(bd) => Some(bd),
            _ => None,
        }
    }

    /// The shape at a micro-batch of `b` samples.
    pub(crate) fn shape_at(&self, b: i64) -> Vec<i64> {
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

    /// Elements per sample and elements that do not scale with the batch: `numel(b) = a b + c`.
    pub(crate) fn numel_parts(&self) -> (u64, u64) {
        let total = shape::numel(&self.shape).max(0) as u64;
        match self.batch() {
            Some(bd) if bd.size > 0 => (total / bd.size as u64, 0),
            _ => (0, total),
        }
    }
}

/// One recorded op and its inputs.
pub(crate) struct Node {
    /// Creation order: inputs always have smaller ids, so sorting by id is a topological order.
    pub(crate) id: u64,
    pub(crate) op: Op,
    pub(crate) inputs: Vec<Rc<Node>>,
    pub(crate) meta: Meta,
    pub(crate) cost: Cost,
    /// Scratch space of the planner: the traversal that last saw this node, and the node's
    /// position in that traversal's order (a map from ids to positions costs more than both).
    pub(crate) mark: Cell<u64>,
    pub(crate) pos: Cell<u32>,
}

impl Node {
    pub(crate) fn new(op: Op, inputs: Vec<Rc<Node>>, meta: Meta) -> Rc<Node> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let cost = Cost::of(&op, &inputs, &meta);
        Rc::new(Node { id, op, inputs, meta, cost, mark: Cell::new(0), pos: Cell::new(0) })
    }
}

/// `per_sample * b + fixed` bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bytes {
    pub(crate) per: u64,
    pub(crate) fixed: u64,
}

impl Bytes {
    fn of(elements: (u64, u64), kind: Kind) -> Bytes {
        let e = kind.elt_size_in_bytes() as u64;
        Bytes { per: elements.0 * e, fixed: elements.1 * e }
    }
}

/// What a node costs in memory, worked out when it is recorded so that planning only adds up.
#[derive(Clone, Debug, Default)]
pub(crate) struct Cost {
    /// Its output's new allocation (0 for views, inputs and parameters).
    pub(crate) out: Bytes,
    /// Its value as a fresh tensor: what its gradient costs.
    pub(crate) grad: Bytes,
    /// What the op allocates besides its output and autograd keeps for its backward.
    pub(crate) extra: Bytes,
    /// Scratch space while it runs, and while its backward runs.
    pub(crate) work: Bytes,
    pub(crate) back_work: Bytes,
    /// CUDA reductions' staging buffers, each with whether its backward takes it.
    pub(crate) staged: Box<[(bool, ReduceStaging)]>,
    /// Inputs autograd keeps for the backward (bit k: input k; inputs past 64 are never saved).
    pub(crate) saved: u64,
    /// Inputs whose gradient is a view of the output's (bit k: input k; past 64: `alias_rest`).
    pub(crate) grad_alias: u64,
    pub(crate) alias_rest: bool,
    /// Hash of op, shape and kind, for graph fingerprints.
    pub(crate) hash: u64,
}

impl Cost {
    fn of(op: &Op, inputs: &[Rc<Node>], meta: &Meta) -> Cost {
        let elements = meta.numel_parts();
        let grad = Bytes::of(elements, meta.kind);
        let leaf = matches!(op, Op::Input { .. } | Op::Leaf { .. });
        let out = if leaf || meta.alias { Bytes::default() } else { grad };
        let extra = match op.saved_extra(inputs, meta) {
            Some((a, c, kind)) if meta.requires_grad => Bytes::of((a, c), kind),
            _ => Bytes::default(),
        };
        let in_kind = inputs.first().map_or(meta.kind, |x| x.meta.kind);
        let scratch = op.scratch(inputs, meta);
        let (work, back_work) = (Bytes::of(scratch.forward, in_kind), Bytes::of(scratch.backward, in_kind));
        let staged = scratch.staged.into_boxed_slice();
        let (mut saved, mut grad_alias) = (0u64, 0u64);
        for k in 0..inputs.len().min(64) {
            if meta.requires_grad && op.saves_input(k, inputs) {
                saved |= 1 << k;
            }
            if op.grad_aliases(k, inputs, meta) {
                grad_alias |= 1 << k;
            }
        }
        let alias_rest = inputs.len() > 64 && op.grad_aliases(64, inputs, meta);
        let mut hash = crate::hash::mix(op.tag() ^ meta.kind as u64);
        for &s in &meta.shape {
            hash = crate::hash::mix(hash ^ s as u64);
        }
        Cost { out, grad, extra, work, back_work, staged, saved, grad_alias, alias_rest, hash }
    }
}

/// What identifies one parameter among several leaves holding it (shallow clones of one
/// tensor): its data, sizes, strides and kind. Hashed once, when recorded.
#[derive(Clone, Debug)]
pub(crate) struct ParamKey {
    hash: u64,
    ptr: usize,
    shape: Vec<i64>,
    strides: Vec<i64>,
    kind: Kind,
}

impl ParamKey {
    pub(crate) fn of(t: &Tensor) -> Self {
        let (ptr, shape, strides, kind) = (t.data_ptr() as usize, t.size(), t.stride(), t.kind());
        let mut hash = crate::hash::mix(ptr as u64 ^ kind as u64);
        for &v in shape.iter().chain(&strides) {
            hash = crate::hash::mix(hash ^ v as u64);
        }
        ParamKey { hash, ptr, shape, strides, kind }
    }
}

impl PartialEq for ParamKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash
            && self.ptr == other.ptr
            && self.kind == other.kind
            && self.shape == other.shape
            && self.strides == other.strides
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

impl Drop for Node {
    fn drop(&mut self) {
        // Iterative: a deep model's graph would overflow the stack if dropped recursively.
        let mut stack = std::mem::take(&mut self.inputs);
        while let Some(rc) = stack.pop() {
            if let Ok(mut node) = Rc::try_unwrap(rc) {
                stack.append(&mut node.inputs);
            }
        }
    }
}

/// A tensor that is recorded, not computed: a node of a graph of tch operations whose shapes,
/// kinds and batch dimension are known, and whose values are computed — in micro-batches when
/// the batch does not fit — only when asked for.
///
/// Cloning is cheap (a reference count). Not `Send`: a graph belongs to one thread.
#[derive(Clone)]
pub struct LazyTensor {
    pub(crate) node: Rc<Node>,
}

/// How an op treats values that were reduced over the batch ([`Flow::Sum`] and [`Flow::Max`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Linearity {
    /// `a + b`, `a - b`: sums stay sums (fixed operands are weighted per micro-batch).
    Additive,
    /// `a * b`, `a / b`: a sum times something fixed stays a sum; `divisor` is the input that
    /// must not be a sum.
    Scaling { divisor: Option<usize> },
    /// Shape-only and linear reductions (views, `sum`, `mean`): sums and maxima pass through.
    Structural,
    /// Anything else.
    Nonlinear,
}

/// A node about to be created.
pub(crate) struct Record {
    pub(crate) op: Op,
    pub(crate) inputs: Vec<Rc<Node>>,
    pub(crate) shape: Vec<i64>,
    /// `None`: a fresh, contiguous output.
    pub(crate) strides: Option<Vec<i64>>,
    pub(crate) kind: Kind,
    pub(crate) device: Device,
    pub(crate) flow: Flow,
    pub(crate) mixes: Option<String>,
    pub(crate) alias: bool,
    pub(crate) differentiable: bool,
}

impl Record {
    pub(crate) fn new(op: Op, inputs: Vec<Rc<Node>>, shape: Vec<i64>, kind: Kind, device: Device) -> Self {
        Record {
            op,
            inputs,
            shape,
            strides: None,
            kind,
            device,
            flow: Flow::Fixed,
            mixes: None,
            alias: false,
            differentiable: true,
        }
    }

    pub(crate) fn flow(mut self, (flow, mixes): (Flow, Option<String>)) -> Self {
        self.flow = flow;
        self.mixes = mixes;
        self
    }

    pub(crate) fn view(mut self, strides: Vec<i64>) -> Self {
        self.strides = Some(strides);
        self.alias = true;
        self
    }

    pub(crate) fn not_differentiable(mut self) -> Self {
        self.differentiable = false;
        self
    }

    pub(crate) fn finish(self) -> LazyTensor {
        let requires_grad =
            self.differentiable && shape::is_floating(self.kind) && self.inputs.iter().any(|n| n.meta.requires_grad);
        let strides = self.strides.unwrap_or_else(|| shape::contiguous_strides(&self.shape));
        let meta = Meta {
            shape: self.shape,
            strides,
            kind: self.kind,
            device: self.device,
            flow: self.flow,
            requires_grad,
            alias: self.alias,
            mixes: self.mixes,
        };
        LazyTensor { node: Node::new(self.op, self.inputs, meta) }
    }
}

/// A leaf: a batched input (`batch = Some(dim)`) or a fixed tensor (parameters, constants).
pub(crate) fn leaf(tensor: &Tensor, batch: Option<usize>) -> LazyTensor {
    let shape = tensor.size();
    let meta_flow = match batch {
        Some(dim) => Flow::PerSample(BatchDim { dim, size: shape[dim], factor: 1 }),
        None => Flow::Fixed,
    };
    let meta = Meta {
        strides: tensor.stride(),
        kind: tensor.kind(),
        device: tensor.device(),
        flow: meta_flow,
        requires_grad: tensor.requires_grad(),
        alias: false,
        mixes: None,
        shape,
    };
    let op = match batch {
        Some(dim) => Op::Input { tensor: tensor.shallow_clone(), dim },
        None => {
            let param =
                meta.requires_grad.then(|| Box::new(Param { key: ParamKey::of(tensor), is_leaf: tensor.is_leaf() }));
            Op::Leaf { tensor: tensor.shallow_clone(), param }
        }
    };
    LazyTensor { node: Node::new(op, Vec::new(), meta) }
}

/// Checks that all operands live on one device; gives it back.
pub(crate) fn same_device(op: &str, nodes: &[&Rc<Node>]) -> Result<Device, LazyError> {
    let first = nodes[0];
    for n in &nodes[1..] {
        // libtorch lets a 0-dim CPU tensor join any device, as a scalar.
        let scalar = n.meta.shape.is_empty() && n.meta.device == Device::Cpu;
        if n.meta.device != first.meta.device && !scalar {
            return Err(LazyError::Device {
                op: op.into(),
                lhs: first.meta.device,
                lhs_shape: first.meta.shape.clone(),
                rhs: n.meta.device,
                rhs_shape: n.meta.shape.clone(),
            });
        }
    }
    Ok(first.meta.device)
}

/// The flow of an op's output, given where each per-sample input's batch dimension lands in
/// the output (`mapped[i]`: `Some(dim)`, or `None` when the op consumes it) and how the op
/// treats reduced values.
///
/// Checks that per-sample inputs share one batch size, and that a fixed operand does not carry
/// what looks like the batch (a fixed tensor of size N along the batch dimension would be
/// broadcast against every micro-batch: wrong, so it is an error).
pub(crate) fn combine_flows(
    op: &str,
    inputs: &[&Rc<Node>],
    mapped: &[Option<usize>],
    out_shape: &[i64],
    linearity: Linearity,
    check_fixed: bool,
) -> Result<(Flow, Option<String>), LazyError> {
    let mut per: Option<(BatchDim, usize)> = None;
    let mut consumed = false;
    let (mut sums, mut maxes, mut opaque) = (0, 0, false);
    let mut misaligned = false;
    for (i, n) in inputs.iter().enumerate() {
        match n.meta.flow {
            Flow::PerSample(bd) => match mapped[i] {
                None => consumed = true,
                Some(dim) => {
                    let here = BatchDim { dim, ..bd };
                    match per {
                        None => per = Some((here, i)),
                        Some((first, j)) => {
                            if first.size != here.size {
                                return Err(LazyError::Batch {
                                    op: op.into(),
                                    lhs: inputs[j].meta.shape.clone(),
                                    rhs: n.meta.shape.clone(),
                                    reason: format!(
                                        "batch sizes {} and {} differ (inputs wrapped by different lazy() calls?)",
                                        first.size, here.size
                                    ),
                                });
                            }
                            misaligned |= first != here;
                        }
                    }
                }
            },
            Flow::Fixed => {}
            Flow::Sum => sums += 1,
            Flow::Max => maxes += 1,
            Flow::Opaque => opaque = true,
        }
    }
    if opaque {
        return Ok((Flow::Opaque, None));
    }
    if let Some((bd, j)) = per {
        // A fixed operand with the batch's size along the batch dimension (right-aligned, as
        // broadcasting aligns) is almost surely per-sample data that was not wrapped.
        let full = bd.size * bd.factor;
        if check_fixed && full > 1 {
            for n in inputs.iter().filter(|n| n.meta.flow == Flow::Fixed) {
                let offset = out_shape.len() as i64 - n.meta.shape.len() as i64;
                let at = bd.dim as i64 - offset;
                if at >= 0 && n.meta.shape.get(at as usize) == Some(&full) {
                    return Err(LazyError::Batch {
                        op: op.into(),
                        lhs: inputs[j].meta.shape.clone(),
                        rhs: n.meta.shape.clone(),
                        reason: format!(
                            "the second operand is not batched but has the batch's size {full} along the batch \
                             dimension {}; wrap it with toma::lazy::lazy(.., dim) so it is split with the batch",
                            bd.dim
                        ),
                    });
                }
            }
        }
        if misaligned || consumed {
            let reason = if consumed {
                "reduces over the batch dimension of one operand while keeping another's".to_string()
            } else {
                "pairs samples found at different positions of its operands' batch dimensions".to_string()
            };
            return Ok((Flow::Opaque, Some(reason)));
        }
        if out_shape.get(bd.dim) != Some(&full) {
            // Only possible with N = 1 broadcast against something larger: never split.
            return Ok((Flow::Opaque, None));
        }
        if sums + maxes > 0 {
            let reason = "combines per-sample values with a value reduced over the batch".to_string();
            return Ok((Flow::PerSample(bd), Some(reason)));
        }
        return Ok((Flow::PerSample(bd), None));
    }
    if consumed {
        return Ok((Flow::Opaque, Some("consumes the batch dimension".to_string())));
    }
    if maxes > 0 {
        if linearity == Linearity::Structural && sums == 0 {
            return Ok((Flow::Max, None));
        }
        return Ok((Flow::Opaque, Some("is applied to a maximum over the batch".to_string())));
    }
    if sums > 0 {
        let linear = match linearity {
            Linearity::Additive | Linearity::Structural => true,
            Linearity::Scaling { divisor } => {
                sums == 1 && divisor.is_none_or(|d| inputs.get(d).is_none_or(|n| n.meta.flow != Flow::Sum))
            }
            Linearity::Nonlinear => false,
        };
        if linear {
            return Ok((Flow::Sum, None));
        }
        return Ok((
            Flow::Opaque,
            Some("is applied to a value reduced over the batch, which is not linear".to_string()),
        ));
    }
    Ok((Flow::Fixed, None))
}

/// Elementwise (broadcasting) ops: each input's batch dimension is right-aligned into the output.
pub(crate) fn broadcast_flows(
    op: &str,
    inputs: &[&Rc<Node>],
    out_shape: &[i64],
    linearity: Linearity,
) -> Result<(Flow, Option<String>), LazyError> {
    let mapped: Vec<Option<usize>> =
        inputs.iter().map(|n| n.meta.batch().map(|bd| bd.dim + out_shape.len() - n.meta.shape.len())).collect();
    combine_flows(op, inputs, &mapped, out_shape, linearity, true)
}

/// A unary op that keeps the batch dimension at `dim` (given the input's), or drops it (`None`).
pub(crate) fn unary_flow(
    op: &str,
    input: &Rc<Node>,
    out_shape: &[i64],
    dim: impl FnOnce(usize) -> Option<usize>,
    linearity: Linearity,
) -> Result<(Flow, Option<String>), LazyError> {
    let mapped = [input.meta.batch().and_then(|bd| dim(bd.dim))];
    combine_flows(op, &[input], &mapped, out_shape, linearity, false)
}
