//! Recomputing against splitting against plain tch, side by side: a batch-norm CNN (training
//! mode: it may not be split), a minGPT-style transformer and an MLP, each under budgets of
//! 75%, 50% and 35% of its whole batch's planned peak. For every budget: the step time of
//! split-only (`Recompute::Never`), recompute-first (`Recompute::Always`) and the planner's
//! choice (`Recompute::Auto`), as ratios to a plain tch step of the whole batch, and each one's
//! measured peak against the budget (the counting CPU allocator). Goals (issue 25): the choice
//! within 5% of the better of the two; recomputing at 50% at most 1.35× a plain step.
//!
//! `cargo bench --bench lazy_recompute` (prints a Markdown table, then criterion's figures for
//! the 50% budget).

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, Criterion};
use tch::{Device, Kind, Tensor};
use toma::lazy::models::{BlockConfig, DecoderBlock};
use toma::lazy::nn::{self, SequentialT};
use toma::lazy::{lazy, LazyTensor, Mode, Options, Recompute};

const CPU: Device = Device::Cpu;

fn conv_bn(vs: &nn::Path, c_in: i64, c_out: i64) -> SequentialT {
    let cfg = nn::ConvConfig { padding: 1, bias: false, ..Default::default() };
    nn::seq_t()
        .add(nn::conv2d(vs, c_in, c_out, 3, cfg))
        .add(nn::batch_norm2d(vs, c_out, Default::default()))
        .add_fn(|x| x.relu())
}

/// A fast-ResNet-style stack in training mode: a stem, six residual blocks, a head.
fn bn_cnn(vs: &nn::Path) -> nn::FuncT<'static> {
    let stem = conv_bn(&vs.sub("stem"), 3, 16);
    let blocks: Vec<(SequentialT, SequentialT)> = (0..6)
        .map(|k| (conv_bn(&vs.sub(format!("b{k}a")), 16, 16), conv_bn(&vs.sub(format!("b{k}b")), 16, 16)))
        .collect();
    let head = nn::linear(vs.sub("head"), 16 * 8 * 8, 10, Default::default());
    nn::func_t(move |xs, train| {
        let mut x = xs.apply_t(&stem, train);
        for (a, b) in &blocks {
            x = &x + x.apply_t(a, train).apply_t(b, train);
        }
        x.max_pool2d_default(2).flat_view().apply(&head)
    })
}

fn mlp(vs: &nn::Path) -> SequentialT {
    let mut seq = nn::seq_t();
    for k in 0..8 {
        seq = seq.add(nn::linear(vs.sub(format!("l{k}")), 256, 256, Default::default())).add_fn(|x| x.relu());
    }
    seq.add(nn::linear(vs.sub("head"), 256, 10, Default::default()))
}

const GPT_WIDTH: i64 = 128;
const GPT_VOCAB: i64 = 256;

struct Gpt {
    blocks: Vec<DecoderBlock>,
    head: nn::Linear,
}

fn gpt(vs: &nn::Path) -> Gpt {
    Gpt {
        blocks: (0..2).map(|i| DecoderBlock::new(vs / "h" / i, BlockConfig::gpt2(GPT_WIDTH, 4))).collect(),
        head: nn::linear(vs / "head", GPT_WIDTH, GPT_VOCAB, Default::default()),
    }
}

/// One model: its plain step and its lazy loss.
struct Case {
    name: &'static str,
    plain: Box<dyn Fn() -> f64>,
    lazy: Box<dyn Fn() -> LazyTensor>,
    vs: nn::VarStore,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    {
        let vs = nn::VarStore::new(CPU);
        let net = bn_cnn(&vs.root());
        let x = Tensor::randn([64, 3, 16, 16], (Kind::Float, CPU));
        let y = Tensor::randint(10, [64], (Kind::Int64, CPU));
        let net = std::rc::Rc::new(net);
        let (n1, x1, y1) = (net.clone(), x.shallow_clone(), y.shallow_clone());
        out.push(Case {
            name: "batch-norm CNN (6 residual blocks, 16 channels, 16×16; batch 64)",
            plain: Box::new(move || {
                let loss = x1.apply_t(&*n1, true).cross_entropy_for_logits(&y1);
                loss.backward();
                loss.double_value(&[])
            }),
            lazy: Box::new(move || {
                let (lx, ly) = lazy((&x, &y), 0);
                lx.apply_t(&*net, true).cross_entropy_for_logits(&ly)
            }),
            vs,
        });
    }
    {
        let vs = nn::VarStore::new(CPU);
        let net = std::rc::Rc::new(gpt(&vs.root()));
        let x = Tensor::randn([32, 64, GPT_WIDTH], (Kind::Float, CPU));
        let y = Tensor::randint(GPT_VOCAB, [32, 64], (Kind::Int64, CPU));
        let (n1, x1, y1) = (net.clone(), x.shallow_clone(), y.shallow_clone());
        out.push(Case {
            name: "transformer (2 GPT-2 blocks, width 128, 64 positions; batch 32)",
            plain: Box::new(move || {
                let h = n1.blocks.iter().fold(x1.shallow_clone(), |h, b| b.forward_t(&h, true));
                let loss = h.apply(&n1.head).view([-1, GPT_VOCAB]).cross_entropy_for_logits(&y1.view([-1]));
                loss.backward();
                loss.double_value(&[])
            }),
            lazy: Box::new(move || {
                let (lx, ly) = lazy((&x, &y), 0);
                let h = net.blocks.iter().fold(lx, |h, b| b.forward_t(&h, true));
                h.apply(&net.head).view([-1, GPT_VOCAB]).cross_entropy_for_logits(&ly.view([-1]))
            }),
            vs,
        });
    }
    {
        let vs = nn::VarStore::new(CPU);
        let net = std::rc::Rc::new(mlp(&vs.root()));
        let x = Tensor::randn([2048, 256], (Kind::Float, CPU));
        let y = Tensor::randint(10, [2048], (Kind::Int64, CPU));
        let (n1, x1, y1) = (net.clone(), x.shallow_clone(), y.shallow_clone());
        out.push(Case {
            name: "MLP (8 × 256, ReLU; batch 2048)",
            plain: Box::new(move || {
                let loss = x1.apply_t(&*n1, true).cross_entropy_for_logits(&y1);
                loss.backward();
                loss.double_value(&[])
            }),
            lazy: Box::new(move || {
                let (lx, ly) = lazy((&x, &y), 0);
                lx.apply_t(&*net, true).cross_entropy_for_logits(&ly)
            }),
            vs,
        });
    }
    out
}

