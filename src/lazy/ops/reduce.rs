//! Reductions over dimensions (`sum`, `mean`, `amax`) and the softmaxes, which normalize
//! along one.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::{broadcast_flows, combine_flows, same_device, unary_flow, IntoLazy, Linearity, Record};
use super::{arg, floating, kind_err, requires, same_kind, same_shape_flow, shape_err};
use crate::dims::Dims;
use crate::lazy::error::LazyError;
use crate::lazy::error::OrPanic;
use crate::lazy::facts::OpFacts;
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{BatchDim, Flow, KernelCall, Meta, Node, Operation, Run, RunCx, Share};
use crate::lazy::int_list::{IntList, IntListOption};
use crate::lazy::shape;
use crate::lazy::size::Elements;
use crate::lazy::LazyTensor;

/// What a reduction computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReduceOp {
    Sum,
    Mean,
    Amax,
    /// `log(sum(exp(x)))`, computed stably.
    LogSumExp,
}

/// How autograd treats a reduction, one row per [`ReduceOp`].
struct ReduceRules {
    name: &'static str,
    /// Whether autograd keeps the input and the output for the backward.
    keeps_input: bool,
    keeps_output: bool,
    /// Whether the input's gradient is the output's, expanded (a view).
    expands_grad: bool,
    /// Temporaries as large as the input, forward and backward.
    temporaries: u64,
}

impl ReduceOp {
    fn rules(self) -> ReduceRules {
        let rules = |name, keeps, expands_grad, temporaries| ReduceRules {
            name,
            keeps_input: keeps,
            keeps_output: keeps,
            expands_grad,
            temporaries,
        };
        match self {
            ReduceOp::Sum => rules("sum", false, true, 0),
            ReduceOp::Mean => rules("mean", false, false, 0),
            // Where the maxima are: the input compared with the output.
            ReduceOp::Amax => rules("amax", true, false, 0),
            // `exp(x - max)` and the difference before it, forward; `exp(x - result)` and the
            // difference, backward.
            ReduceOp::LogSumExp => rules("logsumexp", true, false, 2),
        }
    }
}

/// The `p`-norm (1 or 2) over `dims` (all when `None`). Autograd keeps the input and the
/// norm; the 1-norm's backward makes the input's signs (a temporary as large as it).
pub(crate) struct Norm {
    p: f64,
    dims: Option<Vec<i64>>,
    keepdim: bool,
}

impl Operation for Norm {
    fn name(&self) -> &'static str {
        "norm"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if meta.requires_grad && self.p == 1.0 {
            calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward: inputs[0].meta.elements() });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 0).saves_output(true)
    }
}

impl Run for Norm {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        match &self.dims {
            None if self.p == 2.0 => ins[0].f_norm(),
            None => ins[0].f_norm_scalaropt_dim(self.p, (0..ins[0].dim() as i64).collect::<Vec<_>>(), false),
            Some(dims) => ins[0].f_norm_scalaropt_dim(self.p, dims.as_slice(), self.keepdim),
        }
    }
}

/// The variance over `dims` (all when `None`), or its square root (`std`), with Bessel's
/// correction when `unbiased`. The forward is one pass (Welford's) without temporaries.
/// Autograd keeps the input, and `std` its output; libtorch's `var_backward` makes
/// `(2 / dof) * grad` and the mean (each as large as the output) and `x - mean` (as large as
/// the input) beside the input's gradient, and `std_backward` first divides the gradient by
/// twice the output (one more as large as the output).
pub(crate) struct Variance {
    dims: Option<Vec<i64>>,
    unbiased: bool,
    keepdim: bool,
    sqrt: bool,
}

impl Operation for Variance {
    fn name(&self) -> &'static str {
        match (self.sqrt, self.dims.is_some()) {
            (false, false) => "var",
            (false, true) => "var_dim",
            (true, false) => "std",
            (true, true) => "std_dim",
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 0).saves_output(self.sqrt)
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if meta.requires_grad {
            let (x, out) = (inputs[0].meta.elements(), meta.elements());
            let outs = 2 + u64::from(self.sqrt);
            calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward: x.plus(out.times(outs)) });
        }
    }
}

impl Run for Variance {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let x = ins[0];
        match (&self.dims, self.sqrt) {
            (None, false) => x.f_var(self.unbiased),
            (None, true) => x.f_std(self.unbiased),
            (Some(dims), false) => x.f_var_dim(dims.as_slice(), self.unbiased, self.keepdim),
            (Some(dims), true) => x.f_std_dim(dims.as_slice(), self.unbiased, self.keepdim),
        }
    }
}

/// A reduction's wrapped dimensions, its recorded `dims` and its output shape.
type ReductionShape = (Vec<usize>, Option<Vec<i64>>, Vec<i64>);

/// Where the batch dimension lands once `reduced` (not containing it) are reduced.
fn kept_batch(bd: BatchDim, reduced: &[usize], keepdim: bool) -> BatchDim {
    let dim = if keepdim { bd.dim } else { bd.dim - reduced.iter().filter(|&&r| r < bd.dim).count() };
    BatchDim { dim, ..bd }
}

/// Running sums along `dim`. Its backward is libtorch's reversed cumulative sum of the output's
/// gradient (`flip`, `cumsum`, `flip`): two temporaries as large as the gradient besides it.
pub(crate) struct Cumsum {
    dim: i64,
    kind: Option<Kind>,
}

impl Operation for Cumsum {
    fn name(&self) -> &'static str {
        "cumsum"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let trivial = meta.shape.is_empty() || meta.shape.iter().product::<i64>() <= 1;
        if meta.requires_grad && !trivial && inputs[0].meta.shape.get(self.dim as usize) != Some(&1) {
            let (a, c) = meta.elements().parts();
            calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward: Elements::line(2 * a, 2 * c) });
        }
    }
}

