//! Elementwise ops: activations and other unary functions, binary arithmetic and comparisons
//! (tensor with tensor, broadcasting, or with a scalar), and dropout.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{broadcast_flows, same_device, Linearity, Record};
use super::{arg, floating, kind_err, requires, same_shape_flow, shape_err};
use crate::lazy::error::LazyError;
use crate::lazy::graph::{KernelCall, Meta, Node, Operation, RunCx, Share};
use crate::lazy::shape;
use crate::lazy::LazyTensor;

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
    /// `x * sigmoid(x)`.
    Silu,
    /// `log(1 + e^x)` (tch's defaults: beta 1, threshold 20).
    Softplus,
    /// Slope 0.01 below 0, as tch's `leaky_relu`.
    LeakyRelu,
    /// `alpha = 1`, as tch's `elu`.
    Elu,
    Hardswish,
    Hardsigmoid,
    /// `min(max(x, 0), 6)`.
    Relu6,
    /// `x * tanh(softplus(x))`.
    Mish,
    Sin,
    Cos,
    /// `x²`.
    Square,
    /// `min(max(x, min), max)`, either bound optional (tch's `clamp`, `clamp_min`, `clamp_max`).
    Clamp {
        min: Option<f64>,
        max: Option<f64>,
    },
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// `1 / x`.
    Reciprocal,
    /// The error function.
    Erf,
    /// `log(sigmoid(x))`.
    LogSigmoid,
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

pub(crate) enum Pointwise {
    Unary(Unary),
    /// Operands: a, b.
    Binary(Binary),
    /// `x op scalar`, or `scalar op x` when `reversed`.
    Scalar {
        op: Binary,
        scalar: f64,
        reversed: bool,
    },
    Dropout {
        p: f64,
        train: bool,
        kind: DropoutKind,
    },
    /// Operands: x, mask (Bool, broadcast to x).
    MaskedFill {
        value: f64,
    },
    /// `condition ? x : y`. Operands: condition, x, y (broadcast together).
    Where,
    /// The lower (`tril`) or upper (`triu`) triangle of the last two dimensions.
    Triangle {
        upper: bool,
        diagonal: i64,
    },
}

