//! Mixed precision: lazy steps recorded in a `toma::autocast` region against eager autocast on
//! the CPU in `BFloat16`. An unsplit step is bit-identical to eager autocast (loss, gradients and
//! parameters over three SGD steps after `zero_grad()`); a split step equals the same
//! micro-batches run eagerly under autocast and summed.

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use toma::lazy::{lazy, Layer, Mode, Options, TensorOps};

const CPU: Device = Device::Cpu;

/// The three models of the issue, small: an MLP, a CNN, and a pre-norm transformer block with
/// scaled dot-product attention, each written once over `TensorOps`.
enum Net {
    Mlp(nn::Linear, nn::Linear, nn::Linear),
    Cnn(nn::Conv2D, nn::Conv2D, nn::Linear),
    Block {
        ln1: nn::LayerNorm,
        qkv: nn::Linear,
        proj: nn::Linear,
        ln2: nn::LayerNorm,
        fc: nn::Linear,
        head: nn::Linear,
    },
}

const D: i64 = 32;
const T: i64 = 8;

impl Net {
    fn new(vs: &nn::VarStore, which: &str) -> Net {
        let r = vs.root();
        let c = Default::default;
        match which {
            "mlp" => Net::Mlp(
                nn::linear(&r / "l1", 48, 64, c()),
                nn::linear(&r / "l2", 64, 64, c()),
                nn::linear(&r / "l3", 64, 10, c()),
            ),
            "cnn" => {
                let same = nn::ConvConfig { padding: 1, ..Default::default() };
                Net::Cnn(
                    nn::conv2d(&r / "c1", 3, 8, 3, same),
                    nn::conv2d(&r / "c2", 8, 16, 3, same),
                    nn::linear(&r / "fc", 16 * 4 * 4, 10, c()),
                )
            }
            _ => Net::Block {
                ln1: nn::layer_norm(&r / "ln1", vec![D], Default::default()),
                qkv: nn::linear(&r / "qkv", D, 3 * D, c()),
                proj: nn::linear(&r / "proj", D, D, c()),
                ln2: nn::layer_norm(&r / "ln2", vec![D], Default::default()),
                fc: nn::linear(&r / "fc", D, D, c()),
                head: nn::linear(&r / "head", D, 10, c()),
            },
        }
    }

    fn data(&self, n: i64) -> (Tensor, Tensor) {
        let x = match self {
            Net::Mlp(..) => Tensor::randn([n, 48], (Kind::Float, CPU)),
            Net::Cnn(..) => Tensor::randn([n, 3, 16, 16], (Kind::Float, CPU)),
            Net::Block { .. } => Tensor::randn([n, T, D], (Kind::Float, CPU)),
        };
        (x, Tensor::randint(10, [n], (Kind::Int64, CPU)))
    }

    fn loss<X: TensorOps>(&self, x: &X, y: &X) -> X
    where
        nn::Linear: Layer<X>,
        nn::Conv2D: Layer<X>,
        nn::LayerNorm: Layer<X>,
    {
        match self {
            Net::Mlp(l1, l2, l3) => x.apply(l1).relu().apply(l2).relu().apply(l3).cross_entropy_for_logits(y),
            Net::Cnn(c1, c2, fc) => {
                let h = x.apply(c1).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
                let h = h.apply(c2).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
                h.flatten(1, -1).apply(fc).log_softmax(-1, None).nll_loss(y)
            }
            Net::Block { ln1, qkv, proj, ln2, fc, head } => {
                let n = x.size()[0];
                let qkv = x.apply(ln1).apply(qkv);
                let heads = |i: i64| qkv.narrow(2, i * D, D).reshape([n, T, 4, D / 4]).transpose(1, 2);
                let attended =
                    X::scaled_dot_product_attention(&heads(0), &heads(1), &heads(2), None, 0.0, true, None, false);
                let h = x.add(&attended.transpose(1, 2).reshape([n, T, D]).apply(proj));
                let h = h.add(&h.apply(ln2).apply(fc).gelu("none"));
                h.mean_dim([1], false, None).apply(head).cross_entropy_for_logits(y)
            }
        }
    }
}

fn values(vs: &nn::VarStore) -> Vec<Tensor> {
    vs.trainable_variables().iter().map(|v| v.copy()).collect()
}

