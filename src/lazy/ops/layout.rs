//! Ops that change how values are laid out, not what they are: views (no copy), copies into
//! a new shape or kind, slices, and concatenation.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::{combine_flows, same_device, unary_flow, Linearity, Record};
use super::{arg, panicking, same_shape_flow, shape_err, Rules, RunCx};
use crate::lazy::error::LazyError;
use crate::lazy::graph::{BatchDim, Flow, Meta, Node};
use crate::lazy::shape;
use crate::lazy::LazyTensor;

pub(crate) enum Layout {
    /// A view to the node's shape (no copy).
    View,
    /// A reshape that copies (the input's strides allow no view).
    Reshape,
    Transpose {
        dim0: i64,
        dim1: i64,
    },
    Permute {
        dims: Vec<i64>,
    },
    Unsqueeze {
        dim: i64,
    },
    Squeeze {
        dims: Vec<i64>,
    },
    Narrow {
        dim: i64,
        start: i64,
        length: i64,
    },
    ToKind {
        kind: Kind,
    },
    Contiguous,
    /// Operands: the tensors, in order.
    Cat {
        dim: i64,
    },
}

impl Rules for Layout {
    fn name(&self) -> &'static str {
        match self {
            Layout::View => "view",
            Layout::Reshape => "reshape",
            Layout::Transpose { .. } => "transpose",
            Layout::Permute { .. } => "permute",
            Layout::Unsqueeze { .. } => "unsqueeze",
            Layout::Squeeze { .. } => "squeeze",
            Layout::Narrow { .. } => "narrow",
            Layout::ToKind { .. } => "to_kind",
            Layout::Contiguous => "contiguous",
            Layout::Cat { .. } => "cat",
        }
    }

    fn run(&self, ins: &[&Tensor], cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let x = ins[0];
        match self {
            Layout::View => x.f_view(cx.meta.shape_at(cx.b).as_slice()),
            // Recorded as a copy (the full batch's strides allowed no view), so later views were
            // recorded against a contiguous result: a micro-batch's strides can let libtorch
            // return a strided view instead, which those views cannot take.
            Layout::Reshape => x.f_reshape(cx.meta.shape_at(cx.b).as_slice())?.f_contiguous(),
            Layout::Transpose { dim0, dim1 } => x.f_transpose(*dim0, *dim1),
            Layout::Permute { dims } => x.f_permute(dims.as_slice()),
            Layout::Unsqueeze { dim } => x.f_unsqueeze(*dim),
            Layout::Squeeze { dims } => x.f_squeeze_dims(dims.as_slice()),
            Layout::Narrow { dim, start, length } => x.f_narrow(*dim, *start, *length),
            Layout::ToKind { kind } => x.f_to_kind(*kind),
            Layout::Contiguous => x.f_contiguous(),
            Layout::Cat { dim } => Tensor::f_cat(ins, *dim),
        }
    }

    fn grad_aliases(&self, _i: usize, inputs: &[Rc<Node>], _meta: &Meta) -> bool {
        match self {
            Layout::View
            | Layout::Transpose { .. }
            | Layout::Permute { .. }
            | Layout::Unsqueeze { .. }
            | Layout::Squeeze { .. }
            | Layout::Cat { .. }
            | Layout::Contiguous => true,
            Layout::ToKind { kind } => inputs[0].meta.kind == *kind,
            Layout::Reshape | Layout::Narrow { .. } => false,
        }
    }

    fn adds_fixed(&self) -> bool {
        // Concatenating sums adds them (each along its own range).
        matches!(self, Layout::Cat { .. })
    }
}

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
        let n = &self.node;
        let m = &n.meta;
        let total = shape::numel(&m.shape);
        let new_shape = shape::infer_size(shape, total).map_err(|r| shape_err(name, &m.shape, shape, r))?;
        let flow = self.view_flow(&new_shape);
        match shape::view_strides(&m.shape, &m.strides, &new_shape) {
            Some(strides) => Ok(Record::new(Layout::View, vec![n.clone()], new_shape, m.kind, m.device)
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
            None => Ok(Record::new(Layout::Reshape, vec![n.clone()], new_shape, m.kind, m.device).flow(flow).finish()),
        }
    }

    /// A view with another shape (one size may be -1). Where the batch dimension goes is
    /// followed: merged with the dimensions after it (`[N, T, C] -> [N * T, C]`) or split
    /// again; a view that moves samples across it cannot be split.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match or the strides allow no view.
    pub fn f_view(&self, shape: impl AsRef<[i64]>) -> Result<LazyTensor, LazyError> {
        self.f_reshape_impl("view", shape.as_ref(), true)
    }

    /// Like [`f_view`](Self::f_view), copying when the strides allow no view.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match.
    pub fn f_reshape(&self, shape: impl AsRef<[i64]>) -> Result<LazyTensor, LazyError> {
        self.f_reshape_impl("reshape", shape.as_ref(), false)
    }

    /// Flattens dimensions `start_dim..=end_dim` into one.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for bad dimensions.
    pub fn f_flatten(&self, start_dim: i64, end_dim: i64) -> Result<LazyTensor, LazyError> {
        let s = &self.node.meta.shape;
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
        let n = &self.node;
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
        Ok(Record::new(Layout::Transpose { dim0, dim1 }, vec![n.clone()], s, m.kind, m.device)
            .flow(flow)
            .view(st)
            .finish())
    }

    /// Reorders the dimensions (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] unless `dims` is a permutation of the dimensions.
    pub fn f_permute(&self, dims: impl AsRef<[i64]>) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let dims = dims.as_ref().to_vec();
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
        Ok(Record::new(Layout::Permute { dims }, vec![n.clone()], s, m.kind, m.device).flow(flow).view(st).finish())
    }

    /// Inserts a dimension of size 1 at `dim` (a view).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension.
    pub fn f_unsqueeze(&self, dim: i64) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let u = shape::wrap_insert_dim(dim, m.shape.len()).map_err(|r| arg("unsqueeze", &m.shape, r))?;
        let (mut s, mut st) = (m.shape.clone(), m.strides.clone());
        let stride = if u < s.len() { s[u] * st[u] } else { 1 };
        s.insert(u, 1);
        st.insert(u, stride);
        let flow = unary_flow("unsqueeze", n, &s, |d| Some(if u <= d { d + 1 } else { d }), Linearity::Structural)?;
        Ok(Record::new(Layout::Unsqueeze { dim }, vec![n.clone()], s, m.kind, m.device).flow(flow).view(st).finish())
    }

    fn f_squeeze_impl(&self, dims: Vec<usize>) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
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
        Ok(Record::new(Layout::Squeeze { dims }, vec![n.clone()], s, m.kind, m.device).flow(flow).view(st).finish())
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

    /// `length` entries of `dim` from `start` (a view). Not along the batch dimension.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a range outside the dimension.
    pub fn f_narrow(&self, dim: i64, start: i64, length: i64) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
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
        let op = Layout::Narrow { dim: d as i64, start, length };
        Ok(Record::new(op, vec![n.clone()], s, m.kind, m.device).flow((flow, mixes)).view(m.strides.clone()).finish())
    }

    /// Splits into `chunks` views along `dim`, as tch's `chunk`: each `ceil(size / chunks)`
    /// long, the last one shorter (fewer chunks when the size runs out).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for `chunks` < 1 or a bad dimension.
    pub fn f_chunk(&self, chunks: i64, dim: i64) -> Result<Vec<LazyTensor>, LazyError> {
        let shape = &self.node.meta.shape;
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
    pub fn f_split(&self, split_size: i64, dim: i64) -> Result<Vec<LazyTensor>, LazyError> {
        let shape = &self.node.meta.shape;
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

    /// The value in another kind (the same value, not a copy, when the kind is the same).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_to_kind(&self, kind: Kind) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let linearity = if shape::is_floating(kind) { Linearity::Structural } else { Linearity::Nonlinear };
        let flow = same_shape_flow("to_kind", n, linearity)?;
        let record = Record::new(Layout::ToKind { kind }, vec![n.clone()], m.shape.clone(), kind, m.device).flow(flow);
        // A conversion keeps the layout of a dense input (memory_format = preserve).
        let record = if kind == m.kind {
            record.view(m.strides.clone())
        } else {
            Record { strides: Some(m.strides.clone()), ..record }
        };
        Ok(record.finish())
    }

    /// A contiguous value (the same value when it already is).
    ///
    /// # Errors
    /// None in practice.
    pub fn f_contiguous(&self) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
        let m = &n.meta;
        let flow = same_shape_flow("contiguous", n, Linearity::Structural)?;
        let record = Record::new(Layout::Contiguous, vec![n.clone()], m.shape.clone(), m.kind, m.device).flow(flow);
        Ok(if shape::is_contiguous(&m.shape, &m.strides) { record.view(m.strides.clone()) } else { record }.finish())
    }

    /// Concatenates along `dim` (not the batch dimension). A static method, as in tch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the other sizes differ, [`LazyError::Argument`] for an empty
    /// list or a bad dimension, [`LazyError::Device`].
    pub fn f_cat<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T], dim: i64) -> Result<LazyTensor, LazyError> {
        let lazies: Vec<LazyTensor> = tensors.iter().map(|t| t.borrow().clone()).collect();
        let Some(first) = lazies.first() else {
            return Err(arg("cat", &[], "expected a non-empty list of tensors"));
        };
        let nodes: Vec<&Rc<Node>> = lazies.iter().map(|t| &t.node).collect();
        let device = same_device("cat", &nodes)?;
        let s0 = &first.node.meta.shape;
        let d = shape::wrap_dim(dim, s0.len()).map_err(|r| arg("cat", s0, r))?;
        if s0.is_empty() {
            return Err(arg("cat", s0, "zero-dimensional tensors cannot be concatenated"));
        }
        let mut out = s0.clone();
        out[d] = 0;
        let mut kind = first.node.meta.kind;
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
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(Layout::Cat { dim: d as i64 }, inputs, out, kind, device).flow((flow, mixes)).finish())
    }
}

