//! Micro-batched backward gives the full batch's gradients: an MLP, a small CNN and a
//! transformer block, with mean- and sum-reduced losses, batch sizes that are not powers of
//! two, and budgets small enough to force several micro-batches. Everything runs in f64, so
//! the gradients agree to 1e-5 relative (in practice to ~1e-13).
#![cfg(feature = "tch")]

use std::collections::BTreeMap;

use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};
use toma::lazy::{lazy, LazyTensor, Mode, Options};

const CPU: Device = Device::Cpu;

/// The trainable variables by name, with their gradients zeroed.
pub(crate) fn zero_grads(vs: &nn::VarStore) {
    for (_, mut v) in vs.variables() {
        v.zero_grad();
    }
}

/// The gradients of the trainable variables (batch norm's running statistics have none).
pub(crate) fn grads(vs: &nn::VarStore) -> BTreeMap<String, Tensor> {
    vs.variables().into_iter().filter(|(_, v)| v.requires_grad()).map(|(name, v)| (name, v.grad().copy())).collect()
}

/// Largest elementwise difference relative to the largest reference magnitude. Gradients
/// that are zero in exact arithmetic (a key bias under softmax) are round-off noise of about
/// 1e-17: a floor of 1e-7 under the reference magnitude keeps them from counting as relative
/// errors.
pub(crate) fn relative_error(a: &Tensor, b: &Tensor) -> f64 {
    let diff = (a - b).abs().max().double_value(&[]);
    let scale = b.abs().max().double_value(&[]).max(1e-7);
    diff / scale
}

fn assert_grads_match(eager: &BTreeMap<String, Tensor>, lazy: &BTreeMap<String, Tensor>, what: &str) {
    assert_eq!(eager.keys().collect::<Vec<_>>(), lazy.keys().collect::<Vec<_>>());
    for (name, e) in eager {
        let l = &lazy[name];
        assert!(e.defined() && l.defined(), "{what}: {name} has no gradient");
        let err = relative_error(l, e);
        assert!(err <= 1e-5, "{what}: gradient of {name} differs by {err:e} relative");
    }
}

/// Runs `eager` (a plain tch loss) and `lazy` (the same model recorded lazily) and compares
/// loss values and gradients; `options` force micro-batches. Returns the plan's micro-batch.
fn check(
    vs: &nn::VarStore,
    what: &str,
    options: &Options,
    eager: impl Fn() -> Tensor,
    lazy_loss: impl Fn() -> LazyTensor,
) -> usize {
    zero_grads(vs);
    let eager_loss = eager();
    let eager_value = eager_loss.double_value(&[]);
    eager_loss.backward();
    let eager_grads = grads(vs);

    zero_grads(vs);
    let loss = lazy_loss();
    let plan = loss.plan(Mode::Backward, options).unwrap_or_else(|e| panic!("{what}: {e}"));
    let value = loss.backward_with(options).unwrap_or_else(|e| panic!("{what}: {e}"));
    let lazy_grads = grads(vs);
    let err = (value - eager_value).abs() / eager_value.abs().max(1e-30);
    assert!(err <= 1e-10, "{what}: loss {value} vs eager {eager_value}");
    assert_grads_match(&eager_grads, &lazy_grads, what);
    plan.micro_batch()
}

fn mlp(vs: &nn::VarStore) -> (nn::Linear, nn::Linear) {
    (nn::linear(vs.root() / "l1", 8, 16, Default::default()), nn::linear(vs.root() / "l2", 16, 4, Default::default()))
}

#[test]
fn mlp_mean_and_sum_losses_match_the_full_batch() {
    tch::manual_seed(1);
    let mut vs = nn::VarStore::new(CPU);
    let (l1, l2) = mlp(&vs);
    vs.double();
    for n in [9i64, 100] {
        let x = Tensor::randn([n, 8], (Kind::Double, CPU));
        let y = Tensor::randint(4, [n], (Kind::Int64, CPU));
        let target = Tensor::randn([n, 4], (Kind::Double, CPU));
        let forced = Options::new().micro_batch(4);

        // Mean cross-entropy.
        let b = check(
            &vs,
            &format!("mlp ce n={n}"),
            &forced,
            || l2.forward(&l1.forward(&x).relu()).log_softmax(-1, None).nll_loss(&y),
            || {
                let (lx, ly) = lazy((&x, &y), 0);
                lx.apply(&l1).relu().apply(&l2).cross_entropy_for_logits(&ly)
            },
        );
        assert_eq!(b, 4);

        // Label-smoothed cross-entropy plus a KL divergence to a target distribution.
        let q = target.softmax(-1, None);
        check(
            &vs,
            &format!("mlp smoothed ce + kl n={n}"),
            &forced,
            || {
                let out = l2.forward(&l1.forward(&x).relu());
                out.cross_entropy_loss(&y, None::<&Tensor>, Reduction::Mean, -100, 0.1)
                    + out.log_softmax(-1, None).kl_div(&q, Reduction::Mean, false)
            },
            || {
                let (lx, ly, lq) = lazy((&x, &y, &q), 0);
                let out = lx.apply(&l1).relu().apply(&l2);
                out.cross_entropy_loss(&ly, None::<&Tensor>, Reduction::Mean, -100, 0.1)
                    + out.log_softmax(-1, None).kl_div(&lq, Reduction::Mean, false)
            },
        );

        // Sum-reduced MSE plus a weight penalty that does not depend on the batch.
        check(
            &vs,
            &format!("mlp mse-sum + l2 n={n}"),
            &forced,
            || {
                let out = l2.forward(&l1.forward(&x).tanh());
                out.mse_loss(&target, Reduction::Sum) + l1.ws.square().sum(Kind::Double) * 0.01
            },
            || {
                let (lx, lt) = lazy((&x, &target), 0);
                let out = lx.apply(&l1).tanh().apply(&l2);
                let penalty = LazyTensor::fixed(&l1.ws).pow_tensor_scalar(2.0).sum(Kind::Double) * 0.01;
                out.mse_loss(&lt, Reduction::Sum) + penalty
            },
        );

        // Mean MSE, a mean over the batch of a per-sample loss, and a scalar offset.
        check(
            &vs,
            &format!("mlp mse-mean n={n}"),
            &forced,
            || {
                let out = l2.forward(&l1.forward(&x).gelu("none"));
                out.mse_loss(&target, Reduction::Mean)
                    + (&out - &target).abs().sum_dim_intlist(&[1i64][..], false, None).mean(None)
                    + 1.5
            },
            || {
                let (lx, lt) = lazy((&x, &target), 0);
                let out = lx.apply(&l1).gelu("none").apply(&l2);
                out.mse_loss(&lt, Reduction::Mean)
                    + (&out - &lt).abs().sum_dim_intlist([1], false, None).mean(None)
                    + 1.5
            },
        );
    }
}

