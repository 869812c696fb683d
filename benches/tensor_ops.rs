//! `TensorOps` on `tch::Tensor` is plain delegation: a small MLP's forward written against the
//! trait against the same code on tch's own methods, side by side in one run (tiny tensors, so
//! that any wrapper cost would show); and a resnet18 forward, `toma::lazy::vision`'s (written
//! once over the trait) against `tch::vision`'s on the same weights; and an MLP built with
//! `toma::lazy::nn::seq()` run eagerly against the same one built with tch's `nn::seq()` (its
//! layers run as tch's, its `add_fn` closures get the input's eager form and call tch's methods:
//! what that costs over tch's closure is what this measures). `cargo bench --bench tensor_ops`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use tch::{nn, Device, Kind, Tensor};
use toma::lazy::{Layer, TensorOps};

fn direct(x: &Tensor, l1: &nn::Linear, l2: &nn::Linear) -> Tensor {
    x.apply(l1).relu().apply(l2).gelu("none").sum(Kind::Float)
}

fn generic<T: TensorOps>(x: &T, l1: &nn::Linear, l2: &nn::Linear) -> T
where
    nn::Linear: Layer<T>,
{
    TensorOps::apply(x, l1).relu().apply(l2).gelu("none").sum(Some(Kind::Float))
}

/// The best of `rounds` timings of `calls` calls each, for `a` and for `b`, interleaved so that
/// drift in the machine's speed hits both alike.
fn best_of(rounds: usize, calls: usize, a: &dyn Fn(), b: &dyn Fn()) -> (f64, f64) {
    let time = |f: &dyn Fn()| {
        let start = std::time::Instant::now();
        for _ in 0..calls {
            f();
        }
        start.elapsed().as_secs_f64()
    };
    let (mut ta, mut tb) = (f64::MAX, f64::MAX);
    for _ in 0..rounds {
        ta = ta.min(time(a));
        tb = tb.min(time(b));
    }
    (ta, tb)
}

fn bench(c: &mut Criterion) {
    tch::set_num_threads(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let l1 = nn::linear(vs.root() / "l1", 8, 8, Default::default());
    let l2 = nn::linear(vs.root() / "l2", 8, 8, Default::default());
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    let _no_grad = tch::no_grad_guard();
    let mut group = c.benchmark_group("tensor_ops");
    group.bench_function("tch_methods", |b| b.iter(|| direct(black_box(&x), &l1, &l2)));
    group.bench_function("through_the_trait", |b| b.iter(|| generic(black_box(&x), &l1, &l2)));
    group.finish();
    let (d, g) = best_of(5, 20_000, &|| drop(direct(&x, &l1, &l2)), &|| drop(generic(&x, &l1, &l2)));
    println!("ratio: through the trait / tch methods = {:.3} (best of 5 x 20000 calls)", g / d);

    // resnet18, tch's and the one written once, on the same weights.
    let tch_vs = nn::VarStore::new(Device::Cpu);
    let theirs = tch::vision::resnet::resnet18(&tch_vs.root(), 10);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let ours = toma::lazy::vision::resnet18(&vs.root(), 10);
    vs.copy(&tch_vs).expect("the same variables");
    let images = Tensor::randn([2, 3, 64, 64], (Kind::Float, Device::Cpu));
    let mut group = c.benchmark_group("resnet18_forward");
    group.bench_function("tch_vision", |b| b.iter(|| nn::ModuleT::forward_t(&theirs, black_box(&images), false)));
    group.bench_function("written_once", |b| b.iter(|| ours.forward_t(black_box(&images), false)));
    group.finish();
    let (d, g) = best_of(7, 20, &|| drop(nn::ModuleT::forward_t(&theirs, &images, false)), &|| {
        drop(ours.forward_t(&images, false))
    });
    println!("ratio: resnet18 forward, written once / tch::vision = {:.3} (best of 7 x 20 forwards)", g / d);

    // An MLP as `nn::seq()` builds it, tch's and toma's, on the same weights.
    let build_tch =
        |vs: &nn::VarStore| {
            nn::seq()
                .add(nn::linear(vs.root() / "l1", 512, 512, Default::default()))
                .add_fn(|x| x.relu())
                .add(nn::linear(vs.root() / "l2", 512, 10, Default::default()))
        };
    let tch_vs = nn::VarStore::new(Device::Cpu);
    let theirs = build_tch(&tch_vs);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let ours = toma::lazy::nn::seq()
        .add(nn::linear(vs.root() / "l1", 512, 512, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 512, 10, Default::default()));
    vs.copy(&tch_vs).expect("the same variables");
    let x = Tensor::randn([64, 512], (Kind::Float, Device::Cpu));
    let mut group = c.benchmark_group("seq_mlp_forward");
    group.bench_function("tch_seq", |b| b.iter(|| nn::Module::forward(&theirs, black_box(&x))));
    group.bench_function("toma_seq", |b| b.iter(|| nn::Module::forward(&ours, black_box(&x))));
    group.finish();
    let (d, g) =
        best_of(7, 2_000, &|| drop(nn::Module::forward(&theirs, &x)), &|| drop(nn::Module::forward(&ours, &x)));
    println!(
        "ratio: nn::seq MLP 64x512 forward, toma::lazy::nn::seq / tch = {:.3} (best of 7 x 2000; {:.2} us more per closure call)",
        g / d,
        (g - d) / 2_000.0 * 1e6
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
