//! The tax of `toma::lazy` when no split is needed: one training step plain in tch against the
//! same step through `toma::lazy` whose plan runs the whole batch as one micro-batch, side by
//! side, in time and in peak CPU memory (the counting allocator), on a small CNN (conv, relu,
//! max-pool, linear, cross-entropy; batch 64 of 3×32×32), on an MLP whose parameters
//! dominate its memory (1024 → 4096 → 4096 → 10, 84 MB of weights; batch 64), and on a
//! minGPT-style model (two GPT-2 decoder blocks, width 128, 4 heads, 64 positions, dropout, a
//! head over 256 tokens; batch 64), and on a char-RNN (an LSTM over 32 steps, libtorch's fused
//! kernel plainly, recorded per step lazily; batch 64). Goal (issues 17, 27): within 5% of plain
//! tch in each, the recurrent one aside (a recurrence recorded step by step against a fused kernel).
//!
//! `cargo bench --bench lazy_tax`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use toma::lazy::models::{BlockConfig, DecoderBlock};
use toma::lazy::{lazy, Options};

struct Cnn {
    c1: nn::Conv2D,
    c2: nn::Conv2D,
    fc: nn::Linear,
}

fn cnn(vs: &nn::VarStore) -> Cnn {
    let p = vs.root();
    let conv = nn::ConvConfig { padding: 1, ..Default::default() };
    Cnn {
        c1: nn::conv2d(&p / "c1", 3, 32, 3, conv),
        c2: nn::conv2d(&p / "c2", 32, 64, 3, conv),
        fc: nn::linear(&p / "fc", 64 * 8 * 8, 10, Default::default()),
    }
}

fn plain(m: &Cnn, x: &Tensor, y: &Tensor) -> f64 {
    let h = m.c1.forward(x).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
    let h = m.c2.forward(&h).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
    let loss = m.fc.forward(&h.flatten(1, -1)).cross_entropy_for_logits(y);
    loss.backward();
    loss.double_value(&[])
}

fn lazily(m: &Cnn, x: &Tensor, y: &Tensor) -> f64 {
    let (x, y) = lazy((x, y), 0);
    let h = x.apply(&m.c1).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
    let h = h.apply(&m.c2).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
    let loss = h.flatten(1, -1).apply(&m.fc).cross_entropy_for_logits(&y);
    loss.backward_with(&Options::new()).unwrap()
}

struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
    l3: nn::Linear,
}

fn mlp(vs: &nn::VarStore) -> Mlp {
    let p = vs.root();
    Mlp {
        l1: nn::linear(&p / "l1", 1024, 4096, Default::default()),
        l2: nn::linear(&p / "l2", 4096, 4096, Default::default()),
        l3: nn::linear(&p / "l3", 4096, 10, Default::default()),
    }
}

fn mlp_plain(m: &Mlp, x: &Tensor, y: &Tensor) -> f64 {
    let loss = m.l3.forward(&m.l2.forward(&m.l1.forward(x).relu()).relu()).cross_entropy_for_logits(y);
    loss.backward();
    loss.double_value(&[])
}

fn mlp_lazily(m: &Mlp, x: &Tensor, y: &Tensor) -> f64 {
    let (x, y) = lazy((x, y), 0);
    let loss = x.apply(&m.l1).relu().apply(&m.l2).relu().apply(&m.l3).cross_entropy_for_logits(&y);
    loss.backward_with(&Options::new()).unwrap()
}

/// A minGPT-style model: two GPT-2 decoder blocks of `toma::lazy::models` (written once over
/// `TensorOps`: the same code runs eagerly and lazily), a head over 256 tokens, cross-entropy
/// over every position.
struct Gpt {
    blocks: Vec<DecoderBlock>,
    head: nn::Linear,
}

const GPT_WIDTH: i64 = 128;
const GPT_VOCAB: i64 = 256;

