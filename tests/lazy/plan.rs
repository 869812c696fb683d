//! The plan against what really happens: per-op bytes equal the bytes of the tensors the
//! executor produces, the schedule's live set is what the executor holds, the peak is a peak
//! (not a sum), no split when the batch fits, and the micro-batch is the largest power of two
//! that fits.
#![cfg(feature = "tch")]

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use toma::lazy::{lazy, LazyError, LazyTensor, Mode, Options, Phase};

const CPU: Device = Device::Cpu;

struct Cnn {
    c1: nn::Conv2D,
    c2: nn::Conv2D,
    ln: nn::LayerNorm,
    fc: nn::Linear,
}

fn cnn(vs: &nn::VarStore) -> Cnn {
    let r = vs.root();
    Cnn {
        c1: nn::conv2d(&r / "c1", 3, 4, 3, nn::ConvConfig { padding: 1, ..Default::default() }),
        c2: nn::conv2d(&r / "c2", 4, 6, 3, nn::ConvConfig { stride: 2, ..Default::default() }),
        ln: nn::layer_norm(&r / "ln", vec![6, 1, 1], Default::default()),
        fc: nn::linear(&r / "fc", 6, 5, Default::default()),
    }
}

fn cnn_loss(m: &Cnn, x: &Tensor, y: &Tensor) -> LazyTensor {
    let (lx, ly) = lazy((x, y), 0);
    let h = lx.apply(&m.c1).relu().max_pool2d([2, 2], [], [0, 0], [1, 1], false);
    let h = h.apply(&m.c2).sigmoid().apply(&m.ln).flatten(1, -1);
    h.apply(&m.fc).dropout(0.3, true).cross_entropy_for_logits(&ly)
}

fn attention_loss(x: &Tensor, w: &Tensor, y: &Tensor) -> LazyTensor {
    let (lx, ly) = lazy((x, y), 0);
    let n = lx.size()[0];
    let q = lx.matmul(w).view([n, 4, 2, 4]).transpose(1, 2);
    let att = q.matmul(&q.transpose(-2, -1)).softmax(-1, None);
    let out = att.matmul(&q).transpose(1, 2).reshape([n, 4, 8]);
    (&out + &lx).mean_dim([1], false, None).mse_loss(&ly, tch::Reduction::Mean)
}

/// Checks, op by op, that the plan at micro-batch `b` predicts the bytes and the held values of
/// a real run of the first micro-batch.
fn plan_matches_execution(loss: &LazyTensor, mode: Mode, b: usize) {
    let plan = loss.plan(mode, &Options::new().micro_batch(b)).unwrap();
    let traced = loss.trace(mode, b).unwrap();
    assert_eq!(plan.ops().len(), traced.len());
    for (op, t) in plan.ops().iter().zip(&traced) {
        assert_eq!(op.name, t.name);
        assert_eq!(op.shape, t.shape, "#{} {}", t.node, t.name);
        assert_eq!(
            op.bytes, t.bytes,
            "#{} {} {:?}: planned bytes differ from the real tensor's",
            t.node, t.name, t.shape
        );
        assert_eq!(plan.held_after(t.node), t.held, "#{} {}: live set", t.node, t.name);
    }
    // The schedule's forward steps hold exactly those values (plus what autograd saves).
    for s in plan.steps().iter().filter(|s| s.phase == Phase::Forward) {
        let mut bases: Vec<usize> = plan.held_after(s.node).iter().map(|&j| plan.ops()[j].base).collect();
        bases.dedup();
        let held: u64 = bases.iter().map(|&j| plan.ops()[j].bytes).sum();
        if mode == Mode::Forward {
            assert_eq!(s.live, held, "#{} {}: live bytes", s.node, plan.ops()[s.node].name);
        } else {
            assert!(s.live >= held, "#{}: saved tensors only add", s.node);
        }
    }
}

