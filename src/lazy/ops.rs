//! The ops a graph can hold: how each runs on a micro-batch, and what each costs in memory
//! (what it allocates, what autograd keeps for its backward, which gradients are views).

use std::borrow::Cow;
use std::rc::Rc;

use tch::{Kind, Reduction, TchError, Tensor};

use super::custom::{CustomOp, Saves};
use super::graph::{Meta, Node, Param};
use super::scratch::{self, ReduceStaging};
use super::shape;

/// Unary elementwise ops.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Unary {
    Relu,
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Neg,
    Sqrt,
    Abs,
    /// `approximate`: `"none"` or `"tanh"`, as tch's `gelu` takes it.
    Gelu(String),
}

/// Binary elementwise ops (tensor with tensor, or tensor with scalar).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Binary {
    pub(crate) fn is_comparison(self) -> bool {
        matches!(self, Binary::Eq | Binary::Ne | Binary::Lt | Binary::Le | Binary::Gt | Binary::Ge)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
            Binary::Pow => "pow",
            Binary::Maximum => "maximum",
            Binary::Minimum => "minimum",
            Binary::Eq => "eq",
            Binary::Ne => "ne",
            Binary::Lt => "lt",
            Binary::Le => "le",
            Binary::Gt => "gt",
            Binary::Ge => "ge",
        }
    }
}

/// Reductions over dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReduceOp {
    Sum,
    Mean,
    Amax,
}

/// One recorded operation. Shapes that depend on the batch are not stored here: they are the
/// node's [`Meta`] shape at the micro-batch size.
pub(crate) enum Op {
    /// A batched input, narrowed to each micro-batch along `dim`.
    Input {
        tensor: Tensor,
        dim: usize,
    },
    /// A fixed tensor: a parameter (`param` when it requires a gradient) or a constant.
    Leaf {
        tensor: Tensor,
        param: Option<Box<Param>>,
    },
    Unary(Unary),
    Binary(Binary),
    /// `x op scalar`, or `scalar op x` when `reversed`.
    Scalar {
        op: Binary,
        scalar: f64,
        reversed: bool,
    },
    Softmax {
        dim: i64,
        kind: Option<Kind>,
        log: bool,
    },
    Matmul,
    /// Inputs: x, weight, optional bias.
    Linear,
    /// Inputs: x, weight, optional bias.
    Conv2d {
        stride: [i64; 2],
        padding: [i64; 2],
        dilation: [i64; 2],
        groups: i64,
    },
    MaxPool2d {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
        dilation: [i64; 2],
        ceil_mode: bool,
    },
    AvgPool2d {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: Option<i64>,
    },
    AdaptiveAvgPool2d {
        output: [i64; 2],
    },
    /// Inputs: x, [weight], [bias], running mean, running var.
    BatchNorm {
        training: bool,
        momentum: f64,
        eps: f64,
        weight: bool,
        bias: bool,
    },
    /// Inputs: x, [weight], [bias].
    LayerNorm {
        normalized_shape: Vec<i64>,
        eps: f64,
        weight: bool,
        bias: bool,
    },
    Dropout {
        p: f64,
        train: bool,
    },
    /// Inputs: weight, indices.
    Embedding {
        padding_idx: i64,
        scale_grad_by_freq: bool,
    },
    /// A view to the node's shape (no copy).
    View,
    /// A reshape that copies (the input's strides allow no view).
    Reshape,
    Transpose {
        dim0: i64,
        dim1: i64,
    },
    Permute {
        dims: Vec<i64>,
    },
    Unsqueeze {
        dim: i64,
    },
    Squeeze {
        dims: Vec<i64>,
    },
    Narrow {
        dim: i64,
        start: i64,
        length: i64,
    },
    ToKind {
        kind: Kind,
    },
    Contiguous,
    Cat {
        dim: i64,
    },
    Reduce {
        op: ReduceOp,
        dims: Option<Vec<i64>>,
        keepdim: bool,
        kind: Option<Kind>,
    },
    /// Inputs: logits, targets. Mean over non-ignored targets.
    CrossEntropy {
        ignore_index: i64,
    },
    /// Inputs: log-probabilities, targets, optional class weights.
    NllLoss {
        reduction: Reduction,
        ignore_index: i64,
    },
    /// Inputs: input, target.
    MseLoss {
        reduction: Reduction,
    },
    Custom(Rc<CustomOp>),
}

