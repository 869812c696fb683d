//! Products: `matmul`, `linear`, `baddbmm`, and the embedding lookup (a one-hot product).

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{combine_flows, same_device, Linearity, Record};
use super::{floating, kind_err, requires, same_kind, shape_err};
use crate::lazy::error::LazyError;
use crate::lazy::graph::{Flow, KernelCall, Meta, Node, Operation, RunCx};
use crate::lazy::shape;
use crate::lazy::LazyTensor;

/// Each of two factors is kept for the other's gradient.
fn factors_saved(i: usize, a: usize, b: usize, inputs: &[Rc<Node>]) -> bool {
    (i == a && requires(inputs, b)) || (i == b && requires(inputs, a))
}

/// A matrix product with `torch.matmul`'s rules, or `bmm` (`[B, n, m] @ [B, m, p]`).
/// Operands: a, b.
pub(crate) struct Matmul {
    batched_only: bool,
}

impl Operation for Matmul {
    fn name(&self) -> &'static str {
        if self.batched_only {
            "bmm"
        } else {
            "matmul"
        }
    }

    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        if self.batched_only {
            ins[0].f_bmm(ins[1])
        } else {
            ins[0].f_matmul(ins[1])
        }
    }

    fn saves_input(&self, i: usize, inputs: &[Rc<Node>]) -> bool {
        factors_saved(i, 0, 1, inputs)
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if self.batched_only {
            return;
        }
        // A broadcast operand is expanded into a real copy before the batched product.
        let (oa, oc) = meta.numel_parts();
        let mut total = (0, 0);
        for input in inputs {
            let m = &input.meta;
            if m.shape.len() >= 2 && meta.shape.len() > 2 {
                let own = shape::numel(&m.shape[m.shape.len().saturating_sub(2)..]) as u64;
                let out_batch = shape::numel(&meta.shape[..meta.shape.len() - 2]).max(1) as u64;
                let own_batch = shape::numel(&m.shape[..m.shape.len() - 2]).max(1) as u64;
                if own_batch < out_batch {
                    let scale = own.max(1);
                    let rows = shape::numel(&meta.shape[meta.shape.len() - 2..]).max(1) as u64;
                    total.0 += oa / rows * scale;
                    total.1 += oc / rows * scale;
                }
            }
        }
        if total != (0, 0) {
            calls.push(KernelCall::Temporaries { forward: total, backward: total });
        }
    }
}

/// `x @ weightᵀ + bias`. Operands: x, weight, optional bias.
pub(crate) struct Linear;

impl Operation for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_linear(ins[1], ins.get(2).copied())
    }

    fn saves_input(&self, i: usize, inputs: &[Rc<Node>]) -> bool {
        factors_saved(i, 0, 1, inputs)
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // The bias gradient: the output gradient summed over every dimension but the last.
        if requires(inputs, 2) && meta.requires_grad && !meta.shape.is_empty() {
            let mask = shape::dims_mask(0..meta.shape.len() - 1);
            calls.push(KernelCall::Reduction { of: meta, mask, backward: true });
        }
    }
}

/// `beta * input + alpha * (batch1 @ batch2)`. Operands: input, batch1, batch2.
pub(crate) struct Baddbmm {
    beta: f64,
    alpha: f64,
}

impl Operation for Baddbmm {
    fn name(&self) -> &'static str {
        "baddbmm"
    }

    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (input, batch1, batch2) = (ins[0], ins[1], ins[2]);
        input.f_baddbmm(batch1, batch2, self.beta, self.alpha)
    }

    fn saves_input(&self, i: usize, inputs: &[Rc<Node>]) -> bool {
        factors_saved(i, 1, 2, inputs)
    }

    fn grad_aliases(&self, i: usize, inputs: &[Rc<Node>], meta: &Meta) -> bool {
        // autograd hands `input` the output's gradient itself when it is not scaled or summed.
        i == 0 && self.beta == 1.0 && inputs[0].meta.shape == meta.shape
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // A broadcast input's gradient: the output gradient summed to its shape.
        if requires(inputs, 0) && inputs[0].meta.shape != meta.shape {
            let mask = shape::broadcast_mask(&inputs[0].meta.shape, &meta.shape);
            calls.push(KernelCall::Reduction { of: meta, mask, backward: true });
        }
    }
}

/// Rows of a weight picked by indices (a one-hot product). Operands: weight, indices.
pub(crate) struct Embedding {
    padding_idx: i64,
    scale_grad_by_freq: bool,
}

