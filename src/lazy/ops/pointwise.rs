//! Elementwise ops: activations and other unary functions, binary arithmetic and comparisons
//! (tensor with tensor, broadcasting, or with a scalar), and dropout.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::layout::adopt_batch_broadcasts;
use super::record::IntoLazy;
use super::record::{broadcast_flows, same_device, unary_flow, Linearity, Record};
use super::{arg, floating, kind_err, requires, same_shape_flow, shape_err};
use crate::lazy::error::LazyError;
use crate::lazy::facts::OpFacts;
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{Flow, KernelCall, Meta, Node, Operation, Run, RunCx, Share};
use crate::lazy::shape;
use crate::lazy::size::Elements;
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
    /// -1, 0 or 1 (its gradient is zero).
    Sign,
    /// `min(max(x, -1), 1)`, as tch's `hardtanh`.
    Hardtanh,
    /// Scaled ELU with libtorch's fixed alpha and scale.
    Selu,
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

/// What autograd keeps of an elementwise op for its backward.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keeps {
    Nothing,
    Input,
    Output,
}

/// Which kinds a unary op takes, and what it gives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kinds {
    /// Any kind, kept (integers too).
    Same,
    /// Floating kinds only: libtorch has no integer kernel.
    Floating,
    /// Floats from integers, other kinds kept.
    Promoted,
}

/// A unary op's rules, one row per op ([`Unary::rules`]).
struct UnaryRules {
    name: &'static str,
    kinds: Kinds,
    keeps: Keeps,
    /// Temporaries of its backward, in values as large as the output: the backward formulas
    /// that are not one fused kernel (`grad * x.sgn()`, `grad / (2 * result)`, `grad * x.cos()`
    /// and the like).
    backward: u64,
}

impl Unary {
    fn rules(&self) -> UnaryRules {
        use {Keeps::*, Kinds::*};
        let row = |name, kinds, keeps, backward| UnaryRules { name, kinds, keeps, backward };
        match self {
            Unary::Relu => row("relu", Same, Output, 0),
            Unary::Sigmoid => row("sigmoid", Promoted, Output, 0),
            Unary::Tanh => row("tanh", Promoted, Output, 0),
            Unary::Exp => row("exp", Promoted, Output, 0),
            Unary::Log => row("log", Promoted, Input, 0),
            Unary::Neg => row("neg", Same, Nothing, 0),
            Unary::Sqrt => row("sqrt", Promoted, Output, 1),
            Unary::Abs => row("abs", Same, Input, 1),
            Unary::Gelu(_) => row("gelu", Floating, Input, 0),
            Unary::Silu => row("silu", Floating, Input, 0),
            Unary::Softplus => row("softplus", Floating, Input, 0),
            Unary::LeakyRelu => row("leaky_relu", Floating, Input, 0),
            Unary::Elu => row("elu", Floating, Input, 0),
            Unary::Hardswish => row("hardswish", Floating, Input, 0),
            Unary::Hardsigmoid => row("hardsigmoid", Floating, Input, 0),
            Unary::Relu6 => row("relu6", Floating, Input, 0),
            Unary::Mish => row("mish", Floating, Input, 0),
            Unary::Sin => row("sin", Promoted, Input, 1),
            Unary::Cos => row("cos", Promoted, Input, 2),
            Unary::Square => row("square", Same, Input, 2),
            // A boolean mask per bound (see `kernels`); an `f64` bound on integers gives floats.
            Unary::Clamp { min: Some(_), max: Some(_) } => row("clamp", Promoted, Input, 0),
            Unary::Clamp { min: Some(_), max: None } => row("clamp_min", Promoted, Input, 0),
            Unary::Clamp { min: None, .. } => row("clamp_max", Promoted, Input, 0),
            Unary::Rsqrt => row("rsqrt", Promoted, Output, 2),
            Unary::Reciprocal => row("reciprocal", Promoted, Output, 2),
            // `grad * 2/√π · exp(-x²)`.
            Unary::Erf => row("erf", Promoted, Input, 4),
            // Its kernel keeps a buffer as large as its input (see `kernels`).
            Unary::LogSigmoid => row("log_sigmoid", Floating, Input, 0),
            // `zeros_like(grad)`: nothing kept.
            Unary::Sign => row("sign", Same, Nothing, 0),
            Unary::Hardtanh => row("hardtanh", Floating, Input, 0),
            // libtorch runs it as `elu` with SELU's constants: the same backward.
            Unary::Selu => row("selu", Floating, Input, 0),
        }
    }