/// Scratch space of an op while it runs, besides inputs and outputs.
#[derive(Default)]
pub(crate) struct Scratch {
    /// Elements `(per sample, fixed)` in the input's kind, forward and backward.
    pub(crate) forward: (u64, u64),
    pub(crate) backward: (u64, u64),
    /// Staging buffers of CUDA reductions, each with whether it is taken in the backward.
    pub(crate) staged: Vec<(bool, ReduceStaging)>,
}

/// What a running op needs besides its inputs.
pub(crate) struct RunCx {
    /// First sample of the micro-batch.
    pub(crate) start: i64,
    /// Samples in the micro-batch.
    pub(crate) b: i64,
    /// Multiplier of an additive scalar (`x + s`): a sum over micro-batches must add `s` once.
    pub(crate) scalar_scale: f64,
}

fn opt<'a>(t: Option<&&'a Tensor>) -> Option<&'a Tensor> {
    t.copied()
}

impl Op {
    /// The op's name, as tch calls the method.
    pub(crate) fn name(&self) -> &str {
        match self {
            Op::Custom(c) => c.name(),
            _ => self.builtin_name(),
        }
    }

    /// The name, without borrowing the op (built-in names are static: no allocation).
    pub(crate) fn label(&self) -> Cow<'static, str> {
        match self {
            Op::Custom(c) => Cow::Owned(c.name().to_string()),
            _ => Cow::Borrowed(self.builtin_name()),
        }
    }

    fn builtin_name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Leaf { .. } => "leaf",
            Op::Unary(u) => match u {
                Unary::Relu => "relu",
                Unary::Sigmoid => "sigmoid",
                Unary::Tanh => "tanh",
                Unary::Exp => "exp",
                Unary::Log => "log",
                Unary::Neg => "neg",
                Unary::Sqrt => "sqrt",
                Unary::Abs => "abs",
                Unary::Gelu(_) => "gelu",
            },
            Op::Binary(b) => b.name(),
            Op::Scalar { op, reversed, .. } => match (op, reversed) {
                (Binary::Add, _) => "add_scalar",
                (Binary::Sub, false) => "sub_scalar",
                (Binary::Sub, true) => "rsub_scalar",
                (Binary::Mul, _) => "mul_scalar",
                (Binary::Div, false) => "div_scalar",
                (Binary::Div, true) => "rdiv_scalar",
                (Binary::Pow, _) => "pow_scalar",
                (other, _) => other.name(),
            },
            Op::Softmax { log: false, .. } => "softmax",
            Op::Softmax { log: true, .. } => "log_softmax",
            Op::Matmul => "matmul",
            Op::Linear => "linear",
            Op::Conv2d { .. } => "conv2d",
            Op::MaxPool2d { .. } => "max_pool2d",
            Op::AvgPool2d { .. } => "avg_pool2d",
            Op::AdaptiveAvgPool2d { .. } => "adaptive_avg_pool2d",
            Op::BatchNorm { .. } => "batch_norm",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Dropout { .. } => "dropout",
            Op::Embedding { .. } => "embedding",
            Op::View => "view",
            Op::Reshape => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Permute { .. } => "permute",
            Op::Unsqueeze { .. } => "unsqueeze",
            Op::Squeeze { .. } => "squeeze",
            Op::Narrow { .. } => "narrow",
            Op::ToKind { .. } => "to_kind",
            Op::Contiguous => "contiguous",
            Op::Cat { .. } => "cat",
            Op::Reduce { op: ReduceOp::Sum, .. } => "sum",
            Op::Reduce { op: ReduceOp::Mean, .. } => "mean",
            Op::Reduce { op: ReduceOp::Amax, .. } => "amax",
            Op::CrossEntropy { .. } => "cross_entropy_for_logits",
            Op::NllLoss { .. } => "nll_loss",
            Op::MseLoss { .. } => "mse_loss",
            Op::Custom(_) => "custom",
        }
    }

    /// A stable tag for fingerprints.
    pub(crate) fn tag(&self) -> u64 {
        crate::hash::hash_bytes(0, self.name().as_bytes())
    }

    /// Runs the op on one micro-batch; `meta` is the node's, `ins` its inputs' values.
    pub(crate) fn run(&self, meta: &Meta, ins: &[&Tensor], cx: &RunCx) -> Result<Tensor, TchError> {
        let x = || ins[0];
        Ok(match self {
            Op::Input { tensor, dim } => tensor.f_narrow(*dim as i64, cx.start, cx.b)?,
            Op::Leaf { tensor, .. } => tensor.shallow_clone(),
            Op::Unary(u) => match u {
                Unary::Relu => x().f_relu()?,
                Unary::Sigmoid => x().f_sigmoid()?,
                Unary::Tanh => x().f_tanh()?,
                Unary::Exp => x().f_exp()?,
                Unary::Log => x().f_log()?,
                Unary::Neg => x().f_neg()?,
                Unary::Sqrt => x().f_sqrt()?,
                Unary::Abs => x().f_abs()?,
                Unary::Gelu(approximate) => x().f_gelu(approximate)?,
            },
            Op::Binary(op) => {
                let (a, b) = (ins[0], ins[1]);
                match op {
                    Binary::Add => a.f_add(b)?,
                    Binary::Sub => a.f_sub(b)?,
                    Binary::Mul => a.f_mul(b)?,
                    Binary::Div => a.f_div(b)?,
                    Binary::Pow => a.f_pow(b)?,
                    Binary::Maximum => a.f_maximum(b)?,
                    Binary::Minimum => a.f_minimum(b)?,
                    Binary::Eq => a.f_eq_tensor(b)?,
                    Binary::Ne => a.f_ne_tensor(b)?,
                    Binary::Lt => a.f_lt_tensor(b)?,
                    Binary::Le => a.f_le_tensor(b)?,
                    Binary::Gt => a.f_gt_tensor(b)?,
                    Binary::Ge => a.f_ge_tensor(b)?,
                }
            }
            Op::Scalar { op, scalar, reversed } => {
                let s = *scalar;
                let a = x();
                match (op, reversed) {
                    (Binary::Add, _) => a.f_add_scalar(s * cx.scalar_scale)?,
                    (Binary::Sub, false) => a.f_sub_scalar(s * cx.scalar_scale)?,
                    (Binary::Sub, true) => a.f_rsub_scalar(s * cx.scalar_scale)?,
                    (Binary::Mul, _) => a.f_mul_scalar(s)?,
                    (Binary::Div, false) => a.f_div_scalar(s)?,
                    // As Python's `s / x`: a reciprocal times the scalar.
                    (Binary::Div, true) => a.f_reciprocal()?.f_mul_scalar(s)?,
                    (Binary::Pow, _) => a.f_pow_tensor_scalar(s)?,
                    (Binary::Eq, _) => a.f_eq(s)?,
                    (Binary::Ne, _) => a.f_ne(s)?,
                    (Binary::Lt, _) => a.f_lt(s)?,
                    (Binary::Le, _) => a.f_le(s)?,
                    (Binary::Gt, _) => a.f_gt(s)?,
                    (Binary::Ge, _) => a.f_ge(s)?,
                    (Binary::Maximum | Binary::Minimum, _) => unreachable!("not recorded with a scalar"),
                }
            }
            Op::Softmax { dim, kind, log: false } => x().f_softmax(*dim, *kind)?,
            Op::Softmax { dim, kind, log: true } => x().f_log_softmax(*dim, *kind)?,
            Op::Matmul => ins[0].f_matmul(ins[1])?,
            Op::Linear => ins[0].f_linear(ins[1], opt(ins.get(2)))?,
            Op::Conv2d { stride, padding, dilation, groups } => {
                ins[0].f_conv2d(ins[1], opt(ins.get(2)), stride, padding, dilation, *groups)?
            }
            Op::MaxPool2d { kernel, stride, padding, dilation, ceil_mode } => {
                x().f_max_pool2d(kernel, stride, padding, dilation, *ceil_mode)?
            }
            Op::AvgPool2d { kernel, stride, padding, ceil_mode, count_include_pad, divisor_override } => {
                x().f_avg_pool2d(kernel, stride, padding, *ceil_mode, *count_include_pad, *divisor_override)?
            }
            Op::AdaptiveAvgPool2d { output } => x().f_adaptive_avg_pool2d(output)?,
            Op::BatchNorm { training, momentum, eps, weight, bias } => {
                let mut rest = ins[1..].iter().copied();
                let w = if *weight { rest.next() } else { None };
                let b = if *bias { rest.next() } else { None };
                let (mean, var) = (rest.next(), rest.next());
                Tensor::f_batch_norm(x(), w, b, mean, var, *training, *momentum, *eps, true)?
            }
            Op::LayerNorm { normalized_shape, eps, weight, bias } => {
                let mut rest = ins[1..].iter().copied();
                let w = if *weight { rest.next() } else { None };
                let b = if *bias { rest.next() } else { None };
                Tensor::f_layer_norm(x(), normalized_shape.as_slice(), w, b, *eps, true)?
            }
            Op::Dropout { p, train } => x().f_dropout(*p, *train)?,
            Op::Embedding { padding_idx, scale_grad_by_freq } => {
                Tensor::f_embedding(ins[0], ins[1], *padding_idx, *scale_grad_by_freq, false)?
            }
            Op::View => x().f_view(meta.shape_at(cx.b).as_slice())?,
            // Recorded as a copy (the full batch's strides allowed no view), so later views were
            // recorded against a contiguous result: a micro-batch's strides can let libtorch
            // return a strided view instead, which those views cannot take.
            Op::Reshape => x().f_reshape(meta.shape_at(cx.b).as_slice())?.f_contiguous()?,
            Op::Transpose { dim0, dim1 } => x().f_transpose(*dim0, *dim1)?,
            Op::Permute { dims } => x().f_permute(dims.as_slice())?,
            Op::Unsqueeze { dim } => x().f_unsqueeze(*dim)?,
            Op::Squeeze { dims } => x().f_squeeze_dims(dims.as_slice())?,
            Op::Narrow { dim, start, length } => x().f_narrow(*dim, *start, *length)?,
            Op::ToKind { kind } => x().f_to_kind(*kind)?,
            Op::Contiguous => x().f_contiguous()?,
            Op::Cat { dim } => Tensor::f_cat(ins, *dim)?,
            Op::Reduce { op, dims, keepdim, kind } => reduce(x(), *op, dims.as_deref(), *keepdim, *kind)?,
            Op::CrossEntropy { ignore_index } => {
                x().f_log_softmax(-1, None)?.f_nll_loss(ins[1], None::<&Tensor>, Reduction::Mean, *ignore_index)?
            }
            Op::NllLoss { reduction, ignore_index } => {
                x().f_nll_loss(ins[1], opt(ins.get(2)), *reduction, *ignore_index)?
            }
            Op::MseLoss { reduction } => x().f_mse_loss(ins[1], *reduction)?,
            Op::Custom(c) => c.run(ins)?,
        })
    }

    /// Whether autograd's graph for this op keeps input `i` alive until its backward, given
    /// which inputs require a gradient. Only asked when the output requires a gradient.
    pub(crate) fn saves_input(&self, i: usize, inputs: &[Rc<Node>]) -> bool {
        let other_requires = |j: usize| inputs.get(j).is_some_and(|n| n.meta.requires_grad);
        match self {
            Op::Unary(u) => i == 0 && matches!(u, Unary::Log | Unary::Abs | Unary::Gelu(_)),
            Op::Binary(op) => match op {
                Binary::Add | Binary::Sub => false,
                Binary::Mul => other_requires(1 - i),
                Binary::Div => (i == 1 && (other_requires(0) || other_requires(1))) || (i == 0 && other_requires(1)),
                Binary::Pow | Binary::Maximum | Binary::Minimum => true,
                _ => false,
            },
            Op::Scalar { op: Binary::Pow, .. } => i == 0,
            Op::Matmul => other_requires(1 - i),
            Op::Linear | Op::Conv2d { .. } => match i {
                0 => other_requires(1),
                1 => other_requires(0),
                _ => false,
            },
            Op::MaxPool2d { .. } | Op::AvgPool2d { .. } | Op::AdaptiveAvgPool2d { .. } => i == 0,
            Op::BatchNorm { .. } | Op::LayerNorm { .. } => true,
            Op::Embedding { .. } => i == 1,
            Op::Reduce { op: ReduceOp::Amax, .. } => i == 0,
            Op::CrossEntropy { .. } => i == 1,
            Op::NllLoss { .. } | Op::MseLoss { .. } => true,
            Op::Custom(c) => matches!(c.saves_kind(), Saves::Inputs | Saves::InputsAndOutput),
            _ => false,
        }
    }

    /// Whether autograd keeps the output alive until this op's backward.
    pub(crate) fn saves_output(&self) -> bool {
        match self {
            Op::Unary(u) => matches!(u, Unary::Relu | Unary::Sigmoid | Unary::Tanh | Unary::Exp | Unary::Sqrt),
            Op::Binary(Binary::Pow) | Op::Softmax { .. } | Op::Reduce { op: ReduceOp::Amax, .. } => true,
            Op::Custom(c) => matches!(c.saves_kind(), Saves::Output | Saves::InputsAndOutput),
            _ => false,
        }
    }

    /// Whether the gradient for input `i` is a view of the output's gradient (no allocation).
    pub(crate) fn grad_aliases(&self, i: usize, inputs: &[Rc<Node>], meta: &Meta) -> bool {
        let same_shape = |j: usize| inputs.get(j).is_some_and(|n| n.meta.shape == meta.shape);
        match self {
            Op::View
            | Op::Transpose { .. }
            | Op::Permute { .. }
            | Op::Unsqueeze { .. }
            | Op::Squeeze { .. }
            | Op::Cat { .. }
            | Op::Contiguous
            | Op::Reduce { op: ReduceOp::Sum, .. } => true,
            Op::Reshape => false,
            Op::Binary(Binary::Add) => same_shape(i),
            Op::Binary(Binary::Sub) => i == 0 && same_shape(0),
            Op::Scalar { op: Binary::Add | Binary::Sub, reversed: false, .. } => true,
            Op::ToKind { kind } => inputs[0].meta.kind == *kind,
            Op::Dropout { p, train } => !*train || *p == 0.0,
            _ => false,
        }
    }

    /// A tensor the op allocates besides its output and autograd keeps for the backward (when
    /// the output requires a gradient): `(elements per sample, fixed elements, kind)`.
    pub(crate) fn saved_extra(&self, inputs: &[Rc<Node>], meta: &Meta) -> Option<(u64, u64, Kind)> {
        let input = &inputs.first()?.meta;
        match self {
            // Indices of the maxima, one int64 per output element.
            Op::MaxPool2d { .. } => {
                let (a, c) = meta.numel_parts();
                Some((a, c, Kind::Int64))
            }
            // The scaled Bernoulli mask, as large as the input (CPU path).
            Op::Dropout { p, train } if *train && *p > 0.0 => {
                let (a, c) = input.numel_parts();
                Some((a, c, input.kind))
            }
            // The log-probabilities between log_softmax and nll_loss.
            Op::CrossEntropy { .. } => {
                let (a, c) = input.numel_parts();
                Some((a, c, input.kind))
            }
            // The reciprocal between `1 / x` and the multiplication.
            Op::Scalar { op: Binary::Div, reversed: true, .. } => {
                let (a, c) = input.numel_parts();
                Some((a, c, input.kind))
            }
            // Mean and inverse standard deviation per normalized row (two of them).
            Op::LayerNorm { normalized_shape, .. } => {
                let rows = shape::numel(normalized_shape).max(1) as u64;
                let (a, c) = input.numel_parts();
                let stat = if input.kind == Kind::Double { Kind::Double } else { Kind::Float };
                Some((2 * a / rows, 2 * c / rows, stat))
            }
            _ => None,
        }
    }

    /// Scratch space the op's kernels take while it runs, forward and backward: elements in
    /// the input's kind, and CUDA reductions' staging buffers (see [`scratch`](super::scratch)).
    pub(crate) fn scratch(&self, inputs: &[Rc<Node>], meta: &Meta) -> Scratch {
        let on_cuda = meta.device.is_cuda();
        let mut scratch = Scratch::default();
        // A reduction of `of` (an output gradient in the backward) over the dimensions in `mask`.
        let mut stage = |backward: bool, of: &Meta, mask: u64| {
            if let Some(s) = ReduceStaging::new(&of.shape, of.batch(), mask, of.kind, of.device) {
                scratch.staged.push((backward, s));
            }
        };
        let requires = |j: usize| inputs.get(j).is_some_and(|n| n.meta.requires_grad);
        match self {
            Op::Conv2d { stride, padding, dilation, groups } => {
                let w = &inputs[1].meta.shape;
                let out = &meta.shape;
                if on_cuda && out.len() == 4 {
                    // cuDNN may reorder both operands (see `scratch`): their bytes, and a few MiB.
                    let ((ip, ic), (op, oc)) = (inputs[0].meta.numel_parts(), meta.numel_parts());
                    let elem = meta.kind.elt_size_in_bytes().max(1) as u64;
                    let (forward, backward) = scratch::CONV_WORKSPACE_FIXED;
                    scratch.forward = (ip + op, ic + oc + forward / elem);
                    scratch.backward = (ip + op, ic + oc + backward / elem);
                    // The bias gradient: the output gradient summed over N, H and W.
                    if requires(2) && meta.requires_grad {
                        stage(true, meta, shape::dims_mask([0, 2, 3]));
                    }
                    return scratch;
                }
                let one_by_one =
                    w[2] == 1 && w[3] == 1 && stride == &[1, 1] && padding == &[0, 0] && dilation == &[1, 1];
                if one_by_one {
                    return scratch;
                }
                // im2col: every input channel times every kernel position, per output pixel.
                let pixels = (out[out.len() - 1] * out[out.len() - 2]) as u64;
                let cols = (w[1] * groups * w[2] * w[3]) as u64 * pixels;
                let work = match meta.batch() {
                    Some(_) if out.len() == 4 => (cols, 0),
                    _ => (0, cols * if out.len() == 4 { out[0] as u64 } else { 1 }),
                };
                scratch.forward = work;
                scratch.backward = work;
            }
            Op::Matmul => {
                // A broadcast operand is expanded into a real copy before the batched product.
                let out = meta;
                let (oa, oc) = out.numel_parts();
                let mut total = (0, 0);
                for input in inputs {
                    let m = &input.meta;
                    if m.shape.len() >= 2 && out.shape.len() > 2 {
                        let own = shape::numel(&m.shape[m.shape.len().saturating_sub(2)..]) as u64;
                        let out_batch = shape::numel(&out.shape[..out.shape.len() - 2]).max(1) as u64;
                        let own_batch = shape::numel(&m.shape[..m.shape.len() - 2]).max(1) as u64;
                        if own_batch < out_batch {
                            let scale = own.max(1);
                            let rows = shape::numel(&out.shape[out.shape.len() - 2..]).max(1) as u64;
                            total.0 += oa / rows * scale;
                            total.1 += oc / rows * scale;
                        }
                    }
                }
                scratch.forward = total;
                scratch.backward = total;
            }
            // The bias gradient: the output gradient summed over every dimension but the last.
            Op::Linear if requires(2) && meta.requires_grad && !meta.shape.is_empty() => {
                stage(true, meta, shape::dims_mask(0..meta.shape.len() - 1));
            }
            // A broadcast operand's gradient: the output gradient summed over the broadcast
            // dimensions.
            Op::Binary(op) if !op.is_comparison() && meta.requires_grad => {
                for (k, input) in inputs.iter().enumerate().take(2) {
                    if requires(k) && input.meta.shape != meta.shape {
                        stage(true, meta, shape::broadcast_mask(&input.meta.shape, &meta.shape));
                    }
                }
            }
            Op::Reduce { dims, .. } => {
                let of = &inputs[0].meta;
                let rank = of.shape.len();
                // Checked when recorded: a wrapping error cannot happen here.
                let mask = match dims {
                    None => shape::dims_mask(0..rank),
                    Some(dims) => shape::wrap_dims(dims, rank).map_or(0, shape::dims_mask),
                };
                stage(false, of, mask);
            }
            _ => {}
        }
        scratch
    }

    /// Whether the op takes part in autograd at all.
    pub(crate) fn differentiable(&self) -> bool {
        !matches!(self, Op::Binary(b) | Op::Scalar { op: b, .. } if b.is_comparison())
    }
}

/// A reduction as tch runs it.
pub(crate) fn reduce(
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
    }
}