fn gpt(vs: &nn::VarStore) -> Gpt {
    let p = vs.root();
    Gpt {
        blocks: (0..2).map(|i| DecoderBlock::new(&p / "h" / i, BlockConfig::gpt2(GPT_WIDTH, 4))).collect(),
        head: nn::linear(&p / "head", GPT_WIDTH, GPT_VOCAB, Default::default()),
    }
}

fn gpt_plain(m: &Gpt, x: &Tensor, y: &Tensor) -> f64 {
    let h = m.blocks.iter().fold(x.shallow_clone(), |h, b| b.forward_t(&h, true));
    let loss = h.apply(&m.head).view([-1, GPT_VOCAB]).cross_entropy_for_logits(&y.view([-1]));
    loss.backward();
    loss.double_value(&[])
}

fn gpt_lazily(m: &Gpt, x: &Tensor, y: &Tensor) -> f64 {
    let (x, y) = lazy((x, y), 0);
    let h = m.blocks.iter().fold(x, |h, b| b.forward_t(&h, true));
    let loss = h.apply(&m.head).view([-1, GPT_VOCAB]).cross_entropy_for_logits(&y.view([-1]));
    loss.backward_with(&Options::new()).unwrap()
}

/// A char-RNN: an LSTM over 32 steps of 64 features, a linear head per step. Plain tch runs
/// libtorch's fused `lstm`; `toma::lazy` records the recurrence step by step.
struct CharRnn {
    lstm: toma::lazy::nn::LSTM,
    head: nn::Linear,
}

const RNN_FEATURES: i64 = 64;

fn char_rnn(vs: &nn::VarStore) -> CharRnn {
    CharRnn {
        lstm: toma::lazy::nn::lstm(vs.root() / "lstm", RNN_FEATURES, 128, Default::default()),
        head: nn::linear(vs.root() / "head", 128, RNN_FEATURES, Default::default()),
    }
}

fn rnn_plain(m: &CharRnn, x: &Tensor, y: &Tensor) -> f64 {
    use toma::lazy::nn::RNN;
    let (out, _) = RNN::<Tensor>::seq(&m.lstm, x);
    let loss = out.apply(&m.head).view([-1, RNN_FEATURES]).cross_entropy_for_logits(&y.view([-1]));
    loss.backward();
    loss.double_value(&[])
}

fn rnn_lazily(m: &CharRnn, x: &Tensor, y: &Tensor) -> f64 {
    use toma::lazy::nn::RNN;
    let (x, y) = lazy((x, y), 0);
    let (out, _) = m.lstm.seq(&x);
    let loss = out.apply(&m.head).view([-1, RNN_FEATURES]).cross_entropy_for_logits(&y.view([-1]));
    loss.backward_with(&Options::new()).unwrap()
}

type Step<M> = fn(&M, &Tensor, &Tensor) -> f64;