    fn run(&self, x: &Tensor) -> Result<Tensor, TchError> {
        match self {
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
            Unary::Sign => x.f_sign(),
            Unary::Hardtanh => x.f_hardtanh(),
            Unary::Selu => x.f_selu(),
        }
    }
}

impl Operation for Unary {
    fn name(&self) -> &'static str {
        self.rules().name
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if let Unary::LogSigmoid = self {
            let input = &inputs[0].meta;
            // libtorch's kernel keeps a buffer as large as its input for the backward (the CPU's;
            // CUDA's is empty, not read on a card yet: kept alike).
            calls.push(KernelCall::Keeps { elements: input.elements(), kind: input.kind });
        }
        if !meta.requires_grad {
            return;
        }
        let (a, c) = meta.elements().parts();
        let backward = match self {
            Unary::Clamp { min, max } => {
                let masks = u64::from(min.is_some()) + u64::from(max.is_some());
                let elem = meta.kind.elt_size_in_bytes().max(1) as u64;
                Elements::line((masks * a).div_ceil(elem), (masks * c).div_ceil(elem))
            }
            _ => {
                let k = self.rules().backward;
                Elements::line(k * a, k * c)
            }
        };
        if backward != Elements::ZERO {
            calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| i == 0 && self.rules().keeps == Keeps::Input)
            .saves_output(self.rules().keeps == Keeps::Output)
            // The exact `gelu`'s `Float`/`BFloat16` backward kernel reads its gradient densely.
            .grad_dense(
                matches!(self, Unary::Gelu(a) if a == "none") && matches!(meta.kind, Kind::Float | Kind::BFloat16),
            )
    }
}

impl Run for Unary {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        Unary::run(self, ins[0])
    }
}

/// What a binary op keeps for its backward, one row per op, given which operands require a
/// gradient (`requires(j)`).
impl Binary {
    fn saves(self, i: usize, requires: impl Fn(usize) -> bool) -> bool {
        match self {
            Binary::Add | Binary::Sub => false,
            // Each factor for the other's gradient.
            Binary::Mul => requires(1 - i),
            // The divisor for both gradients, the dividend for the divisor's.
            Binary::Div => (i == 1 && (requires(0) || requires(1))) || (i == 0 && requires(1)),
            Binary::Pow | Binary::Maximum | Binary::Minimum => true,
            Binary::Eq | Binary::Ne | Binary::Lt | Binary::Le | Binary::Gt | Binary::Ge => false,
        }
    }

