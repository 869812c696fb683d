//! The recording API of [`LazyTensor`]: tch's method names, shape-checked when recorded.
//!
//! Every op comes twice, as in tch: `f_op` returns a [`LazyError`] for inputs libtorch would
//! refuse, `op` panics with that error's message.

use std::fmt;
use std::rc::Rc;

use tch::{Device, Kind, Reduction, Tensor};

use super::error::LazyError;
use super::exec;
use super::graph::{
    broadcast_flows, combine_flows, leaf, same_device, unary_flow, BatchDim, Flow, Linearity, Node, Record,
};
use super::ops::{Binary, Op, ReduceOp, Unary};
use super::plan::{self, Mode, Plan};
use super::shape;
use super::LazyTensor;
use super::Options;

/// What an op takes as a tensor operand: a `&LazyTensor`, or a `&tch::Tensor`, recorded as a
/// fixed operand (a parameter or a constant, without a batch dimension). References only, as
/// tch's methods take them (`x.matmul(&w)`).
pub trait IntoLazy {
    /// The operand as a lazy tensor.
    fn into_lazy(self) -> LazyTensor;
}

impl IntoLazy for &LazyTensor {
    fn into_lazy(self) -> LazyTensor {
        self.clone()
    }
}

impl IntoLazy for &Tensor {
    fn into_lazy(self) -> LazyTensor {
        LazyTensor::fixed(self)
    }
}

fn arg(op: &str, shape: &[i64], reason: impl Into<String>) -> LazyError {
    LazyError::Argument { op: op.into(), shape: shape.to_vec(), reason: reason.into() }
}

fn shape_err(op: &str, lhs: &[i64], rhs: &[i64], reason: impl Into<String>) -> LazyError {
    LazyError::Shape { op: op.into(), lhs: lhs.to_vec(), rhs: rhs.to_vec(), reason: reason.into() }
}

fn kind_err(op: &str, kind: Kind, shape: &[i64], reason: impl Into<String>) -> LazyError {
    LazyError::Kind { op: op.into(), kind, shape: shape.to_vec(), reason: reason.into() }
}

fn floating(op: &str, n: &Node) -> Result<(), LazyError> {
    if shape::is_floating(n.meta.kind) {
        Ok(())
    } else {
        Err(kind_err(op, n.meta.kind, &n.meta.shape, "expected a floating-point tensor"))
    }
}

fn same_kind(op: &str, a: &Node, b: &Node) -> Result<(), LazyError> {
    if a.meta.kind == b.meta.kind {
        Ok(())
    } else {
        Err(kind_err(
            op,
            b.meta.kind,
            &b.meta.shape,
            format!("expected {:?} like the first operand of shape {:?}", a.meta.kind, a.meta.shape),
        ))
    }
}

/// Records ops whose batch dimension stays where it is and whose shape does not change.
fn same_shape_flow(op: &str, n: &Rc<Node>, linearity: Linearity) -> Result<(Flow, Option<String>), LazyError> {
    unary_flow(op, n, &n.meta.shape, Some, linearity)
}

impl LazyTensor {
    // -----------------------------------------------------------------------------------------
    // Leaves and queries

    /// A fixed operand: a tensor without a batch dimension (a parameter, a constant). Its
    /// gradient is accumulated by [`backward`](Self::backward) when it requires one.
    pub fn fixed(tensor: &Tensor) -> LazyTensor {
        leaf(tensor, None)
    }

    /// A batched input with its batch dimension `dim` (negative counts from the end).
    ///
    /// # Errors
    /// [`LazyError::Argument`] when the tensor has no such dimension.
    pub fn batched(tensor: &Tensor, dim: i64) -> Result<LazyTensor, LazyError> {
        let shape = tensor.size();
        let d = shape::wrap_dim(dim, shape.len()).map_err(|r| arg("lazy", &shape, r))?;
        if shape.is_empty() {
            return Err(arg("lazy", &shape, "a 0-dim tensor has no batch dimension"));
        }
        Ok(leaf(tensor, Some(d)))
    }

    /// The sizes, at the full batch. Runs nothing.
    pub fn size(&self) -> Vec<i64> {
        self.node.meta.shape.clone()
    }

    /// The number of dimensions. Runs nothing.
    pub fn dim(&self) -> usize {
        self.node.meta.shape.len()
    }

    /// The number of elements at the full batch. Runs nothing.
    pub fn numel(&self) -> usize {
        shape::numel(&self.node.meta.shape) as usize
    }

    /// The element kind. Runs nothing.
    pub fn kind(&self) -> Kind {
        self.node.meta.kind
    }

    /// The device. Runs nothing.
    pub fn device(&self) -> Device {
        self.node.meta.device
    }

    /// Whether the value will require a gradient (some operand is a parameter that requires
    /// one). Runs nothing.
    pub fn requires_grad(&self) -> bool {
        self.node.meta.requires_grad
    }

    /// The batch dimension of a per-sample value, if it has one. Runs nothing.
    pub fn batch_dim(&self) -> Option<usize> {
        self.node.meta.batch().map(|bd| bd.dim)
    }

    /// The full batch size this value was recorded with, when it is per-sample. Runs nothing.
    pub fn batch_size(&self) -> Option<usize> {
        self.node.meta.batch().map(|bd| bd.size as usize)
    }

    /// The name of the op that produces this value (`"relu"`, `"conv2d"`, ..).
    pub fn op_name(&self) -> &str {
        self.node.op.name()
    }

    fn meta(&self) -> &super::graph::Meta {
        &self.node.meta
    }

    // -----------------------------------------------------------------------------------------
    // Evaluation

    /// Computes the value, in micro-batches when the batch does not fit the budget (outputs
    /// are concatenated along the batch dimension, reductions over the batch combined).
    /// Runs without recording gradients: for those, see [`backward`](Self::backward).
    ///
    /// # Errors
    /// A [`LazyError`] when the plan cannot be made or libtorch fails.
    pub fn to_tensor(&self) -> Result<Tensor, LazyError> {
        exec::evaluate(self, &Options::default())
    }

    /// [`to_tensor`](Self::to_tensor) with options (a budget, a forced micro-batch, ..).
    ///
    /// # Errors
    /// As [`to_tensor`](Self::to_tensor).
    pub fn to_tensor_with(&self, options: &Options) -> Result<Tensor, LazyError> {
        exec::evaluate(self, options)
    }

    /// Runs forward and backward in micro-batches and accumulates the gradients of every
    /// parameter into its `.grad()`, exactly as one backward over the full batch would (a
    /// mean-reduced loss weighs each micro-batch by its share of the batch). Returns the
    /// full-batch value of the loss.
    ///
    /// Each micro-batch's gradients are added only once its backward has completed, so a
    /// micro-batch that runs out of memory is halved and redone without counting twice.
    ///
    /// # Errors
    /// [`LazyError::NotScalar`] when the value is not a scalar; [`LazyError::MixesBatch`] when
    /// the batch must be split but the computation mixes samples; any other [`LazyError`]
    /// from planning or running.
    pub fn backward(&self) -> Result<f64, LazyError> {
        exec::backward(self, &Options::default())
    }

    /// [`backward`](Self::backward) with options.
    ///
    /// # Errors
    /// As [`backward`](Self::backward).
    pub fn backward_with(&self, options: &Options) -> Result<f64, LazyError> {
        exec::backward(self, options)
    }

    /// The memory plan of computing this value ([`Mode::Forward`]) or of forward and backward
    /// ([`Mode::Backward`]). Runs nothing.
    ///
    /// # Errors
    /// [`LazyError::DoesNotFit`] when even one sample exceeds the budget, and
    /// [`LazyError::MixesBatch`] / [`LazyError::NotSplittable`] as evaluation would report them.
    pub fn plan(&self, mode: Mode, options: &Options) -> Result<Plan, LazyError> {
        plan::plan(self, mode, options)
    }

    /// The first element's value as `f64`, computed (tch's `double_value`).
    ///
    /// # Errors
    /// As [`to_tensor`](Self::to_tensor), and libtorch's error for a bad index.
    pub fn f_double_value(&self, index: &[i64]) -> Result<f64, LazyError> {
        let t = self.to_tensor()?;
        t.f_double_value(index).map_err(|source| LazyError::Torch { node: None, op: "double_value".into(), source })
    }

