//! The models that the planner is measured on (tests/gpu.rs on CUDA, tests/lazy_peak.rs on
//! the CPU): an MLP, a CNN and a pre-norm transformer block, each with a classification loss,
//! built lazily (`*_lazy`) or eagerly (`*_eager`) on the device of their `VarStore`.

use tch::nn;
use tch::Tensor;
use toma::lazy::{lazy, LazyTensor};

pub struct Mlp {
    pub l1: nn::Linear,
    pub l2: nn::Linear,
    pub l3: nn::Linear,
}

pub fn mlp(vs: &nn::VarStore) -> Mlp {
    let (r, c) = (vs.root(), Default::default);
    Mlp {
        l1: nn::linear(&r / "l1", 1024, 4096, c()),
        l2: nn::linear(&r / "l2", 4096, 4096, c()),
        l3: nn::linear(&r / "l3", 4096, 10, c()),
    }
}

pub fn mlp_lazy(m: &Mlp, x: &Tensor, y: &Tensor) -> LazyTensor {
    let (x, y) = lazy((x, y), 0);
    x.apply(&m.l1).relu().apply(&m.l2).relu().apply(&m.l3).log_softmax(-1, None).nll_loss(&y)
}

pub fn mlp_eager(m: &Mlp, x: &Tensor, y: &Tensor) -> Tensor {
    x.apply(&m.l1).relu().apply(&m.l2).relu().apply(&m.l3).log_softmax(-1, None).nll_loss(y)
}

pub struct Cnn {
    pub c1: nn::Conv2D,
    pub c2: nn::Conv2D,
    pub fc: nn::Linear,
}

pub fn cnn(vs: &nn::VarStore) -> Cnn {
    let r = vs.root();
    let same = nn::ConvConfig { padding: 1, ..Default::default() };
    Cnn {
        c1: nn::conv2d(&r / "c1", 3, 32, 3, same),
        c2: nn::conv2d(&r / "c2", 32, 64, 3, same),
        fc: nn::linear(&r / "fc", 64 * 16 * 16, 10, Default::default()),
    }
}

/// Input `[N, 3, 64, 64]`.
pub fn cnn_lazy(m: &Cnn, x: &Tensor, y: &Tensor) -> LazyTensor {
    let (x, y) = lazy((x, y), 0);
    let h = x.apply(&m.c1).relu().max_pool2d([2, 2], [], [0, 0], [1, 1], false);
    let h = h.apply(&m.c2).relu().max_pool2d([2, 2], [], [0, 0], [1, 1], false);
    h.flatten(1, -1).apply(&m.fc).log_softmax(-1, None).nll_loss(&y)
}

pub fn cnn_eager(m: &Cnn, x: &Tensor, y: &Tensor) -> Tensor {
    let h = x.apply(&m.c1).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
    let h = h.apply(&m.c2).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
    h.flatten(1, -1).apply(&m.fc).log_softmax(-1, None).nll_loss(y)
}

/// A pre-norm transformer block over `[N, T, D]`, mean-pooled into a classifier.
pub struct Block {
    pub ln1: nn::LayerNorm,
    pub qkv: nn::Linear,
    pub proj: nn::Linear,
    pub ln2: nn::LayerNorm,
    pub fc1: nn::Linear,
    pub fc2: nn::Linear,
    pub head: nn::Linear,
}

pub const D: i64 = 512;
pub const T: i64 = 128;
pub const HEADS: i64 = 8;

pub fn block(vs: &nn::VarStore) -> Block {
    let (r, c) = (vs.root(), Default::default);
    Block {
        ln1: nn::layer_norm(&r / "ln1", vec![D], Default::default()),
        qkv: nn::linear(&r / "qkv", D, 3 * D, c()),
        proj: nn::linear(&r / "proj", D, D, c()),
        ln2: nn::layer_norm(&r / "ln2", vec![D], Default::default()),
        fc1: nn::linear(&r / "fc1", D, 4 * D, c()),
        fc2: nn::linear(&r / "fc2", 4 * D, D, c()),
        head: nn::linear(&r / "head", D, 10, c()),
    }
}

