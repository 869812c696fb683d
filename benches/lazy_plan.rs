//! Planning a 96-layer transformer: a graph of thousands of recorded ops, forward and backward,
//! with a budget that forces the micro-batch search. Target (issue 3): under 1 ms per plan.
//!
//! `cargo bench --bench lazy_plan` (criterion); the graph is recorded once, outside the
//! measurement: what is timed is `LazyTensor::plan` — collecting the graph, simulating the
//! schedule at each candidate micro-batch, and building the per-op table.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use tch::{nn, Device, Kind, Tensor};
use toma::lazy::{lazy, Calibrate, LazyTensor, Mode, Options, Recompute};

const LAYERS: usize = 96;
const BATCH: i64 = 64;
const T: i64 = 32;
const D: i64 = 64;
const HEADS: i64 = 4;
const VOCAB: i64 = 100;

struct Layer {
    ln1: nn::LayerNorm,
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
    ln2: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
}

fn layer(p: nn::Path) -> Layer {
    Layer {
        ln1: nn::layer_norm(&p / "ln1", vec![D], Default::default()),
        q: nn::linear(&p / "q", D, D, Default::default()),
        k: nn::linear(&p / "k", D, D, Default::default()),
        v: nn::linear(&p / "v", D, D, Default::default()),
        o: nn::linear(&p / "o", D, D, Default::default()),
        ln2: nn::layer_norm(&p / "ln2", vec![D], Default::default()),
        up: nn::linear(&p / "up", D, 4 * D, Default::default()),
        down: nn::linear(&p / "down", 4 * D, D, Default::default()),
    }
}

/// A pre-norm transformer block, recorded.
fn block(l: &Layer, h: &LazyTensor) -> LazyTensor {
    let n = h.size()[0];
    let x = h.apply(&l.ln1);
    let split = |t: LazyTensor| t.view([n, T, HEADS, D / HEADS]).transpose(1, 2);
    let (q, k, v) = (split(x.apply(&l.q)), split(x.apply(&l.k)), split(x.apply(&l.v)));
    let att = (q.matmul(&k.transpose(-2, -1)) / ((D / HEADS) as f64).sqrt()).softmax(-1, None);
    let a = att.matmul(&v).transpose(1, 2).reshape([n, T, D]).apply(&l.o);
    let h = h + a;
    let m = h.apply(&l.ln2).apply(&l.up).gelu("tanh").apply(&l.down);
    h + m
}

fn transformer_loss(vs: &nn::VarStore, layers: &[Layer], tokens: &Tensor, next: &Tensor) -> LazyTensor {
    let emb = nn::embedding(vs.root() / "emb", VOCAB, D, Default::default());
    let head = nn::linear(vs.root() / "head", D, VOCAB, Default::default());
    let (lt, ly) = lazy((tokens, next), 0);
    let mut h = lt.apply(&emb);
    for l in layers {
        h = block(l, &h);
    }
    h.apply(&head).view([-1, VOCAB]).cross_entropy_for_logits(&ly.view([-1]))
}

fn bench(c: &mut Criterion) {
    let vs = nn::VarStore::new(Device::Cpu);
    let layers: Vec<Layer> = (0..LAYERS).map(|i| layer(vs.root() / format!("layer{i}"))).collect();
    let tokens = Tensor::randint(VOCAB, [BATCH, T], (Kind::Int64, Device::Cpu));
    let next = Tensor::randint(VOCAB, [BATCH, T], (Kind::Int64, Device::Cpu));
    let loss = transformer_loss(&vs, &layers, &tokens, &next);
    let whole = loss.plan(Mode::Backward, &Options::new().budget(u64::MAX)).unwrap();
    // A budget of a fifth of the full batch's peak: the search has to find the micro-batch
    // (recomputing aside: measured on its own below).
    let options = Options::new().budget(whole.full_batch_peak_bytes() / 5).recompute(Recompute::Never);
    let plan = loss.plan(Mode::Backward, &options).unwrap();
    eprintln!(
        "96-layer transformer: {} ops, batch {} -> micro-batch {} x {}, peak {} B (budget {} B)",
        plan.ops().len(),
        plan.batch_size(),
        plan.micro_batch(),
        plan.chunks(),
        plan.peak_bytes(),
        plan.budget()
    );
    assert!(plan.ops().len() > 3000 && plan.splits());
    c.bench_function("lazy_plan/transformer96_backward", |b| {
        b.iter(|| black_box(loss.plan(Mode::Backward, &options).unwrap()))
    });
    c.bench_function("lazy_plan/transformer96_forward", |b| {
        b.iter(|| black_box(loss.plan(Mode::Forward, &options).unwrap()))
    });
    // The same budget with recomputing allowed: the segment search, then split against recompute.
    let auto = Options::new().budget(whole.full_batch_peak_bytes() / 5);
    let plan = loss.plan(Mode::Backward, &auto).unwrap();
    eprintln!(
        "recomputing allowed: {} segments, micro-batch {} ({})",
        plan.segments().len(),
        plan.micro_batch(),
        plan.reason()
    );
    c.bench_function("lazy_plan/transformer96_backward_recompute", |b| {
        b.iter(|| black_box(loss.plan(Mode::Backward, &auto).unwrap()))
    });
    // Every kernel call measured rather than priced by its rules (what a plan is on a machine
    // where no rule was read): the first plan measures each distinct call once; every later one
    // finds the measurements (what is timed).
    assert!(toma::memory::track_cpu_allocations());
    let calibrated = options.clone().calibrate(Calibrate::Always);
    // A plan runs nothing: calibration measures first (and a plan refuses what it lacks).
    let cal = loss.calibrate(Mode::Backward, &calibrated).unwrap();
    let first = loss.plan(Mode::Backward, &calibrated).unwrap();
    eprintln!(
        "calibrated: {} kernel calls measured in {:.1} ms, {} found measured; peak {} B (rules: {} B)",
        cal.measured,
        cal.elapsed.as_secs_f64() * 1e3,
        cal.remembered,
        first.peak_bytes(),
        plan_peak(&loss, &options)
    );
    assert!(cal.measured > 0);
    c.bench_function("lazy_plan/transformer96_backward_calibrated", |b| {
        b.iter(|| black_box(loss.plan(Mode::Backward, &calibrated).unwrap()))
    });
    // A training loop records its graph anew every step: each node's measurement is found by
    // its key. Timed directly (criterion's batched setup of a 3,850-op graph disturbs the caches
    // more than the plan takes), against the rules' plan of a graph recorded anew.
    for (name, o) in [("rules", &options), ("calibrated", &calibrated)] {
        let mut times: Vec<std::time::Duration> = (0..31)
            .map(|_| {
                let loss = transformer_loss(&vs, &layers, &tokens, &next);
                let started = std::time::Instant::now();
                black_box(loss.plan(Mode::Backward, o).unwrap());
                started.elapsed()
            })
            .collect();
        times.sort();
        eprintln!("a graph recorded anew, {name}: median plan {:?} (of 31)", times[15]);
    }
}

fn plan_peak(loss: &LazyTensor, options: &Options) -> u64 {
    loss.plan(Mode::Backward, options).unwrap().peak_bytes()
}

criterion_group!(benches, bench);
criterion_main!(benches);