    /// Like [`f_double_value`](Self::f_double_value), panicking on error.
    #[track_caller]
    pub fn double_value(&self, index: &[i64]) -> f64 {
        self.f_double_value(index).unwrap_or_else(|e| panic!("{e}"))
    }

    /// An element's value as `i64`, computed (tch's `int64_value`).
    ///
    /// # Errors
    /// As [`f_double_value`](Self::f_double_value).
    pub fn f_int64_value(&self, index: &[i64]) -> Result<i64, LazyError> {
        let t = self.to_tensor()?;
        t.f_int64_value(index).map_err(|source| LazyError::Torch { node: None, op: "int64_value".into(), source })
    }

    /// Like [`f_int64_value`](Self::f_int64_value), panicking on error.
    #[track_caller]
    pub fn int64_value(&self, index: &[i64]) -> i64 {
        self.f_int64_value(index).unwrap_or_else(|e| panic!("{e}"))
    }

    // -----------------------------------------------------------------------------------------
    // Elementwise

    fn f_unary(&self, u: Unary) -> Result<LazyTensor, LazyError> {
        let op = Op::Unary(u);
        let name = op.label();
        let n = &self.node;
        let kind = match op {
            Op::Unary(Unary::Relu | Unary::Neg | Unary::Abs) => n.meta.kind,
            Op::Unary(Unary::Gelu(ref approximate)) => {
                floating(&name, n)?;
                if approximate != "none" && approximate != "tanh" {
                    return Err(arg(
                        &name,
                        &n.meta.shape,
                        format!("approximate must be \"none\" or \"tanh\", got {approximate:?}"),
                    ));
                }
                n.meta.kind
            }
            _ => shape::scalar_result_kind(n.meta.kind),
        };
        let linearity = if matches!(op, Op::Unary(Unary::Neg)) { Linearity::Additive } else { Linearity::Nonlinear };
        let flow = same_shape_flow(&name, n, linearity)?;
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
        let mut record = Record::new(Op::Binary(op), vec![a.clone(), b.clone()], out, kind, device).flow(flow);
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
        let record_op = Op::Scalar { op, scalar, reversed };
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

    // -----------------------------------------------------------------------------------------
    // Softmax

    fn f_softmax_impl(&self, dim: i64, kind: Option<Kind>, log: bool) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let op = Op::Softmax { dim, kind, log };
        let name = op.label();
        let d = shape::wrap_dim(dim, n.meta.shape.len()).map_err(|r| arg(&name, &n.meta.shape, r))?;
        let out_kind = kind.unwrap_or(n.meta.kind);
        if !shape::is_floating(out_kind) {
            return Err(kind_err(&name, out_kind, &n.meta.shape, "softmax needs a floating-point kind"));
        }
        let (flow, mut mixes) = same_shape_flow(&name, n, Linearity::Nonlinear)?;
        if n.meta.batch().is_some_and(|bd| bd.dim == d) {
            mixes = Some(format!("normalizes over the batch dimension {d}"));
        }
        Ok(Record::new(op, vec![n.clone()], n.meta.shape.clone(), out_kind, n.meta.device).flow((flow, mixes)).finish())
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

    // -----------------------------------------------------------------------------------------
    // Products

    /// Matrix product with `torch.matmul`'s rules: 1-D operands, batched and broadcast
    /// leading dimensions.
    ///
    /// A batch dimension among the leading dimensions, the rows of `self` or the columns of
    /// `other` stays per-sample. One contracted over (both operands per-sample along the
    /// contracted dimension, as in `xᵀ y`) is a sum over the batch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes cannot be multiplied, [`LazyError::Kind`] for
    /// different kinds, [`LazyError::Device`].
    pub fn f_matmul(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let other = other.into_lazy();
        let (a, b) = (&self.node, &other.node);
        let name = "matmul";
        let device = same_device(name, &[a, b])?;
        let (sa, sb) = (&a.meta.shape, &b.meta.shape);
        let out = shape::matmul(sa, sb).map_err(|r| shape_err(name, sa, sb, r))?;
        same_kind(name, a, b)?;
        let lhs_nd = sa.len().max(2);
        let rhs_nd = sb.len().max(2);
        let out_batch_nd = lhs_nd.max(rhs_nd) - 2;
        // Where each operand's batch dimension lands: Ok(Some(dim)), or Err(()) when contracted.
        let role = |n: &Node, lhs: bool| -> Option<Result<usize, ()>> {
            let bd = n.meta.batch()?;
            let nd = n.meta.shape.len();
            Some(if nd == 1 {
                Err(())
            } else if bd.dim < nd - 2 {
                Ok(out_batch_nd - (nd - 2) + bd.dim)
            } else if lhs {
                if bd.dim == nd - 2 {
                    Ok(out_batch_nd)
                } else {
                    Err(())
                }
            } else if bd.dim == nd - 1 {
                Ok(out.len() - 1)
            } else {
                Err(())
            })
        };
        let roles = [role(a, true), role(b, false)];
        let contracted: Vec<usize> = (0..2).filter(|&i| matches!(roles[i], Some(Err(())))).collect();
        let per_sample = (0..2).filter(|&i| roles[i].is_some()).count();
        let inputs = [a, b];
        let flow = if !contracted.is_empty() && contracted.len() == per_sample {
            // xᵀ y over the batch: a sum of per-sample products.
            if per_sample == 1 {
                let i = contracted[0];
                return Err(LazyError::Batch {
                    op: name.into(),
                    lhs: sa.clone(),
                    rhs: sb.clone(),
                    reason: format!(
                        "operand {} contracts over its batch dimension against a fixed operand; wrap both with lazy(..)",
                        i + 1
                    ),
                });
            }
            let (ba, bb) = (a.meta.batch().expect("per-sample"), b.meta.batch().expect("per-sample"));
            if ba.size != bb.size || ba.factor != bb.factor {
                return Err(LazyError::Batch {
                    op: name.into(),
                    lhs: sa.clone(),
                    rhs: sb.clone(),
                    reason: format!("batch sizes {} and {} differ", ba.size * ba.factor, bb.size * bb.factor),
                });
            }
            if [a, b].iter().any(|n| matches!(n.meta.flow, Flow::Sum | Flow::Max | Flow::Opaque)) {
                (Flow::Opaque, Some("`matmul` contracts the batch of a value already reduced over it".to_string()))
            } else {
                (Flow::Sum, None)
            }
        } else {
            let mapped: Vec<Option<usize>> = roles.iter().map(|r| r.and_then(|r| r.ok())).collect();
            let flow = combine_flows(name, &inputs, &mapped, &out, Linearity::Scaling { divisor: None }, false)?;
            // A fixed operand broadcast against the batch along the leading dimensions.
            if let Flow::PerSample(bd) = flow.0 {
                if bd.dim < out_batch_nd {
                    for n in inputs.iter().filter(|n| n.meta.flow == Flow::Fixed) {
                        let nd = n.meta.shape.len().max(2) - 2;
                        let at = bd.dim as i64 - (out_batch_nd as i64 - nd as i64);
                        if at >= 0 && n.meta.shape[at as usize] == bd.size * bd.factor && bd.size * bd.factor > 1 {
                            return Err(LazyError::Batch {
                                op: name.into(),
                                lhs: sa.clone(),
                                rhs: sb.clone(),
                                reason: "a fixed operand has the batch's size along the batch dimension; wrap it with lazy(..)".into(),
                            });
                        }
                    }
                }
            }
            flow
        };
        Ok(Record::new(Op::Matmul, vec![a.clone(), b.clone()], out, a.meta.kind, device).flow(flow).finish())
    }

    /// `self @ weightᵀ + bias`, as tch's `linear`: `self` is `[.., in]`, `weight` `[out, in]`,
    /// `bias` `[out]`.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_linear(&self, weight: impl IntoLazy, bias: Option<impl IntoLazy>) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let x = &self.node;
        let name = "linear";
        let mut nodes = vec![x, &w.node];
        if let Some(b) = &b {
            nodes.push(&b.node);
        }
        let device = same_device(name, &nodes)?;
        let (sx, sw) = (&x.meta.shape, &w.node.meta.shape);
        if sx.is_empty() || sw.len() != 2 || sx[sx.len() - 1] != sw[1] {
            return Err(shape_err(name, sx, sw, "expected input [.., in] and weight [out, in]"));
        }
        if let Some(b) = &b {
            if b.node.meta.shape != [sw[0]] {
                return Err(shape_err(name, sw, &b.node.meta.shape, format!("bias must have shape [{}]", sw[0])));
            }
            same_kind(name, x, &b.node)?;
        }
        same_kind(name, x, &w.node)?;
        floating(name, x)?;
        let mut out = sx.clone();
        *out.last_mut().expect("non-empty") = sw[0];
        let mapped: Vec<Option<usize>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| n.meta.batch().filter(|bd| i == 0 && bd.dim + 1 < sx.len()).map(|bd| bd.dim))
            .collect();
        let flow = combine_flows(name, &nodes, &mapped, &out, Linearity::Nonlinear, false)?;
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(Op::Linear, inputs, out, x.meta.kind, device).flow(flow).finish())
    }

    // -----------------------------------------------------------------------------------------
    // Convolution and pooling

    /// 2-D convolution, as tch's `conv2d`: `self` is `[N, C, H, W]` (or `[C, H, W]`), `weight`
    /// `[O, C / groups, kh, kw]`; `stride`, `padding` and `dilation` take 1 or 2 values.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when input and weight do not fit, [`LazyError::Argument`] for bad
    /// parameters, [`LazyError::Kind`], [`LazyError::Device`].
    #[allow(clippy::too_many_arguments)]
    pub fn f_conv2d(
        &self,
        weight: impl IntoLazy,
        bias: Option<impl IntoLazy>,
        stride: impl AsRef<[i64]>,
        padding: impl AsRef<[i64]>,
        dilation: impl AsRef<[i64]>,
        groups: i64,
    ) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let x = &self.node;
        let name = "conv2d";
        let mut nodes = vec![x, &w.node];
        if let Some(b) = &b {
            nodes.push(&b.node);
        }
        let device = same_device(name, &nodes)?;
        let sx = &x.meta.shape;
        let a = |r: String| arg(name, sx, r);
        let stride = shape::pair(stride.as_ref(), "stride").map_err(a)?;
        let padding = shape::pair(padding.as_ref(), "padding").map_err(a)?;
        let dilation = shape::pair(dilation.as_ref(), "dilation").map_err(a)?;
        let sw = &w.node.meta.shape;
        let out =
            shape::conv2d(sx, sw, b.as_ref().map(|b| b.node.meta.shape.as_slice()), stride, padding, dilation, groups)
                .map_err(|r| shape_err(name, sx, sw, r))?;
        floating(name, x)?;
        same_kind(name, x, &w.node)?;
        if let Some(b) = &b {
            same_kind(name, x, &b.node)?;
        }
        let mapped: Vec<Option<usize>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| n.meta.batch().filter(|bd| i == 0 && sx.len() == 4 && bd.dim == 0).map(|_| 0))
            .collect();
        let flow = combine_flows(name, &nodes, &mapped, &out, Linearity::Nonlinear, false)?;
        let op = Op::Conv2d { stride, padding, dilation, groups };
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(op, inputs, out, x.meta.kind, device).flow(flow).finish())
    }

    fn pool_flow(&self, name: &str, out: &[i64]) -> Result<(Flow, Option<String>), LazyError> {
        let nd = self.node.meta.shape.len();
        unary_flow(name, &self.node, out, |d| (d + 2 < nd).then_some(d), Linearity::Nonlinear)
    }

    /// 2-D max pooling, as tch's `max_pool2d` (an empty `stride` means the kernel size).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for parameters libtorch refuses (a padding over half the
    /// kernel, an output smaller than 1, ..).
    pub fn f_max_pool2d(
        &self,
        kernel: impl AsRef<[i64]>,
        stride: impl AsRef<[i64]>,
        padding: impl AsRef<[i64]>,
        dilation: impl AsRef<[i64]>,
        ceil_mode: bool,
    ) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let name = "max_pool2d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let kernel = shape::pair(kernel.as_ref(), "kernel_size").map_err(a)?;
        let stride =
            if stride.as_ref().is_empty() { kernel } else { shape::pair(stride.as_ref(), "stride").map_err(a)? };
        let padding = shape::pair(padding.as_ref(), "padding").map_err(a)?;
        let dilation = shape::pair(dilation.as_ref(), "dilation").map_err(a)?;
        let out = shape::pool2d(&n.meta.shape, kernel, stride, padding, dilation, ceil_mode).map_err(a)?;
        let flow = self.pool_flow(name, &out)?;
        let op = Op::MaxPool2d { kernel, stride, padding, dilation, ceil_mode };
        Ok(Record::new(op, vec![n.clone()], out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// 2-D average pooling, as tch's `avg_pool2d` (an empty `stride` means the kernel size).
    ///
    /// # Errors
    /// As [`f_max_pool2d`](Self::f_max_pool2d); also a `divisor_override` of 0.
    #[allow(clippy::too_many_arguments)]
    pub fn f_avg_pool2d(
        &self,
        kernel: impl AsRef<[i64]>,
        stride: impl AsRef<[i64]>,
        padding: impl AsRef<[i64]>,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: impl Into<Option<i64>>,
    ) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let name = "avg_pool2d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let kernel = shape::pair(kernel.as_ref(), "kernel_size").map_err(a)?;
        let stride =
            if stride.as_ref().is_empty() { kernel } else { shape::pair(stride.as_ref(), "stride").map_err(a)? };
        let padding = shape::pair(padding.as_ref(), "padding").map_err(a)?;
        let divisor_override = divisor_override.into();
        if divisor_override == Some(0) {
            return Err(a("divisor must be not zero".into()));
        }
        floating(name, n)?;
        let out = shape::pool2d(&n.meta.shape, kernel, stride, padding, [1, 1], ceil_mode).map_err(a)?;
        let flow = self.pool_flow(name, &out)?;
        let op = Op::AvgPool2d { kernel, stride, padding, ceil_mode, count_include_pad, divisor_override };
        Ok(Record::new(op, vec![n.clone()], out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// 2-D adaptive average pooling to `output_size` (`[h, w]`).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a non 3-/4-D input or a bad size.
    pub fn f_adaptive_avg_pool2d(&self, output_size: impl AsRef<[i64]>) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let name = "adaptive_avg_pool2d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let output: [i64; 2] = output_size
            .as_ref()
            .try_into()
            .map_err(|_| a(format!("output_size must be 2 values, got {:?}", output_size.as_ref())))?;
        let s = &n.meta.shape;
        if s.len() != 3 && s.len() != 4 {
            return Err(a(format!("expected a 3-D or 4-D input, got {} dims", s.len())));
        }
        if s[s.len() - 3..].contains(&0) || output.iter().any(|&v| v < 0) {
            return Err(a(format!("non-empty input and non-negative output size expected, got output {output:?}")));
        }
        floating(name, n)?;
        let mut out = s.clone();
        let nd = out.len();
        out[nd - 2..].copy_from_slice(&output);
        let flow = self.pool_flow(name, &out)?;
        Ok(Record::new(Op::AdaptiveAvgPool2d { output }, vec![n.clone()], out, n.meta.kind, n.meta.device)
            .flow(flow)
            .finish())
    }

    // -----------------------------------------------------------------------------------------
    // Normalization, dropout, embedding

    /// Batch normalization, as tch's `Tensor::batch_norm` (`cudnn_enabled` on). In training mode
    /// it normalizes with statistics over the batch: splitting the batch is refused unless
    /// [`Options::allow_batch_mixing`]. Running statistics are updated in place in training
    /// mode, once per micro-batch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when weight, bias or statistics are not `[C]`, [`LazyError::Kind`],
    /// [`LazyError::Device`].
    #[allow(clippy::too_many_arguments)]
    pub fn f_batch_norm(
        &self,
        weight: Option<impl IntoLazy>,
        bias: Option<impl IntoLazy>,
        running_mean: impl IntoLazy,
        running_var: impl IntoLazy,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<LazyTensor, LazyError> {
        let x = &self.node;
        let name = "batch_norm";
        let s = &x.meta.shape;
        if s.len() < 2 {
            return Err(arg(name, s, format!("expected at least 2 dims (N, C, ..), got {}", s.len())));
        }
        floating(name, x)?;
        let (w, b) = (weight.map(IntoLazy::into_lazy), bias.map(IntoLazy::into_lazy));
        let (rm, rv) = (running_mean.into_lazy(), running_var.into_lazy());
        let mut params: Vec<&Rc<Node>> = Vec::new();
        params.extend(w.iter().map(|t| &t.node));
        params.extend(b.iter().map(|t| &t.node));
        params.extend([&rm.node, &rv.node]);
        for p in &params {
            if p.meta.shape != [s[1]] {
                return Err(shape_err(
                    name,
                    s,
                    &p.meta.shape,
                    format!("expected [{}] for the weight, bias and statistics", s[1]),
                ));
            }
        }
        let mut nodes = vec![x];
        nodes.extend(params.iter().copied());
        let device = same_device(name, &nodes)?;
        let mapped: Vec<Option<usize>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| n.meta.batch().filter(|bd| i == 0 && bd.dim == 0).map(|_| 0))
            .collect();
        let (flow, mut mixes) = combine_flows(name, &nodes, &mapped, s, Linearity::Nonlinear, false)?;
        if training && x.meta.batch().is_some() {
            mixes = Some("in training mode normalizes with statistics over the batch".into());
        }
        let op = Op::BatchNorm { training, momentum, eps, weight: w.is_some(), bias: b.is_some() };
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(op, inputs, s.clone(), x.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// Layer normalization over the trailing `normalized_shape`, as tch's
    /// `Tensor::layer_norm` (`cudnn_enable` on).
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the trailing dimensions, weight or bias do not match
    /// `normalized_shape`, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_layer_norm(
        &self,
        normalized_shape: impl AsRef<[i64]>,
        weight: Option<impl IntoLazy>,
        bias: Option<impl IntoLazy>,
        eps: f64,
    ) -> Result<LazyTensor, LazyError> {
        let x = &self.node;
        let name = "layer_norm";
        let s = &x.meta.shape;
        let norm = normalized_shape.as_ref().to_vec();
        if norm.is_empty() || norm.len() > s.len() || s[s.len() - norm.len()..] != norm[..] {
            return Err(shape_err(name, s, &norm, "the input's trailing dimensions must equal normalized_shape"));
        }
        floating(name, x)?;
        let (w, b) = (weight.map(IntoLazy::into_lazy), bias.map(IntoLazy::into_lazy));
        let mut nodes = vec![x];
        for p in w.iter().chain(b.iter()) {
            if p.node.meta.shape != norm {
                return Err(shape_err(name, &norm, &p.node.meta.shape, "weight and bias must have normalized_shape"));
            }
            same_kind(name, x, &p.node)?;
            nodes.push(&p.node);
        }
        let device = same_device(name, &nodes)?;
        let first_norm = s.len() - norm.len();
        let mapped: Vec<Option<usize>> =
            nodes.iter().enumerate().map(|(i, n)| n.meta.batch().filter(|_| i == 0).map(|bd| bd.dim)).collect();
        let (flow, mut mixes) = combine_flows(name, &nodes, &mapped, s, Linearity::Nonlinear, false)?;
        if x.meta.batch().is_some_and(|bd| bd.dim >= first_norm) {
            mixes = Some("normalizes over the batch dimension".into());
        }
        let op = Op::LayerNorm { normalized_shape: norm, eps, weight: w.is_some(), bias: b.is_some() };
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(op, inputs, s.clone(), x.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// Dropout with probability `p` when `train` (the same value, not a copy, otherwise).
    /// Each micro-batch draws its own mask.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for `p` outside `[0, 1]`.
    pub fn f_dropout(&self, p: f64, train: bool) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        if !(0.0..=1.0).contains(&p) {
            return Err(arg(
                "dropout",
                &n.meta.shape,
                format!("dropout probability has to be between 0 and 1, but got {p}"),
            ));
        }
        let identity = !train || p == 0.0;
        let linearity = if identity { Linearity::Structural } else { Linearity::Nonlinear };
        let flow = same_shape_flow("dropout", n, linearity)?;
        let record =
            Record::new(Op::Dropout { p, train }, vec![n.clone()], n.meta.shape.clone(), n.meta.kind, n.meta.device)
                .flow(flow);
        Ok(if identity { record.view(n.meta.strides.clone()) } else { record }.finish())
    }

    /// Rows of `weight` (`[V, D]`) picked by the integer `indices` (`self`'s role in tch is the
    /// weight: this is `Tensor::embedding(weight, indices, ..)`); the output is
    /// `indices.size() + [D]`. A static method, as in tch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for a weight that is not 2-D, [`LazyError::Kind`] for non-integer
    /// indices, [`LazyError::Device`].
    pub fn f_embedding(
        weight: impl IntoLazy,
        indices: impl IntoLazy,
        padding_idx: i64,
        scale_grad_by_freq: bool,
    ) -> Result<LazyTensor, LazyError> {
        let (w, i) = (weight.into_lazy(), indices.into_lazy());
        let name = "embedding";
        let (wn, inn) = (&w.node, &i.node);
        let device = same_device(name, &[wn, inn])?;
        if wn.meta.shape.len() != 2 {
            return Err(shape_err(name, &wn.meta.shape, &inn.meta.shape, "the weight must be 2-D"));
        }
        if !matches!(inn.meta.kind, Kind::Int64 | Kind::Int) {
            return Err(kind_err(name, inn.meta.kind, &inn.meta.shape, "indices must be Int64 or Int"));
        }
        let mut out = inn.meta.shape.clone();
        out.push(wn.meta.shape[1]);
        let mapped = [None, inn.meta.batch().map(|bd| bd.dim)];
        let (flow, mut mixes) = combine_flows(name, &[wn, inn], &mapped, &out, Linearity::Nonlinear, false)?;
        if scale_grad_by_freq && inn.meta.batch().is_some() {
            mixes = Some("with scale_grad_by_freq scales gradients by counts over the batch".into());
        }
        let op = Op::Embedding { padding_idx, scale_grad_by_freq };
        Ok(Record::new(op, vec![wn.clone(), inn.clone()], out, wn.meta.kind, device).flow((flow, mixes)).finish())
    }

    // -----------------------------------------------------------------------------------------
    // Shape ops

    fn view_flow(&self, new_shape: &[i64]) -> (Flow, Option<String>) {
        let m = self.meta();
        let Some(bd) = m.batch() else { return (m.flow, None) };
        let before = shape::numel(&m.shape[..bd.dim]);
        let mut prefix = 1;
        for (k, &size) in new_shape.iter().enumerate() {
            if prefix == before && size > 0 && size % bd.size == 0 {
                // The samples stay contiguous: the dimensions before the batch are kept, and the
                // batch is the outermost of the dimensions merged into (or split from) `k`.
                return (Flow::PerSample(BatchDim { dim: k, size: bd.size, factor: size / bd.size }), None);
            }
            prefix *= size;
        }
        (Flow::Opaque, Some(format!("to {new_shape:?} moves samples across the batch dimension {}", bd.dim)))
    }

    fn f_reshape_impl(&self, name: &str, shape: &[i64], must_view: bool) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let total = shape::numel(&m.shape);
        let new_shape = shape::infer_size(shape, total).map_err(|r| shape_err(name, &m.shape, shape, r))?;
        let flow = self.view_flow(&new_shape);
        match shape::view_strides(&m.shape, &m.strides, &new_shape) {
            Some(strides) => Ok(Record::new(Op::View, vec![n.clone()], new_shape, m.kind, m.device)
                .flow(flow)
                .view(strides)
                .finish()),
            None if must_view => Err(shape_err(
                name,
                &m.shape,
                shape,
                "view size is not compatible with input tensor's size and stride (at least one dimension spans across \
                 two contiguous subspaces); use reshape instead",
            )),
            None => Ok(Record::new(Op::Reshape, vec![n.clone()], new_shape, m.kind, m.device).flow(flow).finish()),
        }
    }

    /// A view with another shape (one size may be -1). Where the batch dimension goes is
    /// followed: merged with the dimensions after it (`[N, T, C] -> [N * T, C]`) or split
    /// again; a view that moves samples across it cannot be split.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match or the strides allow no view.
    pub fn f_view(&self, shape: impl AsRef<[i64]>) -> Result<LazyTensor, LazyError> {
        self.f_reshape_impl("view", shape.as_ref(), true)
    }

    /// Like [`f_view`](Self::f_view), copying when the strides allow no view.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match.
    pub fn f_reshape(&self, shape: impl AsRef<[i64]>) -> Result<LazyTensor, LazyError> {
        self.f_reshape_impl("reshape", shape.as_ref(), false)
    }

    /// Flattens dimensions `start_dim..=end_dim` into one.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad dimensions.
    pub fn f_flatten(&self, start_dim: i64, end_dim: i64) -> Result<LazyTensor, LazyError> {
        let s = &self.node.meta.shape;
        let a = |r: String| arg("flatten", s, r);
        if s.is_empty() {
            shape::wrap_dim(start_dim, 0).and_then(|_| shape::wrap_dim(end_dim, 0)).map_err(a)?;
            return self.f_reshape([1]);
        }
        let start = shape::wrap_dim(start_dim, s.len()).map_err(a)?;
        let end = shape::wrap_dim(end_dim, s.len()).map_err(a)?;
        if start > end {
            return Err(a("flatten() has invalid args: start_dim cannot come after end_dim".into()));
        }
        let mut new_shape = s[..start].to_vec();
        new_shape.push(shape::numel(&s[start..=end]));
        new_shape.extend_from_slice(&s[end + 1..]);
        self.f_reshape_impl("flatten", &new_shape, false)
    }

    /// Swaps two dimensions (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad dimensions.
    pub fn f_transpose(&self, dim0: i64, dim1: i64) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let a = |r: String| arg("transpose", &m.shape, r);
        let (d0, d1) =
            (shape::wrap_dim(dim0, m.shape.len()).map_err(a)?, shape::wrap_dim(dim1, m.shape.len()).map_err(a)?);
        let (mut s, mut st) = (m.shape.clone(), m.strides.clone());
        if !s.is_empty() {
            s.swap(d0, d1);
            st.swap(d0, d1);
        }
        let map = |d: usize| {
            Some(if d == d0 {
                d1
            } else if d == d1 {
                d0
            } else {
                d
            })
        };
        let flow = unary_flow("transpose", n, &s, map, Linearity::Structural)?;
        Ok(Record::new(Op::Transpose { dim0, dim1 }, vec![n.clone()], s, m.kind, m.device).flow(flow).view(st).finish())
    }

    /// Reorders the dimensions (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] unless `dims` is a permutation of the dimensions.
    pub fn f_permute(&self, dims: impl AsRef<[i64]>) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let dims = dims.as_ref().to_vec();
        let a = |r: String| arg("permute", &m.shape, r);
        if dims.len() != m.shape.len() {
            return Err(a(format!(
                "number of dims don't match in permute: {} given for {} dims",
                dims.len(),
                m.shape.len()
            )));
        }
        let wrapped = shape::wrap_dims(&dims, m.shape.len()).map_err(a)?;
        let s: Vec<i64> = wrapped.iter().map(|&d| m.shape[d]).collect();
        let st: Vec<i64> = wrapped.iter().map(|&d| m.strides[d]).collect();
        let flow = unary_flow("permute", n, &s, |d| wrapped.iter().position(|&w| w == d), Linearity::Structural)?;
        Ok(Record::new(Op::Permute { dims }, vec![n.clone()], s, m.kind, m.device).flow(flow).view(st).finish())
    }

    /// Inserts a dimension of size 1 at `dim` (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension.
    pub fn f_unsqueeze(&self, dim: i64) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let u = shape::wrap_insert_dim(dim, m.shape.len()).map_err(|r| arg("unsqueeze", &m.shape, r))?;
        let (mut s, mut st) = (m.shape.clone(), m.strides.clone());
        let stride = if u < s.len() { s[u] * st[u] } else { 1 };
        s.insert(u, 1);
        st.insert(u, stride);
        let flow = unary_flow("unsqueeze", n, &s, |d| Some(if u <= d { d + 1 } else { d }), Linearity::Structural)?;
        Ok(Record::new(Op::Unsqueeze { dim }, vec![n.clone()], s, m.kind, m.device).flow(flow).view(st).finish())
    }

    fn f_squeeze_impl(&self, dims: Vec<usize>) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let gone: Vec<usize> = dims.into_iter().filter(|&d| m.shape.get(d) == Some(&1)).collect();
        let keep: Vec<usize> = (0..m.shape.len()).filter(|d| !gone.contains(d)).collect();
        let s: Vec<i64> = keep.iter().map(|&d| m.shape[d]).collect();
        let st: Vec<i64> = keep.iter().map(|&d| m.strides[d]).collect();
        let flow = if m.batch().is_some_and(|bd| gone.contains(&bd.dim)) {
            // Only with a batch of 1 (and factor 1), which is never split.
            (Flow::Opaque, None)
        } else {
            unary_flow("squeeze", n, &s, |d| keep.iter().position(|&k| k == d), Linearity::Structural)?
        };
        let dims: Vec<i64> = gone.iter().map(|&d| d as i64).collect();
        Ok(Record::new(Op::Squeeze { dims }, vec![n.clone()], s, m.kind, m.device).flow(flow).view(st).finish())
    }

    /// Removes every dimension of size 1 (a view), as recorded: a micro-batch of one sample
    /// keeps its batch dimension.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_squeeze(&self) -> Result<LazyTensor, LazyError> {
        self.f_squeeze_impl((0..self.dim()).collect())
    }

    /// Removes dimension `dim` if its size is 1 (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension.
    pub fn f_squeeze_dim(&self, dim: i64) -> Result<LazyTensor, LazyError> {
        let d = shape::wrap_dim(dim, self.dim()).map_err(|r| arg("squeeze", &self.size(), r))?;
        self.f_squeeze_impl(if self.dim() == 0 { vec![] } else { vec![d] })
    }

    /// `length` entries of `dim` from `start` (a view). Not along the batch dimension.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a range outside the dimension.
    pub fn f_narrow(&self, dim: i64, start: i64, length: i64) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let a = |r: String| arg("narrow", &m.shape, r);
        if m.shape.is_empty() {
            return Err(a("narrow() cannot be applied to a 0-dim tensor".into()));
        }
        let d = shape::wrap_dim(dim, m.shape.len()).map_err(a)?;
        let size = m.shape[d];
        let start = if start < 0 { start + size } else { start };
        if start < 0 || length < 0 || start + length > size {
            return Err(a(format!("start ({start}) + length ({length}) exceeds dimension size ({size})")));
        }
        let mut s = m.shape.clone();
        s[d] = length;
        let (flow, mixes) = if m.batch().is_some_and(|bd| bd.dim == d) {
            (Flow::Opaque, Some("`narrow` selects samples along the batch dimension".to_string()))
        } else {
            unary_flow("narrow", n, &s, Some, Linearity::Structural)?
        };
        let op = Op::Narrow { dim: d as i64, start, length };
        Ok(Record::new(op, vec![n.clone()], s, m.kind, m.device).flow((flow, mixes)).view(m.strides.clone()).finish())
    }

    /// The value in another kind (the same value, not a copy, when the kind is the same).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_to_kind(&self, kind: Kind) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let linearity = if shape::is_floating(kind) { Linearity::Structural } else { Linearity::Nonlinear };
        let flow = same_shape_flow("to_kind", n, linearity)?;
        let record = Record::new(Op::ToKind { kind }, vec![n.clone()], m.shape.clone(), kind, m.device).flow(flow);
        // A conversion keeps the layout of a dense input (memory_format = preserve).
        let record = if kind == m.kind {
            record.view(m.strides.clone())
        } else {
            Record { strides: Some(m.strides.clone()), ..record }
        };
        Ok(record.finish())
    }

    /// A contiguous value (the same value when it already is).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_contiguous(&self) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let flow = same_shape_flow("contiguous", n, Linearity::Structural)?;
        let record = Record::new(Op::Contiguous, vec![n.clone()], m.shape.clone(), m.kind, m.device).flow(flow);
        Ok(if shape::is_contiguous(&m.shape, &m.strides) { record.view(m.strides.clone()) } else { record }.finish())
    }

    /// Concatenates along `dim` (not the batch dimension). A static method, as in tch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the other sizes differ, [`LazyError::Argument`] for an empty
    /// list or a bad dimension, [`LazyError::Device`].
    pub fn f_cat<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T], dim: i64) -> Result<LazyTensor, LazyError> {
        let lazies: Vec<LazyTensor> = tensors.iter().map(|t| t.borrow().clone()).collect();
        let Some(first) = lazies.first() else {
            return Err(arg("cat", &[], "expected a non-empty list of tensors"));
        };
        let nodes: Vec<&Rc<Node>> = lazies.iter().map(|t| &t.node).collect();
        let device = same_device("cat", &nodes)?;
        let s0 = &first.node.meta.shape;
        let d = shape::wrap_dim(dim, s0.len()).map_err(|r| arg("cat", s0, r))?;
        if s0.is_empty() {
            return Err(arg("cat", s0, "zero-dimensional tensors cannot be concatenated"));
        }
        let mut out = s0.clone();
        out[d] = 0;
        let mut kind = first.node.meta.kind;
        for n in &nodes {
            let s = &n.meta.shape;
            if s.len() != s0.len() || s.iter().zip(s0).enumerate().any(|(i, (a, b))| i != d && a != b) {
                return Err(shape_err("cat", s0, s, format!("sizes must match except in dimension {d}")));
            }
            out[d] += s[d];
            kind = shape::promote(kind, n.meta.kind);
        }
        let (flow, mixes) = if nodes.iter().any(|n| n.meta.batch().is_some_and(|bd| bd.dim == d)) {
            (Flow::Opaque, Some("`cat` concatenates along the batch dimension".to_string()))
        } else {
            let mapped: Vec<Option<usize>> = nodes.iter().map(|n| n.meta.batch().map(|bd| bd.dim)).collect();
            combine_flows("cat", &nodes, &mapped, &out, Linearity::Additive, true)?
        };
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(Op::Cat { dim: d as i64 }, inputs, out, kind, device).flow((flow, mixes)).finish())
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
        let n = &self.node;
        let m = &n.meta;
        let record_op = Op::Reduce { op, dims: None, keepdim, kind };
        let name = record_op.label();
        let a = |r: String| arg(&name, &m.shape, r);
        let (reduced, dims) = match dims {
            Some(list) if !list.is_empty() => {
                let wrapped = shape::wrap_dims(list, m.shape.len()).map_err(a)?;
                (wrapped, Some(list.to_vec()))
            }
            // An empty list reduces every dimension, as in libtorch.
            Some(_) => {
                ((0..m.shape.len()).collect(), if keepdim { Some((0..m.shape.len() as i64).collect()) } else { None })
            }
            None => ((0..m.shape.len()).collect(), None),
        };
        let out_kind = match op {
            ReduceOp::Sum => kind.unwrap_or(if shape::is_integral(m.kind) { Kind::Int64 } else { m.kind }),
            ReduceOp::Mean => {
                let k = kind.unwrap_or(m.kind);
                if !shape::is_floating(k) {
                    return Err(kind_err(&name, k, &m.shape, "mean needs a floating-point kind (pass one)"));
                }
                k
            }
            ReduceOp::Amax => {
                if m.shape.iter().zip(0..).any(|(&s, i)| s == 0 && reduced.contains(&i)) {
                    return Err(a("cannot take the maximum over an empty dimension".into()));
                }
                m.kind
            }
        };
        let out: Vec<i64> = match (&dims, keepdim) {
            (None, false) => Vec::new(),
            _ => m
                .shape
                .iter()
                .enumerate()
                .filter_map(|(i, &s)| if reduced.contains(&i) { keepdim.then_some(1) } else { Some(s) })
                .collect(),
        };
        let flow = match m.flow {
            Flow::PerSample(bd) if reduced.contains(&bd.dim) => match op {
                ReduceOp::Sum | ReduceOp::Mean => (Flow::Sum, None),
                ReduceOp::Amax => (Flow::Max, None),
            },
            Flow::PerSample(bd) => {
                let dim = if keepdim { bd.dim } else { bd.dim - reduced.iter().filter(|&&r| r < bd.dim).count() };
                (Flow::PerSample(BatchDim { dim, ..bd }), None)
            }
            Flow::Sum if op == ReduceOp::Amax => {
                (Flow::Opaque, Some("takes a maximum of a value summed over the batch".to_string()))
            }
            Flow::Max if op != ReduceOp::Amax => (Flow::Opaque, Some("sums a maximum over the batch".to_string())),
            other => (other, None),
        };
        let record_op = Op::Reduce { op, dims, keepdim, kind };
        Ok(Record::new(record_op, vec![n.clone()], out, out_kind, m.device).flow(flow).finish())
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
        dims: impl AsRef<[i64]>,
        keepdim: bool,
        kind: impl Into<Option<Kind>>,
    ) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Sum, Some(dims.as_ref()), keepdim, kind.into())
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
        dims: impl AsRef<[i64]>,
        keepdim: bool,
        kind: impl Into<Option<Kind>>,
    ) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Mean, Some(dims.as_ref()), keepdim, kind.into())
    }

    /// The maximum over `dims` (tch's `amax`). Over the batch it can be evaluated, not
    /// differentiated in micro-batches.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad dimensions or an empty one.
    pub fn f_amax(&self, dims: impl AsRef<[i64]>, keepdim: bool) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Amax, Some(dims.as_ref()), keepdim, None)
    }

    /// The maximum of all elements (tch's `max`).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for an empty tensor.
    pub fn f_max(&self) -> Result<LazyTensor, LazyError> {
        self.f_reduce(ReduceOp::Amax, None, false, None)
    }

    // -----------------------------------------------------------------------------------------
    // Losses

    /// Flow of a loss over `[N, C]` inputs and `[N]` targets (batch on dimension 0 of both).
    fn class_loss_flow(
        name: &str,
        input: &Rc<Node>,
        target: &Rc<Node>,
        reduction: Reduction,
    ) -> Result<(Flow, Option<String>), LazyError> {
        let n = input.meta.shape.first().copied().unwrap_or(1);
        let per_sample_shape = if input.meta.shape.len() == 2 { vec![n] } else { vec![] };
        let mapped = [
            input.meta.batch().filter(|bd| bd.dim == 0 && input.meta.shape.len() == 2).map(|_| 0),
            target.meta.batch().filter(|bd| bd.dim == 0).map(|_| 0),
        ];
        // A fixed input or target facing a per-sample other side of the batch's size.
        let batched = [input, target].iter().find_map(|t| t.meta.batch());
        if let Some(bd) = batched {
            let full = bd.size * bd.factor;
            for t in [input, target] {
                if t.meta.flow == Flow::Fixed && t.meta.shape.first() == Some(&full) && full > 1 {
                    return Err(LazyError::Batch {
                        op: name.into(),
                        lhs: input.meta.shape.clone(),
                        rhs: target.meta.shape.clone(),
                        reason: "one side is not batched but has the batch's size; wrap both with lazy(..)".into(),
                    });
                }
            }
        }
        let (flow, mixes) =
            combine_flows(name, &[input, target], &mapped, &per_sample_shape, Linearity::Nonlinear, false)?;
        Ok(match (flow, reduction) {
            (Flow::PerSample(_), Reduction::Mean | Reduction::Sum) => (Flow::Sum, mixes),
            other => (other.0, mixes),
        })
    }

    fn check_class_loss(name: &str, input: &Node, target: &Node) -> Result<(), LazyError> {
        let (si, st) = (&input.meta.shape, &target.meta.shape);
        let ok = match si.len() {
            2 => st.len() == 1 && st[0] == si[0],
            1 => st.is_empty(),
            _ => false,
        };
        if !ok {
            return Err(shape_err(
                name,
                si,
                st,
                "expected input [N, C] with target [N], or input [C] with a 0-dim target",
            ));
        }
        floating(name, input)?;
        if target.meta.kind != Kind::Int64 {
            return Err(kind_err(name, target.meta.kind, st, "targets must be Int64 class indices"));
        }
        Ok(())
    }

    /// Cross-entropy of logits `[N, C]` against class indices `[N]`, averaged over the
    /// targets that are not -100 (tch's `cross_entropy_for_logits`; the log-softmax is taken in
    /// the logits' kind, where tch uses `Float`). Split in micro-batches, each one is weighted
    /// by its share of the counted targets, so values and gradients are the full batch's.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for other shapes, [`LazyError::Kind`] for non-floating logits or
    /// non-`Int64` targets.
    pub fn f_cross_entropy_for_logits(&self, targets: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let t = targets.into_lazy();
        let name = "cross_entropy_for_logits";
        let (x, tn) = (&self.node, &t.node);
        let device = same_device(name, &[x, tn])?;
        Self::check_class_loss(name, x, tn)?;
        let flow = Self::class_loss_flow(name, x, tn, Reduction::Mean)?;
        let op = Op::CrossEntropy { ignore_index: -100 };
        Ok(Record::new(op, vec![x.clone(), tn.clone()], vec![], x.meta.kind, device).flow(flow).finish())
    }

    /// Negative log-likelihood of log-probabilities `[N, C]` against class indices `[N]`
    /// (tch's `nll_loss`: mean over targets that are not -100, no class weights).
    ///
    /// # Errors
    /// As [`f_cross_entropy_for_logits`](Self::f_cross_entropy_for_logits).
    pub fn f_nll_loss(&self, targets: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_g_nll_loss(targets, None::<&LazyTensor>, Reduction::Mean, -100)
    }

    /// Negative log-likelihood with class `weight`s (`[C]`), a reduction and an ignored index
    /// (tch's `g_nll_loss`). A mean is over the weights of the counted targets, as in libtorch.
    ///
    /// # Errors
    /// As [`f_cross_entropy_for_logits`](Self::f_cross_entropy_for_logits); a weight that is not
    /// `[C]`; [`Reduction::Other`].
    pub fn f_g_nll_loss(
        &self,
        targets: impl IntoLazy,
        weight: Option<impl IntoLazy>,
        reduction: Reduction,
        ignore_index: i64,
    ) -> Result<LazyTensor, LazyError> {
        let t = targets.into_lazy();
        let w = weight.map(IntoLazy::into_lazy);
        let name = "nll_loss";
        let (x, tn) = (&self.node, &t.node);
        let mut nodes = vec![x, tn];
        if let Some(w) = &w {
            nodes.push(&w.node);
        }
        let device = same_device(name, &nodes)?;
        Self::check_class_loss(name, x, tn)?;
        if let Some(w) = &w {
            let c = *x.meta.shape.last().expect("checked");
            if w.node.meta.shape != [c] || w.node.meta.flow != Flow::Fixed {
                return Err(shape_err(
                    name,
                    &x.meta.shape,
                    &w.node.meta.shape,
                    format!("weight must be a fixed [{c}]"),
                ));
            }
            same_kind(name, x, &w.node)?;
        }
        if matches!(reduction, Reduction::Other(_)) {
            return Err(arg(name, &x.meta.shape, "unknown reduction"));
        }
        let flow = Self::class_loss_flow(name, x, tn, reduction)?;
        let out = if reduction == Reduction::None { x.meta.shape[..x.meta.shape.len() - 1].to_vec() } else { vec![] };
        let op = Op::NllLoss { reduction, ignore_index };
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(op, inputs, out, x.meta.kind, device).flow(flow).finish())
    }

    /// Mean squared error against `target` (broadcast), with a reduction (tch's `mse_loss`).
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes do not broadcast, [`LazyError::Kind`],
    /// [`LazyError::Device`]; [`Reduction::Other`].
    pub fn f_mse_loss(&self, target: impl IntoLazy, reduction: Reduction) -> Result<LazyTensor, LazyError> {
        let t = target.into_lazy();
        let name = "mse_loss";
        let (x, tn) = (&self.node, &t.node);
        let device = same_device(name, &[x, tn])?;
        let per = shape::broadcast(&x.meta.shape, &tn.meta.shape)
            .map_err(|r| shape_err(name, &x.meta.shape, &tn.meta.shape, r))?;
        floating(name, x)?;
        same_kind(name, x, tn)?;
        if matches!(reduction, Reduction::Other(_)) {
            return Err(arg(name, &x.meta.shape, "unknown reduction"));
        }
        let (flow, mixes) = broadcast_flows(name, &[x, tn], &per, Linearity::Nonlinear)?;
        let (flow, out) = match (flow, reduction) {
            (Flow::PerSample(_), Reduction::Mean | Reduction::Sum) => (Flow::Sum, vec![]),
            (f, Reduction::None) => (f, per),
            (f, _) => (f, vec![]),
        };
        let op = Op::MseLoss { reduction };
        Ok(Record::new(op, vec![x.clone(), tn.clone()], out, x.meta.kind, device).flow((flow, mixes)).finish())
    }

    // -----------------------------------------------------------------------------------------
    // Modules

    /// Applies a layer (tch's `apply`): `x.apply(&linear)`.
    ///
    /// # Errors
    /// The layer's recording error.
    pub fn f_apply<M: super::nn::LazyModule + ?Sized>(&self, module: &M) -> Result<LazyTensor, LazyError> {
        module.lazy_forward(self)
    }

    /// Applies a layer that behaves differently in training (tch's `apply_t`).
    ///
    /// # Errors
    /// The layer's recording error.
    pub fn f_apply_t<M: super::nn::LazyModuleT + ?Sized>(
        &self,
        module: &M,
        train: bool,
    ) -> Result<LazyTensor, LazyError> {
        module.lazy_forward_t(self, train)
    }
}

