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

use tch::{Kind, TchError, Tensor};

use super::custom::CustomOp;
use super::error::LazyError;
use super::graph::{Flow, Meta, Node};
use super::scratch::ReduceStaging;
use super::shape;
use record::{unary_flow, Linearity};

pub(crate) mod attention;
pub(crate) mod layout;
pub(crate) mod loss;
pub(crate) mod matrix;
pub(crate) mod norm;
pub(crate) mod pointwise;
pub(crate) mod record;
pub(crate) mod reduce;
pub(crate) mod source;
pub(crate) mod window;

/// The families, listed once: the `Op` enum, its `From` conversions and its rules.
macro_rules! families {
    ($($family:ident($ty:ty)),*) => {
        /// One recorded operation, by family. Shapes that depend on the batch are not stored
        /// here: they are the node's [`Meta`] shape at the micro-batch size.
        pub(crate) enum Op {
            $($family($ty),)*
            Custom(Rc<CustomOp>),
        }

        $(
            impl From<$ty> for Op {
                fn from(op: $ty) -> Op {
                    Op::$family(op)
                }
            }
        )*

        impl Op {
            /// The op's rules.
            pub(crate) fn rules(&self) -> &dyn Rules {
                match self {
                    $(Op::$family(r) => r,)*
                    Op::Custom(r) => &**r,
                }
            }
        }
    };
}
families!(
    Source(source::Source),
    Pointwise(pointwise::Pointwise),
    Matrix(matrix::Matrix),
    Window(window::Window),
    Norm(norm::Norm),
    Layout(layout::Layout),
    Reduce(reduce::Reduce),
    Loss(loss::Loss),
    Attention(attention::Attention)
);

/// Everything an op knows about itself. Defaults describe an op that saves nothing, allocates
/// nothing but its output, and needs no rewrite in a split run.
pub(crate) trait Rules {
    /// The op's name, as tch calls the method.
    fn name(&self) -> &'static str;

    /// Runs the op on one micro-batch.
    fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError>;

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

    /// A tensor the op allocates besides its output and autograd keeps for the backward (when
    /// the output requires a gradient): `(elements per sample, fixed elements, kind)`.
    fn saved_extra(&self, _inputs: &[Rc<Node>], _meta: &Meta) -> Option<(u64, u64, Kind)> {
        None
    }

    /// Scratch space the op's kernels take while it runs, forward and backward.
    fn scratch(&self, _inputs: &[Rc<Node>], _meta: &Meta) -> Scratch {
        Scratch::default()
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
    /// The full batch's count, for ops with [`Rules::counted_targets`].
    pub(crate) den: Option<f64>,
    /// Whether an input is per-sample (the op reduces over the batch here).
    pub(crate) reduces_batch: bool,
}

/// Scratch space of an op while it runs, besides inputs and outputs.
#[derive(Default)]
pub(crate) struct Scratch {
    /// Elements `(per sample, fixed)` in the input's kind, forward and backward.
    pub(crate) forward: (u64, u64),
    pub(crate) backward: (u64, u64),
    /// Elements at a micro-batch of one, forward and backward, where a single sample runs
    /// another way (libtorch's native convolution for one small sample, oneDNN's for more).
    pub(crate) one: Option<(u64, u64)>,
    /// Staging buffers of CUDA reductions, each with whether it is taken in the backward.
    pub(crate) staged: Vec<(bool, ReduceStaging)>,
}

impl Scratch {
    /// Adds a CUDA reduction of `of` (an output gradient in the backward) over the dimensions
    /// in `mask`.
    pub(crate) fn stage(&mut self, backward: bool, of: &Meta, mask: u64) {
        if let Some(s) = ReduceStaging::new(&of.shape, of.batch(), mask, of.kind, of.device) {
            self.staged.push((backward, s));
        }
    }
}

impl Op {
    /// The op's name, as tch calls the method.
    pub(crate) fn name(&self) -> &'static str {
        self.rules().name()
    }

    /// A stable tag for fingerprints.
    pub(crate) fn tag(&self) -> u64 {
        crate::hash::hash_bytes(0, self.name().as_bytes())
    }

    /// An input or a fixed leaf: already in memory.
    pub(crate) fn is_source(&self) -> bool {
        matches!(self, Op::Source(_))
    }
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

/// Generates the panicking twin of each fallible method, as tch pairs `op` with `f_op`.
macro_rules! panicking {
    ($( $name:ident => $f:ident ( $($arg:ident : $ty:ty),* ) ; )*) => {
        impl $crate::lazy::LazyTensor {
            $(
                #[doc = concat!("Like [`", stringify!($f), "`](Self::", stringify!($f), "), panicking with its error.")]
                ///
                /// # Panics
                /// When the op cannot be recorded (the error's message says why), as tch's method does.
                #[track_caller]
                #[allow(clippy::too_many_arguments)]
                pub fn $name(&self, $($arg: $ty),*) -> $crate::lazy::LazyTensor {
                    self.$f($($arg),*).unwrap_or_else(|e| panic!("{e}"))
                }
            )*
        }
    };
}
pub(crate) use panicking;
