//! A real budget: in a child process whose address space is capped (`RLIMIT_AS`), a training
//! step whose full batch needs more than the cap runs out of memory when run eagerly, and
//! completes through `toma::lazy` — planned against the memory actually left, with no
//! out-of-memory on the way.
//!
//! A cap cannot be raised again, so the capped part runs in a child: the test re-executes this
//! binary filtered to itself with `TOMA_LAZY_OOM_CHILD` set, and checks the child's verdict.
#![cfg(all(feature = "tch", target_os = "linux"))]

mod support;

use support::events;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use toma::cpu_memory::CpuCap;
use toma::lazy::{lazy, Mode, Options};

const CHILD_ENV: &str = "TOMA_LAZY_OOM_CHILD";
const DONE: &str = "TOMA_LAZY_OOM_DONE";
const GIB: f64 = (1u64 << 30) as f64;
const ALLOCATOR_OOM: &str = "DefaultCPUAllocator: can't allocate memory";

/// Batch, input width and hidden width: the hidden activations of the full batch are 512 MiB
/// each, several of which are alive at the peak of a training step.
const N: i64 = 16_384;
const IN: i64 = 64;
const HIDDEN: i64 = 8192;
const CLASSES: i64 = 10;

fn child() {
    events::record();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let l1 = nn::linear(vs.root() / "l1", IN, HIDDEN, Default::default());
    let l2 = nn::linear(vs.root() / "l2", HIDDEN, CLASSES, Default::default());
    let x = Tensor::randn([N, IN], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(CLASSES, [N], (Kind::Int64, Device::Cpu));

    // Warm libtorch up (its intra-op and BLAS threads, their first allocations) while their
    // stacks and arenas still fit, then cap at what is in use + 1 GiB.
    let warm = Tensor::ones([1 << 22], (Kind::Float, Device::Cpu)).sum(Kind::Double).double_value(&[]);
    assert_eq!(warm, (1 << 22) as f64);
    let warm = l2.forward(&l1.forward(&x.narrow(0, 0, 256)).relu()).sum(Kind::Double).double_value(&[]);
    assert!(warm.is_finite());
    support::cap_memory(CpuCap::AddressSpace, 1.0);
    println!("{:.2} GiB available", toma::cpu_memory::available_cpu_memory() as f64 / GIB);

    // Eagerly, the full batch does not fit (tch panics; its long backtrace is not printed).
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let eager = std::panic::catch_unwind(|| {
        let loss = l2.forward(&l1.forward(&x).relu()).cross_entropy_for_logits(&y);
        loss.backward();
    });
    std::panic::set_hook(hook);
    let payload = eager.expect_err("the full batch must not fit under the cap");
    let message = payload.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains(ALLOCATOR_OOM), "not an allocator failure: {message}");
    for mut v in vs.trainable_variables() {
        v.zero_grad();
    }

    // Lazily, planned against what is left under the cap: it completes, without an OOM.
    let (lx, ly) = lazy((&x, &y), 0);
    let loss = lx.apply(&l1).relu().apply(&l2).cross_entropy_for_logits(&ly);
    let plan = loss.plan(Mode::Backward, &Options::default()).unwrap();
    println!("{}", plan.to_string().lines().take(2).collect::<Vec<_>>().join("\n"));
    assert!(plan.splits(), "the plan must split: {plan}");
    assert!(plan.full_batch_peak_bytes() > plan.budget(), "the full batch exceeds the budget");
    let value = loss.backward().unwrap();
    assert!(value.is_finite() && value > 0.0, "{value}");
    for v in vs.trainable_variables() {
        assert!(v.grad().defined() && v.grad().isfinite().all().int64_value(&[]) == 1);
    }
    let recorded = events::take();
    let plans: Vec<_> = recorded.iter().filter(|e| e.field("message").contains("toma::lazy: plan")).collect();
    assert!(!plans.is_empty(), "the plan was reported: {recorded:#?}");
    let ooms = recorded.iter().filter(|e| e.is_caught_oom()).count();
    assert_eq!(ooms, 0, "the planned micro-batch ran without an out-of-memory: {plans:#?}");
    println!(
        "{DONE} micro_batch={} chunks={} peak={} budget={} full={} loss={value}",
        plan.micro_batch(),
        plan.chunks(),
        plan.peak_bytes(),
        plan.budget(),
        plan.full_batch_peak_bytes()
    );
}