impl Operation for Pointwise {
    fn name(&self) -> &'static str {
        match self {
            Pointwise::Unary(u) => match u {
                Unary::Relu => "relu",
                Unary::Sigmoid => "sigmoid",
                Unary::Tanh => "tanh",
                Unary::Exp => "exp",
                Unary::Log => "log",
                Unary::Neg => "neg",
                Unary::Sqrt => "sqrt",
                Unary::Abs => "abs",
                Unary::Gelu(_) => "gelu",
                Unary::Silu => "silu",
                Unary::Softplus => "softplus",
                Unary::LeakyRelu => "leaky_relu",
                Unary::Elu => "elu",
                Unary::Hardswish => "hardswish",
                Unary::Hardsigmoid => "hardsigmoid",
                Unary::Relu6 => "relu6",
                Unary::Mish => "mish",
                Unary::Sin => "sin",
                Unary::Cos => "cos",
                Unary::Square => "square",
                Unary::Clamp { min: Some(_), max: Some(_) } => "clamp",
                Unary::Clamp { min: Some(_), max: None } => "clamp_min",
                Unary::Clamp { min: None, .. } => "clamp_max",
                Unary::Rsqrt => "rsqrt",
                Unary::Reciprocal => "reciprocal",
                Unary::Erf => "erf",
                Unary::LogSigmoid => "log_sigmoid",
            },
            Pointwise::Binary(b) => b.name(),
            Pointwise::Scalar { op, reversed, .. } => match (op, reversed) {
                (Binary::Add, _) => "add_scalar",
                (Binary::Sub, false) => "sub_scalar",
                (Binary::Sub, true) => "rsub_scalar",
                (Binary::Mul, _) => "mul_scalar",
                (Binary::Div, false) => "div_scalar",
                (Binary::Div, true) => "rdiv_scalar",
                (Binary::Pow, _) => "pow_scalar",
                (other, _) => other.name(),
            },
            Pointwise::Dropout { kind, .. } => kind.name(),
            Pointwise::MaskedFill { .. } => "masked_fill",
            Pointwise::Where => "where_self",
            Pointwise::Triangle { upper: false, .. } => "tril",
            Pointwise::Triangle { upper: true, .. } => "triu",
        }
    }

    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        match self {
            Pointwise::Unary(u) => {
                let x = ins[0];
                match u {
                    Unary::Relu => x.f_relu(),
                    Unary::Sigmoid => x.f_sigmoid(),
                    Unary::Tanh => x.f_tanh(),
                    Unary::Exp => x.f_exp(),
                    Unary::Log => x.f_log(),
                    Unary::Neg => x.f_neg(),
                    Unary::Sqrt => x.f_sqrt(),
                    Unary::Abs => x.f_abs(),
                    Unary::Gelu(approximate) => x.f_gelu(approximate),
                    Unary::Silu => x.f_silu(),
                    Unary::Softplus => x.f_softplus(),
                    Unary::LeakyRelu => x.f_leaky_relu(),
                    Unary::Elu => x.f_elu(),
                    Unary::Hardswish => x.f_hardswish(),
                    Unary::Hardsigmoid => x.f_hardsigmoid(),
                    Unary::Relu6 => x.f_relu6(),
                    Unary::Mish => x.f_mish(),
                    Unary::Sin => x.f_sin(),
                    Unary::Cos => x.f_cos(),
                    Unary::Square => x.f_square(),
                    Unary::Clamp { min: Some(lo), max: Some(hi) } => x.f_clamp(*lo, *hi),
                    Unary::Clamp { min: Some(lo), max: None } => x.f_clamp_min(*lo),
                    Unary::Clamp { min: None, max: Some(hi) } => x.f_clamp_max(*hi),
                    Unary::Clamp { min: None, max: None } => Ok(x.shallow_clone()),
                    Unary::Rsqrt => x.f_rsqrt(),
                    Unary::Reciprocal => x.f_reciprocal(),
                    Unary::Erf => x.f_erf(),
                    Unary::LogSigmoid => x.f_log_sigmoid(),
                }
            }
            Pointwise::Binary(op) => {
                let (a, b) = (ins[0], ins[1]);
                match op {
                    Binary::Add => a.f_add(b),
                    Binary::Sub => a.f_sub(b),
                    Binary::Mul => a.f_mul(b),
                    Binary::Div => a.f_div(b),
                    Binary::Pow => a.f_pow(b),
                    Binary::Maximum => a.f_maximum(b),
                    Binary::Minimum => a.f_minimum(b),
                    Binary::Eq => a.f_eq_tensor(b),
                    Binary::Ne => a.f_ne_tensor(b),
                    Binary::Lt => a.f_lt_tensor(b),
                    Binary::Le => a.f_le_tensor(b),
                    Binary::Gt => a.f_gt_tensor(b),
                    Binary::Ge => a.f_ge_tensor(b),
                }
            }
            Pointwise::Scalar { op, scalar, reversed } => scalar_op(ins[0], *op, *scalar, *reversed),
            Pointwise::Dropout { p, train, kind } => match kind {
                DropoutKind::Plain => ins[0].f_dropout(*p, *train),
                DropoutKind::Feature => ins[0].f_feature_dropout(*p, *train),
                DropoutKind::Alpha => ins[0].f_alpha_dropout(*p, *train),
                DropoutKind::FeatureAlpha => ins[0].f_feature_alpha_dropout(*p, *train),
            },
            Pointwise::MaskedFill { value } => {
                let (x, mask) = (ins[0], ins[1]);
                x.f_masked_fill(mask, *value)
            }
            Pointwise::Where => {
                let (condition, x, y) = (ins[0], ins[1], ins[2]);
                x.f_where_self(condition, y)
            }
            Pointwise::Triangle { upper: false, diagonal } => ins[0].f_tril(*diagonal),
            Pointwise::Triangle { upper: true, diagonal } => ins[0].f_triu(*diagonal),
        }
    }

    fn differentiable(&self) -> bool {
        !matches!(self, Pointwise::Binary(b) | Pointwise::Scalar { op: b, .. } if b.is_comparison())
    }

    fn saves_input(&self, i: usize, inputs: &[Rc<Node>]) -> bool {
        let other_requires = |j: usize| requires(inputs, j);
        match self {
            Pointwise::Unary(u) => {
                i == 0
                    && matches!(
                        u,
                        Unary::Log
                            | Unary::Abs
                            | Unary::Gelu(_)
                            | Unary::Silu
                            | Unary::Softplus
                            | Unary::LeakyRelu
                            | Unary::Elu
                            | Unary::Hardswish
                            | Unary::Hardsigmoid
                            | Unary::Relu6
                            | Unary::Mish
                            | Unary::Sin
                            | Unary::Cos
                            | Unary::Square
                            | Unary::Clamp { .. }
                            | Unary::Erf
                            | Unary::LogSigmoid
                    )
            }
            Pointwise::Binary(op) => match op {
                Binary::Add | Binary::Sub => false,
                Binary::Mul => other_requires(1 - i),
                Binary::Div => (i == 1 && (other_requires(0) || other_requires(1))) || (i == 0 && other_requires(1)),
                Binary::Pow | Binary::Maximum | Binary::Minimum => true,
                _ => false,
            },
            Pointwise::Scalar { op: Binary::Pow, .. } => i == 0,
            // The mask, and the condition: where the gradient goes.
            Pointwise::MaskedFill { .. } => i == 1,
            Pointwise::Where => i == 0,
            _ => false,
        }
    }

    fn saves_output(&self) -> bool {
        match self {
            Pointwise::Unary(u) => matches!(
                u,
                Unary::Relu
                    | Unary::Sigmoid
                    | Unary::Tanh
                    | Unary::Exp
                    | Unary::Sqrt
                    | Unary::Rsqrt
                    | Unary::Reciprocal
            ),
            Pointwise::Binary(Binary::Pow) => true,
            _ => false,
        }
    }

    fn grad_aliases(&self, i: usize, inputs: &[Rc<Node>], meta: &Meta) -> bool {
        let same_shape = |j: usize| inputs.get(j).is_some_and(|n| n.meta.shape == meta.shape);
        match self {
            Pointwise::Binary(Binary::Add) => same_shape(i),
            Pointwise::Binary(Binary::Sub) => i == 0 && same_shape(0),
            Pointwise::Scalar { op: Binary::Add | Binary::Sub, reversed: false, .. } => true,
            Pointwise::Dropout { p, train, .. } => !*train || *p == 0.0,
            _ => false,
        }
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let Some(input) = inputs.first().map(|n| &n.meta) else { return };
        let (a, c) = input.numel_parts();
        match self {
            // The mask: as large as the input, or one value per sample and channel for the
            // feature forms.
            Pointwise::Dropout { p, train, kind } if *train && *p > 0.0 => {
                let per = kind.mask_fraction(&input.shape);
                calls.push(KernelCall::DropoutMask { elements: (a / per, c / per), kind: input.kind });
            }
            // The reciprocal between `1 / x` and the multiplication.
            Pointwise::Scalar { op: Binary::Div, reversed: true, .. } => {
                calls.push(KernelCall::Keeps { elements: (a, c), kind: input.kind })
            }
            Pointwise::Unary(Unary::LogSigmoid) => {
                calls.push(KernelCall::LogSigmoid { elements: (a, c), kind: input.kind })
            }
            _ => {}
        }
        let mut backward = (0, 0);
        // Backward formulas that are not one fused kernel: `grad * x.sgn()` and
        // `grad / (2 * result)` each make a temporary as large as the value.
        if matches!(self, Pointwise::Unary(Unary::Abs | Unary::Sqrt)) && meta.requires_grad {
            backward = meta.numel_parts();
        }
        // `grad * x.cos()`; `grad * -x.sin()`, `grad * 2x`, `-grad · y²` and `-grad · y³ / 2`
        // (two temporaries each); a clamp's backward keeps one boolean mask per bound.
        if let Pointwise::Unary(u) = self {
            if meta.requires_grad {
                let (a, c) = meta.numel_parts();
                let elem = meta.kind.elt_size_in_bytes().max(1) as u64;
                backward = match u {
                    Unary::Sin => (a, c),
                    Unary::Cos | Unary::Square | Unary::Reciprocal | Unary::Rsqrt => (2 * a, 2 * c),
                    // `grad * 2/√π · exp(-x²)`: four temporaries as large as the value.
                    Unary::Erf => (4 * a, 4 * c),
                    Unary::Clamp { min, max } => {
                        let masks = u64::from(min.is_some()) + u64::from(max.is_some());
                        ((masks * a).div_ceil(elem), (masks * c).div_ceil(elem))
                    }
                    _ => backward,
                };
            }
        }
        // `grad * (e * x.pow(e - 1))`: the power and its scaled copy, both as large as the value.
        if let Pointwise::Scalar { op: Binary::Pow, scalar, reversed: false } = self {
            if meta.requires_grad && *scalar != 0.0 {
                let (a, c) = meta.numel_parts();
                backward = (2 * a, 2 * c);
            }
        }
        let mut forward = (0, 0);
        // Alpha dropout is `x · mask + b`: the product is a temporary as large as the input,
        // and `b` is as large as the mask.
        if let Pointwise::Dropout { p, train: true, kind: kind @ (DropoutKind::Alpha | DropoutKind::FeatureAlpha) } =
            self
        {
            if *p > 0.0 {
                let (a, c) = meta.numel_parts();
                let per = kind.mask_fraction(&meta.shape);
                forward = (a + a / per, c + c / per);
            }
        }
        if forward != (0, 0) || backward != (0, 0) {
            calls.push(KernelCall::Temporaries { forward, backward });
        }
        // A broadcast operand's gradient: the output gradient summed over the broadcast
        // dimensions.
        if let Pointwise::Binary(op) = self {
            if !op.is_comparison() && meta.requires_grad {
                for (k, input) in inputs.iter().enumerate().take(2) {
                    if requires(inputs, k) && input.meta.shape != meta.shape {
                        let mask = shape::broadcast_mask(&input.meta.shape, &meta.shape);
                        calls.push(KernelCall::Reduction { of: meta, mask, backward: true });
                    }
                }
            }
        }
    }

    fn run_share(&self, ins: &[&Tensor], _node: &Node, share: &Share) -> Option<Result<Tensor, TchError>> {
        match self {
            // `sum + s`: the scalar must count once over all micro-batches.
            Pointwise::Scalar { op: op @ (Binary::Add | Binary::Sub), scalar, reversed } => {
                Some(scalar_op(ins[0], *op, scalar * share.frac, *reversed))
            }
            _ => None,
        }
    }

    fn adds_fixed(&self) -> bool {
        matches!(self, Pointwise::Binary(Binary::Add | Binary::Sub))
    }
}

