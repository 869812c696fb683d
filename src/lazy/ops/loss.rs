//! Losses: cross-entropy, negative log-likelihood, elementwise losses (squared error, smooth L1,
//! Huber, binary cross-entropy, KL divergence, Poisson), the losses of pairs and triplets
//! (cosine embedding, margin ranking, triplet margin), and CTC. Mean-reduced ones are sums over
//! the batch divided by a count: a split run divides each micro-batch's sum by the full batch's
//! count (CTC's mean, of each sample's loss over its target length, weighs each micro-batch's
//! mean by its share of the batch).

use std::rc::Rc;

use tch::{Kind, Reduction, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{broadcast_flows, combine_flows, same_device, Linearity, Record};
use super::{arg, floating, kind_err, same_kind, shape_err};
use crate::dims::Dims;
use crate::lazy::error::LazyError;
use crate::lazy::error::OrPanic;
use crate::lazy::facts::OpFacts;
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{Flow, KernelCall, Meta, Node, Operation, Run, RunCx, Share, Source};
use crate::lazy::int_list::IntList;
use crate::lazy::shape;
use crate::lazy::size::Elements;
use crate::lazy::LazyTensor;

/// Cross-entropy of logits against class indices. Operands: logits, targets. A mean is over
/// the non-ignored targets; `label_smoothing` mixes in the uniform distribution over the
/// classes, as libtorch does.
pub(crate) struct CrossEntropy {
    ignore_index: i64,
    label_smoothing: f64,
    reduction: Reduction,
}

impl Operation for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy_for_logits"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let input = &inputs[0].meta;
        let x = input.elements();
        // The log-probabilities between log_softmax and nll_loss.
        calls.push(KernelCall::Keeps { elements: x, kind: input.kind });
        // In the backward, `nll_loss`'s gradient of the log-probabilities lives beside
        // `log_softmax`'s gradient of the logits (with label smoothing, the uniform part's
        // gradient is added into it): a tensor as large as the logits. Unpriced, a step whose
        // peak is its loss's backward was a third under.
        calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward: x });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| {
                // The targets; the log-probabilities are kept apart.
                i == 1
            })
            .counted_targets(matches!(self.reduction, Reduction::Mean).then_some(self.ignore_index))
    }
}

impl Run for CrossEntropy {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        cross_entropy(ins[0], ins[1], self.reduction, self.ignore_index, self.label_smoothing)
    }

    fn run_share(&self, ins: &[&Tensor], _node: &Node, share: &Share) -> Option<Result<Tensor, TchError>> {
        if !share.reduces_batch || !matches!(self.reduction, Reduction::Mean) {
            return None;
        }
        let den = share.den.expect("denominator computed before splitting");
        Some(
            cross_entropy(ins[0], ins[1], Reduction::Sum, self.ignore_index, self.label_smoothing)
                .and_then(|s| s.f_div_scalar(den)),
        )
    }
}

/// Negative log-likelihood of log-probabilities against class indices. Operands:
/// log-probabilities, targets, optional class weights.
pub(crate) struct Nll {
    reduction: Reduction,
    ignore_index: i64,
}

impl Operation for Nll {
    fn name(&self) -> &'static str {
        "nll_loss"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|_i| true)
            .counted_targets(matches!(self.reduction, Reduction::Mean).then_some(self.ignore_index))
    }
}

impl Run for Nll {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_nll_loss(ins[1], ins.get(2).copied(), self.reduction, self.ignore_index)
    }

    fn run_share(&self, ins: &[&Tensor], _node: &Node, share: &Share) -> Option<Result<Tensor, TchError>> {
        if !share.reduces_batch || !matches!(self.reduction, Reduction::Mean) {
            return None;
        }
        let den = share.den.expect("denominator computed before splitting");
        Some(
            ins[0]
                .f_nll_loss(ins[1], ins.get(2).copied(), Reduction::Sum, self.ignore_index)
                .and_then(|s| s.f_div_scalar(den)),
        )
    }
}

/// What an elementwise loss computes before its reduction.
#[derive(Clone, Copy)]
pub(crate) enum Elementwise {
    /// Squared error.
    Mse,
    /// Binary cross-entropy of logits (a target of the input's shape).
    BceWithLogits,
    SmoothL1 {
        beta: f64,
    },
    Huber {
        delta: f64,
    },
    /// Kullback-Leibler divergence: the input holds log-probabilities, the target
    /// probabilities (log-probabilities with `log_target`).
    KlDiv {
        log_target: bool,
    },
}

impl Elementwise {
    /// The loss and its reduction.
    fn compute(self, x: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor, TchError> {
        match self {
            Elementwise::Mse => x.f_mse_loss(target, reduction),
            Elementwise::BceWithLogits => {
                x.f_binary_cross_entropy_with_logits(target, None::<&Tensor>, None::<&Tensor>, reduction)
            }
            Elementwise::SmoothL1 { beta } => x.f_smooth_l1_loss(target, reduction, beta),
            Elementwise::Huber { delta } => x.f_huber_loss(target, reduction, delta),
            Elementwise::KlDiv { log_target } => x.f_kl_div(target, reduction, log_target),
        }
    }
}

/// An elementwise loss of input and target, reduced. Autograd keeps both.
pub(crate) struct ElementwiseLoss {
    loss: Elementwise,
    reduction: Reduction,
}

impl Operation for ElementwiseLoss {
    fn name(&self) -> &'static str {
        match self.loss {
            Elementwise::Mse => "mse_loss",
            Elementwise::BceWithLogits => "binary_cross_entropy_with_logits",
            Elementwise::SmoothL1 { .. } => "smooth_l1_loss",
            Elementwise::Huber { .. } => "huber_loss",
            Elementwise::KlDiv { .. } => "kl_div",
        }
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let input = &inputs[0].meta;
        let x = input.elements();
        let times = |k: u64| x.times(k);
        let reduced = !matches!(self.reduction, Reduction::None);
        // Input-sized temporaries of the forward, as libtorch 2.11's allocator counts them
        // (`tests/lazy_peak.rs::elementwise_losses_peak_as_planned`); the backward makes the
        // input's gradient and nothing more. `mse_loss` and `smooth_l1_loss` reduce into
        // their unreduced values, then into a second buffer; binary cross-entropy builds its
        // terms from `(1 - t) x`; `kl_div` from `log t - x` and its product.
        let k = match (self.loss, reduced) {
            (Elementwise::Mse | Elementwise::SmoothL1 { .. }, true) => 2,
            (Elementwise::Huber { .. }, true) => 1,
            (Elementwise::BceWithLogits, true) => 2,
            (Elementwise::BceWithLogits, false) => 1,
            (Elementwise::KlDiv { .. }, true) => 3,
            (Elementwise::KlDiv { .. }, false) => 2,
            _ => return,
        };
        calls.push(KernelCall::Temporaries { forward: times(k), backward: Elements::ZERO });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|_i| true)
    }
}

