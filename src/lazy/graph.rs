//! The recorded graph: nodes, what is known about each output before anything runs, and how
//! the batch flows through them.

use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use tch::{Device, Kind, TchError, Tensor};

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
    pub(crate) op: Box<dyn Operation>,
    pub(crate) inputs: Vec<Rc<Node>>,
    pub(crate) meta: Meta,
    pub(crate) cost: Cost,
    /// What identifies the node's measurement in the cost layer's calibration, worked out the
    /// first time a plan asks (recording does not pay for it).
    pub(crate) calibration_key: std::cell::OnceCell<u64>,
    /// The value the last backward pass of this node computed (a loss after its step):
    /// evaluating the node returns it instead of running the forward again with parameters the
    /// step has since updated.
    pub(crate) stepped: std::cell::Cell<Option<f64>>,
}

impl Node {
    pub(crate) fn new(op: Box<dyn Operation>, inputs: Vec<Rc<Node>>, meta: Meta, cost: Cost) -> Rc<Node> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Rc::new(Node {
            id,
            op,
            inputs,
            meta,
            cost,
            calibration_key: std::cell::OnceCell::new(),
            stepped: std::cell::Cell::new(None),
        })
    }
}

/// `per * b + fixed` bytes at a micro-batch of `b` samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bytes {
    pub(crate) per: u64,
    pub(crate) fixed: u64,
}

impl Bytes {
    pub(crate) fn of(elements: (u64, u64), kind: Kind) -> Bytes {
        let e = kind.elt_size_in_bytes() as u64;
        Bytes { per: elements.0 * e, fixed: elements.1 * e }
    }

