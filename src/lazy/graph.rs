//! The recorded graph: nodes, what is known about each output before anything runs, and how
//! the batch flows through them.

use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::{Device, Kind, Tensor};

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
}

impl Node {
    pub(crate) fn new(op: Op, inputs: Vec<Rc<Node>>, meta: Meta, cost: Cost) -> Rc<Node> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Rc::new(Node { id, op, inputs, meta, cost })
    }
}

/// `per_sample * b + fixed` bytes (at least `one` at a micro-batch of one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bytes {
    pub(crate) per: u64,
    pub(crate) fixed: u64,
    /// Bytes at one sample where a library runs a single sample another way (0: none).
    pub(crate) one: u64,
}

impl Bytes {
    pub(crate) fn of(elements: (u64, u64), kind: Kind) -> Bytes {
        let e = kind.elt_size_in_bytes() as u64;
        Bytes { per: elements.0 * e, fixed: elements.1 * e, one: 0 }
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
