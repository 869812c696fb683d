//! The planner against a real allocator, on the CPU: `toma::memory::track_cpu_allocations`
//! counts libtorch's CPU allocations, and a forward + backward pass of the models of
//! tests/gpu.rs (an MLP, a CNN, a transformer block) is measured against its plan at several
//! batch sizes. The same comparison runs against the CUDA caching allocator in tests/gpu.rs.
//!
//! One test binary of its own: the counter and its peak are process-wide, so nothing else may
//! allocate while a pass is measured.
#![cfg(feature = "tch")]

mod support;

use support::models::*;
use tch::nn;
use tch::{Device, Kind, Tensor};
use toma::lazy::{LazyTensor, Mode, Options};
use toma::memory;

const CPU: Device = Device::Cpu;
const MIB: u64 = 1 << 20;

/// The planner's target (issue 6), either way: within 10% of the measured peak.
const UNDER_TOLERANCE: f64 = 0.10;
const OVER_TOLERANCE: f64 = 0.10;
/// Convolutions are planned with an im2col workspace (libtorch's generic kernels and the
/// bound for cuDNN's choices); oneDNN, which libtorch uses on x86 CPUs, needs less: measured
/// +43% and +45% at batch 8 and 32. An overestimate only wastes memory.
const CNN_OVER_TOLERANCE: f64 = 0.5;

/// The plan's peak for forward and backward of the whole batch, and the peak the counter saw
/// above what was live before (inputs, parameters).
fn planned_and_measured(loss: &LazyTensor, batch: usize) -> (u64, u64) {
    let options = Options::new().micro_batch(batch);
    let plan = loss.plan(Mode::Backward, &options).expect("a plan");
    assert!(!plan.splits(), "the whole batch is planned: {plan}");
    let before = memory::cpu_allocator_stats().expect("tracking").allocated;
    assert!(memory::reset_cpu_peak());
    loss.backward_with(&options).expect("forward and backward");
    let after = memory::cpu_allocator_stats().expect("tracking");
    (plan.peak_bytes(), after.peak_allocated - before)
}

#[test]
fn the_counter_sees_every_byte_of_a_tensor() {
    let _serial = support::serial();
    assert!(memory::track_cpu_allocations());
    assert!(memory::track_cpu_allocations(), "a second call is a no-op that succeeds");
    let before = memory::cpu_allocator_stats().unwrap();
    assert!(memory::reset_cpu_peak());
    let t = Tensor::ones([1 << 20], (Kind::Float, CPU));
    let during = memory::cpu_allocator_stats().unwrap();
    assert_eq!(during.allocated - before.allocated, 4 * MIB, "{before:?} -> {during:?}");
    assert_eq!(during.allocations - before.allocations, 1);
    let doubled = &t * 2.0;
    drop(t);
    assert_eq!(doubled.max().double_value(&[]), 2.0);
    drop(doubled);
    let after = memory::cpu_allocator_stats().unwrap();
    assert!(after.allocated <= before.allocated + 64, "freed: {before:?} -> {after:?}");
    assert!(after.peak_allocated >= before.allocated + 8 * MIB, "both tensors were live at once: {after:?}");
}

