//! The executor: runs a compiled graph on consecutive micro-batches under the retry engine,
//! and puts the full-batch result (value, or accumulated gradients) together.

mod backward;
mod chunks;
mod evaluate;
mod forward;
mod grads;
mod recompute;

use tch::{TchError, Tensor};

use crate::lazy::error::LazyError;

pub(crate) use backward::backward;
pub(crate) use evaluate::{evaluate, read, run_eagerly, trace};

/// One micro-batch: where it starts, its size, and whether the batch is split at all.
struct Chunk<'a> {
    start: i64,
    b: i64,
    split: bool,
    /// The micro-batch's share of the batch, `b / N`.
    frac: f64,
    /// Full-batch denominators of mean-reduced class losses, by node position; empty where
    /// none was worked out (a whole batch).
    dens: &'a [Option<f64>],
    /// Tensors that replace fixed leaves (detached stand-ins of non-leaf operands).
    stand_ins: &'a [Option<Tensor>],
}

/// What the executor did at one op of a traced micro-batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TracedOp {
    /// Position of the op (as in [`Plan::ops`](super::Plan::ops)).
    pub node: usize,
    /// The op's name.
    pub name: String,
    /// The shape of the value it produced.
    pub shape: Vec<i64>,
    /// Bytes of a new allocation for the value (rounded to 512 B); 0 for a view of its input
    /// or for inputs and parameters.
    pub bytes: u64,
    /// Positions of the values the executor holds after the op.
    pub held: Vec<usize>,
}

fn torch(node: usize, op: &str) -> impl Fn(TchError) -> LazyError + '_ {
    move |source| LazyError::Torch { node: Some(node), op: op.into(), source }
}
