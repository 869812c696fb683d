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
