//! Losses: cross-entropy, negative log-likelihood, elementwise losses (squared error, smooth L1,
//! Huber, binary cross-entropy, KL divergence). Mean-reduced ones
//! are sums over the batch divided by a count: a split run divides each micro-batch's sum by
//! the full batch's count.

use std::rc::Rc;

use tch::{Kind, Reduction, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{broadcast_flows, combine_flows, same_device, Linearity, Record};
use super::{arg, floating, kind_err, same_kind, shape_err};
use crate::lazy::error::LazyError;
use crate::lazy::error::OrPanic;
use crate::lazy::graph::{Flow, KernelCall, Meta, Node, Operation, RunCx, Share};
use crate::lazy::shape;
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

    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        cross_entropy(ins[0], ins[1], self.reduction, self.ignore_index, self.label_smoothing)
    }

    fn saves_input(&self, i: usize, _inputs: &[Rc<Node>]) -> bool {
        // The targets; the log-probabilities are kept apart.
        i == 1
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let input = &inputs[0].meta;
        let x = input.numel_parts();
        // The log-probabilities between log_softmax and nll_loss.
        calls.push(KernelCall::Keeps { elements: x, kind: input.kind });
        // With label smoothing, the backward adds the uniform part's gradient, a tensor as
        // large as the logits, to the targets' one.
        if self.label_smoothing > 0.0 {
            calls.push(KernelCall::Temporaries { forward: (0, 0), backward: x });
        }
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

    fn counted_targets(&self) -> Option<i64> {
        matches!(self.reduction, Reduction::Mean).then_some(self.ignore_index)
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

    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_nll_loss(ins[1], ins.get(2).copied(), self.reduction, self.ignore_index)
    }

    fn saves_input(&self, _i: usize, _inputs: &[Rc<Node>]) -> bool {
        true
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

    fn counted_targets(&self) -> Option<i64> {
        matches!(self.reduction, Reduction::Mean).then_some(self.ignore_index)
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

    fn saves_input(&self, _i: usize, _inputs: &[Rc<Node>]) -> bool {
        true
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let input = &inputs[0].meta;
        let x = input.numel_parts();
        let times = |k: u64| (k * x.0, k * x.1);
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
        calls.push(KernelCall::Temporaries { forward: times(k), backward: (0, 0) });
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
    #[lazy_only]
    pub fn f_cross_entropy_for_logits(&self, targets: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let t = targets.into_lazy();
        let name = "cross_entropy_for_logits";
        let (x, tn) = (&self.node, &t.node);
        let device = same_device(name, &[x, tn])?;
        Self::check_class_loss(name, x, tn)?;
        let flow = Self::class_loss_flow(name, x, tn, Reduction::Mean)?;
        let op = CrossEntropy { ignore_index: -100, label_smoothing: 0.0, reduction: Reduction::Mean };
        Ok(Record::new(op, vec![x.clone(), tn.clone()], vec![], x.meta.kind, device).flow(flow).finish())
    }

    /// Cross-entropy of logits `[N, C]` against class indices `[N]`, as tch's
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
        if !(0.0..=1.0).contains(&label_smoothing) {
            return Err(arg(
                name,
                &self.node.meta.shape,
                format!("label_smoothing must lie in [0, 1], got {label_smoothing}"),
            ));
        }
        if label_smoothing == 0.0 || weight.is_some() {
            if label_smoothing != 0.0 {
                return Err(arg(
                    name,
                    &self.node.meta.shape,
                    "label smoothing with class weights is not supported lazily; compute the smoothed term with log_softmax and mean_dim",
                ));
            }
            let kind = self.node.meta.kind;
            return self.f_log_softmax(-1, kind)?.f_nll_loss(targets, weight, reduction, ignore_index);
        }
        let t = targets.into_lazy();
        let (x, tn) = (&self.node, &t.node);
        let device = same_device(name, &[x, tn])?;
        Self::check_class_loss(name, x, tn)?;
        if matches!(reduction, Reduction::Other(_)) {
            return Err(arg(name, &x.meta.shape, "unknown reduction"));
        }
        let flow = Self::class_loss_flow(name, x, tn, reduction)?;
        let out = if reduction == Reduction::None { x.meta.shape[..x.meta.shape.len() - 1].to_vec() } else { vec![] };
        let op = CrossEntropy { ignore_index, label_smoothing, reduction };
        Ok(Record::new(op, vec![x.clone(), tn.clone()], out, x.meta.kind, device).flow(flow).finish())
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
        let op = Nll { reduction, ignore_index };
        let inputs = nodes.into_iter().cloned().collect();
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
        if t.node.meta.shape != self.node.meta.shape {
            return Err(shape_err(
                "binary_cross_entropy_with_logits",
                &self.node.meta.shape,
                &t.node.meta.shape,
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
                &self.node.meta.shape,
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
                &self.node.meta.shape,
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
        Ok(Record::new(op, vec![x.clone(), tn.clone()], out, x.meta.kind, device).flow((flow, mixes)).finish())
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