impl Run for ElementwiseLoss {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let loss = self.loss.compute(ins[0], ins[1], self.reduction)?;
        // libtorch (2.11) reduces `mse_loss` and `smooth_l1_loss` into the first element of
        // their unreduced values: the scalar would hold an input-sized buffer until the loss
        // is dropped (after the backward). A copy of the scalar lets it go now.
        if matches!(self.loss, Elementwise::Mse | Elementwise::SmoothL1 { .. }) && loss.dim() == 0 {
            let mut own = loss.f_empty_like()?;
            own.f_copy_(&loss)?;
            return Ok(own);
        }
        Ok(loss)
    }

    fn run_share(&self, ins: &[&Tensor], node: &Node, share: &Share) -> Option<Result<Tensor, TchError>> {
        if !share.reduces_batch || !matches!(self.reduction, Reduction::Mean) {
            return None;
        }
        // The full batch's count of elements: the broadcast shape of input and target.
        let per = shape::broadcast(&node.inputs[0].meta.shape, &node.inputs[1].meta.shape).unwrap_or_default();
        let count = shape::numel(&per) as f64;
        Some(self.loss.compute(ins[0], ins[1], Reduction::Sum).and_then(|s| s.f_div_scalar(count)))
    }
}

/// A loss libtorch composes from other kernels (`Loss.cpp`), run as tch's method of its name.
#[derive(Clone, Copy)]
pub(crate) enum Composite {
    /// `1 - cos` where the target is 1, `max(0, cos - margin)` where it is -1; operands `x1`,
    /// `x2` (`[N, D]` or `[D]`), target (`[N]` or 0-dim).
    CosineEmbedding { margin: f64 },
    /// `max(0, -target (x1 - x2) + margin)`; operands `x1`, `x2`, target.
    MarginRanking { margin: f64 },
    /// `max(0, d(a, p) - d(a, n) + margin)` with the `p`-distance along the last dimension;
    /// operands anchor, positive, negative.
    TripletMargin { margin: f64, p: f64, eps: f64, swap: bool },
    /// Binary cross-entropy of probabilities; operands input, target, optional weight.
    Bce,
    /// Poisson negative log-likelihood; operands input, target.
    PoissonNll { log_input: bool, full: bool, eps: f64 },
}

impl Composite {
    fn name(self) -> &'static str {
        match self {
            Composite::CosineEmbedding { .. } => "cosine_embedding_loss",
            Composite::MarginRanking { .. } => "margin_ranking_loss",
            Composite::TripletMargin { .. } => "triplet_margin_loss",
            Composite::Bce => "binary_cross_entropy",
            Composite::PoissonNll { .. } => "poisson_nll_loss",
        }
    }

    fn compute(self, ins: &[&Tensor], reduction: Reduction) -> Result<Tensor, TchError> {
        let loss = match self {
            Composite::CosineEmbedding { margin } => {
                Tensor::f_cosine_embedding_loss(ins[0], ins[1], ins[2], margin, reduction)
            }
            Composite::MarginRanking { margin } => {
                Tensor::f_margin_ranking_loss(ins[0], ins[1], ins[2], margin, reduction)
            }
            Composite::TripletMargin { margin, p, eps, swap } => {
                Tensor::f_triplet_margin_loss(ins[0], ins[1], ins[2], margin, p, eps, swap, reduction)
            }
            Composite::Bce => ins[0].f_binary_cross_entropy(ins[1], ins.get(2).copied(), reduction),
            Composite::PoissonNll { log_input, full, eps } => {
                ins[0].f_poisson_nll_loss(ins[1], log_input, full, eps, reduction)
            }
        }?;
        // libtorch (2.11) reduces `binary_cross_entropy` into its unreduced values, resized to
        // a scalar: the scalar would hold an input-sized buffer until it is dropped. A copy lets
        // it go now.
        if matches!(self, Composite::Bce) && loss.dim() == 0 {
            let mut own = loss.f_empty_like()?;
            own.f_copy_(&loss)?;
            return Ok(own);
        }
        Ok(loss)
    }
}

/// A [`Composite`] loss, reduced. Its memory rules were read from libtorch 2.11's CPU allocator
/// (`tests/lazy_peak.rs::one_loss_at_a_time`), in units of the operands' broadcast shape:
/// what autograd keeps of the composite's intermediate values, and its temporaries.
pub(crate) struct CompositeLoss {
    loss: Composite,
    reduction: Reduction,
    /// Elements of the full batch's unreduced loss: a split mean divides each share's sum by it.
    count: f64,
    /// Elements of the operands' broadcast shape.
    unit: Elements,
    /// Elements of the unreduced loss.
    rows: Elements,
}

impl Operation for CompositeLoss {
    fn name(&self) -> &'static str {
        self.loss.name()
    }

    fn kernels<'a>(&'a self, _inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let times = |k: u64| self.unit.times(k);
        let reduced = u64::from(!matches!(self.reduction, Reduction::None));
        let mean = u64::from(matches!(self.reduction, Reduction::Mean));
        // (kept by autograd, forward temporaries, backward temporaries)
        let (kept, forward, backward) = match self.loss {
            // The products, one at a time; the norms, cosines and masks, a row each; the
            // backward's products of the gradient with each operand.
            Composite::CosineEmbedding { .. } => (self.rows.times(10), times(1), times(2)),
            // The negated target and the clamped value (copied: clamped in place); the
            // difference and the product, the sum before the clamp when reduced.
            Composite::MarginRanking { .. } => (times(2), times(1 + reduced), Elements::ZERO),
            // Each distance's operand `x1 - x2 + eps` (a third with `swap`); the difference.
            Composite::TripletMargin { swap, .. } => (times(2 + u64::from(swap)), times(1), Elements::ZERO),
            // The unreduced loss, when reduced (freed by the copy of the scalar).
            Composite::Bce => (Elements::ZERO, times(reduced), Elements::ZERO),
            // `exp(x)` (or `x + eps`, the logarithm's operand); the product, the difference
            // (and the logarithm), and Stirling's term on the target, five more.
            Composite::PoissonNll { log_input, full, .. } => {
                let k = if full {
                    7
                } else if log_input {
                    1
                } else {
                    2
                };
                (times(1), times(k + reduced), times(1 + mean))
            }
        };
        if kept != Elements::ZERO {
            calls.push(KernelCall::SavedCopy { elements: kept, kind: meta.kind });
        }
        calls.push(KernelCall::Temporaries { forward, backward });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| {
            match self.loss {
                // The products of the two operands.
                Composite::CosineEmbedding { .. } => i < 2,
                // Autograd keeps copies (the difference's negated target, the distances' operands).
                Composite::MarginRanking { .. } | Composite::TripletMargin { .. } => false,
                Composite::Bce => true,
                // The target, as the factor of the input (or of its logarithm).
                Composite::PoissonNll { .. } => i == 1,
            }
        })
    }
}

impl Run for CompositeLoss {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        self.loss.compute(ins, self.reduction)
    }

    fn run_share(&self, ins: &[&Tensor], _node: &Node, share: &Share) -> Option<Result<Tensor, TchError>> {
        if !share.reduces_batch || !matches!(self.reduction, Reduction::Mean) {
            return None;
        }
        Some(self.loss.compute(ins, Reduction::Sum).and_then(|s| s.f_div_scalar(self.count)))
    }
}

/// A CTC loss's lengths as its recording takes them.
#[derive(Clone, Copy)]
enum CtcLengthArgs<'a> {
    Lists(&'a [i64], &'a [i64]),
    Tensors(&'a Rc<Node>, &'a Rc<Node>),
}

/// The lengths of a CTC loss given as lists: each sample's input length and target length, and
/// with concatenated targets where each sample's start (`N + 1` offsets).
pub(crate) struct CtcLengths {
    input: Vec<i64>,
    target: Vec<i64>,
    offsets: Option<Vec<i64>>,
}