    fn run(self, a: &Tensor, b: &Tensor) -> Result<Tensor, TchError> {
        match self {
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
}

/// Bytes of one element of `kind` (1 for `Bool`).
fn elt(kind: Kind) -> u64 {
    kind.elt_size_in_bytes().max(1) as u64
}

/// A binary op of two tensors, broadcasting. Operands: a, b.
pub(crate) struct TensorBinary {
    op: Binary,
}

impl Operation for TensorBinary {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if self.op.is_comparison() {
            return;
        }
        // Temporaries in elements of the output's kind, handed on in the first input's.
        let (out, first) = (elt(meta.kind), elt(inputs.first().map_or(meta.kind, |x| x.meta.kind)));
        let in_first = |e: Elements| {
            let (a, c) = e.parts();
            Elements::line((a * out).div_ceil(first), (c * out).div_ceil(first))
        };
        // An operand of another floating kind (`f32 * bf16` under autocast): the CPU's kernels
        // loop over one kind, so the operand is copied into the output's while the op runs,
        // and again in each backward formula that reads it.
        let cast = |k: usize| inputs.get(k).is_some_and(|x| shape::promoted(x.meta.kind, meta.kind));
        let forward = (0..2).filter(|&k| cast(k)).fold(Elements::ZERO, |e, k| e.plus(inputs[k].meta.elements()));
        if !meta.requires_grad {
            if forward != Elements::ZERO {
                calls.push(KernelCall::Temporaries { forward: in_first(forward), backward: Elements::ZERO });
            }
            return;
        }
        // A broadcast operand's gradient: the output gradient summed over the broadcast
        // dimensions.
        let mut full = 0;
        let mut read_casts = Elements::ZERO;
        for (k, input) in inputs.iter().enumerate().take(2) {
            if !requires(inputs, k) {
                continue;
            }
            let broadcast = input.meta.shape != meta.shape;
            if broadcast {
                let mask = shape::broadcast_mask(&input.meta.shape, &meta.shape);
                calls.push(KernelCall::Reduction { of: meta, mask, backward: true });
            }
            // Output-sized temporaries of the operand's gradient formula, beyond the gradient:
            // a divisor's is `-grad * ((a / b) / b)` (two besides the product); a broadcast
            // operand's product is output-sized before it is summed down to the operand.
            full += match (self.op, k) {
                (Binary::Div, 1) => 2 + u64::from(broadcast),
                (Binary::Mul | Binary::Div, _) => u64::from(broadcast),
                _ => 0,
            };
            // A gradient autograd casts to its operand's kind once the backward returns: the
            // formula's result, in the output's kind, lives beside the cast (an addend's
            // result is the output's gradient itself).
            let passes = matches!((self.op, k), (Binary::Add, _) | (Binary::Sub, 0));
            full += u64::from(cast(k) && !passes);
            // The other operand, of another kind, read by this formula (`grad * b`).
            if matches!(self.op, Binary::Mul | Binary::Div | Binary::Pow | Binary::Maximum | Binary::Minimum)
                && cast(1 - k)
            {
                read_casts = read_casts.plus(inputs[1 - k].meta.elements());
            }
        }
        let (a, c) = meta.elements().parts();
        let mut backward = Elements::line(full * a, full * c).plus(read_casts);
        // `maximum` and `minimum` pick each operand's gradient with `where(a == b, grad / 2, grad)`
        // masked in place by `a < b` (or `a > b`), one expression: `grad / 2` and both boolean
        // masks live beside the gradients until it ends, one operand after the other.
        if matches!(self.op, Binary::Maximum | Binary::Minimum) && (requires(inputs, 0) || requires(inputs, 1)) {
            backward = backward.plus(Elements::line(a + (2 * a).div_ceil(out), c + (2 * c).div_ceil(out)));
        }
        if backward != Elements::ZERO || forward != Elements::ZERO {
            calls.push(KernelCall::Temporaries { forward: in_first(forward), backward: in_first(backward) });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], meta: &Meta) -> OpFacts {
        let facts = OpFacts::new(inputs.len())
            .saves(|i| self.op.saves(i, |j| requires(inputs, j)))
            .saves_output(self.op == Binary::Pow)
            .grad_aliases(|i| {
                // The output's gradient itself, where no broadcast must be summed away (and no sign
                // flipped).
                let same_shape = |j: usize| inputs.get(j).is_some_and(|n| n.meta.shape == meta.shape);
                match self.op {
                    Binary::Add => same_shape(i),
                    Binary::Sub => i == 0 && same_shape(0),
                    _ => false,
                }
            })
            .adds_fixed(matches!(self.op, Binary::Add | Binary::Sub));
        // Operands of two kinds: their casts' order in the backward is libtorch's formulas',
        // not read here, so a calibrating plan measures the op.
        let mixed = inputs.iter().any(|x| shape::promoted(x.meta.kind, meta.kind));
        if mixed && !self.op.is_comparison() {
            facts.kernels_unknown()
        } else {
            facts
        }
    }
}

impl Run for TensorBinary {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        self.op.run(ins[0], ins[1])
    }
}

