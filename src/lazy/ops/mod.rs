//! The ops a graph can hold, one file per family (`pointwise`, `matrix`, `window`, `norm`,
//! `layout`, `reduce`, `loss`, `attention`, `recurrent` for a whole LSTM/GRU sequence on
//! libtorch's fused kernel, and `custom` for users' own). Everything about an op sits in its
//! family's file:
//!
//! - **its rules**, in one type per op (or one row per op, for the many unary and binary
//!   elementwise ops) implementing [`Operation`](crate::lazy::graph::Operation): its facts,
//!   stated once as data ([`OpFacts`](crate::lazy::facts::OpFacts): what autograd keeps, which
//!   input gradients are views, what it updates in place) and the kernel calls it makes (for
//!   the cost layer to price on the plan's device); and [`Run`](crate::lazy::graph::Run): how
//!   it runs on a micro-batch, and how a split run computes its share of a value summed over
//!   the batch;
//! - **its recording**: the public `f_op` method on [`LazyTensor`](crate::lazy::LazyTensor),
//!   with its checks, the output's shape, kind and batch flow, in the family's
//!   `#[toma_macros::tensor_methods(..)]` block, which writes the panicking twin `op` and the
//!   family's trait ([`PointwiseOps`], ..) from that one signature.
//!
//! Adding an op touches only its family's file: a type with its `Operation` and `Run` impls, and
//! its `f_op` method. `record` turns a recorded op into a node (its batch flow; its costs
//! whatever the device are `graph`'s `Cost::of`). On a value computed at once (the eager form a
//! `toma::lazy::nn::func` closure gets on a `Tensor`), a trait method calls tch's own method
//! directly, and any other op is recorded and run at once.

use std::rc::Rc;

use tch::Kind;

use super::error::LazyError;
use super::graph::{Flow, LazyTensor, Node};
use super::shape;
use record::{unary_flow, Linearity};

pub(crate) mod attention;
pub(crate) mod autocast;
pub(crate) mod custom;
pub(crate) mod layout;
pub(crate) mod loss;
pub(crate) mod matrix;
pub(crate) mod norm;
pub(crate) mod pointwise;
pub(crate) mod record;
pub(crate) mod recurrent;
pub(crate) mod reduce;
pub(crate) mod window;

pub use layout::LayoutOps;
pub use loss::LossOps;
pub use matrix::MatrixOps;
pub use norm::NormOps;
pub use pointwise::PointwiseOps;
pub use reduce::ReduceOps;
pub use window::WindowOps;

/// What a tensor type's methods fail with: [`TchError`](tch::TchError) for tch's `Tensor`,
/// [`LazyError`] for a [`LazyTensor`](crate::lazy::LazyTensor). Every family of tensor methods
/// ([`TensorOps`](crate::lazy::TensorOps) and the traits it is made of) builds on it.
pub trait Fallible: Sized {
    /// The error of a failing op.
    type Error: std::error::Error;
}

impl Fallible for tch::Tensor {
    type Error = tch::TchError;
}

impl Fallible for crate::lazy::LazyTensor {
    type Error = LazyError;
}

// ---------------------------------------------------------------------------------------------
// Helpers the families record with.

/// The error of tch's method called directly on a value computed at once.
pub(crate) fn eager_err(op: &'static str) -> impl Fn(tch::TchError) -> LazyError {
    move |source| LazyError::Torch { node: None, op: op.into(), source }
}

/// tch's result for a value computed at once, its error named by the op.
pub(crate) fn eager(op: &'static str, result: Result<tch::Tensor, tch::TchError>) -> Result<LazyTensor, LazyError> {
    result.map(LazyTensor::from_eager).map_err(eager_err(op))
}

/// The values of operands all computed at once (`None` if any is recorded, or none is given),
/// for a static method to call tch's directly.
pub(crate) fn eager_values<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T]) -> Option<Vec<&tch::Tensor>> {
    if tensors.is_empty() {
        return None;
    }
    tensors.iter().map(|t| t.borrow().eager_value()).collect()
}

pub(crate) fn arg(op: &str, shape: &[i64], reason: impl Into<String>) -> LazyError {
    LazyError::Argument { op: op.into(), shape: shape.to_vec(), reason: reason.into() }
}

/// Why a fixed operand with the batch's size along the batch dimension is refused where it
/// meets batched values: it looks like data that was not wrapped.
pub(crate) const NOT_WRAPPED: &str = "a fixed operand has the batch's size along the batch dimension and is not a \
     broadcast of parameters (an `expand` or `repeat` to the batch, and layers after it, are per sample): wrap data \
     with lazy(..)";

pub(crate) fn shape_err(op: &str, lhs: &[i64], rhs: &[i64], reason: impl Into<String>) -> LazyError {
    LazyError::Shape { op: op.into(), lhs: lhs.to_vec(), rhs: rhs.to_vec(), reason: reason.into() }
}

pub(crate) fn kind_err(op: &str, kind: Kind, shape: &[i64], reason: impl Into<String>) -> LazyError {
    LazyError::Kind { op: op.into(), kind, shape: shape.to_vec(), reason: reason.into() }
}

pub(crate) fn floating(op: &str, n: &Node) -> Result<(), LazyError> {
    if shape::is_floating(n.meta.kind) {
        Ok(())
    } else {
        Err(kind_err(op, n.meta.kind, &n.meta.shape, "expected a floating-point tensor"))
    }
}

pub(crate) fn same_kind(op: &str, a: &Node, b: &Node) -> Result<(), LazyError> {
    if a.meta.kind == b.meta.kind || autocast::mixes(a, b) {
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

/// The flow of an op whose batch dimension stays where it is and whose shape does not change.
pub(crate) fn same_shape_flow(
    op: &str,
    n: &Rc<Node>,
    linearity: Linearity,
) -> Result<(Flow, Option<String>), LazyError> {
    unary_flow(op, n, &n.meta.shape, Some, linearity)
}

/// Whether input `j` requires a gradient.
pub(crate) fn requires(inputs: &[Rc<Node>], j: usize) -> bool {
    inputs.get(j).is_some_and(|n| n.meta.requires_grad)
}
