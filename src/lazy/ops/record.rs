//! Recording: a node about to be created, and how the batch flows from an op's inputs to its
//! output. An op on values computed at once (toma's closures on a `Tensor`) runs as soon as it
//! is recorded.

use std::rc::Rc;

use tch::{Device, Kind, TchError, Tensor};

use crate::dims::Dims;
use crate::lazy::error::LazyError;
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{BatchDim, Cost, Flow, LazyTensor, Meta, Node, NodeKind, Operation, Run, RunCx};
use crate::lazy::shape;
use crate::memory::ViewBase;

use super::autocast;

/// What an op takes as a tensor operand: a `&LazyTensor`, or a `&tch::Tensor`, recorded as a
/// fixed operand (a parameter or a constant, without a batch dimension). References only, as
/// tch's methods take them (`x.matmul(&w)`).
pub trait IntoLazy {
    /// The operand as a lazy tensor.
    fn into_lazy(self) -> LazyTensor;

    /// The operand's value when it needs no recording (a tensor, or a value computed at
    /// once), for an op on a value computed at once to call tch's method directly.
    #[doc(hidden)]
    fn eager_operand(&self) -> Option<&Tensor> {
        None
    }

    /// Whether the operand is a value computed at once (not a `Tensor`, which a static method
    /// on lazy operands records as a fixed operand).
    #[doc(hidden)]
    fn computed_at_once(&self) -> bool {
        false
    }
}

impl IntoLazy for &LazyTensor {
    fn into_lazy(self) -> LazyTensor {
        self.clone()
    }

    #[inline]
    fn eager_operand(&self) -> Option<&Tensor> {
        self.eager_value()
    }

    #[inline]
    fn computed_at_once(&self) -> bool {
        self.eager_value().is_some()
    }
}

impl IntoLazy for &Tensor {
    fn into_lazy(self) -> LazyTensor {
        leaf(self, None)
    }

    #[inline]
    fn eager_operand(&self) -> Option<&Tensor> {
        Some(self)
    }
}

/// A reference to an operand (`&xs` where `xs: &LazyTensor` or `&Tensor`): what
/// `#[toma::lazy::module]` makes of each element of a list written out for `Tensor::cat`, which
/// may be owned values, references or names bound to references.
macro_rules! through_a_reference {
    ($($operand:ty),*) => {$(
        impl IntoLazy for &&$operand {
            fn into_lazy(self) -> LazyTensor {
                (*self).into_lazy()
            }

            #[inline]
            fn eager_operand(&self) -> Option<&Tensor> {
                (**self).eager_operand()
            }

            #[inline]
            fn computed_at_once(&self) -> bool {
                (**self).computed_at_once()
            }
        }
    )*};
}
through_a_reference!(LazyTensor, Tensor);

/// [`IntoLazy::eager_operand`] of an optional operand: `Some(None)` for none.
#[inline]
pub(crate) fn eager_option<T: IntoLazy>(operand: &Option<T>) -> Option<Option<&Tensor>> {
    match operand {
        None => Some(None),
        Some(x) => x.eager_operand().map(Some),
    }
}

/// A weight of tch's generic form `Option<T>`: `&Tensor`, `&LazyTensor`, or the owned `Tensor`
/// that tch's turbofish names for "no weight" (`x.binary_cross_entropy::<Tensor>(&y, None, ..)`).
/// Apart from [`IntoLazy`], which takes references only, as tch's methods do.
pub trait WeightOperand {
    /// The weight as a lazy tensor.
    fn into_lazy_weight(self) -> LazyTensor;
}

impl<T: IntoLazy> WeightOperand for T {
    fn into_lazy_weight(self) -> LazyTensor {
        self.into_lazy()
    }
}

impl WeightOperand for Tensor {
    fn into_lazy_weight(self) -> LazyTensor {
        leaf(&self, None)
    }
}

/// How an op treats values that were reduced over the batch ([`Flow::Sum`] and [`Flow::Max`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Linearity {
    /// `a + b`, `a - b`: sums stay sums (fixed operands are weighted per micro-batch).
    Additive,
    /// `a * b`, `a / b`: a sum times something fixed stays a sum; `divisor` is the input that
    /// must not be a sum.
    Scaling { divisor: Option<usize> },
    /// Shape-only and linear reductions (views, `sum`, `mean`): sums and maxima pass through.
    Structural,
    /// Anything else.
    Nonlinear,
}