    /// The bytes at the full batch `n`.
    pub(crate) fn at(self, n: u64) -> u64 {
        self.per * n + self.fixed
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
    /// Inputs autograd keeps for the backward (bit k: input k; inputs past 64 are never saved).
    pub(crate) saved: u64,
    /// Inputs whose gradient is a view of the output's (bit k: input k; past 64: `alias_rest`).
    pub(crate) grad_alias: u64,
    /// Inputs whose gradient is a view of a tensor the backward made (bit k: input k; never
    /// past 64): see [`Operation::grad_view`].
    pub(crate) grad_view: u64,
    pub(crate) alias_rest: bool,
    /// The output is a view of input 0 with its dimensions reordered (a transpose, a permute):
    /// its backward hands the gradient on permuted.
    pub(crate) permutes: bool,
    /// Whether the op names any kernel call ([`Operation::kernels`]): the others need no
    /// pricing when a plan is made.
    pub(crate) kernel_calls: bool,
    /// Hash of op, kind, shape, strides and whether a gradient flows, for graph fingerprints.
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

impl Node {
    /// The op's name, as tch calls the method.
    pub(crate) fn name(&self) -> &'static str {
        self.op.name()
    }

    /// An input or a fixed leaf: already in memory.
    pub(crate) fn is_source(&self) -> bool {
        self.op.source().is_some()
    }
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

/// Everything an op knows about itself. Defaults describe an op that saves nothing, allocates
/// nothing but its output, and needs no rewrite in a split run.
pub(crate) trait Operation {
    /// The op's name, as tch calls the method.
    fn name(&self) -> &'static str;

    /// Runs the op on one micro-batch.
    fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError>;

    /// The inputs the op updates in place when it runs (batch norm's running statistics in
    /// training), of the op's `n_inputs`. In a split step the executor restores them before
    /// each micro-batch and applies the micro-batches' updates once, weighted by their shares,
    /// as one step over the whole batch does.
    fn updated_inputs(&self, n_inputs: usize) -> std::ops::Range<usize> {
        n_inputs..n_inputs
    }

    /// Whether the op takes part in autograd at all.
    fn differentiable(&self) -> bool {
        true
    }

    /// Whether autograd keeps input `i` alive until this op's backward, given which inputs
    /// require a gradient. Only asked when the output requires a gradient.
    fn saves_input(&self, _i: usize, _inputs: &[Rc<Node>]) -> bool {
        false
    }

    /// Whether autograd keeps the output alive until this op's backward.
    fn saves_output(&self) -> bool {
        false
    }

    /// Whether the gradient for input `i` is a view of the output's gradient (no allocation).
    fn grad_aliases(&self, _i: usize, _inputs: &[Rc<Node>], _meta: &Meta) -> bool {
        false
    }

    /// Whether the gradient for input `i` is a view of a tensor the backward made (`linear`'s
    /// weight gradient: a product, transposed). A parameter whose first gradient (in the
    /// backward's order) is a view, or a view of the output's ([`grad_aliases`]), is summed
    /// out of place when a second arrives: autograd adds into its buffer in place only when it
    /// holds the tensor's last reference and its storage's.
    ///
    /// [`grad_aliases`]: Operation::grad_aliases
    fn grad_view(&self, _i: usize, _inputs: &[Rc<Node>], _meta: &Meta) -> bool {
        false
    }

    /// The shape the backward reshapes the output's gradient to before its kernels run
    /// (`None`: it takes the gradient as it comes). A gradient that arrives permuted (through a
    /// transpose downstream) cannot always be viewed so: libtorch copies it.
    fn grad_reshape(&self, _inputs: &[Rc<Node>], _meta: &Meta) -> Option<Vec<i64>> {
        None
    }

    /// What the plan depends on beyond the op's name and its output's kind, shape and strides
    /// (which the graph's fingerprint holds already): settings that size its buffers without
    /// showing in the output (`ctc_loss`'s longest target). 0 for most ops.
    fn sizing_hash(&self) -> u64 {
        0
    }

    /// Whether the backward reads the output's gradient densely: one that arrives broadcast
    /// (a `sum`'s backward expands the loss's gradient, stride 0) is copied first, as large as
    /// the output. Elementwise backward kernels read it as it is (libtorch 2.11, CPU).
    fn grad_dense(&self, _meta: &Meta) -> bool {
        false
    }

    /// Whether the backward reads the output's gradient contiguous: one that arrives permuted
    /// (through a transpose or permute downstream) is copied beside it while the backward runs.
    fn grad_contiguous(&self) -> bool {
        false
    }

    /// What the op's kernels do besides computing the output, for the cost layer to price on
    /// the device a plan is made for: buffers autograd keeps, temporaries, reductions,
    /// convolutions.
    fn kernels<'a>(&'a self, _inputs: &'a [Rc<Node>], _meta: &'a Meta, _calls: &mut Vec<KernelCall<'a>>) {}

    /// Whether [`kernels`](Self::kernels) says all the op takes: false for ops whose kernels
    /// nobody read (a user's own function), which a calibrating plan measures.
    fn kernels_known(&self) -> bool {
        true
    }

    /// In a split run, when the op's value is summed over micro-batches: its share of the
    /// full batch's value, or `None` to run it as is.
    fn run_share(&self, _ins: &[&Tensor], _node: &Node, _share: &Share) -> Option<Result<Tensor, TchError>> {
        None
    }

    /// Whether the op adds its operands, so that a fixed operand of a sum over micro-batches
    /// must be weighted by each micro-batch's share.
    fn adds_fixed(&self) -> bool {
        false
    }

    /// For a mean over counted targets (input 1, weighted by input 2 when there is one): the
    /// ignored index. A split run divides every share by the full batch's count.
    fn counted_targets(&self) -> Option<i64> {
        None
    }

    /// Where the value comes from, for inputs and fixed leaves (`None` for ops).
    fn source(&self) -> Option<&Source> {
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
    /// The full batch's count, for ops with [`Operation::counted_targets`].
    pub(crate) den: Option<f64>,
    /// Whether an input is per-sample (the op reduces over the batch here).
    pub(crate) reduces_batch: bool,
}

/// A kernel call an op makes besides computing its output, as the cost layer needs to know it:
/// what it computes, on which shapes, not what it costs (that depends on the device, its
/// library and its threads: the cost layer's models).
pub(crate) enum KernelCall<'a> {
    /// Autograd keeps a tensor the op makes until the op's backward (max-pooling's indices, a
    /// norm's statistics): `(per sample, fixed)` elements of `kind`. Only when the output
    /// requires a gradient.
    Keeps { elements: (u64, u64), kind: Kind },
    /// A copy of an operand the op makes for its kernel and autograd saves for the op's
    /// backward (`matmul`'s operand folded or batched by a copy): kept until the backward when
    /// the output requires a gradient, freed as the op returns in a run without autograd.
    SavedCopy { elements: (u64, u64), kind: Kind },
    /// Temporaries of a composite kernel, while the forward runs and while the backward runs:
    /// `(per sample, fixed)` elements of the op's first input's kind. Composite kernels are
    /// libtorch's formulas over other ops: as large on every device.
    Temporaries { forward: (u64, u64), backward: (u64, u64) },
    /// A reduction of a tensor shaped like `of` over the dimensions whose bit is set in `mask`,
    /// in the forward, or in the backward (of the output's gradient).
    Reduction { of: &'a Meta, mask: u64, backward: bool },
    /// A mean over some dimensions of a `Half`/`BFloat16` tensor of `elements`: libtorch's CPU
    /// kernel sums a `Float` copy of it (CUDA accumulates in registers).
    ReducedPrecisionMean { elements: (u64, u64) },
    /// A convolution, plain or transposed.
    Convolution(Convolution<'a>),
    /// A matrix product (`mm`, `addmm`, `bmm`) and, when the output requires a gradient, the
    /// products of its backward.
    Product(Product<'a>),
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
    /// A batched input, narrowed to each micro-batch along `dim`.
    Input { tensor: Tensor, dim: usize },
    /// A fixed tensor: a parameter (`param` when it requires a gradient) or a constant.
    Leaf { tensor: Tensor, param: Option<Box<Param>> },
}

impl Operation for Source {
    fn name(&self) -> &'static str {
        match self {
            Source::Input { .. } => "input",
            Source::Leaf { .. } => "leaf",
        }
    }

    fn run(&self, _ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        match self {
            Source::Input { tensor, dim } => tensor.f_narrow(*dim as i64, cx.start, cx.b),
            Source::Leaf { tensor, .. } => Ok(tensor.shallow_clone()),
        }
    }

    fn source(&self) -> Option<&Source> {
        Some(self)
    }
}
