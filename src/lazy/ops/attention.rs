//! Attention: `scaled_dot_product_attention`, with an optional mask, a causal mask, dropout
//! and grouped-query heads, as tch (and PyTorch) take them.
//!
//! Its memory depends on the kernel libtorch picks. On the CPU a fused ("flash") kernel runs
//! for 4-D inputs of equal leading sizes without dropout: it keeps its inputs, its output and
//! one log-sum-exp per query row. Anything else runs the composite ("math") path, which
//! materializes the `[.., L, S]` attention weights: scaled copies of query and key and the
//! softmax are kept for the backward, the scores before the softmax live while it runs.
//! CUDA's fused kernels keep what the CPU one keeps.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{combine_flows, same_device, Linearity, Record};
use super::{arg, floating, kind_err, same_kind, shape_err};
use crate::lazy::error::LazyError;
use crate::lazy::error::OrPanic;
use crate::lazy::facts::OpFacts;
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{Flow, KernelCall, Meta, Node, Operation, Run, RunCx};
use crate::lazy::shape;
use crate::lazy::size::Elements;
use crate::lazy::LazyTensor;

/// Scaled dot-product attention. Operands: query, key, value, optional mask. `fused`:
/// libtorch's fused kernel runs (decided by the shapes, when recorded).
pub(crate) struct Attention {
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
    fused: bool,
}

impl Attention {
    fn fused(&self) -> bool {
        self.fused
    }
}

/// Whether libtorch's fused CPU kernel takes these shapes: 4-D, one batch size, as many key
/// as value heads (a divisor of the query's with grouped-query heads), no empty sequence, no
/// dropout.
fn fused(q: &[i64], k: &[i64], v: &[i64], dropout_p: f64, enable_gqa: bool) -> bool {
    let four = [q, k, v].iter().all(|s| s.len() == 4 && s[2] > 0);
    four && dropout_p == 0.0
        && k[0] == q[0]
        && v[0] == q[0]
        && k[1] == v[1]
        && (k[1] == q[1] || (enable_gqa && k[1] > 0 && q[1] % k[1] == 0))
}

/// The elements of a tensor shaped like `out` with its last size `last`.
fn like(out: &Meta, last: i64) -> Elements {
    let (a, c) = out.elements().parts();
    let ev = out.shape.last().copied().unwrap_or(1).max(1) as u64;
    Elements::line(a / ev * last.max(0) as u64, c / ev * last.max(0) as u64)
}

impl Operation for Attention {
    fn name(&self) -> &'static str {
        "scaled_dot_product_attention"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        if self.fused() {
            // One log-sum-exp per query row, in the accumulation kind.
            let kind = if meta.kind == Kind::Double { Kind::Double } else { Kind::Float };
            calls.push(KernelCall::Keeps { elements: like(meta, 1), kind });
            let (q, k) = (&inputs[0].meta.shape, &inputs[1].meta.shape);
            let (l, s, ev) = (q[q.len() - 2], k[k.len() - 2], meta.shape[meta.shape.len() - 1]);
            calls.push(KernelCall::FusedAttention { l, s, ev, kind: meta.kind });
            return;
        }
        // Scaled query and key, and the attention weights after the softmax (and dropout,
        // whose mask is as large).
        let s = inputs[1].meta.shape[inputs[1].meta.shape.len() - 2];
        let (wa, wc) = like(meta, s).parts();
        let Attention { dropout_p, .. } = self;
        let copies = if *dropout_p > 0.0 { 3 } else { 1 };
        let ((qa, qc), (ka, kc)) = (inputs[0].meta.elements().parts(), inputs[1].meta.elements().parts());
        calls.push(KernelCall::Keeps {
            elements: Elements::line(qa + ka + copies * wa, qc + kc + copies * wc),
            kind: meta.kind,
        });
        // The scores before the softmax live beside it. In the backward, the weights'
        // gradient and the softmax's gradient live together: what the backward takes above
        // what it keeps is the larger of the input gradients and `2 w` (measured: within 11%).
        let (ga, gc) = inputs[..3].iter().fold((0u64, 0u64), |(a, c), n| {
            let (na, nc) = n.meta.elements().parts();
            (a + na, c + nc)
        });
        calls.push(KernelCall::Temporaries {
            forward: Elements::line(wa, wc),
            backward: Elements::line((2 * wa).saturating_sub(ga), (2 * wc).saturating_sub(gc)),
        });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| {
                // The fused kernels keep query, key, value and the mask; the composite path keeps the
                // value (its scaled query and key are extras).
                self.fused() || i == 2
            })
            .saves_output(self.fused())
    }
}

