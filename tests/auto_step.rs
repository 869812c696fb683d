//! `auto` steps on real libtorch allocations: the budget holds once the fit exists, the step
//! reaches the largest that fits within four probes, a second call starts there with no
//! probes, `Fastest` settles near the step with the best throughput, and under a real cap with
//! no budget a call meets at most one real out-of-memory.
//!
//! Its own binary: `auto` turns on the counting CPU allocator for the whole process.
#![cfg(feature = "tch")]

mod support;

use std::time::Duration;

use tch::{Device, Kind, TchError, Tensor};
use toma::{CacheKind, Chunked, Objective, Range};

/// Bytes per item of the workload: one f32 row of 64 Ki values.
const ROW: u64 = 256 << 10;

/// A body that allocates `n` rows (and reduces them), recording its ranges.
fn rows(start: usize, end: usize, seen: &mut Vec<(usize, usize)>) -> Result<(), TchError> {
    let n = (end - start) as i64;
    let t = Tensor::f_ones([n, (ROW / 4) as i64], (Kind::Float, Device::Cpu))?;
    // Summed in its own kind: a Double sum would first copy the rows to f64.
    let s = t.f_sum(Kind::Float)?.f_double_value(&[])?;
    assert!((s - n as f64 * (ROW / 4) as f64).abs() < 1e-3 * s, "{s}");
    seen.push((start, end));
    Ok(())
}

fn assert_covers(seen: &[(usize, usize)], start: usize, end: usize) {
    let mut at = start;
    for &(s, e) in seen {
        assert_eq!(s, at, "chunks not consecutive: {seen:?}");
        at = e;
    }
    assert_eq!(at, end, "chunks do not cover the range: {seen:?}");
}

#[test]
fn largest_fits_the_budget_after_at_most_four_probes() {
    let _serial = support::serial();
    let budget: u64 = 64 << 20;
    let best = (budget / ROW) as usize; // 256 rows, before the small fixed cost
    for kind in [CacheKind::None, CacheKind::Global] {
        let mut seen = Vec::new();
        let (result, report) =
            Range::auto(0, 20_000).budget(budget).cache(kind).run_with_report(|s, e| rows(s, e, &mut seen));
        result.unwrap();
        assert_covers(&seen, 0, 20_000);
        let auto = report.auto.clone().expect("an auto report");
        assert_eq!(auto.over_budget, 0, "{auto:?}");
        assert!(auto.probes <= 4, "{auto:?}");
        let full = &seen[..seen.len() - 1];
        for (i, &(s, e)) in full.iter().enumerate().skip(4) {
            assert!(e - s >= best * 3 / 4 && e - s <= best, "chunk {i} of {} rows, best {best}: {seen:?}", e - s);
        }
        let cpu = auto.devices.iter().find(|d| d.device == toma::MeasuredDevice::Cpu).expect("the CPU measured");
        // The fit knows the row size (within the reduction's small output and libtorch's
        // rounding), and never predicts below what it measured.
        assert!(cpu.bytes_per_item >= ROW && cpu.bytes_per_item <= ROW + ROW / 50, "{cpu:?}");
        assert!(cpu.predicted_at_max >= cpu.max_measured && cpu.max_measured <= budget, "{cpu:?}");
        println!("{kind:?}: {} chunks, {auto:?}", seen.len());
    }
}

#[test]
fn a_second_call_starts_from_the_remembered_fit() {
    let _serial = support::serial();
    let mut reports = Vec::new();
    for _ in 0..2 {
        let mut seen = Vec::new();
        let (result, report) = Range::auto(0, 3000)
            .budget(32 << 20)
            .cache(CacheKind::Global)
            .run_with_report(|s, e| rows(s, e, &mut seen));
        result.unwrap();
        assert_covers(&seen, 0, 3000);
        reports.push(report);
    }
    let (first, second) = (&reports[0], &reports[1]);
    assert_eq!(first.first_size, 1, "{first:?}");
    let second_auto = second.auto.as_ref().unwrap();
    assert!(second.from_cache && second_auto.probes == 0, "{second:?}");
    assert!(second.first_size >= 96 && second.first_size <= 128, "{second:?}");
}

