//! tch's own idioms, run lazily with the import changed (`use toma::lazy::nn;` for
//! `use tch::nn;`) and the inputs wrapped: `nn::func_t` blocks behind `-> impl nn::ModuleT`,
//! operators with owned tensors on either side, `_default` pooling, and the optimizer's
//! `backward_step_clip` on a lazy loss, against the same code run eagerly.

use tch::nn as tch_nn;
use tch::{Device, IndexOp, Kind, Tensor};
use toma::lazy::nn::{self, ModuleT, OptimizerConfig};
use toma::lazy::{lazy, LazyError, LazyTensor, Options};

const VOCAB: i64 = 11;
const EMBD: i64 = 8;
const HEADS: i64 = 2;
const BLOCK: i64 = 6;

/// A minGPT-style attention block, written as tch's example writes it: a `func_t` closure
/// returned as `impl ModuleT`, a causal mask as a constant, `att * scalar`, owned sums.
fn attention(p: nn::Path) -> impl ModuleT + use<> {
    let key = nn::linear(&p / "key", EMBD, EMBD, Default::default());
    let query = nn::linear(&p / "query", EMBD, EMBD, Default::default());
    let value = nn::linear(&p / "value", EMBD, EMBD, Default::default());
    let proj = nn::linear(&p / "proj", EMBD, EMBD, Default::default());
    let mask = Tensor::ones([BLOCK, BLOCK], (Kind::Int64, p.device())).tril(0).view([1, 1, BLOCK, BLOCK]);
    nn::func_t(move |xs, train| {
        let (b, t, c) = xs.size3().unwrap();
        let split = |x: LazyTensor| x.view((b, t, HEADS, c / HEADS)).transpose(1, 2);
        let k = split(xs.apply(&key));
        let q = split(xs.apply(&query));
        let v = split(xs.apply(&value));
        let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / ((c / HEADS) as f64).sqrt());
        let att = att.masked_fill(&mask.i((.., .., ..t, ..t)).eq(0.), f64::NEG_INFINITY);
        let att = att.softmax(-1, None).dropout(0.0, train);
        let ys = att.matmul(&v).transpose(1, 2).contiguous().view((b, t, c));
        ys.apply(&proj)
    })
}

fn block(p: nn::Path) -> impl ModuleT + use<> {
    let ln1 = nn::layer_norm(&p / "ln1", vec![EMBD], Default::default());
    let ln2 = nn::layer_norm(&p / "ln2", vec![EMBD], Default::default());
    let attn = attention(&p / "attn");
    let up = nn::linear(&p / "up", EMBD, 4 * EMBD, Default::default());
    let down = nn::linear(&p / "down", 4 * EMBD, EMBD, Default::default());
    nn::func_t(move |xs, train| {
        let xs = xs + xs.apply(&ln1).apply_t(&attn, train);
        let ys = xs.apply(&ln2).apply(&up).gelu("none").apply(&down);
        xs + ys
    })
}

fn gpt(p: nn::Path) -> impl ModuleT + use<> {
    let tok_emb = nn::embedding(&p / "tok_emb", VOCAB, EMBD, Default::default());
    let pos_emb = p.zeros("pos_emb", &[1, BLOCK, EMBD]);
    let blocks = nn::seq_t().add(block(&p / "b0")).add(block(&p / "b1"));
    let head = nn::linear(&p / "head", EMBD, VOCAB, Default::default());
    nn::func_t(move |xs, train| {
        let (_, t) = xs.size2().unwrap();
        // An owned parameter slice on the right of `+`, as minGPT adds its positions.
        let h = xs.apply(&tok_emb) + pos_emb.i((.., ..t, ..));
        h.apply_t(&blocks, train).apply(&head)
    })
}

#[test]
fn a_func_t_model_behind_impl_module_t_trains_in_micro_batches_as_eagerly() {
    // The same model twice (copied: other tests draw from the global generator meanwhile),
    // one run eagerly, one lazily.
    let mut eager_vs = nn::VarStore::new(Device::Cpu);
    let eager_model = gpt(eager_vs.root());
    eager_vs.double();
    let mut lazy_vs = nn::VarStore::new(Device::Cpu);
    let lazy_model = gpt(lazy_vs.root());
    lazy_vs.double();
    lazy_vs.copy(&eager_vs).unwrap();
    // tch's optimizer config, built through toma's trait: the same AdamW, a step for both kinds.
    let mut eager_opt = nn::AdamW::default().build(&eager_vs, 1e-2).unwrap();
    let mut lazy_opt = nn::AdamW::default().build(&lazy_vs, 1e-2).unwrap();
    let tokens = Tensor::randint(VOCAB, [12, BLOCK], (Kind::Int64, Device::Cpu));
    let next = Tensor::randint(VOCAB, [12, BLOCK], (Kind::Int64, Device::Cpu));
    for step in 0..3 {
        // Eagerly: the func_t closures recorded and run at once, on tensors, through tch's traits.
        let logits = tokens.apply_t(&eager_model, true);
        let loss = logits.view([-1, VOCAB]).log_softmax(-1, None).nll_loss(&next.view([-1]));
        let eager_value = loss.double_value(&[]);
        eager_opt.backward_step_clip(&loss, 0.05);
        // Lazily, in micro-batches of 4 (3 per step).
        let (lx, ly) = lazy((&tokens, &next), 0);
        let loss = lx.apply_t(&lazy_model, true).view([-1, VOCAB]).log_softmax(-1, None).nll_loss(&ly.view([-1]));
        let value = lazy_opt.f_backward_step_clip_with(&loss, 0.05, &Options::new().micro_batch(4)).unwrap();
        assert!((value - eager_value).abs() < 1e-9, "step {step}: loss {value} lazily, {eager_value} eagerly");
        for (name, e) in eager_vs.variables() {
            let l = &lazy_vs.variables()[&name];
            let diff = (&e - l).abs().max().double_value(&[]);
            assert!(diff < 1e-9, "step {step}: {name} differs by {diff}");
        }
    }
}

#[test]
fn operators_take_tensors_owned_or_borrowed_on_either_side() {
    let a = Tensor::randn([4, 3], (Kind::Double, Device::Cpu));
    let w = Tensor::randn([3], (Kind::Double, Device::Cpu));
    let la = lazy(&a, 0);
    let cases: Vec<(LazyTensor, Tensor)> = vec![
        (&la + w.shallow_clone(), &a + &w),
        (la.clone() - w.shallow_clone(), &a - &w),
        (&w * &la, &w * &a),
        (w.shallow_clone() / la.clone(), &w / &a),
        (&w - la.clone(), &w - &a),
        (w.shallow_clone() + &la, &w + &a),
        (2.0 / &la, 2.0 / &a),
        (-(&la * 0.5), -(&a * 0.5)),
    ];
    for (k, (lazily, eagerly)) in cases.into_iter().enumerate() {
        let lazily = lazily.to_tensor().unwrap();
        assert!(lazily.allclose(&eagerly, 1e-12, 1e-12, false), "case {k}");
    }
    // Integer scalars, as tch takes them: an integer tensor keeps its kind (true division aside).
    let ids = Tensor::randint(10, [4, 3], (Kind::Int64, Device::Cpu));
    let lids = lazy(&ids, 0);
    let int_cases: Vec<(LazyTensor, Tensor)> = vec![
        (&lids + 1, &ids + 1),
        (2 * &lids, 2 * &ids),
        (lids.clone() - 3, &ids - 3),
        (5 - &lids, 5 - &ids),
        (&lids / 2, &ids / 2),
        (&la * 2, &a * 2),
        (1 - la.clone(), 1 - &a),
        (3 / &la, 3 / &a),
    ];
    for (k, (lazily, eagerly)) in int_cases.into_iter().enumerate() {
        let lazily = lazily.to_tensor().unwrap();
        assert_eq!(lazily.kind(), eagerly.kind(), "integer case {k}");
        let (l, e) = (lazily.to_kind(Kind::Double), eagerly.to_kind(Kind::Double));
        assert!(l.allclose(&e, 1e-12, 1e-12, false), "integer case {k}: {l} vs {e}");
    }
}

#[test]
fn default_pooling_is_tchs() {
    let x = Tensor::randn([3, 2, 8, 8], (Kind::Float, Device::Cpu));
    let lx = lazy(&x, 0);
    let max = lx.max_pool2d_default(2).to_tensor().unwrap();
    assert!(max.allclose(&x.max_pool2d_default(2), 1e-6, 1e-6, false));
    let avg = lx.avg_pool2d_default(4).to_tensor().unwrap();
    assert_eq!(avg.size(), [3, 2, 2, 2]);
    assert!(avg.allclose(&x.avg_pool2d_default(4), 1e-5, 1e-5, false));
}

#[test]
fn a_func_on_tensors_keeps_autograd() {
    let vs = nn::VarStore::new(Device::Cpu);
    let l = nn::linear(vs.root(), 3, 2, Default::default());
    let f = nn::func(move |xs| xs.apply(&l).tanh() * 2.0);
    let x = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
    let out = x.apply(&f);
    assert!(out.requires_grad());
    out.sum(Kind::Float).backward();
    for (name, v) in vs.variables() {
        assert!(v.grad().defined(), "{name} got no gradient");
    }
}