/// Three SGD steps of `which` after `zero_grad()`, eagerly under autocast and lazily recorded in
/// the region (in micro-batches of `micro` where given, else whole): the lazy run's losses,
/// gradients and parameters against eager autocast's, bit for bit when whole; split, against
/// the same micro-batches run eagerly under autocast and summed.
fn three_steps(which: &str, micro: Option<i64>) {
    let n = 8;
    let eager_vs = nn::VarStore::new(CPU);
    let eager_net = Net::new(&eager_vs, which);
    let mut lazy_vs = nn::VarStore::new(CPU);
    let lazy_net = Net::new(&lazy_vs, which);
    lazy_vs.copy(&eager_vs).unwrap();
    let (x, y) = eager_net.data(n);
    let mut eager_opt = nn::Sgd::default().build(&eager_vs, 0.1).unwrap();
    let mut lazy_opt = nn::Sgd::default().build(&lazy_vs, 0.1).unwrap();
    for (e, l) in values(&eager_vs).iter().zip(&values(&lazy_vs)) {
        assert!(e.equal(l), "{which}: the same weights to start from");
    }
    for step in 0..3 {
        eager_opt.zero_grad();
        let eager_loss = match micro {
            None => {
                let loss = toma::autocast(CPU, Kind::BFloat16, || eager_net.loss(&x, &y));
                loss.backward();
                loss.double_value(&[])
            }
            Some(m) => {
                let mut total = 0.0;
                for start in (0..n).step_by(m as usize) {
                    let (xs, ys) = (x.narrow(0, start, m), y.narrow(0, start, m));
                    let loss = toma::autocast(CPU, Kind::BFloat16, || eager_net.loss(&xs, &ys)) * (m as f64 / n as f64);
                    loss.backward();
                    total += loss.double_value(&[]);
                }
                total
            }
        };
        lazy_opt.zero_grad();
        let loss = toma::autocast(CPU, Kind::BFloat16, || {
            let (lx, ly) = lazy((&x, &y), 0);
            lazy_net.loss(&lx, &ly)
        });
        let options = match micro {
            Some(m) => Options::new().micro_batch(m as usize),
            None => Options::new(),
        };
        let lazy_loss = loss.backward_with(&options).unwrap();
        let what = format!("{which} step {step} micro {micro:?}");
        let (eg, lg) = (crate::grad::grads(&eager_vs), crate::grad::grads(&lazy_vs));
        for (e, l) in eg.values().zip(lg.values()) {
            assert_eq!(l.kind(), Kind::Float, "{what}: gradients in the parameters' kind");
            if micro.is_none() {
                assert!(e.equal(l), "{what}: gradients differ by {}", (e - l).abs().max());
            } else {
                let scale = e.abs().max().double_value(&[]).max(1e-12);
                let off = (e - l).abs().max().double_value(&[]) / scale;
                assert!(off < 1e-6, "{what}: gradients differ by {off:e} (relative)");
            }
        }
        if micro.is_none() {
            assert_eq!(lazy_loss, eager_loss, "{what}: loss");
        } else {
            assert!((lazy_loss - eager_loss).abs() <= 1e-6 * eager_loss.abs(), "{what}: {lazy_loss} vs {eager_loss}");
        }
        eager_opt.step();
        lazy_opt.step();
        if micro.is_none() {
            for (e, l) in values(&eager_vs).iter().zip(&values(&lazy_vs)) {
                assert!(e.equal(l), "{what}: parameters differ");
            }
        }
    }
}

#[test]
fn an_unsplit_step_is_bit_identical_to_eager_autocast() {
    for which in ["mlp", "cnn", "block"] {
        three_steps(which, None);
    }
}

#[test]
fn a_split_step_equals_the_micro_batches_under_eager_autocast() {
    for which in ["mlp", "cnn", "block"] {
        three_steps(which, Some(4));
    }
}

/// The step runs in the lower precision: the products' outputs (and the casts autograd keeps)
/// are `BFloat16` in the plan, the loss `Float`, and the printed plan says so.
#[test]
fn a_step_recorded_in_a_region_plans_its_casts() {
    tch::manual_seed(6);
    let vs = nn::VarStore::new(CPU);
    let net = Net::new(&vs, "mlp");
    // Enough samples that the activations, halved, outweigh the weights' 16-bit copies.
    let (x, y) = net.data(256);
    let (lx, ly) = lazy((&x, &y), 0);
    let plain = net.loss(&lx, &ly).plan(Mode::Backward, &Options::new()).unwrap();
    let loss = toma::autocast(CPU, Kind::BFloat16, || net.loss(&lx, &ly));
    assert_eq!(loss.kind(), Kind::Float, "cross-entropy in Float");
    let plan = loss.plan(Mode::Backward, &Options::new()).unwrap();
    let text = plan.to_string();
    let kinds = |name: &str| plan.ops().iter().filter(|o| o.name == name).map(|o| o.kind).collect::<Vec<_>>();
    assert_eq!(kinds("linear"), vec![Kind::BFloat16; 3], "{text}");
    // Each linear's input, weight and bias; the input of the second and third is already BFloat16.
    assert_eq!(kinds("autocast").len(), 8, "{text}");
    // The logits go to Float for the loss, as tch's log-softmax takes them.
    assert!(text.contains("autocast: 7 casts to BFloat16, 1 cast to Float"), "{text}");
    assert!(plan.peak_bytes() < plain.peak_bytes(), "{} vs {}", plan.peak_bytes(), plain.peak_bytes());
    // Outside the region nothing is cast.
    assert!(net
        .loss(&lx, &ly)
        .plan(Mode::Backward, &Options::new())
        .unwrap()
        .ops()
        .iter()
        .all(|o| o.name != "autocast"));
}

#[test]
fn tch_kinds_autocast_does_not_lower_to_are_refused() {
    let err = toma::autocast::AutocastGuard::new(CPU, Kind::Double).unwrap_err();
    assert!(err.to_string().contains("Kind::BFloat16 or Kind::Half"), "{err}");
}