#[test]
fn ignored_targets_and_class_weights_are_weighted_exactly() {
    tch::manual_seed(2);
    let mut vs = nn::VarStore::new(CPU);
    let (l1, l2) = mlp(&vs);
    vs.double();
    let n = 10;
    let x = Tensor::randn([n, 8], (Kind::Double, CPU));
    // Targets -100 are ignored: micro-batches count different numbers of targets.
    let y = Tensor::from_slice(&[0i64, -100, 1, 2, -100, -100, 3, 0, 1, -100]);
    let w = Tensor::from_slice(&[1.0f64, 2.0, 0.5, 3.0]);
    let forced = Options::new().micro_batch(2);
    check(
        &vs,
        "ce with ignored targets",
        &forced,
        || l2.forward(&l1.forward(&x).relu()).log_softmax(-1, None).nll_loss(&y),
        || {
            let (lx, ly) = lazy((&x, &y), 0);
            lx.apply(&l1).relu().apply(&l2).cross_entropy_for_logits(&ly)
        },
    );
    check(
        &vs,
        "weighted nll",
        &forced,
        || l2.forward(&l1.forward(&x).relu()).log_softmax(-1, None).g_nll_loss(&y, Some(&w), Reduction::Mean, -100),
        || {
            let (lx, ly) = lazy((&x, &y), 0);
            lx.apply(&l1).relu().apply(&l2).log_softmax(-1, None).g_nll_loss(&ly, Some(&w), Reduction::Mean, -100)
        },
    );
}

/// A segmentation loss: logits `[N, C, H, W]` against per-pixel classes `[N, H, W]`, tch's
/// `cross_entropy_loss` with class weights and ignored pixels (micro-batches count different
/// numbers of them), mean, sum and per-pixel: loss and gradients of the full batch, split.
#[test]
fn per_pixel_cross_entropy_matches_the_full_batch() {
    tch::manual_seed(3);
    let mut vs = nn::VarStore::new(CPU);
    let conv = nn::conv2d(vs.root() / "c", 3, 4, 3, nn::ConvConfig { padding: 1, ..Default::default() });
    vs.double();
    let n = 6;
    let x = Tensor::randn([n, 3, 5, 5], (Kind::Double, CPU));
    let y = Tensor::randint(4, [n, 5, 5], (Kind::Int64, CPU));
    let _ = y.narrow(0, 1, 2).narrow(1, 0, 3).fill_(-100);
    let w = Tensor::from_slice(&[1.0f64, 2.0, 0.5, 3.0]);
    for (reduction, weight) in [(Reduction::Mean, Some(&w)), (Reduction::Mean, None), (Reduction::Sum, Some(&w))] {
        let what = format!("per-pixel cross-entropy {reduction:?}, weighted {}", weight.is_some());
        check(
            &vs,
            &what,
            &Options::new().micro_batch(2),
            || conv.forward(&x).cross_entropy_loss(&y, weight, reduction, -100, 0.0),
            || {
                let (lx, ly) = lazy((&x, &y), 0);
                lx.apply(&conv).cross_entropy_loss(&ly, weight, reduction, -100, 0.0)
            },
        );
    }
    // Label smoothing: the mean over counted pixels, as libtorch's.
    let unweighted = |smoothing: f64| {
        let (lx, ly) = lazy((&x, &y), 0);
        lx.apply(&conv).cross_entropy_loss(&ly, None::<&Tensor>, Reduction::Mean, -100, smoothing)
    };
    check(
        &vs,
        "per-pixel cross-entropy, smoothed",
        &Options::new().micro_batch(2),
        || conv.forward(&x).cross_entropy_loss(&y, None::<&Tensor>, Reduction::Mean, -100, 0.1),
        || unweighted(0.1),
    );
    // Per pixel: the loss keeps the targets' shape.
    let (lx, ly) = lazy((&x, &y), 0);
    let per_pixel = lx.apply(&conv).cross_entropy_loss(&ly, None::<&Tensor>, Reduction::None, -100, 0.0);
    assert_eq!(per_pixel.size(), [n, 5, 5]);
    let eager = conv.forward(&x).cross_entropy_loss(&y, None::<&Tensor>, Reduction::None, -100, 0.0);
    let value = per_pixel.to_tensor_with(&Options::new().micro_batch(4)).unwrap();
    assert!(relative_error(&value, &eager) < 1e-12);
    // A target of another shape is a typed error naming both shapes.
    let bad = lx.apply(&conv).f_cross_entropy_loss(&ly.narrow(1, 0, 4), None::<&Tensor>, Reduction::Mean, -100, 0.0);
    assert!(matches!(bad, Err(toma::lazy::LazyError::Shape { .. })), "{bad:?}");
}

#[test]
fn small_cnn_matches_the_full_batch_under_a_small_budget() {
    tch::manual_seed(3);
    let mut vs = nn::VarStore::new(CPU);
    let root = vs.root();
    let c1 = nn::conv2d(&root / "c1", 3, 4, 3, nn::ConvConfig { padding: 1, ..Default::default() });
    let c2 = nn::conv2d(&root / "c2", 4, 6, 3, nn::ConvConfig { stride: 2, ..Default::default() });
    let ln = nn::layer_norm(&root / "ln", vec![6, 1, 1], Default::default());
    let fc = nn::linear(&root / "fc", 6, 5, Default::default());
    vs.double();
    for n in [9i64, 100] {
        let x = Tensor::randn([n, 3, 8, 8], (Kind::Double, CPU));
        let y = Tensor::randint(5, [n], (Kind::Int64, CPU));
        let eager = || {
            let h = c1.forward(&x).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
            let h = c2.forward(&h).relu().adaptive_avg_pool2d([1, 1]);
            let h = ln.forward(&h).flatten(1, -1);
            fc.forward(&h).log_softmax(-1, None).nll_loss(&y)
        };
        let lazy_loss = || {
            let (lx, ly) = lazy((&x, &y), 0);
            let h = lx.apply(&c1).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
            let h = h.apply(&c2).relu().adaptive_avg_pool2d([1, 1]);
            h.apply(&ln).flatten(1, -1).apply(&fc).cross_entropy_for_logits(&ly)
        };
        // A budget of a third of the full batch's peak forces several micro-batches.
        let full = lazy_loss().plan(Mode::Backward, &Options::new().budget(u64::MAX)).unwrap();
        assert!(!full.splits());
        let budget = full.peak_bytes() / 3;
        let options = Options::new().budget(budget);
        let b = check(&vs, &format!("cnn n={n}"), &options, eager, lazy_loss);
        assert!(b < n as usize && b.is_power_of_two(), "micro-batch {b} of {n}");
        let plan = lazy_loss().plan(Mode::Backward, &options).unwrap();
        assert!(plan.peak_bytes() <= budget, "{plan}");
    }
}

/// One pre-norm-free transformer block: embedding, multi-head attention via matmul and
/// softmax, residuals, layer norms, a GELU MLP.
struct Block {
    emb: nn::Embedding,
    pos: Tensor,
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
    ln1: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
    ln2: nn::LayerNorm,
    head: nn::Linear,
}

const VOCAB: i64 = 11;
const T: i64 = 5;
const D: i64 = 8;
const HEADS: i64 = 2;

