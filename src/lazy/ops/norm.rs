//! Normalization: batch, layer, group and RMS norm.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{combine_flows, same_device, Linearity, Record};
use super::{arg, floating, same_kind, shape_err};
use crate::lazy::error::LazyError;
use crate::lazy::facts::OpFacts;
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{KernelCall, Meta, Node, Operation, Run, RunCx};
use crate::lazy::int_list::IntList;
use crate::lazy::shape;
use crate::lazy::size::Elements;
use crate::lazy::LazyTensor;

/// Which optional operands a normalization has after its input (`x, [weight], [bias], ..`).
#[derive(Clone, Copy)]
struct Affine {
    weight: bool,
    bias: bool,
}

impl Affine {
    /// The weight, the bias, and the operands after them.
    fn split<'a>(self, ins: &[&'a Tensor]) -> (Option<&'a Tensor>, Option<&'a Tensor>, Vec<&'a Tensor>) {
        let mut rest = ins[1..].iter().copied();
        let weight = if self.weight { rest.next() } else { None };
        let bias = if self.bias { rest.next() } else { None };
        (weight, bias, rest.collect())
    }
}

/// The kind libtorch keeps a norm's statistics in.
fn stat_kind(input: &Meta) -> Kind {
    if input.kind == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// Batch normalization. Operands: x, [weight], [bias], running mean, running var.
pub(crate) struct BatchNorm {
    training: bool,
    momentum: f64,
    eps: f64,
    affine: Affine,
}

impl Operation for BatchNorm {
    fn name(&self) -> &'static str {
        "batch_norm"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|_i| true).updates({
            let n_inputs = inputs.len();
            // The running mean and variance come last, when there are any; evaluation reads them.
            let first = 1 + usize::from(self.affine.weight) + usize::from(self.affine.bias);
            if self.training && n_inputs >= first + 2 {
                first..first + 2
            } else {
                n_inputs..n_inputs
            }
        })
    }
}

impl Run for BatchNorm {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (weight, bias, running) = self.affine.split(ins);
        let (mean, var) = (running.first().copied(), running.get(1).copied());
        Tensor::f_batch_norm(ins[0], weight, bias, mean, var, self.training, self.momentum, self.eps, true)
    }
}

/// Layer normalization over the trailing `normalized_shape`. Operands: x, [weight], [bias].
pub(crate) struct LayerNorm {
    normalized_shape: Vec<i64>,
    eps: f64,
    affine: Affine,
}

impl Operation for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // Mean and inverse standard deviation per normalized row (two of them).
        let input = &inputs[0].meta;
        let rows = shape::numel(&self.normalized_shape).max(1) as u64;
        let (a, c) = input.elements().parts();
        calls.push(KernelCall::Keeps { elements: Elements::line(2 * a / rows, 2 * c / rows), kind: stat_kind(input) });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|_i| true).grad_dense(true)
    }
}

impl Run for LayerNorm {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (weight, bias, _) = self.affine.split(ins);
        Tensor::f_layer_norm(ins[0], self.normalized_shape.as_slice(), weight, bias, self.eps, true)
    }
}

/// Group normalization: statistics per sample and group. Operands: x, [weight], [bias].
pub(crate) struct GroupNorm {
    num_groups: i64,
    eps: f64,
    affine: Affine,
}

impl Operation for GroupNorm {
    fn name(&self) -> &'static str {
        "group_norm"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // Mean and inverse standard deviation per sample and group.
        let input = &inputs[0].meta;
        let groups = self.num_groups as u64;
        let elements = match input.batch() {
            Some(_) => Elements::line(2 * groups, 0),
            None => Elements::line(0, 2 * groups * input.shape.first().copied().unwrap_or(1).max(1) as u64),
        };
        calls.push(KernelCall::Keeps { elements, kind: stat_kind(input) });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|_i| true).grad_dense(true)
    }
}

impl Run for GroupNorm {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (weight, bias, _) = self.affine.split(ins);
        ins[0].f_group_norm(self.num_groups, weight, bias, self.eps, true)
    }
}

/// Root-mean-square normalization over the trailing `normalized_shape`. Operands: x, [weight].
pub(crate) struct RmsNorm {
    normalized_shape: Vec<i64>,
    eps: Option<f64>,
    weight: bool,
}

