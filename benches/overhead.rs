//! What a toma wrapper adds to a call that needs no retry (a cache hit), per cache kind, and
//! what each part of a cache key costs.
//!
//! Targets (issue 5): ≤ 50 ns added per call for `Global` and `None`, ≤ 2 µs for
//! `StacktraceMemory` (stack capture and free-memory probe included). Besides criterion's own
//! report, `ratio:` lines compare each wrapper with the bare body measured in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use toma::__private::key_parts;

/// The work: trivial on purpose, so that only the wrapper's cost shows.
#[inline(never)]
fn body(batchsize: usize, x: u64) -> Result<u64, String> {
    Ok(black_box(x).wrapping_mul(batchsize as u64))
}

#[toma::batch(initial_batchsize = 64, cache = Global)]
fn wrapped_global(batchsize: usize, x: u64) -> Result<u64, String> {
    body(batchsize, x)
}

#[toma::batch(initial_batchsize = 64, cache = None)]
fn wrapped_none(batchsize: usize, x: u64) -> Result<u64, String> {
    body(batchsize, x)
}

#[toma::batch(initial_batchsize = 64, cache = StacktraceMemory)]
fn wrapped_stacktrace(batchsize: usize, x: u64) -> Result<u64, String> {
    body(batchsize, x)
}

static LIMITED_ATTEMPTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs out of memory above 16; the default cache (StacktraceMemory) should remember that.
#[toma::batch(initial_batchsize = 64)]
fn limited(batchsize: usize) -> Result<usize, String> {
    LIMITED_ATTEMPTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if batchsize > 16 {
        return Err("CUDA out of memory. Tried to allocate 2.00 MiB".into());
    }
    Ok(batchsize)
}

/// In this optimised build (where the compiler may unroll the loop), one line called in a loop
/// must hit the StacktraceMemory cache from its second call on.
fn check_loop_hits_in_release() {
    let attempts = || LIMITED_ATTEMPTS.load(std::sync::atomic::Ordering::Relaxed);
    let mut per_call = [0; 8];
    for slot in &mut per_call {
        let before = attempts();
        assert_eq!(limited(), Ok(16));
        *slot = attempts() - before;
    }
    assert_eq!(per_call, [3, 1, 1, 1, 1, 1, 1, 1], "attempts per call of one line in a loop");
    println!("check: one line in a loop hits the StacktraceMemory cache in this build: {per_call:?}");
}

/// Nanoseconds per call: the best of several timed loops (the least disturbed one).
fn ns_per_call(mut f: impl FnMut(), iterations: u32) -> f64 {
    (0..7)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iterations {
                f();
            }
            start.elapsed().as_secs_f64() * 1e9 / f64::from(iterations)
        })
        .fold(f64::INFINITY, f64::min)
}

fn calls(c: &mut Criterion) {
    let mut group = c.benchmark_group("batch_call");
    group.bench_function("native", |b| b.iter(|| body(64, black_box(3))));
    group.bench_function("toma_global", |b| b.iter(|| wrapped_global(black_box(3))));
    group.bench_function("toma_none", |b| b.iter(|| wrapped_none(black_box(3))));
    group.bench_function("toma_stacktrace_memory", |b| b.iter(|| wrapped_stacktrace(black_box(3))));
    group.finish();

    let native = ns_per_call(
        || {
            let _ = black_box(body(64, black_box(3)));
        },
        2_000_000,
    );
    let global = || {
        let _ = black_box(wrapped_global(black_box(3)));
    };
    let none = || {
        let _ = black_box(wrapped_none(black_box(3)));
    };
    let stacktrace = || {
        let _ = black_box(wrapped_stacktrace(black_box(3)));
    };
    for (name, iterations, f) in [
        ("Global", 2_000_000, &global as &dyn Fn()),
        ("None", 2_000_000, &none),
        ("StacktraceMemory", 100_000, &stacktrace),
    ] {
        let wrapped = ns_per_call(f, iterations);
        println!(
            "ratio: #[toma::batch] cache hit, {name:<16} {wrapped:>8.1} ns/call vs native {native:.1} ns: \
             +{:.1} ns added ({:.1}x)",
            wrapped - native,
            wrapped / native
        );
    }
}

fn key_parts(c: &mut Criterion) {
    let mut group = c.benchmark_group("key_parts");
    group.bench_function("stack_walk_bounded", |b| b.iter(key_parts::stack_hash));
    group.bench_function("free_memory_shared_reading", |b| b.iter(key_parts::free_memory_reading));
    group.bench_function("cpu_available_fresh", |b| b.iter(toma::cpu_memory::available_cpu_memory));
    group.bench_function("gpu_free_probe", |b| b.iter(|| toma::memory::cuda_memory(0)));
    group.finish();
    println!(
        "ratio: key parts: stack walk {:.0} ns, shared free-memory reading {:.0} ns, fresh CPU reading {:.0} ns, \
         GPU probe {:.0} ns ({})",
        ns_per_call(
            || {
                black_box(key_parts::stack_hash());
            },
            50_000
        ),
        ns_per_call(
            || {
                black_box(key_parts::free_memory_reading());
            },
            1_000_000
        ),
        ns_per_call(
            || {
                black_box(toma::cpu_memory::available_cpu_memory());
            },
            5_000
        ),
        ns_per_call(
            || {
                black_box(toma::memory::cuda_memory(0));
            },
            100_000
        ),
        if toma::memory::cuda_device_count() > 0 { "CUDA device 0" } else { "no CUDA device: returns None" },
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = calls, key_parts
}

fn main() {
    check_loop_hits_in_release();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