impl Block {
    fn new(vs: &nn::VarStore) -> Self {
        let r = vs.root();
        Block {
            emb: nn::embedding(&r / "emb", VOCAB, D, Default::default()),
            pos: r.randn("pos", &[T, D], 0.0, 0.1),
            q: nn::linear(&r / "q", D, D, Default::default()),
            k: nn::linear(&r / "k", D, D, Default::default()),
            v: nn::linear(&r / "v", D, D, Default::default()),
            o: nn::linear(&r / "o", D, D, Default::default()),
            ln1: nn::layer_norm(&r / "ln1", vec![D], Default::default()),
            up: nn::linear(&r / "up", D, 16, Default::default()),
            down: nn::linear(&r / "down", 16, D, Default::default()),
            ln2: nn::layer_norm(&r / "ln2", vec![D], Default::default()),
            head: nn::linear(&r / "head", D, VOCAB, Default::default()),
        }
    }

    fn eager(&self, tokens: &Tensor) -> Tensor {
        let n = tokens.size()[0];
        let h = self.emb.forward(tokens) + &self.pos;
        let split = |t: Tensor| t.view([n, T, HEADS, D / HEADS]).transpose(1, 2);
        let (q, k, v) = (split(self.q.forward(&h)), split(self.k.forward(&h)), split(self.v.forward(&h)));
        let att = (q.matmul(&k.transpose(-2, -1)) / ((D / HEADS) as f64).sqrt()).softmax(-1, None);
        let a = att.matmul(&v).transpose(1, 2).reshape([n, T, D]);
        let h = self.ln1.forward(&(h + self.o.forward(&a)));
        let m = self.down.forward(&self.up.forward(&h).gelu("tanh"));
        self.head.forward(&self.ln2.forward(&(h + m)))
    }

    fn lazy(&self, tokens: &LazyTensor) -> LazyTensor {
        let n = tokens.size()[0];
        let h = LazyTensor::embedding(&self.emb.ws, tokens, -1, false, false) + &self.pos;
        let split = |t: LazyTensor| t.view([n, T, HEADS, D / HEADS]).transpose(1, 2);
        let (q, k, v) = (split(h.apply(&self.q)), split(h.apply(&self.k)), split(h.apply(&self.v)));
        let att = (q.matmul(&k.transpose(-2, -1)) / ((D / HEADS) as f64).sqrt()).softmax(-1, None);
        let a = att.matmul(&v).transpose(1, 2).reshape([n, T, D]);
        let h = (&h + a.apply(&self.o)).apply(&self.ln1);
        let m = h.apply(&self.up).gelu("tanh").apply(&self.down);
        (h + m).apply(&self.ln2).apply(&self.head)
    }
}

#[test]
fn transformer_block_matches_the_full_batch() {
    tch::manual_seed(4);
    let mut vs = nn::VarStore::new(CPU);
    let block = Block::new(&vs);
    vs.double();
    for n in [9i64, 100] {
        let tokens = Tensor::randint(VOCAB, [n, T], (Kind::Int64, CPU));
        let next = Tensor::randint(VOCAB, [n, T], (Kind::Int64, CPU));
        // Token-level loss: logits [N, T, V] flattened to [N * T, V] (the batch merged with T).
        let b = check(
            &vs,
            &format!("transformer token loss n={n}"),
            &Options::new().micro_batch(4),
            || block.eager(&tokens).view([-1, VOCAB]).log_softmax(-1, None).nll_loss(&next.view([-1])),
            || {
                let (lt, ly) = lazy((&tokens, &next), 0);
                block.lazy(&lt).view([-1, VOCAB]).cross_entropy_for_logits(&ly.view([-1]))
            },
        );
        assert_eq!(b, 4);
        // Sequence-level loss: mean over positions, then a sum-reduced NLL.
        let label = Tensor::randint(VOCAB, [n], (Kind::Int64, CPU));
        let full = {
            let (lt, ly) = lazy((&tokens, &label), 0);
            block.lazy(&lt).mean_dim([1], false, None).log_softmax(-1, None).g_nll_loss(
                &ly,
                None::<&Tensor>,
                Reduction::Sum,
                -100,
            )
        };
        let budget = full.plan(Mode::Backward, &Options::new().budget(u64::MAX)).unwrap().peak_bytes() / 4;
        let b = check(
            &vs,
            &format!("transformer sequence loss n={n}"),
            &Options::new().budget(budget),
            || {
                block.eager(&tokens).mean_dim(&[1i64][..], false, None).log_softmax(-1, None).g_nll_loss(
                    &label,
                    None::<&Tensor>,
                    Reduction::Sum,
                    -100,
                )
            },
            || {
                let (lt, ly) = lazy((&tokens, &label), 0);
                block.lazy(&lt).mean_dim([1], false, None).log_softmax(-1, None).g_nll_loss(
                    &ly,
                    None::<&Tensor>,
                    Reduction::Sum,
                    -100,
                )
            },
        );
        assert!(b < n as usize, "the budget forces a split");
    }
}

#[test]
fn gradients_accumulate_on_top_of_existing_ones_like_tch() {
    // Two lazy backwards add up, as two eager backwards do; parameters start without `.grad()`.
    tch::manual_seed(5);
    let mut vs = nn::VarStore::new(CPU);
    let (l1, l2) = mlp(&vs);
    vs.double();
    let x = Tensor::randn([12, 8], (Kind::Double, CPU));
    let y = Tensor::randint(4, [12], (Kind::Int64, CPU));
    for v in vs.trainable_variables() {
        assert!(!v.grad().defined());
    }
    let lazy_loss = || {
        let (lx, ly) = lazy((&x, &y), 0);
        lx.apply(&l1).relu().apply(&l2).cross_entropy_for_logits(&ly)
    };
    let options = Options::new().micro_batch(5);
    lazy_loss().backward_with(&options).unwrap();
    lazy_loss().backward_with(&options).unwrap();
    let twice = grads(&vs);
    zero_grads(&vs);
    l2.forward(&l1.forward(&x).relu()).log_softmax(-1, None).nll_loss(&y).backward();
    let once = grads(&vs);
    for (name, g) in &once {
        let err = relative_error(&twice[name], &(g * 2.0));
        assert!(err <= 1e-10, "{name}: {err:e}");
    }
}