#[test]
fn planned_bytes_and_live_sets_match_the_executor() {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(CPU);
    let m = cnn(&vs);
    let x = Tensor::randn([10, 3, 8, 8], (Kind::Float, CPU));
    let y = Tensor::randint(5, [10], (Kind::Int64, CPU));
    for b in [1, 3, 10] {
        plan_matches_execution(&cnn_loss(&m, &x, &y), Mode::Forward, b);
        plan_matches_execution(&cnn_loss(&m, &x, &y), Mode::Backward, b);
    }
    let xa = Tensor::randn([6, 4, 8], (Kind::Float, CPU));
    let w = Tensor::randn([8, 8], (Kind::Float, CPU)).set_requires_grad(true);
    let ya = Tensor::randn([6, 8], (Kind::Float, CPU));
    for b in [2, 6] {
        plan_matches_execution(&attention_loss(&xa, &w, &ya), Mode::Forward, b);
        plan_matches_execution(&attention_loss(&xa, &w, &ya), Mode::Backward, b);
    }
}

#[test]
fn the_peak_is_a_peak_not_a_sum() {
    // A deep MLP: every layer's activation is dead two layers later in a forward pass.
    let vs = nn::VarStore::new(CPU);
    let layers: Vec<nn::Linear> = (0..20).map(|i| nn::linear(vs.root() / i, 64, 64, Default::default())).collect();
    let x = Tensor::randn([256, 64], (Kind::Float, CPU));
    let mut h = lazy(&x, 0);
    for l in &layers {
        h = h.apply(l).relu();
    }
    let out = h.sum(None);
    let plan = out.plan(Mode::Forward, &Options::new().budget(u64::MAX)).unwrap();
    let total: u64 = plan.ops().iter().map(|op| op.bytes).sum();
    let activation = 256 * 64 * 4;
    assert_eq!(plan.peak_bytes(), 2 * activation, "the input of an op plus its output: {plan}");
    assert!(total > 10 * plan.peak_bytes());
    // Training keeps what backward needs: every linear's input and every relu's output.
    let training = out.plan(Mode::Backward, &Options::new().budget(u64::MAX)).unwrap();
    assert!(training.peak_bytes() >= 20 * activation, "{}", training.peak_bytes());
    assert_eq!(training.per_sample_bytes() * 256 + training.fixed_bytes(), training.peak_bytes());
    assert!(training.per_sample_bytes() >= 20 * 64 * 4);
}