/// A node about to be created.
pub(crate) struct Record {
    pub(crate) op: Box<dyn Operation>,
    pub(crate) inputs: Vec<Rc<Node>>,
    pub(crate) shape: Dims,
    /// `None`: a fresh, contiguous output.
    pub(crate) strides: Option<Dims>,
    pub(crate) kind: Kind,
    pub(crate) device: Device,
    pub(crate) flow: Flow,
    pub(crate) mixes: Option<String>,
    pub(crate) alias: bool,
    pub(crate) differentiable: bool,
}

impl Record {
    pub(crate) fn new(
        op: impl Operation + 'static,
        inputs: Vec<Rc<Node>>,
        shape: impl Into<Dims>,
        kind: Kind,
        device: Device,
    ) -> Self {
        Record {
            op: Box::new(op),
            inputs,
            shape: shape.into(),
            strides: None,
            kind,
            device,
            flow: Flow::Fixed,
            mixes: None,
            alias: false,
            differentiable: true,
        }
    }

    pub(crate) fn flow(mut self, (flow, mixes): (Flow, Option<String>)) -> Self {
        self.flow = flow;
        self.mixes = mixes;
        self
    }

    /// An elementwise op's output, laid out as libtorch's `TensorIterator` lays it out from the
    /// inputs' strides ([`shape::elementwise_strides`]): in a transposed input's order, so that
    /// a later `reshape` copies where eager tch's does. Not a view.
    pub(crate) fn elementwise(mut self) -> Self {
        // Contiguous inputs give the contiguous default: nothing to gather on the common path.
        if self.inputs.iter().all(|n| shape::is_contiguous(&n.meta.shape, &n.meta.strides)) {
            return self;
        }
        let operands: Vec<(&[i64], &[i64])> =
            self.inputs.iter().map(|n| (n.meta.shape.as_slice(), n.meta.strides.as_slice())).collect();
        self.strides = Some(shape::elementwise_strides(&self.shape, &operands));
        self
    }

    pub(crate) fn view(mut self, strides: impl Into<Dims>) -> Self {
        self.strides = Some(strides.into());
        self.alias = true;
        self
    }

    pub(crate) fn not_differentiable(mut self) -> Self {
        self.differentiable = false;
        self
    }

    pub(crate) fn finish(mut self) -> LazyTensor {
        // An op on values computed at once (and parameters, constants) runs at once too: the
        // ops without a direct path to tch's method (see `tensor_methods`) come here.
        let now = self.inputs.iter().any(|n| n.is_eager()) && self.inputs.iter().all(|n| n.is_fixed_leaf());
        // In an autocast region, the casts libtorch would insert (none for most ops).
        if let Some(target) = autocast::target(self.device, self.op.name(), self.inputs.iter().map(|n| n.meta.kind)) {
            for input in &mut self.inputs {
                if autocast::eligible(input.meta.kind) && input.meta.kind != target {
                    *input = Cast::record(input, target);
                }
            }
            if autocast::eligible(self.kind) {
                self.kind = target;
            }
        }
        let recorded = self.finish_as_is();
        if now {
            // On failure the op stays recorded: its error comes back where the value is asked
            // for, from a call that returns it.
            if let Ok(value) = recorded.node().run_at_once() {
                return LazyTensor::from_eager(value);
            }
        }
        // Recorded under `tch::no_grad` (a target network's estimate): eagerly its value has
        // no `grad_fn`, so no gradient flows back through it. Detached, as that value is.
        if recorded.node().meta.requires_grad && !crate::lazy::tch_compat::grad_enabled() {
            return recorded.detach();
        }
        recorded
    }