/// `x op scalar`, or `scalar op x` when `reversed`.
pub(crate) struct Scalar {
    op: Binary,
    scalar: f64,
    reversed: bool,
    /// An integer scalar (`x + 1`): on an integer tensor the result keeps its kind.
    integral: bool,
}

impl Operation for Scalar {
    fn name(&self) -> &'static str {
        match (self.op, self.reversed) {
            (Binary::Add, _) => "add_scalar",
            (Binary::Sub, false) => "sub_scalar",
            (Binary::Sub, true) => "rsub_scalar",
            (Binary::Mul, _) => "mul_scalar",
            (Binary::Div, false) => "div_scalar",
            (Binary::Div, true) => "rdiv_scalar",
            (Binary::Pow, _) => "pow_scalar",
            (other, _) => other.name(),
        }
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        match (self.op, self.reversed) {
            // The reciprocal between `1 / x` and the multiplication.
            (Binary::Div, true) => {
                let input = &inputs[0].meta;
                calls.push(KernelCall::Keeps { elements: input.elements(), kind: input.kind });
            }
            // `grad * (e * x.pow(e - 1))`: the power and its scaled copy, both as large as the
            // value.
            (Binary::Pow, false) if meta.requires_grad && self.scalar != 0.0 => {
                let (a, c) = meta.elements().parts();
                calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward: Elements::line(2 * a, 2 * c) });
            }
            _ => {}
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| self.op == Binary::Pow && i == 0)
            .grad_aliases(|_i| matches!(self.op, Binary::Add | Binary::Sub) && !self.reversed)
    }
}

impl Run for Scalar {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        scalar_op(ins[0], self.op, self.scalar, self.reversed, self.integral)
    }

    fn run_share(&self, ins: &[&Tensor], _node: &Node, share: &Share) -> Option<Result<Tensor, TchError>> {
        // `sum + s`: the scalar must count once over all micro-batches.
        matches!(self.op, Binary::Add | Binary::Sub)
            .then(|| scalar_op(ins[0], self.op, self.scalar * share.frac, self.reversed, false))
    }
}

/// Dropout in its four forms; the identity (a view) when not training or with `p = 0`.
pub(crate) struct Dropout {
    p: f64,
    train: bool,
    kind: DropoutKind,
}

impl Operation for Dropout {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if !self.train || self.p <= 0.0 {
            return;
        }
        // The mask: as large as the input, or one value per sample and channel for the
        // feature forms.
        let input = &inputs[0].meta;
        let (a, c) = input.elements().parts();
        let per = self.kind.mask_fraction(&input.shape);
        // libtorch's composite dropout keeps the mask in the input's kind (CUDA's fused one keeps
        // booleans, not read on a card yet: kept alike).
        calls.push(KernelCall::Keeps { elements: Elements::line(a / per, c / per), kind: input.kind });
        // Alpha dropout is `x · mask + b`: the product is a temporary as large as the input,
        // and `b` is as large as the mask.
        if matches!(self.kind, DropoutKind::Alpha | DropoutKind::FeatureAlpha) {
            let (a, c) = meta.elements().parts();
            let per = self.kind.mask_fraction(&meta.shape);
            calls.push(KernelCall::Temporaries {
                forward: Elements::line(a + a / per, c + c / per),
                backward: Elements::ZERO,
            });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).grad_aliases(|_i| !self.train || self.p == 0.0)
    }
}

impl Run for Dropout {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (x, p, train) = (ins[0], self.p, self.train);
        match self.kind {
            DropoutKind::Plain => x.f_dropout(p, train),
            DropoutKind::Feature => x.f_feature_dropout(p, train),
            DropoutKind::Alpha => x.f_alpha_dropout(p, train),
            DropoutKind::FeatureAlpha => x.f_feature_alpha_dropout(p, train),
        }
    }
}

/// `value` where a mask is true. Operands: x, mask (Bool, broadcast to x), kept for the
/// backward (where the gradient goes).
pub(crate) struct MaskedFill {
    value: f64,
}

