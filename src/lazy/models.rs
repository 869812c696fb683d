//! Transformer blocks written once over [`TensorOps`]: a GPT-2-style decoder block (pre-norm,
//! causal self-attention) and a BERT-style encoder block (post-norm, optional padding mask).
//! Each runs eagerly on tensors and lazily, planned and micro-batched, from one definition.
//!
//! ```
//! use tch::{nn, Device, Kind, Tensor};
//! use toma::lazy::{lazy, models::{BlockConfig, DecoderBlock}, Options};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let block = DecoderBlock::new(&vs.root() / "h" / 0, BlockConfig::gpt2(64, 4));
//! let x = Tensor::randn([8, 16, 64], (Kind::Float, Device::Cpu));
//! let eager = block.forward_t(&x, false);
//! let planned = block.forward_t(&lazy(&x, 0), false).to_tensor_with(&Options::new().micro_batch(3))?;
//! assert!(planned.allclose(&eager, 1e-5, 1e-5, false));
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```
//!
//! Variable names follow GPT-2's (`ln_1`, `attn.c_attn`, `attn.c_proj`, `ln_2`, `mlp.c_fc`,
//! `mlp.c_proj`). The layers are `nn::Linear` (weights `[out, in]`); checkpoints that store
//! GPT-2's `Conv1D` weights (`[in, out]`) load after a transpose.

use tch::{nn, Kind, Tensor};

use super::nn::Layer;
use super::nn::{both_modules, LazyModuleT};
use super::tensor_ops::TensorOps;

/// The sizes of a block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockConfig {
    /// Width of the residual stream.
    pub d_model: i64,
    /// Attention heads (they divide `d_model`).
    pub n_head: i64,
    /// Width of the MLP's hidden layer.
    pub d_ff: i64,
    /// Dropout after the attention weights, the attention output and the MLP (training only).
    pub dropout: f64,
    /// Layer norm's epsilon.
    pub eps: f64,
}

impl BlockConfig {
    /// GPT-2's choices: an MLP four times as wide, dropout 0.1, epsilon 1e-5.
    ///
    /// # Panics
    /// When `n_head` does not divide `d_model`.
    #[track_caller]
    pub fn gpt2(d_model: i64, n_head: i64) -> BlockConfig {
        assert!(
            n_head > 0 && d_model % n_head == 0,
            "toma::lazy::models: n_head {n_head} must divide d_model {d_model}"
        );
        BlockConfig { d_model, n_head, d_ff: 4 * d_model, dropout: 0.1, eps: 1e-5 }
    }
}

/// Multi-head self-attention with one input projection (`c_attn`) and an output one (`c_proj`).
#[derive(Debug)]
struct SelfAttention {
    c_attn: nn::Linear,
    c_proj: nn::Linear,
    n_head: i64,
    dropout: f64,
}

impl SelfAttention {
    fn new(p: nn::Path, c: &BlockConfig) -> Self {
        SelfAttention {
            c_attn: nn::linear(&p / "c_attn", c.d_model, 3 * c.d_model, Default::default()),
            c_proj: nn::linear(&p / "c_proj", c.d_model, c.d_model, Default::default()),
            n_head: c.n_head,
            dropout: c.dropout,
        }
    }

    /// `mask`: true where a query must not see a key, broadcast to `[N, heads, T, T]`.
    fn forward<T: TensorOps>(&self, x: &T, mask: Option<&T>, train: bool) -> T
    where
        nn::Linear: Layer<T>,
    {
        let size = x.size();
        let (b, t, c) = (size[0], size[1], size[2]);
        let hs = c / self.n_head;
        let qkv = x.apply(&self.c_attn).chunk(3, 2);
        let heads = |h: &T| h.view([b, t, self.n_head, hs]).transpose(1, 2);
        let (q, k, v) = (heads(&qkv[0]), heads(&qkv[1]), heads(&qkv[2]));
        let scores = q.matmul(&k.transpose(-2, -1)).mul_scalar(1.0 / (hs as f64).sqrt());
        let scores = match mask {
            Some(mask) => scores.masked_fill(mask, f64::NEG_INFINITY),
            None => scores,
        };
        let weights = scores.softmax(-1, None).dropout(self.dropout, train);
        let y = weights.matmul(&v).transpose(1, 2).contiguous().view([b, t, c]);
        y.apply(&self.c_proj).dropout(self.dropout, train)
    }
}

/// The position-wise MLP: `c_fc`, GELU, `c_proj`.
#[derive(Debug)]
struct Mlp {
    c_fc: nn::Linear,
    c_proj: nn::Linear,
    dropout: f64,
}

impl Mlp {
    fn new(p: nn::Path, c: &BlockConfig) -> Self {
        Mlp {
            c_fc: nn::linear(&p / "c_fc", c.d_model, c.d_ff, Default::default()),
            c_proj: nn::linear(&p / "c_proj", c.d_ff, c.d_model, Default::default()),
            dropout: c.dropout,
        }
    }

    fn forward<T: TensorOps>(&self, x: &T, approximate: &str, train: bool) -> T
    where
        nn::Linear: Layer<T>,
    {
        x.apply(&self.c_fc).gelu(approximate).apply(&self.c_proj).dropout(self.dropout, train)
    }
}

fn layer_norm(p: nn::Path, c: &BlockConfig) -> nn::LayerNorm {
    nn::layer_norm(p, vec![c.d_model], nn::LayerNormConfig { eps: c.eps, ..Default::default() })
}

/// A GPT-2 decoder block: `x + attn(ln_1(x))` with a causal mask, then `x + mlp(ln_2(x))` (GELU
/// with the tanh approximation, as GPT-2).
#[derive(Debug)]
pub struct DecoderBlock {
    ln_1: nn::LayerNorm,
    attn: SelfAttention,
    ln_2: nn::LayerNorm,
    mlp: Mlp,
}

impl DecoderBlock {
    /// A block under `p` (GPT-2 keeps its blocks under `h.0`, `h.1`, ..).
    pub fn new(p: nn::Path, config: BlockConfig) -> Self {
        DecoderBlock {
            ln_1: layer_norm(&p / "ln_1", &config),
            attn: SelfAttention::new(&p / "attn", &config),
            ln_2: layer_norm(&p / "ln_2", &config),
            mlp: Mlp::new(&p / "mlp", &config),
        }
    }

    /// The block on `xs` (`[N, T, d_model]`), written once for tensors and lazy tensors.
    pub fn forward_t<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Linear: Layer<T>,
        nn::LayerNorm: Layer<T>,
    {
        let t = xs.size()[1];
        // Built once per call and shared by every sample: a constant of the graph.
        let future = T::constant(&Tensor::ones([t, t], (Kind::Bool, xs.device())).triu(1));
        let h = xs.add(&self.attn.forward(&xs.apply(&self.ln_1), Some(&future), train));
        h.add(&self.mlp.forward(&h.apply(&self.ln_2), "tanh", train))
    }
}

/// A BERT-style encoder block: `ln_1(x + attn(x))`, then `ln_2(x + mlp(x))` (exact GELU), with an
/// optional padding mask.
#[derive(Debug)]
pub struct EncoderBlock {
    attn: SelfAttention,
    ln_1: nn::LayerNorm,
    mlp: Mlp,
    ln_2: nn::LayerNorm,
}

impl EncoderBlock {
    /// A block under `p`, with the decoder block's variable names.
    pub fn new(p: nn::Path, config: BlockConfig) -> Self {
        EncoderBlock {
            attn: SelfAttention::new(&p / "attn", &config),
            ln_1: layer_norm(&p / "ln_1", &config),
            mlp: Mlp::new(&p / "mlp", &config),
            ln_2: layer_norm(&p / "ln_2", &config),
        }
    }

    /// The block on `xs` (`[N, T, d_model]`). `padding`, when given, is `[N, 1, 1, T]` and true at
    /// the keys to ignore (per sample: wrap it with the inputs, `lazy((&x, &padding), 0)`).
    pub fn forward_t<T: TensorOps>(&self, xs: &T, padding: Option<&T>, train: bool) -> T
    where
        nn::Linear: Layer<T>,
        nn::LayerNorm: Layer<T>,
    {
        let h = xs.add(&self.attn.forward(xs, padding, train)).apply(&self.ln_1);
        h.add(&self.mlp.forward(&h, "none", train)).apply(&self.ln_2)
    }
}

both_modules!(DecoderBlock);

/// Without a padding mask: tch's `ModuleT` (`x.apply_t(&block, train)`), so that blocks stack
/// in a `toma::lazy::nn::seq_t()`.
impl nn::ModuleT for EncoderBlock {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        EncoderBlock::forward_t(self, xs, None, train)
    }
}

/// Without a padding mask, recorded; a shape that does not fit panics with the recording
/// error, as the eager block panics.
impl LazyModuleT for EncoderBlock {
    fn lazy_forward_t(&self, xs: &super::LazyTensor, train: bool) -> Result<super::LazyTensor, super::LazyError> {
        Ok(EncoderBlock::forward_t(self, xs, None, train))
    }
}
