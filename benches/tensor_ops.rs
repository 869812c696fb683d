//! `TensorOps` on `tch::Tensor` is plain delegation: a small MLP's forward written against the
//! trait against the same code on tch's own methods, side by side in one run (tiny tensors, so
//! that any wrapper cost would show). `cargo bench --bench tensor_ops`.

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
    TensorOps::sum(&TensorOps::apply(x, l1).relu().apply(l2).gelu("none"), Some(Kind::Float))
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
    let time = |f: &dyn Fn()| {
        let start = std::time::Instant::now();
        for _ in 0..20_000 {
            f();
        }
        start.elapsed().as_secs_f64()
    };
    let (mut d, mut g) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        d = d.min(time(&|| drop(direct(&x, &l1, &l2))));
        g = g.min(time(&|| drop(generic(&x, &l1, &l2))));
    }
    println!("ratio: through the trait / tch methods = {:.3} (best of 5 x 20000 calls)", g / d);
}

criterion_group!(benches, bench);
criterion_main!(benches);