impl Operation for MaskedFill {
    fn name(&self) -> &'static str {
        "masked_fill"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 1)
    }
}

impl Run for MaskedFill {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (x, mask) = (ins[0], ins[1]);
        x.f_masked_fill(mask, self.value)
    }
}

/// `condition ? x : y`. Operands: condition (kept: where the gradient goes), x, y, broadcast
/// together.
pub(crate) struct Where;

impl Operation for Where {
    fn name(&self) -> &'static str {
        "where_self"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 0)
    }
}

impl Run for Where {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (condition, x, y) = (ins[0], ins[1], ins[2]);
        x.f_where_self(condition, y)
    }
}

/// The lower (`tril`) or upper (`triu`) triangle of the last two dimensions.
pub(crate) struct Triangle {
    upper: bool,
    diagonal: i64,
}

impl Operation for Triangle {
    fn name(&self) -> &'static str {
        if self.upper {
            "triu"
        } else {
            "tril"
        }
    }
}

impl Run for Triangle {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        if self.upper {
            ins[0].f_triu(self.diagonal)
        } else {
            ins[0].f_tril(self.diagonal)
        }
    }
}

/// The gated linear unit along `dim`: the first half times the sigmoid of the second. Autograd
/// keeps the input; libtorch's backward writes both halves of the input's gradient in place,
/// without temporaries (CPU and CUDA).
pub(crate) struct Glu {
    dim: i64,
}

impl Operation for Glu {
    fn name(&self) -> &'static str {
        "glu"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 0)
    }
}

impl Run for Glu {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_glu(self.dim)
    }
}

fn scalar_op(a: &Tensor, op: Binary, s: f64, reversed: bool, integral: bool) -> Result<Tensor, TchError> {
    if integral {
        // libtorch's own promotion for an integer scalar (the value is a recorded i64).
        let i = s as i64;
        return match (op, reversed) {
            (Binary::Add, _) => a.f_add_scalar(i),
            (Binary::Sub, false) => a.f_sub_scalar(i),
            (Binary::Sub, true) => a.f_rsub_scalar(i),
            (Binary::Mul, _) => a.f_mul_scalar(i),
            (Binary::Div, false) => a.f_div_scalar(i),
            (Binary::Div, true) => a.f_reciprocal()?.f_mul_scalar(i),
            (Binary::Pow, false) => a.f_pow_tensor_scalar(i),
            _ => scalar_op(a, op, s, reversed, false),
        };
    }
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

/// A constant in the shape of its input (`full_like`), contiguous as the plan records it.
pub(crate) struct FullLike {
    value: f64,
}

impl Operation for FullLike {
    fn name(&self) -> &'static str {
        "full_like"
    }
}

impl Run for FullLike {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        Tensor::f_full(ins[0].size(), self.value, (ins[0].kind(), ins[0].device()))
    }
}