impl Operation for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (weight, indices) = (ins[0], ins[1]);
        Tensor::f_embedding(weight, indices, self.padding_idx, self.scale_grad_by_freq, false)
    }

    fn saves_input(&self, i: usize, _inputs: &[Rc<Node>]) -> bool {
        // The indices, to scatter the gradient back.
        i == 1
    }
}

#[toma_macros::tensor_methods(
    MatrixOps,
    "Matrix products and linear layers (a family of [`TensorOps`](crate::lazy::TensorOps))."
)]
impl LazyTensor {
    /// Matrix product with `torch.matmul`'s rules: 1-D operands, batched and broadcast
    /// leading dimensions.
    ///
    /// A batch dimension among the leading dimensions, the rows of `self` or the columns of
    /// `other` stays per-sample. One contracted over (both operands per-sample along the
    /// contracted dimension, as in `xᵀ y`) is a sum over the batch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes cannot be multiplied, [`LazyError::Kind`] for
    /// different kinds, [`LazyError::Device`].
    pub fn f_matmul(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let other = other.into_lazy();
        let (a, b) = (&self.node, &other.node);
        let name = "matmul";
        let device = same_device(name, &[a, b])?;
        let (sa, sb) = (&a.meta.shape, &b.meta.shape);
        let out = shape::matmul(sa, sb).map_err(|r| shape_err(name, sa, sb, r))?;
        same_kind(name, a, b)?;
        let lhs_nd = sa.len().max(2);
        let rhs_nd = sb.len().max(2);
        let out_batch_nd = lhs_nd.max(rhs_nd) - 2;
        // Where each operand's batch dimension lands: Ok(Some(dim)), or Err(()) when contracted.
        let role = |n: &Node, lhs: bool| -> Option<Result<usize, ()>> {
            let bd = n.meta.batch()?;
            let nd = n.meta.shape.len();
            Some(if nd == 1 {
                Err(())
            } else if bd.dim < nd - 2 {
                Ok(out_batch_nd - (nd - 2) + bd.dim)
            } else if lhs {
                if bd.dim == nd - 2 {
                    Ok(out_batch_nd)
                } else {
                    Err(())
                }
            } else if bd.dim == nd - 1 {
                Ok(out.len() - 1)
            } else {
                Err(())
            })
        };
        let roles = [role(a, true), role(b, false)];
        let contracted: Vec<usize> = (0..2).filter(|&i| matches!(roles[i], Some(Err(())))).collect();
        let per_sample = (0..2).filter(|&i| roles[i].is_some()).count();
        let inputs = [a, b];
        let flow = if !contracted.is_empty() && contracted.len() == per_sample {
            // xᵀ y over the batch: a sum of per-sample products.
            if per_sample == 1 {
                let i = contracted[0];
                return Err(LazyError::Batch {
                    op: name.into(),
                    lhs: sa.clone(),
                    rhs: sb.clone(),
                    reason: format!(
                        "operand {} contracts over its batch dimension against a fixed operand; wrap both with lazy(..)",
                        i + 1
                    ),
                });
            }
            let (ba, bb) = (a.meta.batch().expect("per-sample"), b.meta.batch().expect("per-sample"));
            if ba.size != bb.size || ba.factor != bb.factor {
                return Err(LazyError::Batch {
                    op: name.into(),
                    lhs: sa.clone(),
                    rhs: sb.clone(),
                    reason: format!("batch sizes {} and {} differ", ba.size * ba.factor, bb.size * bb.factor),
                });
            }
            if [a, b].iter().any(|n| matches!(n.meta.flow, Flow::Sum | Flow::Max | Flow::Opaque)) {
                (Flow::Opaque, Some("`matmul` contracts the batch of a value already reduced over it".to_string()))
            } else {
                (Flow::Sum, None)
            }
        } else {
            let mapped: Vec<Option<usize>> = roles.iter().map(|r| r.and_then(|r| r.ok())).collect();
            let flow = combine_flows(name, &inputs, &mapped, &out, Linearity::Scaling { divisor: None }, false)?;
            // A fixed operand broadcast against the batch along the leading dimensions.
            if let Flow::PerSample(bd) = flow.0 {
                if bd.dim < out_batch_nd {
                    for n in inputs.iter().filter(|n| n.meta.flow == Flow::Fixed) {
                        let nd = n.meta.shape.len().max(2) - 2;
                        let at = bd.dim as i64 - (out_batch_nd as i64 - nd as i64);
                        if at >= 0 && n.meta.shape[at as usize] == bd.size * bd.factor && bd.size * bd.factor > 1 {
                            return Err(LazyError::Batch {
                                op: name.into(),
                                lhs: sa.clone(),
                                rhs: sb.clone(),
                                reason: "a fixed operand has the batch's size along the batch dimension; wrap it with lazy(..)".into(),
                            });
                        }
                    }
                }
            }
            flow
        };
        Ok(Record::new(Matmul { batched_only: false }, vec![a.clone(), b.clone()], out, a.meta.kind, device)
            .flow(flow)
            .finish())
    }

