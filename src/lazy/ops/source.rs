//! Where values come from: batched inputs, narrowed to each micro-batch, and fixed tensors
//! (parameters and constants). Both are already in memory: they cost the plan nothing.

use tch::{TchError, Tensor};

use super::{Rules, RunCx};
use crate::lazy::graph::Param;

pub(crate) enum Source {
    /// A batched input, narrowed to each micro-batch along `dim`.
    Input { tensor: Tensor, dim: usize },
    /// A fixed tensor: a parameter (`param` when it requires a gradient) or a constant.
    Leaf { tensor: Tensor, param: Option<Box<Param>> },
}

impl Rules for Source {
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
}
