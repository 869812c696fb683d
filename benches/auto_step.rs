//! The cost of adapting: a range loop over a real workload under a real CPU cap
//! (`RLIMIT_DATA`, 768 MiB above what is in use), `Range::auto` with no budget against the
//! same loop at the best fixed step known in advance (the largest that fits the same budget).
//! `auto` is run twice: without a cache (four probes every call, the worst case) and with the
//! default cache (the fit is remembered: no probes after the first call).
//! Goal (issue 17): auto ≤ 1.10× the fixed step.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use tch::{Device, Kind, Tensor};
use toma::{CacheKind, Range};

/// Items per call, and floats per item (256 KiB).
const ITEMS: usize = 4096;
const FLOATS: i64 = 1 << 16;

fn body(start: usize, end: usize) -> Result<(), tch::TchError> {
    let x = Tensor::f_ones([(end - start) as i64, FLOATS], (Kind::Float, Device::Cpu))?;
    // Two temporaries as large as the chunk, then a reduction: 3 × 256 KiB per item at the peak.
    let y = x.f_mul_scalar(0.5)?.f_relu()?;
    black_box(y.f_sum(Kind::Float)?.f_double_value(&[])?);
    Ok(())
}

fn fixed(step: usize) {
    Range::new(0, ITEMS, step).cache(CacheKind::None).run(body).unwrap();
}

fn auto(cache: CacheKind) -> usize {
    let (result, report) = Range::auto(0, ITEMS).cache(cache).run_with_report(body);
    result.unwrap();
    report.auto.map_or(0, |a| a.step)
}

fn adapting(c: &mut Criterion) {
    // Warm libtorch's threads up, then cap, as a user on a shared machine would.
    let _ = Tensor::ones([1 << 20], (Kind::Float, Device::Cpu)).sum(Kind::Float).double_value(&[]);
    toma::cpu_memory::CpuCap::Data.set_headroom(768 << 20).expect("cap the data segment");
    // The best fixed step known in advance: the budget auto computes (free less 10%), over the
    // peak per item; auto's own fit is printed beside it.
    let budget = (toma::cpu_memory::available_cpu_memory() as f64 * 0.9) as u64;
    let best = (budget / (3 * 4 * FLOATS as u64)) as usize;
    let settled = auto(CacheKind::None);
    println!("budget {} MiB: best fixed step {best}, auto settles on {settled}", budget >> 20);

    let mut group = c.benchmark_group("range_4096_items_of_256KiB_under_a_cap");
    group.sample_size(10);
    group.bench_function("fixed_best_step", |b| b.iter(|| fixed(best)));
    group.bench_function("auto_probing_every_call", |b| b.iter(|| auto(CacheKind::None)));
    group.bench_function("auto_remembered", |b| b.iter(|| auto(CacheKind::Global)));
    group.finish();

    // Ratios from interleaved runs, so that a busy moment hits all alike.
    let time = |f: &dyn Fn()| {
        let start = Instant::now();
        f();
        start.elapsed().as_secs_f64()
    };
    let (mut f, mut p, mut r) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for _ in 0..8 {
        f = f.min(time(&|| fixed(best)));
        p = p.min(time(&|| {
            auto(CacheKind::None);
        }));
        r = r.min(time(&|| {
            auto(CacheKind::Global);
        }));
    }
    println!(
        "ratio: auto probing every call {:.3}x, auto remembered {:.3}x the best fixed step ({:.1} ms)",
        p / f,
        r / f,
        f * 1e3
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_millis(500));
    targets = adapting
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