/// Generates the panicking twin of each fallible op, as tch pairs `op` with `f_op`.
macro_rules! panicking {
    ($( $name:ident => $f:ident ( $($arg:ident : $ty:ty),* ) ; )*) => {
        impl LazyTensor {
            $(
                #[doc = concat!("Like [`", stringify!($f), "`](Self::", stringify!($f), "), panicking with its error.")]
                ///
                /// # Panics
                /// When the op cannot be recorded (the error's message says why), as tch's method does.
                #[track_caller]
                #[allow(clippy::too_many_arguments)]
                pub fn $name(&self, $($arg: $ty),*) -> LazyTensor {
                    self.$f($($arg),*).unwrap_or_else(|e| panic!("{e}"))
                }
            )*
        }
    };
}

panicking! {
    relu => f_relu();
    sigmoid => f_sigmoid();
    tanh => f_tanh();
    exp => f_exp();
    log => f_log();
    neg => f_neg();
    sqrt => f_sqrt();
    abs => f_abs();
    gelu => f_gelu(approximate: &str);
    add => f_add(other: impl IntoLazy);
    sub => f_sub(other: impl IntoLazy);
    mul => f_mul(other: impl IntoLazy);
    div => f_div(other: impl IntoLazy);
    pow => f_pow(other: impl IntoLazy);
    maximum => f_maximum(other: impl IntoLazy);
    minimum => f_minimum(other: impl IntoLazy);
    eq_tensor => f_eq_tensor(other: impl IntoLazy);
    ne_tensor => f_ne_tensor(other: impl IntoLazy);
    lt_tensor => f_lt_tensor(other: impl IntoLazy);
    le_tensor => f_le_tensor(other: impl IntoLazy);
    gt_tensor => f_gt_tensor(other: impl IntoLazy);
    ge_tensor => f_ge_tensor(other: impl IntoLazy);
    add_scalar => f_add_scalar(s: f64);
    sub_scalar => f_sub_scalar(s: f64);
    rsub_scalar => f_rsub_scalar(s: f64);
    mul_scalar => f_mul_scalar(s: f64);
    div_scalar => f_div_scalar(s: f64);
    rdiv_scalar => f_rdiv_scalar(s: f64);
    pow_tensor_scalar => f_pow_tensor_scalar(s: f64);
    eq => f_eq(s: f64);
    ne => f_ne(s: f64);
    lt => f_lt(s: f64);
    le => f_le(s: f64);
    gt => f_gt(s: f64);
    ge => f_ge(s: f64);
    softmax => f_softmax(dim: i64, kind: impl Into<Option<Kind>>);
    log_softmax => f_log_softmax(dim: i64, kind: impl Into<Option<Kind>>);
    matmul => f_matmul(other: impl IntoLazy);
    linear => f_linear(weight: impl IntoLazy, bias: Option<impl IntoLazy>);
    conv2d => f_conv2d(weight: impl IntoLazy, bias: Option<impl IntoLazy>, stride: impl AsRef<[i64]>, padding: impl AsRef<[i64]>, dilation: impl AsRef<[i64]>, groups: i64);
    max_pool2d => f_max_pool2d(kernel: impl AsRef<[i64]>, stride: impl AsRef<[i64]>, padding: impl AsRef<[i64]>, dilation: impl AsRef<[i64]>, ceil_mode: bool);
    avg_pool2d => f_avg_pool2d(kernel: impl AsRef<[i64]>, stride: impl AsRef<[i64]>, padding: impl AsRef<[i64]>, ceil_mode: bool, count_include_pad: bool, divisor_override: impl Into<Option<i64>>);
    adaptive_avg_pool2d => f_adaptive_avg_pool2d(output_size: impl AsRef<[i64]>);
    batch_norm => f_batch_norm(weight: Option<impl IntoLazy>, bias: Option<impl IntoLazy>, running_mean: impl IntoLazy, running_var: impl IntoLazy, training: bool, momentum: f64, eps: f64);
    layer_norm => f_layer_norm(normalized_shape: impl AsRef<[i64]>, weight: Option<impl IntoLazy>, bias: Option<impl IntoLazy>, eps: f64);
    dropout => f_dropout(p: f64, train: bool);
    view => f_view(shape: impl AsRef<[i64]>);
    reshape => f_reshape(shape: impl AsRef<[i64]>);
    flatten => f_flatten(start_dim: i64, end_dim: i64);
    transpose => f_transpose(dim0: i64, dim1: i64);
    permute => f_permute(dims: impl AsRef<[i64]>);
    unsqueeze => f_unsqueeze(dim: i64);
    squeeze => f_squeeze();
    squeeze_dim => f_squeeze_dim(dim: i64);
    narrow => f_narrow(dim: i64, start: i64, length: i64);
    to_kind => f_to_kind(kind: Kind);
    contiguous => f_contiguous();
    sum => f_sum(kind: impl Into<Option<Kind>>);
    sum_dim_intlist => f_sum_dim_intlist(dims: impl AsRef<[i64]>, keepdim: bool, kind: impl Into<Option<Kind>>);
    mean => f_mean(kind: impl Into<Option<Kind>>);
    mean_dim => f_mean_dim(dims: impl AsRef<[i64]>, keepdim: bool, kind: impl Into<Option<Kind>>);
    amax => f_amax(dims: impl AsRef<[i64]>, keepdim: bool);
    max => f_max();
    cross_entropy_for_logits => f_cross_entropy_for_logits(targets: impl IntoLazy);
    nll_loss => f_nll_loss(targets: impl IntoLazy);
    g_nll_loss => f_g_nll_loss(targets: impl IntoLazy, weight: Option<impl IntoLazy>, reduction: Reduction, ignore_index: i64);
    mse_loss => f_mse_loss(target: impl IntoLazy, reduction: Reduction);
}