/// Connectionist temporal classification of log-probabilities (`[T, N, C]`, or `[T, C]`)
/// against targets (`[N, S]` padded, or concatenated 1-D). Operands: log-probabilities,
/// targets, and with lengths as tensors, the input and the target lengths. A split run slices
/// the length lists (and concatenated targets) to the micro-batch; a mean (of each sample's
/// loss over its target length) is weighted by the micro-batch's share of the batch.
pub(crate) struct Ctc {
    blank: i64,
    reduction: Reduction,
    zero_infinity: bool,
    /// The lengths as lists; `None` when they are operands 2 and 3.
    lists: Option<CtcLengths>,
    /// Whether the log-probabilities are split with the batch (their dimension 1).
    batched: bool,
    /// Elements of libtorch's `log_alpha` (`[N, T, 2 L + 1]`, `L` the longest target), and of
    /// the per-sample losses and their clamped target lengths.
    alpha: Elements,
    per_sample: Elements,
    /// Elements of targets libtorch converts to `Int64` (none when they are `Int64`).
    targets_copy: Elements,
}

impl Ctc {
    /// The loss of the samples `cx` runs, reduced by `reduction`.
    fn compute(&self, ins: &[&Tensor], cx: &RunCx<'_>, reduction: Reduction) -> Result<Tensor, TchError> {
        let (lp, targets) = (ins[0], ins[1]);
        let (blank, zero_infinity) = (self.blank, self.zero_infinity);
        let Some(lists) = &self.lists else {
            return Tensor::f_ctc_loss_tensor(lp, targets, ins[2], ins[3], blank, reduction, zero_infinity);
        };
        let samples = if self.batched { cx.start as usize..(cx.start + cx.b) as usize } else { 0..lists.input.len() };
        let (input, target) = (&lists.input[samples.clone()], &lists.target[samples.clone()]);
        match &lists.offsets {
            Some(offsets) if self.batched => {
                let (from, to) = (offsets[samples.start], offsets[samples.end]);
                let targets = targets.f_narrow(0, from, to - from)?;
                Tensor::f_ctc_loss(lp, &targets, input, target, blank, reduction, zero_infinity)
            }
            _ => Tensor::f_ctc_loss(lp, targets, input, target, blank, reduction, zero_infinity),
        }
    }
}

impl Operation for Ctc {
    fn name(&self) -> &'static str {
        if self.lists.is_some() {
            "ctc_loss"
        } else {
            "ctc_loss_tensor"
        }
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // Read from libtorch 2.11's CPU allocator (`tests/lazy_peak.rs::one_loss_at_a_time`):
        // the forward makes `log_alpha` and the per-sample losses, which autograd keeps; the
        // backward makes `log_beta`, as large as `log_alpha`, beside the input's gradient.
        let kind = inputs[0].meta.kind;
        let a = self.alpha;
        calls.push(KernelCall::SavedCopy { elements: a.plus(self.per_sample), kind });
        if self.targets_copy != Elements::ZERO {
            calls.push(KernelCall::SavedCopy { elements: self.targets_copy, kind: Kind::Int64 });
        }
        calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward: a });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| {
                // The log-probabilities, and the targets unless libtorch converts them (the copy is
                // kept instead).
                i == 0 || (i == 1 && inputs[1].meta.kind == Kind::Int64)
            })
            // `log_alpha` is sized by the longest target, which the output's shape does not show.
            .sizing(self.alpha.per ^ self.alpha.fixed.rotate_left(32))
    }
}

impl Run for Ctc {
    fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        self.compute(ins, cx, self.reduction)
    }

    fn run_share(&self, ins: &[&Tensor], _node: &Node, share: &Share) -> Option<Result<Tensor, TchError>> {
        if !share.reduces_batch || !matches!(self.reduction, Reduction::Mean) {
            return None;
        }
        // The micro-batch's mean of each loss over its target length, times its share of the
        // batch: the full batch's mean, summed over micro-batches.
        Some(self.compute(ins, &share.cx, Reduction::Mean).and_then(|m| m.f_mul_scalar(share.frac)))
    }
}

/// Cross-entropy of logits, as libtorch's `cross_entropy_loss` without class weights, with the
/// log-softmax in the logits' kind.
fn cross_entropy(
    x: &Tensor,
    target: &Tensor,
    reduction: Reduction,
    ignore_index: i64,
    label_smoothing: f64,
) -> Result<Tensor, TchError> {
    if label_smoothing == 0.0 {
        return x.f_log_softmax(-1, None)?.f_nll_loss(target, None::<&Tensor>, reduction, ignore_index);
    }
    x.f_cross_entropy_loss(target, None::<&Tensor>, reduction, ignore_index, label_smoothing)
}