panicking! {
    view => f_view(shape: impl AsRef<[i64]>);
    reshape => f_reshape(shape: impl AsRef<[i64]>);
    flatten => f_flatten(start_dim: i64, end_dim: i64);
    transpose => f_transpose(dim0: i64, dim1: i64);
    permute => f_permute(dims: impl AsRef<[i64]>);
    unsqueeze => f_unsqueeze(dim: i64);
    squeeze => f_squeeze();
    squeeze_dim => f_squeeze_dim(dim: i64);
    narrow => f_narrow(dim: i64, start: i64, length: i64);
    to_kind => f_to_kind(kind: Kind);
    contiguous => f_contiguous();
}

impl LazyTensor {
    /// Like [`f_chunk`](Self::f_chunk), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn chunk(&self, chunks: i64, dim: i64) -> Vec<LazyTensor> {
        self.f_chunk(chunks, dim).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`f_split`](Self::f_split), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn split(&self, split_size: i64, dim: i64) -> Vec<LazyTensor> {
        self.f_split(split_size, dim).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`f_cat`](Self::f_cat), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn cat<T: std::borrow::Borrow<LazyTensor>>(tensors: &[T], dim: i64) -> LazyTensor {
        Self::f_cat(tensors, dim).unwrap_or_else(|e| panic!("{e}"))
    }
}
