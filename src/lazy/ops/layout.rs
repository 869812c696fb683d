//! Ops that change how values are laid out, not what they are: views (no copy), copies into
//! a new shape or kind, slices, and concatenation.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{combine_flows, same_device, unary_flow, Linearity, Record};
use super::{arg, kind_err, requires, same_shape_flow, shape_err};
use crate::lazy::error::LazyError;
use crate::lazy::error::OrPanic;
use crate::lazy::facts::{GradReshape, OpFacts};
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{BatchDim, Flow, KernelCall, Meta, Node, Operation, Run, RunCx};
use crate::lazy::int_list::IntList;
use crate::lazy::shape;
use crate::lazy::size::Elements;
use crate::lazy::LazyTensor;

/// A view to the node's shape (no copy); its input's gradient is the output's, viewed. Named
/// `view`, or after the op whose last step it is (`einsum`, which carries its batch rule).
pub(crate) struct View(pub(crate) &'static str);

impl Operation for View {
    fn name(&self) -> &'static str {
        self.0
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).grad_aliases(|_i| true).grad_reshape(GradReshape::AsInput)
    }
}

impl Run for View {
    fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_view(cx.meta.shape_at(cx.b).as_slice())
    }
}

/// Ops that rearrange their input's entries, as a view or a copy, and need nothing but their
/// output and a fresh gradient for it: alike but for their name and how they run, so one table.
pub(crate) enum Rearrange {
    /// A reshape that copies (the input's strides allow no view).
    Reshape,
    /// `length` entries of `dim` from `start` (a view; its gradient is a new tensor).
    Narrow { dim: i64, start: i64, length: i64 },
    /// The same storage, cut from autograd.
    Detach,
    /// Entries shifted circularly by `shifts` along `dims` (the value flattened when `dims` is
    /// empty); its gradient is the output's rolled back.
    Roll { shifts: Vec<i64>, dims: Vec<i64> },
    /// A copy with the order of the entries along `dims` reversed; its gradient is the
    /// output's, flipped back.
    Flip(Vec<i64>),
    /// Copies repeated `repeats` times along each dimension.
    Repeat(Vec<i64>),
    /// A fixed value derived from a broadcast over the batch (a learned latent array expanded
    /// to the batch, then passed through layers): each micro-batch reads its own rows of it
    /// along `dim`, so that it meets the micro-batch's values and its gradient is the
    /// micro-batch's share. The value itself is computed whole (a view of it).
    BatchSlice { dim: i64 },
}

impl Operation for Rearrange {
    fn name(&self) -> &'static str {
        match self {
            Rearrange::Reshape => "reshape",
            Rearrange::Narrow { .. } => "narrow",
            Rearrange::Detach => "detach",
            Rearrange::Roll { .. } => "roll",
            Rearrange::Flip(_) => "flip",
            Rearrange::Repeat(_) => "repeat",
            Rearrange::BatchSlice { .. } => "batch_slice",
        }
    }
}

impl Run for Rearrange {
    fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let x = ins[0];
        match self {
            // Recorded as a copy (the full batch's strides allowed no view), so later views were
            // recorded against a contiguous result: a micro-batch's strides can let libtorch
            // return a strided view instead, which those views cannot take.
            Rearrange::Reshape => x.f_reshape(cx.meta.shape_at(cx.b).as_slice())?.f_contiguous(),
            Rearrange::Narrow { dim, start, length } => x.f_narrow(*dim, *start, *length),
            Rearrange::Detach => x.f_detach(),
            Rearrange::Roll { shifts, dims } => x.f_roll(shifts.as_slice(), dims.as_slice()),
            Rearrange::Flip(dims) => x.f_flip(dims.as_slice()),
            Rearrange::Repeat(repeats) => x.f_repeat(repeats.as_slice()),
            Rearrange::BatchSlice { dim } => x.f_narrow(*dim, cx.start, cx.b),
        }
    }
}

/// Ops whose output is their input's storage (a view, or the value itself) and whose input's
/// gradient is a view of the output's: alike but for their name and how they run, so one table.
pub(crate) enum Alias {
    /// Two dimensions swapped.
    Transpose { dim0: i64, dim1: i64 },
    /// The dimensions reordered.
    Permute(Vec<i64>),
    /// A dimension of size 1 inserted.
    Unsqueeze(i64),
    /// Dimensions of size 1 removed.
    Squeeze(Vec<i64>),
    /// The value on its own device: the value itself (tch returns a tensor already there as
    /// it is).
    ToDevice(tch::Device),
    /// A contiguous copy where the strides need one, else the value itself.
    Contiguous,
}

impl Operation for Alias {
    fn name(&self) -> &'static str {
        match self {
            Alias::Transpose { .. } => "transpose",
            Alias::Permute(_) => "permute",
            Alias::Unsqueeze(_) => "unsqueeze",
            Alias::Squeeze(_) => "squeeze",
            Alias::ToDevice(_) => "to_device",
            Alias::Contiguous => "contiguous",
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).grad_aliases(|_i| true)
    }
}

impl Run for Alias {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let x = ins[0];
        match self {
            Alias::Transpose { dim0, dim1 } => x.f_transpose(*dim0, *dim1),
            Alias::Permute(dims) => x.f_permute(dims.as_slice()),
            Alias::Unsqueeze(dim) => x.f_unsqueeze(*dim),
            Alias::Squeeze(dims) => x.f_squeeze_dims(dims.as_slice()),
            Alias::ToDevice(device) => x.f_to_device(*device),
            Alias::Contiguous => x.f_contiguous(),
        }
    }
}

/// The value in another kind (the value itself when the kind is its own).
pub(crate) struct ToKind {
    kind: Kind,
}

impl Operation for ToKind {
    fn name(&self) -> &'static str {
        "to_kind"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).grad_aliases(|_i| inputs[0].meta.kind == self.kind)
    }
}

impl Run for ToKind {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_to_kind(self.kind)
    }
}

/// Operands concatenated along `dim`, in order. Each operand's gradient is a view of the
/// output's; concatenating sums adds them (each along its own range).
pub(crate) struct Cat {
    dim: i64,
}

impl Operation for Cat {
    fn name(&self) -> &'static str {
        "cat"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).grad_aliases(|_i| true).adds_fixed(true)
    }
}

impl Run for Cat {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        Tensor::f_cat(ins, self.dim)
    }
}

/// A view broadcast to the node's shape (no copy); its gradient is summed over the expanded
/// dimensions.
pub(crate) struct Expand;

impl Operation for Expand {
    fn name(&self) -> &'static str {
        "expand"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if meta.requires_grad {
            let input = &inputs[0].meta;
            let offset = meta.shape.len() - input.shape.len();
            let mask = shape::dims_mask(
                (0..meta.shape.len()).filter(|&d| d < offset || (input.shape[d - offset] == 1 && meta.shape[d] != 1)),
            );
            calls.push(KernelCall::Reduction { of: meta, mask, backward: true });
        }
    }
}

impl Run for Expand {
    fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_expand(cx.meta.shape_at(cx.b).as_slice(), false)
    }
}

/// Whether fixed `node` holds, along a dimension of `size`, copies that an `expand` or `repeat`
/// made (itself or an op on it): a broadcast of parameters, not data that was not wrapped.
fn derived_from_broadcast(node: &Rc<Node>, size: i64) -> bool {
    let mut stack = vec![node.clone()];
    let mut seen = 0;
    while let Some(n) = stack.pop() {
        seen += 1;
        if seen > 256 || n.meta.flow != Flow::Fixed {
            continue;
        }
        if matches!(n.name(), "expand" | "repeat") && n.meta.shape.contains(&size) {
            return true;
        }
        stack.extend(n.inputs.iter().filter(|i| i.meta.shape.contains(&size)).cloned());
    }
    false
}