/// A ViT-style learned token, expanded to the batch and wrapped with `lazy` (as the error for
/// a fixed operand of the batch's size asks), and an input of the user's that requires a
/// gradient: both get the full batch's gradients, in micro-batches and whole (before, both were
/// silently dropped: the parameters' gradients were the only ones asked for).
#[test]
fn inputs_that_require_gradients_get_them() {
    tch::manual_seed(9);
    let mut vs = nn::VarStore::new(CPU);
    let (n, t, d) = (10i64, 4i64, 8i64);
    let embed = nn::linear(vs.root() / "embed", d, d, Default::default());
    let head = nn::linear(vs.root() / "head", d, 3, Default::default());
    let cls = vs.root().randn("cls", &[1, 1, d], 0.0, 1.0);
    vs.double();
    let x = Tensor::randn([n, t, d], (Kind::Double, CPU));
    let y = Tensor::randint(3, [n], (Kind::Int64, CPU));
    // The token's row of each sequence, after one mixing layer over the positions.
    let eager = || {
        let tokens = Tensor::cat(&[cls.expand([n, 1, d], false), embed.forward(&x)], 1);
        let mixed = tokens.softmax(1, None) * &tokens;
        // (tch's `cross_entropy_for_logits` computes in f32.)
        head.forward(&mixed.select(1, 0).tanh()).log_softmax(-1, None).nll_loss(&y)
    };
    let lazily = || {
        let (lx, ly) = lazy((&x, &y), 0);
        let token = lazy(&cls.expand([n, 1, d], false), 0);
        let tokens = LazyTensor::cat(&[token, lx.apply(&embed)], 1);
        let mixed = tokens.softmax(1, None) * &tokens;
        mixed.select(1, 0).tanh().apply(&head).cross_entropy_for_logits(&ly)
    };
    for micro in [3usize, 10] {
        check(
            &vs,
            &format!("learned token, micro-batches of {micro}"),
            &Options::new().micro_batch(micro),
            eager,
            lazily,
        );
    }
    // An input that requires a gradient of its own: its `.grad` is the full batch's.
    let xg = x.detach().set_requires_grad(true);
    let eager_grad = {
        let loss = head.forward(&embed.forward(&xg).relu().mean_dim(1, false, None)).log_softmax(-1, None).nll_loss(&y);
        loss.backward();
        xg.grad().copy()
    };
    for micro in [3usize, 10] {
        let mut g = xg.grad();
        let _ = g.zero_();
        let (lx, ly) = lazy((&xg, &y), 0);
        let loss = lx.apply(&embed).relu().mean_dim(1, false, None).apply(&head).cross_entropy_for_logits(&ly);
        loss.backward_with(&Options::new().micro_batch(micro)).unwrap();
        let err = relative_error(&xg.grad(), &eager_grad);
        assert!(err <= 1e-10, "the input's gradient in micro-batches of {micro} differs by {err:e}");
    }
}

/// The ops added with the op families (conv1d, silu, causal attention, baddbmm, softplus) in
/// one sequence model: micro-batched gradients are the full batch's.
#[test]
fn sequence_model_of_the_new_ops_matches_the_full_batch() {
    use crate::support::models::{seq, seq_eager, seq_lazy};
    tch::manual_seed(5);
    let mut vs = nn::VarStore::new(CPU);
    let (channels, len) = (3, 12);
    let m = seq(&vs, channels, 8, 2, len);
    vs.double();
    for n in [7i64, 20] {
        let x = Tensor::randn([n, channels, len], (Kind::Double, CPU));
        let y = Tensor::randint(10, [n], (Kind::Int64, CPU));
        for micro in [1, 3] {
            let b = check(
                &vs,
                &format!("sequence model n={n} in micro-batches of {micro}"),
                &Options::new().micro_batch(micro),
                || seq_eager(&m, &x, &y),
                || seq_lazy(&m, &x, &y),
            );
            assert_eq!(b, micro);
        }
    }
}

/// `rms_norm` (with a weight), `gather` with an index split with the batch, and `select`:
/// written once over `TensorOps`, the same function eagerly and lazily.
#[test]
fn rms_norm_gather_and_select_match_the_full_batch() {
    use toma::lazy::TensorOps;
    fn head<T: TensorOps>(x: &T, idx: &T, y: &T, norm: &Tensor, proj: &nn::Linear) -> T
    where
        nn::Linear: toma::lazy::Layer<T>,
    {
        let h = x.rms_norm([8], Some(norm), Some(1e-6)).apply(proj).tanh();
        // Three picked features per position, then the last position of the sequence.
        let picked = h.gather(2, idx, false);
        // tch's cross_entropy_for_logits takes the log-softmax in Float; this one in the input's kind.
        picked.select(1, -1).cross_entropy_loss(y, None, Reduction::Mean, -100, 0.0)
    }
    tch::manual_seed(9);
    let mut vs = nn::VarStore::new(CPU);
    let proj = nn::linear(vs.root() / "proj", 8, 6, Default::default());
    let norm = vs.root().ones("norm", &[8]);
    vs.double();
    for n in [5i64, 16] {
        let x = Tensor::randn([n, 4, 8], (Kind::Double, CPU));
        let idx = Tensor::randint(6, [n, 4, 3], (Kind::Int64, CPU));
        let y = Tensor::randint(3, [n], (Kind::Int64, CPU));
        for micro in [1, 3] {
            check(
                &vs,
                &format!("rms/gather/select n={n} micro {micro}"),
                &Options::new().micro_batch(micro),
                || head(&x, &idx, &y, &norm, &proj),
                || {
                    let (lx, li, ly) = lazy((&x, &idx, &y), 0);
                    head(&lx, &li, &ly, &norm, &proj)
                },
            );
        }
    }
}

/// A small decoder: `conv_transpose2d` (strided, grouped) and bilinear upsampling.
#[test]
fn transposed_convolution_and_bilinear_upsampling_match_the_full_batch() {
    use toma::lazy::TensorOps;
    fn decode<T: TensorOps>(x: &T, target: &T, w1: &Tensor, b1: &Tensor, w2: &Tensor) -> T {
        let h = x.conv_transpose2d(w1, Some(b1), [2], [1], [1], 2, [1]).relu();
        let h = h.conv_transpose2d(w2, None, [1], [0], [0], 1, [1]);
        h.upsample_bilinear2d([15, 17], false, None, None).mse_loss(target, Reduction::Mean)
    }
    tch::manual_seed(12);
    let mut vs = nn::VarStore::new(CPU);
    let w1 = vs.root().randn("w1", &[4, 3, 3, 3], 0.0, 0.3);
    let b1 = vs.root().randn("b1", &[6], 0.0, 0.1);
    let w2 = vs.root().randn("w2", &[6, 2, 2, 2], 0.0, 0.3);
    vs.double();
    for n in [4i64, 9] {
        let x = Tensor::randn([n, 4, 5, 6], (Kind::Double, CPU));
        let target = Tensor::randn([n, 2, 15, 17], (Kind::Double, CPU));
        check(
            &vs,
            &format!("decoder n={n}"),
            &Options::new().micro_batch(2),
            || decode(&x, &target, &w1, &b1, &w2),
            || {
                let (lx, lt) = lazy((&x, &target), 0);
                decode(&lx, &lt, &w1, &b1, &w2)
            },
        );
    }
}