#[test]
fn no_split_when_the_batch_fits_and_the_largest_power_of_two_otherwise() {
    tch::manual_seed(8);
    let vs = nn::VarStore::new(CPU);
    let m = cnn(&vs);
    let x = Tensor::randn([100, 3, 8, 8], (Kind::Float, CPU));
    let y = Tensor::randint(5, [100], (Kind::Int64, CPU));
    let loss = cnn_loss(&m, &x, &y);
    let whole = loss.plan(Mode::Backward, &Options::new().budget(u64::MAX)).unwrap();
    assert_eq!((whole.micro_batch(), whole.chunks(), whole.splits()), (100, 1, false));
    let exactly = loss.plan(Mode::Backward, &Options::new().budget(whole.peak_bytes())).unwrap();
    assert_eq!(exactly.micro_batch(), 100, "a budget equal to the peak fits");

    let mut last_peak = 0;
    // Budgets down to one sample's peak (the convolutions' fixed scratch is below that).
    let one = loss.plan(Mode::Backward, &Options::new().micro_batch(1)).unwrap().peak_bytes();
    let budgets = [whole.peak_bytes() - 1, whole.peak_bytes() / 2, whole.peak_bytes() / 7, whole.peak_bytes() / 30];
    for budget in budgets.into_iter().filter(|&b| b >= one) {
        let plan = loss.plan(Mode::Backward, &Options::new().budget(budget)).unwrap();
        let b = plan.micro_batch();
        assert!(b.is_power_of_two() && b < 100, "{b}");
        assert!(plan.peak_bytes() <= budget);
        assert_eq!(plan.chunks(), 100usize.div_ceil(b));
        let twice = loss.plan(Mode::Backward, &Options::new().micro_batch(2 * b)).unwrap();
        assert!(2 * b >= 100 || twice.peak_bytes() > budget, "{} would fit too", 2 * b);
        assert!(last_peak == 0 || plan.peak_bytes() <= last_peak);
        last_peak = plan.peak_bytes();
    }
    let err = loss.plan(Mode::Backward, &Options::new().budget(1000)).unwrap_err();
    assert!(matches!(err, LazyError::DoesNotFit { batch: 100, .. }), "{err}");
    assert!(err.to_string().contains("cross_entropy_for_logits"), "{err}");
    // Sizes as a person reads them, the exact bytes beside; how the lowest plan ran.
    let LazyError::DoesNotFit { peak, micro_batch, .. } = &err else { unreachable!() };
    let text = err.to_string();
    assert!(text.contains("budget of 1000 B") && text.contains(&format!("({peak} B)")), "{text}");
    assert!(text.contains("KiB") || text.contains("MiB"), "{text}");
    assert!(text.contains(&format!("micro-batches of {micro_batch} of a batch of 100")), "{text}");
    // Nothing to split: the whole batch, said so.
    let unsplit = loss.plan(Mode::Backward, &Options::new().budget(1000).micro_batch(100)).map(|p| p.peak_bytes());
    assert!(unsplit.is_ok_and(|p| p > 1000), "a forced micro-batch plans, whatever the budget");
}

#[test]
fn the_plan_prints_as_a_table_naming_the_peak() {
    let vs = nn::VarStore::new(CPU);
    let m = cnn(&vs);
    let x = Tensor::randn([9, 3, 8, 8], (Kind::Float, CPU));
    let y = Tensor::randint(5, [9], (Kind::Int64, CPU));
    let loss = cnn_loss(&m, &x, &y);
    let full = loss.plan(Mode::Backward, &Options::new().budget(u64::MAX)).unwrap();
    // Between four samples' peak and the whole batch's: a split. (Not one sample's: where a
    // single sample runs another kernel, its peak may be above the whole batch's.)
    let four = loss.plan(Mode::Backward, &Options::new().micro_batch(4)).unwrap().peak_bytes();
    assert!(four < full.peak_bytes(), "{four} against {}", full.peak_bytes());
    let plan = loss.plan(Mode::Backward, &Options::new().budget((four + full.peak_bytes()) / 2)).unwrap();
    let text = plan.to_string();
    println!("{text}");
    let (node, name, _) = plan.peak_op();
    let b = plan.micro_batch();
    assert!(plan.splits() && b.is_power_of_two(), "{text}");
    assert!(text.contains(&format!("batch 9 -> micro-batch {b} x {} chunk(s)", 9usize.div_ceil(b))), "{text}");
    assert!(text.contains(&format!("at #{node} {name}")), "{text}");
    assert!(text.contains("<- peak"));
    for op in ["conv2d", "max_pool2d", "layer_norm", "linear", "cross_entropy_for_logits"] {
        assert!(text.contains(op), "{op} missing:\n{text}");
    }
    assert!(text.contains(&format!("[{b}, 4, 8, 8]")), "shapes at the micro-batch size");
    // No `.grad` yet: autograd adds into it in place, no step of its own.
    assert!(plan.accumulates_in_place() && text.contains("gradients: added into .grad in place"), "{text}");
    assert!(!text.contains("grad += micro-batch"), "{text}");
    // Gradients from an earlier step: each micro-batch's are added once its backward is done.
    loss.backward_with(&Options::new()).unwrap();
    let later = loss.plan(Mode::Backward, &Options::new().micro_batch(b)).unwrap();
    let text = later.to_string();
    assert!(!later.accumulates_in_place() && text.contains("grad += micro-batch"), "{text}");
    assert!(text.contains("gradients: each micro-batch's kept apart"), "{text}");
}