fn zero(vs: &nn::VarStore) {
    for mut v in vs.trainable_variables() {
        v.zero_grad();
    }
}

/// Best of `runs` interleaved timings of each step (seconds), `None` where it cannot plan.
fn best_times(case: &Case, steps: &[Option<Options>], runs: usize) -> (f64, Vec<Option<f64>>) {
    let time = |f: &dyn Fn() -> f64| {
        zero(&case.vs);
        let start = Instant::now();
        black_box(f());
        start.elapsed().as_secs_f64()
    };
    let mut plain = f64::INFINITY;
    let mut best: Vec<Option<f64>> = steps.iter().map(|s| s.as_ref().map(|_| f64::INFINITY)).collect();
    for _ in 0..runs {
        plain = plain.min(time(&|| (case.plain)()));
        for (b, s) in best.iter_mut().zip(steps) {
            if let (Some(b), Some(options)) = (b.as_mut(), s) {
                *b = b.min(time(&|| (case.lazy)().backward_with(options).unwrap()));
            }
        }
    }
    (plain, best)
}

fn measured_peak(case: &Case, f: &dyn Fn()) -> u64 {
    zero(&case.vs);
    let before = toma::memory::cpu_allocator_stats().unwrap().allocated;
    toma::memory::reset_cpu_peak();
    f();
    toma::memory::cpu_allocator_stats().unwrap().peak_allocated - before
}

fn recompute(c: &mut Criterion) {
    toma::memory::track_cpu_allocations();
    tch::manual_seed(0);
    println!(
        "| model | budget | split only | recompute first | choice (`Auto`) | plan chosen | measured peak / budget (split, recompute, choice) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for case in cases() {
        // Measured first: plans run nothing, and refuse what this machine prices by no rule.
        (case.lazy)().calibrate(Mode::Backward, &Options::new()).unwrap();
        let whole = (case.lazy)()
            .plan(Mode::Backward, &Options::new().recompute(Recompute::Never).budget(u64::MAX / 4))
            .unwrap();
        let whole = whole.full_batch_peak_bytes();
        for percent in [75u64, 50, 35] {
            let budget = whole * percent / 100;
            let options: Vec<Option<Options>> = [Recompute::Never, Recompute::Always, Recompute::Auto]
                .into_iter()
                .map(|r| {
                    let o = Options::new().budget(budget).recompute(r);
                    (case.lazy)().plan(Mode::Backward, &o).ok().map(|_| o)
                })
                .collect();
            let (plain, times) = best_times(&case, &options, 10);
            let chosen = options[2]
                .as_ref()
                .map(|o| {
                    let p = (case.lazy)().plan(Mode::Backward, o).unwrap();
                    match (p.recomputes(), p.splits()) {
                        (true, true) => {
                            format!("{} segments, micro-batches of {}", p.segments().len(), p.micro_batch())
                        }
                        (true, false) => format!("{} segments", p.segments().len()),
                        (false, _) => format!("micro-batches of {}", p.micro_batch()),
                    }
                })
                .unwrap_or_else(|| "none fits".into());
            let peaks: Vec<String> = options
                .iter()
                .map(|o| match o {
                    Some(o) => {
                        let peak = measured_peak(&case, &|| {
                            black_box((case.lazy)().backward_with(o).unwrap());
                        });
                        format!("{:.2}", peak as f64 / budget as f64)
                    }
                    None => "n/a".into(),
                })
                .collect();
            let ratio = |t: &Option<f64>| t.map_or("refused".to_string(), |t| format!("{:.2}×", t / plain));
            println!(
                "| {} | {percent}% | {} | {} | {} | {chosen} | {} |",
                case.name,
                ratio(&times[0]),
                ratio(&times[1]),
                ratio(&times[2]),
                peaks.join(", ")
            );
            if percent == 50 {
                let mut group =
                    c.benchmark_group(format!("{}_at_50_percent", case.name.split(' ').next().unwrap_or("model")));
                group.sample_size(10);
                group.bench_function("plain_tch_whole_batch", |b| {
                    b.iter(|| {
                        zero(&case.vs);
                        (case.plain)()
                    })
                });
                for (label, o) in ["split_only", "recompute_first", "auto"].into_iter().zip(&options) {
                    if let Some(o) = o {
                        group.bench_function(label, |b| {
                            b.iter(|| {
                                zero(&case.vs);
                                (case.lazy)().backward_with(o).unwrap()
                            })
                        });
                    }
                }
                group.finish();
            }
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = recompute
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