#[test]
fn planner_peak_matches_the_cpu_allocator() {
    let _serial = support::serial();
    assert!(memory::track_cpu_allocations());
    tch::manual_seed(11);
    let mut rows = Vec::new();
    let mut measure = |model: &str, batch: i64, run: &dyn Fn(i64) -> (u64, u64)| {
        run(batch.min(2)); // warm-up: lazily created kernels' state, not measured
        let (planned, measured) = run(batch);
        let error = (planned as f64 - measured as f64) / measured as f64;
        println!(
            "planner {model:>11} batch {batch:>4}: planned {:>8.2} MiB measured {:>8.2} MiB error {:+.1}%",
            planned as f64 / MIB as f64,
            measured as f64 / MIB as f64,
            100.0 * error
        );
        rows.push((model.to_owned(), batch, planned, measured));
    };
    for batch in [16, 256] {
        measure("mlp", batch, &|n| {
            let vs = nn::VarStore::new(CPU);
            let m = mlp(&vs);
            let (x, y) = (Tensor::randn([n, 1024], (Kind::Float, CPU)), Tensor::randint(10, [n], (Kind::Int64, CPU)));
            planned_and_measured(&mlp_lazy(&m, &x, &y), n as usize)
        });
    }
    for batch in [8, 32] {
        measure("cnn", batch, &|n| {
            let vs = nn::VarStore::new(CPU);
            let m = cnn(&vs);
            let x = Tensor::randn([n, 3, 64, 64], (Kind::Float, CPU));
            let y = Tensor::randint(10, [n], (Kind::Int64, CPU));
            planned_and_measured(&cnn_lazy(&m, &x, &y), n as usize)
        });
    }
    for batch in [2, 8] {
        measure("transformer", batch, &|n| {
            let vs = nn::VarStore::new(CPU);
            let m = block(&vs);
            let x = Tensor::randn([n, T, D], (Kind::Float, CPU));
            let y = Tensor::randint(10, [n], (Kind::Int64, CPU));
            planned_and_measured(&block_lazy(&m, &x, &y), n as usize)
        });
    }
    // The ops added with the op families: conv1d, silu, causal attention (the fused kernel),
    // baddbmm, softplus.
    for batch in [4, 16] {
        measure("seq", batch, &|n| {
            let vs = nn::VarStore::new(CPU);
            let m = seq(&vs, 16, 256, 4, 128);
            let x = Tensor::randn([n, 16, 128], (Kind::Float, CPU));
            let y = Tensor::randint(10, [n], (Kind::Int64, CPU));
            planned_and_measured(&seq_lazy(&m, &x, &y), n as usize)
        });
    }
    // 3-D attention runs libtorch's composite path, which materializes the attention weights:
    // weights as large as the queries, and four times larger.
    for (model, batch, len, width) in [("attention", 4, 128, 64), ("attention", 16, 128, 64), ("long attn", 4, 256, 16)]
    {
        measure(model, batch, &|n| {
            let vs = nn::VarStore::new(CPU);
            let qkv = nn::linear(vs.root() / "qkv", width, 3 * width, Default::default());
            let x = Tensor::randn([n, len, width], (Kind::Float, CPU));
            let h = toma::lazy::lazy(&x, 0).apply(&qkv);
            let part = |i: i64| h.narrow(2, width * i, width);
            let a = LazyTensor::scaled_dot_product_attention(
                &part(0),
                &part(1),
                &part(2),
                None::<&LazyTensor>,
                0.0,
                true,
                None,
                false,
            );
            planned_and_measured(&a.mean(None), n as usize)
        });
    }
    // All rows are printed before any bound is checked.
    for (model, batch, planned, measured) in rows {
        let (p, m) = (planned as f64, measured as f64);
        // Never under by more than the default safety margin: that is what would run out.
        assert!(m <= p * (1.0 + UNDER_TOLERANCE), "{model} at {batch}: planned {planned} < measured {measured}");
        let over = if model == "cnn" { CNN_OVER_TOLERANCE } else { OVER_TOLERANCE };
        assert!(p <= m * (1.0 + over), "{model} at {batch}: planned {planned} >> measured {measured}");
    }
}

/// No tax when no split is needed: on a first step (no `.grad` yet) of an MLP whose weights
/// dominate its memory, the lazy step peaks within 5% of plain tch, because it accumulates
/// straight into `.grad` instead of holding a second copy of the gradients.
#[test]
fn an_unsplit_first_step_peaks_like_plain_tch() {
    use tch::nn::Module;
    let _serial = support::serial();
    assert!(memory::track_cpu_allocations());
    tch::manual_seed(0);
    let x = Tensor::randn([16, 256], (Kind::Float, CPU));
    let y = Tensor::randint(10, [16], (Kind::Int64, CPU));
    let build = |vs: &nn::VarStore| {
        let p = vs.root();
        (
            nn::linear(&p / "l1", 256, 2048, Default::default()),
            nn::linear(&p / "l2", 2048, 2048, Default::default()),
            nn::linear(&p / "l3", 2048, 10, Default::default()),
        )
    };
    let peak = |f: &dyn Fn()| {
        let before = memory::cpu_allocator_stats().unwrap().allocated;
        assert!(memory::reset_cpu_peak());
        f();
        memory::cpu_allocator_stats().unwrap().peak_allocated - before
    };
    // The same seed before each build: the same weights.
    tch::manual_seed(1);
    let plain_vs = nn::VarStore::new(CPU);
    let (l1, l2, l3) = build(&plain_vs);
    tch::manual_seed(1);
    let vs = nn::VarStore::new(CPU);
    let (m1, m2, m3) = build(&vs);
    let plain =
        peak(&|| l3.forward(&l2.forward(&l1.forward(&x).relu()).relu()).cross_entropy_for_logits(&y).backward());
    let plain_grads: Vec<Tensor> = plain_vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();
    let lazy = peak(&|| {
        let (lx, ly) = toma::lazy::lazy((&x, &y), 0);
        let loss = lx.apply(&m1).relu().apply(&m2).relu().apply(&m3).cross_entropy_for_logits(&ly);
        loss.backward_with(&Options::new()).unwrap();
    });
    println!("first step peak: plain {plain} B, lazy {lazy} B ({:.3}x)", lazy as f64 / plain as f64);
    assert!((lazy as f64) <= 1.05 * plain as f64, "lazy {lazy} B vs plain {plain} B");
    let lazy_grads: Vec<Tensor> = vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();
    for (a, b) in plain_grads.iter().zip(&lazy_grads) {
        assert!(a.allclose(b, 1e-5, 1e-6, false), "gradients differ");
    }
}