impl Operation for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // libtorch's rms_norm is composite: autograd keeps the inverse root mean square per row
        // and, with a weight, the normalized input; it squares the input before its mean, and
        // its backward builds input-sized terms.
        let input = &inputs[0].meta;
        let (a, c) = input.elements().parts();
        let row = shape::numel(&self.normalized_shape).max(1) as u64;
        let kept =
            if self.weight { Elements::line(a + a / row, c + c / row) } else { Elements::line(a / row, c / row) };
        calls.push(KernelCall::Keeps { elements: kept, kind: input.kind });
        calls.push(KernelCall::Temporaries { forward: Elements::line(a, c), backward: Elements::line(a, c) });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|_i| true)
    }
}

impl Run for RmsNorm {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let weight = if self.weight { ins.get(1).copied() } else { None };
        ins[0].f_rms_norm(self.normalized_shape.as_slice(), weight, self.eps)
    }
}

#[toma_macros::tensor_methods(NormOps, "Normalizations (a family of [`TensorOps`](crate::lazy::TensorOps)).")]
impl LazyTensor {
    /// Batch normalization, as tch's `Tensor::batch_norm` (`cudnn_enabled` on). In training mode
    /// it normalizes with statistics over the batch: splitting the batch is refused unless
    /// [`Options::allow_batch_mixing`](crate::lazy::Options::allow_batch_mixing). Running statistics are updated in place in training
    /// mode, once per micro-batch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when weight, bias or statistics are not `[C]`, [`LazyError::Kind`],
    /// [`LazyError::Device`].
    #[allow(clippy::too_many_arguments)]
    #[lazy_only]
    pub fn f_batch_norm(
        &self,
        #[fixed] weight: Option<impl IntoLazy>,
        #[fixed] bias: Option<impl IntoLazy>,
        #[fixed] running_mean: impl IntoLazy,
        #[fixed] running_var: impl IntoLazy,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<LazyTensor, LazyError> {
        if let (Some(x), Some(w), Some(b), Some(m), Some(v)) = (
            self.eager_value(),
            super::record::eager_option(&weight),
            super::record::eager_option(&bias),
            running_mean.eager_operand(),
            running_var.eager_operand(),
        ) {
            // What the recorded op would run.
            return super::eager(
                "batch_norm",
                Tensor::f_batch_norm(x, w, b, Some(m), Some(v), training, momentum, eps, true),
            );
        }
        let x = self.node();
        let name = "batch_norm";
        let s = &x.meta.shape;
        if s.len() < 2 {
            return Err(arg(name, s, format!("expected at least 2 dims (N, C, ..), got {}", s.len())));
        }
        floating(name, x)?;
        let (w, b) = (weight.map(IntoLazy::into_lazy), bias.map(IntoLazy::into_lazy));
        let (rm, rv) = (running_mean.into_lazy(), running_var.into_lazy());
        let mut params: Vec<&Rc<Node>> = Vec::new();
        params.extend(w.iter().map(|t| t.node()));
        params.extend(b.iter().map(|t| t.node()));
        params.extend([rm.node(), rv.node()]);
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
        let op = BatchNorm { training, momentum, eps, affine: Affine { weight: w.is_some(), bias: b.is_some() } };
        let inputs = inputs_of(nodes);
        Ok(Record::new(op, inputs, s.clone(), x.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// Layer normalization over the trailing `normalized_shape`, as tch's
    /// `Tensor::layer_norm`. libtorch ignores `cudnn_enable` (it has no cuDNN layer norm), and
    /// so does the plan.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the trailing dimensions, weight or bias do not match
    /// `normalized_shape`, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_layer_norm(
        &self,
        normalized_shape: impl IntList,
        #[fixed] weight: Option<impl IntoLazy>,
        #[fixed] bias: Option<impl IntoLazy>,
        eps: f64,
        cudnn_enable: bool,
    ) -> Result<LazyTensor, LazyError> {
        let _ = cudnn_enable;
        let norm = normalized_shape.as_slice().to_vec();
        let params = [weight.map(IntoLazy::into_lazy), bias.map(IntoLazy::into_lazy)];
        let (weight, bias) = (params[0].is_some(), params[1].is_some());
        self.trailing_norm(
            "layer_norm",
            norm.clone(),
            &params,
            LayerNorm { normalized_shape: norm, eps, affine: Affine { weight, bias } },
        )
    }

    /// Records a normalization over the trailing `norm` dimensions whose parameters (those
    /// given) have `norm`'s shape: layer norm, RMS norm.
    fn trailing_norm(
        &self,
        name: &str,
        norm: Vec<i64>,
        params: &[Option<LazyTensor>],
        op: impl Operation + 'static,
    ) -> Result<LazyTensor, LazyError> {
        let x = self.node();
        let s = &x.meta.shape;
        if norm.is_empty() || norm.len() > s.len() || s[s.len() - norm.len()..] != norm[..] {
            return Err(shape_err(name, s, &norm, "the input's trailing dimensions must equal normalized_shape"));
        }
        floating(name, x)?;
        let mut nodes = vec![x];
        for p in params.iter().flatten() {
            if p.node().meta.shape != norm {
                return Err(shape_err(name, &norm, &p.node().meta.shape, "weight and bias must have normalized_shape"));
            }
            same_kind(name, x, p.node())?;
            nodes.push(p.node());
        }
        let device = same_device(name, &nodes)?;
        let first_norm = s.len() - norm.len();
        let mapped: Vec<Option<usize>> =
            nodes.iter().enumerate().map(|(i, n)| n.meta.batch().filter(|_| i == 0).map(|bd| bd.dim)).collect();
        let (flow, mut mixes) = combine_flows(name, &nodes, &mapped, s, Linearity::Nonlinear, false)?;
        if x.meta.batch().is_some_and(|bd| bd.dim >= first_norm) {
            mixes = Some("normalizes over the batch dimension".into());
        }
        let inputs = inputs_of(nodes);
        Ok(Record::new(op, inputs, s.clone(), x.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// Group normalization, as tch's `group_norm`: `self` is `[N, C, ..]`, normalized per sample
    /// over `num_groups` groups of `C / num_groups` channels; `weight` and `bias` are `[C]`.
    /// Samples stay apart: it splits freely. libtorch ignores `cudnn_enabled` here, and so
    /// does the plan.
    ///
    /// # Errors
    /// [`LazyError::Argument`] when `num_groups` does not divide `C`, [`LazyError::Shape`] for
    /// a weight or bias that is not `[C]`, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_group_norm(
        &self,
        num_groups: i64,
        #[fixed] weight: Option<impl IntoLazy>,
        #[fixed] bias: Option<impl IntoLazy>,
        eps: f64,
        cudnn_enabled: bool,
    ) -> Result<LazyTensor, LazyError> {
        let _ = cudnn_enabled;
        let x = self.node();
        let name = "group_norm";
        let s = &x.meta.shape;
        if s.len() < 2 {
            return Err(arg(name, s, format!("expected at least 2 dims (N, C, ..), got {}", s.len())));
        }
        if num_groups < 1 || s[1] % num_groups != 0 {
            return Err(arg(
                name,
                s,
                format!("expected number of channels {} to be divisible by num_groups {num_groups}", s[1]),
            ));
        }
        floating(name, x)?;
        let (w, b) = (weight.map(IntoLazy::into_lazy), bias.map(IntoLazy::into_lazy));
        let mut nodes = vec![x];
        for p in w.iter().chain(b.iter()) {
            if p.node().meta.shape != [s[1]] {
                return Err(shape_err(name, s, &p.node().meta.shape, format!("weight and bias must be [{}]", s[1])));
            }
            same_kind(name, x, p.node())?;
            nodes.push(p.node());
        }
        let device = same_device(name, &nodes)?;
        let mapped: Vec<Option<usize>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| n.meta.batch().filter(|bd| i == 0 && bd.dim == 0).map(|_| 0))
            .collect();
        let (flow, mut mixes) = combine_flows(name, &nodes, &mapped, s, Linearity::Nonlinear, false)?;
        if x.meta.batch().is_some_and(|bd| bd.dim != 0) {
            mixes = Some("normalizes over the batch dimension (it is not the first)".into());
        }
        let op = GroupNorm { num_groups, eps, affine: Affine { weight: w.is_some(), bias: b.is_some() } };
        let inputs = inputs_of(nodes);
        Ok(Record::new(op, inputs, s.clone(), x.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// Root-mean-square normalization over the trailing `normalized_shape`, as tch's
    /// `rms_norm`: `x / sqrt(mean(x²) + eps) · weight` (`eps`: the kind's epsilon when `None`).
    /// Each sample is normalized alone unless the batch dimension is among the normalized ones.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the trailing dimensions or the weight do not match
    /// `normalized_shape`, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_rms_norm(
        &self,
        normalized_shape: impl IntList,
        #[fixed] weight: Option<impl IntoLazy>,
        eps: impl Into<Option<f64>>,
    ) -> Result<LazyTensor, LazyError> {
        let norm = normalized_shape.as_slice().to_vec();
        let params = [weight.map(IntoLazy::into_lazy)];
        let op = RmsNorm { normalized_shape: norm.clone(), eps: eps.into(), weight: params[0].is_some() };
        self.trailing_norm("rms_norm", norm, &params, op)
    }
}