impl Run for Cumsum {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_cumsum(self.dim, self.kind)
    }
}

/// Running products along `dim`. Autograd keeps the input and the output; libtorch's backward
/// (for an input without zeros) builds `output · grad`, its reversed cumulative sum (`flip`,
/// `cumsum`, `flip`) and a mask of the zeros: three temporaries as large as the input and a
/// boolean one. An input with zeros takes libtorch's exact path for them, which the plan does
/// not hold: about eleven temporaries (read from the CPU allocator: `tests/lazy_peak.rs`).
pub(crate) struct Cumprod {
    dim: i64,
    kind: Option<Kind>,
}

impl Operation for Cumprod {
    fn name(&self) -> &'static str {
        "cumprod"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let input = &inputs[0].meta;
        let trivial = shape::numel(&input.shape) <= 1 || input.shape.get(self.dim as usize).is_some_and(|&s| s <= 1);
        if meta.requires_grad && !trivial {
            let (a, c) = input.elements().parts();
            let e = input.kind.elt_size_in_bytes() as u64;
            // Three in the input's kind, and the mask of zeros (one byte each).
            let elements = Elements::line(3 * a + a.div_ceil(e), 3 * c + c.div_ceil(e));
            calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward: elements });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 0).saves_output(true)
    }
}

impl Run for Cumprod {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_cumprod(self.dim, self.kind)
    }
}

/// The entries sorted along `dim`: their values (differentiable; autograd keeps the positions
/// to send the gradient back) or their positions (`Int64`), as tch's `sort` (or `sort_stable`
/// when `stable` is given). Each is its own node; a graph that uses both sorts twice.
pub(crate) struct Sort {
    dim: i64,
    descending: bool,
    stable: Option<bool>,
    values: bool,
}

impl Operation for Sort {
    fn name(&self) -> &'static str {
        match (self.stable.is_some(), self.values) {
            (false, true) => "sort",
            (false, false) => "sort_indices",
            (true, true) => "sort_stable",
            (true, false) => "sort_stable_indices",
        }
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let (a, c) = meta.elements().parts();
        let input = inputs[0].meta.kind;
        if self.values && meta.requires_grad {
            // The positions, made beside the values and kept for the backward.
            calls.push(KernelCall::Keeps { elements: Elements::line(a, c), kind: Kind::Int64 });
        } else {
            // The other output, freed as the op returns (in the input's kind's elements).
            let e = input.elt_size_in_bytes() as u64;
            let other = if self.values { 8 } else { e };
            let elements = Elements::line((a * other).div_ceil(e), (c * other).div_ceil(e));
            calls.push(KernelCall::Temporaries { forward: elements, backward: Elements::ZERO });
        }
    }
}

impl Run for Sort {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (values, indices) = match self.stable {
            Some(stable) => ins[0].f_sort_stable(stable, self.dim, self.descending)?,
            None => ins[0].f_sort(self.dim, self.descending)?,
        };
        Ok(if self.values { values } else { indices })
    }
}

/// The `k` largest (or smallest) entries along `dim`: their values (differentiable; autograd
/// keeps the positions to send the gradient back) or their positions (`Int64`). Each is its own
/// node; a graph that uses both runs libtorch's `topk` twice.
pub(crate) struct TopK {
    k: i64,
    dim: i64,
    largest: bool,
    sorted: bool,
    values: bool,
}

impl Operation for TopK {
    fn name(&self) -> &'static str {
        if self.values {
            "topk"
        } else {
            "topk_indices"
        }
    }

    fn kernels<'a>(&'a self, _inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // The positions, made beside the values: kept for the backward, else freed at once.
        let positions = meta.elements();
        if self.values && meta.requires_grad {
            calls.push(KernelCall::Keeps { elements: positions, kind: Kind::Int64 });
        }
    }
}

impl Run for TopK {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (values, indices) = ins[0].f_topk(self.k, self.dim, self.largest, self.sorted)?;
        Ok(if self.values { values } else { indices })
    }
}

/// Where the largest (`max`) or smallest entry is along `dim`, or in the value flattened
/// (`None`): integer positions, which carry no gradient.
pub(crate) struct ArgExtreme {
    max: bool,
    dim: Option<i64>,
    keepdim: bool,
}

impl Operation for ArgExtreme {
    fn name(&self) -> &'static str {
        if self.max {
            "argmax"
        } else {
            "argmin"
        }
    }
}

impl Run for ArgExtreme {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        if self.max {
            ins[0].f_argmax(self.dim, self.keepdim)
        } else {
            ins[0].f_argmin(self.dim, self.keepdim)
        }
    }
}

/// A reduction over `dims` (all when `None`).
pub(crate) struct Reduction {
    op: ReduceOp,
    dims: Option<Vec<i64>>,
    keepdim: bool,
    kind: Option<Kind>,
}

impl Operation for Reduction {
    fn name(&self) -> &'static str {
        self.op.rules().name
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let of = &inputs[0].meta;
        let k = self.op.rules().temporaries;
        if k > 0 {
            let (a, c) = of.elements().parts();
            calls.push(KernelCall::Temporaries {
                forward: Elements::line(k * a, k * c),
                backward: Elements::line(k * a, k * c),
            });
        }
        let rank = of.shape.len();
        // Checked when recorded: a wrapping error cannot happen here.
        let mask = match &self.dims {
            None => shape::dims_mask(0..rank),
            Some(dims) => shape::wrap_dims(dims, rank).map_or(0, shape::dims_mask),
        };
        calls.push(KernelCall::Reduction { of, mask, backward: false });
        if self.op == ReduceOp::Mean && self.dims.is_some() && matches!(of.kind, Kind::Half | Kind::BFloat16) {
            calls.push(KernelCall::ReducedPrecisionMean { elements: of.elements() });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| i == 0 && self.op.rules().keeps_input)
            .saves_output(self.op.rules().keeps_output)
            .grad_aliases(|_i| self.op.rules().expands_grad)
    }
}