#[toma_macros::tensor_methods(LossOps, "Losses (a family of [`TensorOps`](crate::lazy::TensorOps)).")]
impl LazyTensor {
    /// Flow of a loss over `[N, C]` inputs and `[N]` targets (batch on dimension 0 of both).
    fn class_loss_flow(
        name: &str,
        input: &Rc<Node>,
        target: &Rc<Node>,
        reduction: Reduction,
    ) -> Result<(Flow, Option<String>), LazyError> {
        let n = input.meta.shape.first().copied().unwrap_or(1);
        let per_sample_shape = if input.meta.shape.len() == 2 { Dims::from([n]) } else { Dims::new() };
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
                        lhs: input.meta.shape.to_vec(),
                        rhs: target.meta.shape.to_vec(),
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
    #[lazy_only]
    pub fn f_cross_entropy_for_logits(&self, targets: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let name = "cross_entropy_for_logits";
        let op = CrossEntropy { ignore_index: -100, label_smoothing: 0.0, reduction: Reduction::Mean };
        if let (Some(x), Some(t)) = (self.eager_value(), targets.eager_operand()) {
            return super::eager(name, cross_entropy(x, t, op.reduction, op.ignore_index, op.label_smoothing));
        }
        let t = targets.into_lazy();
        let (x, tn) = (self.node(), t.node());
        let device = same_device(name, &[x, tn])?;
        Self::check_class_loss(name, x, tn)?;
        let flow = Self::class_loss_flow(name, x, tn, op.reduction)?;
        Ok(Record::new(op, inputs_of([x, tn]), Dims::new(), x.meta.kind, device).flow(flow).finish())
    }

    /// Cross-entropy of logits `[N, C]` against class indices `[N]` (or `[N, C, d1, ..]` against
    /// `[N, d1, ..]`, one class per position), as tch's
    /// `cross_entropy_loss`: optional class `weight`s (`[C]`), a reduction, an ignored index, and
    /// `label_smoothing` in `[0, 1]` (the target mixed with the uniform distribution over the
    /// classes). Split in micro-batches, a mean is weighted by the full batch's count of
    /// counted targets (or their weights), so values and gradients are the full batch's.
    ///
    /// # Errors
    /// As [`f_nll_loss`](Self::f_nll_loss); [`LazyError::Argument`] for a smoothing outside
    /// `[0, 1]`, or smoothing together with class weights (not modelled lazily: compute it
    /// eagerly, or write the smoothed term with `log_softmax` and `mean_dim`).
    pub fn f_cross_entropy_loss(
        &self,
        targets: impl IntoLazy,
        #[fixed] weight: Option<impl IntoLazy>,
        reduction: Reduction,
        ignore_index: i64,
        label_smoothing: f64,
    ) -> Result<LazyTensor, LazyError> {
        let name = "cross_entropy_loss";
        // Logits `[N, C, d1, ..]` against targets `[N, d1, ..]` (a segmentation's per-pixel
        // classes): the classes moved last and every position a row, as one `[N·d, C]` loss
        // whose mean over counted targets, sum, or per-position values (shaped back) are the
        // K-dimensional loss's.
        let shape = self.node().meta.shape.clone();
        if shape.len() > 2 {
            let t = targets.into_lazy();
            let mut expected = shape.clone();
            expected.remove(1);
            if t.node().meta.shape != expected {
                return Err(LazyError::Shape {
                    op: name.into(),
                    lhs: shape.to_vec(),
                    rhs: t.node().meta.shape.to_vec(),
                    reason: "expected logits [N, C, d1, ..] with targets [N, d1, ..]".into(),
                });
            }
            let mut order: Vec<i64> = (0..shape.len() as i64).filter(|&d| d != 1).collect();
            order.push(1);
            let rows = self.f_permute(order.as_slice())?.f_reshape([-1, shape[1]])?;
            let loss =
                rows.f_cross_entropy_loss(&t.f_reshape([-1])?, weight, reduction, ignore_index, label_smoothing)?;
            return if reduction == Reduction::None { loss.f_reshape(expected.as_slice()) } else { Ok(loss) };
        }
        if !(0.0..=1.0).contains(&label_smoothing) {
            return Err(arg(
                name,
                &self.node().meta.shape,
                format!("label_smoothing must lie in [0, 1], got {label_smoothing}"),
            ));
        }
        if label_smoothing == 0.0 || weight.is_some() {
            if label_smoothing != 0.0 {
                return Err(arg(
                    name,
                    &self.node().meta.shape,
                    "label smoothing with class weights is not supported lazily; compute the smoothed term with log_softmax and mean_dim",
                ));
            }
            let kind = self.node().meta.kind;
            return self.f_log_softmax(-1, kind)?.f_nll_loss(targets, weight, reduction, ignore_index);
        }
        let t = targets.into_lazy();
        let (x, tn) = (self.node(), t.node());
        let device = same_device(name, &[x, tn])?;
        Self::check_class_loss(name, x, tn)?;
        if matches!(reduction, Reduction::Other(_)) {
            return Err(arg(name, &x.meta.shape, "unknown reduction"));
        }
        let flow = Self::class_loss_flow(name, x, tn, reduction)?;
        let out = if reduction == Reduction::None {
            Dims::from(&x.meta.shape[..x.meta.shape.len() - 1])
        } else {
            Dims::new()
        };
        let op = CrossEntropy { ignore_index, label_smoothing, reduction };
        Ok(Record::new(op, inputs_of([x, tn]), out, x.meta.kind, device).flow(flow).finish())
    }

    /// Kullback-Leibler divergence of `target` from `self` (log-probabilities), as tch's
    /// `kl_div`: pointwise `target · (log target − self)` (with `log_target`, the target is given
    /// as log-probabilities), reduced by `reduction` (a mean is over every element, as in
    /// libtorch; divide a sum by the batch for PyTorch's `batchmean`).
    ///
    /// # Errors
    /// As [`f_mse_loss`](Self::f_mse_loss).
    pub fn f_kl_div(
        &self,
        target: impl IntoLazy,
        reduction: Reduction,
        log_target: bool,
    ) -> Result<LazyTensor, LazyError> {
        self.f_elementwise_loss(target, Elementwise::KlDiv { log_target }, reduction)
    }

    /// Negative log-likelihood of log-probabilities `[N, C]` against class indices `[N]`, with
    /// class `weight`s (`[C]`), a reduction and an ignored index (tch's `f_nll_loss`; its
    /// panicking form is `g_nll_loss`, and `nll_loss(targets)` is the plain mean). A mean is over the weights of the counted targets, as in libtorch.
    ///
    /// # Errors
    /// As [`f_cross_entropy_for_logits`](Self::f_cross_entropy_for_logits); a weight that is not
    /// `[C]`; [`Reduction::Other`].
    #[lazy_only]
    #[twin(g_nll_loss)]
    pub fn f_nll_loss(
        &self,
        targets: impl IntoLazy,
        #[fixed] weight: Option<impl IntoLazy>,
        reduction: Reduction,
        ignore_index: i64,
    ) -> Result<LazyTensor, LazyError> {
        if let (Some(x), Some(t), Some(w)) =
            (self.eager_value(), targets.eager_operand(), super::record::eager_option(&weight))
        {
            return super::eager("nll_loss", x.f_nll_loss(t, w, reduction, ignore_index));
        }
        let t = targets.into_lazy();
        let w = weight.map(IntoLazy::into_lazy);
        let name = "nll_loss";
        let (x, tn) = (self.node(), t.node());
        let mut nodes = vec![x, tn];
        if let Some(w) = &w {
            nodes.push(w.node());
        }
        let device = same_device(name, &nodes)?;
        Self::check_class_loss(name, x, tn)?;
        if let Some(w) = &w {
            let c = *x.meta.shape.last().expect("checked");
            if w.node().meta.shape != [c] || w.node().meta.flow != Flow::Fixed {
                return Err(shape_err(
                    name,
                    &x.meta.shape,
                    &w.node().meta.shape,
                    format!("weight must be a fixed [{c}]"),
                ));
            }
            same_kind(name, x, w.node())?;
        }
        if matches!(reduction, Reduction::Other(_)) {
            return Err(arg(name, &x.meta.shape, "unknown reduction"));
        }
        let flow = Self::class_loss_flow(name, x, tn, reduction)?;
        let out = if reduction == Reduction::None { x.meta.shape[..x.meta.shape.len() - 1].to_vec() } else { vec![] };
        let op = Nll { reduction, ignore_index };
        let inputs = inputs_of(nodes);
        Ok(Record::new(op, inputs, out, x.meta.kind, device).flow(flow).finish())
    }

    /// Mean squared error against `target` (broadcast), with a reduction (tch's `mse_loss`).
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes do not broadcast, [`LazyError::Kind`],
    /// [`LazyError::Device`]; [`Reduction::Other`].
    pub fn f_mse_loss(&self, target: impl IntoLazy, reduction: Reduction) -> Result<LazyTensor, LazyError> {
        self.f_elementwise_loss(target, Elementwise::Mse, reduction)
    }

    /// Absolute error against `target`, reduced, as tch's `l1_loss`: libtorch composes it as
    /// `(input - target).abs()` and its reduction, and so is it recorded (their rules price it).
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes do not broadcast, [`LazyError::Argument`] for an
    /// unknown reduction, and as [`f_sub`](Self::f_sub).
    pub fn f_l1_loss(&self, target: impl IntoLazy, reduction: Reduction) -> Result<LazyTensor, LazyError> {
        let diff = self.f_sub(target)?.f_abs()?;
        match reduction {
            Reduction::None => Ok(diff),
            Reduction::Sum => diff.f_sum(None),
            Reduction::Mean => diff.f_mean(None),
            Reduction::Other(_) => Err(arg("l1_loss", &self.size(), "unknown reduction")),
        }
    }

    /// Binary cross-entropy of logits against targets of the same shape, as tch's
    /// `binary_cross_entropy_with_logits`.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for a target of another shape, [`LazyError::Kind`],
    /// [`LazyError::Device`]; [`Reduction::Other`]; [`LazyError::Unsupported`] for a `weight` or
    /// `pos_weight` (not planned yet: weigh the unreduced loss, `Reduction::None`, then reduce).
    pub fn f_binary_cross_entropy_with_logits(
        &self,
        target: impl IntoLazy,
        #[fixed] weight: Option<impl IntoLazy>,
        #[fixed] pos_weight: Option<impl IntoLazy>,
        reduction: Reduction,
    ) -> Result<LazyTensor, LazyError> {
        if weight.is_some() || pos_weight.is_some() {
            return Err(LazyError::Unsupported {
                op: "binary_cross_entropy_with_logits".into(),
                reason: "weight and pos_weight are not planned yet; multiply the unreduced loss \
                         (Reduction::None) by the weights, then reduce"
                    .into(),
            });
        }
        let t = target.into_lazy();
        if t.node().meta.shape != self.node().meta.shape {
            return Err(shape_err(
                "binary_cross_entropy_with_logits",
                &self.node().meta.shape,
                &t.node().meta.shape,
                "the target must have the input's size",
            ));
        }
        self.f_elementwise_loss(&t, Elementwise::BceWithLogits, reduction)
    }

    /// Smooth L1 loss (quadratic below `beta`), as tch's `smooth_l1_loss`.
    ///
    /// # Errors
    /// As [`f_mse_loss`](Self::f_mse_loss); [`LazyError::Argument`] for a negative `beta`.
    pub fn f_smooth_l1_loss(
        &self,
        target: impl IntoLazy,
        reduction: Reduction,
        beta: f64,
    ) -> Result<LazyTensor, LazyError> {
        if beta < 0.0 {
            return Err(arg(
                "smooth_l1_loss",
                &self.node().meta.shape,
                "smooth_l1_loss does not support negative values for beta.",
            ));
        }
        self.f_elementwise_loss(target, Elementwise::SmoothL1 { beta }, reduction)
    }

    /// Huber loss (quadratic below `delta`), as tch's `huber_loss`.
    ///
    /// # Errors
    /// As [`f_mse_loss`](Self::f_mse_loss); [`LazyError::Argument`] for `delta` ≤ 0.
    pub fn f_huber_loss(
        &self,
        target: impl IntoLazy,
        reduction: Reduction,
        delta: f64,
    ) -> Result<LazyTensor, LazyError> {
        if delta <= 0.0 {
            return Err(arg(
                "huber_loss",
                &self.node().meta.shape,
                "huber_loss does not support non-positive values for delta.",
            ));
        }
        self.f_elementwise_loss(target, Elementwise::Huber { delta }, reduction)
    }

    /// An elementwise loss against a broadcast target, reduced by `op`'s reduction.
    fn f_elementwise_loss(
        &self,
        target: impl IntoLazy,
        loss: Elementwise,
        reduction: Reduction,
    ) -> Result<LazyTensor, LazyError> {
        let t = target.into_lazy();
        let op = ElementwiseLoss { loss, reduction };
        let name = op.name();
        let (x, tn) = (self.node(), t.node());
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
            (Flow::PerSample(_), Reduction::Mean | Reduction::Sum) => (Flow::Sum, Dims::new()),
            (f, Reduction::None) => (f, per),
            (f, _) => (f, Dims::new()),
        };
        Ok(Record::new(op, inputs_of([x, tn]), out, x.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// Records a [`Composite`] loss of `inputs` whose unreduced value has shape `per` and flows
    /// as `flow`; `unit` is the operands' broadcast shape (what its temporaries are sized by).
    #[allow(clippy::too_many_arguments)]
    fn composite_loss(
        loss: Composite,
        inputs: Vec<Rc<Node>>,
        unit: &[i64],
        per: Dims,
        (flow, mixes): (Flow, Option<String>),
        reduction: Reduction,
        device: tch::Device,
    ) -> Result<LazyTensor, LazyError> {
        let name = loss.name();
        if matches!(reduction, Reduction::Other(_)) {
            return Err(arg(name, &inputs[0].meta.shape, "unknown reduction"));
        }
        let parts = |shape: &[i64]| {
            let total = shape::numel(shape).max(0) as u64;
            match flow {
                Flow::PerSample(bd) if bd.size > 0 => Elements::line(total / bd.size as u64, 0),
                _ => Elements::line(0, total),
            }
        };
        let op =
            CompositeLoss { loss, reduction, count: shape::numel(&per) as f64, unit: parts(unit), rows: parts(&per) };
        let (flow, out) = match (flow, reduction) {
            (f, Reduction::None) => (f, per),
            (Flow::PerSample(_), _) => (Flow::Sum, Dims::new()),
            (f, _) => (f, Dims::new()),
        };
        let kind = inputs[0].meta.kind;
        Ok(Record::new(op, inputs, out, kind, device).flow((flow, mixes)).finish())
    }

    /// A fixed operand whose first size is the batch's, beside one batched along dimension 0:
    /// per-sample data that was not wrapped (it would meet every micro-batch whole).
    fn unwrapped_batch(name: &str, nodes: &[&Rc<Node>]) -> Result<(), LazyError> {
        let Some((j, bd)) = nodes.iter().enumerate().find_map(|(j, n)| n.meta.batch().map(|bd| (j, bd))) else {
            return Ok(());
        };
        let full = bd.size * bd.factor;
        match nodes.iter().find(|n| n.meta.flow == Flow::Fixed && n.meta.shape.first() == Some(&full)) {
            Some(n) if bd.dim == 0 && full > 1 => Err(LazyError::Batch {
                op: name.into(),
                lhs: nodes[j].meta.shape.to_vec(),
                rhs: n.meta.shape.to_vec(),
                reason: "one operand is not batched but has the batch's size; wrap it with lazy(..) too".into(),
            }),
            _ => Ok(()),
        }
    }

    /// The flow of a value reduced along the last of `rank` dimensions: along the batch, it
    /// mixes samples.
    fn last_dim_reduced(flow: (Flow, Option<String>), rank: usize, what: &str) -> (Flow, Option<String>) {
        match flow {
            (Flow::PerSample(bd), _) if bd.dim + 1 == rank => {
                (Flow::Opaque, Some(format!("{what} along the batch dimension {}", bd.dim)))
            }
            other => other,
        }
    }

    /// Cosine embedding loss of `input1` and `input2` (`[N, D]`, or `[D]`) against `target`
    /// (`[N]` of ±1, or 0-dim), as tch's `cosine_embedding_loss` (a static method, as in tch):
    /// `1 − cos(x1, x2)` where the target is 1, `max(0, cos(x1, x2) − margin)` where it is −1,
    /// 0 elsewhere, then reduced. A mean split in micro-batches divides each share by the full
    /// batch's count; along `D` it mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for other shapes, [`LazyError::Kind`] for non-floating inputs or two
    /// kinds, [`LazyError::Device`], [`LazyError::Batch`] for an unwrapped per-sample operand;
    /// [`Reduction::Other`].
    #[lazy_only]
    pub fn f_cosine_embedding_loss(
        input1: impl IntoLazy,
        input2: impl IntoLazy,
        target: impl IntoLazy,
        margin: f64,
        reduction: Reduction,
    ) -> Result<LazyTensor, LazyError> {
        let loss = Composite::CosineEmbedding { margin };
        let name = loss.name();
        let (a, b, t) = (input1.into_lazy(), input2.into_lazy(), target.into_lazy());
        let (x1, x2, tn) = (a.node(), b.node(), t.node());
        let device = same_device(name, &[x1, x2, tn])?;
        let (s1, s2, st) = (&x1.meta.shape, &x2.meta.shape, &tn.meta.shape);
        let rank = st.len() + 1;
        if st.len() > 1 || s1.len() != rank || s2.len() != rank {
            return Err(shape_err(
                name,
                s1,
                s2,
                format!("expected inputs [N, D] with a target [N], or inputs [D] with a 0-dim target (target {st:?})"),
            ));
        }
        floating(name, x1)?;
        same_kind(name, x1, x2)?;
        let both = shape::broadcast(s1, s2).map_err(|r| shape_err(name, s1, s2, r))?;
        let per = shape::broadcast(&both[..rank - 1], st).map_err(|r| shape_err(name, &both, st, r))?;
        let consumed = [x1, x2].iter().any(|n| n.meta.batch().is_some_and(|bd| bd.dim + 1 == rank));
        if !consumed {
            Self::unwrapped_batch(name, &[x1, x2, tn])?;
        }
        // The inputs' rows line up with the target's; their last dimension is reduced.
        let mapped: Vec<Option<usize>> = [x1, x2]
            .iter()
            .map(|n| n.meta.batch().and_then(|bd| (bd.dim + 1 < rank).then_some(bd.dim)))
            .chain([tn.meta.batch().map(|bd| bd.dim)])
            .collect();
        let flow = combine_flows(name, &[x1, x2, tn], &mapped, &per, Linearity::Nonlinear, false)?;
        let flow = if consumed { (Flow::Opaque, Some("takes cosines along the batch dimension".into())) } else { flow };
        let inputs = inputs_of([x1, x2, tn]);
        Self::composite_loss(loss, inputs, &both, per, flow, reduction, device)
    }

    /// Margin ranking loss of `input1` and `input2` against `target` (±1: which should rank
    /// higher), as tch's `margin_ranking_loss` (a static method, as in tch): `max(0, −target ·
    /// (x1 − x2) + margin)`, broadcast, then reduced. A mean split in micro-batches divides each
    /// share by the full batch's count.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for operands that do not broadcast, [`LazyError::Kind`] for
    /// non-floating operands or two kinds,
    /// [`LazyError::Device`], [`LazyError::Batch`]; [`Reduction::Other`].
    #[lazy_only]
    pub fn f_margin_ranking_loss(
        input1: impl IntoLazy,
        input2: impl IntoLazy,
        target: impl IntoLazy,
        margin: f64,
        reduction: Reduction,
    ) -> Result<LazyTensor, LazyError> {
        let loss = Composite::MarginRanking { margin };
        let name = loss.name();
        let (a, b, t) = (input1.into_lazy(), input2.into_lazy(), target.into_lazy());
        let (x1, x2, tn) = (a.node(), b.node(), t.node());
        let device = same_device(name, &[x1, x2, tn])?;
        let (s1, s2, st) = (&x1.meta.shape, &x2.meta.shape, &tn.meta.shape);
        floating(name, x1)?;
        same_kind(name, x1, x2)?;
        same_kind(name, x1, tn)?;
        let both = shape::broadcast(s1, s2).map_err(|r| shape_err(name, s1, s2, r))?;
        let per = shape::broadcast(&both, st).map_err(|r| shape_err(name, &both, st, r))?;
        let flow = broadcast_flows(name, &[x1, x2, tn], &per, Linearity::Nonlinear)?;
        let inputs = inputs_of([x1, x2, tn]);
        Self::composite_loss(loss, inputs, &per.clone(), per, flow, reduction, device)
    }

    /// Triplet margin loss of `anchor`, `positive` and `negative` (of one number of dimensions,
    /// broadcast), as tch's `triplet_margin_loss` (a static method, as in tch): `max(0, d(a, p) −
    /// d(a, n) + margin)`, with `d` the `p`-norm of `x1 − x2 + eps` along the last dimension
    /// (with `swap`, `d(a, n)` is the smaller of it and `d(p, n)`), then reduced. A mean split in
    /// micro-batches divides each share by the full batch's count; along the last dimension it
    /// mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for operands of different numbers of dimensions, 0-dim ones or ones
    /// that do not broadcast, [`LazyError::Kind`] for non-floating operands or two kinds,
    /// [`LazyError::Device`], [`LazyError::Batch`]; [`Reduction::Other`].
    #[lazy_only]
    #[allow(clippy::too_many_arguments)]
    pub fn f_triplet_margin_loss(
        anchor: impl IntoLazy,
        positive: impl IntoLazy,
        negative: impl IntoLazy,
        margin: f64,
        p: f64,
        eps: f64,
        swap: bool,
        reduction: Reduction,
    ) -> Result<LazyTensor, LazyError> {
        let loss = Composite::TripletMargin { margin, p, eps, swap };
        let name = loss.name();
        let (a, b, c) = (anchor.into_lazy(), positive.into_lazy(), negative.into_lazy());
        let (an, pn, nn) = (a.node(), b.node(), c.node());
        let device = same_device(name, &[an, pn, nn])?;
        let (sa, sp, sn) = (&an.meta.shape, &pn.meta.shape, &nn.meta.shape);
        if sa.len() != sp.len() || sa.len() != sn.len() || sa.is_empty() {
            return Err(shape_err(
                name,
                sa,
                sp,
                format!(
                    "anchor, positive and negative must have one number of dimensions, at least 1 (negative {sn:?})"
                ),
            ));
        }
        floating(name, an)?;
        same_kind(name, an, pn)?;
        same_kind(name, an, nn)?;
        let both = shape::broadcast(sa, sp).map_err(|r| shape_err(name, sa, sp, r))?;
        let all = shape::broadcast(&both, sn).map_err(|r| shape_err(name, &both, sn, r))?;
        let rank = all.len();
        let flow = broadcast_flows(name, &[an, pn, nn], &all, Linearity::Nonlinear)?;
        let flow = Self::last_dim_reduced(flow, rank, "measures distances");
        let per = Dims::from(&all[..rank - 1]);
        let inputs = inputs_of([an, pn, nn]);
        Self::composite_loss(loss, inputs, &all, per, flow, reduction, device)
    }

    /// Binary cross-entropy of probabilities (in `[0, 1]`) against targets of the same shape,
    /// as tch's `binary_cross_entropy`: `−w (t log x + (1 − t) log(1 − x))` (each log clamped at
    /// −100), with an optional `weight` broadcast to the input, then reduced (a mean is over
    /// the elements, not the weights). A mean split in micro-batches divides each share by the
    /// full batch's count. A probability outside `[0, 1]` fails when it runs, as in tch. A
    /// target of another size is refused, as PyTorch does (libtorch squeezes both and
    /// broadcasts).
    ///
    /// # Errors
    /// [`LazyError::Shape`] for a target of another shape or a weight that does not broadcast to
    /// the input, [`LazyError::Kind`], [`LazyError::Device`], [`LazyError::Batch`];
    /// [`Reduction::Other`].
    #[no_twin]
    pub fn f_binary_cross_entropy(
        &self,
        target: impl IntoLazy,
        #[fixed] weight: Option<impl IntoLazy>,
        reduction: Reduction,
    ) -> Result<LazyTensor, LazyError> {
        let loss = Composite::Bce;
        let name = loss.name();
        let t = target.into_lazy();
        let w = weight.map(IntoLazy::into_lazy);
        let (x, tn) = (self.node(), t.node());
        let mut nodes = vec![x, tn];
        if let Some(w) = &w {
            nodes.push(w.node());
        }
        let device = same_device(name, &nodes)?;
        let sx = &x.meta.shape;
        if &tn.meta.shape != sx {
            return Err(shape_err(name, sx, &tn.meta.shape, "the target must have the input's size"));
        }
        floating(name, x)?;
        same_kind(name, x, tn)?;
        if let Some(w) = &w {
            let ws = &w.node().meta.shape;
            if shape::broadcast(sx, ws).as_ref() != Ok(sx) {
                return Err(shape_err(name, sx, ws, "the weight must broadcast to the input's size"));
            }
            same_kind(name, x, w.node())?;
        }
        let flow = broadcast_flows(name, &nodes, sx, Linearity::Nonlinear)?;
        let inputs = inputs_of(nodes);
        Self::composite_loss(loss, inputs, sx, sx.clone(), flow, reduction, device)
    }

    /// Poisson negative log-likelihood of `self` against `target` (counts), as tch's
    /// `poisson_nll_loss`: `exp(x) − t x` with `log_input`, else `x − t log(x + eps)`; with
    /// `full`, Stirling's approximation `t log t − t + ½ log(2π t)` is added where `t > 1`;
    /// broadcast, then reduced. A mean split in micro-batches divides each share by the full
    /// batch's count.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes do not broadcast, [`LazyError::Kind`],
    /// [`LazyError::Device`], [`LazyError::Batch`]; [`Reduction::Other`].
    pub fn f_poisson_nll_loss(
        &self,
        target: impl IntoLazy,
        log_input: bool,
        full: bool,
        eps: f64,
        reduction: Reduction,
    ) -> Result<LazyTensor, LazyError> {
        let loss = Composite::PoissonNll { log_input, full, eps };
        let name = loss.name();
        let t = target.into_lazy();
        let (x, tn) = (self.node(), t.node());
        let device = same_device(name, &[x, tn])?;
        let per = shape::broadcast(&x.meta.shape, &tn.meta.shape)
            .map_err(|r| shape_err(name, &x.meta.shape, &tn.meta.shape, r))?;
        floating(name, x)?;
        same_kind(name, x, tn)?;
        let flow = broadcast_flows(name, &[x, tn], &per, Linearity::Nonlinear)?;
        let inputs = inputs_of([x, tn]);
        Self::composite_loss(loss, inputs, &per.clone(), per, flow, reduction, device)
    }

    /// Connectionist temporal classification loss of `log_probs` (`[T, N, C]`: the batch is
    /// dimension 1; or `[T, C]` unbatched) against `targets` (`[N, S]` padded, or the samples'
    /// labels concatenated, 1-D), with each sample's `input_lengths` (at most `T`) and
    /// `target_lengths` as lists, as tch's `ctc_loss` (a static method, as in tch; `blank` is
    /// the blank's class; `zero_infinity` zeroes infinite losses and their gradients). A mean
    /// averages each sample's loss over its target length (at least 1). Split in micro-batches,
    /// the lists are sliced to each one (concatenated targets too, by the target lengths, so
    /// pass them fixed), and a mean is weighted by each micro-batch's share of the batch.
    /// Wrap the log-probabilities with `lazy(.., 1)` and padded targets with `lazy(.., 0)`.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for other shapes, lists that are not one length a sample, lengths
    /// outside `[0, T]`, or targets shorter than their lengths; [`LazyError::Kind`] for
    /// log-probabilities that are not `Float` or `Double`, or targets that are not integers;
    /// [`LazyError::Argument`] for a blank outside `[0, C)` or [`Reduction::Other`];
    /// [`LazyError::Device`]; [`LazyError::Batch`] for a per-sample operand that was not
    /// wrapped.
    #[lazy_only]
    #[allow(clippy::too_many_arguments)]
    pub fn f_ctc_loss(
        log_probs: impl IntoLazy,
        targets: impl IntoLazy,
        input_lengths: impl IntList,
        target_lengths: impl IntList,
        blank: i64,
        reduction: Reduction,
        zero_infinity: bool,
    ) -> Result<LazyTensor, LazyError> {
        let (lp, tg) = (log_probs.into_lazy(), targets.into_lazy());
        let lengths = CtcLengthArgs::Lists(input_lengths.as_slice(), target_lengths.as_slice());
        Self::ctc(lp.node(), tg.node(), lengths, blank, reduction, zero_infinity)
    }

    /// As [`f_ctc_loss`](Self::f_ctc_loss), with the lengths as integer tensors of one value a
    /// sample (tch's `ctc_loss_tensor`; wrap them with `lazy(.., 0)` too). Concatenated
    /// targets cannot be sliced to a micro-batch before it runs: with them, a split is refused
    /// (pass the lengths as lists). The plan sizes libtorch's buffers by the longest target,
    /// read from the target lengths when they are an input or a constant, else taken as the
    /// targets' size.
    ///
    /// # Errors
    /// As [`f_ctc_loss`](Self::f_ctc_loss).
    #[lazy_only]
    #[allow(clippy::too_many_arguments)]
    pub fn f_ctc_loss_tensor(
        log_probs: impl IntoLazy,
        targets: impl IntoLazy,
        input_lengths: impl IntoLazy,
        target_lengths: impl IntoLazy,
        blank: i64,
        reduction: Reduction,
        zero_infinity: bool,
    ) -> Result<LazyTensor, LazyError> {
        let (lp, tg) = (log_probs.into_lazy(), targets.into_lazy());
        let (il, tl) = (input_lengths.into_lazy(), target_lengths.into_lazy());
        let lengths = CtcLengthArgs::Tensors(il.node(), tl.node());
        Self::ctc(lp.node(), tg.node(), lengths, blank, reduction, zero_infinity)
    }

    /// Records a CTC loss, its lengths as lists or as tensors.
    fn ctc(
        lp: &Rc<Node>,
        tg: &Rc<Node>,
        lengths: CtcLengthArgs<'_>,
        blank: i64,
        reduction: Reduction,
        zero_infinity: bool,
    ) -> Result<LazyTensor, LazyError> {
        let name = match lengths {
            CtcLengthArgs::Lists(..) => "ctc_loss",
            CtcLengthArgs::Tensors(..) => "ctc_loss_tensor",
        };
        let mut nodes = vec![lp, tg];
        if let CtcLengthArgs::Tensors(il, tl) = lengths {
            nodes.extend([il, tl]);
        }
        let device = same_device(name, &nodes)?;
        let (ls, ts) = (&lp.meta.shape, &tg.meta.shape);
        if !matches!(ls.len(), 2 | 3) {
            return Err(shape_err(name, ls, ts, "expected log-probabilities [T, N, C], or [T, C] unbatched"));
        }
        if !matches!(lp.meta.kind, Kind::Float | Kind::Double) {
            return Err(kind_err(name, lp.meta.kind, ls, "expected Float or Double log-probabilities"));
        }
        if !shape::is_integral(tg.meta.kind) || tg.meta.kind == Kind::Bool {
            return Err(kind_err(name, tg.meta.kind, ts, "targets must be integer class indices"));
        }
        if matches!(reduction, Reduction::Other(_)) {
            return Err(arg(name, ls, "unknown reduction"));
        }
        let (t, n, c) = (ls[0], if ls.len() == 3 { ls[1] } else { 1 }, ls[ls.len() - 1]);
        if !(0..c).contains(&blank) {
            return Err(arg(name, ls, format!("blank must be in label range [0, {c}), got {blank}")));
        }
        let concatenated = ts.len() == 1;
        if !(concatenated || (ts.len() == 2 && ts[0] == n)) {
            return Err(shape_err(name, ls, ts, format!("expected targets [{n}, S], or concatenated 1-D")));
        }
        // The lists (checked as libtorch does), and the longest target.
        let (lists, longest) = match lengths {
            CtcLengthArgs::Lists(input, target) => {
                if input.len() as i64 != n || target.len() as i64 != n {
                    return Err(shape_err(
                        name,
                        ls,
                        ts,
                        format!("expected {n} input and target lengths, got {} and {}", input.len(), target.len()),
                    ));
                }
                if let Some(l) = input.iter().find(|&&l| !(0..=t).contains(&l)) {
                    return Err(shape_err(name, ls, ts, format!("an input length {l} is outside [0, {t}]")));
                }
                if let Some(l) = target.iter().find(|&&l| l < 0) {
                    return Err(shape_err(name, ls, ts, format!("a target length {l} is negative")));
                }
                let longest = target.iter().copied().max().unwrap_or(0);
                let offsets: Vec<i64> = std::iter::once(0)
                    .chain(target.iter().scan(0, |sum, &l| {
                        *sum += l;
                        Some(*sum)
                    }))
                    .collect();
                let total = *offsets.last().expect("one offset at least");
                if concatenated && ts[0] != total {
                    return Err(shape_err(name, ls, ts, format!("concatenated targets must hold {total} labels")));
                }
                if !concatenated && ts[1] < longest {
                    return Err(shape_err(
                        name,
                        ls,
                        ts,
                        format!("targets must hold at least {longest} labels a sample"),
                    ));
                }
                let lists = CtcLengths {
                    input: input.to_vec(),
                    target: target.to_vec(),
                    offsets: concatenated.then_some(offsets),
                };
                (Some(lists), longest)
            }
            CtcLengthArgs::Tensors(il, tl) => {
                for l in [il, tl] {
                    if !shape::is_integral(l.meta.kind) || l.meta.kind == Kind::Bool {
                        return Err(kind_err(name, l.meta.kind, &l.meta.shape, "lengths must be integers"));
                    }
                    if l.meta.shape.len() > 1 || shape::numel(&l.meta.shape) != n {
                        return Err(shape_err(name, ls, &l.meta.shape, format!("expected {n} lengths")));
                    }
                }
                let bound = if concatenated { ts[0] } else { ts[1] };
                (None, Self::longest(tl).map_or(bound, |l| l.min(bound)))
            }
        };
        let flow = Self::ctc_flow(name, &nodes, lists.is_some(), concatenated, n)?;
        let batched = lp.meta.batch().is_some_and(|bd| ls.len() == 3 && bd.dim == 1 && bd.factor == 1);
        // Elements libtorch makes, per sample when the batch is split.
        let split = nodes.iter().any(|x| x.meta.batch().is_some()) && n > 0;
        let parts = |total: i64| {
            let total = total.max(0) as u64;
            if split {
                Elements::line(total / n as u64, 0)
            } else {
                Elements::line(0, total)
            }
        };
        let op = Ctc {
            blank,
            reduction,
            zero_infinity,
            lists,
            batched,
            alpha: parts(n * t * (2 * longest + 1)),
            per_sample: parts(2 * n),
            targets_copy: if tg.meta.kind == Kind::Int64 { Elements::ZERO } else { tg.meta.elements() },
        };
        let per = if ls.len() == 3 { vec![n] } else { vec![] };
        let (flow, out) = match (flow, reduction) {
            (f, Reduction::None) => (f, per),
            ((Flow::PerSample(_), mixes), _) => ((Flow::Sum, mixes), vec![]),
            (f, _) => (f, vec![]),
        };
        let inputs = inputs_of(nodes);
        Ok(Record::new(op, inputs, out, lp.meta.kind, device).flow(flow).finish())
    }

    /// The flow of a CTC loss's per-sample values: the batch is dimension 1 of the
    /// log-probabilities, 0 of padded targets and of lengths given as tensors.
    fn ctc_flow(
        name: &str,
        nodes: &[&Rc<Node>],
        lists: bool,
        concatenated: bool,
        n: i64,
    ) -> Result<(Flow, Option<String>), LazyError> {
        let expected = |j: usize| match j {
            0 => (nodes[0].meta.shape.len() == 3).then_some(1),
            1 => (!concatenated).then_some(0),
            _ => (nodes[j].meta.shape.len() == 1).then_some(0),
        };
        let mut mapped = Vec::with_capacity(nodes.len());
        for (j, node) in nodes.iter().enumerate() {
            match node.meta.batch() {
                Some(bd) if expected(j) == Some(bd.dim) && bd.factor == 1 => mapped.push(Some(0)),
                Some(_) if j == 1 && concatenated => {
                    return Ok((
                        Flow::Opaque,
                        Some("takes concatenated targets split along their labels; pass them fixed".into()),
                    ));
                }
                Some(bd) => {
                    return Ok((
                        Flow::Opaque,
                        Some(format!(
                            "runs along dimension {} of operand {j} (its batch is dimension 1 of the \
                             log-probabilities, 0 of the targets and lengths)",
                            bd.dim
                        )),
                    ))
                }
                None => mapped.push(None),
            }
        }
        // Per-sample data that was not wrapped would meet every micro-batch whole.
        if let Some(bd) = nodes.iter().find_map(|x| x.meta.batch()) {
            let full = bd.size * bd.factor;
            for (j, node) in nodes.iter().enumerate() {
                let at = expected(j).and_then(|d| node.meta.shape.get(d));
                if node.meta.flow == Flow::Fixed && full > 1 && at == Some(&full) {
                    return Err(LazyError::Batch {
                        op: name.into(),
                        lhs: nodes[0].meta.shape.to_vec(),
                        rhs: node.meta.shape.to_vec(),
                        reason: format!(
                            "operand {j} is not batched but has the batch's size {full}; wrap it with lazy(..)"
                        ),
                    });
                }
            }
        }
        let per = if nodes[0].meta.shape.len() == 3 { vec![n] } else { vec![] };
        let flow = combine_flows(name, nodes, &mapped, &per, Linearity::Nonlinear, false)?;
        let batched = nodes[0].meta.batch().is_some();
        if concatenated && !lists && batched {
            return Ok((
                Flow::Opaque,
                Some(
                    "takes concatenated targets with lengths as tensors: a micro-batch's labels are not known \
                     before it runs (pass the lengths as lists)"
                        .into(),
                ),
            ));
        }
        Ok(flow)
    }

    /// The longest target of lengths that are an input or a constant (read once, when recorded).
    fn longest(lengths: &Rc<Node>) -> Option<i64> {
        let tensor = match lengths.source()? {
            Source::Input { tensor, .. } | Source::Leaf { tensor, .. } => tensor,
        };
        if tensor.numel() == 0 {
            return Some(0);
        }
        tensor.f_max().ok()?.f_int64_value(&[]).ok()
    }

    /// Negative log-likelihood of log-probabilities against class indices, averaged over the
    /// targets that are not -100 (tch's `nll_loss`, which has no fallible form: see
    /// [`f_nll_loss`](Self::f_nll_loss)).
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn nll_loss(&self, targets: impl IntoLazy) -> LazyTensor {
        self.f_nll_loss(targets, None::<&LazyTensor>, Reduction::Mean, -100).or_panic()
    }
}

impl LazyTensor {
    /// Like [`f_binary_cross_entropy`](Self::f_binary_cross_entropy), panicking with its error.
    /// The weight's type is a named parameter, as in tch, so tch's spelling of "no weight"
    /// compiles unchanged: `recon_x.binary_cross_entropy::<Tensor>(&x, None, Reduction::Sum)`.
    #[track_caller]
    pub fn binary_cross_entropy<W: super::record::WeightOperand>(
        &self,
        target: impl IntoLazy,
        weight: Option<W>,
        reduction: Reduction,
    ) -> LazyTensor {
        let weight = weight.map(super::record::WeightOperand::into_lazy_weight);
        self.f_binary_cross_entropy(target, weight.as_ref(), reduction).or_panic()
    }
}