impl LazyTensor {
    /// Like [`f_embedding`](Self::f_embedding), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn embedding(
        weight: impl IntoLazy,
        indices: impl IntoLazy,
        padding_idx: i64,
        scale_grad_by_freq: bool,
    ) -> LazyTensor {
        Self::f_embedding(weight, indices, padding_idx, scale_grad_by_freq).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`f_cat`](Self::f_cat), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn cat<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T], dim: i64) -> LazyTensor {
        Self::f_cat(tensors, dim).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`f_apply`](Self::f_apply), panicking with its error.
    ///
    /// # Panics
    /// When the layer cannot be recorded.
    #[track_caller]
    pub fn apply<M: super::nn::LazyModule + ?Sized>(&self, module: &M) -> LazyTensor {
        self.f_apply(module).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`f_apply_t`](Self::f_apply_t), panicking with its error.
    ///
    /// # Panics
    /// When the layer cannot be recorded.
    #[track_caller]
    pub fn apply_t<M: super::nn::LazyModuleT + ?Sized>(&self, module: &M, train: bool) -> LazyTensor {
        self.f_apply_t(module, train).unwrap_or_else(|e| panic!("{e}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Operators: panic on shape errors, as tch's operators do.

macro_rules! binary_operators {
    ($($trait:ident $method:ident $f:ident $fs:ident $rev:ident;)*) => {$(
        impl std::ops::$trait<&LazyTensor> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                self.$f(rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<LazyTensor> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                self.$f(&rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<&LazyTensor> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                self.$f(rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<LazyTensor> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                self.$f(&rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<&Tensor> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> LazyTensor {
                self.$f(rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<&Tensor> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> LazyTensor {
                self.$f(rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<f64> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: f64) -> LazyTensor {
                self.$fs(rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<f64> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: f64) -> LazyTensor {
                self.$fs(rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<&LazyTensor> for f64 {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                rhs.$rev(self).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl std::ops::$trait<LazyTensor> for f64 {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                rhs.$rev(self).unwrap_or_else(|e| panic!("{e}"))
            }
        }
    )*};
}

binary_operators! {
    Add add f_add f_add_scalar f_add_scalar;
    Sub sub f_sub f_sub_scalar f_rsub_scalar;
    Mul mul f_mul f_mul_scalar f_mul_scalar;
    Div div f_div f_div_scalar f_rdiv_scalar;
}

impl std::ops::Neg for &LazyTensor {
    type Output = LazyTensor;
    fn neg(self) -> LazyTensor {
        LazyTensor::neg(self)
    }
}

impl std::ops::Neg for LazyTensor {
    type Output = LazyTensor;
    fn neg(self) -> LazyTensor {
        LazyTensor::neg(&self)
    }
}

// ---------------------------------------------------------------------------------------------
// Forcing evaluation: printing and conversions compute the value.

impl fmt::Display for LazyTensor {
    /// Computes the value and prints it as tch does; an error is printed in its place.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_tensor() {
            Ok(t) => fmt::Display::fmt(&t, f),
            Err(e) => write!(f, "<{e}>"),
        }
    }
}

impl fmt::Debug for LazyTensor {
    /// The recorded facts: op, shape, kind, device and batch dimension. Evaluates nothing, so
    /// `dbg!`, `{:?}` in a log line or an assertion message never plans, allocates or runs out
    /// of memory; `Display` computes the value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.meta();
        write!(f, "LazyTensor[{}, {:?}, {:?}, {:?}", self.op_name(), m.shape, m.kind, m.device)?;
        if let Some(bd) = m.batch() {
            write!(f, ", batch dim {}", bd.dim)?;
        }
        f.write_str("]")
    }
}

macro_rules! try_from_lazy {
    ($($t:ty),*) => {$(
        impl TryFrom<&LazyTensor> for $t {
            type Error = LazyError;
            /// Computes the value and converts it as tch's `TryFrom<&Tensor>` does.
            fn try_from(value: &LazyTensor) -> Result<Self, LazyError> {
                let t = value.to_tensor()?;
                <$t>::try_from(&t).map_err(|source| LazyError::Torch { node: None, op: "try_from".into(), source })
            }
        }
        impl TryFrom<LazyTensor> for $t {
            type Error = LazyError;
            /// Computes the value and converts it as tch's `TryFrom<&Tensor>` does.
            fn try_from(value: LazyTensor) -> Result<Self, LazyError> {
                <$t>::try_from(&value)
            }
        }
    )*};
}

try_from_lazy!(f64, f32, i64, bool, Vec<f64>, Vec<f32>, Vec<i64>);

impl TryFrom<&LazyTensor> for Tensor {
    type Error = LazyError;
    /// Computes the value ([`LazyTensor::to_tensor`]).
    fn try_from(value: &LazyTensor) -> Result<Self, LazyError> {
        value.to_tensor()
    }
}

impl LazyTensor {
    /// The plan of the value's forward and backward, as a table: handy to print.
    ///
    /// # Errors
    /// As [`plan`](Self::plan).
    pub fn explain(&self, mode: Mode, options: &Options) -> Result<String, LazyError> {
        Ok(self.plan(mode, options)?.to_string())
    }
}