pub fn block_lazy(m: &Block, x: &Tensor, y: &Tensor) -> LazyTensor {
    let (x, y) = lazy((x, y), 0);
    let n = x.size()[0];
    let qkv = x.apply(&m.ln1).apply(&m.qkv);
    let heads = |i: i64| qkv.narrow(2, i * D, D).reshape([n, T, HEADS, D / HEADS]).transpose(1, 2);
    let (q, k, v) = (heads(0), heads(1), heads(2));
    let scores = q.matmul(&k.transpose(-2, -1)).mul_scalar(1.0 / ((D / HEADS) as f64).sqrt());
    let attended = scores.softmax(-1, None).matmul(&v).transpose(1, 2).reshape([n, T, D]);
    let h = &x + &attended.apply(&m.proj);
    let h = &h + &h.apply(&m.ln2).apply(&m.fc1).gelu("none").apply(&m.fc2);
    h.mean_dim([1], false, None).apply(&m.head).cross_entropy_for_logits(&y)
}

/// The eager twin of [`block_lazy`].
pub fn block_eager(m: &Block, x: &Tensor, y: &Tensor) -> Tensor {
    let n = x.size()[0];
    let qkv = x.apply(&m.ln1).apply(&m.qkv);
    let heads = |i: i64| qkv.narrow(2, i * D, D).reshape([n, T, HEADS, D / HEADS]).transpose(1, 2);
    let (q, k, v) = (heads(0), heads(1), heads(2));
    let scores = q.matmul(&k.transpose(-2, -1)) * (1.0 / ((D / HEADS) as f64).sqrt());
    let attended = scores.softmax(-1, None).matmul(&v).transpose(1, 2).reshape([n, T, D]);
    let h = x + attended.apply(&m.proj);
    let h = &h + h.apply(&m.ln2).apply(&m.fc1).gelu("none").apply(&m.fc2);
    h.mean_dim([1i64].as_slice(), false, None).apply(&m.head).cross_entropy_for_logits(y)
}

/// A small residual network the planner rules were not fitted on: a 3-channel stem, batch
/// norm, a strided convolution, a 1×1 projection, average pooling. Input `[N, 3, 64, 64]`.
pub struct Res {
    pub stem: nn::Conv2D,
    pub bn1: nn::BatchNorm,
    pub down: nn::Conv2D,
    pub bn2: nn::BatchNorm,
    pub conv: nn::Conv2D,
    pub proj: nn::Conv2D,
    pub fc: nn::Linear,
}

pub fn res(vs: &nn::VarStore) -> Res {
    let r = vs.root();
    let conv = |name: &str, cin, cout, k, stride, padding| {
        nn::conv2d(&r / name, cin, cout, k, nn::ConvConfig { stride, padding, ..Default::default() })
    };
    Res {
        stem: conv("stem", 3, 16, 3, 1, 1),
        bn1: nn::batch_norm2d(&r / "bn1", 16, Default::default()),
        down: conv("down", 16, 32, 3, 2, 1),
        bn2: nn::batch_norm2d(&r / "bn2", 32, Default::default()),
        conv: conv("conv", 32, 32, 3, 1, 1),
        proj: conv("proj", 32, 64, 1, 1, 0),
        fc: nn::linear(&r / "fc", 64, 10, Default::default()),
    }
}

pub fn res_lazy(m: &Res, x: &Tensor, y: &Tensor) -> LazyTensor {
    let (x, y) = lazy((x, y), 0);
    let h = x.apply(&m.stem).apply_t(&m.bn1, true).relu();
    let h = h.apply(&m.down).apply_t(&m.bn2, true).relu();
    let h = (&h + &h.apply(&m.conv).relu()).apply(&m.proj).relu();
    h.adaptive_avg_pool2d([1, 1]).flatten(1, -1).apply(&m.fc).log_softmax(-1, None).nll_loss(&y)
}