#[test]
fn mixing_ops_refuse_to_split_unless_allowed() {
    tch::manual_seed(9);
    let mut vs = nn::VarStore::new(CPU);
    let bn = nn::batch_norm2d(vs.root() / "bn", 3, Default::default());
    let fc = nn::linear(vs.root() / "fc", 3, 2, Default::default());
    vs.double();
    let x = Tensor::randn([12, 3, 2, 2], (Kind::Double, CPU));
    let y = Tensor::randint(2, [12], (Kind::Int64, CPU));
    let loss = |train: bool| {
        let (lx, ly) = lazy((&x, &y), 0);
        lx.apply_t(&bn, train).mean_dim([2, 3], false, None).apply(&fc).cross_entropy_for_logits(&ly)
    };
    let split = Options::new().micro_batch(4);
    // Eval mode uses running statistics: splits.
    loss(false).backward_with(&split).unwrap();
    // Training mode: batch statistics. Fits whole: fine. Must split: refused, naming the op.
    loss(true).backward_with(&Options::new().budget(u64::MAX)).unwrap();
    let err = loss(true).backward_with(&split).unwrap_err();
    match &err {
        LazyError::MixesBatch { op, reason, .. } => {
            assert_eq!(op, "batch_norm");
            assert!(reason.contains("training"), "{reason}");
        }
        other => panic!("{other}"),
    }
    let text = err.to_string();
    assert!(text.contains("allow_batch_mixing"), "{err}");
    // The split was asked for (micro_batch(4)), not forced by the budget: the message says so,
    // and names the op once.
    assert!(text.contains("asked to run in micro-batches of 4") && !text.contains("does not fit"), "{text}");
    assert_eq!(text.matches("batch_norm").count(), 1, "{text}");
    // Split because the budget is too small, recomputing ruled out: the message gives the peak
    // and the budget. (Recomputing, the default, keeps the batch whole: tests/lazy_recompute.rs.)
    let whole = loss(true).plan(Mode::Backward, &Options::new().budget(u64::MAX)).unwrap().peak_bytes();
    let never = Options::new().budget(whole - 1).recompute(toma::lazy::Recompute::Never);
    let tight = loss(true).backward_with(&never).unwrap_err();
    assert!(matches!(tight, LazyError::MixesBatch { requested: None, .. }), "{tight}");
    assert!(tight.to_string().contains("does not fit"), "{tight}");
    // Opting in splits with per-micro-batch statistics.
    let value = loss(true).backward_with(&split.clone().allow_batch_mixing(true)).unwrap();
    assert!(value.is_finite());

    // A batch statistic used per sample: refused; a sum over the batch used linearly: fine.
    let lx = lazy(&x, 0);
    let centered = (&lx - lx.mean_dim([0], true, None)).square_free();
    assert!(matches!(centered.to_tensor_with(&split), Err(LazyError::MixesBatch { .. })));
    let linear = lx.sum(None) * 2.0 + lx.mean(None);
    let v = linear.to_tensor_with(&split).unwrap();
    let e = x.sum(None) * 2.0 + x.mean(None);
    assert!(v.allclose(&e, 1e-10, 1e-10, false));
    assert!(matches!(centered.to_tensor_with(&split), Err(LazyError::MixesBatch { splits_anyway: true, .. })));
    // A nonlinear function of a batch sum cannot be split, by any option: the refusal offers
    // none.
    let nonlinear = lx.sum(None).exp();
    assert!(matches!(nonlinear.to_tensor_with(&split), Err(LazyError::MixesBatch { splits_anyway: false, .. })));
    // Nor can a view that folds the batch into other dimensions (tch-rs's a2c views its
    // `steps * processes` rows as `[steps, processes]`): allowing batch mixing refuses it too.
    let folded = lx.view([3, 4, 3, 2, 2]).mean(None);
    let err = folded.to_tensor_with(&split).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, LazyError::MixesBatch { splits_anyway: false, .. }), "{text}");
    assert!(text.contains("no option splits it") && !text.contains("allow_batch_mixing"), "{text}");
    let mixing = split.clone().allow_batch_mixing(true);
    assert!(matches!(folded.to_tensor_with(&mixing), Err(LazyError::NotSplittable { .. })));
    // A maximum over the batch evaluates in micro-batches, but does not differentiate.
    let m = lx.max();
    assert!(m.to_tensor_with(&split).unwrap().allclose(&x.max(), 0.0, 0.0, false));
}