/// toma's SGD (its steps take lazy losses), learning rate 0.1.
fn toma_sgd(vs: &nn::VarStore) -> toma::lazy::nn::Optimizer {
    <nn::Sgd as toma::lazy::nn::OptimizerConfig>::build(nn::Sgd::default(), vs, 0.1).unwrap()
}

fn mlp_loss(net: &Net, x: &Tensor, y: &Tensor) -> toma::lazy::LazyTensor {
    let (lx, ly) = lazy((x, y), 0);
    net.loss(&lx, &ly)
}

/// A power-of-two scale is exact: in `Float`, three scaled steps (whole, then in micro-batches)
/// leave the parameters bit-identical to three plain steps.
#[test]
fn a_scaled_step_in_float_is_the_plain_step() {
    use toma::lazy::nn::GradScaler;
    for micro in [None, Some(4)] {
        let plain_vs = nn::VarStore::new(CPU);
        let plain_net = Net::new(&plain_vs, "mlp");
        let mut scaled_vs = nn::VarStore::new(CPU);
        let scaled_net = Net::new(&scaled_vs, "mlp");
        scaled_vs.copy(&plain_vs).unwrap();
        let (x, y) = plain_net.data(8);
        let options = micro.map_or_else(Options::new, |m| Options::new().micro_batch(m));
        let mut plain_opt = toma_sgd(&plain_vs);
        let mut scaled_opt = toma_sgd(&scaled_vs);
        let mut scaler = GradScaler::new();
        for step in 0..3 {
            let plain = plain_opt.f_backward_step_with(&mlp_loss(&plain_net, &x, &y), &options).unwrap();
            let scaled = scaler.backward_step_with(&mut scaled_opt, &mlp_loss(&scaled_net, &x, &y), &options).unwrap();
            assert!(scaled.stepped && scaled.scale == 65536.0, "{micro:?} step {step}: {scaled:?}");
            assert_eq!(plain, scaled.value, "{micro:?} step {step}: the loss, unscaled");
            for (a, b) in values(&plain_vs).iter().zip(&values(&scaled_vs)) {
                assert!(a.equal(b), "{micro:?} step {step}: parameters differ");
            }
        }
    }
}

/// An infinity in one sample of the second micro-batch makes that micro-batch's gradients
/// infinite: the whole step is skipped (no parameter moves), the scale halves; the next clean
/// step steps, and two finite steps in a row double the scale (`growth(2.0, 2)`).
#[test]
fn an_overflow_in_one_micro_batch_skips_the_whole_step() {
    use toma::lazy::nn::GradScaler;
    let vs = nn::VarStore::new(CPU);
    let net = Net::new(&vs, "mlp");
    let (x, y) = net.data(8);
    let bad = x.copy();
    let _ = bad.get(6).get(3).fill_(f64::INFINITY);
    let mut opt = toma_sgd(&vs);
    let mut scaler = GradScaler::new().with_scale(1024.0).unwrap().growth(2.0, 2).unwrap();
    let options = Options::new().micro_batch(4);
    let before = values(&vs);
    let step = scaler.backward_step_with(&mut opt, &mlp_loss(&net, &bad, &y), &options).unwrap();
    assert!(!step.stepped && step.scale == 1024.0 && scaler.scale() == 512.0, "{step:?}");
    for (a, b) in before.iter().zip(&values(&vs)) {
        assert!(a.equal(b), "a skipped step moves nothing");
    }
    for expected in [512.0, 1024.0] {
        let step = scaler.backward_step_with(&mut opt, &mlp_loss(&net, &x, &y), &options).unwrap();
        assert!(step.stepped && step.value.is_finite(), "{step:?}");
        assert_eq!(scaler.scale(), expected);
    }
    assert!(!before[0].equal(&values(&vs)[0]), "clean steps step");
    assert!(GradScaler::new().with_scale(0.0).is_err() && GradScaler::new().growth(1.0, 3).is_err());
}

/// `Half` on the CPU: a region in `Half` with the scaler, three steps of the MLP, split in two:
/// the products run in `Half`, the loss is finite and the steps step.
#[test]
fn half_autocast_with_the_scaler_trains_on_the_cpu() {
    use toma::lazy::nn::GradScaler;
    let vs = nn::VarStore::new(CPU);
    let net = Net::new(&vs, "mlp");
    let (x, y) = net.data(8);
    let mut opt = toma_sgd(&vs);
    let mut scaler = GradScaler::new();
    let mut losses = Vec::new();
    for _ in 0..3 {
        let loss = toma::autocast(CPU, Kind::Half, || mlp_loss(&net, &x, &y));
        let plan = loss.plan(Mode::Backward, &Options::new()).unwrap();
        assert!(plan.ops().iter().any(|o| o.name == "linear" && o.kind == Kind::Half), "{plan}");
        let step = scaler.backward_step_with(&mut opt, &loss, &Options::new().micro_batch(4)).unwrap();
        assert!(step.stepped, "{step:?}");
        losses.push(step.value);
    }
    assert!(losses.iter().all(|l| l.is_finite()) && losses[2] < losses[0], "{losses:?}");
}
