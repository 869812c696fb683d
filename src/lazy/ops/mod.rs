//! The ops a graph can hold, one file per family. Each op keeps all of its rules in its
//! family's file:
//!
//! - **recording**: the public `f_op` method on [`LazyTensor`] with its checks, the output's
//!   shape, kind and batch flow, and the panicking twin `op`;
//! - **running** on one micro-batch ([`Rules::run`]);
//! - **memory facts** for the planner: what autograd saves, which input gradients are views,
//!   extras kept for the backward, scratch space;
//! - **the micro-batch rewrite**: how a split run computes the op's share of a value summed
//!   over the batch ([`Rules::run_share`], [`Rules::adds_fixed`], [`Rules::counted_targets`]).
//!
//! Adding an op touches only its family's file: a variant, a method, and the arms of the
//! family's [`Rules`].

use std::rc::Rc;

use tch::Kind;

use super::error::LazyError;
use super::graph::{Flow, Node};
use super::shape;
use record::{unary_flow, Linearity};

pub(crate) mod attention;
pub(crate) mod custom;
pub(crate) mod layout;
pub(crate) mod loss;
pub(crate) mod matrix;
pub(crate) mod norm;
pub(crate) mod pointwise;
pub(crate) mod record;
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

pub(crate) fn arg(op: &str, shape: &[i64], reason: impl Into<String>) -> LazyError {
    LazyError::Argument { op: op.into(), shape: shape.to_vec(), reason: reason.into() }
}

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