/// `(x - m)^2` without `pow`: exercises mul of a per-sample value with itself.
trait SquareFree {
    fn square_free(&self) -> LazyTensor;
}

impl SquareFree for LazyTensor {
    fn square_free(&self) -> LazyTensor {
        self * self
    }
}

#[test]
fn forward_only_peak_is_below_training_peak_and_both_scale_with_the_batch() {
    let vs = nn::VarStore::new(CPU);
    let m = cnn(&vs);
    let x = Tensor::randn([64, 3, 8, 8], (Kind::Float, CPU));
    let y = Tensor::randint(5, [64], (Kind::Int64, CPU));
    let loss = cnn_loss(&m, &x, &y);
    let mut previous = (0, 0);
    for b in [1, 2, 4, 8, 16, 32, 64] {
        let f = loss.plan(Mode::Forward, &Options::new().micro_batch(b)).unwrap().peak_bytes();
        let t = loss.plan(Mode::Backward, &Options::new().micro_batch(b)).unwrap().peak_bytes();
        assert!(f < t, "b={b}: forward {f}, training {t}");
        // From two samples on, on every machine. One sample may run another kernel (libtorch's
        // native im2col where oneDNN runs a batch; with AVX2's blocks of 8 its columns take more
        // than oneDNN's scratch at two samples), so it bounds nothing.
        if b > 2 {
            assert!(f >= previous.0 && t >= previous.1, "b={b}: monotone in the micro-batch from 2 on");
        }
        previous = (f, t);
    }
    // At most twice the peak at 32: no step's fixed part is negative. Whether the line of the
    // step that peaked at 32 bounds the plan at 64 from below depends on which kernels this
    // machine's key prices (it did not on an AMX CPU: 354184 predicted, 353736 planned), so it
    // is printed, not asserted.
    let p32 = loss.plan(Mode::Backward, &Options::new().micro_batch(32)).unwrap();
    let p64 = loss.plan(Mode::Backward, &Options::new().micro_batch(64)).unwrap();
    let predicted = p32.per_sample_bytes() * 64 + p32.fixed_bytes();
    println!("the line at 32 predicts {predicted} B at 64; the plan at 64 is {} B", p64.peak_bytes());
    assert!(p64.peak_bytes() <= 2 * p32.peak_bytes(), "{} > 2 × {}", p64.peak_bytes(), p32.peak_bytes());
}

#[test]
fn eager_forward_matches_a_micro_batched_forward_output() {
    // Forward-only outputs are concatenated along the batch dimension.
    let vs = nn::VarStore::new(CPU);
    let m = cnn(&vs);
    let x = Tensor::randn([11, 3, 8, 8], (Kind::Float, CPU));
    let lx = lazy(&x, 0);
    let features = lx.apply(&m.c1).relu().max_pool2d([2, 2], [], [0, 0], [1, 1], false).apply(&m.c2);
    let eager = m.c2.forward(&m.c1.forward(&x).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false));
    let plan = features.plan(Mode::Forward, &Options::new().micro_batch(4)).unwrap();
    assert_eq!(plan.chunks(), 3);
    let v = features.to_tensor_with(&Options::new().micro_batch(4)).unwrap();
    assert!(v.allclose(&eager, 1e-5, 1e-6, false));
}