#[test]
fn a_training_step_that_ooms_eagerly_completes_lazily_under_a_real_cap() {
    if std::env::var(CHILD_ENV).is_ok() {
        return child();
    }
    let child =
        support::child::run("a_training_step_that_ooms_eagerly_completes_lazily_under_a_real_cap", CHILD_ENV, "1");
    let fields = child.assert_finished(DONE);
    println!("{}", child.report);
    let field = |name: &str| -> u64 { fields[name].parse().unwrap_or_else(|_| panic!("{name}: {fields:?}")) };
    assert!(field("micro_batch") < N as u64 && field("chunks") > 1, "{fields:?}");
    assert!(field("peak") <= field("budget") && field("full") > field("budget"), "{fields:?}");
}

/// A step that may not be split (batch norm in training mixes the samples) under a budget that
/// overstates the memory there (a budget read before other work took memory, or a GPU's
/// caching allocator that cannot find one large block): the whole batch runs out of memory for
/// real, the step is planned again under 3/4 of its peak, recomputing, and completes with the
/// eager step's loss and gradients.
fn child_replan() {
    const N: i64 = 4096;
    const H: i64 = 2048;
    events::record();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let r = vs.root();
    let l1 = nn::linear(&r / "l1", IN, H, Default::default());
    let bn = nn::batch_norm1d(&r / "bn", H, Default::default());
    let hidden: Vec<nn::Linear> = (0..4).map(|i| nn::linear(&r / format!("h{i}"), H, H, Default::default())).collect();
    let head = nn::linear(&r / "head", H, CLASSES, Default::default());
    let x = Tensor::randn([N, IN], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(CLASSES, [N], (Kind::Int64, Device::Cpu));
    let running = bn.running_mean.copy();

    // The eager step's loss and gradients, before the cap; the running statistics put back.
    let eager = {
        let h = l1.forward(&x).apply_t(&bn, true).relu();
        let h = hidden.iter().fold(h, |h, l| l.forward(&h).relu());
        head.forward(&h).cross_entropy_for_logits(&y)
    };
    eager.backward();
    let eager_value = eager.double_value(&[]);
    drop(eager);
    let eager_grads: Vec<Tensor> = vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();
    let eager_running = bn.running_mean.copy();
    tch::no_grad(|| {
        let mut m = bn.running_mean.shallow_clone();
        m.copy_(&running);
        let mut v = bn.running_var.shallow_clone();
        let _ = v.fill_(1.0);
    });
    for mut v in vs.trainable_variables() {
        v.zero_grad();
    }

    let (lx, ly) = lazy((&x, &y), 0);
    let loss = || {
        let h = lx.apply(&l1).apply_t(&bn, true).relu();
        let h = hidden.iter().fold(h, |h, l| h.apply(l).relu());
        h.apply(&head).cross_entropy_for_logits(&ly)
    };
    let whole = loss().plan(Mode::Backward, &Options::new().budget(u64::MAX / 4)).unwrap();
    assert!(!whole.splits() && !whole.recomputes(), "{whole}");
    // The lowest plan: the one a replan falls back to where 3/4 of the peak is out of reach.
    let lowest = match loss().plan(Mode::Backward, &Options::new().budget(1)) {
        Err(toma::lazy::LazyError::DoesNotFit { peak, .. }) => peak,
        other => panic!("nothing fits 1 byte: {other:?}"),
    };
    let lower = loss().plan(Mode::Backward, &Options::new().budget(lowest)).unwrap();
    assert!(lower.recomputes() && !lower.splits() && lower.peak_bytes() < whole.peak_bytes(), "{lower}");
    // Room for the recomputing plan, not for the whole batch.
    let headroom = (lower.peak_bytes() + whole.peak_bytes()) / 2;
    support::cap_memory(CpuCap::Data, headroom as f64 / GIB);
    let value = loss().backward_with(&Options::new().budget(4 * whole.peak_bytes())).unwrap();

    let recorded = events::take();
    let replans = recorded.iter().filter(|e| e.field("message").contains("planning it again")).count();
    assert!(replans >= 1, "the step was planned again: {recorded:#?}");
    assert!((value - eager_value).abs() <= 1e-4 * eager_value.abs(), "loss {value} lazily, {eager_value} eagerly");
    let worst = worst_difference(&vs, &eager_grads);
    assert!(worst < 1e-3, "gradients differ from the eager step's by {worst:e}");
    // Once, as the eager step moved them: the failed attempt left nothing behind.
    let off = (&bn.running_mean - &eager_running).abs().max().double_value(&[]);
    assert!(off < 1e-5, "running mean {off:e} from the eager step's");
    println!(
        "{DONE} replans={replans} whole={} lower={} headroom={headroom} segments={} worst={worst:.1e}",
        whole.peak_bytes(),
        lower.peak_bytes(),
        lower.segments().len()
    );
}

#[test]
fn a_step_that_cannot_split_is_planned_again_after_a_real_out_of_memory() {
    const TEST: &str = "a_step_that_cannot_split_is_planned_again_after_a_real_out_of_memory";
    if std::env::var(CHILD_ENV).is_ok() {
        return child_replan();
    }
    let child = support::child::run(TEST, CHILD_ENV, "1");
    let fields = child.assert_finished(DONE);
    println!("{}", child.report);
    assert!(fields["replans"].parse::<usize>().unwrap() >= 1, "{fields:?}");
}

/// The largest difference of a parameter's gradient from the eager one, relative to the eager
/// one's largest entry. Compared 64 rows at a time: under the cap, glibc's heap is fragmented
/// by the failures, and a check that needs whole-layer temporaries can fail where the step did
/// not.
fn worst_difference(vs: &nn::VarStore, eager_grads: &[Tensor]) -> f64 {
    let mut worst: f64 = 0.0;
    for (v, e) in vs.trainable_variables().iter().zip(eager_grads) {
        let (g, rows) = (v.grad(), e.size()[0]);
        let (mut diff, mut scale) = (0f64, 1e-12f64);
        for start in (0..rows).step_by(64) {
            let len = 64.min(rows - start);
            let (gs, es) = (g.narrow(0, start, len), e.narrow(0, start, len));
            diff = diff.max((&gs - &es).abs().max().double_value(&[]));
            scale = scale.max(es.abs().max().double_value(&[]));
        }
        worst = worst.max(diff / scale);
    }
    worst
}

/// A split step's micro-batches add their gradients into `.grad` in place (it was none: tch's
/// `zero_grad()`), so a micro-batch after the first runs with every gradient live. Under a cap
/// that the first micro-batch fits and a later one does not, the later one runs out of memory
/// for real: its half-added gradients cannot be told apart, so `.grad` goes back to none and
/// the step starts again from its first sample at half the size. It completes with the eager
/// step's loss and gradients (nothing counted twice).
fn child_restart() {
    const N: i64 = 8192;
    const H: i64 = 2048;
    const MICRO: i64 = 4096;
    assert!(toma::memory::track_cpu_allocations());
    events::record();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let r = vs.root();
    let first = nn::linear(&r / "l0", IN, H, Default::default());
    let hidden: Vec<nn::Linear> = (1..4).map(|i| nn::linear(&r / format!("l{i}"), H, H, Default::default())).collect();
    let head = nn::linear(&r / "head", H, CLASSES, Default::default());
    let x = Tensor::randn([N, IN], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(CLASSES, [N], (Kind::Int64, Device::Cpu));
    let mut opt = {
        use tch::nn::OptimizerConfig;
        nn::Sgd::default().build(&vs, 0.0).unwrap()
    };

    let eager = {
        let h = hidden.iter().fold(first.forward(&x).relu(), |h, l| l.forward(&h).relu());
        head.forward(&h).cross_entropy_for_logits(&y)
    };
    eager.backward();
    let eager_value = eager.double_value(&[]);
    drop(eager);
    let eager_grads: Vec<Tensor> = vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();
    opt.zero_grad();
    assert!(vs.trainable_variables().iter().all(|v| !v.grad().defined()), "zero_grad sets .grad to none");

    let loss = |x: &Tensor, y: &Tensor| {
        let (lx, ly) = lazy((x, y), 0);
        let h = hidden.iter().fold(lx.apply(&first).relu(), |h, l| h.apply(l).relu());
        h.apply(&head).cross_entropy_for_logits(&ly)
    };
    let peak = |x: &Tensor, y: &Tensor, micro: i64| {
        let options = Options::new().micro_batch(micro as usize);
        // What this machine prices by no rule is measured first, as the step would.
        let loss = loss(x, y);
        loss.calibrate(Mode::Backward, &options).unwrap();
        loss.plan(Mode::Backward, &options).unwrap().peak_bytes()
    };
    // The first micro-batch peaks as a whole batch of its size would; a later one holds every
    // gradient beside it; a later one of half the size needs less than the first.
    let first_peak = peak(&x.narrow(0, 0, MICRO), &y.narrow(0, 0, MICRO), MICRO);
    let later = peak(&x, &y, MICRO);
    let half = peak(&x, &y, MICRO / 2);
    assert!(first_peak < later && half < first_peak, "first {first_peak}, later {later}, half {half}");
    support::cap_memory(CpuCap::Data, (first_peak + later) as f64 / 2.0 / GIB);
    let before = toma::memory::cpu_allocator_stats().unwrap().allocated;
    let value = loss(&x, &y).backward_with(&Options::new().micro_batch(MICRO as usize));
    let after = toma::memory::cpu_allocator_stats().unwrap().allocated;
    let grads: i64 = vs.trainable_variables().iter().map(|v| 4 * v.numel() as i64).sum();
    // The failed attempts left nothing behind: what is new is `.grad`, once.
    assert_eq!(after as i64 - before as i64, grads, "bytes held after the step beyond the gradients");
    let recorded = events::take();
    let value = value.unwrap_or_else(|err| {
        let seen: Vec<String> = recorded.iter().map(|e| format!("{:?}", e.fields)).collect();
        panic!("{err}\n{}", seen.join("\n"))
    });
    let restarts = recorded.iter().filter(|e| e.field("message").contains("starts again from its first")).count();
    let ooms = recorded.iter().filter(|e| e.is_caught_oom()).count();
    assert!(restarts >= 1 && ooms >= 1, "the step started again after a real out-of-memory: {recorded:#?}");
    assert!((value - eager_value).abs() <= 1e-4 * eager_value.abs(), "loss {value} lazily, {eager_value} eagerly");
    let worst = worst_difference(&vs, &eager_grads);
    assert!(worst < 1e-3, "gradients differ from the eager step's by {worst:e}");
    println!("{DONE} restarts={restarts} ooms={ooms} first={first_peak} later={later} half={half} worst={worst:.1e}");
}

#[test]
fn a_split_step_starts_again_when_a_later_micro_batch_runs_out_of_memory() {
    const TEST: &str = "a_split_step_starts_again_when_a_later_micro_batch_runs_out_of_memory";
    if std::env::var(CHILD_ENV).is_ok() {
        return child_restart();
    }
    // The cap sits half the gradients' size above the first micro-batch's peak. glibc's
    // dynamic mmap threshold would serve large tensors from its heap and keep them there once
    // freed: counted as in use when the cap is set, yet reused after, they widened the
    // headroom by an unknown amount (no out-of-memory in 1 of 3 full runs). A fixed threshold
    // maps each tensor and unmaps it when freed, so the cap counts what is live.
    let tunables = Some("glibc.malloc.mmap_threshold=65536");
    let child = support::child::run_with(TEST, &[(CHILD_ENV, Some("1")), ("GLIBC_TUNABLES", tunables)]);
    let fields = child.assert_finished(DONE);
    println!("{}", child.report);
    assert!(fields["restarts"].parse::<usize>().unwrap() >= 1, "{fields:?}");
}
