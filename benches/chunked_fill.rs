//! Python toma's own benchmark: fill `zeros(128, 256, 256)` with 1.0 in chunks of 32 rows,
//! through `toma::execute::chunked` and through a hand-written `narrow` loop.
//! Target (issue 5): toma ≤ 1.05× the hand-written loop.

use std::hint::black_box;
use std::time::{Duration, Instant};

mod workload;

use criterion::{criterion_group, Criterion};
use tch::{Device, Kind, Tensor};
use workload::{native, with_toma};

/// Best-of-many milliseconds for both, interleaved so that a busy moment hits both alike.
fn best_ms_pair(t: &Tensor) -> (f64, f64) {
    let time = |f: fn(&Tensor)| {
        let start = Instant::now();
        f(black_box(t));
        start.elapsed().as_secs_f64() * 1e3
    };
    (0..60).fold((f64::INFINITY, f64::INFINITY), |(n, w), _| (n.min(time(native)), w.min(time(with_toma))))
}

fn fill(c: &mut Criterion) {
    let t = Tensor::zeros([128, 256, 256], (Kind::Float, Device::Cpu));
    let mut group = c.benchmark_group("chunked_fill_128x256x256_by_32");
    group.bench_function("native_narrow_loop", |b| b.iter(|| native(&t)));
    group.bench_function("toma_execute_chunked", |b| b.iter(|| with_toma(&t)));
    group.finish();
    let (n, w) = best_ms_pair(&t);
    println!("ratio: chunked fill, toma {w:.3} ms vs native {n:.3} ms: {:.3}x", w / n);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    targets = fill
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