/// One closure body for tch's `nn::func` and toma's: ops with a direct path to tch's method,
/// and some without (integer scalars, a tensor on the left, indexing, `cat`, `topk`), which are
/// recorded and run at once.
macro_rules! mixed_body {
    ($nn:ident, $t:ident, $l:expr, $bias:expr) => {{
        let (l, bias) = ($l, $bias);
        $nn::func(move |xs| {
            let h = xs.apply(&l).tanh();
            let h = &bias + h * 2 - 1;
            let (top, _) = h.topk(2, -1, true, true);
            let parts = h.chunk(2, -1);
            let joined = $t::cat(&[&parts[1], &parts[0]], -1);
            let h = (joined + h.i((.., 0..1)) * (1.0 / 3.0)) / top.i((.., 0..1)).exp();
            let s: $t = 3 * h.softmax(-1, Kind::Float);
            s.square()
        })
    }};
}

#[test]
fn a_func_on_tensors_runs_as_tchs_closure() {
    let vs = nn::VarStore::new(Device::Cpu);
    let l = nn::linear(vs.root() / "l", 3, 4, Default::default());
    let bias = vs.root().randn("bias", &[4], 0.0, 1.0);
    let ours = mixed_body!(
        nn,
        LazyTensor,
        nn::Linear { ws: l.ws.shallow_clone(), bs: l.bs.as_ref().map(Tensor::shallow_clone) },
        bias.shallow_clone()
    );
    let theirs = mixed_body!(tch_nn, Tensor, l, bias.shallow_clone());
    let x = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
    let (a, b) = (x.apply(&ours), x.apply(&theirs));
    assert!(a.allclose(&b, 0.0, 0.0, false), "the same ops, the same values");
    // Autograd as tch's: the same gradients.
    let grads = |out: &Tensor| {
        vs.trainable_variables().iter_mut().for_each(|v| v.zero_grad());
        out.sum(Kind::Float).backward();
        vs.trainable_variables().iter().map(|v| v.grad().copy()).collect::<Vec<_>>()
    };
    let (ga, gb) = (grads(&a), grads(&b));
    assert!(ga.iter().zip(&gb).all(|(a, b)| a.allclose(b, 0.0, 0.0, false)));
    // libtorch's autocast applies to it as to tch's closure.
    let f = nn::func(|xs| xs.matmul(&xs.tr()) + 1);
    let x = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
    let y = toma::autocast(Device::Cpu, Kind::BFloat16, || x.apply(&f));
    let expected = toma::autocast(Device::Cpu, Kind::BFloat16, || x.matmul(&x.tr()) + 1);
    assert_eq!(y.kind(), Kind::BFloat16);
    assert!(y.allclose(&expected, 0.0, 0.0, false));
}

#[test]
fn a_failing_op_in_a_func_on_tensors_panics_as_tchs() {
    let f = nn::func(|xs| xs.matmul(xs));
    let x = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| x.apply(&f)));
    let message = caught.err().and_then(|e| e.downcast_ref::<String>().cloned()).expect("a panic with a message");
    assert!(message.contains("matmul") && message.contains("cannot be multiplied"), "{message}");
}

#[test]
fn an_empty_batch_is_a_clear_error() {
    let x = Tensor::zeros([0, 3], (Kind::Float, Device::Cpu));
    let vs = nn::VarStore::new(Device::Cpu);
    let l = nn::linear(vs.root(), 3, 2, Default::default());
    let loss = lazy(&x, 0).apply(&l).sum(None);
    match loss.backward() {
        Err(LazyError::EmptyBatch { shape, dim }) => {
            assert_eq!((shape, dim), (vec![0, 3], 0));
        }
        other => panic!("expected EmptyBatch, got {other:?}"),
    }
}

/// minGPT's own linear layer: weights transposed eagerly inside the body, a bias added.
#[derive(Debug)]
struct CustomLinear {
    ws: Tensor,
    bs: Tensor,
}

#[toma::lazy::module]
impl nn::Module for CustomLinear {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.matmul(&self.ws.tr()) + &self.bs
    }
}

/// A custom `ModuleT`, also written once.
#[derive(Debug)]
struct Scaled {
    gamma: Tensor,
}

#[toma::lazy::module]
impl ModuleT for Scaled {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let ys = xs.dropout(0.0, train) * &self.gamma;
        ys.tanh()
    }
}

#[test]
fn a_custom_module_written_once_has_the_full_batchs_gradients() {
    let vs = nn::VarStore::new(Device::Cpu);
    let l = CustomLinear { ws: vs.root().randn("w", &[5, 4], 0.0, 1.0), bs: vs.root().randn("b", &[5], 0.0, 1.0) };
    let s = Scaled { gamma: vs.root().randn("gamma", &[5], 0.0, 1.0) };
    let x = Tensor::randn([9, 4], (Kind::Float, Device::Cpu));
    let eager = x.apply(&l).apply_t(&s, true).sum(Kind::Float);
    eager.backward();
    let grads = |vs: &nn::VarStore| -> Vec<(String, Tensor)> {
        let mut v: Vec<_> = vs.variables().into_iter().map(|(n, t)| (n, t.grad().copy())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let want = grads(&vs);
    for (_, t) in vs.variables() {
        let _ = t.grad().zero_();
    }
    let value =
        lazy(&x, 0).apply(&l).apply_t(&s, true).sum(None).backward_with(&Options::new().micro_batch(2)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-4);
    for ((name, w), (_, g)) in want.iter().zip(grads(&vs)) {
        assert!(w.allclose(&g, 1e-5, 1e-5, false), "{name}: {w} eagerly, {g} in micro-batches");
    }
}

// How `vit_loss` broadcasts its CLS token: expanded (0), repeated (1), or expanded and stacked
// with the tokens' mean (2).
thread_local! {
    static REPEAT: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// A ViT's CLS token written tch's way: a parameter expanded (or repeated) to the batch and
/// concatenated with the patch tokens, plus a learned position table added to every sample.
fn vit_loss<T: toma::lazy::TensorOps + toma::lazy::Operators>(
    x: &T,
    y: &T,
    cls: &Tensor,
    pos: &Tensor,
    head: &nn::Linear,
) -> T
where
    nn::Linear: toma::lazy::Layer<T>,
{
    let b = x.size()[0];
    // tch's two ways to broadcast a learned token over the batch: expand (a view), repeat (a copy).
    let how = REPEAT.with(|r| r.get());
    let tokens = if how == 2 {
        // `stack` of the token (`[b, d]`) and the tokens' mean, then the tokens after them.
        let d = cls.size()[2];
        let row = T::constant(&cls.view([1, d])).expand([b, -1], false);
        let pair = T::stack(&[&row, &x.mean_dim([1], false, None)], 1);
        T::cat(&[&pair.narrow(1, 0, 1), x], 1)
    } else {
        let cls =
            if how == 1 { T::constant(cls).repeat([b, 1, 1]) } else { T::constant(cls).expand([b, -1, -1], false) };
        T::cat(&[&cls, x], 1)
    };
    let h = tokens + pos;
    h.i((.., 0, ..)).apply(head).log_softmax(-1, None).nll_loss(y)
}

#[test]
fn a_cls_token_expanded_to_the_batch_records_and_splits() {
    for how in 0..3 {
        REPEAT.with(|r| r.set(how));
        cls_token_splits();
    }
}

fn cls_token_splits() {
    let vs = nn::VarStore::new(Device::Cpu);
    let cls = vs.root().randn("cls", &[1, 1, 6], 0.0, 1.0);
    let pos = vs.root().randn("pos", &[1, 5, 6], 0.0, 1.0);
    let head = nn::linear(vs.root() / "head", 6, 3, Default::default());
    let x = Tensor::randn([10, 4, 6], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(3, [10], (Kind::Int64, Device::Cpu));
    let eager = vit_loss(&x, &y, &cls, &pos, &head);
    eager.backward();
    let want: Vec<Tensor> = [&cls, &pos].iter().map(|t| t.grad().copy()).collect();
    for (_, t) in vs.variables() {
        let _ = t.grad().zero_();
    }
    let (lx, ly) = lazy((&x, &y), 0);
    let loss = vit_loss(&lx, &ly, &cls, &pos, &head);
    let plan = loss.plan(toma::lazy::Mode::Backward, &Options::new().micro_batch(3)).unwrap();
    assert!(plan.splits(), "{plan}");
    let value = loss.backward_with(&Options::new().micro_batch(3)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-5);
    for (w, t) in want.iter().zip([&cls, &pos]) {
        assert!(w.allclose(&t.grad(), 1e-5, 1e-5, false), "{w} eagerly, {} in micro-batches", t.grad());
    }
}

std::thread_local! {
    static PANICKED_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Where `f` panicked: the file and line the panic reports.
fn panic_location(f: impl FnOnce()) -> String {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let at = info.location().map(|l| format!("{}:{}", l.file(), l.line()));
            if PANICKED_AT.with(|p| p.borrow().as_deref() == Some("armed")) {
                PANICKED_AT.with(|p| *p.borrow_mut() = at);
            } else {
                default(info);
            }
        }));
    });
    PANICKED_AT.with(|p| *p.borrow_mut() = Some("armed".into()));
    assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err(), "expected a panic");
    PANICKED_AT.with(|p| p.borrow_mut().take()).unwrap_or_default()
}

fn softmax_then_matmul<T: toma::lazy::TensorOps>(x: &T, w: &T) -> T {
    x.softmax(-1, Kind::Float).matmul(w)
}

#[test]
fn a_panicking_op_points_at_the_users_line() {
    // A hard-coded `Kind::Float` in an f64 model: tch refuses the matmul too; the panic must
    // name this file, not toma's.
    let x = Tensor::randn([4, 3], (Kind::Double, Device::Cpu));
    let w = Tensor::randn([3, 3], (Kind::Double, Device::Cpu));
    let lx = lazy(&x, 0);
    let here = file!();
    for at in [
        panic_location(|| drop(lx.softmax(-1, Kind::Float).matmul(&w))),
        panic_location(|| drop(softmax_then_matmul(&lx, &LazyTensor::fixed(&w)))),
        panic_location(|| drop(lx.softmax(-1, Kind::Float) * &w.i(0..2))),
    ] {
        assert!(at.starts_with(here), "panicked at {at}, not in {here}");
    }
}