/// The MLP of `mlp` on `n` samples, its loss written by the caller once over `TensorOps`
/// (`eager` and `lazy` are that function at `Tensor` and `LazyTensor`): micro-batched
/// gradients equal the full batch's at each of `micro`.
fn check_mlp_loss(
    seed: i64,
    n: i64,
    micro: &[usize],
    eager: impl Fn(&Tensor, &Tensor, &nn::Linear, &nn::Linear) -> Tensor,
    lazy_loss: impl Fn(&LazyTensor, &LazyTensor, &nn::Linear, &nn::Linear) -> LazyTensor,
) {
    tch::manual_seed(seed);
    let mut vs = nn::VarStore::new(CPU);
    let (l1, l2) = mlp(&vs);
    vs.double();
    let x = Tensor::randn([n, 8], (Kind::Double, CPU));
    let y = Tensor::randint(4, [n], (Kind::Int64, CPU));
    let (lx, ly) = lazy((&x, &y), 0);
    for &m in micro {
        check(
            &vs,
            &format!("micro-batches of {m}"),
            &Options::new().micro_batch(m),
            || eager(&x, &y, &l1, &l2),
            || lazy_loss(&lx, &ly, &l1, &l2),
        );
    }
}

/// Sine, cosine, square, the clamps, erf, log-sigmoid, rsqrt, reciprocal and logsumexp: written
/// once over `TensorOps`, micro-batched gradients equal the full batch's.
#[test]
fn more_pointwise_ops_match_the_full_batch() {
    use toma::lazy::TensorOps;
    fn loss<T: TensorOps>(x: &T, y: &T, l1: &nn::Linear, l2: &nn::Linear) -> T
    where
        nn::Linear: toma::lazy::Layer<T>,
    {
        let h = x.apply(l1);
        let h = h.sin().add(&h.cos().square()).clamp(-0.8, 0.9).clamp_min(-0.6).clamp_max(0.7);
        let positive = h.square().add_scalar(0.5);
        let h = h.erf().add(&h.log_sigmoid()).add(&positive.rsqrt()).add(&positive.reciprocal());
        let h = h.sub(&h.logsumexp(-1, true));
        h.apply(l2).log_softmax(-1, None).nll_loss(y)
    }
    check_mlp_loss(13, 11, &[2, 5], loss::<Tensor>, loss::<LazyTensor>);
}

/// The variance and standard deviation over features (a hand-made layer norm) and a gated
/// linear unit: micro-batched gradients equal the full batch's.
#[test]
fn var_std_and_glu_match_the_full_batch() {
    use toma::lazy::TensorOps;
    fn loss<T: TensorOps>(x: &T, y: &T, l1: &nn::Linear, l2: &nn::Linear) -> T
    where
        nn::Linear: toma::lazy::Layer<T>,
    {
        let h = x.apply(l1);
        let centred = h.sub(&h.mean_dim([-1], true, None));
        let h = centred.div(&h.var_dim([-1], false, true).add_scalar(1e-5).sqrt());
        let h = h.add(&h.tanh().std_dim([-1], true, true));
        // Gated: the features doubled, then halved by `glu`.
        let h = T::cat(&[&h, &h.sin()], -1).glu(-1);
        h.apply(l2).log_softmax(-1, None).nll_loss(y)
    }
    check_mlp_loss(19, 12, &[5, 12], loss::<Tensor>, loss::<LazyTensor>);
}

/// `detach` cuts the gradient as tch's does: `h · stop(h)` has the gradient `stop(h)` only,
/// micro-batched or not.
#[test]
fn detach_cuts_the_gradient_like_tch() {
    use toma::lazy::TensorOps;
    fn loss<T: TensorOps>(x: &T, y: &T, l1: &nn::Linear, l2: &nn::Linear) -> T
    where
        nn::Linear: toma::lazy::Layer<T>,
    {
        let h = x.apply(l1);
        h.mul(&h.detach().tanh()).apply(l2).log_softmax(-1, None).nll_loss(y)
    }
    let vs = nn::VarStore::new(CPU);
    let (l1, _) = mlp(&vs);
    let x = Tensor::randn([10, 8], (Kind::Float, CPU));
    assert!(!lazy(&x, 0).apply(&l1).detach().requires_grad());
    check_mlp_loss(17, 10, &[3, 10], loss::<Tensor>, loss::<LazyTensor>);
}

/// `cosine_similarity` (each sample's features against a learned direction and against their
/// own flipped order) and `flip`: written once over `TensorOps`, micro-batched gradients equal
/// the full batch's.
#[test]
fn cosine_similarity_and_flip_match_the_full_batch() {
    use toma::lazy::TensorOps;
    fn loss<T: TensorOps>(x: &T, y: &T, l1: &nn::Linear, l2: &nn::Linear) -> T
    where
        nn::Linear: toma::lazy::Layer<T>,
    {
        let h = x.apply(l1);
        let mirrored = h.flip([-1]);
        // [N, 16] against [N, 16] along the features: one similarity per sample, [N, 1].
        let similarity = h.cosine_similarity(&mirrored, -1, 1e-8).unsqueeze(-1);
        h.mul(&similarity).apply(l2).log_softmax(-1, None).nll_loss(y)
    }
    check_mlp_loss(13, 11, &[2, 5], loss::<Tensor>, loss::<LazyTensor>);
}

/// The losses of pairs and triplets (cosine embedding, margin ranking, triplet margin, with
/// and without `swap`), binary cross-entropy of probabilities (weighted) and the Poisson
/// likelihood (with Stirling's term), mean- and sum-reduced, on an MLP's features: the loss and
/// the gradients of micro-batches of 1, 3 and 4 are the full batch's to 1e-9 relative.
#[test]
fn pair_and_probability_losses_match_the_full_batch() {
    tch::manual_seed(21);
    let mut vs = nn::VarStore::new(CPU);
    let l1 = nn::linear(vs.root() / "l1", 8, 15, Default::default());
    let l2 = nn::linear(vs.root() / "l2", 15, 4, Default::default());
    vs.double();
    let n = 11i64;
    let f64s = (Kind::Double, CPU);
    let x = Tensor::randn([n, 8], f64s);
    let sign = Tensor::randint(2, [n], (Kind::Int64, CPU)).to_kind(Kind::Double) * 2.0 - 1.0;
    let probability = Tensor::rand([n, 4], f64s);
    let counts = Tensor::randint(4, [n, 4], (Kind::Int64, CPU)).to_kind(Kind::Double);
    let weight = Tensor::rand([4], f64s) + 0.5;
    let part = |h: &Tensor, i: i64| h.narrow(1, 5 * i, 5);
    let eager = |sum: bool| {
        let reduction = || if sum { Reduction::Sum } else { Reduction::Mean };
        let h = l1.forward(&x).tanh();
        let out = l2.forward(&h);
        let (a, p, q) = (part(&h, 0), part(&h, 1), part(&h, 2));
        Tensor::cosine_embedding_loss(&a, &p, &sign, 0.2, reduction())
            + Tensor::margin_ranking_loss(&out.select(1, 0), &out.select(1, 1), &sign, 0.1, reduction())
            + Tensor::triplet_margin_loss(&a, &p, &q, 1.0, 2.0, 1e-6, false, reduction())
            + Tensor::triplet_margin_loss(&q, &a, &p, 0.5, 1.0, 1e-6, true, reduction())
            + out.sigmoid().binary_cross_entropy(&probability, Some(&weight), reduction())
            + out.poisson_nll_loss(&counts, true, true, 1e-8, reduction())
            + (out.abs() + 0.1).poisson_nll_loss(&counts, false, false, 1e-8, reduction())
    };
    let lazily = |sum: bool| {
        let reduction = || if sum { Reduction::Sum } else { Reduction::Mean };
        let (lx, ls, lp, lc) = lazy((&x, &sign, &probability, &counts), 0);
        let h = lx.apply(&l1).tanh();
        let out = h.apply(&l2);
        let part = |i: i64| h.narrow(1, 5 * i, 5);
        let (a, p, q) = (part(0), part(1), part(2));
        LazyTensor::cosine_embedding_loss(&a, &p, &ls, 0.2, reduction())
            + LazyTensor::margin_ranking_loss(&out.select(1, 0), &out.select(1, 1), &ls, 0.1, reduction())
            + LazyTensor::triplet_margin_loss(&a, &p, &q, 1.0, 2.0, 1e-6, false, reduction())
            + LazyTensor::triplet_margin_loss(&q, &a, &p, 0.5, 1.0, 1e-6, true, reduction())
            + out.sigmoid().binary_cross_entropy(&lp, Some(&weight), reduction())
            + out.poisson_nll_loss(&lc, true, true, 1e-8, reduction())
            + (out.abs() + 0.1).poisson_nll_loss(&lc, false, false, 1e-8, reduction())
    };
    for (name, sum) in [("mean", false), ("sum", true)] {
        check_tight(&vs, name, &[1, 3, 4], || eager(sum), || lazily(sum));
    }
}