#[test]
fn chunked_auto_keeps_to_its_budget() {
    let _serial = support::serial();
    let data = Tensor::ones([4000, 1024], (Kind::Float, Device::Cpu));
    let mut chunks = Vec::new();
    let (result, report) =
        Chunked::auto(&data).budget(16 << 20).cache(CacheKind::None).run_with_report(|chunk, s, e| {
            // Each chunk makes a 64x larger temporary: 256 KiB per row.
            let wide = chunk.f_repeat([1, 64])?;
            assert_eq!(wide.size()[0], (e - s) as i64);
            chunks.push(e - s);
            Ok::<(), TchError>(())
        });
    result.unwrap();
    assert_eq!(chunks.iter().sum::<usize>(), 4000);
    let auto = report.auto.unwrap();
    assert_eq!(auto.over_budget, 0, "{auto:?}");
    assert!(chunks.iter().all(|&n| n <= 64), "{chunks:?}");
    assert!(chunks[4..chunks.len() - 1].iter().all(|&n| n >= 48), "{chunks:?}");
}

/// A body whose throughput peaks at 64 items: a fixed 20 ms per chunk, then 250 µs per item up
/// to 64 and 1 ms per item beyond (64 items: 1.8 k/s; 32: 1.1 k/s; 128: 0.9 k/s). Long enough
/// that a busy machine's late wake-ups (a few ms) do not decide. Its memory would allow 1024.
#[test]
fn fastest_settles_near_the_best_throughput() {
    let _serial = support::serial();
    let mut chunks = Vec::new();
    let (result, report) = Range::auto(0, 8000)
        .budget(1024 * (64 << 10) + (1 << 20))
        .objective(Objective::Fastest)
        .cache(CacheKind::None)
        .run_with_report(|s, e| {
            let n = e - s;
            let _t = Tensor::f_zeros([n as i64, 16 << 10], (Kind::Float, Device::Cpu))?;
            let per_item = if n <= 64 { 250 } else { 1000 };
            std::thread::sleep(Duration::from_micros(20_000 + per_item * n as u64));
            chunks.push(n);
            Ok::<(), TchError>(())
        });
    result.unwrap();
    let auto = report.auto.unwrap();
    // Where it settled: the step most chunks ran at (a busy machine may make it explore again
    // near the end, so the last chunk alone says less).
    let mut counts = std::collections::BTreeMap::new();
    for &n in &chunks[..chunks.len() - 1] {
        *counts.entry(n).or_insert(0) += 1;
    }
    let (&settled, _) = counts.iter().max_by_key(|&(_, &c)| c).unwrap();
    assert!((38..=102).contains(&settled), "settled on {settled}, want 0.6-1.6x of 64: {chunks:?} {auto:?}");
}

#[test]
fn bad_auto_options_are_config_errors() {
    let text = |f: fn() -> Range| support::payload_text(std::panic::catch_unwind(f).unwrap_err().as_ref());
    assert!(text(|| Range::auto(0, 10).budget(0)).contains("budget (bytes) must be at least 1"));
    assert!(text(|| Range::auto(0, 10).max_step(0)).contains("max_step must be at least 1"));
    assert!(text(|| Range::auto(0, 10).safety_margin(1.5)).contains("safety margin must lie in [0, 1)"));
    assert!(text(|| Range::new(0, 10, 4).budget(1 << 20)).contains("options of Range::auto"));
    assert_eq!(Range::try_auto(5, 1).unwrap_err(), toma::ConfigError::StartAfterEnd { start: 5, end: 1 });
}

/// Under a real cap (`RLIMIT_DATA`, 1 GiB above what is in use) and no budget, the budget is
/// the memory the cap leaves: at most one real out-of-memory per call.
#[cfg(target_os = "linux")]
#[test]
fn at_most_one_real_out_of_memory_under_a_cap() {
    const ENV: &str = "TOMA_AUTO_CAP_CHILD";
    let _serial = support::serial();
    if std::env::var(ENV).is_ok() {
        support::cap_memory(toma::cpu_memory::CpuCap::Data, 1.0);
        let mut seen = Vec::new();
        let (result, report) =
            Range::auto(0, 40_000).cache(CacheKind::None).run_with_report(|s, e| rows(s, e, &mut seen));
        result.unwrap();
        assert_covers(&seen, 0, 40_000);
        let largest = seen.iter().map(|(s, e)| e - s).max().unwrap();
        println!("\nTOMA_AUTO_CAP_DONE ooms={} largest={largest} chunks={}", report.out_of_memory, seen.len());
        return;
    }
    let child = support::child::run("at_most_one_real_out_of_memory_under_a_cap", ENV, "1");
    let values = child.assert_finished("TOMA_AUTO_CAP_DONE");
    let ooms: u32 = values["ooms"].parse().unwrap();
    let largest: usize = values["largest"].parse().unwrap();
    assert!(ooms <= 1, "{}", child.report);
    // 1 GiB less the 10% margin is about 3600 rows; the fit must get well past the probes.
    assert!(largest >= 1500, "{}", child.report);
}