fn scalar_op(a: &Tensor, op: Binary, s: f64, reversed: bool) -> Result<Tensor, TchError> {
    match (op, reversed) {
        (Binary::Add, _) => a.f_add_scalar(s),
        (Binary::Sub, false) => a.f_sub_scalar(s),
        (Binary::Sub, true) => a.f_rsub_scalar(s),
        (Binary::Mul, _) => a.f_mul_scalar(s),
        (Binary::Div, false) => a.f_div_scalar(s),
        // As Python's `s / x`: a reciprocal times the scalar.
        (Binary::Div, true) => a.f_reciprocal()?.f_mul_scalar(s),
        (Binary::Pow, _) => a.f_pow_tensor_scalar(s),
        (Binary::Eq, _) => a.f_eq(s),
        (Binary::Ne, _) => a.f_ne(s),
        (Binary::Lt, _) => a.f_lt(s),
        (Binary::Le, _) => a.f_le(s),
        (Binary::Gt, _) => a.f_gt(s),
        (Binary::Ge, _) => a.f_ge(s),
        (Binary::Maximum | Binary::Minimum, _) => unreachable!("not recorded with a scalar"),
    }
}

#[toma_macros::tensor_methods(PointwiseOps, "Elementwise ops: activations, arithmetic and comparisons, dropout (a family of [`TensorOps`](crate::lazy::TensorOps)).")]
impl LazyTensor {
    fn f_unary(&self, u: Unary) -> Result<LazyTensor, LazyError> {
        let op = Pointwise::Unary(u);
        let name = op.name();
        let n = &self.node;
        let kind = match op {
            Pointwise::Unary(Unary::Relu | Unary::Neg | Unary::Abs | Unary::Square) => n.meta.kind,
            Pointwise::Unary(Unary::Gelu(ref approximate)) => {
                floating(name, n)?;
                if approximate != "none" && approximate != "tanh" {
                    return Err(arg(
                        name,
                        &n.meta.shape,
                        format!("approximate must be \"none\" or \"tanh\", got {approximate:?}"),
                    ));
                }
                n.meta.kind
            }
            // libtorch has no integer kernels for these.
            Pointwise::Unary(
                Unary::Silu
                | Unary::Softplus
                | Unary::LeakyRelu
                | Unary::Elu
                | Unary::Hardswish
                | Unary::Hardsigmoid
                | Unary::Relu6
                | Unary::Mish
                | Unary::LogSigmoid,
            ) => {
                floating(name, n)?;
                n.meta.kind
            }
            // Floats from integers (for `clamp`: an `f64` bound on an integer tensor gives floats,
            // as in libtorch).
            _ => shape::scalar_result_kind(n.meta.kind),
        };
        let linearity =
            if matches!(op, Pointwise::Unary(Unary::Neg)) { Linearity::Additive } else { Linearity::Nonlinear };
        let flow = same_shape_flow(name, n, linearity)?;
        Ok(Record::new(op, vec![n.clone()], n.meta.shape.clone(), kind, n.meta.device).flow(flow).finish())
    }