#[toma_macros::tensor_methods(PointwiseOps, "Elementwise ops: activations, arithmetic and comparisons, dropout (a family of [`TensorOps`](crate::lazy::TensorOps)).")]
impl LazyTensor {
    fn f_unary(&self, u: Unary) -> Result<LazyTensor, LazyError> {
        let rules = u.rules();
        let name = rules.name;
        let n = self.node();
        if let Unary::Gelu(approximate) = &u {
            floating(name, n)?;
            if approximate != "none" && approximate != "tanh" {
                return Err(arg(
                    name,
                    &n.meta.shape,
                    format!("approximate must be \"none\" or \"tanh\", got {approximate:?}"),
                ));
            }
        }
        let kind = match rules.kinds {
            Kinds::Same => n.meta.kind,
            Kinds::Floating => {
                floating(name, n)?;
                n.meta.kind
            }
            Kinds::Promoted => shape::scalar_result_kind(n.meta.kind),
        };
        let linearity = if matches!(u, Unary::Neg) { Linearity::Additive } else { Linearity::Nonlinear };
        let flow = same_shape_flow(name, n, linearity)?;
        Ok(Record::new(u, inputs_of([n]), n.meta.shape.clone(), kind, n.meta.device).flow(flow).elementwise().finish())
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
    /// `min(max(x, -1), 1)`, as tch's `hardtanh`.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_hardtanh(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Hardtanh)
    }
    /// SELU, `scale * elu(x, alpha)` with libtorch's constants.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor.
    pub fn f_selu(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Selu)
    }
    /// The sign, -1, 0 or 1, as tch's `sign` (no gradient flows through it).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_sign(&self) -> Result<LazyTensor, LazyError> {
        self.f_unary(Unary::Sign)
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
            return Err(arg("clamp", &self.node().meta.shape, format!("a bound is NaN: min {min:?}, max {max:?}")));
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
        let (x, m) = (self.node(), mask.node());
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
        let op = MaskedFill { value };
        Ok(Record::new(op, inputs_of([x, m]), x.meta.shape.clone(), x.meta.kind, device)
            .flow(flow)
            .elementwise()
            .finish())
    }

    /// `self` where `condition` is true, `other` elsewhere, broadcast together (tch's
    /// `where_self`, PyTorch's `torch.where(condition, self, other)`).
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a condition that is not Bool, [`LazyError::Shape`] when the shapes
    /// do not broadcast, [`LazyError::Device`], [`LazyError::Batch`].
    pub fn f_where_self(&self, condition: impl IntoLazy, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let (condition, other) = (condition.into_lazy(), other.into_lazy());
        let (c, x, y) = (condition.node(), self.node(), other.node());
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
        Ok(Record::new(Where, inputs_of([c, x, y]), out, kind, device).flow(flow).elementwise().finish())
    }

    /// The gated linear unit along `dim` (tch's `glu`): the first half of `dim` times the
    /// sigmoid of the second, halving it. Along the batch dimension it mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-floating tensor; [`LazyError::Argument`] for a bad
    /// dimension or one of odd size.
    pub fn f_glu(&self, dim: i64) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        floating("glu", n)?;
        if m.shape.is_empty() {
            return Err(arg("glu", &m.shape, "needs at least one dimension to halve"));
        }
        let d = shape::wrap_dim(dim, m.shape.len()).map_err(|r| arg("glu", &m.shape, r))?;
        if m.shape[d] % 2 != 0 {
            return Err(arg("glu", &m.shape, format!("halves dimension {d}, whose size {} is odd", m.shape[d])));
        }
        let mut out = m.shape.clone();
        out[d] /= 2;
        let flow = match m.batch() {
            Some(bd) if bd.dim == d => {
                (Flow::Opaque, Some(format!("gates samples by others: it halves the batch dimension {d}")))
            }
            _ => unary_flow("glu", n, &out, Some, Linearity::Nonlinear)?,
        };
        Ok(Record::new(Glu { dim }, inputs_of([n]), out, m.kind, m.device).flow(flow).finish())
    }

    fn f_triangle(&self, upper: bool, diagonal: i64) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let op = Triangle { upper, diagonal };
        let name = op.name();
        let rank = n.meta.shape.len();
        if rank < 2 {
            return Err(arg(name, &n.meta.shape, "needs at least 2 dimensions"));
        }
        let (flow, mut mixes) = same_shape_flow(name, n, Linearity::Structural)?;
        if n.meta.batch().is_some_and(|bd| bd.dim + 2 >= rank) {
            mixes = Some("keeps a triangle by position along the batch dimension".into());
        }
        Ok(Record::new(op, inputs_of([n]), n.meta.shape.clone(), n.meta.kind, n.meta.device)
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
        let name = op.name();
        let out = shape::broadcast(&self.node().meta.shape, &other.node().meta.shape)
            .map_err(|r| shape_err(name, &self.node().meta.shape, &other.node().meta.shape, r))?;
        let mut pair = [self.node().clone(), other.node().clone()];
        adopt_batch_broadcasts(&mut pair, out.len(), true);
        let [a, b] = &pair;
        let device = same_device(name, &[a, b])?;
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
        let mut record =
            Record::new(TensorBinary { op }, inputs_of([a, b]), out, kind, device).flow(flow).elementwise();
        if op.is_comparison() {
            record = record.not_differentiable();
        }
        Ok(record.finish())
    }

    fn f_scalar(&self, op: Binary, scalar: f64, reversed: bool) -> Result<LazyTensor, LazyError> {
        self.f_scalar_of(op, scalar, reversed, false)
    }

    /// `self op s` for an integer `s` (the operators' `x + 1`): an integer tensor keeps its kind
    /// (true division aside), as in libtorch; a floating one is as with `s as f64`.
    pub(crate) fn f_int_scalar(&self, op: Binary, s: i64, reversed: bool) -> Result<LazyTensor, LazyError> {
        if let Some(t) = self.eager_value() {
            return self.f_scalar_of(op, s as f64, reversed, shape::is_integral(t.kind()));
        }
        let integral = shape::is_integral(self.node().meta.kind);
        if integral && matches!(op, Binary::Add | Binary::Sub) && self.node().meta.flow == crate::lazy::graph::Flow::Sum
        {
            return Err(LazyError::Unsupported {
                op: op.name().into(),
                reason: "an integer added to an integer value summed over the batch cannot be split exactly; \
                         convert the value to a floating kind first"
                    .into(),
            });
        }
        self.f_scalar_of(op, s as f64, reversed, integral)
    }

    fn f_scalar_of(&self, op: Binary, scalar: f64, reversed: bool, integral: bool) -> Result<LazyTensor, LazyError> {
        // On a value computed at once, what the recorded op would run (`2 * x`, `s / x`).
        if let Some(t) = self.eager_value() {
            return super::eager(op.name(), scalar_op(t, op, scalar, reversed, integral));
        }
        let n = self.node();
        let kind = match op {
            _ if op.is_comparison() => Kind::Bool,
            Binary::Div if integral => Kind::Float,
            _ if integral => n.meta.kind,
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
        let record_op = Scalar { op, scalar, reversed, integral };
        let flow = same_shape_flow(record_op.name(), n, linearity)?;
        let mut record =
            Record::new(record_op, inputs_of([n]), n.meta.shape.clone(), kind, n.meta.device).flow(flow).elementwise();
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
    /// Elementwise maximum, as tch's `max_other` (the same op as `maximum`).
    ///
    /// # Errors
    /// As [`f_maximum`](Self::f_maximum).
    pub fn f_max_other(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Maximum, other)
    }
    /// Elementwise minimum, as tch's `min_other` (the same op as `minimum`).
    ///
    /// # Errors
    /// As [`f_minimum`](Self::f_minimum).
    pub fn f_min_other(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_binary(Binary::Minimum, other)
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
    /// `self ^ s` (tch's `pow_tensor_scalar`): the exponent an integer or a float, as tch takes
    /// it (`x.pow_tensor_scalar(2)`); an integer tensor raised to an integer stays an integer, as
    /// in libtorch.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_pow_tensor_scalar(&self, s: impl Into<tch::Scalar> + 'static) -> Result<LazyTensor, LazyError> {
        // tch's scalars come from an `i64` or an `f64`: which one decides libtorch's promotion.
        fn integer<T: 'static>(_: &T) -> bool {
            std::any::TypeId::of::<T>() == std::any::TypeId::of::<i64>()
        }
        let integral = integer(&s);
        let s: tch::Scalar = s.into();
        let torch = |source| LazyError::Torch { node: None, op: "pow_tensor_scalar".into(), source };
        if integral {
            return self.f_int_scalar(Binary::Pow, s.to_int().map_err(torch)?, false);
        }
        self.f_scalar(Binary::Pow, s.to_float().map_err(torch)?, false)
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

    /// `fill_value` in every entry, in the shape, kind and device of `self`, per sample (tch's
    /// `full_like`). No gradient flows back through it.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_full_like(&self, fill_value: f64) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let flow = same_shape_flow("full_like", n, Linearity::Nonlinear)?;
        let record = Record::new(FullLike { value: fill_value }, inputs_of([n]), m.shape.clone(), m.kind, m.device);
        Ok(record.flow(flow).not_differentiable().finish())
    }

    /// Standard normal noise in the shape, kind and device of `self` (tch's `randn_like`). It is
    /// drawn for the whole batch when recorded and enters the graph as an input (batched as
    /// `self` is), each micro-batch taking its slice: a split step uses the numbers an eager step
    /// draws at the same point from the same seed. A random op recorded before it (dropout)
    /// draws when the step runs, so after it: the order of their draws differs from eager.
    ///
    /// # Errors
    /// [`LazyError::Unsupported`] where the batch is folded into another dimension (draw the
    /// noise with tch and pass it with `lazy(..)`); [`LazyError::Torch`] when the draw fails
    /// (an integer kind).
    pub fn f_randn_like(&self) -> Result<LazyTensor, LazyError> {
        self.drawn_like("randn_like", |shape, options| Tensor::f_randn(shape, options))
    }

    /// Uniform noise from 0 (included) to 1 in the shape, kind and device of `self` (tch's
    /// `rand_like`). It is drawn for the whole batch when recorded, as
    /// [`f_randn_like`](Self::f_randn_like) is.
    ///
    /// # Errors
    /// As [`f_randn_like`](Self::f_randn_like).
    pub fn f_rand_like(&self) -> Result<LazyTensor, LazyError> {
        self.drawn_like("rand_like", |shape, options| Tensor::f_rand(shape, options))
    }

    /// Zeros and ones drawn with the probabilities in `self` (tch's `bernoulli`), as libtorch's
    /// CPU kernel draws them: a uniform number per element, drawn for the whole batch when
    /// recorded ([`f_rand_like`](Self::f_rand_like)), compared with its probability. On the CPU
    /// in `Float` and `Double` these are the numbers tch's `bernoulli` draws from the same seed
    /// (checked bit for bit); in other kinds and on CUDA, whose kernels draw otherwise, the same
    /// distribution. A split step uses the whole batch's draws. Not differentiable.
    ///
    /// # Errors
    /// As [`f_rand_like`](Self::f_rand_like); [`LazyError::Kind`] for probabilities that are not
    /// floating-point.
    pub fn f_bernoulli(&self) -> Result<LazyTensor, LazyError> {
        super::floating("bernoulli", self.node())?;
        let uniform = self.f_rand_like()?;
        uniform.f_lt_tensor(self)?.f_to_kind(self.node().meta.kind)
    }

    fn drawn_like(
        &self,
        op: &str,
        draw: impl FnOnce(&[i64], (Kind, tch::Device)) -> Result<Tensor, TchError>,
    ) -> Result<LazyTensor, LazyError> {
        let m = &self.node().meta;
        if matches!(m.flow, crate::lazy::graph::Flow::PerSample(bd) if bd.factor != 1) {
            return Err(LazyError::Unsupported {
                op: op.into(),
                reason: "the batch is folded into another dimension here: draw the noise with tch for the whole batch and pass it with lazy(..)".into(),
            });
        }
        let noise = draw(&m.shape, (m.kind, m.device)).map_err(|source| LazyError::Torch {
            node: None,
            op: op.into(),
            source,
        })?;
        match m.batch() {
            Some(bd) => LazyTensor::batched(&noise, bd.dim as i64),
            None => Ok(LazyTensor::fixed(&noise)),
        }
    }

    /// Zeros in the shape, kind and device of `self`, per sample (tch's `zeros_like`).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_zeros_like(&self) -> Result<LazyTensor, LazyError> {
        self.f_full_like(0.0)
    }

    /// Ones in the shape, kind and device of `self`, per sample (tch's `ones_like`).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_ones_like(&self) -> Result<LazyTensor, LazyError> {
        self.f_full_like(1.0)
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
        let n = self.node();
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
        let record =
            Record::new(Dropout { p, train, kind }, inputs_of([n]), n.meta.shape.clone(), n.meta.kind, n.meta.device)
                .flow(flow);
        Ok(if identity { record.view(n.meta.strides.clone()) } else { record.elementwise() }.finish())
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