    /// [`finish`](Self::finish) without autocast's casts.
    fn finish_as_is(self) -> LazyTensor {
        let requires_grad =
            self.differentiable && shape::is_floating(self.kind) && self.inputs.iter().any(|n| n.meta.requires_grad);
        let strides = self.strides.unwrap_or_else(|| shape::contiguous_strides(&self.shape));
        let meta = Meta {
            shape: self.shape,
            strides,
            kind: self.kind,
            device: self.device,
            flow: self.flow,
            requires_grad,
            alias: self.alias,
            mixes: self.mixes,
        };
        let cast = |k: usize| shape::promoted(self.inputs[k].meta.kind, meta.kind);
        let mut facts = self.op.facts(&self.inputs, &meta).recorded(meta.requires_grad);
        if (0..self.inputs.len()).any(cast) {
            facts = facts.grads_cast(cast);
        }
        let kind = NodeKind::Op(self.op);
        let cost = Cost::of(&kind, &facts, &self.inputs, &meta);
        LazyTensor::from_node(Node::new(kind, self.inputs, meta, facts, cost))
    }
}

/// A cast an autocast region inserts before an op, as libtorch's autocast does (`to_kind`,
/// named `autocast` in plans).
struct Cast {
    kind: Kind,
}

impl Operation for Cast {
    fn name(&self) -> &'static str {
        "autocast"
    }
}

impl Run for Cast {
    fn run(&self, ins: &[&Tensor], _cx: &crate::lazy::graph::RunCx<'_>) -> Result<Tensor, tch::TchError> {
        ins[0].f_to_kind(self.kind)
    }
}

impl Cast {
    /// `input` in `kind`, keeping its layout (as `to` does a dense tensor's) and batch flow.
    fn record(input: &Rc<Node>, kind: Kind) -> Rc<Node> {
        let m = &input.meta;
        let flow = unary_flow("autocast", input, &m.shape, Some, Linearity::Structural);
        // A cast of a value the batch flows through is as any elementwise op's; the flow of
        // an input is always one a unary op accepts.
        let flow = flow.unwrap_or((m.flow, m.mixes.clone()));
        let record = Record::new(Cast { kind }, inputs_of([input]), m.shape.clone(), kind, m.device).flow(flow);
        Record { strides: Some(m.strides.clone()), ..record }.finish_as_is().node().clone()
    }
}

/// A leaf: a batched input (`batch = Some(dim)`) or a fixed tensor (parameters, constants).
pub(crate) fn leaf(tensor: &Tensor, batch: Option<usize>) -> LazyTensor {
    let facts = crate::memory::tensor_facts(tensor);
    // A view of a parameter (`w.t()`) is an op on the parameter: one gradient, in its `.grad`,
    // not an operand of its own whose gradient is sent back through autograd afterwards.
    if batch.is_none() && facts.requires_grad && !facts.is_leaf {
        if let Some(view) = crate::memory::view_base(tensor) {
            return ParamView::record(&facts.shape, &facts.strides, view);
        }
    }
    LazyTensor::from_node(Node::leaf_of(tensor.shallow_clone(), facts, batch, false))
}

/// A view of a parameter that the user made with tch and that is no permutation of it
/// (`w.narrow(..)`, `w.view(..)`, `w.expand(..)`): recorded on the parameter itself, so that its
/// gradient lands in the parameter's `.grad` as a plain step's does. Its backward (libtorch's
/// `as_strided_backward`) writes the output's gradient into a fresh tensor of the parameter's
/// size, as a narrow's zero-filled gradient does.
pub(crate) struct ParamView {
    pub(crate) size: Dims,
    pub(crate) stride: Dims,
    pub(crate) offset: i64,
}

impl Operation for ParamView {
    fn name(&self) -> &'static str {
        "as_strided"
    }
}

impl Run for ParamView {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_as_strided(self.size.as_slice(), self.stride.as_slice(), self.offset)
    }
}

