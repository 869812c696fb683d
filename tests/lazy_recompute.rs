//! Recomputing activations against the eager full batch, under budgets the whole batch does
//! not fit: batch norm in training and an InfoNCE loss (neither may be split), dropout
//! replayed, running statistics updated once, a recomputing plan in micro-batches, the error
//! when nothing fits, and measured peaks held to the budget.
//!
//! One test binary of its own, its tests one at a time: libtorch's random generator and the
//! CPU allocator's counter are process-wide.
#![cfg(feature = "tch")]

use std::sync::{Mutex, MutexGuard};

use tch::{Device, Kind, Tensor};
use toma::lazy::nn::{self, ModuleT, OptimizerConfig, SequentialT};
use toma::lazy::{lazy, LazyError, LazyTensor, Mode, Options, Recompute};
use toma::memory;

const CPU: Device = Device::Cpu;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The plan of `loss` in `mode`, after measuring what this machine prices by no rule (with the
/// room of no budget, as a first step without one would): a plan itself runs nothing, and
/// refuses what it lacks where the CPU's allocator counts.
fn planned(loss: &LazyTensor, mode: Mode, options: &Options) -> Result<toma::lazy::Plan, LazyError> {
    loss.calibrate(mode, &Options::new())?;
    loss.plan(mode, options)
}

/// The whole batch's planned peak as it is, recomputing nothing.
fn whole_peak(loss: &LazyTensor) -> u64 {
    planned(loss, Mode::Backward, &Options::new().recompute(Recompute::Never).budget(u64::MAX / 4))
        .expect("a plan")
        .full_batch_peak_bytes()
}

/// Runs the backward under `options`, returning the loss and the counter's peak above what was
/// live before.
fn measured_backward(loss: &LazyTensor, options: &Options) -> (f64, u64) {
    let before = memory::cpu_allocator_stats().expect("tracking").allocated;
    assert!(memory::reset_cpu_peak());
    let value = loss.backward_with(options).unwrap_or_else(|e| panic!("{e}"));
    let after = memory::cpu_allocator_stats().expect("tracking");
    (value, after.peak_allocated - before)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Every variable (parameters and running statistics) of two stores within `tol`.
fn assert_same_variables(eager: &nn::VarStore, lazy: &nn::VarStore, tol: f64, what: &str) {
    for (name, e) in eager.variables() {
        let l = &lazy.variables()[&name];
        let diff = max_diff(&e, l);
        assert!(diff <= tol, "{what}: {name} differs by {diff:e}");
    }
}

fn conv_bn(vs: &nn::Path, c_in: i64, c_out: i64) -> SequentialT {
    let cfg = nn::ConvConfig { padding: 1, bias: false, ..Default::default() };
    nn::seq_t()
        .add(nn::conv2d(vs, c_in, c_out, 3, cfg))
        .add(nn::batch_norm2d(vs, c_out, Default::default()))
        .add_fn(|x| x.relu())
}

/// A fast-ResNet-style stack: batch norm in training, residual blocks, pooling, a linear
/// head. Deep enough that activations, not one convolution's scratch space, set its peak.
fn bn_cnn(vs: &nn::Path) -> impl ModuleT + use<> {
    let stem = conv_bn(&vs.sub("stem"), 3, 16);
    let blocks: Vec<(SequentialT, SequentialT)> = (0..6)
        .map(|k| (conv_bn(&vs.sub(format!("b{k}a")), 16, 16), conv_bn(&vs.sub(format!("b{k}b")), 16, 16)))
        .collect();
    let head = nn::linear(vs.sub("head"), 16 * 4 * 4, 10, Default::default());
    nn::func_t(move |xs, train| {
        let mut x = xs.apply_t(&stem, train);
        for (a, b) in &blocks {
            x = &x + x.apply_t(a, train).apply_t(b, train);
        }
        x.max_pool2d_default(2).flat_view().apply(&head)
    })
}

/// Trains `steps` steps as tch users do (`zero_grad`, backward, step), eagerly and lazily under
/// `options`, and holds the lazy run to the eager one: loss and every variable within `tol`.
/// Returns the lazy steps' planned peaks, budgets and measured peaks.
fn train_both<M: ModuleT>(
    build: impl Fn(&nn::Path) -> M,
    x: &Tensor,
    y: &Tensor,
    steps: usize,
    budget_fraction: f64,
    recompute: Recompute,
    tol: f64,
) -> Vec<(toma::lazy::Plan, u64, u64)> {
    let mut eager_vs = nn::VarStore::new(CPU);
    let eager_net = build(&eager_vs.root());
    eager_vs.double();
    let mut lazy_vs = nn::VarStore::new(CPU);
    let lazy_net = build(&lazy_vs.root());
    lazy_vs.double();
    lazy_vs.copy(&eager_vs).unwrap();
    let sgd = nn::Sgd { momentum: 0.9, ..Default::default() };
    let mut eager_opt = sgd.build(&eager_vs, 0.05).unwrap();
    let mut lazy_opt = sgd.build(&lazy_vs, 0.05).unwrap();
    let mut runs = Vec::new();
    for step in 0..steps {
        eager_opt.zero_grad();
        let loss = x.apply_t(&eager_net, true).log_softmax(-1, Kind::Double).nll_loss(y);
        let eager_value = loss.double_value(&[]);
        loss.backward();
        eager_opt.step();

        lazy_opt.zero_grad();
        let (lx, ly) = lazy((x, y), 0);
        let loss = lx.apply_t(&lazy_net, true).log_softmax(-1, Kind::Double).nll_loss(&ly);
        let budget = (whole_peak(&loss) as f64 * budget_fraction) as u64;
        let options = Options::new().budget(budget).recompute(recompute);
        let plan = planned(&loss, Mode::Backward, &options).unwrap_or_else(|e| panic!("step {step}: {e}"));
        let (value, measured) = measured_backward(&loss, &options);
        lazy_opt.step();
        assert!(
            (value - eager_value).abs() <= tol * eager_value.abs().max(1.0),
            "step {step}: {value} vs {eager_value}"
        );
        assert_same_variables(&eager_vs, &lazy_vs, tol, &format!("step {step}"));
        runs.push((plan, budget, measured));
    }
    runs
}

#[test]
fn a_batch_norm_cnn_trains_at_55_percent_of_its_peak() {
    let _serial = serial();
    assert!(memory::track_cpu_allocations());
    let x = Tensor::randn([32, 3, 8, 8], (Kind::Double, CPU));
    let y = Tensor::randint(10, [32], (Kind::Int64, CPU));
    let runs = train_both(bn_cnn, &x, &y, 3, 0.55, Recompute::Auto, 1e-6);
    for (step, (plan, budget, measured)) in runs.iter().enumerate() {
        println!(
            "step {step}: planned {} measured {measured} budget {budget} ({:.1}% of it), {} segments: {}",
            plan.peak_bytes(),
            100.0 * *measured as f64 / *budget as f64,
            plan.segments().len(),
            plan.reason()
        );
        assert!(plan.recomputes() && !plan.splits(), "step {step}: {plan}");
        assert!(plan.reason().contains("batch_norm"), "the op that rules out splitting is named: {}", plan.reason());
        // The printed plan and the picture say what runs twice, and the estimated time.
        let text = plan.to_string();
        assert!(
            text.contains("recomputes:") && text.contains("re-fwd") && text.contains("estimated step time"),
            "{text}"
        );
        let svg = plan.to_svg();
        assert_eq!(svg.matches("data-series=\"recompute\"").count(), plan.segments().len() - 1, "{svg}");
        assert!(svg.contains("segments recomputed"));
        assert!(
            *measured as f64 <= 1.10 * *budget as f64,
            "step {step}: measured {measured} over 110% of {budget}\n{plan}"
        );
    }
}

/// An InfoNCE loss: two views of each sample through one encoder, every sample's logits
/// against every other's (`z1 · z2ᵀ`), the matching view as the class.
fn info_nce(encoder: &impl nn::Module, a: &LazyTensor, b: &LazyTensor, labels: &LazyTensor) -> LazyTensor {
    let normalize = |z: LazyTensor| {
        let norm = z.square().sum_dim_intlist([-1i64].as_slice(), true, None::<Kind>).sqrt();
        z / norm
    };
    let z1 = normalize(a.apply(encoder));
    let z2 = normalize(b.apply(encoder));
    (z1.matmul(&z2.tr()) * 10.0).log_softmax(-1, Kind::Double).nll_loss(labels)
}

fn encoder(vs: &nn::Path) -> nn::Sequential {
    let mut seq = nn::seq();
    let mut width = 32;
    for k in 0..12 {
        let out = if k < 11 { 64 } else { 32 };
        seq = seq.add(nn::linear(vs.sub(format!("l{k}")), width, out, Default::default()));
        if k < 11 {
            seq = seq.add_fn(|x| x.relu());
        }
        width = out;
    }
    seq
}

#[test]
fn an_info_nce_loss_trains_at_55_percent_of_its_peak() {
    let _serial = serial();
    assert!(memory::track_cpu_allocations());
    let n = 128;
    let x = Tensor::randn([n, 32], (Kind::Double, CPU));
    let a = &x + Tensor::randn([n, 32], (Kind::Double, CPU)) * 0.1;
    let b = &x + Tensor::randn([n, 32], (Kind::Double, CPU)) * 0.1;
    let labels = Tensor::arange(n, (Kind::Int64, CPU));
    let mut eager_vs = nn::VarStore::new(CPU);
    let eager_enc = encoder(&eager_vs.root());
    eager_vs.double();
    let mut lazy_vs = nn::VarStore::new(CPU);
    let lazy_enc = encoder(&lazy_vs.root());
    lazy_vs.double();
    lazy_vs.copy(&eager_vs).unwrap();
    let mut eager_opt = nn::Adam::default().build(&eager_vs, 1e-3).unwrap();
    let mut lazy_opt = nn::Adam::default().build(&lazy_vs, 1e-3).unwrap();
    for step in 0..3 {
        eager_opt.zero_grad();
        let normalize = |z: Tensor| {
            let norm = z.square().sum_dim_intlist([-1i64].as_slice(), true, None::<Kind>).sqrt();
            z / norm
        };
        let z1 = normalize(a.apply(&eager_enc));
        let z2 = normalize(b.apply(&eager_enc));
        let loss = (z1.matmul(&z2.tr()) * 10.0).log_softmax(-1, Kind::Double).nll_loss(&labels);
        let eager_value = loss.double_value(&[]);
        loss.backward();
        eager_opt.step();

        lazy_opt.zero_grad();
        let (la, lb, ll) = lazy((&a, &b, &labels), 0);
        let loss = info_nce(&lazy_enc, &la, &lb, &ll);
        let whole = whole_peak(&loss);
        let budget = whole * 55 / 100;
        let options = Options::new().budget(budget);
        let plan = planned(&loss, Mode::Backward, &options).unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert!(plan.recomputes() && !plan.splits(), "step {step}: {plan}");
        let (value, measured) = measured_backward(&loss, &options);
        lazy_opt.step();
        println!(
            "step {step}: whole {whole} planned {} measured {measured} budget {budget} ({:.1}%)",
            plan.peak_bytes(),
            100.0 * measured as f64 / budget as f64
        );
        assert!((value - eager_value).abs() <= 1e-9 * eager_value.abs(), "step {step}: {value} vs {eager_value}");
        assert_same_variables(&eager_vs, &lazy_vs, 1e-6, &format!("step {step}"));
        assert!(
            measured as f64 <= 1.10 * budget as f64,
            "step {step}: measured {measured} over 110% of {budget}\n{plan}"
        );
    }
}

#[test]
fn when_nothing_fits_the_error_names_the_lowest_peak_and_what_rules_out_splitting() {
    let _serial = serial();
    let n = 64;
    let a = Tensor::randn([n, 32], (Kind::Double, CPU));
    let b = Tensor::randn([n, 32], (Kind::Double, CPU));
    let labels = Tensor::arange(n, (Kind::Int64, CPU));
    let mut vs = nn::VarStore::new(CPU);
    let enc = encoder(&vs.root());
    vs.double();
    let (la, lb, ll) = lazy((&a, &b, &labels), 0);
    let loss = info_nce(&enc, &la, &lb, &ll);
    let whole = whole_peak(&loss);
    // One byte under the whole batch: recomputing fits.
    let plan = planned(&loss, Mode::Backward, &Options::new().budget(whole - 1)).unwrap();
    assert!(plan.recomputes() && plan.peak_bytes() < whole, "{plan}");
    // Nothing fits a tenth: the error gives the lowest peak, below the whole batch's, and the op.
    let err = planned(&loss, Mode::Backward, &Options::new().budget(whole / 10)).unwrap_err();
    match &err {
        LazyError::DoesNotFit { peak, split_refused: Some(why), micro_batch, .. } => {
            assert!(*peak < whole, "{err}");
            assert_eq!(*micro_batch, n as usize);
            assert!(why.contains("matmul"), "{err}");
            assert!(err.to_string().contains(&format!("the whole batch of {n})")), "{err}");
        }
        other => panic!("{other}"),
    }
    // Told never to recompute, the split is refused by name, as before.
    let err =
        planned(&loss, Mode::Backward, &Options::new().budget(whole / 2).recompute(Recompute::Never)).unwrap_err();
    assert!(matches!(err, LazyError::MixesBatch { .. }), "{err}");
}

/// A chain whose first layers drop out: the recomputed segment must draw the same mask.
fn dropout_chain(vs: &nn::Path) -> impl ModuleT + use<> {
    let mut seq = nn::seq_t();
    for k in 0..6 {
        seq = seq.add(nn::linear(vs.sub(format!("l{k}")), 24, 24, Default::default())).add_fn(|x| x.tanh());
        if k < 2 {
            seq = seq.add_fn_t(|x, train| x.dropout(0.5, train));
        }
    }
    seq.add(nn::linear(vs.sub("head"), 24, 5, Default::default()))
}

#[test]
fn dropout_is_replayed_and_the_generator_ends_as_after_one_forward() {
    let _serial = serial();
    let x = Tensor::randn([512, 24], (Kind::Double, CPU));
    let y = Tensor::randint(5, [512], (Kind::Int64, CPU));
    let mut eager_vs = nn::VarStore::new(CPU);
    let eager_net = dropout_chain(&eager_vs.root());
    eager_vs.double();
    let mut lazy_vs = nn::VarStore::new(CPU);
    let lazy_net = dropout_chain(&lazy_vs.root());
    lazy_vs.double();
    lazy_vs.copy(&eager_vs).unwrap();

    tch::manual_seed(7);
    let loss = x.apply_t(&eager_net, true).log_softmax(-1, Kind::Double).nll_loss(&y);
    loss.backward();
    let eager_next = Tensor::rand([8], (Kind::Double, CPU));

    let (lx, ly) = lazy((&x, &y), 0);
    let loss_lazy = lx.apply_t(&lazy_net, true).log_softmax(-1, Kind::Double).nll_loss(&ly);
    let options = Options::new().budget(whole_peak(&loss_lazy) * 6 / 10).recompute(Recompute::Always);
    let plan = planned(&loss_lazy, Mode::Backward, &options).unwrap();
    assert!(plan.recomputes() && !plan.splits(), "{plan}");
    // The dropouts run twice: in a segment before the last.
    let dropouts: Vec<usize> =
        plan.ops().iter().enumerate().filter(|(_, o)| o.name.contains("dropout")).map(|(i, _)| i).collect();
    assert!(!dropouts.is_empty() && dropouts.iter().all(|d| plan.recomputed_ops().contains(d)), "{plan}");
    tch::manual_seed(7);
    let value = loss_lazy.backward_with(&options).unwrap();
    let lazy_next = Tensor::rand([8], (Kind::Double, CPU));
    assert!((value - loss.double_value(&[])).abs() < 1e-12, "{value} vs {}", loss.double_value(&[]));
    for (name, e) in eager_vs.trainable_variables().iter().zip(lazy_vs.trainable_variables()) {
        let diff = max_diff(&e.grad(), &name.grad());
        assert!(diff < 1e-12, "a gradient differs by {diff:e}: the mask was not replayed");
    }
    assert!(eager_next.equal(&lazy_next), "the generator continues as after one forward");
}

#[test]
fn running_statistics_move_once() {
    let _serial = serial();
    let x = Tensor::randn([16, 3, 8, 8], (Kind::Double, CPU));
    let y = Tensor::randint(10, [16], (Kind::Int64, CPU));
    // Every variable, running statistics included, after two steps: within 1e-9.
    let runs = train_both(bn_cnn, &x, &y, 2, 0.7, Recompute::Always, 1e-9);
    assert!(runs.iter().all(|(plan, _, _)| plan.recomputes() && !plan.splits()));
}

#[test]
fn a_recomputing_plan_splits_where_recomputing_alone_does_not_fit() {
    let _serial = serial();
    let x = Tensor::randn([512, 24], (Kind::Double, CPU));
    let y = Tensor::randint(5, [512], (Kind::Int64, CPU));
    let build = |vs: &nn::Path| {
        let mut seq = nn::seq_t();
        for k in 0..8 {
            seq = seq.add(nn::linear(vs.sub(format!("l{k}")), 24, 24, Default::default())).add_fn(|x| x.relu());
        }
        seq.add(nn::linear(vs.sub("head"), 24, 5, Default::default()))
    };
    let runs = train_both(build, &x, &y, 2, 0.2, Recompute::Always, 1e-9);
    for (plan, budget, _) in &runs {
        assert!(plan.recomputes() && plan.splits(), "{plan}");
        assert!(plan.peak_bytes() <= *budget, "{plan}");
    }
}

#[test]
fn never_recomputes_when_told_and_when_the_batch_fits() {
    let _serial = serial();
    let x = Tensor::randn([64, 24], (Kind::Double, CPU));
    let vs = nn::VarStore::new(CPU);
    let net = nn::seq()
        .add(nn::linear(vs.root().sub("a"), 24, 24, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root().sub("b"), 24, 24, Default::default()));
    let x = x.to_kind(Kind::Float);
    let loss = lazy(&x, 0).apply(&net).square().sum(None);
    let whole = whole_peak(&loss);
    assert!(!planned(&loss, Mode::Backward, &Options::new().budget(whole)).unwrap().recomputes());
    let never = planned(&loss, Mode::Backward, &Options::new().budget(whole / 2).recompute(Recompute::Never)).unwrap();
    assert!(!never.recomputes() && never.splits(), "{never}");
    // A forward keeps no activations: nothing to recompute.
    let forward = planned(&loss, Mode::Forward, &Options::new().budget(1 << 30).recompute(Recompute::Always)).unwrap();
    assert!(!forward.recomputes());
}

/// Gradients of an input that requires one, of parameters reached through an eager operand
/// (`w.tr()`, a non-leaf), and on top of gradients an earlier step left: all as eagerly,
/// recomputed whole and recomputed in micro-batches.
#[test]
fn inputs_eager_operands_and_accumulated_gradients_when_recomputing() {
    let _serial = serial();
    let opts = (Kind::Double, CPU);
    let w1 = Tensor::randn([32, 32], opts).set_requires_grad(true);
    let w2 = Tensor::randn([32, 32], opts).set_requires_grad(true);
    let x = (Tensor::randn([256, 32], opts) * 0.3).set_requires_grad(true);
    let eager = |x: &Tensor| {
        let mut h = x.matmul(&w1.tr()).tanh();
        for _ in 0..6 {
            h = h.matmul(&w2).tanh() * 0.5 + &h;
        }
        h.square().mean(Kind::Double)
    };
    let lazily = || {
        let wt = w1.tr();
        let mut h = lazy(&x, 0).matmul(&wt).tanh();
        for _ in 0..6 {
            h = h.matmul(&w2).tanh() * 0.5 + &h;
        }
        h.square().mean(None::<Kind>)
    };
    let grads = || [w1.grad().copy(), w2.grad().copy(), x.grad().copy()];
    // An earlier step's gradients, then this step's on top (eagerly: twice the backward).
    eager(&x).backward();
    let before = grads();
    eager(&x).backward();
    let want = grads();
    let value = eager(&x).double_value(&[]);
    let whole = whole_peak(&lazily());
    for fraction in [0.6, 0.3] {
        for (t, b) in [&w1, &w2, &x].into_iter().zip(&before) {
            t.grad().copy_(b);
        }
        let options = Options::new().budget((whole as f64 * fraction) as u64).recompute(Recompute::Always);
        let loss = lazily();
        let plan = planned(&loss, Mode::Backward, &options).unwrap();
        assert!(plan.recomputes() && plan.splits() == (fraction < 0.5), "{fraction}: {plan}");
        let got = loss.backward_with(&options).unwrap();
        assert!((got - value).abs() <= 1e-12 * value.abs(), "{fraction}: {got} vs {value}");
        for ((g, w), name) in grads().iter().zip(&want).zip(["w1", "w2", "x"]) {
            let diff = max_diff(g, w) / w.abs().max().double_value(&[]);
            assert!(diff <= 1e-10, "{fraction} (split: {}): {name} differs by {diff:e}\n{plan}", plan.splits());
        }
    }
}

/// Values of the first segment read by a middle segment and summed at the end (`c + a + b`):
/// autograd hands one buffer to both operands of that sum, and the middle segment's gradient
/// of `a` must not land in `b`'s. With gradients already present (the path that sums the
/// segments' gradients itself), whole and split.
#[test]
fn gradients_summed_across_segments_stay_apart() {
    let _serial = serial();
    let opts = (Kind::Double, CPU);
    let w1 = (Tensor::randn([24, 24], opts) * 0.3).set_requires_grad(true);
    let w2 = (Tensor::randn([24, 24], opts) * 0.3).set_requires_grad(true);
    let w3 = (Tensor::randn([24, 24], opts) * 0.3).set_requires_grad(true);
    let x = Tensor::randn([512, 24], opts);
    let eager = || {
        let a = x.matmul(&w1).tanh();
        let b = x.matmul(&w2).tanh();
        let mut c = a.shallow_clone();
        for _ in 0..6 {
            c = c.matmul(&w3).tanh();
        }
        (c + &a + &b).square().mean(Kind::Double)
    };
    let lazily = || {
        let lx = lazy(&x, 0);
        let a = lx.matmul(&w1).tanh();
        let b = lx.matmul(&w2).tanh();
        let mut c = a.clone();
        for _ in 0..6 {
            c = c.matmul(&w3).tanh();
        }
        (c + &a + &b).square().mean(None::<Kind>)
    };
    let grads = || [w1.grad().copy(), w2.grad().copy(), w3.grad().copy()];
    eager().backward();
    let before = grads();
    eager().backward();
    let want = grads();
    let whole = whole_peak(&lazily());
    for fraction in [0.7, 0.3] {
        for (t, b) in [&w1, &w2, &w3].into_iter().zip(&before) {
            t.grad().copy_(b);
        }
        let options = Options::new().budget((whole as f64 * fraction) as u64).recompute(Recompute::Always);
        let plan = planned(&lazily(), Mode::Backward, &options).unwrap();
        assert!(plan.recomputes() && plan.segments().len() >= 3, "{fraction}: {plan}");
        lazily().backward_with(&options).unwrap();
        for ((g, w), name) in grads().iter().zip(&want).zip(["w1", "w2", "w3"]) {
            let diff = max_diff(g, w) / w.abs().max().double_value(&[]);
            assert!(diff <= 1e-10, "{fraction}: {name} differs by {diff:e}\n{plan}");
        }
    }
}

/// A batch of one that does not fit is an error naming the peak, not a panic.
#[test]
fn a_batch_of_one_that_does_not_fit_is_an_error() {
    let _serial = serial();
    let w = Tensor::randn([64, 64], (Kind::Float, CPU)).set_requires_grad(true);
    let x = Tensor::randn([1, 64], (Kind::Float, CPU));
    let loss = lazy(&x, 0).matmul(&w).tanh().matmul(&w).sum(None);
    for recompute in [Recompute::Auto, Recompute::Never, Recompute::Always] {
        let err = planned(&loss, Mode::Backward, &Options::new().budget(64).recompute(recompute)).unwrap_err();
        assert!(matches!(err, LazyError::DoesNotFit { peak, .. } if peak > 64), "{recompute:?}: {err}");
    }
}