#[cfg(feature = "macros")]
#[toma::range(initial_step = auto, budget = 32 << 20, max_step = 100, cache = None)]
fn rows_attribute(start: usize, end: usize, seen: &mut Vec<(usize, usize)>) -> Result<(), TchError> {
    rows(start, end, seen)
}

#[cfg(feature = "macros")]
#[toma::chunked(initial_step = auto, dimension = 1, budget = 8 << 20, objective = largest, cache = None)]
fn columns_attribute(chunk: Tensor, start: usize, end: usize, widths: &mut Vec<usize>) {
    // Per column: a 64 Ki-row temporary of f32, 256 KiB.
    let _wide = chunk.repeat([1 << 16, 1]);
    assert_eq!(chunk.size()[1], (end - start) as i64);
    widths.push(end - start);
}

/// The attributes lower to the same builders: `max_step` caps, the budget holds.
#[cfg(feature = "macros")]
#[test]
fn attributes_take_auto_and_its_options() {
    let _serial = support::serial();
    let mut seen = Vec::new();
    rows_attribute(0, 2000, &mut seen).unwrap();
    assert_covers(&seen, 0, 2000);
    assert!(seen.iter().all(|(s, e)| e - s <= 100), "{seen:?}");
    assert!(seen[4..seen.len() - 1].iter().all(|(s, e)| e - s == 100), "{seen:?}");
    let t = Tensor::ones([1, 3000], (Kind::Float, Device::Cpu));
    let mut widths = Vec::new();
    columns_attribute(&t, &mut widths);
    assert_eq!(widths.iter().sum::<usize>(), 3000);
    assert!(widths.iter().all(|&w| w <= 32), "{widths:?}");
    assert!(widths[4..widths.len() - 1].iter().all(|&w| w >= 24), "{widths:?}");
}

/// The immediate forms: the same engine, the device's free memory as the budget.
#[test]
fn execute_forms_cover_everything() {
    let _serial = support::serial();
    let mut seen = Vec::new();
    toma::execute::range_auto(0, 500, |s, e| rows(s, e, &mut seen)).unwrap();
    assert_covers(&seen, 0, 500);
    assert!(seen.len() >= 3, "probes first: {seen:?}");
    let t = Tensor::zeros([300, 4], (Kind::Float, Device::Cpu));
    toma::execute::chunked_auto(&t, |mut chunk, _, _| chunk.f_fill_(1.0).map(drop)).unwrap();
    assert_eq!(t.sum(Kind::Double).double_value(&[]), 1200.0);
}

/// An unchanged tch resnet18 through `Range::auto`: chunks weighted by `toma::share` give the
/// full batch's gradients (batch norm in eval mode; f64 so that they agree to 1e-9).
#[test]
fn resnet18_gradients_accumulate_exactly_through_auto_chunks() {
    use tch::nn::{self, ModuleT};
    let _serial = support::serial();
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = tch::vision::resnet::resnet18(&vs.root(), 10);
    vs.double();
    let n = 24;
    let images = Tensor::randn([n as i64, 3, 32, 32], (Kind::Double, Device::Cpu));
    let labels = Tensor::randint(10, [n as i64], (Kind::Int64, Device::Cpu));
    let grads =
        |vs: &nn::VarStore| -> Vec<Tensor> { vs.trainable_variables().iter().map(|v| v.grad().copy()).collect() };

    model.forward_t(&images, false).cross_entropy_for_logits(&labels).backward();
    let full = grads(&vs);
    for mut v in vs.trainable_variables() {
        v.zero_grad();
    }
    let mut sizes = Vec::new();
    let (result, report) = Range::auto(0, n).budget(24 << 20).cache(CacheKind::None).run_with_report(|start, end| {
        let x = images.f_narrow(0, start as i64, (end - start) as i64)?;
        let y = labels.f_narrow(0, start as i64, (end - start) as i64)?;
        let loss = model.forward_t(&x, false).cross_entropy_for_logits(&y);
        loss.f_mul_scalar(toma::share(start, end, n))?.f_backward()?;
        sizes.push(end - start);
        Ok::<(), TchError>(())
    });
    result.unwrap();
    assert!(sizes.len() >= 3 && sizes.iter().sum::<usize>() == n, "{sizes:?} {report:?}");
    let chunked = grads(&vs);
    for (a, b) in full.iter().zip(&chunked) {
        let scale = a.abs().max().double_value(&[]).max(1e-12);
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff <= 1e-9 * scale, "gradient differs by {diff} (scale {scale}); chunks {sizes:?}");
    }
}