/// `cumprod` (over features with exact zeros from a ReLU, so libtorch's backward takes its path
/// for zeros, and without) and `sort`'s values (positions carry no gradient; the stable form
/// too): micro-batched gradients equal tch's on the full batch to 1e-9 relative.
#[test]
fn cumprod_and_sort_match_the_full_batch() {
    tch::manual_seed(23);
    let mut vs = nn::VarStore::new(CPU);
    let l1 = nn::linear(vs.root() / "l1", 8, 6, Default::default());
    let l2 = nn::linear(vs.root() / "l2", 18, 4, Default::default());
    vs.double();
    let mut other = nn::VarStore::new(CPU);
    let l3 = nn::linear(other.root() / "l3", 6, 4, Default::default());
    other.double();
    let n = 10i64;
    let x = Tensor::randn([n, 8], (Kind::Double, CPU));
    let y = Tensor::randint(4, [n], (Kind::Int64, CPU));
    let eager = || {
        let h = l1.forward(&x);
        let zeros = h.relu().cumprod(1, None::<Kind>);
        assert!(h.relu().eq(0.0).any().int64_value(&[]) == 1, "the ReLU makes zeros");
        let plain = (h.tanh() + 1.5).cumprod(-1, None::<Kind>);
        let (sorted, positions) = h.sort_stable(true, 1, true);
        let features = Tensor::cat(&[zeros, plain, sorted * (positions.to_kind(Kind::Double) + 1.0)], 1);
        l2.forward(&features).log_softmax(-1, None).nll_loss(&y)
    };
    let lazily = || {
        let (lx, ly) = lazy((&x, &y), 0);
        let h = lx.apply(&l1);
        let zeros = h.relu().cumprod(1, None::<Kind>);
        let plain = (h.tanh() + 1.5).cumprod(-1, None::<Kind>);
        let (sorted, positions) = h.sort_stable(true, 1, true);
        let features = LazyTensor::cat(&[zeros, plain, sorted * (positions.to_kind(Kind::Double) + 1.0)], 1);
        features.apply(&l2).log_softmax(-1, None).nll_loss(&ly)
    };
    check_tight(&vs, "cumprod, sort", &[1, 3, 10], eager, lazily);
    // The plain sort's values, and a sort along the batch: refused for a split.
    let (lx, ly) = lazy((&x, &y), 0);
    let h = lx.apply(&l1);
    let loss = h.sort(0, false).0.apply(&l3).log_softmax(-1, None).nll_loss(&ly);
    assert!(loss.backward_with(&Options::new().micro_batch(3)).is_err(), "sorting along the batch is refused");
}

/// Eager against lazy at each of `micro`: the loss to 1e-12 and every variable's gradient to
/// `1e-9` relative (f64).
fn check_tight(
    vs: &nn::VarStore,
    what: &str,
    micro: &[usize],
    eager: impl Fn() -> Tensor,
    lazy_loss: impl Fn() -> LazyTensor,
) {
    zero_grads(vs);
    let eager_loss = eager();
    let eager_value = eager_loss.double_value(&[]);
    eager_loss.backward();
    let eager_grads = grads(vs);
    for &m in micro {
        zero_grads(vs);
        let loss = lazy_loss();
        let options = Options::new().micro_batch(m);
        assert_eq!(loss.plan(Mode::Backward, &options).unwrap().micro_batch(), m, "{what}");
        let value = loss.backward_with(&options).unwrap_or_else(|e| panic!("{what}: {e}"));
        let err = (value - eager_value).abs() / eager_value.abs().max(1e-30);
        assert!(err <= 1e-12, "{what} micro {m}: loss {value} vs eager {eager_value}");
        for (name, e) in &eager_grads {
            let err = relative_error(&grads(vs)[name], e);
            assert!(err <= 1e-9, "{what} micro {m}: gradient of {name} differs by {err:e} relative");
        }
    }
}

/// `pixel_shuffle`, `pixel_unshuffle`, `upsample_nearest1d` and `unfold` (overlapping windows)
/// in one model: micro-batched gradients are the full batch's.
#[test]
fn pixel_shuffles_upsampling_and_unfold_match_the_full_batch() {
    use toma::lazy::TensorOps;
    fn loss<T: TensorOps>(x: &T, target: &T, w: &Tensor, scale: &Tensor) -> T {
        let h = x.conv2d(w, None::<&Tensor>, [1], [1], [1], 1).pixel_shuffle(2).tanh();
        // [N, 4, 12, 12] -> [N, 36, 4, 4] -> [N, 36, 16] -> [N, 36, 24] -> windows [N, 36, 7, 6].
        let h = h.pixel_unshuffle(3).flatten(2, 3).upsample_nearest1d([24], None).unfold(2, 6, 3);
        h.mul(&T::constant(scale)).sum_dim_intlist([-1], false, None).mse_loss(target, Reduction::Mean)
    }
    tch::manual_seed(21);
    let mut vs = nn::VarStore::new(CPU);
    let w = vs.root().randn("w", &[16, 8, 3, 3], 0.0, 0.2);
    let scale = vs.root().randn("scale", &[6], 1.0, 0.3);
    vs.double();
    for n in [5i64, 8] {
        let x = Tensor::randn([n, 8, 6, 6], (Kind::Double, CPU));
        let target = Tensor::randn([n, 36, 7], (Kind::Double, CPU));
        check_tight(
            &vs,
            &format!("pixel shuffles n={n}"),
            &[1, 2, 3],
            || loss(&x, &target, &w, &scale),
            || {
                let (lx, lt) = lazy((&x, &target), 0);
                loss(&lx, &lt, &w, &scale)
            },
        );
    }
}