/// Peaks and times of one model, plain against lazy.
fn compare<M>(
    c: &mut Criterion,
    name: &str,
    build: fn(&nn::VarStore) -> M,
    x: &Tensor,
    y: &Tensor,
    plain: Step<M>,
    lazily: Step<M>,
) {
    // Peaks above what is in use, on a first step (no .grad yet) and a later one.
    let peak = |f: &dyn Fn() -> f64| {
        let before = toma::memory::cpu_allocator_stats().unwrap().allocated;
        toma::memory::reset_cpu_peak();
        black_box(f());
        toma::memory::cpu_allocator_stats().unwrap().peak_allocated - before
    };
    let mut peaks = Vec::new();
    for run in [plain, lazily] {
        let fresh = nn::VarStore::new(Device::Cpu);
        let model = build(&fresh);
        let mut opt = nn::Sgd::default().build(&fresh, 0.01).unwrap();
        let first = peak(&|| run(&model, x, y));
        // A later step of the usual loop: `zero_grad` (which sets gradients to none), step.
        opt.zero_grad();
        let later = peak(&|| run(&model, x, y));
        peaks.push((first, later));
    }
    println!(
        "{name} peak: first step lazy/plain {:.3}x ({} / {} B), later step {:.3}x ({} / {} B)",
        peaks[1].0 as f64 / peaks[0].0 as f64,
        peaks[1].0,
        peaks[0].0,
        peaks[1].1 as f64 / peaks[0].1 as f64,
        peaks[1].1,
        peaks[0].1
    );

    let vs = nn::VarStore::new(Device::Cpu);
    let m = build(&vs);
    let opt = std::cell::RefCell::new(nn::Sgd::default().build(&vs, 0.0).unwrap());
    let zero = |_: &nn::VarStore| opt.borrow_mut().zero_grad();
    let mut group = c.benchmark_group(format!("{name}_step_batch_64_unsplit"));
    group.bench_function("plain_tch", |b| {
        b.iter(|| {
            zero(&vs);
            plain(&m, x, y)
        })
    });
    group.bench_function("toma_lazy", |b| {
        b.iter(|| {
            zero(&vs);
            lazily(&m, x, y)
        })
    });
    group.finish();

    // The ratio from interleaved runs (best of each), so that a busy moment hits both alike.
    let time = |f: &dyn Fn() -> f64| {
        zero(&vs);
        let start = Instant::now();
        black_box(f());
        start.elapsed().as_secs_f64()
    };
    let (mut p, mut l) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..20 {
        p = p.min(time(&|| plain(&m, x, y)));
        l = l.min(time(&|| lazily(&m, x, y)));
    }
    println!("ratio: {name} lazy step {:.3}x plain tch ({:.2} ms vs {:.2} ms)", l / p, l * 1e3, p * 1e3);
}

fn tax(c: &mut Criterion) {
    toma::memory::track_cpu_allocations();
    tch::manual_seed(0);
    let x = Tensor::randn([64, 3, 32, 32], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(10, [64], (Kind::Int64, Device::Cpu));
    compare(c, "cnn", cnn, &x, &y, plain, lazily);
    split(&x, &y);
    let x = Tensor::randn([64, 1024], (Kind::Float, Device::Cpu));
    compare(c, "mlp", mlp, &x, &y, mlp_plain, mlp_lazily);
    let x = Tensor::randn([64, 64, GPT_WIDTH], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(GPT_VOCAB, [64, 64], (Kind::Int64, Device::Cpu));
    compare(c, "gpt", gpt, &x, &y, gpt_plain, gpt_lazily);
    let x = Tensor::randn([64, 32, RNN_FEATURES], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(RNN_FEATURES, [64, 32], (Kind::Int64, Device::Cpu));
    compare(c, "lstm", char_rnn, &x, &y, rnn_plain, rnn_lazily);
}

/// When the plan splits: the CNN step in 4 micro-batches of 16 through `toma::lazy`, against
/// the sum of 4 plain steps of 16 (goal, issue 17: within 10%).
fn split(x: &Tensor, y: &Tensor) {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = cnn(&vs);
    let mut opt = nn::Sgd::default().build(&vs, 0.0).unwrap();
    let options = Options::new().micro_batch(16);
    let lazy_split = || {
        let (lx, ly) = lazy((x, y), 0);
        let h = lx.apply(&m.c1).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
        let h = h.apply(&m.c2).relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
        let loss = h.flatten(1, -1).apply(&m.fc).cross_entropy_for_logits(&ly);
        loss.backward_with(&options).unwrap()
    };
    let plain_parts =
        || (0..4).map(|k| plain(&m, &x.narrow(0, 16 * k, 16), &y.narrow(0, 16 * k, 16)) * 0.25).sum::<f64>();
    let mut time = |f: &dyn Fn() -> f64| {
        opt.zero_grad();
        let start = Instant::now();
        black_box(f());
        start.elapsed().as_secs_f64()
    };
    let (mut p, mut l) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..20 {
        p = p.min(time(&plain_parts));
        l = l.min(time(&lazy_split));
    }
    println!(
        "ratio: cnn split 4 x 16, lazy {:.3}x the sum of 4 plain steps of 16 ({:.2} ms vs {:.2} ms)",
        l / p,
        l * 1e3,
        p * 1e3
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    targets = tax
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