#[test]
fn methods_of_tchs_examples_are_tchs() {
    let x = Tensor::randn([4, 6, 5], (Kind::Double, Device::Cpu));
    let w = Tensor::randn([5, 3], (Kind::Double, Device::Cpu));
    let lx = lazy(&x, 0);
    let same = |l: LazyTensor, t: Tensor| {
        let l = l.to_tensor().unwrap();
        assert_eq!(l.size(), t.size());
        assert!(l.allclose(&t, 1e-12, 1e-12, false));
    };
    same(lx.slice(1, 1, -1, 1), x.slice(1, 1, -1, 1));
    same(lx.slice(2, None, 3, 1), x.slice(2, None, 3, 1));
    same(lx.slice(1, -2, None, 1), x.slice(1, -2, None, 1));
    same(lx.slice(1, 2, 100, 1), x.slice(1, 2, 100, 1));
    same(lx.i((.., 0, ..)).tr().tr(), x.i((.., 0, ..)).tr().tr());
    same(lx.i((.., 0, ..)).mm(&w), x.i((.., 0, ..)).mm(&w));
    same(lx.copy(), x.copy());
    assert!(matches!(lx.f_slice(1, 0, 4, 2), Err(LazyError::Unsupported { .. })));
    assert!(lx.f_mm(&w).is_err(), "mm takes matrices only, as tch");
    assert!(x.f_mm(&w).is_err());
}

/// Batch norm in training, split under `allow_batch_mixing(true)`: its running statistics move
/// once per step, by the micro-batches' mean update, not once per micro-batch.
#[test]
fn running_statistics_move_once_per_split_step() {
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = nn::batch_norm1d(vs.root() / "bn", 3, Default::default());
    let x = Tensor::randn([16, 3], (Kind::Float, Device::Cpu)) * 2.0 + 1.0;
    let (mean0, var0) = (bn.running_mean.copy(), bn.running_var.copy());
    // Expected: each quarter's update from the same starting point, averaged.
    let mut want_mean = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    let mut want_var = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    for q in 0..4 {
        let rm = mean0.copy();
        let rv = var0.copy();
        let _ = x.narrow(0, 4 * q, 4).batch_norm(
            bn.ws.as_ref(),
            bn.bs.as_ref(),
            Some(&rm),
            Some(&rv),
            true,
            0.1,
            1e-5,
            false,
        );
        want_mean += rm / 4.0;
        want_var += rv / 4.0;
    }
    let options = Options::new().allow_batch_mixing(true).micro_batch(4);
    let loss = lazy(&x, 0).apply_t(&bn, true).square().sum(None);
    let plan = loss.plan(toma::lazy::Mode::Backward, &options).unwrap();
    assert_eq!(plan.chunks(), 4, "{plan}");
    loss.backward_with(&options).unwrap();
    assert!(bn.running_mean.allclose(&want_mean, 1e-6, 1e-6, false), "{} vs {want_mean}", bn.running_mean);
    assert!(bn.running_var.allclose(&want_var, 1e-6, 1e-6, false), "{} vs {want_var}", bn.running_var);
    // Unsplit, the one update is the full batch's, exactly.
    let mut bn_vs = nn::VarStore::new(Device::Cpu);
    let whole = nn::batch_norm1d(bn_vs.root() / "bn", 3, Default::default());
    bn_vs.copy(&vs).unwrap();
    let _ = x.apply_t(&whole, true);
    let _ = lazy(&x, 0).apply_t(&bn, true).square().sum(None).backward().unwrap();
    assert_eq!(bn.running_mean, whole.running_mean);
}

// The fast ResNet of tch's CIFAR example, in its idioms (smaller channels): `SequentialT`,
// `FuncT`, batch norm in training, `max_pool2d_default`, `flat_view`, `x * 0.125`.
mod fast_resnet {
    use tch::{Device, Kind, Tensor};
    use toma::lazy::lazy;
    use toma::lazy::nn::{self, FuncT, ModuleT, OptimizerConfig, SequentialT};

    fn conv_bn(vs: &nn::Path, c_in: i64, c_out: i64) -> SequentialT {
        let conv2d_cfg = nn::ConvConfig { padding: 1, bias: false, ..Default::default() };
        nn::seq_t()
            .add(nn::conv2d(vs, c_in, c_out, 3, conv2d_cfg))
            .add(nn::batch_norm2d(vs, c_out, Default::default()))
            .add_fn(|x| x.relu())
    }

    fn layer<'a>(vs: &nn::Path, c_in: i64, c_out: i64) -> FuncT<'a> {
        let pre = conv_bn(&vs.sub("pre"), c_in, c_out);
        let block1 = conv_bn(&vs.sub("b1"), c_out, c_out);
        let block2 = conv_bn(&vs.sub("b2"), c_out, c_out);
        nn::func_t(move |xs, train| {
            let pre = xs.apply_t(&pre, train).max_pool2d_default(2);
            let ys = pre.apply_t(&block1, train).apply_t(&block2, train);
            pre + ys
        })
    }

    fn fast_resnet(vs: &nn::Path) -> SequentialT {
        nn::seq_t()
            .add(conv_bn(&vs.sub("pre"), 3, 4))
            .add(layer(&vs.sub("layer1"), 4, 8))
            .add(conv_bn(&vs.sub("inter"), 8, 8))
            .add_fn(|x| x.max_pool2d_default(2))
            .add(layer(&vs.sub("layer2"), 8, 8))
            .add_fn(|x| x.max_pool2d_default(2).flat_view())
            .add(nn::linear(vs.sub("linear"), 8, 10, Default::default()))
            .add_fn(|x| x * 0.125)
    }

    #[test]
    fn trains_lazily_as_eagerly() {
        let mut eager_vs = nn::VarStore::new(Device::Cpu);
        let eager_net = fast_resnet(&eager_vs.root());
        eager_vs.double();
        let mut lazy_vs = nn::VarStore::new(Device::Cpu);
        let lazy_net = fast_resnet(&lazy_vs.root());
        lazy_vs.double();
        lazy_vs.copy(&eager_vs).unwrap();
        let sgd = || nn::Sgd { momentum: 0.9, dampening: 0., wd: 5e-4, nesterov: true };
        let mut eager_opt = sgd().build(&eager_vs, 0.1).unwrap();
        let mut lazy_opt = sgd().build(&lazy_vs, 0.1).unwrap();
        let images = Tensor::randn([6, 3, 16, 16], (Kind::Double, Device::Cpu));
        let labels = Tensor::randint(10, [6], (Kind::Int64, Device::Cpu));
        for step in 0..2 {
            let loss = eager_net.forward_t(&images, true).cross_entropy_for_logits(&labels);
            let eager_value = f64::try_from(&loss).unwrap();
            eager_opt.backward_step(&loss);
            // The one changed line: the batch wrapped. Batch norm in training mixes samples,
            // so the step runs whole (issue 25 splits it by recomputing).
            let (images, labels) = lazy((&images, &labels), 0);
            let loss = lazy_net.forward_t(&images, true).cross_entropy_for_logits(&labels);
            let value = lazy_opt.backward_step(&loss);
            // tch's `cross_entropy_for_logits` takes its log-softmax in f32 even for f64 logits;
            // the lazy one stays in the logits' kind: they agree to f32's precision.
            assert!((value - eager_value).abs() < 1e-6, "step {step}: {value} vs {eager_value}");
            for (name, e) in eager_vs.variables() {
                let l = &lazy_vs.variables()[&name];
                let diff = (&e - l).abs().max().double_value(&[]);
                assert!(diff < 1e-6, "step {step}: {name} differs by {diff}");
            }
        }
        let accuracy = lazy_net.batch_accuracy_for_logits(&images, &labels, Device::Cpu, 4);
        assert!((0.0..=1.0).contains(&accuracy));
    }
}