/// Fixed operands that `expand` broadcast to the batch's size along the batch dimension (a
/// learned CLS token, `T::constant(&cls).expand([b, -1, -1])`, or `.repeat([b, 1, 1])`),
/// re-recorded as per-sample broadcasts: the same expand (a repeat: the expand copied),
/// batched, which each micro-batch runs at its own size. `nodes`
/// meet in an op whose output has `out_len` dimensions; `right_aligned` when broadcasting aligns
/// them from the right (elementwise ops), else they share their dimensions (`cat`). Anything
/// else is left as it is, for the op's own checks.
pub(crate) fn adopt_batch_broadcasts(nodes: &mut [Rc<Node>], out_len: usize, right_aligned: bool) {
    let at_out = |n: &Node, d: usize| if right_aligned { d + out_len - n.meta.shape.len() } else { d };
    let Some((dim, bd)) = nodes.iter().find_map(|n| n.meta.batch().map(|bd| (at_out(n, bd.dim), bd))) else {
        return;
    };
    if bd.factor != 1 || bd.size <= 1 {
        return;
    }
    for node in nodes.iter_mut() {
        let m = &node.meta;
        let repeat = node.name() == "repeat";
        if m.flow != Flow::Fixed {
            continue;
        }
        let offset = out_len as i64 - m.shape.len() as i64;
        let at = if right_aligned { dim as i64 - offset } else { dim as i64 };
        if at < 0 || m.shape.get(at as usize) != Some(&bd.size) {
            continue;
        }
        if !(node.name() == "expand" || repeat) {
            // Layers after the broadcast: each micro-batch takes its rows of their output.
            if derived_from_broadcast(node, bd.size) {
                let batched = BatchDim { dim: at as usize, size: bd.size, factor: 1 };
                let sliced = Record::new(
                    Rearrange::BatchSlice { dim: at },
                    inputs_of([&*node]),
                    m.shape.clone(),
                    m.kind,
                    m.device,
                )
                .flow((Flow::PerSample(batched), None))
                .view(m.strides.clone())
                .finish();
                *node = sliced.node().clone();
            }
            continue;
        }
        if repeat {
            // `repeat([b, 1, ..])` of a size-1 dimension: the same values as the expand, copied.
            let src = &node.inputs[0];
            let (s, o) = (&src.meta.shape, &m.shape);
            let only_batch =
                s.len() == o.len() && (0..o.len()).all(|d| if d == at as usize { s[d] == 1 } else { s[d] == o[d] });
            if !only_batch {
                continue;
            }
            let batched = BatchDim { dim: at as usize, size: bd.size, factor: 1 };
            let mut strides = src.meta.strides.clone();
            strides[at as usize] = 0;
            let expanded = Record::new(Expand, inputs_of([src]), o.clone(), m.kind, m.device)
                .flow((Flow::PerSample(batched), None))
                .view(strides)
                .finish();
            if let Ok(copied) = expanded.f_contiguous() {
                *node = copied.node().clone();
            }
            continue;
        }
        // Broadcast there, from size 1 or from a dimension the expand added.
        let src = &node.inputs[0];
        let src_at = at - (m.shape.len() - src.meta.shape.len()) as i64;
        if src_at >= 0 && src.meta.shape[src_at as usize] != 1 {
            continue;
        }
        let batched = BatchDim { dim: at as usize, size: bd.size, factor: 1 };
        let lazy = Record::new(Expand, inputs_of([src]), m.shape.clone(), m.kind, m.device)
            .flow((Flow::PerSample(batched), None))
            .view(m.strides.clone())
            .finish();
        *node = lazy.node().clone();
    }
}

/// Class indices as one-hot rows along a new last dimension of `classes` entries (`Int64`,
/// no gradient), as libtorch's `one_hot`.
pub(crate) struct OneHot {
    classes: i64,
}

impl Operation for OneHot {
    fn name(&self) -> &'static str {
        "one_hot"
    }
}

impl Run for OneHot {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_one_hot(self.classes)
    }
}

/// Entries of `dim` at the positions in an index. Operands: x, index (1-D integers), kept to
/// send the gradient back to the entries it picked.
pub(crate) struct IndexSelect {
    dim: i64,
}

impl Operation for IndexSelect {
    fn name(&self) -> &'static str {
        "index_select"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 1)
    }
}

impl Run for IndexSelect {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_index_select(self.dim, ins[1])
    }
}

/// Entries along `dim` at an index. Operands: x, index (integers, x's rank; the output's
/// shape), kept to send the gradient back.
pub(crate) struct Gather {
    dim: i64,
    sparse_grad: bool,
}

impl Operation for Gather {
    fn name(&self) -> &'static str {
        "gather"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 1)
    }
}

impl Run for Gather {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_gather(self.dim, ins[1], self.sparse_grad)
    }
}

/// `self` with entries along `dim` written (`scatter`) or added to (`scatter_add`) at an
/// index, from `src`. Operands: self, index (integers, kept to send the gradient back), src.
/// `scatter_add`'s gradient for `self` is the output's (a view); `scatter`'s is it with the
/// overwritten entries zeroed (a new tensor).
pub(crate) struct Scatter {
    dim: i64,
    add: bool,
}

impl Operation for Scatter {
    fn name(&self) -> &'static str {
        if self.add {
            "scatter_add"
        } else {
            "scatter"
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 1).grad_aliases(|i| self.add && i == 0)
    }
}

impl Run for Scatter {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        if self.add {
            ins[0].f_scatter_add(self.dim, ins[1], ins[2])
        } else {
            ins[0].f_scatter(self.dim, ins[1], ins[2])
        }
    }
}

/// `self` with `source`'s slices added along `dim` at the positions of a 1-D index. Operands:
/// self, index (kept), source. The gradient for `self` is the output's (a view).
pub(crate) struct IndexAdd {
    dim: i64,
}

impl Operation for IndexAdd {
    fn name(&self) -> &'static str {
        "index_add"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 1).grad_aliases(|i| i == 0)
    }
}

impl Run for IndexAdd {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_index_add(self.dim, ins[1], ins[2])
    }
}

/// `self` with `values` written (or added, `accumulate`) at advanced indices. Operands: self,
/// values, then each index given (kept).
/// Backward: `self`'s gradient is the output's with the indexed entries zeroed (a new tensor;
/// the output's itself when accumulating), `values`' the output's gradient at the indices
/// (`indexed` shape), summed down when `values` was broadcast.
pub(crate) struct IndexPut {
    /// Which entries of the index list are given (`Some`).
    given: Vec<bool>,
    accumulate: bool,
    /// The indexed result's facts (what `values` broadcasts to).
    indexed: Meta,
}

impl Operation for IndexPut {
    fn name(&self) -> &'static str {
        "index_put"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if !meta.requires_grad {
            return;
        }
        let values = &inputs[1].meta;
        // `self`'s gradient first, with `zeros_like(values)` written into the copy of the
        // output's; freed before `values`' gradient, at least as large, is made.
        let mut backward = if requires(inputs, 0) && !self.accumulate { values.elements() } else { Elements::ZERO };
        if requires(inputs, 1) {
            backward = Elements::ZERO;
            if values.shape != self.indexed.shape {
                // The gradient at the indices, before it is summed down to `values`.
                backward = self.indexed.elements();
                let mask = shape::broadcast_mask(&values.shape, &self.indexed.shape);
                calls.push(KernelCall::Reduction { of: &self.indexed, mask, backward: true });
            }
        }
        if backward != Elements::ZERO {
            calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| {
                // Not `values`: autograd keeps only its kind and sizes for `zeros_like(values)`.
                i >= 2
            })
            .grad_aliases(|i| i == 0 && self.accumulate)
    }
}

impl Run for IndexPut {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let mut given = ins[2..].iter();
        let indices: Vec<Option<&Tensor>> =
            self.given.iter().map(|&g| if g { given.next().copied() } else { None }).collect();
        ins[0].f_index_put(&indices, ins[1], self.accumulate)
    }
}

/// `self` with its entries where a mask is true taken from `source`, in order. Operands:
/// self, mask (Bool, kept), source. The backward selects the output gradient's masked
/// entries for `source` (padded with zeros to its size).
pub(crate) struct MaskedScatter;

/// Bytes of the two `Int64` buffers per output element that libtorch's CPU `masked_select`
/// fills beside its result, in `masked_scatter`'s backward (read from the CPU allocator's
/// trace, libtorch 2.11).
const MASKED_SELECT_INDEX_BYTES: u64 = 16;

impl Operation for MaskedScatter {
    fn name(&self) -> &'static str {
        "masked_scatter"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // `source`'s gradient: the output gradient's masked entries (at most all of them, or
        // `source`'s size: how many depends on the mask's values), selected with two index
        // buffers per entry; then zeros to `source`'s size, and both joined into the gradient.
        // The gradient is made last (the planner holds it through the op's backward). Never
        // split (a split is refused), so the whole batch's sizes.
        if requires(inputs, 2) {
            let elt = meta.kind.elt_size_in_bytes().max(1) as u64;
            let out = shape::numel(&meta.shape).max(0) as u64;
            let source = shape::numel(&inputs[2].meta.shape).max(0) as u64;
            let selected = out.min(source);
            let indices = (out * MASKED_SELECT_INDEX_BYTES).div_ceil(elt);
            let scratch = (selected + indices).saturating_sub(source).max(source);
            calls.push(KernelCall::Temporaries { forward: Elements::ZERO, backward: Elements::line(0, scratch) });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 1)
    }
}

impl Run for MaskedScatter {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_masked_scatter(ins[1], ins[2])
    }
}

/// Padding of the trailing dimensions, as tch's `pad`.
pub(crate) struct Pad {
    pad: Vec<i64>,
    mode: &'static str,
    value: Option<f64>,
}

impl Operation for Pad {
    fn name(&self) -> &'static str {
        "pad"
    }
}

impl Run for Pad {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_pad(self.pad.as_slice(), self.mode, self.value)
    }
}

#[toma_macros::tensor_methods(LayoutOps, "Views, copies and selections: shapes, dimensions, indexing, padding, kinds (a family of [`TensorOps`](crate::lazy::TensorOps)).")]
impl LazyTensor {
    fn view_flow(&self, new_shape: &[i64]) -> (Flow, Option<String>) {
        let m = self.meta();
        let Some(bd) = m.batch() else { return (m.flow, None) };
        let before = shape::numel(&m.shape[..bd.dim]);
        let mut prefix = 1;
        for (k, &size) in new_shape.iter().enumerate() {
            if prefix == before && size > 0 && size % bd.size == 0 {
                // The samples stay contiguous: the dimensions before the batch are kept, and the
                // batch is the outermost of the dimensions merged into (or split from) `k`.
                return (Flow::PerSample(BatchDim { dim: k, size: bd.size, factor: size / bd.size }), None);
            }
            prefix *= size;
        }
        (Flow::Opaque, Some(format!("to {new_shape:?} moves samples across the batch dimension {}", bd.dim)))
    }