impl Run for Reduction {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        reduce(ins[0], self.op, self.dims.as_deref(), self.keepdim, self.kind)
    }

    fn run_share(&self, ins: &[&Tensor], node: &Node, share: &Share) -> Option<Result<Tensor, TchError>> {
        // A mean over the batch: each micro-batch adds its share, so it divides by the full
        // batch's count, not the micro-batch's.
        if self.op != ReduceOp::Mean || !share.reduces_batch {
            return None;
        }
        let full_count = |m: &Meta| shape::numel(&m.shape) as f64;
        let count = full_count(&node.inputs[0].meta) / full_count(&node.meta).max(1.0);
        Some(
            reduce(ins[0], ReduceOp::Sum, self.dims.as_deref(), self.keepdim, self.kind)
                .and_then(|s| s.f_div_scalar(count)),
        )
    }
}

/// `softmax` or `log_softmax` along `dim`; autograd keeps the output.
pub(crate) struct Softmax {
    dim: i64,
    kind: Option<Kind>,
    log: bool,
}

impl Operation for Softmax {
    fn name(&self) -> &'static str {
        if self.log {
            "log_softmax"
        } else {
            "softmax"
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves_output(true).grad_dense(true)
    }
}

impl Run for Softmax {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        if self.log {
            ins[0].f_log_softmax(self.dim, self.kind)
        } else {
            ins[0].f_softmax(self.dim, self.kind)
        }
    }
}

/// The cosine similarity of two operands along `dim` of their broadcast shape (the dimension
/// removed). Operands: x1, x2.
///
/// libtorch's kernel is composite: it divides each operand by its norm along `dim` (clamped at
/// `sqrt(eps)`), multiplies the two and sums. Autograd keeps each operand that requires a
/// gradient (the division's numerator) with two norms (output-sized), and each normalized
/// operand the other one's gradient needs; the normalized operands it does not keep and the
/// product are temporaries; the backward builds operand-sized terms (read from the CPU
/// allocator: `tests/lazy_peak.rs`).
pub(crate) struct CosineSimilarity {
    dim: i64,
    eps: f64,
}

impl Operation for CosineSimilarity {
    fn name(&self) -> &'static str {
        "cosine_similarity"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // Elements of the broadcast operands: the output's, times the reduced dimension's size.
        let shapes = (&inputs[0].meta.shape, &inputs[1].meta.shape);
        let full = shape::broadcast(shapes.0, shapes.1).unwrap_or_default();
        let along = shape::wrap_dim(self.dim, full.len()).map_or(1, |d| full[d].max(0) as u64);
        let out = meta.elements();
        let operand = out.times(along);
        let with_grad = (0..2).filter(|&k| requires(inputs, k)).count() as u64;
        let times = |x: u64, y: u64| operand.times(x).plus(out.times(y));
        calls.push(KernelCall::Keeps { elements: times(with_grad, 2 * with_grad), kind: meta.kind });
        let backward = if with_grad > 0 { times(4 - with_grad, 0) } else { Elements::ZERO };
        calls.push(KernelCall::Temporaries { forward: times(3 - with_grad, 4 - 2 * with_grad), backward });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| requires(inputs, i))
    }
}

impl Run for CosineSimilarity {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        Tensor::f_cosine_similarity(ins[0], ins[1], self.dim, self.eps)
    }
}

/// A reduction as tch runs it.
fn reduce(
    x: &Tensor,
    op: ReduceOp,
    dims: Option<&[i64]>,
    keepdim: bool,
    kind: Option<Kind>,
) -> Result<Tensor, TchError> {
    match (op, dims) {
        (ReduceOp::Sum, None) => x.f_sum(kind),
        (ReduceOp::Sum, Some(dims)) => x.f_sum_dim_intlist(dims, keepdim, kind),
        (ReduceOp::Mean, None) => x.f_mean(kind),
        (ReduceOp::Mean, Some(dims)) => x.f_mean_dim(dims, keepdim, kind),
        (ReduceOp::Amax, None) => x.f_max(),
        (ReduceOp::Amax, Some(dims)) => x.f_amax(dims, keepdim),
        (ReduceOp::LogSumExp, None) => x.f_logsumexp((0..x.dim() as i64).collect::<Vec<_>>(), keepdim),
        (ReduceOp::LogSumExp, Some(dims)) => x.f_logsumexp(dims, keepdim),
    }
}

#[toma_macros::tensor_methods(ReduceOps, "Reductions and softmax (a family of [`TensorOps`](crate::lazy::TensorOps)).")]
impl LazyTensor {
    /// `None` reduces every dimension; kept, each stays as a 1 (as tch's `sum_dim_intlist`).
    fn dims_or_all(&self, dims: Option<&[i64]>, keepdim: bool) -> Option<Vec<i64>> {
        match dims {
            Some(d) => Some(d.to_vec()),
            None if keepdim => Some((0..self.dim() as i64).collect()),
            None => None,
        }
    }