#[test]
fn argmax_stops_the_gradient_and_accuracy_is_a_mean() {
    let x = Tensor::randn([10, 5], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let y = Tensor::randint(5, [10], (Kind::Int64, Device::Cpu));
    // The largest logit picked by its position: the gradient flows through gather only.
    let eager = x.gather(-1, &x.argmax(-1, true), false).sum(Kind::Double);
    eager.backward();
    let want = x.grad().copy();
    let _ = x.grad().zero_();
    let lx = lazy(&x, 0);
    let value =
        lx.gather(-1, &lx.argmax(-1, true), false).sum(None).backward_with(&Options::new().micro_batch(3)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-9);
    assert!(x.grad().allclose(&want, 1e-12, 1e-12, false));
    let (lx, ly) = lazy((&x.detach(), &y), 0);
    let accuracy = lx.accuracy_for_logits(&ly);
    let split = accuracy.to_tensor_with(&Options::new().micro_batch(3)).unwrap().double_value(&[]);
    assert!((split - x.accuracy_for_logits(&y).double_value(&[])).abs() < 1e-6);
}

#[test]
fn gradients_through_topk_cumsum_and_roll_match_the_full_batch() {
    let x = Tensor::randn([9, 6, 5], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let w = Tensor::randn([3, 5], (Kind::Double, Device::Cpu));
    let eager =
        x.cumsum(1, None::<Kind>).roll([1], [2]).topk(3, 1, true, true).0.matmul(&w.tr()).square().mean(None::<Kind>);
    eager.backward();
    let want = x.grad().copy();
    let _ = x.grad().zero_();
    let lx = lazy(&x, 0);
    let loss =
        lx.cumsum(1, None::<Kind>).roll([1], [2]).topk(3, 1, true, true).0.matmul(&w.tr()).square().mean(None::<Kind>);
    let value = loss.backward_with(&Options::new().micro_batch(4)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-12);
    assert!(x.grad().allclose(&want, 1e-12, 1e-12, false));
}

#[test]
fn normalized_rows_have_the_full_batchs_gradients_even_at_zero() {
    // A zero row: the norm's gradient there is libtorch's 0, not a NaN.
    let x = Tensor::randn([8, 5], (Kind::Double, Device::Cpu));
    let _ = x.narrow(0, 3, 1).zero_();
    let x = x.set_requires_grad(true);
    let w = Tensor::randn([5], (Kind::Double, Device::Cpu));
    let eager = (x.norm_scalaropt_dim(2.0, [1], true).clamp_min(1e-12).expand_as(&x).reciprocal() * &x * &w)
        .sum(Kind::Double)
        + x.norm_scalaropt_dim(2.0, [1], false).sum(Kind::Double);
    eager.backward();
    let want = x.grad().copy();
    let _ = x.grad().zero_();
    let lx = lazy(&x, 0);
    let loss = (lx.normalize(2.0, 1, 1e-12) * &w).sum(None) + lx.norm_scalaropt_dim(2.0, [1], false).sum(None);
    let value = loss.backward_with(&Options::new().micro_batch(3)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-10);
    assert!(!bool::try_from(x.grad().isnan().any()).unwrap());
    assert!(x.grad().allclose(&want, 1e-10, 1e-10, false), "{} vs {want}", x.grad());
}

/// Mixed kinds promote as tch's ops promote them (a 0-dim operand of the same category defers
/// to the other's kind), and a `Float` parameter met by a `Double` input gets its gradient in
/// its own kind, split or not.
#[test]
fn mixed_kinds_promote_as_tchs_ops_do() {
    let kinds = [Kind::Float, Kind::Double, Kind::Int64, Kind::Half, Kind::Bool];
    let make = |kind: Kind, shape: &[i64]| match kind {
        Kind::Bool => Tensor::randn(shape, (Kind::Float, Device::Cpu)).gt(0.0),
        Kind::Int64 => Tensor::randint(5, shape, (Kind::Int64, Device::Cpu)) + 1,
        k => Tensor::randn(shape, (k, Device::Cpu)),
    };
    for &ka in &kinds {
        for &kb in &kinds {
            for b_shape in [&[4i64, 3][..], &[][..], &[3][..]] {
                let (a, b) = (make(ka, &[4, 3]), make(kb, b_shape));
                // A batch-sized operand is batched too; a smaller one is a fixed operand.
                let (la, lb) =
                    if b_shape.len() == 2 { lazy((&a, &b), 0) } else { (lazy(&a, 0), LazyTensor::fixed(&b)) };
                let what = format!("{ka:?} with {kb:?}{b_shape:?}");
                type Case = (&'static str, Result<Tensor, tch::TchError>, Result<LazyTensor, LazyError>);
                let cases: Vec<Case> = vec![
                    ("add", a.f_add(&b), la.f_add(&lb)),
                    ("mul", a.f_mul(&b), la.f_mul(&lb)),
                    ("div", a.f_div(&b), la.f_div(&lb)),
                    ("maximum", a.f_maximum(&b), la.f_maximum(&lb)),
                    ("where", a.f_where_self(&b.ne(0), &b), la.f_where_self(&lb.ne(0.0), &lb)),
                ];
                for (op, eager, lazily) in cases {
                    match (eager, lazily) {
                        (Ok(e), Ok(l)) => {
                            assert_eq!(l.kind(), e.kind(), "{op} {what}: kind");
                            let l = l.to_tensor_with(&Options::new().micro_batch(3)).unwrap();
                            assert_eq!(l.kind(), e.kind(), "{op} {what}: kind run");
                            let (l, e) = (l.to_kind(Kind::Double), e.to_kind(Kind::Double));
                            assert!(l.allclose(&e, 1e-3, 1e-3, true), "{op} {what}: {l} vs {e}");
                        }
                        (Err(_), Err(_)) => {}
                        (e, l) => panic!("{op} {what}: tch {:?}, lazy {:?}", e.map(|t| t.kind()), l.map(|t| t.kind())),
                    }
                }
            }
        }
    }
    // A Float parameter times a Double input: the product is Double, the parameter's gradient
    // Float, as eagerly.
    let w = Tensor::randn([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::randn([6, 3], (Kind::Double, Device::Cpu));
    let eager = (&x * &w).tanh().sum(Kind::Double);
    eager.backward();
    let want = w.grad().copy();
    let _ = w.grad().zero_();
    let lazily = (lazy(&x, 0) * &w).tanh().sum(None);
    assert_eq!(lazily.kind(), Kind::Double);
    lazily.backward_with(&Options::new().micro_batch(2)).unwrap();
    assert_eq!(w.grad().kind(), Kind::Float);
    assert!(w.grad().allclose(&want, 1e-6, 1e-6, false), "{} vs {want}", w.grad());
}

/// Three AdamW steps of a model with dropout, as tch's examples train: `backward_step`, then
/// the loss read with `f64::try_from`. Read after its step, a lazy loss is the step's value,
/// and reading it runs nothing: no forward with the updated parameters, no random numbers
/// drawn, so the lazy steps stay bit-for-bit those of eager tch (unsplit). Run in a child
/// process, alone: dropout draws from the global generator. (`log_softmax` with `nll_loss`:
/// tch's `cross_entropy_for_logits` takes its `log_softmax` in `Float` even of `Double` logits.)
#[test]
fn a_loss_read_after_its_step_is_the_steps_and_runs_nothing() {
    if std::env::var_os("TOMA_STEPPED_LOSS_CHILD").is_none() {
        let out = crate::support::child::run(
            "idioms::a_loss_read_after_its_step_is_the_steps_and_runs_nothing",
            "TOMA_STEPPED_LOSS_CHILD",
            "1",
        );
        out.assert_finished("stepped-loss ");
        return;
    }
    let train = |lazily: bool| -> (Vec<f64>, Vec<(String, Tensor)>, f64) {
        tch::manual_seed(7);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let (fc1, fc2) = (
            nn::linear(vs.root() / "fc1", 16, 32, Default::default()),
            nn::linear(vs.root() / "fc2", 32, 5, Default::default()),
        );
        vs.double();
        let x = Tensor::randn([24, 16], (Kind::Double, Device::Cpu));
        let y = Tensor::randint(5, [24], (Kind::Int64, Device::Cpu));
        let mut opt = nn::AdamW::default().build(&vs, 1e-2).unwrap();
        let mut read = Vec::new();
        for _ in 0..3 {
            if lazily {
                let (lx, ly) = lazy((&x, &y), 0);
                let loss = lx.apply(&fc1).relu().dropout(0.1, true).apply(&fc2).log_softmax(-1, None).nll_loss(&ly);
                let value = opt.backward_step(&loss);
                let after = f64::try_from(&loss).unwrap();
                assert_eq!(after, value, "the value the step computed");
                assert_eq!(format!("{loss}"), format!("{}", Tensor::from(value)), "Display prints it too");
                read.push(after);
            } else {
                let loss = x.apply(&fc1).relu().dropout(0.1, true).apply(&fc2).log_softmax(-1, None).nll_loss(&y);
                opt.backward_step(&loss);
                read.push(f64::try_from(&loss).unwrap());
            }
        }
        // The generator where the steps left it.
        let next = Tensor::rand([1], (Kind::Double, Device::Cpu)).double_value(&[0]);
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        (read, params, next)
    };
    let (eager, eager_params, eager_next) = train(false);
    let (lazy_read, lazy_params, lazy_next) = train(true);
    assert_eq!(lazy_read, eager, "losses read after each step");
    assert_eq!(lazy_next, eager_next, "reading the loss drew no random numbers");
    for ((name, e), (_, l)) in eager_params.iter().zip(&lazy_params) {
        assert!(e.equal(l), "{name} after 3 steps: eager and lazy differ");
    }
    println!("\nstepped-loss losses={lazy_read:?}");
}

/// tch's examples move each batch in the loop (`xs.to_device(device)`): on a lazy batch already
/// there it is the batch itself, in code written once over `TensorOps` too; another device is
/// refused, saying to move the tensors before `lazy(..)`.
#[test]
fn to_device_in_the_loop_stays_as_it_is() {
    use toma::lazy::{Layer, TensorOps};
    fn loss<T: TensorOps>(l: &nn::Linear, x: &T, y: &T, device: Device) -> T
    where
        nn::Linear: Layer<T>,
    {
        x.to_device(device).apply(l).cross_entropy_for_logits(&y.to_device(device))
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let l = nn::linear(vs.root(), 8, 4, Default::default());
    let x = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(4, [16], (Kind::Int64, Device::Cpu));
    let eager = loss(&l, &x, &y, Device::Cpu).double_value(&[]);
    let (lx, ly) = lazy((&x, &y), 0);
    let lazily = loss(&l, &lx, &ly, Device::Cpu).backward_with(&Options::new().micro_batch(4)).unwrap();
    assert!((eager - lazily).abs() < 1e-6, "{eager} eagerly, {lazily} lazily");
    let err = lx.f_to_device(Device::Cuda(0)).unwrap_err();
    assert!(matches!(err, LazyError::Argument { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("to_device") && text.contains("before lazy"), "{text}");
}

/// `zeros_like`, `ones_like` and `full_like` in code written once over `TensorOps`: per sample,
/// so a split step gives the eager step's loss and gradients (a smoothed target built from
/// `full_like`, a mask from `zeros_like`).
#[test]
fn like_constructors_in_generic_code_split_exactly() {
    use toma::lazy::{Layer, Operators, TensorOps};
    fn loss<T: TensorOps + Operators>(l: &nn::Linear, x: &T, y: &T) -> T
    where
        nn::Linear: Layer<T>,
    {
        let logits = x.apply(l);
        let smoothed = logits.full_like(0.1 / 4.0) + y.one_hot(4).to_kind(Kind::Double) * 0.9;
        let floor = logits.zeros_like() + logits.ones_like() * -30.0;
        let logp = logits.maximum(&floor).log_softmax(-1, None);
        (smoothed * logp).sum_dim_intlist(-1, false, None).mean(None).neg()
    }
    let mut vs = nn::VarStore::new(Device::Cpu);
    let l = nn::linear(vs.root(), 8, 4, Default::default());
    vs.double();
    let x = Tensor::randn([16, 8], (Kind::Double, Device::Cpu));
    let y = Tensor::randint(4, [16], (Kind::Int64, Device::Cpu));
    let eager = loss(&l, &x, &y);
    eager.backward();
    let eager_grad = l.ws.grad().copy();
    let mut w = l.ws.grad();
    let _ = w.zero_();
    let (lx, ly) = lazy((&x, &y), 0);
    let lazily = loss(&l, &lx, &ly).backward_with(&Options::new().micro_batch(4)).unwrap();
    assert!((eager.double_value(&[]) - lazily).abs() < 1e-12, "{} eagerly, {lazily} lazily", eager.double_value(&[]));
    let diff = (l.ws.grad() - eager_grad).abs().max().double_value(&[]);
    assert!(diff < 1e-12, "weight gradients differ by {diff:e}");
    let ones = lx.ones_like().to_tensor().unwrap();
    assert_eq!(ones.size(), [16, 8]);
    assert_eq!(ones.sum(Kind::Double).double_value(&[]), 128.0);
}

/// tch's `nn::GroupNorm` as a layer, `x.apply(&gn)`, with its own epsilon read: statistics per
/// sample and group, so micro-batches give the eager step's loss and gradients.
#[test]
fn group_norm_is_a_layer_that_splits_exactly() {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let conv = nn::conv2d(vs.root() / "conv", 3, 8, 3, Default::default());
    let gn = nn::group_norm(vs.root() / "gn", 4, 8, nn::GroupNormConfig { eps: 1e-3, ..Default::default() });
    let head = nn::linear(vs.root() / "head", 8, 5, Default::default());
    vs.double();
    let x = Tensor::randn([12, 3, 6, 6], (Kind::Double, Device::Cpu));
    let y = Tensor::randint(5, [12], (Kind::Int64, Device::Cpu));
    let eager = x
        .apply(&conv)
        .apply(&gn)
        .relu()
        .mean_dim([2, 3].as_slice(), false, None)
        .apply(&head)
        .log_softmax(-1, None)
        .nll_loss(&y);
    eager.backward();
    let grads = crate::grad::grads(&vs);
    crate::grad::zero_grads(&vs);
    let (lx, ly) = lazy((&x, &y), 0);
    let loss = lx
        .apply(&conv)
        .apply(&gn)
        .relu()
        .mean_dim([2, 3].as_slice(), false, None)
        .apply(&head)
        .log_softmax(-1, None)
        .nll_loss(&ly);
    let value = loss.backward_with(&Options::new().micro_batch(4)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-12, "{value} lazily, {} eagerly", eager.double_value(&[]));
    for (name, got) in crate::grad::grads(&vs) {
        let g = &grads[&name];
        let diff = (&got - g).abs().max().double_value(&[]);
        assert!(diff < 1e-12, "gradients differ by {diff:e}");
    }
}

/// tch's `nn::conv3d` as a layer, padded and strided: micro-batches give the eager step's
/// loss and gradients.
#[test]
fn conv3d_is_a_layer_that_splits_exactly() {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let config = nn::ConvConfig { stride: 2, padding: 1, ..Default::default() };
    let conv = nn::conv3d(vs.root() / "conv", 2, 4, 3, config);
    vs.double();
    let x = Tensor::randn([6, 2, 5, 6, 7], (Kind::Double, Device::Cpu));
    let eager = x.apply(&conv).tanh().square().mean(None);
    eager.backward();
    let grad = conv.ws.grad().copy();
    let mut g = conv.ws.grad();
    let _ = g.zero_();
    let value =
        lazy(&x, 0).apply(&conv).tanh().square().mean(None).backward_with(&Options::new().micro_batch(2)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-12);
    let diff = (conv.ws.grad() - grad).abs().max().double_value(&[]);
    assert!(diff < 1e-12, "weight gradients differ by {diff:e}");
}

/// tch's `ModuleT::batch_accuracy_for_logits` stays callable on an `impl ModuleT` once the import
/// is `toma::lazy::nn::ModuleT` (tch's trait is not in scope here).
#[test]
fn batch_accuracy_stays_in_scope_with_the_switched_import() {
    // A concrete type, as a user's own `struct Net`: its methods come from the traits in scope.
    fn net(vs: &nn::Path) -> nn::FuncT<'static> {
        let l = nn::linear(vs / "l", 4, 3, Default::default());
        nn::func_t(move |xs, _train| xs.apply(&l))
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let m = net(&vs.root());
    let xs = Tensor::randn([10, 4], (Kind::Float, Device::Cpu));
    let ys = Tensor::randint(3, [10], (Kind::Int64, Device::Cpu));
    let accuracy = m.batch_accuracy_for_logits(&xs, &ys, Device::Cpu, 4);
    let want = m.forward_t(&xs, false).accuracy_for_logits(&ys).double_value(&[]);
    assert!((accuracy - want).abs() < 1e-6, "{accuracy} vs {want}");
}

/// tch's method calls on a lazy value, as tch's examples write them: `layer.forward(&xs)` (vae's
/// `self.fc21.forward(&h1)`) and a custom `ModuleT`'s `net.forward_t(&xs, train)` (mnist_conv's
/// `impl ModuleT for Net`), the same calls as on tensors, splitting exactly.
#[test]
fn layers_take_lazy_values_by_the_same_method_call() {
    use toma::lazy::nn::Module;
    let vs = nn::VarStore::new(Device::Cpu);
    let fc = nn::linear(vs.root() / "fc", 4, 5, Default::default());
    let l = CustomLinear { ws: vs.root().randn("w", &[5, 5], 0.0, 1.0), bs: vs.root().randn("b", &[5], 0.0, 1.0) };
    let s = Scaled { gamma: vs.root().randn("gamma", &[5], 0.0, 1.0) };
    let x = Tensor::randn([9, 4], (Kind::Float, Device::Cpu));
    let eager = s.forward_t(&l.forward(&fc.forward(&x)), true).sum(Kind::Float);
    eager.backward();
    let want = crate::grad::grads(&vs);
    crate::grad::zero_grads(&vs);
    let lx = lazy(&x, 0);
    let loss = s.forward_t(&l.forward(&fc.forward(&lx)), true).sum(None);
    let value = loss.backward_with(&Options::new().micro_batch(2)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-4, "{value} vs {}", eager.double_value(&[]));
    for (name, got) in crate::grad::grads(&vs) {
        let w = &want[&name];
        assert!(got.allclose(w, 1e-5, 1e-5, false));
    }
}

/// A port compiles without warnings: the imports a custom layer's `impl` names (`Tensor`, the
/// switched `ModuleT`) stay used under `#[toma::lazy::module]` (this module denies unused ones;
/// nothing else in it names them).
mod no_unused_imports_after_a_port {
    #![deny(unused_imports)]
    use tch::Tensor;
    use toma::lazy::nn::{Module, ModuleT};

    #[derive(Debug)]
    pub struct Net {
        pub fc: toma::lazy::nn::Linear,
    }

    #[toma::lazy::module]
    impl ModuleT for Net {
        fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
            xs.apply(&self.fc).dropout(0.0, train)
        }
    }

    #[derive(Debug)]
    pub struct Shift;

    #[toma::lazy::module]
    impl Module for Shift {
        fn forward(&self, xs: &Tensor) -> Tensor {
            xs + 1.0
        }
    }
}

#[test]
fn a_ported_layer_runs_on_both_kinds() {
    use no_unused_imports_after_a_port::{Net, Shift};
    use toma::lazy::nn::Module;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = Net { fc: nn::linear(vs.root(), 3, 2, Default::default()) };
    let x = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    let eager = Shift.forward(&net.forward_t(&x, false));
    let lazily = Shift.forward(&net.forward_t(&lazy(&x, 0), false)).to_tensor().unwrap();
    assert!(eager.allclose(&lazily, 1e-6, 1e-6, false));
}

/// `topk`, `sort`, `einsum`, `copy`, `onehot` and `accuracy_for_logits` in code written once over
/// `TensorOps`: the same values on a tensor and on a lazy one.
#[test]
fn tensor_ops_has_topk_sort_einsum_and_friends() {
    use toma::lazy::TensorOps;
    fn features<T: TensorOps>(x: &T, y: &T) -> T {
        let (top, _) = x.topk(2, -1, true, true);
        let (sorted, _) = x.sort(-1, false);
        let gram = T::einsum("bi,bj->bij", &[&top, &sorted.narrow(1, 0, 2)], None);
        let hot = y.onehot(5);
        let acc = x.accuracy_for_logits(y).expand([x.size()[0]], false);
        T::cat(&[&gram.flatten(1, -1), &hot.to_kind(Kind::Double), &x.copy()], 1)
            .sum_dim_intlist(1, false, None)
            .add(&acc)
    }
    let x = Tensor::randn([8, 5], (Kind::Double, Device::Cpu));
    let y = Tensor::randint(5, [8], (Kind::Int64, Device::Cpu));
    let eager = features(&x, &y);
    let (lx, ly) = lazy((&x, &y), 0);
    let lazily = features(&lx, &ly).to_tensor_with(&Options::new().micro_batch(8)).unwrap();
    assert!(eager.allclose(&lazily, 1e-12, 1e-12, false), "{eager} vs {lazily}");
}

/// Every method of `LazyTensor` that tch's `Tensor` has is in `TensorOps`, so a model written
/// once over `T: TensorOps` can call it: a family file's `#[lazy_only]` method must be written
/// into `TensorOps` by hand (`src/lazy/tensor_ops.rs`) or named below with why it is not.
#[test]
fn every_lazy_method_tch_has_is_in_tensor_ops() {
    // Lazy-only on purpose: tch has no method of that name, or one of another signature.
    const OUTSIDE: [(&str, &str); 10] = [
        ("rdiv_scalar", "tch writes it `s / x` (an operator)"),
        ("normalize", "tch has no such method"),
        ("index_put", "tch's takes `&[Option<Tensor>]` and a value of the same kind"),
        ("sort_stable", "tch's takes `stable: bool` first"),
        ("cosine_embedding_loss", "not yet"),
        ("margin_ranking_loss", "not yet"),
        ("triplet_margin_loss", "not yet"),
        ("ctc_loss", "not yet"),
        ("ctc_loss_tensor", "not yet"),
        ("flat_view", "in TensorOps without a fallible form (tch has none)"),
    ];
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let ops = std::fs::read_to_string(root.join("src/lazy/tensor_ops.rs")).unwrap();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root.join("src/lazy/ops")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.trim() != "#[lazy_only]" {
                continue;
            }
            let Some(name) = lines[i..].iter().take(6).find_map(|l| {
                let rest = l.trim().strip_prefix("pub fn f_")?;
                Some(rest.split(['(', '<']).next().unwrap().to_string())
            }) else {
                continue;
            };
            let in_trait = ops.contains(&format!("fn f_{name}(")) || ops.contains(&format!("fn {name}("));
            if !in_trait && !OUTSIDE.iter().any(|(n, _)| *n == name) {
                missing.push(format!("{name} ({})", path.display()));
            }
        }
    }
    assert!(missing.is_empty(), "LazyTensor methods missing from TensorOps: {missing:?}");
}

/// vae's loss as tch writes it, `recon_x.binary_cross_entropy::<Tensor>(&x, None, Sum)`: the
/// turbofish names the weight's type on a lazy value too, and the sum splits exactly.
#[test]
fn tchs_generic_binary_cross_entropy_compiles_unchanged() {
    let x = Tensor::rand([8, 6], (Kind::Double, Device::Cpu));
    let recon = Tensor::randn([8, 6], (Kind::Double, Device::Cpu)).sigmoid();
    let eager = recon.binary_cross_entropy::<Tensor>(&x, None, tch::Reduction::Sum);
    let (recon_x, x) = lazy((&recon, &x), 0);
    let lazily = recon_x
        .binary_cross_entropy::<Tensor>(&x, None, tch::Reduction::Sum)
        .to_tensor_with(&Options::new().micro_batch(2))
        .unwrap();
    assert!(eager.allclose(&lazily, 1e-12, 1e-12, false), "{eager} vs {lazily}");
}

/// vae's reparameterization as tch writes it, `mu + std.randn_like() * std` (and a `bernoulli`
/// mask of computed probabilities), in code written
/// once: from the same seed, a step in micro-batches draws the eager step's noise (drawn for the
/// whole batch when recorded) and gets its loss and gradients. Run in a child process, alone:
/// other tests' draws from the global generator would fall between the seed and the noise.
#[test]
fn randn_like_draws_the_eager_steps_noise_in_a_split_step() {
    use toma::lazy::{Layer, Operators, TensorOps};
    if std::env::var_os("TOMA_RANDN_LIKE_CHILD").is_none() {
        let out = crate::support::child::run(
            "idioms::randn_like_draws_the_eager_steps_noise_in_a_split_step",
            "TOMA_RANDN_LIKE_CHILD",
            "1",
        );
        out.assert_finished("randn-like ");
        return;
    }
    fn loss<T: TensorOps + Operators>(mu: &nn::Linear, logvar: &nn::Linear, x: &T) -> T
    where
        nn::Linear: Layer<T>,
    {
        let (mu, logvar) = (x.apply(mu), x.apply(logvar));
        let std = (logvar * 0.5).exp();
        let z = mu + std.randn_like() * std + x.narrow(1, 0, 3).rand_like();
        // A mask drawn with probabilities the step computes: libtorch's CPU kernel draws a
        // uniform per element, as `bernoulli` does lazily (drawn when recorded).
        let keep = x.narrow(1, 3, 3).sigmoid().bernoulli();
        (z * keep).square().mean(None)
    }
    let mut vs = nn::VarStore::new(Device::Cpu);
    let mu = nn::linear(vs.root() / "mu", 6, 3, Default::default());
    let logvar = nn::linear(vs.root() / "logvar", 6, 3, Default::default());
    vs.double();
    let x = Tensor::randn([12, 6], (Kind::Double, Device::Cpu));
    tch::manual_seed(77);
    let eager = loss(&mu, &logvar, &x);
    eager.backward();
    let want = crate::grad::grads(&vs);
    crate::grad::zero_grads(&vs);
    tch::manual_seed(77);
    let lazily = loss(&mu, &logvar, &lazy(&x, 0)).backward_with(&Options::new().micro_batch(4)).unwrap();
    assert!((lazily - eager.double_value(&[])).abs() < 1e-12, "{lazily} vs {}", eager.double_value(&[]));
    let mut worst: f64 = 0.0;
    for (name, got) in crate::grad::grads(&vs) {
        let w = &want[&name];
        worst = worst.max((&got - w).abs().max().double_value(&[]));
    }
    assert!(worst < 1e-12, "gradients differ by {worst:e}");
    println!("\nrandn-like loss={lazily} worst={worst:e}");
}

/// Cross-attention's learned queries, tch's way: a parameter passed through its layer, expanded
/// to the batch, then multiplied with the batch's keys (`matmul`, `bmm`). The expand meets the
/// batch in the product and is per sample there: micro-batches give the eager step's loss and
/// gradients (1e-12, f64), the queries' gradient summed over all of them.
#[test]
fn learned_queries_expanded_over_the_batch_split_exactly() {
    use toma::lazy::{Layer, TensorOps};
    fn loss<T: TensorOps>(latents: &Tensor, proj: &nn::Linear, x: &T, bmm: bool) -> T
    where
        nn::Linear: Layer<T>,
    {
        let b = x.size()[0];
        let queries = T::constant(&latents.apply(proj)).expand([b, -1, -1], false);
        let keys = x.transpose(1, 2);
        let scores = if bmm { queries.bmm(&keys) } else { queries.matmul(&keys) };
        scores.softmax(-1, None).matmul(x).square().mean(None)
    }
    for bmm in [false, true] {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let _ = vs.root().randn("latents", &[1, 4, 8], 0.0, 1.0);
        let proj = nn::linear(vs.root() / "proj", 8, 8, Default::default());
        vs.double();
        let latents = vs.variables()["latents"].shallow_clone();
        let x = Tensor::randn([10, 5, 8], (Kind::Double, Device::Cpu));
        let eager = loss(&latents, &proj, &x, bmm);
        eager.backward();
        let want = crate::grad::grads(&vs);
        crate::grad::zero_grads(&vs);
        let value = loss(&latents, &proj, &lazy(&x, 0), bmm).backward_with(&Options::new().micro_batch(3)).unwrap();
        assert!((value - eager.double_value(&[])).abs() < 1e-12, "bmm {bmm}: {value} vs {}", eager.double_value(&[]));
        for (name, got) in crate::grad::grads(&vs) {
            let w = &want[&name];
            let diff = (&got - w).abs().max().double_value(&[]);
            assert!(diff < 1e-12, "bmm {bmm}: gradients differ by {diff:e}");
        }
    }
}

/// A Perceiver's cross-attention through `scaled_dot_product_attention`: learned queries (a
/// parameter through its layer, expanded to the batch) attend over the batch's tokens; split
/// exactly against eager (1e-12, f64).
#[test]
fn learned_queries_attend_over_the_batch_in_sdpa() {
    use toma::lazy::TensorOps;
    fn loss<T: TensorOps>(queries: &Tensor, x: &T) -> T {
        let b = x.size()[0];
        let q = T::constant(queries).expand([b, -1, -1, -1], false);
        T::scaled_dot_product_attention(&q, x, x, None::<&T>, 0.0, false, None, false).square().mean(None)
    }
    let mut vs = nn::VarStore::new(Device::Cpu);
    let _ = vs.root().randn("latents", &[1, 2, 4, 8], 0.0, 1.0);
    let proj = nn::linear(vs.root() / "proj", 8, 8, Default::default());
    vs.double();
    let latents = vs.variables()["latents"].shallow_clone();
    let x = Tensor::randn([10, 2, 5, 8], (Kind::Double, Device::Cpu));
    let eager = loss(&latents.apply(&proj), &x);
    eager.backward();
    let want = crate::grad::grads(&vs);
    crate::grad::zero_grads(&vs);
    let value = loss(&latents.apply(&proj), &lazy(&x, 0)).backward_with(&Options::new().micro_batch(3)).unwrap();
    assert!((value - eager.double_value(&[])).abs() < 1e-12, "{value} vs {}", eager.double_value(&[]));
    for (name, got) in crate::grad::grads(&vs) {
        let w = &want[&name];
        let diff = (&got - w).abs().max().double_value(&[]);
        assert!(diff < 1e-12, "gradients differ by {diff:e}");
    }
}

/// A Perceiver's learned latent array, written once: expanded to the batch, then through a
/// layer norm and linear projections *before* it meets the batch (queries of a cross-attention
/// over the inputs, by `matmul` and by `scaled_dot_product_attention`), then a residual sum and
/// an MLP on the latents. In f64, split in micro-batches of 3, its loss and gradients equal the
/// eager whole batch's within 1e-9.
fn perceiver_loss<T: toma::lazy::TensorOps>(
    x: &T,
    y: &T,
    latents: &Tensor,
    layers: &[nn::Linear],
    norm: &nn::LayerNorm,
    sdpa: bool,
) -> T
where
    nn::Linear: toma::lazy::Layer<T>,
    nn::LayerNorm: toma::lazy::Layer<T>,
{
    let b = x.size()[0];
    let lat = T::constant(latents).expand([b, -1, -1], false);
    let q = lat.apply(norm).apply(&layers[0]);
    let (k, v) = (x.apply(&layers[1]), x.apply(&layers[2]));
    let attended = if sdpa {
        T::scaled_dot_product_attention(&q, &k, &v, None, 0.0, false, None, false)
    } else {
        q.matmul(&k.transpose(-2, -1)).mul_scalar(0.25).softmax(-1, None).matmul(&v)
    };
    let h = lat.add(&attended);
    let h = h.add(&h.apply(&layers[3]).gelu("none"));
    h.mean_dim([1], false, None).apply(&layers[4]).log_softmax(-1, None).nll_loss(y)
}

#[test]
fn a_latent_array_through_layers_before_it_meets_the_batch_splits_exactly() {
    for sdpa in [false, true] {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let r = vs.root();
        let latents = r.randn("latents", &[4, 16], 0.0, 1.0);
        let norm = nn::layer_norm(&r / "norm", vec![16], Default::default());
        let dims = [(16, 16), (8, 16), (8, 16), (16, 16), (16, 3)];
        let layers: Vec<nn::Linear> = dims
            .iter()
            .enumerate()
            .map(|(i, &(a, o))| nn::linear(&r / format!("l{i}"), a, o, Default::default()))
            .collect();
        vs.double();
        let x = Tensor::randn([10, 5, 8], (Kind::Double, Device::Cpu));
        let y = Tensor::randint(3, [10], (Kind::Int64, Device::Cpu));
        let eager = perceiver_loss(&x, &y, &latents, &layers, &norm, sdpa);
        eager.backward();
        let want = crate::grad::grads(&vs);
        crate::grad::zero_grads(&vs);
        let (lx, ly) = lazy((&x, &y), 0);
        let loss = perceiver_loss(&lx, &ly, &latents, &layers, &norm, sdpa);
        let options = Options::new().micro_batch(3);
        let value = loss.backward_with(&options).unwrap();
        assert!((value - eager.double_value(&[])).abs() <= 1e-9 * value.abs(), "sdpa {sdpa}: loss {value}");
        // Relative to the largest gradient of all: the keys' bias has a gradient of zero up to
        // rounding (softmax ignores a constant added to every score).
        let scale = want.values().map(|w| w.abs().max().double_value(&[])).fold(1e-12, f64::max);
        for (name, got) in crate::grad::grads(&vs) {
            let off = (&want[&name] - got).abs().max().double_value(&[]) / scale;
            assert!(off < 1e-9, "sdpa {sdpa}: {name} differs by {off:e}");
        }
    }
}

/// tch's spellings used by tch-rs's programs (PPO's `min_other`, `view_as`, `expand_as`,
/// `type_as`, `l1_loss`, `hardtanh`, `selu`, `sign`): the values and gradients of eager tch,
/// whole and in micro-batches of 3 of 8.
#[test]
fn tchs_other_spellings_record_as_eagerly() {
    type Loss = fn(&LazyTensor) -> LazyTensor;
    type Eager = fn(&Tensor) -> Tensor;
    let cases: [(&str, Eager, Loss); 10] = [
        ("min_other", |x| x.min_other(&x.tanh()).sum(None), |x| x.min_other(&x.tanh()).sum(None)),
        ("max_other", |x| x.max_other(&x.sin()).sum(None), |x| x.max_other(&x.sin()).sum(None)),
        ("view_as", |x| x.view([-1, 12]).tanh().view_as(x).sum(None), |x| x.view([-1, 12]).tanh().view_as(x).sum(None)),
        (
            "reshape_as",
            |x| x.transpose(1, 2).sigmoid().reshape_as(x).sum(None),
            |x| x.transpose(1, 2).sigmoid().reshape_as(x).sum(None),
        ),
        (
            "expand_as",
            |x| x.narrow(2, 0, 1).expand_as(x).tanh().sum(None),
            |x| x.narrow(2, 0, 1).expand_as(x).tanh().sum(None),
        ),
        (
            "type_as",
            |x| x.type_as(&x.to_kind(Kind::Double)).exp().sum(None),
            |x| x.type_as(&x.to_kind(Kind::Double)).exp().sum(None),
        ),
        ("l1_loss", |x| x.l1_loss(&x.cos(), tch::Reduction::Mean), |x| x.l1_loss(&x.cos(), tch::Reduction::Mean)),
        ("hardtanh", |x| (x * 2.0).hardtanh().sum(None), |x| (x * 2.0).hardtanh().sum(None)),
        ("selu", |x| x.selu().sum(None), |x| x.selu().sum(None)),
        ("sign", |x| (x * x.sign()).sum(None), |x| (x * x.sign()).sum(None)),
    ];
    for (name, eager, lazily) in cases {
        let mut x = Tensor::randn([8, 3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let expected = eager(&x);
        expected.backward();
        let grad = x.grad().copy();
        for micro in [8usize, 3] {
            x.zero_grad();
            let value = lazily(&lazy(&x, 0)).backward_with(&Options::new().micro_batch(micro)).unwrap();
            assert!((value - expected.double_value(&[])).abs() < 1e-4, "{name}, micro-batch {micro}: the loss");
            let diff = (x.grad() - &grad).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "{name}, micro-batch {micro}: the gradient differs by {diff}");
        }
    }
}

/// An elementwise op keeps a transposed operand's memory order, as libtorch's `TensorIterator`
/// does, so a `reshape` after it copies where eager tch's copies (attention's `(q.transpose(1,
/// 2) * scale).reshape(..)`): the values and gradients of eager tch, whole and in micro-batches.
#[test]
fn elementwise_ops_on_transposed_values_reshape_as_eagerly() {
    type Case = fn(&LazyTensor, &LazyTensor) -> LazyTensor;
    type Eager = fn(&Tensor, &Tensor) -> Tensor;
    let cases: [(&str, Eager, Case); 6] = [
        ("unary", |a, _| a.transpose(1, 2).tanh().reshape([8, 12]), |a, _| a.transpose(1, 2).tanh().reshape([8, 12])),
        (
            "scalar",
            |a, _| (a.transpose(1, 2) * 2.0).reshape([8, 12]),
            |a, _| (a.transpose(1, 2) * 2.0).reshape([8, 12]),
        ),
        (
            "both transposed",
            |a, b| (a.transpose(1, 2) + b.transpose(1, 2)).reshape([8, 12]),
            |a, b| (a.transpose(1, 2) + b.transpose(1, 2)).reshape([8, 12]),
        ),
        (
            "first decides",
            |a, b| (a.transpose(1, 2) * b.view([8, 4, 3])).reshape([8, 12]),
            |a, b| (a.transpose(1, 2) * b.view([8, 4, 3])).reshape([8, 12]),
        ),
        (
            "pow",
            |a, _| a.transpose(1, 2).pow_tensor_scalar(2.0).reshape([8, 12]),
            |a, _| a.transpose(1, 2).pow_tensor_scalar(2.0).reshape([8, 12]),
        ),
        (
            "where",
            |a, b| a.transpose(1, 2).where_self(&b.transpose(1, 2).gt(0.0), &b.transpose(1, 2)).reshape([8, 12]),
            |a, b| a.transpose(1, 2).where_self(&b.transpose(1, 2).gt(0.0), &b.transpose(1, 2)).reshape([8, 12]),
        ),
    ];
    let y = Tensor::randn([8, 3, 4], (Kind::Float, Device::Cpu));
    for (name, eager, lazily) in cases {
        let mut x = Tensor::randn([8, 3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let expected = eager(&x, &y).sin().sum(None);
        expected.backward();
        let grad = x.grad().copy();
        for micro in [8usize, 3] {
            x.zero_grad();
            let (lx, ly) = lazy((&x, &y), 0);
            let value = lazily(&lx, &ly).sin().sum(None).backward_with(&Options::new().micro_batch(micro)).unwrap();
            assert!((value - expected.double_value(&[])).abs() < 1e-4, "{name}, micro-batch {micro}: the loss");
            let diff = (x.grad() - &grad).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "{name}, micro-batch {micro}: the gradient differs by {diff}");
        }
    }
}

/// tch-rs's a2c holds its model as a boxed closure over tensors (`Box<dyn Fn(&Tensor) ->
/// (Tensor, Tensor)>`). Ported, the closure's types name `LazyTensor`; its body, the update
/// (`gather` of the actions taken, `detach` of the advantages, `sum_dim_intlist` and `mean` in
/// `Kind::Float`, `backward_step_clip`) and acting (the policy read for an observation) are as
/// written. Three updates give the eager losses and weights.
#[test]
fn a_boxed_closure_model_trains_as_tchs_a2c_does() {
    type Eager = Box<dyn Fn(&Tensor) -> (Tensor, Tensor)>;
    type Lazy = Box<dyn Fn(&LazyTensor) -> (LazyTensor, LazyTensor)>;
    let (steps, procs, obs, nact) = (5i64, 4i64, 10i64, 3i64);
    let eager_vs = tch_nn::VarStore::new(Device::Cpu);
    let lazy_vs = nn::VarStore::new(Device::Cpu);
    let eager_model: Eager = {
        let p = eager_vs.root();
        let seq = tch_nn::seq().add(tch_nn::linear(&p / "l1", obs, 32, Default::default())).add_fn(|xs| xs.relu());
        let (critic, actor) = (
            tch_nn::linear(&p / "cl", 32, 1, Default::default()),
            tch_nn::linear(&p / "al", 32, nact, Default::default()),
        );
        Box::new(move |xs: &Tensor| {
            let xs = xs.apply(&seq);
            (xs.apply(&critic), xs.apply(&actor))
        })
    };
    let lazy_model: Lazy = {
        let p = lazy_vs.root();
        let seq = nn::seq().add(nn::linear(&p / "l1", obs, 32, Default::default())).add_fn(|xs| xs.relu());
        let (critic, actor) =
            (nn::linear(&p / "cl", 32, 1, Default::default()), nn::linear(&p / "al", 32, nact, Default::default()));
        Box::new(move |xs: &LazyTensor| {
            let xs = xs.apply(&seq);
            (xs.apply(&critic), xs.apply(&actor))
        })
    };
    let mut lazy_vs = lazy_vs;
    lazy_vs.copy(&eager_vs).unwrap();
    let mut eager_opt = tch_nn::Adam::default().build(&eager_vs, 1e-2).unwrap();
    let mut lazy_opt = nn::Adam::default().build(&lazy_vs, 1e-2).unwrap();
    let s = Tensor::randn([steps * procs, obs], (Kind::Float, Device::Cpu));
    let actions = Tensor::randint(nact, [steps * procs], (Kind::Int64, Device::Cpu));
    let returns = Tensor::randn([steps * procs, 1], (Kind::Float, Device::Cpu));
    // The update as upstream writes it, for either kind (`$s` the states, `$model` the model).
    macro_rules! a2c_loss {
        ($model:expr, $s:expr, $actions:expr, $returns:expr) => {{
            let (critic, actor) = $model($s);
            let critic = critic.view([steps, procs]);
            let actor = actor.view([steps, procs, -1]);
            let log_probs = actor.log_softmax(-1, Kind::Float);
            let probs = actor.softmax(-1, Kind::Float);
            let action_log_probs = log_probs.gather(2, &$actions.view([steps, procs, 1]), false).squeeze_dim(-1);
            let dist_entropy = (-log_probs * probs).sum_dim_intlist(-1, false, Kind::Float).mean(Kind::Float);
            let advantages = $returns.view([steps, procs]) - critic;
            let value_loss = (&advantages * &advantages).mean(Kind::Float);
            let action_loss = (-advantages.detach() * action_log_probs).mean(Kind::Float);
            value_loss * 0.5 + action_loss - dist_entropy * 0.01
        }};
    }
    for step in 0..3 {
        let expected = a2c_loss!(eager_model, &s, actions, returns);
        eager_opt.backward_step_clip(&expected, 0.5);
        let (ls, la, lr) = lazy((&s, &actions, &returns), 0);
        let loss = a2c_loss!(lazy_model, &ls, la, lr);
        let value = lazy_opt.f_backward_step_clip_with(&loss, 0.5, &Options::new()).unwrap();
        let expected = expected.double_value(&[]);
        assert!((value - expected).abs() <= 1e-5 * expected.abs().max(1.0), "step {step}: {value} against {expected}");
        let lazy_vars = lazy_vs.variables();
        for (name, t) in eager_vs.variables() {
            let diff = (&t - &lazy_vars[&name]).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "step {step}: {name} differs by {diff}");
        }
    }
    // Acting: the policy for one observation, read as a tensor.
    let observation = Tensor::randn([1, obs], (Kind::Float, Device::Cpu));
    let (_, actor) = lazy_model(&lazy(&observation, None));
    let probs = Tensor::try_from(&actor.softmax(-1, Kind::Float)).unwrap();
    let (_, expected) = eager_model(&observation);
    assert!(probs.allclose(&expected.softmax(-1, Kind::Float), 1e-6, 1e-6, false));
}

/// tch-rs's a2c keeps its rollout as upstream stores it, steps by processes (`s_states`:
/// `[NSTEPS + 1, NPROCS, ..]`), and views its steps' rows as one batch for the model
/// (`.view([NSTEPS * NPROCS, ..])`) and back (`critic.view([NSTEPS, NPROCS])`). Wrapped over its
/// steps (`lazy((&s_states.narrow(0, 0, NSTEPS), &s_actions, &returns), 0)`), each micro-batch
/// is whole steps of every process: the update splits in micro-batches of 2 steps (2, 2 and 1
/// of 5) with the eager update's losses and weights.
#[test]
fn a2cs_rollout_wrapped_over_its_steps_splits_exactly() {
    let (steps, procs, obs, nact) = (5i64, 4i64, 10i64, 3i64);
    let eager_vs = tch_nn::VarStore::new(Device::Cpu);
    let p = eager_vs.root();
    let seq = tch_nn::seq().add(tch_nn::linear(&p / "l1", obs, 32, Default::default())).add_fn(|xs| xs.relu());
    let (critic, actor) =
        (tch_nn::linear(&p / "cl", 32, 1, Default::default()), tch_nn::linear(&p / "al", 32, nact, Default::default()));
    let eager_model = move |xs: &Tensor| {
        let xs = xs.apply(&seq);
        (xs.apply(&critic), xs.apply(&actor))
    };
    let mut lazy_vs = nn::VarStore::new(Device::Cpu);
    let p = lazy_vs.root();
    let seq = nn::seq().add(nn::linear(&p / "l1", obs, 32, Default::default())).add_fn(|xs| xs.relu());
    let (critic, actor) =
        (nn::linear(&p / "cl", 32, 1, Default::default()), nn::linear(&p / "al", 32, nact, Default::default()));
    let lazy_model = move |xs: &LazyTensor| {
        let xs = xs.apply(&seq);
        (xs.apply(&critic), xs.apply(&actor))
    };
    lazy_vs.copy(&eager_vs).unwrap();
    let mut eager_opt = tch_nn::Adam::default().build(&eager_vs, 1e-2).unwrap();
    let mut lazy_opt = nn::Adam::default().build(&lazy_vs, 1e-2).unwrap();
    // The update as upstream writes it, for either kind.
    macro_rules! a2c_loss {
        ($model:expr, $states:expr, $actions:expr, $returns:expr) => {{
            let (critic, actor) = $model(&$states.view([steps * procs, obs]));
            let critic = critic.view([steps, procs]);
            let actor = actor.view([steps, procs, -1]);
            let log_probs = actor.log_softmax(-1, Kind::Float);
            let probs = actor.softmax(-1, Kind::Float);
            let action_log_probs = log_probs.gather(2, &$actions.unsqueeze(-1), false).squeeze_dim(-1);
            let dist_entropy = (-log_probs * probs).sum_dim_intlist(-1, false, Kind::Float).mean(Kind::Float);
            let advantages = $returns - critic;
            let value_loss = (&advantages * &advantages).mean(Kind::Float);
            let action_loss = (-advantages.detach() * action_log_probs).mean(Kind::Float);
            value_loss * 0.5 + action_loss - dist_entropy * 0.01
        }};
    }
    for (update, micro) in [5usize, 2, 2].into_iter().enumerate() {
        let s_states = Tensor::randn([steps + 1, procs, obs], (Kind::Float, Device::Cpu));
        let s_actions = Tensor::randint(nact, [steps, procs], (Kind::Int64, Device::Cpu));
        let s_returns = Tensor::randn([steps + 1, procs], (Kind::Float, Device::Cpu));
        let (states, returns) = (s_states.narrow(0, 0, steps), s_returns.narrow(0, 0, steps));
        let expected = a2c_loss!(eager_model, states, s_actions, &returns);
        eager_opt.backward_step_clip(&expected, 0.5);
        let (states, actions, returns) = lazy((&states, &s_actions, &returns), 0);
        let loss = a2c_loss!(lazy_model, states, actions, returns);
        let value = lazy_opt.f_backward_step_clip_with(&loss, 0.5, &Options::new().micro_batch(micro)).unwrap();
        let expected = expected.double_value(&[]);
        assert!(
            (value - expected).abs() <= 1e-5 * expected.abs().max(1.0),
            "update {update}: {value} against {expected}"
        );
        let lazy_vars = lazy_vs.variables();
        for (name, t) in eager_vs.variables() {
            let diff = (&t - &lazy_vars[&name]).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "update {update}, micro-batch {micro}: {name} differs by {diff}");
        }
    }
}