/// `scatter` (a permutation per sample), `scatter_add` (repeated indices) and `index_add` (a
/// fixed index, along the features) in one model: micro-batched gradients are the full
/// batch's; `masked_scatter`, which no split can reproduce, against tch unsplit.
#[test]
fn scatters_and_index_add_match_the_full_batch() {
    use toma::lazy::TensorOps;
    fn loss<T: TensorOps>(x: &T, perm: &T, repeats: &T, picks: &Tensor, y: &T, l1: &nn::Linear, l2: &nn::Linear) -> T
    where
        nn::Linear: toma::lazy::Layer<T>,
    {
        let h = x.apply(l1);
        let h = h.scatter(2, perm, &h.tanh());
        // libtorch's backward takes a `src` of the index's shape only.
        let h = h.scatter_add(1, repeats, &h.narrow(1, 2, 4).sin());
        let h = h.index_add(2, &T::constant(picks), &h.narrow(2, 1, 5).square());
        h.apply(l2).sum_dim_intlist([1], false, None).log_softmax(-1, None).nll_loss(y)
    }
    tch::manual_seed(23);
    let mut vs = nn::VarStore::new(CPU);
    let (l1, l2) = (
        nn::linear(vs.root() / "l1", 8, 8, Default::default()),
        nn::linear(vs.root() / "l2", 8, 4, Default::default()),
    );
    vs.double();
    let picks = Tensor::from_slice(&[0i64, 3, 3, 7, 1]);
    for n in [5i64, 7] {
        let x = Tensor::randn([n, 6, 8], (Kind::Double, CPU));
        let perm = Tensor::rand([n, 6, 8], (Kind::Double, CPU)).argsort(2, false);
        let repeats = Tensor::randint(6, [n, 4, 8], (Kind::Int64, CPU));
        let y = Tensor::randint(4, [n], (Kind::Int64, CPU));
        check_tight(
            &vs,
            &format!("scatters n={n}"),
            &[1, 2, 3],
            || loss(&x, &perm, &repeats, &picks, &y, &l1, &l2),
            || {
                let (lx, lp, lr, ly) = lazy((&x, &perm, &repeats, &y), 0);
                loss(&lx, &lp, &lr, &picks, &ly, &l1, &l2)
            },
        );
        // masked_scatter: the gradient reaches `self` where the mask is false and the source's
        // first entries, as many as the mask's trues.
        let mask = Tensor::randn([n, 6, 8], (Kind::Double, CPU)).gt(0.0);
        let source = Tensor::randn([n * 6 * 8 + 3], (Kind::Double, CPU));
        let masked = |h: &Tensor, src: &Tensor| h.masked_scatter(&mask, src);
        check_tight(
            &vs,
            &format!("masked_scatter n={n}"),
            &[n as usize],
            || masked(&x.apply(&l1), &(&source * l2.ws.sum(None))).apply(&l2).square().mean(None),
            || {
                let lx = lazy(&x, 0);
                let src = LazyTensor::fixed(&source) * LazyTensor::fixed(&l2.ws).sum(None);
                lx.apply(&l1).masked_scatter(&mask, &src).apply(&l2).square().mean(None)
            },
        );
        let refused =
            lazy(&x, 0).masked_scatter(&mask, &source).sum(None).backward_with(&Options::new().micro_batch(2));
        assert!(refused.is_err(), "a split of masked_scatter is refused");
    }
}

/// A small volume model: `conv3d` (strided, then grouped), `max_pool3d` and `avg_pool3d`:
/// micro-batched gradients are the full batch's.
#[test]
fn volumes_match_the_full_batch() {
    use toma::lazy::TensorOps;
    fn loss<T: TensorOps>(x: &T, y: &T, w1: &Tensor, b1: &Tensor, w2: &Tensor) -> T {
        let h = x.conv3d(w1, Some(b1), [1, 2, 2], [1], [1], 1).relu();
        let h = h.max_pool3d([2], [], [0], [1], false).conv3d(w2, None::<&Tensor>, [1], [1], [1], 2).tanh();
        let h = h.avg_pool3d([2, 2, 2], [1], [1], true, false, None).sum_dim_intlist([2, 3, 4], false, None);
        h.log_softmax(-1, None).nll_loss(y)
    }
    tch::manual_seed(31);
    let mut vs = nn::VarStore::new(CPU);
    let w1 = vs.root().randn("w1", &[6, 3, 3, 3, 3], 0.0, 0.2);
    let b1 = vs.root().randn("b1", &[6], 0.0, 0.1);
    let w2 = vs.root().randn("w2", &[4, 3, 3, 3, 3], 0.0, 0.2);
    vs.double();
    for n in [5i64, 8] {
        let x = Tensor::randn([n, 3, 6, 10, 10], (Kind::Double, CPU));
        let y = Tensor::randint(4, [n], (Kind::Int64, CPU));
        check_tight(
            &vs,
            &format!("volumes n={n}"),
            &[1, 2, 3],
            || loss(&x, &y, &w1, &b1, &w2),
            || {
                let (lx, ly) = lazy((&x, &y), 0);
                loss(&lx, &ly, &w1, &b1, &w2)
            },
        );
    }
}

/// CTC on an MLP's per-step log-probabilities (`[N, T, 8]` features, transposed to `[T, N, C]`),
/// against padded targets and concatenated ones with lengths as lists, and padded ones with
/// lengths as tensors, mean- and sum-reduced: the loss and the gradients of micro-batches of 1,
/// 3 and the whole batch are the full batch's to 1e-9 relative.
#[test]
fn ctc_loss_matches_the_full_batch() {
    tch::manual_seed(29);
    let mut vs = nn::VarStore::new(CPU);
    let l1 = nn::linear(vs.root() / "l1", 8, 12, Default::default());
    let l2 = nn::linear(vs.root() / "l2", 12, 5, Default::default());
    vs.double();
    let (n, t, s) = (7i64, 12i64, 4i64);
    let x = Tensor::randn([n, t, 8], (Kind::Double, CPU));
    let targets = Tensor::randint_low(1, 5, [n, s], (Kind::Int64, CPU));
    // Input lengths from 9 to 12, targets of 0 to 4 labels: every loss finite.
    let il: Vec<i64> = (0..n).map(|i| t - i % 4).collect();
    let tl: Vec<i64> = (0..n).map(|i| (i + 1) % (s + 1)).collect();
    let pieces: Vec<Tensor> = tl.iter().enumerate().map(|(i, &l)| targets.get(i as i64).narrow(0, 0, l)).collect();
    let concatenated = Tensor::cat(&pieces, 0);
    let (il_t, tl_t) = (Tensor::from_slice(&il), Tensor::from_slice(&tl));
    let eager = |red: Reduction| {
        let lp = l2.forward(&l1.forward(&x).tanh()).log_softmax(-1, None).transpose(0, 1);
        Tensor::ctc_loss(&lp, &targets, &il, &tl, 0, red, false)
            + Tensor::ctc_loss(&lp, &concatenated, &il, &tl, 0, red, false) * 0.5
            + Tensor::ctc_loss_tensor(&lp, &targets, &il_t, &tl_t, 0, red, true) * 0.25
    };
    let lazily = |red: Reduction| {
        let (lx, lt, lil, ltl) = lazy((&x, &targets, &il_t, &tl_t), 0);
        let lp = lx.apply(&l1).tanh().apply(&l2).log_softmax(-1, None).transpose(0, 1);
        LazyTensor::ctc_loss(&lp, &lt, &il, &tl, 0, red, false)
            + LazyTensor::ctc_loss(&lp, &concatenated, &il, &tl, 0, red, false) * 0.5
            + LazyTensor::ctc_loss_tensor(&lp, &lt, &lil, &ltl, 0, red, true) * 0.25
    };
    for red in [Reduction::Mean, Reduction::Sum] {
        check_tight(&vs, &format!("{red:?}"), &[1, 3, n as usize], || eager(red), || lazily(red));
    }
}