    fn f_softmax_impl(&self, dim: i64, kind: Option<Kind>, log: bool) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let op = Softmax { dim, kind, log };
        let name = op.name();
        let d = shape::wrap_dim(dim, n.meta.shape.len()).map_err(|r| arg(name, &n.meta.shape, r))?;
        let out_kind = kind.unwrap_or(n.meta.kind);
        if !shape::is_floating(out_kind) {
            return Err(kind_err(name, out_kind, &n.meta.shape, "softmax needs a floating-point kind"));
        }
        let (flow, mut mixes) = same_shape_flow(name, n, Linearity::Nonlinear)?;
        if n.meta.batch().is_some_and(|bd| bd.dim == d) {
            mixes = Some(format!("normalizes over the batch dimension {d}"));
        }
        Ok(Record::new(op, inputs_of([n]), n.meta.shape.clone(), out_kind, n.meta.device).flow((flow, mixes)).finish())
    }

    /// Softmax along `dim`, optionally computed in `kind`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension, [`LazyError::Kind`] for a non-floating kind.
    pub fn f_softmax(&self, dim: i64, kind: impl Into<Option<Kind>>) -> Result<LazyTensor, LazyError> {
        self.f_softmax_impl(dim, kind.into(), false)
    }

    /// Log-softmax along `dim`, optionally computed in `kind`.
    ///
    /// # Errors
    /// As [`f_softmax`](Self::f_softmax).
    pub fn f_log_softmax(&self, dim: i64, kind: impl Into<Option<Kind>>) -> Result<LazyTensor, LazyError> {
        self.f_softmax_impl(dim, kind.into(), true)
    }

    /// Cosine similarity of `self` and `x2` along `dim` of their broadcast shape, as tch's
    /// `cosine_similarity`: `x1 · x2 / max(‖x1‖ ‖x2‖, eps)`, the dimension removed (each norm
    /// clamped at `sqrt(eps)`, as libtorch computes it). Along the batch dimension it mixes
    /// samples.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for operands that do not broadcast, [`LazyError::Argument`] for a
    /// bad dimension, [`LazyError::Kind`] for integers or two kinds, [`LazyError::Device`].
    pub fn f_cosine_similarity(&self, x2: impl IntoLazy, dim: i64, eps: f64) -> Result<LazyTensor, LazyError> {
        let name = "cosine_similarity";
        let other = x2.into_lazy();
        let (a, b) = (self.node(), other.node());
        let device = same_device(name, &[a, b])?;
        floating(name, a)?;
        same_kind(name, a, b)?;
        let full = shape::broadcast(&a.meta.shape, &b.meta.shape)
            .map_err(|r| shape_err(name, &a.meta.shape, &b.meta.shape, r))?;
        let d = shape::wrap_dim(dim, full.len()).map_err(|r| arg(name, &full, r))?;
        let mut out = full.clone();
        out.remove(d);
        // Operands align in the broadcast shape (a fixed one of the batch's size there is an
        // error); each batch dimension then moves down past the removed one, or is consumed.
        broadcast_flows(name, &[a, b], &full, Linearity::Nonlinear)?;
        let mapped: Vec<Option<usize>> = [a, b]
            .iter()
            .map(|n| {
                let at = n.meta.batch()?.dim + full.len() - n.meta.shape.len();
                (at != d).then(|| if at > d { at - 1 } else { at })
            })
            .collect();
        let flow = combine_flows(name, &[a, b], &mapped, &out, Linearity::Nonlinear, false)?;
        let op = CosineSimilarity { dim, eps };
        Ok(Record::new(op, inputs_of([a, b]), out, a.meta.kind, device).flow(flow).finish())
    }

    // -----------------------------------------------------------------------------------------
    // Reductions

    fn f_reduce(
        &self,
        op: ReduceOp,
        dims: Option<&[i64]>,
        keepdim: bool,
        kind: Option<Kind>,
    ) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let name = op.rules().name;
        let a = |r: String| arg(name, &m.shape, r);
        let (reduced, dims, out) = self.reduction_shape(name, dims, keepdim)?;
        let out_kind = match op {
            ReduceOp::Sum => kind.unwrap_or(if shape::is_integral(m.kind) { Kind::Int64 } else { m.kind }),
            ReduceOp::Mean => {
                let k = kind.unwrap_or(m.kind);
                if !shape::is_floating(k) {
                    return Err(kind_err(name, k, &m.shape, "mean needs a floating-point kind (pass one)"));
                }
                k
            }
            ReduceOp::Amax => {
                if m.shape.iter().zip(0..).any(|(&s, i)| s == 0 && reduced.contains(&i)) {
                    return Err(a("cannot take the maximum over an empty dimension".into()));
                }
                m.kind
            }
            ReduceOp::LogSumExp => {
                if !shape::is_floating(m.kind) {
                    return Err(kind_err(name, m.kind, &m.shape, "logsumexp needs a floating-point tensor"));
                }
                m.kind
            }
        };
        let flow = match m.flow {
            Flow::PerSample(bd) if reduced.contains(&bd.dim) => match op {
                ReduceOp::Sum | ReduceOp::Mean => (Flow::Sum, None),
                ReduceOp::Amax => (Flow::Max, None),
                ReduceOp::LogSumExp => {
                    (Flow::Opaque, Some(format!("takes a logsumexp over the batch dimension {}", bd.dim)))
                }
            },
            Flow::PerSample(bd) => (Flow::PerSample(kept_batch(bd, &reduced, keepdim)), None),
            Flow::Sum if op == ReduceOp::Amax => {
                (Flow::Opaque, Some("takes a maximum of a value summed over the batch".to_string()))
            }
            Flow::Sum | Flow::Max if op == ReduceOp::LogSumExp => {
                (Flow::Opaque, Some("takes a logsumexp of a value combined over the batch".to_string()))
            }
            Flow::Max if op != ReduceOp::Amax => (Flow::Opaque, Some("sums a maximum over the batch".to_string())),
            other => (other, None),
        };
        let record_op = Reduction { op, dims, keepdim, kind };
        Ok(Record::new(record_op, inputs_of([n]), out, out_kind, m.device).flow(flow).finish())
    }

    /// A reduction's dimensions (wrapped), its `dims` as recorded (`None`: all, dropped) and
    /// its output shape. An empty list reduces every dimension, as in libtorch.
    fn reduction_shape(&self, name: &str, dims: Option<&[i64]>, keepdim: bool) -> Result<ReductionShape, LazyError> {
        let shape = &self.node().meta.shape;
        let all = || (0..shape.len()).collect::<Vec<usize>>();
        let (reduced, dims) = match dims {
            Some(list) if !list.is_empty() => {
                (shape::wrap_dims(list, shape.len()).map_err(|r| arg(name, shape, r))?, Some(list.to_vec()))
            }
            Some(_) => (all(), keepdim.then(|| (0..shape.len() as i64).collect())),
            None => (all(), None),
        };
        let out = match (&dims, keepdim) {
            (None, false) => Vec::new(),
            _ => shape
                .iter()
                .enumerate()
                .filter_map(|(i, &s)| if reduced.contains(&i) { keepdim.then_some(1) } else { Some(s) })
                .collect(),
        };
        Ok((reduced, dims, out))
    }

    /// The 2-norm of all entries, as tch's `norm`. Over the batch it combines samples (refused
    /// for a split).
    ///
    /// # Errors
    /// [`LazyError::Kind`] for an integer tensor.
    pub fn f_norm(&self) -> Result<LazyTensor, LazyError> {
        self.f_norm_impl(2.0, None, false)
    }

    /// The `p`-norm over `dims`, as tch's `norm_scalaropt_dim` (`p` 1 or 2).
    ///
    /// # Errors
    /// [`LazyError::Unsupported`] for another `p`; [`LazyError::Argument`] for bad dimensions;
    /// [`LazyError::Kind`] for an integer tensor.
    pub fn f_norm_scalaropt_dim(&self, p: f64, dim: impl IntList, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_norm_impl(p, Some(dim.as_slice().to_vec()), keepdim)
    }

    /// `x / max(‖x‖_p over dim, eps)`, as PyTorch's `F.normalize` (`p` 1 or 2; per sample unless
    /// `dim` is the batch dimension).
    ///
    /// # Errors
    /// As [`f_norm_scalaropt_dim`](Self::f_norm_scalaropt_dim).
    #[lazy_only]
    pub fn f_normalize(&self, p: f64, dim: i64, eps: f64) -> Result<LazyTensor, LazyError> {
        let norm = self.f_norm_scalaropt_dim(p, [dim], true)?.f_clamp_min(eps)?;
        self.f_div(&norm)
    }

    fn f_norm_impl(&self, p: f64, dims: Option<Vec<i64>>, keepdim: bool) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        if p != 1.0 && p != 2.0 {
            return Err(LazyError::Unsupported {
                op: "norm".into(),
                reason: format!("p = {p}: only the 1- and 2-norms are planned; compose others (abs, pow, sum)"),
            });
        }
        if !shape::is_floating(m.kind) {
            return Err(kind_err("norm", m.kind, &m.shape, "norm needs a floating-point tensor"));
        }
        let keepdim = keepdim && dims.is_some();
        let (reduced, _, out) = self.reduction_shape("norm", Some(dims.as_deref().unwrap_or(&[])), keepdim)?;
        let flow = match m.flow {
            Flow::PerSample(bd) if reduced.contains(&bd.dim) => {
                (Flow::Opaque, Some(format!("takes a norm over the batch dimension {}", bd.dim)))
            }
            Flow::PerSample(bd) => (Flow::PerSample(kept_batch(bd, &reduced, keepdim)), None),
            Flow::Fixed => (Flow::Fixed, None),
            _ => (Flow::Opaque, Some("takes a norm of a value combined over the batch".to_string())),
        };
        let op = Norm { p, dims, keepdim };
        Ok(Record::new(op, inputs_of([n]), out, m.kind, m.device).flow(flow).finish())
    }

    /// The `k` largest (`largest`) or smallest entries along `dim` and their positions, as
    /// tch's `topk`. Along the batch dimension it compares samples (refused for a split).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension or a `k` larger than the dimension.
    #[lazy_only]
    pub fn f_topk(&self, k: i64, dim: i64, largest: bool, sorted: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        if let Some(t) = self.eager_value() {
            let (values, indices) = t.f_topk(k, dim, largest, sorted).map_err(super::eager_err("topk"))?;
            return Ok((LazyTensor::from_eager(values), LazyTensor::from_eager(indices)));
        }
        let n = self.node();
        let m = &n.meta;
        let d = shape::wrap_dim(dim, m.shape.len().max(1)).map_err(|r| arg("topk", &m.shape, r))?;
        let size = m.shape.get(d).copied().unwrap_or(1);
        if k < 0 || k > size {
            return Err(arg("topk", &m.shape, format!("k ({k}) is out of range for dimension {d} of size {size}")));
        }
        let mut out = m.shape.clone();
        if !out.is_empty() {
            out[d] = k;
        }
        let (flow, mut mixes) = unary_flow("topk", n, &out, Some, Linearity::Nonlinear)?;
        if let Some(bd) = m.batch().filter(|bd| bd.dim == d) {
            mixes = Some(format!("compares samples along the batch dimension {}", bd.dim));
        }
        let record = |values: bool, kind: Kind| {
            let op = TopK { k, dim: d as i64, largest, sorted, values };
            let r = Record::new(op, inputs_of([n]), out.clone(), kind, m.device).flow((flow, mixes.clone()));
            if values { r } else { r.not_differentiable() }.finish()
        };
        Ok((record(true, m.kind), record(false, Kind::Int64)))
    }

    /// Like [`f_topk`](Self::f_topk), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn topk(&self, k: i64, dim: i64, largest: bool, sorted: bool) -> (LazyTensor, LazyTensor) {
        self.f_topk(k, dim, largest, sorted).or_panic()
    }

    /// The maximum along `dim` and its position, as tch's `max_dim` (DQN's
    /// `target.forward(&next_obs).max_dim(1, false).0`): recorded as a `topk` of one, whose
    /// backward sends the gradient to that position as `max_dim`'s does. Along the batch
    /// dimension it compares samples (refused for a split).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension or an empty one.
    #[lazy_only]
    pub fn f_max_dim(&self, dim: i64, keepdim: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        self.extremum_dim(dim, keepdim, true)
    }

    /// Like [`f_max_dim`](Self::f_max_dim), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn max_dim(&self, dim: i64, keepdim: bool) -> (LazyTensor, LazyTensor) {
        self.f_max_dim(dim, keepdim).or_panic()
    }

    /// The minimum along `dim` and its position, as tch's `min_dim` (a `topk` of the smallest
    /// one; see [`f_max_dim`](Self::f_max_dim)).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension or an empty one.
    #[lazy_only]
    pub fn f_min_dim(&self, dim: i64, keepdim: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        self.extremum_dim(dim, keepdim, false)
    }

    /// Like [`f_min_dim`](Self::f_min_dim), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn min_dim(&self, dim: i64, keepdim: bool) -> (LazyTensor, LazyTensor) {
        self.f_min_dim(dim, keepdim).or_panic()
    }

    fn extremum_dim(&self, dim: i64, keepdim: bool, largest: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        let name = if largest { "max_dim" } else { "min_dim" };
        if let Some(t) = self.eager_value() {
            let (values, indices) = if largest { t.f_max_dim(dim, keepdim) } else { t.f_min_dim(dim, keepdim) }
                .map_err(super::eager_err(name))?;
            return Ok((LazyTensor::from_eager(values), LazyTensor::from_eager(indices)));
        }
        let shape = &self.node().meta.shape;
        let d = shape::wrap_dim(dim, shape.len().max(1)).map_err(|r| arg(name, shape, r))?;
        if shape.get(d) == Some(&0) {
            return Err(arg(name, shape, format!("dimension {d} is empty: it has no {}", &name[..3])));
        }
        let (values, indices) = self.f_topk(1, d as i64, largest, true)?;
        if keepdim || shape.is_empty() {
            return Ok((values, indices));
        }
        Ok((values.f_squeeze_dim(d as i64)?, indices.f_squeeze_dim(d as i64)?))
    }

    /// Running products along `dim`, as tch's `cumprod` (in `kind` when given; integers multiply
    /// as `Int64`), with libtorch's gradient (exact where the input has zeros). Along the batch
    /// dimension it multiplies earlier samples into later ones (refused for a split).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension.
    pub fn f_cumprod(&self, dim: i64, kind: impl Into<Option<Kind>>) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let kind = kind.into();
        let d = shape::wrap_dim(dim, m.shape.len().max(1)).map_err(|r| arg("cumprod", &m.shape, r))?;
        let out_kind = kind.unwrap_or(if shape::is_integral(m.kind) { Kind::Int64 } else { m.kind });
        let (flow, mut mixes) = same_shape_flow("cumprod", n, Linearity::Nonlinear)?;
        if let Some(bd) = m.batch().filter(|bd| bd.dim == d) {
            mixes = Some(format!("multiplies earlier samples into later ones along the batch dimension {}", bd.dim));
        }
        let op = Cumprod { dim: d as i64, kind };
        Ok(Record::new(op, inputs_of([n]), m.shape.clone(), out_kind, m.device).flow((flow, mixes)).finish())
    }

    /// The entries sorted along `dim` (ascending unless `descending`) and their positions, as
    /// tch's `sort`: the values carry the gradient, the positions (`Int64`) none. Along the
    /// batch dimension it compares samples (refused for a split).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension.
    #[lazy_only]
    pub fn f_sort(&self, dim: i64, descending: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        if let Some(t) = self.eager_value() {
            let (values, indices) = t.f_sort(dim, descending).map_err(super::eager_err("sort"))?;
            return Ok((LazyTensor::from_eager(values), LazyTensor::from_eager(indices)));
        }
        self.f_sort_impl(None, dim, descending)
    }

    /// Like [`f_sort`](Self::f_sort), as tch's `sort_stable`: with `stable`, equal entries keep
    /// their order.
    ///
    /// # Errors
    /// As [`f_sort`](Self::f_sort).
    #[lazy_only]
    pub fn f_sort_stable(
        &self,
        stable: bool,
        dim: i64,
        descending: bool,
    ) -> Result<(LazyTensor, LazyTensor), LazyError> {
        if let Some(t) = self.eager_value() {
            let (values, indices) = t.f_sort_stable(stable, dim, descending).map_err(super::eager_err("sort"))?;
            return Ok((LazyTensor::from_eager(values), LazyTensor::from_eager(indices)));
        }
        self.f_sort_impl(Some(stable), dim, descending)
    }

    fn f_sort_impl(
        &self,
        stable: Option<bool>,
        dim: i64,
        descending: bool,
    ) -> Result<(LazyTensor, LazyTensor), LazyError> {
        let n = self.node();
        let m = &n.meta;
        let name = if stable.is_some() { "sort_stable" } else { "sort" };
        let d = shape::wrap_dim(dim, m.shape.len().max(1)).map_err(|r| arg(name, &m.shape, r))?;
        let (flow, mut mixes) = same_shape_flow(name, n, Linearity::Nonlinear)?;
        if let Some(bd) = m.batch().filter(|bd| bd.dim == d) {
            mixes = Some(format!("compares samples along the batch dimension {}", bd.dim));
        }
        let record = |values: bool, kind: Kind| {
            let op = Sort { dim: d as i64, descending, stable, values };
            let r = Record::new(op, inputs_of([n]), m.shape.clone(), kind, m.device).flow((flow, mixes.clone()));
            if values { r } else { r.not_differentiable() }.finish()
        };
        Ok((record(true, m.kind), record(false, Kind::Int64)))
    }

    /// Like [`f_sort`](Self::f_sort), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn sort(&self, dim: i64, descending: bool) -> (LazyTensor, LazyTensor) {
        self.f_sort(dim, descending).or_panic()
    }

    /// Like [`f_sort_stable`](Self::f_sort_stable), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn sort_stable(&self, stable: bool, dim: i64, descending: bool) -> (LazyTensor, LazyTensor) {
        self.f_sort_stable(stable, dim, descending).or_panic()
    }

    /// The positions of the nonzero entries, one row per entry, as tch's `nonzero`: refused
    /// when recorded, since how many rows there are depends on the values, which a plan cannot
    /// know before running.
    ///
    /// # Errors
    /// Always [`LazyError::Unsupported`], saying what to do instead: keep the shape with a
    /// mask (`ne(0)` with `where_self`, `masked_fill`, or a product), or run it eagerly on
    /// [`to_tensor`](Self::to_tensor)'s result.
    pub fn f_nonzero(&self) -> Result<LazyTensor, LazyError> {
        Err(Self::data_dependent_shape("nonzero"))
    }

    /// The positions of the nonzero entries, as tch's `argwhere` (libtorch's `nonzero`):
    /// refused when recorded, as [`f_nonzero`](Self::f_nonzero).
    ///
    /// # Errors
    /// Always [`LazyError::Unsupported`], as [`f_nonzero`](Self::f_nonzero).
    pub fn f_argwhere(&self) -> Result<LazyTensor, LazyError> {
        Err(Self::data_dependent_shape("argwhere"))
    }

    /// The refusal of an op whose output's shape depends on its input's values.
    fn data_dependent_shape(op: &str) -> LazyError {
        LazyError::Unsupported {
            op: op.into(),
            reason: format!(
                "its output has one row per nonzero entry, a shape that depends on the values and that no plan \
                 can know before running; keep the shape fixed with a mask instead (x.ne(0) with where_self, \
                 masked_fill, or a product), or call {op} eagerly on the value of to_tensor()"
            ),
        }
    }

    /// Running sums along `dim`, as tch's `cumsum` (in `kind` when given; integers sum as
    /// `Int64`). Along the batch dimension it adds up earlier samples (refused for a split).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension.
    pub fn f_cumsum(&self, dim: i64, kind: impl Into<Option<Kind>>) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let kind = kind.into();
        let d = shape::wrap_dim(dim, m.shape.len().max(1)).map_err(|r| arg("cumsum", &m.shape, r))?;
        let out_kind = kind.unwrap_or(if shape::is_integral(m.kind) { Kind::Int64 } else { m.kind });
        let (flow, mut mixes) = same_shape_flow("cumsum", n, Linearity::Nonlinear)?;
        if let Some(bd) = m.batch().filter(|bd| bd.dim == d) {
            mixes = Some(format!("sums earlier samples into later ones along the batch dimension {}", bd.dim));
        }
        let op = Cumsum { dim: d as i64, kind };
        Ok(Record::new(op, inputs_of([n]), m.shape.clone(), out_kind, m.device).flow((flow, mixes)).finish())
    }

    /// The position of the largest entry along `dim` (of the value flattened when `None`), as
    /// tch's `argmax`: `Int64`, no gradient. Along the batch dimension, or flattened, it
    /// compares samples (refused for a split).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension or an empty one.
    pub fn f_argmax(&self, dim: impl Into<Option<i64>>, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_arg_extreme(true, dim.into(), keepdim)
    }

    /// The position of the smallest entry, as [`f_argmax`](Self::f_argmax) and tch's `argmin`.
    ///
    /// # Errors
    /// As [`f_argmax`](Self::f_argmax).
    pub fn f_argmin(&self, dim: impl Into<Option<i64>>, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_arg_extreme(false, dim.into(), keepdim)
    }

    /// The share of rows whose largest logit is at the target, as tch's `accuracy_for_logits`
    /// (`argmax(-1) == targets`, as `Float`, averaged). No gradient; over the batch it is a
    /// mean, combined exactly across micro-batches.
    ///
    /// # Errors
    /// As [`f_argmax`](Self::f_argmax) and `eq_tensor` for targets that do not fit.
    #[lazy_only]
    pub fn f_accuracy_for_logits(&self, targets: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_argmax(-1, false)?.f_eq_tensor(targets)?.f_to_kind(Kind::Float)?.f_mean(Kind::Float)
    }

    fn f_arg_extreme(&self, max: bool, dim: Option<i64>, keepdim: bool) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let op = ArgExtreme { max, dim, keepdim };
        let name = op.name();
        let a = |r: String| arg(name, &m.shape, r);
        let (out, reduced) = match dim {
            None => {
                if m.shape.contains(&0) {
                    return Err(a("cannot take it of an empty tensor".into()));
                }
                (if keepdim { std::iter::repeat_n(1, m.shape.len()).collect() } else { Dims::new() }, None)
            }
            Some(dim) => {
                let d = if m.shape.is_empty() {
                    shape::wrap_dim(dim, 1).map_err(a)?
                } else {
                    shape::wrap_dim(dim, m.shape.len()).map_err(a)?
                };
                if m.shape.get(d) == Some(&0) {
                    return Err(a(format!("dimension {d} is empty")));
                }
                let mut out = m.shape.clone();
                if !out.is_empty() {
                    if keepdim {
                        out[d] = 1;
                    } else {
                        out.remove(d);
                    }
                }
                (out, Some(d))
            }
        };
        let flow = match (m.flow, reduced) {
            (Flow::PerSample(bd), Some(d)) if d != bd.dim => (Flow::PerSample(kept_batch(bd, &[d], keepdim)), None),
            (Flow::PerSample(bd), _) => (
                Flow::Opaque,
                Some(format!("`{name}` compares entries across samples (the batch dimension {})", bd.dim)),
            ),
            (Flow::Fixed, _) => (Flow::Fixed, None),
            (_, _) => (Flow::Opaque, Some(format!("`{name}` of a value combined over the batch"))),
        };
        Ok(Record::new(op, inputs_of([n]), out, Kind::Int64, m.device).flow(flow).not_differentiable().finish())
    }

    /// The sum of all elements (optionally in `kind`). Over the batch, micro-batch sums add up.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_sum(&self, kind: impl Into<Option<Kind>>) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Sum, None, false, kind.into())
    }

    /// The sum over `dims` (tch's `sum_dim_intlist`).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad or repeated dimensions.
    pub fn f_sum_dim_intlist(
        &self,
        dims: impl IntListOption,
        keepdim: bool,
        kind: impl Into<Option<Kind>>,
    ) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Sum, self.dims_or_all(dims.as_option(), keepdim).as_deref(), keepdim, kind.into())
    }

    /// The mean of all elements. Over the batch, each micro-batch is weighted by its share, so
    /// the result is the full-batch mean.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for an integer tensor without a floating `kind`.
    pub fn f_mean(&self, kind: impl Into<Option<Kind>>) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Mean, None, false, kind.into())
    }

    /// The mean over `dims` (tch's `mean_dim`).
    ///
    /// # Errors
    /// As [`f_mean`](Self::f_mean), and bad dimensions.
    pub fn f_mean_dim(
        &self,
        dims: impl IntListOption,
        keepdim: bool,
        kind: impl Into<Option<Kind>>,
    ) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Mean, self.dims_or_all(dims.as_option(), keepdim).as_deref(), keepdim, kind.into())
    }

    /// The maximum over `dims` (tch's `amax`). Over the batch it can be evaluated, not
    /// differentiated in micro-batches.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad dimensions or an empty one.
    pub fn f_amax(&self, dims: impl IntList, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Amax, Some(dims.as_slice()), keepdim, None)
    }

    fn f_variance(
        &self,
        dims: Option<&[i64]>,
        unbiased: bool,
        keepdim: bool,
        sqrt: bool,
    ) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let name = if sqrt { "std" } else { "var" };
        if !shape::is_floating(m.kind) {
            return Err(kind_err(name, m.kind, &m.shape, "var and std need a floating-point tensor"));
        }
        let (reduced, dims, out) = self.reduction_shape(name, dims, keepdim)?;
        let what = if sqrt { "standard deviation" } else { "variance" };
        let flow = match m.flow {
            Flow::PerSample(bd) if reduced.contains(&bd.dim) => {
                (Flow::Opaque, Some(format!("takes a {what} over the batch dimension {}", bd.dim)))
            }
            Flow::PerSample(bd) => (Flow::PerSample(kept_batch(bd, &reduced, keepdim)), None),
            Flow::Sum | Flow::Max => (Flow::Opaque, Some(format!("takes a {what} of a value combined over the batch"))),
            other => (other, None),
        };
        let op = Variance { dims, unbiased, keepdim, sqrt };
        Ok(Record::new(op, inputs_of([n]), out, m.kind, m.device).flow(flow).finish())
    }

    /// The variance of all entries (tch's `var`), with Bessel's correction when `unbiased`.
    /// Over the batch it mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for an integer tensor.
    pub fn f_var(&self, unbiased: bool) -> Result<LazyTensor, LazyError> {
        self.f_variance(None, unbiased, false, false)
    }

    /// The variance over `dims` (all when `None`), as tch's `var_dim`. Over the batch dimension
    /// it mixes samples.
    ///
    /// # Errors
    /// As [`f_var`](Self::f_var), and bad dimensions.
    pub fn f_var_dim(&self, dim: impl IntListOption, unbiased: bool, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_variance(self.dims_or_all(dim.as_option(), keepdim).as_deref(), unbiased, keepdim, false)
    }

    /// The standard deviation of all entries (tch's `std`), as [`f_var`](Self::f_var).
    ///
    /// # Errors
    /// [`LazyError::Kind`] for an integer tensor.
    pub fn f_std(&self, unbiased: bool) -> Result<LazyTensor, LazyError> {
        self.f_variance(None, unbiased, false, true)
    }

    /// The standard deviation over `dims` (tch's `std_dim`), as [`f_var_dim`](Self::f_var_dim).
    ///
    /// # Errors
    /// As [`f_var_dim`](Self::f_var_dim).
    pub fn f_std_dim(&self, dim: impl IntListOption, unbiased: bool, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_variance(self.dims_or_all(dim.as_option(), keepdim).as_deref(), unbiased, keepdim, true)
    }

    /// `log(sum(exp(x)))` over `dims`, computed stably (tch's `logsumexp`). Over the batch
    /// dimension it mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad dimensions, [`LazyError::Kind`] for an integer tensor.
    pub fn f_logsumexp(&self, dims: impl IntList, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::LogSumExp, Some(dims.as_slice()), keepdim, None)
    }

    /// The maximum of all elements (tch's `max`).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for an empty tensor.
    pub fn f_max(&self) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Amax, None, false, None)
    }

    /// The minimum of all elements (tch's `min`), recorded as `-max(-x)`: the same values and
    /// gradient (shared evenly among ties); the negated copy is planned with it. Over the batch
    /// it compares samples: a split is refused.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for an empty tensor; [`LazyError::Kind`] for a boolean one.
    pub fn f_min(&self) -> Result<LazyTensor, LazyError> {
        self.f_neg()?.f_max()?.f_neg()
    }

    /// The minimum over `dims` (tch's `amin`), as [`f_min`](Self::f_min) is recorded.
    ///
    /// # Errors
    /// As [`f_amax`](Self::f_amax).
    pub fn f_amin(&self, dims: impl IntList, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_neg()?.f_amax(dims, keepdim)?.f_neg()
    }
}