impl Run for Attention {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let Attention { dropout_p, is_causal, scale, enable_gqa, .. } = self;
        let (query, key, value, mask) = (ins[0], ins[1], ins[2], ins.get(3).copied());
        Tensor::f_scaled_dot_product_attention(query, key, value, mask, *dropout_p, *is_causal, *scale, *enable_gqa)
    }
}

impl LazyTensor {
    /// Attention as tch's `Tensor::scaled_dot_product_attention` (a static method, as in
    /// tch): `softmax(query keyᵀ · scale + mask) value`, with `query` `[.., L, E]`, `key`
    /// `[.., S, E]`, `value` `[.., S, Ev]` and an optional `attn_mask` (boolean, or additive
    /// in the query's kind) broadcasting to `[.., L, S]`. `is_causal` masks out keys after each
    /// query; `scale` defaults to `1 / sqrt(E)`; `enable_gqa` lets key and value have fewer
    /// heads (dimension -3) than the query.
    ///
    /// The batch may be any leading dimension, or the query's rows (`L`) without
    /// `is_causal`. Along the keys (`S`) it mixes samples. Each micro-batch draws its own
    /// dropout.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not fit, [`LazyError::Kind`] for different or
    /// non-floating kinds, [`LazyError::Argument`] for a `dropout_p` outside `[0, 1]` or for a
    /// mask together with `is_causal` where libtorch's composite path runs (it refuses that),
    /// [`LazyError::Device`].
    #[allow(clippy::too_many_arguments)]
    pub fn f_scaled_dot_product_attention(
        query: impl IntoLazy,
        key: impl IntoLazy,
        value: impl IntoLazy,
        attn_mask: Option<impl IntoLazy>,
        dropout_p: f64,
        is_causal: bool,
        scale: impl Into<Option<f64>>,
        enable_gqa: bool,
    ) -> Result<LazyTensor, LazyError> {
        let name = "scaled_dot_product_attention";
        let (mut q, mut k, mut v) = (query.into_lazy(), key.into_lazy(), value.into_lazy());
        let rank = q.node().meta.shape.len();
        let leading = |t: &LazyTensor| t.node().meta.batch().is_none_or(|bd| bd.dim + 2 < rank);
        if !enable_gqa && [&q, &k, &v].iter().all(|t| rank >= 3 && t.node().meta.shape.len() == rank && leading(t)) {
            // Learned queries (or keys) expanded to the batch meet it here: per sample, as in
            // `+`, `cat` and `matmul`.
            let mut qkv = [q.node().clone(), k.node().clone(), v.node().clone()];
            super::layout::adopt_batch_broadcasts(&mut qkv, rank, true);
            let [nq, nk, nv] = qkv;
            (q, k, v) = (LazyTensor::from_node(nq), LazyTensor::from_node(nk), LazyTensor::from_node(nv));
        }
        let mask = attn_mask.map(IntoLazy::into_lazy);
        let mut nodes = vec![q.node(), k.node(), v.node()];
        if let Some(m) = &mask {
            nodes.push(m.node());
        }
        let device = same_device(name, &nodes)?;
        let (sq, sk, sv) = (&q.node().meta.shape, &k.node().meta.shape, &v.node().meta.shape);
        if sq.len() < 2 || sk.len() < 2 || sv.len() < 2 {
            return Err(shape_err(name, sq, sk, "query, key and value need at least 2 dims"));
        }
        if !(0.0..=1.0).contains(&dropout_p) {
            return Err(arg(name, sq, format!("dropout_p must be in [0, 1], got {dropout_p}")));
        }
        // The composite path refuses both masks at once; the fused kernel applies both.
        if is_causal && mask.is_some() && !fused(sq, sk, sv, dropout_p, enable_gqa) {
            return Err(arg(name, sq, "an explicit attn_mask cannot be combined with is_causal here"));
        }
        let (l, e) = (sq[sq.len() - 2], sq[sq.len() - 1]);
        let (s, ek) = (sk[sk.len() - 2], sk[sk.len() - 1]);
        if ek != e || sv[sv.len() - 2] != s {
            return Err(shape_err(name, sq, sk, "expected query [.., L, E], key [.., S, E] and value [.., S, Ev]"));
        }
        // Leading sizes broadcast; with grouped-query heads, key and value's heads divide the
        // query's.
        let (mut lk, lv) = (sk[..sk.len() - 2].to_vec(), &sv[..sv.len() - 2]);
        if lk.as_slice() != lv {
            return Err(shape_err(name, sk, sv, "key and value must have the same leading sizes"));
        }
        let lq = &sq[..sq.len() - 2];
        if enable_gqa && (lq.is_empty() || lk.is_empty()) {
            return Err(shape_err(name, sq, sk, "grouped-query heads (dimension -3) need at least 3 dims"));
        }
        if enable_gqa {
            let (hq, hk) = (lq[lq.len() - 1], lk[lk.len() - 1]);
            if hk == 0 || hq % hk != 0 {
                return Err(shape_err(name, sq, sk, format!("{hq} query heads are not a multiple of {hk} key heads")));
            }
            *lk.last_mut().expect("non-empty") = hq;
        }
        let lead = shape::broadcast(lq, &lk).map_err(|r| shape_err(name, sq, sk, r))?;
        let mut out = lead.clone();
        out.extend([l, sv[sv.len() - 1]]);
        let mut scores = lead;
        scores.extend([l, s]);
        for n in [q.node(), k.node()] {
            floating(name, n)?;
        }
        same_kind(name, q.node(), k.node())?;
        same_kind(name, q.node(), v.node())?;
        if let Some(m) = &mask {
            let mm = &m.node().meta;
            if !matches!(mm.kind, Kind::Bool | Kind::Float) && mm.kind != q.node().meta.kind {
                return Err(kind_err(
                    name,
                    mm.kind,
                    &mm.shape,
                    format!("the mask must be Bool, Float or {:?} like the query", q.node().meta.kind),
                ));
            }
            match shape::broadcast(&mm.shape, &scores) {
                Ok(b) if b == scores => {}
                _ => return Err(shape_err(name, &mm.shape, &scores, format!("the mask must broadcast to {scores:?}"))),
            }
        }
        // Where each operand's batch lands in the output: leading dimensions right-aligned,
        // the query's rows; the keys' dimension (and E) is contracted.
        let rank = out.len();
        let mapped: Vec<Option<usize>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let bd = n.meta.batch()?;
                let r = n.meta.shape.len();
                let at = bd.dim + rank - r;
                match i {
                    _ if bd.dim + 2 < r => Some(at),
                    0 | 3 if bd.dim + 2 == r => Some(at),
                    2 if bd.dim + 1 == r => Some(at),
                    _ => None,
                }
            })
            .collect();
        let (flow, mut mixes) = combine_flows(name, &nodes, &mapped, &out, Linearity::Nonlinear, false)?;
        // A fixed operand with the batch's size where the batch is (leading dimensions, or the
        // mask's rows) is per-sample data that was not wrapped. Keys' rows are not the queries'.
        if let Flow::PerSample(bd) = flow {
            let full = bd.size * bd.factor;
            for (i, n) in nodes.iter().enumerate().filter(|(_, n)| n.meta.flow == Flow::Fixed) {
                let r = n.meta.shape.len();
                let at = bd.dim as i64 - (rank - r) as i64;
                let rows = i == 0 || i == 3;
                let aligned = at >= 0 && ((at as usize) + 2 < r || (rows && at as usize + 2 == r));
                if full > 1 && aligned && n.meta.shape[at as usize] == full {
                    return Err(LazyError::Batch {
                        op: name.into(),
                        lhs: sq.to_vec(),
                        rhs: n.meta.shape.to_vec(),
                        reason: super::NOT_WRAPPED.into(),
                    });
                }
            }
        }
        if is_causal && mapped[0] == Some(rank - 2) {
            mixes = Some("with is_causal masks by position along the batch dimension".into());
        }
        let fused = fused(sq, sk, sv, dropout_p, enable_gqa);
        let op = Attention { dropout_p, is_causal, scale: scale.into(), enable_gqa, fused };
        let inputs = inputs_of(nodes);
        let record = Record::new(op, inputs, out, q.node().meta.kind, device).flow((flow, mixes));
        // The fused kernels write `[B, L, H, Ev]` and hand it back transposed: the heads put
        // back together (`transpose(1, 2).reshape(..)`) are a view, not a copy.
        let strides = fused.then(|| {
            let s = &record.shape;
            let (h, l, ev) = (s[1], s[2], s[3]);
            crate::dims::Dims::from([l * h * ev, ev, h * ev, 1])
        });
        Ok(Record { strides, ..record }.finish())
    }
}

impl LazyTensor {
    /// Like [`f_scaled_dot_product_attention`](Self::f_scaled_dot_product_attention), panicking
    /// with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    pub fn scaled_dot_product_attention(
        query: impl IntoLazy,
        key: impl IntoLazy,
        value: impl IntoLazy,
        attn_mask: Option<impl IntoLazy>,
        dropout_p: f64,
        is_causal: bool,
        scale: impl Into<Option<f64>>,
        enable_gqa: bool,
    ) -> LazyTensor {
        Self::f_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            .or_panic()
    }
}