impl ParamView {
    /// A view the user holds (sized `shape`, strided `strides`), as an op on the leaf autograd
    /// made it from (`of`): a transpose or permutation as that op (its gradient is added into
    /// `.grad` as it comes, as a plain step adds it), any other view as `as_strided`.
    pub(crate) fn record(shape: &[i64], strides: &[i64], of: ViewBase) -> LazyTensor {
        let offset = of.offset;
        let base_facts = crate::memory::tensor_facts(&of.base);
        let leaf = LazyTensor::from_node(Node::leaf_of(of.base, base_facts, None, false));
        if offset == of.base_offset {
            if let Some(perm) = permutation(shape, strides, &leaf.meta().shape, &leaf.meta().strides) {
                return match perm.as_slice() {
                    _ if perm.iter().enumerate().all(|(i, &p)| i as i64 == p) => leaf,
                    [1, 0] => leaf.transpose(0, 1),
                    _ => leaf.permute(perm.as_slice()),
                };
            }
        }
        let m = leaf.meta();
        let (size, stride) = (Dims::from(shape), Dims::from(strides));
        let op = ParamView { size: size.clone(), stride: stride.clone(), offset };
        Record::new(op, inputs_of([leaf.node()]), size, m.kind, m.device)
            .flow((Flow::Fixed, None))
            .view(stride)
            .finish()
    }
}

/// The order of `base`'s dimensions that gives `view`'s sizes and strides, if there is one.
fn permutation(size: &[i64], stride: &[i64], base_size: &[i64], base_stride: &[i64]) -> Option<Dims> {
    if size.len() != base_size.len() {
        return None;
    }
    // 1 where a dimension of the base is taken; in place, as the result, for short shapes.
    let mut used = Dims::zeros(size.len());
    size.iter()
        .zip(stride)
        .map(|(s, t)| {
            let j = (0..used.len()).find(|&j| used[j] == 0 && base_size[j] == *s && base_stride[j] == *t)?;
            used[j] = 1;
            Some(j as i64)
        })
        .collect()
}

/// Checks that all operands live on one device; gives it back.
pub(crate) fn same_device(op: &str, nodes: &[&Rc<Node>]) -> Result<Device, LazyError> {
    let first = nodes[0];
    for n in &nodes[1..] {
        // libtorch lets a 0-dim CPU tensor join any device, as a scalar.
        let scalar = n.meta.shape.is_empty() && n.meta.device == Device::Cpu;
        if n.meta.device != first.meta.device && !scalar {
            return Err(LazyError::Device {
                op: op.into(),
                lhs: first.meta.device,
                lhs_shape: first.meta.shape.to_vec(),
                rhs: n.meta.device,
                rhs_shape: n.meta.shape.to_vec(),
            });
        }
    }
    Ok(first.meta.device)
}