    /// `max(x, 0)`.
    ///
    /// # Errors
    /// None in practice; `Result` for symmetry with the other ops.
    pub fn f_relu(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Relu)
    }
    /// The logistic sigmoid.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_sigmoid(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Sigmoid)
    }
    /// The hyperbolic tangent.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_tanh(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Tanh)
    }
    /// `e^x`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_exp(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Exp)
    }
    /// The natural logarithm.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_log(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Log)
    }
    /// `-x`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_neg(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Neg)
    }
    /// The square root.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_sqrt(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Sqrt)
    }
    /// The absolute value.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_abs(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Abs)
    }
    /// GELU; `approximate` is `"none"` or `"tanh"`, as in tch.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor, [`LazyError::Argument`] for another
    /// `approximate`.
    pub fn f_gelu(&self, approximate: &str) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Gelu(approximate.to_string()))
    }
    /// SiLU (swish): `x * sigmoid(x)`.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_silu(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Silu)
    }
    /// Softplus, `log(1 + e^x)`, with tch's defaults (beta 1; linear above 20).
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_softplus(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Softplus)
    }
    /// Leaky ReLU with tch's slope (0.01).
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_leaky_relu(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::LeakyRelu)
    }
    /// ELU with tch's `alpha` (1).
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_elu(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Elu)
    }
    /// Hard swish, `x * relu6(x + 3) / 6`.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_hardswish(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Hardswish)
    }
    /// Hard sigmoid, `relu6(x + 3) / 6`.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_hardsigmoid(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Hardsigmoid)
    }
    /// `min(max(x, 0), 6)`.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_relu6(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Relu6)
    }
    /// Mish, `x * tanh(softplus(x))`.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_mish(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Mish)
    }
    /// The sine.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_sin(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Sin)
    }
    /// The cosine.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_cos(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Cos)
    }
    /// `x²`, as tch's `square`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_square(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Square)
    }
    /// `min(max(x, min), max)`, as tch's `clamp` (the gradient is 0 where a bound applies).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a NaN bound.
    pub fn f_clamp(&self, min: f64, max: f64) -> Result<LazyTensor, LazyError> {
        self.f_clamp_impl(Some(min), Some(max))
    }
    /// `max(x, min)`, as tch's `clamp_min`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a NaN bound.
    pub fn f_clamp_min(&self, min: f64) -> Result<LazyTensor, LazyError> {
        self.f_clamp_impl(Some(min), None)
    }
    /// `min(x, max)`, as tch's `clamp_max`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a NaN bound.
    pub fn f_clamp_max(&self, max: f64) -> Result<LazyTensor, LazyError> {
        self.f_clamp_impl(None, Some(max))
    }
    /// `1 / sqrt(x)`, as tch's `rsqrt`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_rsqrt(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Rsqrt)
    }
    /// `1 / x`, as tch's `reciprocal`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_reciprocal(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Reciprocal)
    }
    /// The error function, as tch's `erf`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_erf(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Erf)
    }
    /// `log(sigmoid(x))`, as tch's `log_sigmoid`.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for an integer tensor.
    pub fn f_log_sigmoid(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::LogSigmoid)
    }
    fn f_clamp_impl(&self, min: Option<f64>, max: Option<f64>) -> Result<LazyTensor, LazyError> {
        if min.is_some_and(f64::is_nan) || max.is_some_and(f64::is_nan) {
            return Err(arg("clamp", &self.node.meta.shape, format!("a bound is NaN: min {min:?}, max {max:?}")));
        }
        self.f_unary(Unary::Clamp { min, max })
    }

    /// `value` where `mask` (Bool, broadcast to `self`'s shape) is true, `self` elsewhere, as
    /// tch's `masked_fill`.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a mask that is not Bool, [`LazyError::Shape`] for one that does
    /// not broadcast to `self`, [`LazyError::Device`], [`LazyError::Batch`] for a fixed mask
    /// with the batch's size along the batch dimension.
    pub fn f_masked_fill(&self, mask: impl IntoLazy, value: f64) -> Result<LazyTensor, LazyError> {
        let mask = mask.into_lazy();
        let (x, m) = (&self.node, &mask.node);
        let name = "masked_fill";
        let device = same_device(name, &[x, m])?;
        if m.meta.kind != Kind::Bool {
            return Err(kind_err(name, m.meta.kind, &m.meta.shape, "the mask must be Bool"));
        }
        match shape::broadcast(&x.meta.shape, &m.meta.shape) {
            Ok(b) if b == x.meta.shape => {}
            _ => return Err(shape_err(name, &x.meta.shape, &m.meta.shape, "the mask must broadcast to the tensor")),
        }
        let flow = broadcast_flows(name, &[x, m], &x.meta.shape, Linearity::Nonlinear)?;
        let op = Pointwise::MaskedFill { value };
        Ok(Record::new(op, vec![x.clone(), m.clone()], x.meta.shape.clone(), x.meta.kind, device).flow(flow).finish())
    }

    /// `self` where `condition` is true, `other` elsewhere, broadcast together (tch's
    /// `where_self`, PyTorch's `torch.where(condition, self, other)`).
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a condition that is not Bool, [`LazyError::Shape`] when the shapes
    /// do not broadcast, [`LazyError::Device`], [`LazyError::Batch`].
    pub fn f_where_self(&self, condition: impl IntoLazy, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let (condition, other) = (condition.into_lazy(), other.into_lazy());
        let (c, x, y) = (&condition.node, &self.node, &other.node);
        let name = "where_self";
        let device = same_device(name, &[x, c, y])?;
        if c.meta.kind != Kind::Bool {
            return Err(kind_err(name, c.meta.kind, &c.meta.shape, "the condition must be Bool"));
        }
        let out = shape::broadcast(&x.meta.shape, &y.meta.shape)
            .and_then(|xy| shape::broadcast(&xy, &c.meta.shape))
            .map_err(|r| shape_err(name, &x.meta.shape, &y.meta.shape, r))?;
        let kind = shape::result_kind(x.meta.kind, x.meta.shape.len(), y.meta.kind, y.meta.shape.len());
        let flow = broadcast_flows(name, &[c, x, y], &out, Linearity::Nonlinear)?;
        Ok(Record::new(Pointwise::Where, vec![c.clone(), x.clone(), y.clone()], out, kind, device).flow(flow).finish())
    }

    fn f_triangle(&self, upper: bool, diagonal: i64) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let op = Pointwise::Triangle { upper, diagonal };
        let name = op.name();
        let rank = n.meta.shape.len();
        if rank < 2 {
            return Err(arg(name, &n.meta.shape, "needs at least 2 dimensions"));
        }
        let (flow, mut mixes) = same_shape_flow(name, n, Linearity::Structural)?;
        if n.meta.batch().is_some_and(|bd| bd.dim + 2 >= rank) {
            mixes = Some("keeps a triangle by position along the batch dimension".into());
        }
        Ok(Record::new(op, vec![n.clone()], n.meta.shape.clone(), n.meta.kind, n.meta.device)
            .flow((flow, mixes))
            .finish())
    }

    /// The lower triangle of the last two dimensions (at and below `diagonal`), zeros above.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for fewer than 2 dimensions.
    pub fn f_tril(&self, diagonal: i64) -> Result<LazyTensor, LazyError> {
        self.f_triangle(false, diagonal)
    }
    /// The upper triangle of the last two dimensions (at and above `diagonal`), zeros below.
    ///
    /// # Errors
    /// As [`f_tril`](Self::f_tril).
    pub fn f_triu(&self, diagonal: i64) -> Result<LazyTensor, LazyError> {
        self.f_triangle(true, diagonal)
    }

    fn f_binary(&self, op: Binary, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let other = other.into_lazy();
        let (a, b) = (&self.node, &other.node);
        let name = op.name();
        let device = same_device(name, &[a, b])?;
        let out = shape::broadcast(&a.meta.shape, &b.meta.shape)
            .map_err(|r| shape_err(name, &a.meta.shape, &b.meta.shape, r))?;
        let promoted = shape::result_kind(a.meta.kind, a.meta.shape.len(), b.meta.kind, b.meta.shape.len());
        let kind = match op {
            _ if op.is_comparison() => Kind::Bool,
            Binary::Div if shape::is_integral(promoted) => Kind::Float,
            _ => promoted,
        };
        let linearity = match op {
            Binary::Add | Binary::Sub => Linearity::Additive,
            Binary::Mul => Linearity::Scaling { divisor: None },
            Binary::Div => Linearity::Scaling { divisor: Some(1) },
            _ => Linearity::Nonlinear,
        };
        let flow = broadcast_flows(name, &[a, b], &out, linearity)?;
        let mut record = Record::new(Pointwise::Binary(op), vec![a.clone(), b.clone()], out, kind, device).flow(flow);
        if op.is_comparison() {
            record = record.not_differentiable();
        }
        Ok(record.finish())
    }

    fn f_scalar(&self, op: Binary, scalar: f64, reversed: bool) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let kind = match op {
            _ if op.is_comparison() => Kind::Bool,
            Binary::Div => {
                if shape::is_integral(n.meta.kind) {
                    Kind::Float
                } else {
                    n.meta.kind
                }
            }
            _ => shape::scalar_result_kind(n.meta.kind),
        };
        let linearity = match op {
            Binary::Add | Binary::Sub => Linearity::Additive,
            Binary::Mul => Linearity::Structural,
            Binary::Div if !reversed => Linearity::Structural,
            _ => Linearity::Nonlinear,
        };
        let record_op = Pointwise::Scalar { op, scalar, reversed };
        let flow = same_shape_flow(record_op.name(), n, linearity)?;
        let mut record = Record::new(record_op, vec![n.clone()], n.meta.shape.clone(), kind, n.meta.device).flow(flow);
        if op.is_comparison() {
            record = record.not_differentiable();
        }
        Ok(record.finish())
    }

    /// `self + other`, broadcasting.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes do not broadcast, [`LazyError::Device`],
    /// [`LazyError::Batch`] for a fixed operand that has the batch's size along the batch
    /// dimension.
    pub fn f_add(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Add, other)
    }
    /// `self - other`, broadcasting.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_sub(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Sub, other)
    }
    /// `self * other`, broadcasting.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_mul(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Mul, other)
    }
    /// `self / other` (true division), broadcasting.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_div(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Div, other)
    }
    /// `self ^ other`, broadcasting.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_pow(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Pow, other)
    }
    /// Elementwise maximum, broadcasting.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_maximum(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Maximum, other)
    }
    /// Elementwise minimum, broadcasting.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_minimum(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Minimum, other)
    }
    /// `self == other` elementwise (a `Bool` tensor).
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_eq_tensor(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Eq, other)
    }
    /// `self != other` elementwise.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_ne_tensor(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Ne, other)
    }
    /// `self < other` elementwise.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_lt_tensor(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Lt, other)
    }
    /// `self <= other` elementwise.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_le_tensor(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Le, other)
    }
    /// `self > other` elementwise.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_gt_tensor(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Gt, other)
    }
    /// `self >= other` elementwise.
    ///
    /// # Errors
    /// As [`f_add`](Self::f_add).
    pub fn f_ge_tensor(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Ge, other)
    }

    /// `self + s`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_add_scalar(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Add, s, false)
    }
    /// `self - s`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_sub_scalar(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Sub, s, false)
    }
    /// `s - self`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_rsub_scalar(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Sub, s, true)
    }
    /// `self * s`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_mul_scalar(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Mul, s, false)
    }
    /// `self / s`.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_div_scalar(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Div, s, false)
    }
    /// `s / self` (as Python's `s / x`: the reciprocal times `s`).
    ///
    /// # Errors
    /// None in practice.
    #[lazy_only]
    pub fn f_rdiv_scalar(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Div, s, true)
    }
    /// `self ^ s` (tch's `pow_tensor_scalar`).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_pow_tensor_scalar(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Pow, s, false)
    }
    /// `self == s` elementwise.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_eq(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Eq, s, false)
    }
    /// `self != s` elementwise.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_ne(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Ne, s, false)
    }
    /// `self < s` elementwise.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_lt(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Lt, s, false)
    }
    /// `self <= s` elementwise.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_le(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Le, s, false)
    }
    /// `self > s` elementwise.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_gt(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Gt, s, false)
    }
    /// `self >= s` elementwise.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_ge(&self, s: f64) -> Result<LazyTensor, LazyError> {
        self.f_scalar(Binary::Ge, s, false)
    }

    /// Dropout with probability `p` when `train` (the same value, not a copy, otherwise).
    /// Each micro-batch draws its own mask.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for `p` outside `[0, 1]`.
    pub fn f_dropout(&self, p: f64, train: bool) -> Result<LazyTensor, LazyError> {
        self.dropout_as(DropoutKind::Plain, p, train)
    }

    /// Dropout of whole channels (`[N, C, ..]`: one draw per sample and channel), as tch's
    /// `feature_dropout` (PyTorch's `dropout2d`/`dropout3d`).
    ///
    /// # Errors
    /// As [`f_dropout`](Self::f_dropout); an input of fewer than 2 dimensions.
    pub fn f_feature_dropout(&self, p: f64, train: bool) -> Result<LazyTensor, LazyError> {
        self.dropout_as(DropoutKind::Feature, p, train)
    }

    /// Alpha dropout (keeps a SELU network's mean and variance), as tch's `alpha_dropout`.
    ///
    /// # Errors
    /// As [`f_dropout`](Self::f_dropout).
    pub fn f_alpha_dropout(&self, p: f64, train: bool) -> Result<LazyTensor, LazyError> {
        self.dropout_as(DropoutKind::Alpha, p, train)
    }

    /// Alpha dropout of whole channels, as tch's `feature_alpha_dropout`.
    ///
    /// # Errors
    /// As [`f_feature_dropout`](Self::f_feature_dropout).
    pub fn f_feature_alpha_dropout(&self, p: f64, train: bool) -> Result<LazyTensor, LazyError> {
        self.dropout_as(DropoutKind::FeatureAlpha, p, train)
    }

    fn dropout_as(&self, kind: DropoutKind, p: f64, train: bool) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let name = kind.name();
        if !(0.0..=1.0).contains(&p) {
            return Err(arg(
                name,
                &n.meta.shape,
                format!("dropout probability has to be between 0 and 1, but got {p}"),
            ));
        }
        if matches!(kind, DropoutKind::Feature | DropoutKind::FeatureAlpha) && n.meta.shape.len() < 2 {
            return Err(arg(
                name,
                &n.meta.shape,
                format!("Feature dropout requires at least 2 dimensions in the input, got {}", n.meta.shape.len()),
            ));
        }
        let identity = !train || p == 0.0;
        let linearity = if identity { Linearity::Structural } else { Linearity::Nonlinear };
        let flow = same_shape_flow(name, n, linearity)?;
        let record = Record::new(
            Pointwise::Dropout { p, train, kind },
            vec![n.clone()],
            n.meta.shape.clone(),
            n.meta.kind,
            n.meta.device,
        )
        .flow(flow);
        Ok(if identity { record.view(n.meta.strides.clone()) } else { record }.finish())
    }
}

/// Which dropout: elementwise or per channel, plain or alpha.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DropoutKind {
    Plain,
    Feature,
    Alpha,
    FeatureAlpha,
}

impl DropoutKind {
    fn name(self) -> &'static str {
        match self {
            DropoutKind::Plain => "dropout",
            DropoutKind::Feature => "feature_dropout",
            DropoutKind::Alpha => "alpha_dropout",
            DropoutKind::FeatureAlpha => "feature_alpha_dropout",
        }
    }

    /// How many input elements share one mask element: the spatial size for the feature
    /// forms (their mask is `[N, C, 1, ..]`), else 1.
    fn mask_fraction(self, shape: &[i64]) -> u64 {
        match self {
            DropoutKind::Feature | DropoutKind::FeatureAlpha if shape.len() > 2 => {
                shape[2..].iter().product::<i64>().max(1) as u64
            }
            _ => 1,
        }
    }
}