pub fn res_eager(m: &Res, x: &Tensor, y: &Tensor) -> Tensor {
    let h = x.apply(&m.stem).apply_t(&m.bn1, true).relu();
    let h = h.apply(&m.down).apply_t(&m.bn2, true).relu();
    let h = (&h + h.apply(&m.conv).relu()).apply(&m.proj).relu();
    h.adaptive_avg_pool2d([1, 1]).flatten(1, -1).apply(&m.fc).log_softmax(-1, None).nll_loss(y)
}

/// A sequence model built from the ops added with the op families (conv1d, silu, causal
/// scaled-dot-product attention, baddbmm, softplus). Input `[N, C, L]`.
pub struct Seq {
    pub conv: nn::Conv1D,
    pub qkv: nn::Linear,
    /// `[L, L]`, added to every sample's gram matrix by `baddbmm`.
    pub bias: Tensor,
    pub head: nn::Linear,
    pub d: i64,
    pub heads: i64,
}

pub fn seq(vs: &nn::VarStore, channels: i64, d: i64, heads: i64, len: i64) -> Seq {
    let r = vs.root();
    Seq {
        conv: nn::conv1d(&r / "conv", channels, d, 3, nn::ConvConfig { padding: 1, ..Default::default() }),
        qkv: nn::linear(&r / "qkv", d, 3 * d, Default::default()),
        bias: r.var("bias", &[len, len], nn::Init::Const(0.1)),
        head: nn::linear(&r / "head", len, 10, Default::default()),
        d,
        heads,
    }
}

pub fn seq_lazy(m: &Seq, x: &Tensor, y: &Tensor) -> LazyTensor {
    let (x, y) = lazy((x, y), 0);
    let (n, l) = (x.size()[0], x.size()[2]);
    let h = x.apply(&m.conv).silu().transpose(1, 2);
    let qkv = h.apply(&m.qkv);
    let heads = |i: i64| qkv.narrow(2, i * m.d, m.d).reshape([n, l, m.heads, m.d / m.heads]).transpose(1, 2);
    let a = LazyTensor::scaled_dot_product_attention(
        &heads(0),
        &heads(1),
        &heads(2),
        None::<&LazyTensor>,
        0.0,
        true,
        None,
        false,
    );
    let h = a.transpose(1, 2).reshape([n, l, m.d]);
    let gram = LazyTensor::fixed(&m.bias).baddbmm(&h, &h.transpose(1, 2), 1.0, 1.0 / (m.d as f64).sqrt());
    gram.softplus().mean_dim([2], false, None).apply(&m.head).cross_entropy_for_logits(&y)
}

/// The eager twin of [`seq_lazy`].
pub fn seq_eager(m: &Seq, x: &Tensor, y: &Tensor) -> Tensor {
    let (n, l) = (x.size()[0], x.size()[2]);
    let h = x.apply(&m.conv).silu().transpose(1, 2);
    let qkv = h.apply(&m.qkv);
    let heads = |i: i64| qkv.narrow(2, i * m.d, m.d).reshape([n, l, m.heads, m.d / m.heads]).transpose(1, 2);
    let a =
        Tensor::scaled_dot_product_attention(&heads(0), &heads(1), &heads(2), None::<&Tensor>, 0.0, true, None, false);
    let h = a.transpose(1, 2).reshape([n, l, m.d]);
    let gram = m.bias.baddbmm(&h, &h.transpose(1, 2), 1.0, 1.0 / (m.d as f64).sqrt());
    // The log-softmax in the logits' kind, as `toma::lazy` takes it (tch's takes it in Float).
    gram.softplus().mean_dim([2i64].as_slice(), false, None).apply(&m.head).log_softmax(-1, None).nll_loss(y)
}