/// The flow of an op's output, given where each per-sample input's batch dimension lands in
/// the output (`mapped[i]`: `Some(dim)`, or `None` when the op consumes it) and how the op
/// treats reduced values.
///
/// Checks that per-sample inputs share one batch size, and that a fixed operand does not carry
/// what looks like the batch (a fixed tensor of size N along the batch dimension would be
/// broadcast against every micro-batch: wrong, so it is an error).
pub(crate) fn combine_flows(
    op: &str,
    inputs: &[&Rc<Node>],
    mapped: &[Option<usize>],
    out_shape: &[i64],
    linearity: Linearity,
    check_fixed: bool,
) -> Result<(Flow, Option<String>), LazyError> {
    let mut per: Option<(BatchDim, usize)> = None;
    let mut consumed = false;
    let (mut sums, mut maxes, mut opaque) = (0, 0, false);
    let mut misaligned = false;
    for (i, n) in inputs.iter().enumerate() {
        match n.meta.flow {
            Flow::PerSample(bd) => match mapped[i] {
                None => consumed = true,
                Some(dim) => {
                    let here = BatchDim { dim, ..bd };
                    match per {
                        None => per = Some((here, i)),
                        Some((first, j)) => {
                            if first.size != here.size {
                                return Err(LazyError::Batch {
                                    op: op.into(),
                                    lhs: inputs[j].meta.shape.to_vec(),
                                    rhs: n.meta.shape.to_vec(),
                                    reason: format!(
                                        "batch sizes {} and {} differ (inputs wrapped by different lazy() calls?)",
                                        first.size, here.size
                                    ),
                                });
                            }
                            misaligned |= first != here;
                        }
                    }
                }
            },
            Flow::Fixed => {}
            Flow::Sum => sums += 1,
            Flow::Max => maxes += 1,
            Flow::Opaque => opaque = true,
        }
    }
    if opaque {
        return Ok((Flow::Opaque, None));
    }
    if let Some((bd, j)) = per {
        // A fixed operand with the batch's size along the batch dimension (right-aligned, as
        // broadcasting aligns) is almost surely per-sample data that was not wrapped.
        let full = bd.size * bd.factor;
        if check_fixed && full > 1 {
            for n in inputs.iter().filter(|n| n.meta.flow == Flow::Fixed) {
                let offset = out_shape.len() as i64 - n.meta.shape.len() as i64;
                let at = bd.dim as i64 - offset;
                if at >= 0 && n.meta.shape.get(at as usize) == Some(&full) {
                    return Err(LazyError::Batch {
                        op: op.into(),
                        lhs: inputs[j].meta.shape.to_vec(),
                        rhs: n.meta.shape.to_vec(),
                        reason: format!(
                            "the second operand is not batched but has the batch's size {full} along the batch \
                             dimension {}; wrap it with toma::lazy::lazy(.., dim) so it is split with the batch",
                            bd.dim
                        ),
                    });
                }
            }
        }
        if misaligned || consumed {
            let reason = if consumed {
                "reduces over the batch dimension of one operand while keeping another's".to_string()
            } else {
                "pairs samples found at different positions of its operands' batch dimensions".to_string()
            };
            return Ok((Flow::Opaque, Some(reason)));
        }
        if out_shape.get(bd.dim) != Some(&full) {
            // Only possible with N = 1 broadcast against something larger: never split.
            return Ok((Flow::Opaque, None));
        }
        if sums + maxes > 0 {
            let reason = "combines per-sample values with a value reduced over the batch".to_string();
            return Ok((Flow::PerSample(bd), Some(reason)));
        }
        return Ok((Flow::PerSample(bd), None));
    }
    if consumed {
        return Ok((Flow::Opaque, Some("consumes the batch dimension".to_string())));
    }
    if maxes > 0 {
        if linearity == Linearity::Structural && sums == 0 {
            return Ok((Flow::Max, None));
        }
        return Ok((Flow::Opaque, Some("is applied to a maximum over the batch".to_string())));
    }
    if sums > 0 {
        let linear = match linearity {
            Linearity::Additive | Linearity::Structural => true,
            Linearity::Scaling { divisor } => {
                sums == 1 && divisor.is_none_or(|d| inputs.get(d).is_none_or(|n| n.meta.flow != Flow::Sum))
            }
            Linearity::Nonlinear => false,
        };
        if linear {
            return Ok((Flow::Sum, None));
        }
        return Ok((
            Flow::Opaque,
            Some("is applied to a value reduced over the batch, which is not linear".to_string()),
        ));
    }
    Ok((Flow::Fixed, None))
}

/// Elementwise (broadcasting) ops: each input's batch dimension is right-aligned into the output.
pub(crate) fn broadcast_flows(
    op: &str,
    inputs: &[&Rc<Node>],
    out_shape: &[i64],
    linearity: Linearity,
) -> Result<(Flow, Option<String>), LazyError> {
    let at = |n: &Rc<Node>| n.meta.batch().map(|bd| bd.dim + out_shape.len() - n.meta.shape.len());
    // Two or three operands, nearly always: nothing allocated for them.
    if inputs.len() <= 4 {
        let mut mapped = [None; 4];
        for (m, n) in mapped.iter_mut().zip(inputs) {
            *m = at(n);
        }
        return combine_flows(op, inputs, &mapped[..inputs.len()], out_shape, linearity, true);
    }
    let mapped: Vec<Option<usize>> = inputs.iter().map(|n| at(n)).collect();
    combine_flows(op, inputs, &mapped, out_shape, linearity, true)
}

/// A unary op that keeps the batch dimension at `dim` (given the input's), or drops it (`None`).
pub(crate) fn unary_flow(
    op: &str,
    input: &Rc<Node>,
    out_shape: &[i64],
    dim: impl FnOnce(usize) -> Option<usize>,
    linearity: Linearity,
) -> Result<(Flow, Option<String>), LazyError> {
    let mapped = [input.meta.batch().and_then(|bd| dim(bd.dim))];
    combine_flows(op, &[input], &mapped, out_shape, linearity, false)
}
