//! The passes of a step: data only, below the planner, so that errors can name them.

/// Which pass a step of the schedule belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Running an op.
    Forward,
    /// Running an op's backward.
    Backward,
    /// Running an op again before its backward, its saved activations dropped after the
    /// forward (see [`Recompute`](crate::lazy::Recompute)).
    Recompute,
    /// Adding the micro-batch's parameter gradients into `.grad()`.
    Accumulate,
}

impl Phase {
    /// The pass in words, as plans and errors print it.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Recompute => "recompute",
            Phase::Accumulate => "gradient accumulation",
        }
    }
}