    /// Batched matrix product, as tch's `bmm`: `self` `[B, n, m]` by `other` `[B, m, p]`. The
    /// batch may be `B`, the rows of `self` or the columns of `other`; contracting over it
    /// mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for other shapes, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_bmm(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let other = other.into_lazy();
        let (a, b) = (&self.node, &other.node);
        let name = "bmm";
        let device = same_device(name, &[a, b])?;
        let (sa, sb) = (&a.meta.shape, &b.meta.shape);
        if sa.len() != 3 || sb.len() != 3 || sa[0] != sb[0] || sa[2] != sb[1] {
            return Err(shape_err(name, sa, sb, "expected [B, n, m] and [B, m, p]"));
        }
        same_kind(name, a, b)?;
        let out = vec![sa[0], sa[1], sb[2]];
        let mapped = [
            a.meta.batch().and_then(|bd| (bd.dim < 2).then_some(bd.dim)),
            b.meta.batch().and_then(|bd| (bd.dim != 1).then_some(bd.dim)),
        ];
        let along_b = mapped.iter().flatten().any(|&d| d == 0);
        let flow = combine_flows(name, &[a, b], &mapped, &out, Linearity::Nonlinear, along_b)?;
        Ok(Record::new(Matmul { batched_only: true }, vec![a.clone(), b.clone()], out, a.meta.kind, device)
            .flow(flow)
            .finish())
    }

    /// `self @ weightᵀ + bias`, as tch's `linear`: `self` is `[.., in]`, `weight` `[out, in]`,
    /// `bias` `[out]`.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_linear(
        &self,
        #[fixed] weight: impl IntoLazy,
        #[fixed] bias: Option<impl IntoLazy>,
    ) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let x = &self.node;
        let name = "linear";
        let mut nodes = vec![x, &w.node];
        if let Some(b) = &b {
            nodes.push(&b.node);
        }
        let device = same_device(name, &nodes)?;
        let (sx, sw) = (&x.meta.shape, &w.node.meta.shape);
        if sx.is_empty() || sw.len() != 2 || sx[sx.len() - 1] != sw[1] {
            return Err(shape_err(name, sx, sw, "expected input [.., in] and weight [out, in]"));
        }
        if let Some(b) = &b {
            if b.node.meta.shape != [sw[0]] {
                return Err(shape_err(name, sw, &b.node.meta.shape, format!("bias must have shape [{}]", sw[0])));
            }
            same_kind(name, x, &b.node)?;
        }
        same_kind(name, x, &w.node)?;
        floating(name, x)?;
        let mut out = sx.clone();
        *out.last_mut().expect("non-empty") = sw[0];
        let mapped: Vec<Option<usize>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| n.meta.batch().filter(|bd| i == 0 && bd.dim + 1 < sx.len()).map(|bd| bd.dim))
            .collect();
        let flow = combine_flows(name, &nodes, &mapped, &out, Linearity::Nonlinear, false)?;
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(Linear, inputs, out, x.meta.kind, device).flow(flow).finish())
    }

    /// `beta * self + alpha * (batch1 @ batch2)`, as tch's `baddbmm`: `batch1` is `[B, n, m]`,
    /// `batch2` `[B, m, p]`, and `self` broadcasts to `[B, n, p]`. The batch may be the
    /// product's `B`, the rows of `batch1` or the columns of `batch2`; contracting over it mixes
    /// samples.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not fit, [`LazyError::Kind`] for different or
    /// non-floating kinds, [`LazyError::Device`].
    pub fn f_baddbmm(
        &self,
        batch1: impl IntoLazy,
        batch2: impl IntoLazy,
        beta: f64,
        alpha: f64,
    ) -> Result<LazyTensor, LazyError> {
        let (b1, b2) = (batch1.into_lazy(), batch2.into_lazy());
        let (x, m1, m2) = (&self.node, &b1.node, &b2.node);
        let name = "baddbmm";
        let nodes = [x, m1, m2];
        let device = same_device(name, &nodes)?;
        let (s1, s2) = (&m1.meta.shape, &m2.meta.shape);
        if s1.len() != 3 || s2.len() != 3 {
            return Err(shape_err(name, s1, s2, "batch1 and batch2 must be 3-D"));
        }
        if s1[0] != s2[0] || s1[2] != s2[1] {
            return Err(shape_err(name, s1, s2, "expected batch1 [B, n, m] and batch2 [B, m, p]"));
        }
        let out = vec![s1[0], s1[1], s2[2]];
        match shape::broadcast(&x.meta.shape, &out) {
            Ok(b) if b == out => {}
            _ => return Err(shape_err(name, &x.meta.shape, &out, format!("the input must broadcast to {out:?}"))),
        }
        floating(name, m1)?;
        same_kind(name, m1, m2)?;
        same_kind(name, m1, x)?;
        let offset = 3 - x.meta.shape.len();
        let mapped = [
            x.meta.batch().map(|bd| bd.dim + offset),
            m1.meta.batch().and_then(|bd| (bd.dim < 2).then_some(bd.dim)),
            m2.meta.batch().and_then(|bd| (bd.dim != 1).then_some(bd.dim)),
        ];
        // A fixed operand the size of the batch is checked where the batch is the product's B.
        let along_b = mapped.iter().flatten().any(|&d| d == 0);
        let flow = combine_flows(name, &nodes, &mapped, &out, Linearity::Nonlinear, along_b)?;
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(Baddbmm { beta, alpha }, inputs, out, m1.meta.kind, device).flow(flow).finish())
    }

    /// Rows of `weight` (`[V, D]`) picked by the integer `indices` (`self`'s role in tch is the
    /// weight: this is `Tensor::embedding(weight, indices, ..)`); the output is
    /// `indices.size() + [D]`. A static method, as in tch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for a weight that is not 2-D, [`LazyError::Kind`] for non-integer
    /// indices, [`LazyError::Device`]; [`LazyError::Unsupported`] for `sparse` gradients (not
    /// planned: use dense ones).
    #[lazy_only]
    #[no_twin]
    pub fn f_embedding(
        #[fixed] weight: impl IntoLazy,
        indices: impl IntoLazy,
        padding_idx: i64,
        scale_grad_by_freq: bool,
        sparse: bool,
    ) -> Result<LazyTensor, LazyError> {
        let name = "embedding";
        if sparse {
            return Err(LazyError::Unsupported {
                op: name.into(),
                reason: "sparse gradients are not planned; use dense ones (sparse = false)".into(),
            });
        }
        let (w, i) = (weight.into_lazy(), indices.into_lazy());
        let (wn, inn) = (&w.node, &i.node);
        let device = same_device(name, &[wn, inn])?;
        if wn.meta.shape.len() != 2 {
            return Err(shape_err(name, &wn.meta.shape, &inn.meta.shape, "the weight must be 2-D"));
        }
        if !matches!(inn.meta.kind, Kind::Int64 | Kind::Int) {
            return Err(kind_err(name, inn.meta.kind, &inn.meta.shape, "indices must be Int64 or Int"));
        }
        let mut out = inn.meta.shape.clone();
        out.push(wn.meta.shape[1]);
        let mapped = [None, inn.meta.batch().map(|bd| bd.dim)];
        let (flow, mut mixes) = combine_flows(name, &[wn, inn], &mapped, &out, Linearity::Nonlinear, false)?;
        if scale_grad_by_freq && inn.meta.batch().is_some() {
            mixes = Some("with scale_grad_by_freq scales gradients by counts over the batch".into());
        }
        let op = Embedding { padding_idx, scale_grad_by_freq };
        Ok(Record::new(op, vec![wn.clone(), inn.clone()], out, wn.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// Like [`f_embedding`](Self::f_embedding), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn embedding(
        weight: impl IntoLazy,
        indices: impl IntoLazy,
        padding_idx: i64,
        scale_grad_by_freq: bool,
        sparse: bool,
    ) -> LazyTensor {
        Self::f_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse).unwrap_or_else(|e| panic!("{e}"))
    }
}