/// `einsum` in one model: a projection (`bij,jk->bik`), attention scores over heads
/// (`bhqd,bhkd->bhqk`) and their use, a batch in the middle (`ibj,jk->ibk`, interleaved when
/// folded), a sum over a subscript one operand has, a per-sample outer product and a per-sample
/// dot: micro-batched gradients are the full batch's.
#[test]
fn einsum_matches_the_full_batch() {
    tch::manual_seed(29);
    let mut vs = nn::VarStore::new(CPU);
    let w = vs.root().randn("w", &[8, 8], 0.0, 0.3);
    let v = vs.root().randn("v", &[4, 6], 0.0, 0.3);
    let u = vs.root().randn("u", &[8], 0.0, 0.3);
    vs.double();
    let none = None::<i64>;
    for n in [5i64, 7] {
        let x = Tensor::randn([n, 6, 8], (Kind::Double, CPU));
        let t = Tensor::randn([6, n, 4], (Kind::Double, CPU));
        let eager = || {
            let h = Tensor::einsum("bij,jk->bik", &[&x, &w], none).tanh();
            let heads = h.view([n, 6, 2, 4]).permute([0, 2, 1, 3]);
            let scores = Tensor::einsum("bhqd,bhkd->bhqk", &[&heads, &heads], none).softmax(-1, None);
            let mixed = Tensor::einsum("bhqk,bhkd->bqhd", &[&scores, &heads], none);
            let side = Tensor::einsum("ibj,jk->bik", &[&t, &v], none).sin();
            let outer = Tensor::einsum("bi,j->bij", &[&side.sum_dim_intlist(&[1i64][..], false, None), &u], none);
            let dot = Tensor::einsum("bqhd,bqhd->b", &[&mixed, &mixed], none);
            dot.sum(None)
                + Tensor::einsum("bij,bik->", &[&outer, &side], none)
                + Tensor::einsum("bqhd,i->b", &[&mixed, &u], none).mean(None)
        };
        let lazily = || {
            let (lx, lt) = (lazy(&x, 0), lazy(&t, 1));
            let (lw, lv, lu) = (LazyTensor::fixed(&w), LazyTensor::fixed(&v), LazyTensor::fixed(&u));
            let h = LazyTensor::einsum("bij,jk->bik", &[&lx, &lw], none).tanh();
            let heads = h.view([n, 6, 2, 4]).permute([0, 2, 1, 3]);
            let scores = LazyTensor::einsum("bhqd,bhkd->bhqk", &[&heads, &heads], none).softmax(-1, None);
            let mixed = LazyTensor::einsum("bhqk,bhkd->bqhd", &[&scores, &heads], none);
            let side = LazyTensor::einsum("ibj,jk->bik", &[&lt, &lv], none).sin();
            let outer = LazyTensor::einsum("bi,j->bij", &[&side.sum_dim_intlist([1], false, None), &lu], none);
            let dot = LazyTensor::einsum("bqhd,bqhd->b", &[&mixed, &mixed], none);
            // Per-sample pieces summed into the loss: a sum over the batch splits.
            dot.sum(None)
                + LazyTensor::einsum("bij,bik->b", &[&outer, &side], none).sum(None)
                + LazyTensor::einsum("bqhd,i->b", &[&mixed, &lu], none).mean(None)
        };
        check_tight(&vs, &format!("einsum n={n}"), &[1, 2, 3], eager, lazily);
    }
}

/// `index_put` in one model: learned values written at fixed indices of a learned activation
/// (adjacent indices, and indices separated by `None`, which move the batch), then added with
/// repeated indices (`accumulate`): micro-batched gradients are the full batch's.
#[test]
fn index_put_matches_the_full_batch() {
    tch::manual_seed(31);
    let mut vs = nn::VarStore::new(CPU);
    let (l1, l2) = (
        nn::linear(vs.root() / "l1", 8, 8, Default::default()),
        nn::linear(vs.root() / "l2", 8, 8, Default::default()),
    );
    let row = vs.root().randn("row", &[3], 0.0, 1.0);
    vs.double();
    let rows = Tensor::from_slice(&[0i64, 4, 2]);
    let cols = Tensor::from_slice(&[1i64, 1, 7]);
    let repeats = Tensor::from_slice(&[5i64, 5, 0, 5]);
    for n in [5i64, 7] {
        let x = Tensor::randn([n, 6, 8], (Kind::Double, CPU));
        let eager = || {
            let h = x.apply(&l1).tanh();
            let v = x.apply(&l2).sin();
            // [N, 6, 8] at rows (dim 1) and cols (dim 2): values [N, 3].
            let h = h.index_put(
                &[None, Some(&rows), Some(&cols)],
                &v.narrow(1, 0, 1).narrow(2, 0, 3).squeeze_dim(1),
                false,
            );
            // Separated by None: values [3, N, 6]... here broadcast as a learned row.
            let h4 = h.view([n, 2, 3, 8]);
            let h4 = h4.index_put(
                &[None, Some(&Tensor::from_slice(&[1i64, 0, 1])), None, Some(&cols)],
                &row.view([3, 1, 1]),
                false,
            );
            let h = h4.view([n, 6, 8]).index_put(&[None, None, Some(&repeats)], &v.narrow(2, 0, 4), true);
            h.square().mean(None)
        };
        let lazily = || {
            let lx = lazy(&x, 0);
            let h = lx.apply(&l1).tanh();
            let v = lx.apply(&l2).sin();
            let h = h.index_put(
                &[None, Some(&rows), Some(&cols)],
                &v.narrow(1, 0, 1).narrow(2, 0, 3).squeeze_dim(1),
                false,
            );
            let h4 = h.view([n, 2, 3, 8]);
            let h4 = h4.index_put(
                &[None, Some(&Tensor::from_slice(&[1i64, 0, 1])), None, Some(&cols)],
                &LazyTensor::fixed(&row).view([3, 1, 1]),
                false,
            );
            let h = h4.view([n, 6, 8]).index_put(&[None, None, Some(&repeats)], &v.narrow(2, 0, 4), true);
            h.square().mean(None)
        };
        check_tight(&vs, &format!("index_put n={n}"), &[1, 2, 3], eager, lazily);
    }
}