    fn f_reshape_impl(&self, name: &str, shape: &[i64], must_view: bool) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let total = shape::numel(&m.shape);
        let new_shape = shape::infer_size(shape, total).map_err(|r| shape_err(name, &m.shape, shape, r))?;
        let flow = self.view_flow(&new_shape);
        match shape::view_strides(&m.shape, &m.strides, &new_shape) {
            Some(strides) => Ok(Record::new(View("view"), inputs_of([n]), new_shape, m.kind, m.device)
                .flow(flow)
                .view(strides)
                .finish()),
            None if must_view => Err(shape_err(
                name,
                &m.shape,
                shape,
                "view size is not compatible with input tensor's size and stride (at least one dimension spans across \
                 two contiguous subspaces); use reshape instead",
            )),
            None => {
                Ok(Record::new(Rearrange::Reshape, inputs_of([n]), new_shape, m.kind, m.device).flow(flow).finish())
            }
        }
    }

    /// A view with another shape (one size may be -1; a tuple, an array or a slice, as tch's
    /// `view` takes). Where the batch dimension goes is
    /// followed: merged with the dimensions after it (`[N, T, C] -> [N * T, C]`) or split
    /// again; a view that moves samples across it cannot be split.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match or the strides allow no view.
    pub fn f_view(&self, shape: impl tch::Shape) -> Result<LazyTensor, LazyError> {
        self.f_reshape_impl("view", &shape.to_shape(), true)
    }

    /// Like [`f_view`](Self::f_view), copying when the strides allow no view.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match.
    pub fn f_reshape(&self, shape: impl IntList) -> Result<LazyTensor, LazyError> {
        self.f_reshape_impl("reshape", shape.as_slice(), false)
    }

    /// Flattens dimensions `start_dim..=end_dim` into one.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad dimensions.
    pub fn f_flatten(&self, start_dim: i64, end_dim: i64) -> Result<LazyTensor, LazyError> {
        let s = &self.node().meta.shape;
        let a = |r: String| arg("flatten", s, r);
        if s.is_empty() {
            shape::wrap_dim(start_dim, 0).and_then(|_| shape::wrap_dim(end_dim, 0)).map_err(a)?;
            return self.f_reshape([1]);
        }
        let start = shape::wrap_dim(start_dim, s.len()).map_err(a)?;
        let end = shape::wrap_dim(end_dim, s.len()).map_err(a)?;
        if start > end {
            return Err(a("flatten() has invalid args: start_dim cannot come after end_dim".into()));
        }
        let mut new_shape = s[..start].to_vec();
        new_shape.push(shape::numel(&s[start..=end]));
        new_shape.extend_from_slice(&s[end + 1..]);
        self.f_reshape_impl("flatten", &new_shape, false)
    }

    /// Swaps two dimensions (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad dimensions.
    pub fn f_transpose(&self, dim0: i64, dim1: i64) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let a = |r: String| arg("transpose", &m.shape, r);
        let (d0, d1) =
            (shape::wrap_dim(dim0, m.shape.len()).map_err(a)?, shape::wrap_dim(dim1, m.shape.len()).map_err(a)?);
        let (mut s, mut st) = (m.shape.clone(), m.strides.clone());
        if !s.is_empty() {
            s.swap(d0, d1);
            st.swap(d0, d1);
        }
        let map = |d: usize| {
            Some(if d == d0 {
                d1
            } else if d == d1 {
                d0
            } else {
                d
            })
        };
        let flow = unary_flow("transpose", n, &s, map, Linearity::Structural)?;
        Ok(Record::new(Alias::Transpose { dim0, dim1 }, inputs_of([n]), s, m.kind, m.device)
            .flow(flow)
            .view(st)
            .finish())
    }

    /// Reorders the dimensions (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] unless `dims` is a permutation of the dimensions.
    pub fn f_permute(&self, dims: impl IntList) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let dims = dims.as_slice().to_vec();
        let a = |r: String| arg("permute", &m.shape, r);
        if dims.len() != m.shape.len() {
            return Err(a(format!(
                "number of dims don't match in permute: {} given for {} dims",
                dims.len(),
                m.shape.len()
            )));
        }
        let wrapped = shape::wrap_dims(&dims, m.shape.len()).map_err(a)?;
        let s: Vec<i64> = wrapped.iter().map(|&d| m.shape[d]).collect();
        let st: Vec<i64> = wrapped.iter().map(|&d| m.strides[d]).collect();
        let flow = unary_flow("permute", n, &s, |d| wrapped.iter().position(|&w| w == d), Linearity::Structural)?;
        Ok(Record::new(Alias::Permute(dims), inputs_of([n]), s, m.kind, m.device).flow(flow).view(st).finish())
    }

    /// Inserts a dimension of size 1 at `dim` (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension.
    pub fn f_unsqueeze(&self, dim: i64) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let u = shape::wrap_insert_dim(dim, m.shape.len()).map_err(|r| arg("unsqueeze", &m.shape, r))?;
        let (mut s, mut st) = (m.shape.clone(), m.strides.clone());
        let stride = if u < s.len() { s[u] * st[u] } else { 1 };
        s.insert(u, 1);
        st.insert(u, stride);
        let flow = unary_flow("unsqueeze", n, &s, |d| Some(if u <= d { d + 1 } else { d }), Linearity::Structural)?;
        Ok(Record::new(Alias::Unsqueeze(dim), inputs_of([n]), s, m.kind, m.device).flow(flow).view(st).finish())
    }

    fn f_squeeze_impl(&self, dims: Vec<usize>) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let gone: Vec<usize> = dims.into_iter().filter(|&d| m.shape.get(d) == Some(&1)).collect();
        let keep: Vec<usize> = (0..m.shape.len()).filter(|d| !gone.contains(d)).collect();
        let s: Vec<i64> = keep.iter().map(|&d| m.shape[d]).collect();
        let st: Vec<i64> = keep.iter().map(|&d| m.strides[d]).collect();
        let flow = if m.batch().is_some_and(|bd| gone.contains(&bd.dim)) {
            // Only with a batch of 1 (and factor 1), which is never split.
            (Flow::Opaque, None)
        } else {
            unary_flow("squeeze", n, &s, |d| keep.iter().position(|&k| k == d), Linearity::Structural)?
        };
        let dims: Vec<i64> = gone.iter().map(|&d| d as i64).collect();
        Ok(Record::new(Alias::Squeeze(dims), inputs_of([n]), s, m.kind, m.device).flow(flow).view(st).finish())
    }

    /// Removes every dimension of size 1 (a view), as recorded: a micro-batch of one sample
    /// keeps its batch dimension.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_squeeze(&self) -> Result<LazyTensor, LazyError> {
        self.f_squeeze_impl((0..self.dim()).collect())
    }

    /// Removes dimension `dim` if its size is 1 (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension.
    pub fn f_squeeze_dim(&self, dim: i64) -> Result<LazyTensor, LazyError> {
        let d = shape::wrap_dim(dim, self.dim()).map_err(|r| arg("squeeze", &self.size(), r))?;
        self.f_squeeze_impl(if self.dim() == 0 { vec![] } else { vec![d] })
    }

    /// Entries `start..end` of `dim`, as tch's `slice` (Python's rules: negative bounds count
    /// from the end, bounds past the end are clamped, `None` is the whole side). A view, as
    /// [`f_narrow`](Self::f_narrow).
    ///
    /// # Errors
    /// As [`f_narrow`](Self::f_narrow); [`LazyError::Unsupported`] for a `step` other than 1
    /// (index with `index_select` instead).
    pub fn f_slice(
        &self,
        dim: i64,
        start: impl Into<Option<i64>>,
        end: impl Into<Option<i64>>,
        step: i64,
    ) -> Result<LazyTensor, LazyError> {
        let s = &self.node().meta.shape;
        let d = shape::wrap_dim(dim, s.len()).map_err(|r| arg("slice", s, r))?;
        if step != 1 {
            return Err(LazyError::Unsupported {
                op: "slice".into(),
                reason: format!("a step of {step} is not recorded; take the entries with index_select instead"),
            });
        }
        let size = s[d];
        let bound = |v: i64| (if v < 0 { v + size } else { v }).clamp(0, size);
        let start = bound(start.into().unwrap_or(0));
        let end = bound(end.into().unwrap_or(size)).max(start);
        self.f_narrow(d as i64, start, end - start)
    }

    /// The transpose of a matrix (dimensions 0 and 1; a 0-D or 1-D value as it is), as tch's
    /// `tr` (libtorch's `t`).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for more than 2 dimensions.
    pub fn f_tr(&self) -> Result<LazyTensor, LazyError> {
        match self.dim() {
            0 | 1 => Ok(self.clone()),
            2 => self.f_transpose(0, 1),
            _ => Err(arg("tr", &self.size(), "expects a tensor of at most 2 dimensions (use transpose)")),
        }
    }

    /// The same values, as tch's `copy`. A lazy value is never changed in place, so the copy
    /// shares the recorded node: no storage is copied.
    ///
    /// # Errors
    /// None today; fallible as tch's family is.
    #[lazy_only]
    pub fn f_copy(&self) -> Result<LazyTensor, LazyError> {
        Ok(self.clone())
    }

    /// `length` entries of `dim` from `start` (a view). Not along the batch dimension.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a range outside the dimension.
    pub fn f_narrow(&self, dim: i64, start: i64, length: i64) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let a = |r: String| arg("narrow", &m.shape, r);
        if m.shape.is_empty() {
            return Err(a("narrow() cannot be applied to a 0-dim tensor".into()));
        }
        let d = shape::wrap_dim(dim, m.shape.len()).map_err(a)?;
        let size = m.shape[d];
        let start = if start < 0 { start + size } else { start };
        if start < 0 || length < 0 || start + length > size {
            return Err(a(format!("start ({start}) + length ({length}) exceeds dimension size ({size})")));
        }
        let mut s = m.shape.clone();
        s[d] = length;
        let (flow, mixes) = if m.batch().is_some_and(|bd| bd.dim == d) {
            (Flow::Opaque, Some("`narrow` selects samples along the batch dimension".to_string()))
        } else {
            unary_flow("narrow", n, &s, Some, Linearity::Structural)?
        };
        let op = Rearrange::Narrow { dim: d as i64, start, length };
        Ok(Record::new(op, inputs_of([n]), s, m.kind, m.device).flow((flow, mixes)).view(m.strides.clone()).finish())
    }

    /// Splits into `chunks` views along `dim`, as tch's `chunk`: each `ceil(size / chunks)`
    /// long, the last one shorter (fewer chunks when the size runs out).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for `chunks` < 1 or a bad dimension.
    #[lazy_only]
    #[no_twin]
    pub fn f_chunk(&self, chunks: i64, dim: i64) -> Result<Vec<LazyTensor>, LazyError> {
        if let Some(t) = self.eager_value() {
            return t.f_chunk(chunks, dim).map(eager_all).map_err(super::eager_err("chunk"));
        }
        let shape = &self.node().meta.shape;
        if chunks < 1 {
            return Err(arg("chunk", shape, format!("chunk expects `chunks` to be greater than 0, got: {chunks}")));
        }
        let d = shape::wrap_dim(dim, shape.len()).map_err(|r| arg("chunk", shape, r))?;
        let size = (shape[d] + chunks - 1) / chunks;
        self.f_split(size.max(1), dim)
            .map(|parts| if shape[d] == 0 { parts.into_iter().take(1).collect() } else { parts })
    }

    /// Splits into views of `split_size` along `dim` (the last one shorter), as tch's `split`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for `split_size` < 1 (unless the dimension is empty) or a bad
    /// dimension.
    #[lazy_only]
    #[no_twin]
    pub fn f_split(&self, split_size: i64, dim: i64) -> Result<Vec<LazyTensor>, LazyError> {
        if let Some(t) = self.eager_value() {
            return t.f_split(split_size, dim).map(eager_all).map_err(super::eager_err("split"));
        }
        let shape = &self.node().meta.shape;
        let d = shape::wrap_dim(dim, shape.len()).map_err(|r| arg("split", shape, r))?;
        let size = shape[d];
        if split_size < 1 && size > 0 {
            return Err(arg(
                "split",
                shape,
                format!("split_size can only be 0 if dimension size is 0, but got {split_size}"),
            ));
        }
        if size == 0 {
            return Ok(vec![self.f_narrow(d as i64, 0, 0)?]);
        }
        (0..size)
            .step_by(split_size as usize)
            .map(|start| self.f_narrow(d as i64, start, split_size.min(size - start)))
            .collect()
    }

    /// A view broadcast to `other`'s shape, as tch's `expand_as`.
    ///
    /// # Errors
    /// As [`f_expand`](Self::f_expand).
    pub fn f_expand_as(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_expand(other.into_lazy().size(), false)
    }

    /// A view with `other`'s shape, as tch's `view_as`.
    ///
    /// # Errors
    /// As [`f_view`](Self::f_view).
    pub fn f_view_as(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_view(other.into_lazy().size().as_slice())
    }

    /// `self` reshaped to `other`'s shape, as tch's `reshape_as`.
    ///
    /// # Errors
    /// As [`f_reshape`](Self::f_reshape).
    pub fn f_reshape_as(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_reshape(other.into_lazy().size())
    }

    /// `self` in `other`'s kind, as tch's `type_as`.
    ///
    /// # Errors
    /// As [`f_to_kind`](Self::f_to_kind).
    pub fn f_type_as(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.f_to_kind(other.into_lazy().kind())
    }

    /// A view broadcast to `size` (tch's `expand`): `-1` keeps a size, new leading dimensions
    /// may be added, and only dimensions of size 1 grow. The batch stays where it is.
    /// `implicit` only marks the op for libtorch's tracer; the result is the same either way.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for a size `self` cannot be expanded to.
    pub fn f_expand(&self, size: impl IntList, implicit: bool) -> Result<LazyTensor, LazyError> {
        let _ = implicit;
        let n = self.node();
        let m = &n.meta;
        let size = size.as_slice();
        let name = "expand";
        if size.len() < m.shape.len() {
            return Err(shape_err(
                name,
                &m.shape,
                size,
                "the number of sizes must be at least the tensor's dimensions",
            ));
        }
        let offset = size.len() - m.shape.len();
        let mut out = Vec::with_capacity(size.len());
        let mut strides = Vec::with_capacity(size.len());
        for (k, &want) in size.iter().enumerate() {
            if k < offset {
                if want < 0 {
                    return Err(shape_err(
                        name,
                        &m.shape,
                        size,
                        "-1 is not allowed in a leading, non-existing dimension",
                    ));
                }
                out.push(want);
                strides.push(0);
                continue;
            }
            let (have, stride) = (m.shape[k - offset], m.strides[k - offset]);
            match want {
                -1 => {
                    out.push(have);
                    strides.push(stride);
                }
                w if w == have => {
                    out.push(have);
                    strides.push(stride);
                }
                w if have == 1 && w >= 0 => {
                    out.push(w);
                    strides.push(0);
                }
                _ => {
                    return Err(shape_err(
                        name,
                        &m.shape,
                        size,
                        format!("the expanded size ({want}) must match the existing size ({have}) at non-singleton dimension {k}"),
                    ))
                }
            }
        }
        let (flow, mixes) = match m.batch() {
            Some(bd) if out[bd.dim + offset] != m.shape[bd.dim] => {
                (Flow::Opaque, Some("`expand` broadcasts along the batch dimension".to_string()))
            }
            _ => unary_flow(name, n, &out, |d| Some(d + offset), Linearity::Nonlinear)?,
        };
        Ok(Record::new(Expand, inputs_of([n]), out, m.kind, m.device).flow((flow, mixes)).view(strides).finish())
    }

    /// Class indices (`Int64`) as one-hot rows along a new last dimension of `num_classes`
    /// entries, as tch's `one_hot`: `Int64`, no gradient, per sample. `num_classes` of -1
    /// (the largest index plus one) depends on the data: pass the count.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for indices that are not `Int64`; [`LazyError::Unsupported`] for
    /// `num_classes` below 1.
    pub fn f_one_hot(&self, num_classes: i64) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        if m.kind != Kind::Int64 {
            return Err(kind_err("one_hot", m.kind, &m.shape, "one_hot takes Int64 class indices"));
        }
        if num_classes < 1 {
            return Err(LazyError::Unsupported {
                op: "one_hot".into(),
                reason: format!(
                    "num_classes {num_classes}: the count would be read from the data; pass the number of classes"
                ),
            });
        }
        let mut out = m.shape.clone();
        out.push(num_classes);
        let flow = unary_flow("one_hot", n, &out, Some, Linearity::Nonlinear)?;
        Ok(Record::new(OneHot { classes: num_classes }, inputs_of([n]), out, Kind::Int64, m.device)
            .flow(flow)
            .not_differentiable()
            .finish())
    }

    /// tch's `onehot`: [`f_one_hot`](Self::f_one_hot) as `Float` rows.
    ///
    /// # Errors
    /// As [`f_one_hot`](Self::f_one_hot), for indices of any integer kind.
    #[lazy_only]
    pub fn f_onehot(&self, labels: i64) -> Result<LazyTensor, LazyError> {
        self.f_to_kind(Kind::Int64)?.f_one_hot(labels)?.f_to_kind(Kind::Float)
    }

    /// Entries shifted circularly by `shifts[i]` along `dims[i]` (the value flattened and
    /// shifted when `dims` is empty), as tch's `roll`. Rolling the batch dimension, or the
    /// flattened value, moves entries between samples (refused for a split).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension or `shifts` and `dims` of different lengths.
    pub fn f_roll(&self, shifts: impl IntList, dims: impl IntList) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let name = "roll";
        let (shifts, dims) = (shifts.as_slice().to_vec(), dims.as_slice().to_vec());
        // A dimension may come more than once: each shift applies in turn.
        let wrapped = dims
            .iter()
            .map(|&d| shape::wrap_dim(d, m.shape.len()).map_err(|r| arg(name, &m.shape, r)))
            .collect::<Result<Vec<usize>, _>>()?;
        let valid = if dims.is_empty() { shifts.len() == 1 } else { shifts.len() == dims.len() };
        if !valid {
            return Err(arg(name, &m.shape, format!("shifts {shifts:?} and dims {dims:?} do not pair up")));
        }
        let (flow, mut mixes) = same_shape_flow(name, n, Linearity::Nonlinear)?;
        if let Some(bd) = m.batch() {
            if dims.is_empty() || wrapped.contains(&bd.dim) {
                mixes = Some(format!("moves entries between samples (the batch dimension {})", bd.dim));
            }
        }
        Ok(Record::new(Rearrange::Roll { shifts, dims }, inputs_of([n]), m.shape.clone(), m.kind, m.device)
            .flow((flow, mixes))
            .finish())
    }

    /// A copy with the order of the entries along `dims` reversed, as tch's `flip`. Flipping the
    /// batch dimension mixes samples (a micro-batch's rows come from another's).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a dimension out of range or given twice.
    pub fn f_flip(&self, dims: impl IntList) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let name = "flip";
        let dims = dims.as_slice().to_vec();
        let wrapped = shape::wrap_dims(&dims, m.shape.len()).map_err(|r| arg(name, &m.shape, r))?;
        let (flow, mut mixes) = same_shape_flow(name, n, Linearity::Nonlinear)?;
        if let Some(bd) = m.batch().filter(|bd| wrapped.contains(&bd.dim)) {
            mixes = Some(format!("reverses the order of samples along the batch dimension {}", bd.dim));
        }
        Ok(Record::new(Rearrange::Flip(dims), inputs_of([n]), m.shape.clone(), m.kind, m.device)
            .flow((flow, mixes))
            .finish())
    }

    /// A copy repeated `repeats[i]` times along each dimension (tch's `repeat`; extra leading
    /// repeats add dimensions). Repeating along the batch dimension mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for fewer repeats than dimensions or a negative one.
    pub fn f_repeat(&self, repeats: impl IntList) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let repeats = repeats.as_slice().to_vec();
        if repeats.len() < m.shape.len() {
            return Err(arg("repeat", &m.shape, "the number of repeats must be at least the number of dimensions"));
        }
        if repeats.iter().any(|&r| r < 0) {
            return Err(arg("repeat", &m.shape, format!("repeats must be non-negative, got {repeats:?}")));
        }
        let offset = repeats.len() - m.shape.len();
        let out: Vec<i64> =
            repeats.iter().enumerate().map(|(k, &r)| if k < offset { r } else { r * m.shape[k - offset] }).collect();
        let (flow, mixes) = match m.batch() {
            Some(bd) if repeats[bd.dim + offset] != 1 => {
                (Flow::Opaque, Some("`repeat` repeats along the batch dimension".to_string()))
            }
            _ => unary_flow("repeat", n, &out, |d| Some(d + offset), Linearity::Structural)?,
        };
        Ok(Record::new(Rearrange::Repeat(repeats), inputs_of([n]), out, m.kind, m.device).flow((flow, mixes)).finish())
    }

    /// The entries of `index` (1-D, integers) along `dim`, as tch's `index_select`. Selecting
    /// along the batch dimension picks samples: it mixes them.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-integer index, [`LazyError::Shape`] for one that is not 1-D,
    /// [`LazyError::Argument`] for a bad dimension, [`LazyError::Device`].
    pub fn f_index_select(&self, dim: i64, index: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let index = index.into_lazy();
        let (x, i) = (self.node(), index.node());
        let name = "index_select";
        let device = same_device(name, &[x, i])?;
        if !matches!(i.meta.kind, Kind::Int64 | Kind::Int) {
            return Err(kind_err(name, i.meta.kind, &i.meta.shape, "the index must be Int64 or Int"));
        }
        if i.meta.shape.len() > 1 {
            return Err(shape_err(name, &x.meta.shape, &i.meta.shape, "the index must be 1-D"));
        }
        let rank = x.meta.shape.len().max(1);
        let d = shape::wrap_dim(dim, rank).map_err(|r| arg(name, &x.meta.shape, r))?;
        let mut out = x.meta.shape.clone();
        if !out.is_empty() {
            out[d] = i.meta.shape.first().copied().unwrap_or(1);
        }
        let (flow, mixes) = if x.meta.batch().is_some_and(|bd| bd.dim == d) || i.meta.batch().is_some() {
            (Flow::Opaque, Some("`index_select` picks along the batch dimension".to_string()))
        } else {
            unary_flow(name, x, &out, Some, Linearity::Structural)?
        };
        let op = IndexSelect { dim: d as i64 };
        Ok(Record::new(op, inputs_of([x, i]), out, x.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// The entries of `self` along `dim` at `index` (integers, as many dimensions as `self`, no
    /// larger than it outside `dim`), as tch's `gather`: `out[i][j] = self[index[i][j]][j]` for
    /// `dim` 0. The output has the index's shape. Gathering along the batch dimension, or with
    /// an index that is not split with the batch (when `self` is), mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-`Int64` index, [`LazyError::Shape`] for an index of another
    /// rank or larger than `self` outside `dim`, [`LazyError::Argument`] for a bad dimension,
    /// [`LazyError::Device`].
    pub fn f_gather(&self, dim: i64, index: impl IntoLazy, sparse_grad: bool) -> Result<LazyTensor, LazyError> {
        let index = index.into_lazy();
        let (x, i) = (self.node(), index.node());
        let name = "gather";
        let device = same_device(name, &[x, i])?;
        if i.meta.kind != Kind::Int64 {
            return Err(kind_err(name, i.meta.kind, &i.meta.shape, "gather(): Expected dtype int64 for index"));
        }
        let (xs, is) = (&x.meta.shape, &i.meta.shape);
        let rank = xs.len().max(1);
        let d = shape::wrap_dim(dim, rank).map_err(|r| arg(name, xs, r))?;
        if xs.len().max(1) != is.len().max(1) {
            return Err(shape_err(
                name,
                xs,
                is,
                "Index tensor must have the same number of dimensions as input tensor",
            ));
        }
        if xs.iter().zip(is).enumerate().any(|(k, (a, b))| k != d && b > a) {
            return Err(shape_err(name, xs, is, format!("Size does not match at a dimension other than {d}")));
        }
        let mapped: Vec<Option<usize>> =
            [x, i].iter().map(|n| n.meta.batch().map(|bd| bd.dim).filter(|&b| b != d)).collect();
        let (flow, mut mixes) = combine_flows(name, &[x, i], &mapped, is, Linearity::Structural, false)?;
        let along_batch = [x, i].iter().any(|n| n.meta.batch().is_some_and(|bd| bd.dim == d));
        if along_batch || (x.meta.batch().is_some() && i.meta.batch().is_none()) {
            mixes = Some("`gather` picks samples along the batch dimension, or with an index not split with it".into());
        }
        let flow = if mixes.is_some() && matches!(flow, Flow::PerSample(_)) { Flow::Opaque } else { flow };
        let op = Gather { dim: d as i64, sparse_grad };
        Ok(Record::new(op, inputs_of([x, i]), is.clone(), x.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// `self` with `src`'s entries written along `dim` at `index` (integers, as many
    /// dimensions as `self`, no larger than `src`, nor than `self` outside `dim`), as tch's
    /// `scatter`: `out[index[i][j]][j] = src[i][j]` for `dim` 0 (where an index repeats, one
    /// of the writes wins). Per sample when all three are split with the batch along another
    /// dimension; scattering along the batch dimension, or with an operand not split with it,
    /// mixes samples. libtorch's backward takes a `src` of the index's shape only.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a non-`Int64` index or a `src` of another kind,
    /// [`LazyError::Shape`] for operands of other ranks or too small, [`LazyError::Argument`]
    /// for a bad dimension, [`LazyError::Device`].
    pub fn f_scatter(&self, dim: i64, index: impl IntoLazy, src: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.scattered("scatter", dim, &index.into_lazy(), &src.into_lazy(), false)
    }

    /// `self` with `src`'s entries added along `dim` at `index`, as tch's `scatter_add`:
    /// `out[index[i][j]][j] += src[i][j]` for `dim` 0 (repeated indices add up). Split as
    /// [`f_scatter`](Self::f_scatter).
    ///
    /// # Errors
    /// As [`f_scatter`](Self::f_scatter).
    pub fn f_scatter_add(&self, dim: i64, index: impl IntoLazy, src: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        self.scattered("scatter_add", dim, &index.into_lazy(), &src.into_lazy(), true)
    }

    fn scattered(
        &self,
        name: &'static str,
        dim: i64,
        index: &LazyTensor,
        src: &LazyTensor,
        add: bool,
    ) -> Result<LazyTensor, LazyError> {
        let (x, i, s) = (self.node(), index.node(), src.node());
        let device = same_device(name, &[x, i, s])?;
        if i.meta.kind != Kind::Int64 {
            return Err(kind_err(
                name,
                i.meta.kind,
                &i.meta.shape,
                format!("{name}(): Expected dtype int64 for index"),
            ));
        }
        if s.meta.kind != x.meta.kind {
            return Err(kind_err(
                name,
                s.meta.kind,
                &s.meta.shape,
                format!("{name}(): Expected self.dtype ({:?}) to be equal to src.dtype", x.meta.kind),
            ));
        }
        let (xs, is, ss) = (&x.meta.shape, &i.meta.shape, &s.meta.shape);
        let d = shape::wrap_dim(dim, xs.len()).map_err(|r| arg(name, xs, r))?;
        // libtorch checks nothing more for an empty index.
        if shape::numel(is) != 0 {
            if xs.len().max(1) != is.len().max(1) || ss.len().max(1) != is.len().max(1) {
                return Err(shape_err(
                    name,
                    xs,
                    is,
                    "Index tensor must have the same number of dimensions as self and src",
                ));
            }
            let fits = is.iter().enumerate().all(|(k, &n)| (k == d || n <= xs[k]) && n <= ss[k]);
            if !fits {
                return Err(shape_err(
                    name,
                    xs,
                    is,
                    format!("Expected index {is:?} to be no larger than self {xs:?} apart from dimension {d} and no larger than src {ss:?}"),
                ));
            }
        }
        let flow = self.written_flow(name, &[x, i, s], d, "scatters")?;
        let op = Scatter { dim: d as i64, add };
        let inputs = inputs_of([x, i, s]);
        Ok(Record::new(op, inputs, xs.clone(), x.meta.kind, device).flow(flow).finish())
    }

    /// The flow of an op that writes `nodes[2]` into `nodes[0]` (`self`) along `d` at
    /// `nodes[1]`: per sample only when every per-sample operand is split with the batch along
    /// another dimension, and `self` and the values written are.
    fn written_flow(
        &self,
        name: &str,
        nodes: &[&Rc<Node>; 3],
        d: usize,
        verb: &str,
    ) -> Result<(Flow, Option<String>), LazyError> {
        let mapped: Vec<Option<usize>> = nodes.iter().map(|n| n.meta.batch().map(|bd| bd.dim)).collect();
        let (flow, mixes) = combine_flows(name, nodes, &mapped, &self.node().meta.shape, Linearity::Nonlinear, false)?;
        let batched: Vec<bool> = nodes.iter().map(|n| n.meta.batch().is_some()).collect();
        if !batched.contains(&true) {
            return Ok((flow, mixes));
        }
        let reason = if nodes.iter().any(|n| n.meta.batch().is_some_and(|bd| bd.dim == d)) {
            format!("`{name}` {verb} along the batch dimension")
        } else if !(batched[0] && batched[2]) || (verb == "scatters" && !batched[1]) {
            format!(
                "`{name}` {verb} per-sample values with an operand not split with the batch (wrap it with \
                 toma::lazy::lazy(.., dim))"
            )
        } else {
            return Ok((flow, mixes));
        };
        Ok((Flow::Opaque, Some(reason)))
    }

    /// `self` with `source`'s slices added along `dim` at the positions of `index` (1-D,
    /// integers; `source` is `self`'s shape with `index`'s length along `dim`), as tch's
    /// `index_add`. Per sample when `self` and `source` are split with the batch along another
    /// dimension and the index is fixed; along the batch dimension, with a per-sample index,
    /// or with only one of `self` and `source` split, it mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Kind`] for an index not `Int64` or `Int`, or a `source` of another kind;
    /// [`LazyError::Shape`] for an index that is not 1-D or a `source` of another shape;
    /// [`LazyError::Argument`] for a bad dimension; [`LazyError::Device`].
    pub fn f_index_add(&self, dim: i64, index: impl IntoLazy, source: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let (index, source) = (index.into_lazy(), source.into_lazy());
        let (x, i, s) = (self.node(), index.node(), source.node());
        let name = "index_add";
        let device = same_device(name, &[x, i, s])?;
        let (xs, is, ss) = (&x.meta.shape, &i.meta.shape, &s.meta.shape);
        let d = shape::wrap_dim(dim, xs.len()).map_err(|r| arg(name, xs, r))?;
        if is.len() > 1 {
            return Err(shape_err(name, xs, is, "index_add_(): Index is supposed to be a vector"));
        }
        if !matches!(i.meta.kind, Kind::Int64 | Kind::Int) {
            return Err(kind_err(name, i.meta.kind, is, "index_add_(): Expected dtype int32/int64 for index"));
        }
        if s.meta.kind != x.meta.kind {
            return Err(kind_err(
                name,
                s.meta.kind,
                ss,
                format!("index_add_(): self ({:?}) and source must have the same scalar type", x.meta.kind),
            ));
        }
        if d != 0 && d >= ss.len() {
            return Err(arg(name, ss, format!("index_add_(): Indexing dim {d} is out of bounds of the source")));
        }
        let count = shape::numel(is);
        if count != ss.get(d).copied().unwrap_or(1) {
            return Err(shape_err(name, is, ss, "Number of indices should be equal to source.size(dim)"));
        }
        let (mut xr, mut sr) = (xs.clone(), ss.clone());
        if !xr.is_empty() && !sr.is_empty() {
            xr.remove(d);
            sr.remove(d);
        }
        if xr != sr {
            return Err(shape_err(
                name,
                xs,
                ss,
                "source tensor shape must match self tensor shape, excluding the specified dimension",
            ));
        }
        let mut flow = self.written_flow(name, &[x, i, s], d, "adds")?;
        if flow.0 != Flow::Opaque && i.meta.batch().is_some() {
            flow = (Flow::Opaque, Some("`index_add` adds with a per-sample index along its dimension".into()));
        }
        let inputs = inputs_of([x, i, s]);
        Ok(Record::new(IndexAdd { dim: d as i64 }, inputs, xs.clone(), x.meta.kind, device).flow(flow).finish())
    }

    /// `self` with `values` written at advanced indices, or added (`accumulate`), as tch's
    /// `index_put`: `indices[k]` (an integer tensor, or `None` for the whole dimension) indexes
    /// dimension `k`; the given indices broadcast together, and `values` broadcasts to the
    /// indexed result (tch's rules: in place of adjacent indices, first when `None` separates
    /// them). Not in the family traits (its index list has no `TensorOps` form): an inherent
    /// method of `LazyTensor`, taking `&Tensor` or `&LazyTensor` indices.
    ///
    /// Micro-batches: per sample when every index is fixed and none is on the batch dimension,
    /// with `values` split with the batch at its place in the indexed result or broadcast along
    /// it. An index on the batch dimension, a per-sample index, or per-sample values written
    /// into a value not split with the batch mix samples: a split is refused.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for more indices than dimensions, [`LazyError::Kind`] for an
    /// index that is not an integer tensor or `values` of another kind, [`LazyError::Shape`]
    /// for indices that do not broadcast together or `values` that do not broadcast to the
    /// indexed result, [`LazyError::Device`], [`LazyError::Batch`] for fixed `values` with the
    /// batch's size along the batch; [`LazyError::Unsupported`] for a Bool or `Uint8` (mask)
    /// index, whose indexed shape depends on its values.
    #[lazy_only]
    #[no_twin]
    pub fn f_index_put<T: IntoLazy + Clone>(
        &self,
        indices: &[Option<T>],
        values: impl IntoLazy,
        accumulate: bool,
    ) -> Result<LazyTensor, LazyError> {
        let name = "index_put";
        let values = values.into_lazy();
        let given: Vec<(usize, LazyTensor)> =
            indices.iter().enumerate().filter_map(|(k, i)| i.clone().map(|i| (k, i.into_lazy()))).collect();
        let (x, v) = (self.node(), values.node());
        let mut nodes = vec![x, v];
        nodes.extend(given.iter().map(|(_, i)| i.node()));
        let device = same_device(name, &nodes)?;
        let xs = &x.meta.shape;
        if indices.len() > xs.len() {
            return Err(arg(
                name,
                xs,
                format!("too many indices for tensor of dimension {} (got {})", xs.len(), indices.len()),
            ));
        }
        if given.is_empty() {
            // libtorch fails on a list without a tensor (an undefined index).
            return Err(arg(name, xs, "expected at least one index tensor (a list of None indexes nothing)"));
        }
        let mut joint: Vec<i64> = Vec::new();
        for (_, i) in &given {
            let m = &i.node().meta;
            match m.kind {
                Kind::Int64 | Kind::Int => {}
                Kind::Bool | Kind::Uint8 => {
                    return Err(LazyError::Unsupported {
                        op: name.into(),
                        reason: "a mask index (Bool or Uint8) picks as many entries as it has trues, known only \
                                 when it runs; use masked_fill, masked_scatter or where_self"
                            .into(),
                    })
                }
                kind => {
                    return Err(kind_err(
                        name,
                        kind,
                        &m.shape,
                        "tensors used as indices must be long, int, byte or bool tensors",
                    ))
                }
            }
            joint = Vec::from(shape::broadcast(&joint, &m.shape).map_err(|_| {
                shape_err(name, &joint, &m.shape, "shape mismatch: indexing tensors could not be broadcast together")
            })?);
        }
        if v.meta.kind != x.meta.kind {
            return Err(kind_err(
                name,
                v.meta.kind,
                &v.meta.shape,
                format!("Index put requires the source and destination dtypes match ({:?})", x.meta.kind),
            ));
        }
        // The indexed result: the indices' joint shape in place of adjacent ones, first when
        // `None` separates them; the other dimensions in order.
        let at: Vec<usize> = given.iter().map(|(k, _)| *k).collect();
        let adjacent = at.windows(2).all(|w| w[1] == w[0] + 1);
        let rest = |range: std::ops::Range<usize>| range.filter(|d| !at.contains(d)).map(|d| xs[d]);
        let indexed: Vec<i64> = match (at.first(), at.last()) {
            (Some(&first), Some(&last)) if adjacent => {
                xs[..first].iter().copied().chain(joint.iter().copied()).chain(xs[last + 1..].iter().copied()).collect()
            }
            _ => joint.iter().copied().chain(rest(0..xs.len())).collect(),
        };
        if shape::broadcast(&v.meta.shape, &indexed).ok().as_deref() != Some(&indexed[..]) {
            return Err(shape_err(
                name,
                &v.meta.shape,
                &indexed,
                format!(
                    "shape mismatch: value tensor of shape {:?} cannot be broadcast to indexing result of shape \
                     {indexed:?}",
                    v.meta.shape
                ),
            ));
        }
        // Where the batch sits in the indexed result, when `self` is split with it elsewhere.
        let batch_at = |bd: BatchDim| match (at.first(), at.last()) {
            (Some(&first), Some(&last)) if adjacent => {
                if bd.dim < first {
                    bd.dim
                } else {
                    bd.dim - (last + 1 - first) + joint.len()
                }
            }
            _ => joint.len() + (0..bd.dim).filter(|d| !at.contains(d)).count(),
        };
        let refuse = |reason: &str| Ok::<_, LazyError>((Flow::Opaque, Some(format!("`index_put` {reason}"))));
        let lead = indexed.len() - v.meta.shape.len();
        let (flow, indexed_flow) = if given.iter().any(|(_, i)| i.node().meta.batch().is_some()) {
            (
                refuse("picks with a per-sample index, whose entries may reach other samples; use fixed indices")?,
                Flow::Opaque,
            )
        } else if let Some(bd) = x.meta.batch() {
            if at.contains(&bd.dim) {
                (refuse("indexes the batch dimension")?, Flow::Opaque)
            } else {
                let pos = batch_at(bd);
                let full = bd.size * bd.factor;
                let mapped_v = match v.meta.batch() {
                    Some(vb) if vb.dim + lead == pos => Some(bd.dim),
                    Some(_) => None,
                    None => {
                        if full > 1 && pos >= lead && v.meta.shape[pos - lead] == full {
                            return Err(LazyError::Batch {
                                op: name.into(),
                                lhs: xs.to_vec(),
                                rhs: v.meta.shape.to_vec(),
                                reason: format!(
                                    "values are not batched but have the batch's size {full} where the batch lands \
                                     in the indexed result; wrap them with toma::lazy::lazy(.., dim)"
                                ),
                            });
                        }
                        None
                    }
                };
                let mut mapped = vec![Some(bd.dim), mapped_v];
                mapped.extend(given.iter().map(|_| None));
                let flow = combine_flows(name, &nodes, &mapped, xs, Linearity::Nonlinear, false)?;
                let flow = if v.meta.batch().is_some() && mapped_v.is_none() {
                    refuse("writes values whose batch is not where the batch lands in the indexed result")?
                } else {
                    flow
                };
                (flow, Flow::PerSample(BatchDim { dim: pos, ..bd }))
            }
        } else if v.meta.batch().is_some() {
            (refuse("writes per-sample values into a value not split with the batch")?, Flow::Opaque)
        } else {
            let mapped = vec![None; nodes.len()];
            let flow = combine_flows(name, &nodes, &mapped, xs, Linearity::Nonlinear, false)?;
            (flow.clone(), flow.0)
        };
        let indexed = Meta {
            strides: shape::contiguous_strides(&indexed),
            shape: indexed.into(),
            kind: x.meta.kind,
            device,
            flow: if matches!(indexed_flow, Flow::PerSample(_)) { indexed_flow } else { Flow::Fixed },
            requires_grad: x.meta.requires_grad || v.meta.requires_grad,
            alias: false,
            mixes: None,
        };
        let op = IndexPut { given: indices.iter().map(Option::is_some).collect(), accumulate, indexed };
        let inputs = inputs_of(nodes);
        Ok(Record::new(op, inputs, xs.clone(), x.meta.kind, device).flow(flow).finish())
    }

    /// Like [`f_index_put`](Self::f_index_put), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn index_put<T: IntoLazy + Clone>(
        &self,
        indices: &[Option<T>],
        values: impl IntoLazy,
        accumulate: bool,
    ) -> LazyTensor {
        self.f_index_put(indices, values, accumulate).or_panic()
    }

    /// `self` (broadcast with `mask`) with its entries where `mask` (Bool) is true taken from
    /// `source`, in order, as tch's `masked_scatter`. A sample's entries come from wherever the
    /// masks of the samples before it stopped: with anything split with the batch it mixes
    /// samples. `source` must hold at least as many entries as the mask's trues (checked by
    /// libtorch when it runs).
    ///
    /// # Errors
    /// [`LazyError::Kind`] for a mask that is not Bool or a `source` of another kind,
    /// [`LazyError::Shape`] when `self` and `mask` do not broadcast, [`LazyError::Device`].
    pub fn f_masked_scatter(&self, mask: impl IntoLazy, source: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let (mask, source) = (mask.into_lazy(), source.into_lazy());
        let (x, m, s) = (self.node(), mask.node(), source.node());
        let name = "masked_scatter";
        let device = same_device(name, &[x, m, s])?;
        if m.meta.kind != Kind::Bool {
            return Err(kind_err(name, m.meta.kind, &m.meta.shape, "masked_scatter_ only supports boolean masks"));
        }
        if s.meta.kind != x.meta.kind {
            return Err(kind_err(
                name,
                s.meta.kind,
                &s.meta.shape,
                format!("masked_scatter: expected self and source to have same dtypes ({:?})", x.meta.kind),
            ));
        }
        let out = shape::broadcast(&x.meta.shape, &m.meta.shape)
            .map_err(|r| shape_err(name, &x.meta.shape, &m.meta.shape, r))?;
        let nodes = [x, m, s];
        let flow = if nodes.iter().any(|n| n.meta.batch().is_some()) {
            let reason = "`masked_scatter` takes `source`'s entries in order over the whole tensor: a sample's \
                          depend on the masks of the samples before it";
            (Flow::Opaque, Some(reason.to_string()))
        } else {
            let mapped = [None, None, None];
            combine_flows(name, &nodes, &mapped, &out, Linearity::Nonlinear, false)?
        };
        let inputs = inputs_of([x, m, s]);
        Ok(Record::new(MaskedScatter, inputs, out, x.meta.kind, device).flow(flow).finish())
    }

    /// Entry `index` of `dim`, that dimension removed (a view), as tch's `select`; a negative
    /// index counts from the end. Not along the batch dimension.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension or an index outside it.
    pub fn f_select(&self, dim: i64, index: i64) -> Result<LazyTensor, LazyError> {
        let shape = &self.node().meta.shape;
        let d = shape::wrap_dim(dim, shape.len().max(1)).map_err(|r| arg("select", shape, r))?;
        let size = shape
            .get(d)
            .copied()
            .ok_or_else(|| arg("select", shape, "select() cannot be applied to a 0-dim tensor"))?;
        if index < -size || index >= size {
            return Err(arg(
                "select",
                shape,
                format!("index {index} out of range for tensor of size {shape:?} at dimension {d}"),
            ));
        }
        self.f_narrow(d as i64, index, 1)?.f_squeeze_dim(d as i64)
    }

    /// Pads the trailing dimensions with zeros, as tch's `constant_pad_nd`: `pad` holds (before,
    /// after) pairs from the last dimension backwards. [`pad`](Self::pad) in `"constant"` mode.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for an odd or too long `pad`.
    pub fn f_constant_pad_nd(&self, pad: impl IntList) -> Result<LazyTensor, LazyError> {
        self.f_pad(pad, "constant", None)
    }

    /// Pads the trailing dimensions, as tch's `pad`: `pad` holds (before, after) pairs from
    /// the last dimension backwards; `mode` is `"constant"` (with `value`, default 0),
    /// `"reflect"`, `"replicate"` or `"circular"`. Padding the batch dimension mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for an odd or too long `pad`, an unknown mode, or a pad the mode
    /// cannot take (reflect: at least as large as the dimension).
    pub fn f_pad(&self, pad: impl IntList, mode: &str, value: impl Into<Option<f64>>) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let pad = pad.as_slice().to_vec();
        let a = |r: String| arg("pad", &m.shape, r);
        let mode: &'static str = match mode {
            "constant" => "constant",
            "reflect" => "reflect",
            "replicate" => "replicate",
            "circular" => "circular",
            other => {
                return Err(a(format!("unknown padding mode {other:?}: constant, reflect, replicate or circular")))
            }
        };
        let value = value.into();
        if pad.len() % 2 != 0 || pad.len() / 2 > m.shape.len() {
            return Err(a(format!(
                "padding length must be even and at most twice the number of dimensions, got {}",
                pad.len()
            )));
        }
        let padded = pad.len() / 2;
        if mode != "constant" {
            if value.is_some_and(|v| v != 0.0) {
                return Err(a(format!("padding mode \"{mode}\" doesn't take in value argument")));
            }
            if m.shape.len() != padded + 1 && m.shape.len() != padded + 2 {
                return Err(a(format!(
                    "{mode} padding of {padded} dimensions needs a {}-D or {}-D input",
                    padded + 1,
                    padded + 2
                )));
            }
        }
        let mut out = m.shape.clone();
        for k in 0..padded {
            let d = m.shape.len() - 1 - k;
            let (before, after) = (pad[2 * k], pad[2 * k + 1]);
            let size = m.shape[d];
            match mode {
                "reflect" if before >= size || after >= size => {
                    return Err(a(format!(
                        "padding ({before}, {after}) must be below the size {size} of dimension {d}"
                    )))
                }
                "circular" if before > size || after > size => {
                    return Err(a(format!(
                        "padding ({before}, {after}) must be at most the size {size} of dimension {d}"
                    )))
                }
                "replicate" | "reflect" | "circular" if size == 0 => {
                    return Err(a(format!("{mode} padding of an empty dimension {d}")))
                }
                _ => {}
            }
            out[d] = size + before + after;
            if out[d] < 0 {
                return Err(a(format!("the padded size of dimension {d} is negative")));
            }
        }
        let first_padded = m.shape.len() - padded;
        let (flow, mixes) = if m.batch().is_some_and(|bd| bd.dim >= first_padded) {
            (Flow::Opaque, Some("`pad` pads the batch dimension".to_string()))
        } else {
            unary_flow("pad", n, &out, Some, Linearity::Nonlinear)?
        };
        let value = if mode == "constant" { value } else { None };
        Ok(Record::new(Pad { pad, mode, value }, inputs_of([n]), out, m.kind, m.device).flow((flow, mixes)).finish())
    }

    /// The value flattened per leading entry: `view([size[0], -1])`, as tch's `flat_view`.
    ///
    /// # Errors
    /// As [`f_view`](Self::f_view); [`LazyError::Argument`] for a 0-dim tensor.
    #[lazy_only]
    pub fn f_flat_view(&self) -> Result<LazyTensor, LazyError> {
        let s = self.shape();
        let Some(&first) = s.first() else {
            return Err(arg("flat_view", &s, "a 0-dim tensor has no leading dimension"));
        };
        self.f_view([first, -1])
    }

    /// The size of a 1-D value, as tch's `size1`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for another number of dimensions.
    pub fn size1(&self) -> Result<i64, LazyError> {
        match self.shape()[..] {
            [a] => Ok(a),
            ref s => Err(arg("size1", s, "expected 1 dimension")),
        }
    }

    /// The sizes of a 2-D value, as tch's `size2`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for another number of dimensions.
    pub fn size2(&self) -> Result<(i64, i64), LazyError> {
        match self.shape()[..] {
            [a, b] => Ok((a, b)),
            ref s => Err(arg("size2", s, "expected 2 dimensions")),
        }
    }

    /// The sizes of a 3-D value, as tch's `size3`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for another number of dimensions.
    pub fn size3(&self) -> Result<(i64, i64, i64), LazyError> {
        match self.shape()[..] {
            [a, b, c] => Ok((a, b, c)),
            ref s => Err(arg("size3", s, "expected 3 dimensions")),
        }
    }

    /// The sizes of a 4-D value, as tch's `size4`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for another number of dimensions.
    pub fn size4(&self) -> Result<(i64, i64, i64, i64), LazyError> {
        match self.shape()[..] {
            [a, b, c, d] => Ok((a, b, c, d)),
            ref s => Err(arg("size4", s, "expected 4 dimensions")),
        }
    }

    /// The value in another kind (the same value, not a copy, when the kind is the same).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_to_kind(&self, kind: Kind) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let linearity = if shape::is_floating(kind) { Linearity::Structural } else { Linearity::Nonlinear };
        let flow = same_shape_flow("to_kind", n, linearity)?;
        let record = Record::new(ToKind { kind }, inputs_of([n]), m.shape.clone(), kind, m.device).flow(flow);
        // A conversion keeps the layout of a dense input (memory_format = preserve).
        let record = if kind == m.kind {
            record.view(m.strides.clone())
        } else {
            Record { strides: Some(m.strides.clone()), ..record }
        };
        Ok(record.finish())
    }

    /// The value on `device` (tch's `to_device`): the value itself where it already is, as tch
    /// gives back a tensor already on the device. tch's examples move each batch with
    /// `xs.to_device(device)` in the loop, and that line stays as it is once the batch is lazy.
    ///
    /// A lazy value's graph runs on the device of its inputs, so it does not move.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for another device: move the tensors before `lazy(..)`.
    pub fn f_to_device(&self, device: tch::Device) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        if device == m.device {
            let flow = same_shape_flow("to_device", n, Linearity::Structural)?;
            let record =
                Record::new(Alias::ToDevice(device), inputs_of([n]), m.shape.clone(), m.kind, m.device).flow(flow);
            return Ok(record.view(m.strides.clone()).finish());
        }
        Err(arg(
            "to_device",
            &m.shape,
            format!(
                "the value is on {:?}, not {device:?}: a lazy graph runs where its inputs are; move them before lazy(..)",
                m.device
            ),
        ))
    }

    /// The value on `device`, as tch's `to(device)`: [`f_to_device`](Self::f_to_device).
    ///
    /// # Errors
    /// As [`f_to_device`](Self::f_to_device).
    pub fn f_to(&self, device: tch::Device) -> Result<LazyTensor, LazyError> {
        self.f_to_device(device)
    }

    /// The same value, cut from autograd (tch's `detach`): no gradient flows back through it.
    /// A view: it costs nothing.
    ///
    /// # Errors
    /// None in practice.
    pub fn f_detach(&self) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let flow = same_shape_flow("detach", n, Linearity::Structural)?;
        let record = Record::new(Rearrange::Detach, inputs_of([n]), m.shape.clone(), m.kind, m.device).flow(flow);
        Ok(record.view(m.strides.clone()).not_differentiable().finish())
    }

    /// A contiguous value (the same value when it already is).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_contiguous(&self) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let flow = same_shape_flow("contiguous", n, Linearity::Structural)?;
        let record = Record::new(Alias::Contiguous, inputs_of([n]), m.shape.clone(), m.kind, m.device).flow(flow);
        Ok(if shape::is_contiguous(&m.shape, &m.strides) { record.view(m.strides.clone()) } else { record }.finish())
    }

    /// Joins equal-shaped values along a new dimension `dim`, as tch's `Tensor::stack` (a
    /// static method, as in tch). Stacking at or before the batch dimension keeps samples per
    /// sample; a fixed operand expanded to the batch is broadcast per sample, as in `cat`.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes differ, [`LazyError::Argument`] for an empty list or
    /// a bad dimension, [`LazyError::Device`].
    #[lazy_only]
    #[no_twin]
    pub fn f_stack<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T], dim: i64) -> Result<LazyTensor, LazyError> {
        if let Some(values) = super::eager_values(tensors) {
            return super::eager("stack", Tensor::f_stack(&values, dim));
        }
        // libtorch's `stack` is this composite too: each operand unsqueezed (a view), then `cat`.
        let Some(first) = tensors.first() else {
            return Err(arg("stack", &[], "expected a non-empty list of tensors"));
        };
        let s0 = first.borrow().size();
        for t in tensors {
            let s = t.borrow().size();
            if s != s0 {
                return Err(shape_err("stack", &s0, &s, "stack expects each tensor to be equal size"));
            }
        }
        let d = shape::wrap_insert_dim(dim, s0.len()).map_err(|r| arg("stack", &s0, r))?;
        // A fixed operand broadcast to the batch is adopted before it is unsqueezed (`cat` then
        // meets a batched view, not the expand).
        let mut nodes: Vec<Rc<Node>> = tensors.iter().map(|t| t.borrow().node().clone()).collect();
        adopt_batch_broadcasts(&mut nodes, s0.len(), false);
        let parts = nodes
            .into_iter()
            .map(|node| LazyTensor::from_node(node).f_unsqueeze(d as i64))
            .collect::<Result<Vec<_>, _>>()?;
        Self::f_cat(&parts, d as i64)
    }

    /// Concatenates along `dim` (not the batch dimension). A static method, as in tch. A fixed
    /// operand expanded to the batch (a CLS token) is broadcast per sample.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the other sizes differ, [`LazyError::Argument`] for an empty
    /// list or a bad dimension, [`LazyError::Device`].
    #[lazy_only]
    #[no_twin]
    pub fn f_cat<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T], dim: i64) -> Result<LazyTensor, LazyError> {
        if let Some(values) = super::eager_values(tensors) {
            return super::eager("cat", Tensor::f_cat(&values, dim));
        }
        let lazies: Vec<LazyTensor> = tensors.iter().map(|t| t.borrow().clone()).collect();
        let Some(first) = lazies.first() else {
            return Err(arg("cat", &[], "expected a non-empty list of tensors"));
        };
        let mut owned: Vec<Rc<Node>> = lazies.iter().map(|t| t.node().clone()).collect();
        adopt_batch_broadcasts(&mut owned, first.node().meta.shape.len(), false);
        let nodes: Vec<&Rc<Node>> = owned.iter().collect();
        let device = same_device("cat", &nodes)?;
        let s0 = &first.node().meta.shape;
        let d = shape::wrap_dim(dim, s0.len()).map_err(|r| arg("cat", s0, r))?;
        if s0.is_empty() {
            return Err(arg("cat", s0, "zero-dimensional tensors cannot be concatenated"));
        }
        let mut out = s0.clone();
        out[d] = 0;
        let mut kind = first.node().meta.kind;
        for n in &nodes {
            let s = &n.meta.shape;
            if s.len() != s0.len() || s.iter().zip(s0).enumerate().any(|(i, (a, b))| i != d && a != b) {
                return Err(shape_err("cat", s0, s, format!("sizes must match except in dimension {d}")));
            }
            out[d] += s[d];
            kind = shape::promote(kind, n.meta.kind);
        }
        let (flow, mixes) = if nodes.iter().any(|n| n.meta.batch().is_some_and(|bd| bd.dim == d)) {
            (Flow::Opaque, Some("`cat` concatenates along the batch dimension".to_string()))
        } else {
            let mapped: Vec<Option<usize>> = nodes.iter().map(|n| n.meta.batch().map(|bd| bd.dim)).collect();
            combine_flows("cat", &nodes, &mapped, &out, Linearity::Additive, true)?
        };
        let inputs = inputs_of(nodes);
        Ok(Record::new(Cat { dim: d as i64 }, inputs, out, kind, device).flow((flow, mixes)).finish())
    }

    /// Like [`f_chunk`](Self::f_chunk), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn chunk(&self, chunks: i64, dim: i64) -> Vec<LazyTensor> {
        self.f_chunk(chunks, dim).or_panic()
    }

    /// Like [`f_split`](Self::f_split), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn split(&self, split_size: i64, dim: i64) -> Vec<LazyTensor> {
        self.f_split(split_size, dim).or_panic()
    }

    /// Like [`f_cat`](Self::f_cat), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn cat<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T], dim: i64) -> LazyTensor {
        Self::f_cat(tensors, dim).or_panic()
    }

    /// Like [`f_stack`](Self::f_stack), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn stack<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T], dim: i64) -> LazyTensor {
        Self::f_stack(tensors, dim).or_panic()
    }
}

/// Tensors computed at once, in their eager form.
fn eager_all(tensors: Vec<Tensor>) -> Vec<LazyTensor> {
    tensors.into_iter().map(LazyTensor::from_eager).collect()
}
