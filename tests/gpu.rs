//! On a CUDA machine: real CUDA out-of-memory (1-3), the planner against the caching allocator
//! (4: peaks, plans holding on a filled card, reduction staging buffers), a lazy step against
//! CPU gradients (5), what an address-space or data-segment cap does to CUDA (6), the Rust half
//! of the side-by-side with Python toma (7), time per sample by batch size (8), auto steps (9),
//! recomputing: gradients, peak and time against splitting (10), `Fastest` on a kernel curve
//! (11), the zoo on a filled card and against the CPU (12, 13), autocast (14), and the zoo's
//! GPT-2 stack part by part (15), two threads calibrating on one card at once (16).
//!
//! Opt-in: every GPU test is `#[ignore]`d, so `cargo test` lists them as ignored, never as
//! passed; `scripts/gpu-run.sh` runs them with `--include-ignored` and `TOMA_CUDA_TESTS=1`.
//! Run without that variable they still print `skipped: set TOMA_CUDA_TESTS=1 on a CUDA
//! machine` and return; with it set, a machine where the driver or libtorch sees no CUDA
//! device fails them loudly. `scripts/gpu-bundle.sh` builds and packs this binary,
//! `scripts/gpu-run.sh` runs it on the GPU machine. Each measurement is printed as one
//! `GPU-RESULT <test> key=value ..` line, which gpu-run.sh collects.
//!
//! The tests share one card, so they take turns (`Gpu` holds a lock). Sizes come from the
//! card's total memory: the first attempts ask for more than the card has.
//!
//! The one test that runs everywhere, `allocator_functions_agree_with_the_machine`, checks the
//! allocator functions against the machine: `None`/`false` without a CUDA device (CI).
#![cfg(all(feature = "tch", feature = "macros", feature = "cuda"))]

mod support;

use std::collections::BTreeMap;
use std::fmt::Display;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use support::models::*;
use support::zoo::*;
use support::{MeasuredPlan, Recorder};
use tch::nn;
use tch::{Device, Kind, TchError, Tensor};
use toma::cpu_memory::CpuCap;
use toma::lazy::{LazyTensor, Mode, Options};
use toma::memory::{self, AllocatorStats};

const OPT_IN: &str = "TOMA_CUDA_TESTS";
const CUDA: Device = Device::Cuda(0);
const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
/// Floats in a row of the batch tests: 64 MiB.
const ROW_FLOATS: i64 = 16 << 20;
const ROW_BYTES: u64 = ROW_FLOATS as u64 * 4;
/// What libtorch's CUDA allocator says when it runs out.
const CUDA_OOM: &str = "CUDA out of memory";

// ---------------------------------------------------------------------------------------------
// Gate, card, reports

/// The card, held by one test at a time.
struct Gpu {
    _turn: MutexGuard<'static, ()>,
    /// Bytes of memory of device 0.
    total: u64,
}

/// `Some` on a CUDA machine with `TOMA_CUDA_TESTS=1`; `None` (after saying so) without the
/// opt-in. Panics when opted in on a machine where CUDA does not work.
fn gpu(test: &str) -> Option<Gpu> {
    if std::env::var(OPT_IN).as_deref() != Ok("1") {
        println!("{test}: skipped: set {OPT_IN}=1 on a CUDA machine");
        return None;
    }
    let turn = turn();
    let driver = memory::cuda_device_count();
    assert!(driver > 0, "{OPT_IN}=1, but the CUDA driver sees no device (no driver library, or no GPU)");
    let torch = tch::Cuda::device_count();
    assert!(
        torch > 0,
        "the driver sees {driver} CUDA device(s) but libtorch none: libtorch_cuda is not loaded \
         (build.rs links it into this package's tests) or libtorch is a CPU build"
    );
    if let Err(err) = memory::try_cuda_allocator_stats(0) {
        panic!("libtorch sees {torch} CUDA device(s) but toma cannot read its allocator: {err}");
    }
    // Each test starts from a card without the blocks an earlier test left in the cache.
    memory::release_cached_blocks();
    let total = memory::cuda_memory(0).expect("device 0 reports its memory").total;
    Some(Gpu { _turn: turn, total })
}

/// The card's lock: one test at a time uses it.
fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Prints one result line for gpu-run.sh to collect.
fn report(test: &str, fields: &[(&str, &dyn Display)]) {
    let fields: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("GPU-RESULT {test} {}", fields.join(" "));
}

/// The card's allocator segments as one line (`GPU-SEGMENTS`), for a replay on the CPU from
/// the state a step started in: each segment `pool:address:blocks` (`L` large, `S` small, `x`
/// expandable, `p` private), each block its bytes and `a` (in a tensor), `w` (waiting for a
/// stream) or `f` (free). "unavailable" where toma's shim could not read them.
fn report_segments(test: &str, fields: &[(&str, &dyn Display)]) {
    let fields: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let list = match memory::try_cuda_segments(0) {
        Ok(segments) => segments
            .iter()
            .map(|s| {
                let pool = format!(
                    "{}{}{}",
                    if s.large_pool { "L" } else { "S" },
                    if s.expandable { "x" } else { "" },
                    if s.private_pool { "p" } else { "" }
                );
                let blocks: Vec<String> = s
                    .blocks
                    .iter()
                    .map(|b| {
                        let state = match b.state {
                            memory::CudaBlockState::Allocated => "a",
                            memory::CudaBlockState::PendingFree => "w",
                            _ => "f",
                        };
                        format!("{}{state}", b.size)
                    })
                    .collect();
                format!("{pool}:{:#x}:{}", s.address, blocks.join(","))
            })
            .collect::<Vec<_>>()
            .join(";"),
        Err(err) => format!("unavailable({})", err.to_string().replace(' ', "_")),
    };
    println!("GPU-SEGMENTS {test} {} segments={list}", fields.join(" "));
}

fn stats() -> AllocatorStats {
    memory::cuda_allocator_stats(0).expect("allocator statistics of device 0")
}

fn gib(bytes: u64) -> String {
    format!("{:.2}GiB", bytes as f64 / GIB)
}

/// Runs the kinds of ops the tests use once, so that libtorch's lasting allocations (cuBLAS
/// workspaces, kernels' scratch) exist before a test takes its baseline.
fn warm_up() {
    let a = Tensor::ones([256, 256], (Kind::Float, CUDA));
    let _ = a.matmul(&a).sum(Kind::Float).double_value(&[]);
    let _ = a.f_repeat([1, 2]).unwrap().amin([1], false).amax([0], false).double_value(&[]);
    tch::Cuda::synchronize(0);
}

/// A batch size whose first attempt asks for about four times the card's memory.
fn rows_beyond_the_card() -> usize {
    let total = memory::cuda_memory(0).map_or(1 << 30, |m| m.total);
    ((2 * total / ROW_BYTES) as usize).next_power_of_two()
}

static ATTEMPTS: Recorder = Recorder::new();
static ERRORS: Recorder<String> = Recorder::new();

fn recorded(err: TchError) -> TchError {
    ERRORS.push(err.to_string());
    err
}

/// `rows` rows of ones on the card plus a temporary as large (2 × rows × 64 MiB); checks them.
fn ones_and_double(rows: usize) -> Result<(), TchError> {
    let x = Tensor::f_ones([rows as i64, ROW_FLOATS], (Kind::Float, CUDA)).map_err(recorded)?;
    let y = x.f_add(&x).map_err(recorded)?;
    // Reductions to one value: no temporary of the input's size.
    let (min, max) = (y.f_min()?.f_double_value(&[])?, y.f_max()?.f_double_value(&[])?);
    assert_eq!((min, max), (2.0, 2.0), "every element was computed");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Everywhere: the allocator functions agree with the machine.

#[test]
fn allocator_functions_agree_with_the_machine() {
    let _turn = turn();
    let (driver, torch) = (memory::cuda_device_count(), tch::Cuda::device_count());
    println!("CUDA devices: driver {driver}, libtorch {torch}");
    if driver == 0 && torch == 0 {
        assert_eq!(memory::cuda_allocator_stats(0), None);
        assert!(!memory::reset_cuda_peak(0));
        assert!(!memory::empty_cuda_cache());
        assert_eq!(memory::release_cached_blocks(), 0);
        assert_eq!(memory::cuda_current_device(), None);
        assert_eq!(memory::cuda_usable_memory(0), None);
        return;
    }
    let torch = torch as usize;
    for device in 0..torch {
        let s = memory::cuda_allocator_stats(device).expect("libtorch's device has statistics");
        assert!(s.allocated <= s.reserved && s.allocated <= s.peak_allocated, "{s:?}");
    }
    assert_eq!(memory::cuda_allocator_stats(torch), None);
    assert!(memory::cuda_current_device().is_some_and(|d| d < torch));
    assert!(memory::empty_cuda_cache());
}

// ---------------------------------------------------------------------------------------------
// 1. #[toma::batch] under a real CUDA out-of-memory: converges, leaks nothing.

/// f_ methods: the out-of-memory arrives as `Err`.
#[toma::batch(initial_batchsize = rows_beyond_the_card(), cache = None)]
fn rows_with_errors(batchsize: usize) -> Result<usize, TchError> {
    ATTEMPTS.push(batchsize);
    ones_and_double(batchsize)?;
    Ok(batchsize)
}

/// Plain methods: the out-of-memory arrives as a panic.
#[toma::batch(initial_batchsize = rows_beyond_the_card(), cache = None)]
fn rows_with_panics(batchsize: usize) -> usize {
    ATTEMPTS.push(batchsize);
    let x = Tensor::ones([batchsize as i64, ROW_FLOATS], (Kind::Float, CUDA));
    let y = &x + &x;
    assert_eq!((y.min().double_value(&[]), y.max().double_value(&[])), (2.0, 2.0));
    batchsize
}

/// Runs `call` once from a warm card and checks convergence, real OOMs and no leak.
fn converge(test: &str, gpu: &Gpu, call: impl FnOnce() -> usize) {
    let before = stats();
    let usable_before = memory::cuda_usable_memory(0).expect("usable memory");
    let started = Instant::now();
    let converged = call();
    tch::Cuda::synchronize(0);
    let secs = started.elapsed().as_secs_f64();
    let after = stats();
    let attempts = ATTEMPTS.take();
    let errors = ERRORS.take();
    println!("{test}: attempts {attempts:?} -> {converged} rows of 64 MiB in {secs:.2} s; errors {errors:#?}");

    support::assert_halving(&attempts, rows_beyond_the_card());
    assert_eq!(attempts.last(), Some(&converged));
    assert!(attempts.len() >= 2, "the first attempt asks for ~4x the card and must fail: {attempts:?}");
    assert!(2 * converged as u64 * ROW_BYTES <= gpu.total, "{converged} rows cannot fit");
    let ooms = after.ooms - before.ooms;
    assert_eq!(ooms as usize, attempts.len() - 1, "one allocator OOM per failed attempt: {before:?} -> {after:?}");
    assert!(errors.iter().all(|e| e.contains(CUDA_OOM)), "not libtorch's CUDA OOM: {errors:#?}");
    // Nothing of the failed or the good attempts is still alive.
    assert_eq!(after.allocated, before.allocated, "leaked: {before:?} -> {after:?}");
    assert!(after.peak_allocated >= 2 * converged as u64 * ROW_BYTES, "{after:?}");

    // The cache holds what the attempts freed; usable memory counts it, the driver does not.
    let driver_free = memory::cuda_memory(0).unwrap().free;
    let usable_cached = memory::cuda_usable_memory(0).unwrap();
    let released = memory::release_cached_blocks();
    let usable_released = memory::cuda_usable_memory(0).unwrap();
    let emptied = stats();
    println!(
        "{test}: usable before {} / with the cache {} (driver free {}, cached {}) / after releasing {} ({})",
        gib(usable_before),
        gib(usable_cached),
        gib(driver_free),
        gib(after.cached()),
        gib(usable_released),
        gib(released)
    );
    assert!(released > 0 && released <= after.cached(), "released {released} of {after:?}");
    assert!(emptied.reserved < after.reserved, "{after:?} -> {emptied:?}");
    for usable in [usable_cached, usable_released] {
        assert!(usable.abs_diff(usable_before) <= 256 * MIB, "usable memory moved: {usable} vs {usable_before}");
    }

    report(
        test,
        &[
            ("card", &gib(gpu.total)),
            ("attempts", &attempts.len()),
            ("first_rows", &attempts[0]),
            ("converged_rows", &converged),
            ("peak_allocated", &gib(after.peak_allocated)),
            ("allocator_ooms", &ooms),
            ("secs", &format!("{secs:.2}")),
            ("released", &gib(released)),
        ],
    );
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn batch_converges_under_a_real_cuda_oom_without_leaking() {
    let Some(gpu) = gpu("batch_converges_under_a_real_cuda_oom_without_leaking") else { return };
    warm_up();
    memory::release_cached_blocks();
    converge("batch_errors", &gpu, || rows_with_errors().expect("converges to a size that fits"));
    converge("batch_panics", &gpu, rows_with_panics);
}

// ---------------------------------------------------------------------------------------------
// 2. #[toma::range] and #[toma::chunked] over CUDA tensors under a real out-of-memory.

static RANGES: Recorder<(usize, usize)> = Recorder::new();

/// Each sub-range needs 2 × its length × 64 MiB; adds 1 to `seen[start..end]` once it is done.
#[toma::range(initial_step = rows_beyond_the_card(), cache = None)]
fn rows_in_ranges(start: usize, end: usize, seen: &Tensor) -> Result<(), TchError> {
    RANGES.push((start, end));
    ones_and_double(end - start)?;
    let mut part = seen.f_narrow(0, start as i64, (end - start) as i64)?;
    let _ = part.f_add_(&Tensor::f_ones([(end - start) as i64], (Kind::Float, CUDA))?)?;
    Ok(())
}

/// Checks the recorded attempts of one call over `[0, len)` (see
/// [`support::check_halving_ranges`]). Returns the longest finished sub-range and the number
/// of failed attempts.
fn check_ranges(ranges: &[(usize, usize)], len: usize) -> (usize, usize) {
    let done = support::check_halving_ranges(ranges, len);
    (done.iter().map(|r| r.1 - r.0).max().unwrap_or(0), ranges.len() - done.len())
}

/// Slices of the chunked tensor.
const SLICES: i64 = 64;
static CHUNKS: Recorder<(usize, usize)> = Recorder::new();

/// Needs temporaries of 5 × the chunk; slice `i` becomes `2 i + 1` (from `i`): a slice done
/// twice would read `4 i + 3`, one skipped `i`.
#[toma::chunked(initial_step = SLICES as usize, cache = None)]
fn slices_in_chunks(mut chunk: Tensor, start: usize, end: usize) -> Result<(), TchError> {
    CHUNKS.push((start, end));
    let wide = chunk.f_repeat([1, 4]).map_err(recorded)?;
    let mut computed = chunk.f_add(&chunk).map_err(recorded)?;
    // The repeated slices are the chunk's: their maxima match.
    assert!(wide.f_amax([1], false)?.f_equal(&chunk.f_amax([1], false)?)?);
    drop(wide);
    let _ = computed.f_add_scalar_(1.0)?; // in place: allocates nothing
    chunk.f_copy_(&computed)
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn range_and_chunked_halve_under_a_real_cuda_oom() {
    let Some(gpu) = gpu("range_and_chunked_halve_under_a_real_cuda_oom") else { return };
    warm_up();
    memory::release_cached_blocks();

    // Range over rows: every index once.
    let len = rows_beyond_the_card();
    let seen = Tensor::zeros([len as i64], (Kind::Float, CUDA));
    let before = stats();
    let started = Instant::now();
    rows_in_ranges(0, len, &seen).expect("every sub-range is done");
    let secs = started.elapsed().as_secs_f64();
    let ranges = RANGES.take();
    let errors = ERRORS.take();
    println!("range: attempts {ranges:?} in {secs:.2} s");
    let (step, failed) = check_ranges(&ranges, len);
    assert!(failed >= 1 && step < len, "the whole range cannot fit: {ranges:?}");
    assert!(errors.iter().all(|e| e.contains(CUDA_OOM)), "{errors:#?}");
    let after = stats();
    assert_eq!(after.allocated, before.allocated, "leaked: {before:?} -> {after:?}");
    let counts = Vec::<f32>::try_from(&seen.to_device(Device::Cpu)).unwrap();
    assert!(counts.iter().all(|&c| c == 1.0), "an index was done twice or never: {counts:?}");
    drop(seen);
    report(
        "range",
        &[
            ("card", &gib(gpu.total)),
            ("rows", &len),
            ("step", &step),
            ("failed", &failed),
            ("secs", &format!("{secs:.2}")),
        ],
    );

    // Chunked over a tensor of a quarter of the card: the whole chunk's temporaries cannot fit.
    let columns = (gpu.total / 4 / SLICES as u64 / 4) as i64;
    let tensor = Tensor::arange(SLICES, (Kind::Float, CUDA)).view([SLICES, 1]).repeat([1, columns]);
    let started = Instant::now();
    slices_in_chunks(&tensor).expect("every chunk is done");
    tch::Cuda::synchronize(0);
    let secs = started.elapsed().as_secs_f64();
    let chunks = CHUNKS.take();
    let errors = ERRORS.take();
    println!("chunked: attempts {chunks:?} in {secs:.2} s");
    let (step, failed) = check_ranges(&chunks, SLICES as usize);
    assert!(failed >= 1 && step < SLICES as usize, "the whole tensor's temporaries cannot fit: {chunks:?}");
    assert!(errors.iter().all(|e| e.contains(CUDA_OOM)), "{errors:#?}");
    let (min, max) = (tensor.amin([1], false), tensor.amax([1], false));
    let (min, max) = (Vec::<f32>::try_from(&min).unwrap(), Vec::<f32>::try_from(&max).unwrap());
    for i in 0..SLICES as usize {
        let expected = 2.0 * i as f32 + 1.0;
        assert_eq!((min[i], max[i]), (expected, expected), "slice {i} (2 i + 1 expected)");
    }
    report(
        "chunked",
        &[
            ("card", &gib(gpu.total)),
            ("tensor", &gib(tensor.numel() as u64 * 4)),
            ("step", &step),
            ("failed", &failed),
            ("secs", &format!("{secs:.2}")),
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// 3. The second call starts at the cached size: one attempt, no out-of-memory.

/// The default cache (call site + stack + free memory): a CUDA cache that still holds the
/// first call's blocks must not change the key (usable memory counts them as free).
#[toma::batch(initial_batchsize = rows_beyond_the_card())]
fn rows_remembered(batchsize: usize) -> Result<usize, TchError> {
    ATTEMPTS.push(batchsize);
    ones_and_double(batchsize)?;
    Ok(batchsize)
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn a_second_call_hits_the_cache_without_an_oom() {
    let Some(gpu) = gpu("a_second_call_hits_the_cache_without_an_oom") else { return };
    warm_up();
    memory::release_cached_blocks();
    let mut runs = Vec::new();
    for run in 0..3 {
        match run {
            // A fresh free-memory reading (they live a second), with the cache still full.
            1 => std::thread::sleep(Duration::from_millis(1100)),
            // The same after toma-style release of the cache between calls.
            2 => {
                memory::release_cached_blocks();
                std::thread::sleep(Duration::from_millis(1100));
            }
            _ => {}
        }
        let reading = toma::__private::key_parts::free_memory_reading();
        let before = stats();
        let started = Instant::now();
        let converged = rows_remembered().expect("converges");
        let secs = started.elapsed().as_secs_f64();
        let ooms = stats().ooms - before.ooms;
        let attempts = ATTEMPTS.take();
        println!(
            "run {run}: cpu {} gpu {} cached {}: attempts {attempts:?}, allocator OOMs {ooms}, {secs:.2} s",
            gib(reading.0),
            gib(reading.1.unwrap_or(0)),
            gib(before.cached())
        );
        runs.push((attempts, converged, ooms, secs, reading));
    }
    ERRORS.take();
    let converged = runs[0].1;
    assert!(runs[0].0.len() >= 2, "the first call must run out: {:?}", runs[0]);
    // Usable memory does not move with what libtorch caches, so the key stays put...
    let first_gpu = runs[0].4 .1.expect("a GPU reading");
    for (run, (attempts, _, ooms, _, reading)) in runs.iter().enumerate().skip(1) {
        let gpu = reading.1.expect("a GPU reading");
        assert!(gpu.abs_diff(first_gpu) <= 64 * MIB, "run {run}: usable {gpu} vs {first_gpu} at first");
        // ...unless a reading sits right at a 256 MiB bucket's edge: then the miss is the
        // bucketing's, not the reading's, and is reported rather than failed.
        let bucket = |r: (u64, Option<u64>)| (r.0 >> 28, r.1.map(|g| g >> 28));
        if bucket(*reading) != bucket(runs[0].4) {
            println!(
                "run {run}: the reading crossed a 256 MiB bucket edge ({reading:?} vs {:?}): not a hit",
                runs[0].4
            );
            continue;
        }
        assert_eq!(attempts, &[converged], "run {run} starts at the cached size");
        assert_eq!(*ooms, 0, "run {run} ran out of memory");
    }
    report(
        "cache_hit",
        &[
            ("card", &gib(gpu.total)),
            ("first_attempts", &runs[0].0.len()),
            ("first_secs", &format!("{:.2}", runs[0].3)),
            ("hit_secs", &format!("{:.3}", runs[1].3)),
            ("hit_after_release_secs", &format!("{:.3}", runs[2].3)),
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// 4. toma::lazy's planned peak against the allocator's measured peak.

/// Issue 6's target: the planned peak within 10% of the measured one, either way. An
/// underestimate beyond the default safety margin (10%) is what turns into an out-of-memory...
const UNDER_TOLERANCE: f64 = 0.10;
/// ...and an overestimate wastes memory: smaller micro-batches than would fit.
const OVER_TOLERANCE: f64 = 0.10;
/// Absolute slack for the smallest cases, where kernels' scratch buffers (cuDNN workspaces)
/// are a large part of the peak.
const SLACK: u64 = 32 * MIB;

/// One measurement: the plan's peak for forward and backward of the whole batch, the peak
/// the allocator saw above what was live before (inputs, parameters), and the plan's schedule
/// (printed when the two disagree).
fn planned_and_measured(loss: &LazyTensor, batch: usize) -> (u64, u64, String) {
    let options = Options::new().micro_batch(batch);
    let plan = loss.measured_plan(Mode::Backward, &options).expect("a plan");
    assert!(!plan.splits(), "the whole batch is planned: {plan}");
    let measured = peak_above_before(|| {
        loss.backward_with(&options).expect("forward and backward");
    });
    (plan.peak_bytes(), measured, plan.to_string())
}

/// The allocator's peak while `run` runs, above what was allocated before it.
fn peak_above_before(run: impl FnOnce()) -> u64 {
    tch::Cuda::synchronize(0);
    let before = stats().allocated;
    assert!(memory::reset_cuda_peak(0));
    run();
    tch::Cuda::synchronize(0);
    stats().peak_allocated - before
}

fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / MIB as f64)
}

/// Whether a planned peak is within the tolerances of the measured one.
fn within(planned: u64, measured: u64) -> bool {
    let (p, m) = (planned as f64, measured as f64);
    m <= p * (1.0 + UNDER_TOLERANCE) + SLACK as f64 && p <= m * (1.0 + OVER_TOLERANCE) + SLACK as f64
}

/// A model of the planner tests: its name, whether it has convolutions (whose cuDNN workspace
/// is elastic, see below), its batch sizes, and a builder of its lazy loss on a fresh model.
type PlannerModel = (&'static str, bool, &'static [i64], fn(i64) -> LazyTensor);

fn planner_models() -> [PlannerModel; 4] {
    fn labels(n: i64) -> Tensor {
        Tensor::randint(10, [n], (Kind::Int64, CUDA))
    }
    [
        ("mlp", false, &[256, 1024, 4096, 16384], |n| {
            let vs = nn::VarStore::new(CUDA);
            mlp_lazy(&mlp(&vs), &Tensor::randn([n, 1024], (Kind::Float, CUDA)), &labels(n))
        }),
        ("cnn", true, &[64, 256, 1024], |n| {
            let vs = nn::VarStore::new(CUDA);
            cnn_lazy(&cnn(&vs), &Tensor::randn([n, 3, 64, 64], (Kind::Float, CUDA)), &labels(n))
        }),
        ("transformer", false, &[8, 32, 128], |n| {
            let vs = nn::VarStore::new(CUDA);
            block_lazy(&block(&vs), &Tensor::randn([n, T, D], (Kind::Float, CUDA)), &labels(n))
        }),
        // Not a model the CUDA rules were fitted on: batch norm, a strided convolution, a 1x1
        // projection, a residual sum and average pooling.
        ("res", true, &[64, 256, 1024], |n| {
            let vs = nn::VarStore::new(CUDA);
            res_lazy(&res(&vs), &Tensor::randn([n, 3, 64, 64], (Kind::Float, CUDA)), &labels(n))
        }),
    ]
}

/// Planned against measured peaks. Without convolutions the plan must be within 10% either
/// way. cuDNN's convolution workspace is elastic: PyTorch tries the engines its heuristics
/// rank first and, when one's workspace cannot be allocated, falls back to the next. On a
/// free card a convolution may take far more than the plan counts (2.2 GiB for one 3x3
/// convolution of the `res` model at batch 1024), so for models with convolutions only an
/// overestimate fails here, and `plans_hold_on_a_filled_card` checks that the plan holds
/// when the memory is not there.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn planner_peak_matches_the_allocator_on_gpu() {
    let Some(_gpu) = gpu("planner_peak_matches_the_allocator_on_gpu") else { return };
    warm_up();
    tch::manual_seed(11);
    let mut rows = Vec::new();
    for (model, convolutions, batches, build) in planner_models() {
        // Warm-up: cuBLAS/cuDNN handles and kernels, not measured.
        planned_and_measured(&build(4), 4);
        for &batch in batches {
            let (planned, measured, plan) = planned_and_measured(&build(batch), batch as usize);
            let error = (planned as f64 - measured as f64) / measured as f64;
            println!(
                "planner {model:>11} batch {batch:>5}: planned {:>10} measured {:>10} error {:+.1}%",
                mib(planned),
                mib(measured),
                100.0 * error
            );
            if !within(planned, measured) {
                println!("{plan}");
            }
            let error = format!("{:+.1}%", 100.0 * error);
            report(
                "planner",
                &[
                    ("model", &model),
                    ("batch", &batch),
                    ("planned", &mib(planned)),
                    ("measured", &mib(measured)),
                    ("error", &error),
                ],
            );
            rows.push((model, convolutions, batch, planned, measured));
        }
    }
    // All rows are printed before any bound is checked.
    for (model, convolutions, batch, planned, measured) in rows {
        let (p, m) = (planned as f64, measured as f64);
        assert!(
            p <= m * (1.0 + OVER_TOLERANCE) + SLACK as f64,
            "{model} at {batch}: planned {planned} >> measured {measured}"
        );
        assert!(
            convolutions || m <= p * (1.0 + UNDER_TOLERANCE) + SLACK as f64,
            "{model} at {batch}: planned {planned} < measured {measured}"
        );
    }
}

/// What the planner promises: a step whose plan fits the memory runs in it. The card is filled
/// until only the plan's peak, the default safety margin (10%) and 64 MiB for the caching
/// allocator's rounding are left; then the step runs without toma's retry, so an
/// out-of-memory would fail it. Allocator OOMs counted meanwhile are cuDNN's engines whose
/// workspace did not fit, which PyTorch skips. The peak measured there is the step without
/// cuDNN's elastic workspace (it cannot grow past what is left): the plan must be within the
/// planner's tolerance of it, convolutions or not.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn plans_hold_on_a_filled_card() {
    let Some(_gpu) = gpu("plans_hold_on_a_filled_card") else { return };
    warm_up();
    tch::manual_seed(13);
    let mut failures = Vec::new();
    for (model, _, batches, build) in planner_models() {
        build(4).backward_with(&Options::new().micro_batch(4)).expect("warm-up");
        for &batch in batches {
            let loss = build(batch);
            let options = Options::new().micro_batch(batch as usize).retry(false);
            let planned = loss.measured_plan(Mode::Backward, &options).expect("a plan").peak_bytes();
            memory::release_cached_blocks();
            tch::Cuda::synchronize(0);
            let usable = memory::cuda_usable_memory(0).expect("usable memory");
            let left = planned + planned / 10 + 64 * MIB;
            let filler =
                Tensor::f_empty([usable.saturating_sub(left) as i64], (Kind::Uint8, CUDA)).expect("the filler");
            let before = stats();
            assert!(memory::reset_cuda_peak(0));
            let outcome = loss.backward_with(&options).map(|_| ());
            tch::Cuda::synchronize(0);
            let after = stats();
            let skipped = after.ooms - before.ooms;
            // The peak where cuDNN's workspace cannot grow past what is left: the step's need
            // without the elastic part, which the plan is held to below.
            let measured = after.peak_allocated - before.allocated;
            let error = 100.0 * (planned as f64 - measured as f64) / measured as f64;
            drop(filler);
            memory::release_cached_blocks();
            println!(
                "filled card: {model:>11} batch {batch:>5}: planned {} left {}: {}, peak {} ({error:+.1}%) (cuDNN engines skipped: {skipped})",
                mib(planned),
                mib(left),
                if outcome.is_ok() { "ran" } else { "FAILED" },
                mib(measured),
            );
            report(
                "plan_holds",
                &[
                    ("model", &model),
                    ("batch", &batch),
                    ("planned", &mib(planned)),
                    ("left", &mib(left)),
                    ("ran", &outcome.is_ok()),
                    ("allocator_ooms", &skipped),
                    ("measured", &mib(measured)),
                    ("error", &format!("{error:+.1}%")),
                ],
            );
            if let Err(err) = outcome {
                failures.push(format!("{model} at {batch}: {}", first_line(&err)));
            } else if !within(planned, measured) {
                failures.push(format!("{model} at {batch}: planned {planned}, measured on the filled card {measured}"));
            }
        }
    }
    assert!(failures.is_empty(), "plans that did not hold: {failures:#?}");
}

/// The staging buffer of CUDA's reduction kernel (src/lazy/cost/cuda.rs) against the allocator:
/// a lazy `sum` over dimensions, planned forward, then run.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn reduction_staging_matches_the_allocator() {
    let Some(_gpu) = gpu("reduction_staging_matches_the_allocator") else { return };
    warm_up();
    let cases: [(&[i64], &[i64]); 8] = [
        (&[4096, 4096], &[0]),
        (&[1024, 4096], &[0]),
        (&[256, 4096], &[0]),
        (&[16384, 4096], &[0]),
        (&[64, 128, 512], &[0, 1]),
        (&[32, 256, 1024], &[1]),
        (&[4096, 4096], &[1]),
        (&[1 << 20, 64], &[0, 1]),
    ];
    let mut misses = Vec::new();
    for (shape, dims) in cases {
        let x = Tensor::randn(shape, (Kind::Float, CUDA));
        let sum = toma::lazy::lazy(&x, 0).sum_dim_intlist(dims, false, None);
        let options = Options::new().micro_batch(shape[0] as usize);
        let planned = sum.measured_plan(Mode::Forward, &options).expect("a plan").peak_bytes();
        let _ = sum.to_tensor_with(&options).expect("warm-up"); // kernels loaded, not measured
        tch::Cuda::synchronize(0);
        let before = stats().allocated;
        assert!(memory::reset_cuda_peak(0));
        let out = sum.to_tensor_with(&options).expect("the sum");
        tch::Cuda::synchronize(0);
        let measured = stats().peak_allocated - before;
        drop(out);
        let output = 4 * shape
            .iter()
            .enumerate()
            .filter(|(d, _)| !dims.contains(&(*d as i64)))
            .map(|(_, &s)| s as u64)
            .product::<u64>();
        println!(
            "reduction {shape:?} over {dims:?}: planned {} measured {} (output {})",
            mib(planned),
            mib(measured),
            mib(output)
        );
        report(
            "reduction",
            &[
                ("shape", &format!("{shape:?}").replace(' ', "")),
                ("dims", &format!("{dims:?}").replace(' ', "")),
                ("planned", &mib(planned)),
                ("measured", &mib(measured)),
            ],
        );
        if planned.abs_diff(measured) > MIB + measured / 50 {
            misses.push(format!("{shape:?} over {dims:?}: planned {planned}, measured {measured}"));
        }
    }
    assert!(misses.is_empty(), "staging buffers planned wrong: {misses:#?}");
}

// ---------------------------------------------------------------------------------------------
// 5. A lazy training step in micro-batches on the GPU gives the CPU's full-batch gradients.

/// Gradients of every variable, on the CPU, by name.
fn gradients(vs: &nn::VarStore) -> BTreeMap<String, Tensor> {
    // Trainable ones: batch norm's running statistics are variables without gradients.
    vs.variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .map(|(name, t)| (name, t.grad().to_device(Device::Cpu)))
        .collect()
}

/// The largest difference between two sets of gradients, relative to the largest gradient of
/// all. (Not each variable's own: the bias of a convolution that batch norm follows has a
/// gradient of zero up to rounding, and two roundings differ by 100% of it.)
fn relative_difference(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let (mut worst, mut scale): (f64, f64) = (0.0, 1e-30);
    for (name, ga) in a {
        let gb = &b[name];
        assert!(ga.defined() && gb.defined(), "{name} has no gradient");
        scale = scale.max(ga.abs().max().double_value(&[]));
        worst = worst.max((ga - gb).abs().max().double_value(&[]));
    }
    worst / scale
}

/// Samples of the training-step comparison, and the micro-batch the GPU runs them in.
const STEP_BATCH: i64 = 64;
const STEP_MICRO_BATCH: usize = 16;

/// Builds one model twice (CPU and GPU, same weights, double precision), takes an eager
/// full-batch backward on the CPU and a lazy micro-batched one on the GPU, and returns the
/// largest relative difference of their gradients. (The models end in `log_softmax` and
/// `nll_loss`, not tch's `cross_entropy_for_logits`, which computes in `Float` whatever the
/// input's kind.)
fn gpu_step_against_cpu<M>(
    build: impl Fn(&nn::VarStore) -> M,
    eager: impl Fn(&M, &Tensor, &Tensor) -> Tensor,
    lazy_loss: impl Fn(&M, &Tensor, &Tensor) -> LazyTensor,
    input_shape: &[i64],
) -> f64 {
    let mut cpu_vs = nn::VarStore::new(Device::Cpu);
    let cpu_model = build(&cpu_vs);
    cpu_vs.double();
    let mut gpu_vs = nn::VarStore::new(CUDA);
    let gpu_model = build(&gpu_vs);
    gpu_vs.double();
    gpu_vs.copy(&cpu_vs).expect("the same weights on the GPU");

    let x = Tensor::randn(input_shape, (Kind::Double, Device::Cpu));
    let y = Tensor::randint(10, [STEP_BATCH], (Kind::Int64, Device::Cpu));
    let cpu_loss = eager(&cpu_model, &x, &y);
    cpu_loss.backward();
    let split = Options::new().micro_batch(STEP_MICRO_BATCH);
    let gpu_loss =
        lazy_loss(&gpu_model, &x.to_device(CUDA), &y.to_device(CUDA)).backward_with(&split).expect("lazy step");
    tch::Cuda::synchronize(0);
    let cpu_loss = cpu_loss.double_value(&[]);
    assert!((gpu_loss - cpu_loss).abs() <= 1e-9 * cpu_loss.abs(), "losses: GPU {gpu_loss} vs CPU {cpu_loss}");
    relative_difference(&gradients(&cpu_vs), &gradients(&gpu_vs))
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn lazy_training_step_on_gpu_matches_cpu_gradients() {
    let Some(_gpu) = gpu("lazy_training_step_on_gpu_matches_cpu_gradients") else { return };
    tch::manual_seed(12);
    // Double precision: the comparison then sees the summation order of micro-batches and of
    // GPU kernels, not TF32 or float rounding.
    let results = [
        ("mlp", gpu_step_against_cpu(mlp, mlp_eager, mlp_lazy, &[STEP_BATCH, 1024])),
        ("cnn", gpu_step_against_cpu(cnn, cnn_eager, cnn_lazy, &[STEP_BATCH, 3, 64, 64])),
    ];
    for (name, difference) in results {
        let micro_batches = STEP_BATCH as usize / STEP_MICRO_BATCH;
        println!("lazy step {name}: gradients of {micro_batches} GPU micro-batches vs the CPU's full batch: largest relative difference {difference:.2e}");
        report(
            "lazy_step",
            &[("model", &name), ("micro_batches", &micro_batches), ("max_rel_grad_diff", &format!("{difference:.2e}"))],
        );
    }
    for (name, difference) in results {
        assert!(difference < 1e-9, "{name}: gradients differ by {difference:e}");
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Each CPU cap (toma::cpu_memory::CpuCap) set before and after CUDA starts.

const CHILD_ENV: &str = "TOMA_GPU_CHILD";
const STEP: &str = "TOMA_GPU_STEP";
const DONE: &str = "TOMA_GPU_DONE";

/// Runs `what` and prints one `STEP` line: `ok <detail>` or `failed <error or panic>`.
fn step(name: &str, what: impl FnOnce() -> Result<String, String>) -> bool {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(what))
        .unwrap_or_else(|payload| Err(format!("panicked: {}", support::payload_text(payload.as_ref()))));
    let first = |s: &str| s.lines().next().unwrap_or("").to_owned();
    match &outcome {
        Ok(detail) => println!("{STEP} {name}: ok {}", first(detail)),
        Err(err) => println!("{STEP} {name}: failed {}", first(err)),
    }
    outcome.is_ok()
}

fn cap(kind: CpuCap, headroom_gib: f64) -> Result<String, String> {
    let in_use = kind.in_use().map_err(|e| e.to_string())?;
    kind.set(in_use + (headroom_gib * GIB) as u64).map_err(|e| e.to_string())?;
    Ok(format!("{kind}: {} in use, capped at +{headroom_gib} GiB", gib(in_use)))
}

/// The scenarios of test 6: which cap, and whether CUDA starts before it is set.
const CAP_SCENARIOS: [(&str, CpuCap, bool); 4] = [
    ("address_space_before_cuda", CpuCap::AddressSpace, false),
    ("address_space_after_cuda", CpuCap::AddressSpace, true),
    ("data_before_cuda", CpuCap::Data, false),
    ("data_after_cuda", CpuCap::Data, true),
];

/// What a process does with CUDA; each step is reported, none stops the others.
fn use_cuda(tag: &str, capped: bool) {
    step(&format!("{tag}: libtorch sees CUDA"), || {
        let n = tch::Cuda::device_count();
        if n > 0 {
            Ok(format!("{n} device(s)"))
        } else {
            Err("no device".into())
        }
    });
    step(&format!("{tag}: 1 GiB on cuda:0"), || {
        let t = Tensor::f_ones([1 << 28], (Kind::Float, CUDA)).map_err(|e| e.to_string())?;
        Ok(format!("max {}", t.f_max().and_then(|m| m.f_double_value(&[])).map_err(|e| e.to_string())?))
    });
    step(&format!("{tag}: 8 GiB on cuda:0"), || {
        let t = Tensor::f_zeros([1 << 31], (Kind::Float, CUDA)).map_err(|e| e.to_string())?;
        Ok(format!("{} elements", t.numel()))
    });
    step(&format!("{tag}: cuBLAS matmul on cuda:0"), || {
        let a = Tensor::f_ones([2048, 2048], (Kind::Float, CUDA)).map_err(|e| e.to_string())?;
        let v =
            a.f_matmul(&a).and_then(|p| p.f_max()).and_then(|m| m.f_double_value(&[])).map_err(|e| e.to_string())?;
        Ok(format!("max {v}"))
    });
    step(&format!("{tag}: allocator statistics"), || {
        memory::cuda_allocator_stats(0).map(|s| format!("{s:?}")).ok_or_else(|| "None".into())
    });
    if capped {
        step(&format!("{tag}: 16 GiB on the CPU is refused (beyond the cap)"), || {
            match Tensor::f_zeros([1 << 32], (Kind::Float, Device::Cpu)) {
                Ok(_) => Err("the cap did not stop it".into()),
                Err(e) => Ok(format!("refused: {e}")),
            }
        });
    }
}

fn child_rlimit(scenario: &str) {
    let &(_, kind, cuda_first) =
        CAP_SCENARIOS.iter().find(|s| s.0 == scenario).unwrap_or_else(|| panic!("unknown scenario {scenario}"));
    if cuda_first {
        use_cuda("uncapped", false);
    }
    step("cap", || cap(kind, 4.0));
    if cuda_first {
        // New allocations must reach the driver, not the blocks cached before the cap.
        step("empty the CUDA cache", || {
            if memory::empty_cuda_cache() {
                Ok(String::new())
            } else {
                Err("empty_cuda_cache() returned false".into())
            }
        });
    }
    use_cuda(if cuda_first { "capped after" } else { "capped first" }, true);
    println!("{DONE} {scenario}");
}

/// Reports what each cap does to CUDA, and asserts what the docs of `toma::cpu_memory` claim:
/// under the data cap, set before or after CUDA starts, everything works.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn cpu_caps_next_to_cuda() {
    const TEST: &str = "cpu_caps_next_to_cuda";
    if let Ok(scenario) = std::env::var(CHILD_ENV) {
        return child_rlimit(&scenario);
    }
    let Some(_gpu) = gpu(TEST) else { return };
    if !cfg!(target_os = "linux") {
        println!("{TEST}: skipped: CPU caps are Linux only");
        return;
    }
    let mut broken = Vec::new();
    for (scenario, kind, _) in CAP_SCENARIOS {
        let child = support::child::run(TEST, CHILD_ENV, scenario);
        let (stdout, stderr) = (&child.stdout, &child.stderr);
        let steps: BTreeMap<usize, &str> =
            stdout.lines().filter_map(|l| l.strip_prefix(STEP)).map(str::trim).enumerate().collect();
        let finished = stdout.lines().any(|l| l == format!("{DONE} {scenario}"));
        println!("--- {scenario}: exit {} finished {finished}", child.status);
        for line in steps.values() {
            println!("    {line}");
        }
        let failed: Vec<&str> = steps.values().copied().filter(|l| l.contains(": failed")).collect();
        if !finished {
            println!("--- child stdout ---\n{stdout}");
        }
        if !finished || !failed.is_empty() {
            let tail: Vec<&str> = stderr.lines().rev().take(40).collect();
            println!("--- child stderr (last 40 lines) ---");
            tail.iter().rev().for_each(|line| println!("{line}"));
        }
        let summary = if failed.is_empty() { "all-ok".to_owned() } else { failed.join(" | ").replace(' ', "_") };
        report(
            &format!("rlimit_{scenario}"),
            &[
                ("exit", &child.status.code().map_or("signal".into(), |c| c.to_string())),
                ("finished", &finished),
                ("failed_steps", &summary),
            ],
        );
        if kind == CpuCap::Data && !(finished && failed.is_empty()) {
            broken.push(format!("{scenario}: finished {finished}, failed steps {failed:?}"));
        }
    }
    assert!(broken.is_empty(), "the data cap is documented to leave CUDA working: {broken:#?}");
}

// ---------------------------------------------------------------------------------------------
// 7. The Rust half of the side-by-side with Python toma (benches/gpu_side_by_side.py runs the
//    same workload through Python toma 1.1.0; scripts/gpu-run.sh prints both rows).

/// Calls after the first, the one that converges.
const SIDE_BY_SIDE_LATER_CALLS: usize = 10;

/// The workload of benches/gpu_side_by_side.py: `ones_and_double` from a first size of about
/// four times the card, with the default cache.
#[toma::batch(initial_batchsize = rows_beyond_the_card())]
fn rows_side_by_side(batchsize: usize) -> Result<usize, TchError> {
    ATTEMPTS.push(batchsize);
    ones_and_double(batchsize)?;
    Ok(batchsize)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn side_by_side_with_python_toma_rust_half() {
    let Some(gpu) = gpu("side_by_side_with_python_toma_rust_half") else { return };
    warm_up();
    memory::release_cached_blocks();
    let mut calls = Vec::new();
    for _ in 0..=SIDE_BY_SIDE_LATER_CALLS {
        let before = stats();
        let started = Instant::now();
        let rows = rows_side_by_side().expect("converges");
        tch::Cuda::synchronize(0);
        let secs = started.elapsed().as_secs_f64();
        calls.push((ATTEMPTS.take(), stats().ooms - before.ooms, rows, secs));
    }
    ERRORS.take();
    for (i, (attempts, ooms, rows, secs)) in calls.iter().enumerate() {
        println!("side by side, rust call {i}: attempts {attempts:?}, allocator OOMs {ooms}, {rows} rows, {secs:.3} s");
    }
    let (first, later) = calls.split_first().expect("calls");
    assert!(first.0.len() >= 2, "the first call must run out: {first:?}");
    assert!(2 * first.2 as u64 * ROW_BYTES <= gpu.total, "{} rows cannot fit", first.2);
    for call in later {
        assert_eq!(call.2, first.2, "a later call converged elsewhere: {call:?}");
    }
    let later_attempts: usize = later.iter().map(|c| c.0.len()).sum();
    let later_ooms: u64 = later.iter().map(|c| c.1).sum();
    report(
        "side_by_side",
        &[
            ("impl", &"rust-toma"),
            ("card", &gib(gpu.total)),
            ("first_rows", &first.0[0]),
            ("converge_secs", &format!("{:.3}", first.3)),
            ("converge_ooms", &first.1),
            ("final_rows", &first.2),
            ("later_calls", &later.len()),
            ("later_attempts", &later_attempts),
            ("later_ooms", &later_ooms),
            ("later_median_ms", &format!("{:.1}", 1e3 * median(later.iter().map(|c| c.3).collect()))),
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Is a bigger batch faster? Eager training steps (forward and backward, float32) of the
//    three planner models, timed per sample at each batch size.

/// Seconds per call of `step`, after warm-up: the median of at least 5 timed calls, more while
/// they take under half a second in all.
fn seconds_per_step(mut step: impl FnMut()) -> f64 {
    for _ in 0..3 {
        step();
    }
    tch::Cuda::synchronize(0);
    let (mut times, started) = (Vec::new(), Instant::now());
    while times.len() < 5 || (started.elapsed() < Duration::from_millis(500) && times.len() < 200) {
        let t = Instant::now();
        step();
        tch::Cuda::synchronize(0);
        times.push(t.elapsed().as_secs_f64());
    }
    median(times)
}

/// Times one model's steps at each batch size and reports them; returns `(batch, us/sample)`.
fn time_per_sample<S: FnMut()>(model: &str, batches: &[i64], step_at: impl Fn(i64) -> S) -> Vec<(i64, f64)> {
    let mut rows = Vec::new();
    for &batch in batches {
        let secs = seconds_per_step(step_at(batch));
        let us_per_sample = 1e6 * secs / batch as f64;
        println!("per sample {model:>11} batch {batch:>6}: {:>9.3} ms/step {us_per_sample:>8.3} us/sample", 1e3 * secs);
        report(
            "per_sample",
            &[
                ("model", &model),
                ("batch", &batch),
                ("ms_per_step", &format!("{:.3}", 1e3 * secs)),
                ("us_per_sample", &format!("{us_per_sample:.3}")),
            ],
        );
        rows.push((batch, us_per_sample));
        memory::release_cached_blocks();
    }
    let best = rows.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1)).expect("rows");
    let largest = *rows.last().expect("rows");
    report(
        "per_sample_fastest",
        &[
            ("model", &model),
            ("fastest_batch", &best.0),
            ("largest_batch", &largest.0),
            ("largest_vs_fastest", &format!("{:.2}x", largest.1 / best.1)),
        ],
    );
    rows
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn time_per_sample_by_batch_size() {
    let Some(_gpu) = gpu("time_per_sample_by_batch_size") else { return };
    warm_up();
    tch::manual_seed(13);
    // Each closure makes its inputs once; the step itself is forward and backward.
    let vs = nn::VarStore::new(CUDA);
    let m = &mlp(&vs);
    let mlp_rows = time_per_sample("mlp", &[64, 256, 1024, 4096, 16384, 65536], |n| {
        let (x, y) = (Tensor::randn([n, 1024], (Kind::Float, CUDA)), Tensor::randint(10, [n], (Kind::Int64, CUDA)));
        move || mlp_eager(m, &x, &y).backward()
    });
    let vs = nn::VarStore::new(CUDA);
    let c = &cnn(&vs);
    let cnn_rows = time_per_sample("cnn", &[16, 64, 256, 1024, 4096], |n| {
        let x = Tensor::randn([n, 3, 64, 64], (Kind::Float, CUDA));
        let y = Tensor::randint(10, [n], (Kind::Int64, CUDA));
        move || cnn_eager(c, &x, &y).backward()
    });
    let vs = nn::VarStore::new(CUDA);
    let b = &block(&vs);
    let block_rows = time_per_sample("transformer", &[4, 16, 64, 256], |n| {
        let (x, y) = (Tensor::randn([n, T, D], (Kind::Float, CUDA)), Tensor::randint(10, [n], (Kind::Int64, CUDA)));
        move || block_eager(b, &x, &y).backward()
    });
    for (model, rows) in [("mlp", mlp_rows), ("cnn", cnn_rows), ("transformer", block_rows)] {
        assert!(rows.iter().all(|r| r.1.is_finite() && r.1 > 0.0), "{model}: {rows:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Auto steps on the card: fitted from the caching allocator's peaks.

/// `Range::auto` with no budget on the card: the budget is the card's usable memory less 10%,
/// no chunk goes over it once the fit exists, at most one real out-of-memory, and the step
/// reaches most of what fits. Then a body that allocates only on the CPU, on this CUDA
/// machine: the CPU is measured too, so the step stays under the CPU budget instead of
/// growing without bound on peaks of 0.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn auto_steps_fit_the_card_and_the_cpu() {
    let Some(gpu) = gpu("auto_steps_fit_the_card_and_the_cpu") else { return };
    warm_up();
    memory::release_cached_blocks();
    // 64 MiB rows: the card holds about total / 128 MiB of them with the temporary.
    let len = 4 * rows_beyond_the_card();
    let started = Instant::now();
    let mut chunks = Vec::new();
    let (result, report_) = toma::Range::auto(0, len).cache(toma::CacheKind::None).run_with_report(|s, e| {
        chunks.push(e - s);
        ones_and_double(e - s)
    });
    result.expect("every chunk is done");
    let secs = started.elapsed().as_secs_f64();
    let auto = report_.auto.clone().expect("an auto report");
    println!("auto on CUDA: chunks {chunks:?} in {secs:.2} s; {auto:?}");
    let cuda = auto.devices.iter().find(|d| d.device == toma::MeasuredDevice::Cuda(0)).expect("device 0 measured");
    let fits = ((cuda.budget.saturating_sub(cuda.fixed_bytes)) / (2 * ROW_BYTES)) as usize;
    assert_eq!(auto.over_budget, 0, "{auto:?}");
    assert!(report_.out_of_memory <= 1, "{report_:?}");
    assert!(cuda.bytes_per_item >= 2 * ROW_BYTES && cuda.bytes_per_item <= 2 * ROW_BYTES + (8 << 20), "{cuda:?}");
    let full = &chunks[..chunks.len() - 1];
    assert!(full.iter().skip(4).all(|&n| n * 4 >= fits * 3), "after 4 probes every chunk >= 75% of {fits}: {chunks:?}");
    report(
        "auto_cuda",
        &[
            ("card", &gib(gpu.total)),
            ("budget", &gib(cuda.budget)),
            ("rows", &len),
            ("chunks", &chunks.len()),
            ("probes", &auto.probes),
            ("step", &auto.step),
            ("fits", &fits),
            ("ooms", &report_.out_of_memory),
            ("secs", &format!("{secs:.2}")),
        ],
    );

    // A CPU-only body: 1 MiB per item on the CPU, budget 256 MiB: at most 256 per chunk.
    let mut cpu_chunks = Vec::new();
    let (result, cpu_report) =
        toma::Range::auto(0, 100_000).budget(256 << 20).cache(toma::CacheKind::None).run_with_report(|s, e| {
            let t = Tensor::f_ones([(e - s) as i64, 1 << 18], (Kind::Float, Device::Cpu))?;
            cpu_chunks.push(e - s);
            t.f_sum(Kind::Float).map(drop)
        });
    result.expect("the CPU body runs");
    let cpu_auto = cpu_report.auto.unwrap();
    assert!(cpu_chunks.iter().all(|&n| n <= 256), "{cpu_chunks:?} {cpu_auto:?}");
    assert_eq!(cpu_auto.over_budget, 0, "{cpu_auto:?}");
    report("auto_cpu_body", &[("chunks", &cpu_chunks.len()), ("step", &cpu_auto.step)]);
}

// ---------------------------------------------------------------------------------------------
// 10. Recomputing on the card (issue 25's CUDA half): the `res` model (batch norm in training:
//     it may not be split) under the least of 55%, 60%, .. of its whole batch's plan that it
//     meets matches the CPU's full-batch gradients and stays near the budget; then the MLP, the CNN and the transformer block at
//     75%, 50% and 35%, split-only against recompute-first against the choice, timed against a
//     plain step.

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn recomputing_on_the_gpu() {
    use toma::lazy::Recompute;
    let Some(_gpu) = gpu("recomputing_on_the_gpu") else { return };
    warm_up();
    tch::manual_seed(25);
    let whole_plan = |loss: &LazyTensor| {
        loss.measured_plan(Mode::Backward, &Options::new().recompute(Recompute::Never).budget(u64::MAX / 4))
            .expect("a plan")
            .full_batch_peak_bytes()
    };

    // Gradients and the peak: `res` in f64 on the card against the CPU's eager full batch.
    let n = 256;
    let mut cpu_vs = nn::VarStore::new(Device::Cpu);
    let cpu_model = res(&cpu_vs);
    cpu_vs.double();
    let mut gpu_vs = nn::VarStore::new(CUDA);
    let gpu_model = res(&gpu_vs);
    gpu_vs.double();
    gpu_vs.copy(&cpu_vs).expect("the same weights on the GPU");
    let x = Tensor::randn([n, 3, 64, 64], (Kind::Double, Device::Cpu));
    let y = Tensor::randint(10, [n], (Kind::Int64, Device::Cpu));
    let cpu_loss = res_eager(&cpu_model, &x, &y);
    cpu_loss.backward();
    let loss = res_lazy(&gpu_model, &x.to_device(CUDA), &y.to_device(CUDA));
    // The smallest budget from 55% of the whole batch's plan up that recomputing meets (on an
    // H200, 2026-11-27, 55% was 4% short: the parameters' gradients and the widest activation
    // stay whatever is recomputed).
    let whole = whole_plan(&loss);
    let (budget, options) = (55..=90)
        .step_by(5)
        .map(|percent| (whole * percent / 100, Options::new().budget(whole * percent / 100)))
        .find(|(_, o)| loss.measured_plan(Mode::Backward, o).is_ok())
        .expect("a budget that recomputing meets");
    let plan = loss.measured_plan(Mode::Backward, &options).expect("a recomputing plan");
    tch::Cuda::synchronize(0);
    let before = stats().allocated;
    assert!(memory::reset_cuda_peak(0));
    let value = loss.backward_with(&options).expect("a recomputed step");
    tch::Cuda::synchronize(0);
    let measured = stats().peak_allocated - before;
    let cpu_value = cpu_loss.double_value(&[]);
    let difference = relative_difference(&gradients(&cpu_vs), &gradients(&gpu_vs));
    if difference >= 1e-9 {
        // Where they differ, and whether another segmentation or none differs too.
        println!("recompute_res: gradients differ by {difference:.2e}\n{plan}");
        let (cpu_grads, gpu_grads) = (gradients(&cpu_vs), gradients(&gpu_vs));
        for (name, g) in &cpu_grads {
            let d = (g - &gpu_grads[name]).abs().max().double_value(&[]);
            println!(
                "recompute_res: {name}: largest difference {d:.2e}, largest gradient {:.2e}",
                g.abs().max().double_value(&[])
            );
        }
        for (label, o) in (55..=100).step_by(5).map(|p| {
            let o = Options::new().budget(if p == 100 { u64::MAX / 4 } else { whole * p / 100 });
            (format!("{p}%"), o)
        }) {
            let Ok(again) = loss.measured_plan(Mode::Backward, &o) else { continue };
            for (_, t) in gpu_vs.variables() {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            loss.backward_with(&o).expect("a step");
            let d = relative_difference(&gradients(&cpu_vs), &gradients(&gpu_vs));
            println!("recompute_res: budget {label}: segments {:?}: gradients differ by {d:.2e}", again.segments());
        }
    }
    report(
        "recompute_res",
        &[
            ("segments", &plan.segments().len()),
            ("planned", &mib(plan.peak_bytes())),
            ("measured", &mib(measured)),
            ("budget", &mib(budget)),
            ("measured_over_budget", &format!("{:.2}", measured as f64 / budget as f64)),
            ("max_rel_grad_diff", &format!("{difference:.2e}")),
        ],
    );
    assert!(plan.recomputes() && !plan.splits(), "{plan}");
    assert!((value - cpu_value).abs() <= 1e-9 * cpu_value.abs(), "losses: GPU {value} vs CPU {cpu_value}");
    assert!(difference < 1e-9, "gradients differ by {difference:e}");
    assert!(within(plan.peak_bytes(), measured), "planned {} measured {}\n{plan}", plan.peak_bytes(), measured);
    memory::release_cached_blocks();

    // Time: split-only, recompute-first and the choice, against a plain step of the whole batch.
    type Case = (&'static str, i64, fn(i64) -> (Box<dyn Fn() -> LazyTensor>, Box<dyn Fn()>));
    let cases: [Case; 3] = [
        ("mlp", 4096, |n| {
            let vs = nn::VarStore::new(CUDA);
            let m = std::rc::Rc::new(mlp(&vs));
            let x = Tensor::randn([n, 1024], (Kind::Float, CUDA));
            let y = Tensor::randint(10, [n], (Kind::Int64, CUDA));
            let (m2, x2, y2) = (m.clone(), x.shallow_clone(), y.shallow_clone());
            (Box::new(move || mlp_lazy(&m, &x, &y)), Box::new(move || mlp_eager(&m2, &x2, &y2).backward()))
        }),
        ("cnn", 256, |n| {
            let vs = nn::VarStore::new(CUDA);
            let m = std::rc::Rc::new(cnn(&vs));
            let x = Tensor::randn([n, 3, 64, 64], (Kind::Float, CUDA));
            let y = Tensor::randint(10, [n], (Kind::Int64, CUDA));
            let (m2, x2, y2) = (m.clone(), x.shallow_clone(), y.shallow_clone());
            (Box::new(move || cnn_lazy(&m, &x, &y)), Box::new(move || cnn_eager(&m2, &x2, &y2).backward()))
        }),
        ("transformer", 64, |n| {
            let vs = nn::VarStore::new(CUDA);
            let m = std::rc::Rc::new(block(&vs));
            let x = Tensor::randn([n, T, D], (Kind::Float, CUDA));
            let y = Tensor::randint(10, [n], (Kind::Int64, CUDA));
            let (m2, x2, y2) = (m.clone(), x.shallow_clone(), y.shallow_clone());
            (Box::new(move || block_lazy(&m, &x, &y)), Box::new(move || block_eager(&m2, &x2, &y2).backward()))
        }),
    ];
    for (name, n, build) in cases {
        let (lazy_loss, plain) = build(n);
        let plain_secs = seconds_per_step(&*plain);
        let whole = whole_plan(&lazy_loss());
        for percent in [75u64, 50, 35] {
            let budget = whole * percent / 100;
            let mut fields: Vec<(String, String)> = Vec::new();
            for (label, recompute) in
                [("split", Recompute::Never), ("recompute", Recompute::Always), ("auto", Recompute::Auto)]
            {
                let options = Options::new().budget(budget).recompute(recompute);
                let Ok(plan) = lazy_loss().measured_plan(Mode::Backward, &options) else {
                    fields.push((label.into(), "none".into()));
                    continue;
                };
                let secs = seconds_per_step(|| {
                    lazy_loss().backward_with(&options).expect("a step");
                });
                let how = match (plan.recomputes(), plan.splits()) {
                    (true, true) => format!("{}seg/{}", plan.segments().len(), plan.micro_batch()),
                    (true, false) => format!("{}seg", plan.segments().len()),
                    (false, _) => format!("mb{}", plan.micro_batch()),
                };
                fields.push((label.into(), format!("{:.2}x({how})", secs / plain_secs)));
            }
            let refs: Vec<(&str, &dyn Display)> = fields.iter().map(|(k, v)| (k.as_str(), v as &dyn Display)).collect();
            let mut all: Vec<(&str, &dyn Display)> =
                vec![("model", &name), ("batch", &n), ("budget_percent", &percent)];
            all.extend(refs);
            report("recompute_time", &all);
            memory::release_cached_blocks();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 11. `Fastest` on a real kernel: a matrix product whose time per row falls with the step and
//     then flattens once the card is busy.

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn fastest_settles_on_a_real_kernel_curve() {
    let Some(_gpu) = gpu("fastest_settles_on_a_real_kernel_curve") else { return };
    warm_up();
    let w = Tensor::randn([1024, 1024], (Kind::Float, CUDA));
    let body = |n: usize| -> Result<(), TchError> {
        let x = Tensor::f_ones([n as i64, 1024], (Kind::Float, CUDA))?;
        x.f_matmul(&w)?.f_relu()?.f_sum(Kind::Float)?.f_double_value(&[]).map(drop)
    };
    let mut chunks = Vec::new();
    let started = Instant::now();
    let (result, report_) = toma::Range::auto(0, 1 << 23)
        .objective(toma::Objective::Fastest)
        .cache(toma::CacheKind::None)
        .run_with_report(|s, e| {
            chunks.push(e - s);
            body(e - s)
        });
    result.expect("every chunk is done");
    let secs = started.elapsed().as_secs_f64();
    let auto = report_.auto.expect("an auto report");
    let mut counts = BTreeMap::new();
    for &n in &chunks[..chunks.len() - 1] {
        *counts.entry(n).or_insert(0usize) += 1;
    }
    let (&settled, _) = counts.iter().max_by_key(|&(_, &c)| c).expect("chunks");
    // The curve, timed afterwards at powers of two: nanoseconds per row.
    let mut curve = Vec::new();
    let mut n = 1024;
    while n <= (4 * settled).min(1 << 22) {
        let per_row = seconds_per_step(|| body(n).expect("a timed chunk")) / n as f64 * 1e9;
        curve.push((n, per_row));
        n *= 2;
    }
    let best = curve.iter().map(|&(_, t)| t).fold(f64::INFINITY, f64::min);
    let at_settled = seconds_per_step(|| body(settled).expect("the settled step")) / settled as f64 * 1e9;
    println!(
        "fastest on a matmul: chunks {chunks:?} in {secs:.2} s; settled {settled}; curve (rows, ns/row) {curve:?}"
    );
    let curve_text: Vec<String> = curve.iter().map(|(n, t)| format!("{n}:{t:.2}")).collect();
    report(
        "fastest_cuda",
        &[
            ("chunks", &chunks.len()),
            ("settled", &settled),
            ("reason", &auto.reason.replace(' ', "_")),
            ("ns_per_row_settled", &format!("{at_settled:.2}")),
            ("ns_per_row_best", &format!("{best:.2}")),
            ("curve", &curve_text.join(",")),
            ("secs", &format!("{secs:.2}")),
        ],
    );
    assert_eq!(auto.over_budget, 0, "{auto:?}");
    assert!(
        at_settled <= 1.25 * best,
        "settled on {settled} at {at_settled:.2} ns/row; the curve's best is {best:.2}: {curve:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 12. The zoo on a filled card: ResNet-18, MobileNet-V2, a GPT-2 block stack and an LSTM, in
//     f32 and bf16, whole training steps with Adam under default `Options` (calibration on,
//     the budget read from the card) on a card filled to leave `ZOO_LEFT`. Batches are chosen
//     from the plan so the whole batch needs about 2.5 times what is left: the CNNs in eval
//     mode (no batch statistics) and the sequence models split into micro-batches; the CNNs in
//     training mode (batch norm mixes samples) recompute. Then (13) each model in f64, split
//     or recomputed on the card, against the CPU's eager full batch.

/// The first line of an error: libtorch's messages carry a C++ backtrace after it.
fn first_line(err: &dyn Display) -> String {
    err.to_string().lines().next().unwrap_or("").chars().take(400).collect()
}

/// One zoo case on the filled card: two Adam steps, each planned then run; one report line per
/// step. Returns the failures.
fn zoo_on_a_filled_card(which: ZooKind, size: i64, train: bool, first: i64, kind: Kind) -> Vec<String> {
    use toma::lazy::nn::OptimizerConfig;
    let name = format!("{which:?} {} {}", kind_name(kind), if train { "train" } else { "eval" });
    let mut vs = nn::VarStore::new(CUDA);
    let model = ZooModel::new(&vs, which, size);
    vs.set_kind(kind);
    let mut opt = toma::lazy::nn::Adam::default().build(&vs, 1e-4).expect("Adam");
    let unbounded = Options::new().budget(u64::MAX / 4);
    // The whole batch's peak at two sizes, on the card as it is (calibration measures here),
    // then the batch whose whole step needs about 2.5 times what the filled card leaves.
    let mut whole = |n: i64| {
        let (x, y) = model.data(n, kind, CUDA);
        let loss = model.lazy_loss(&x, &y, train);
        let calibration = loss.calibrate(Mode::Backward, &unbounded).expect("calibration");
        let plan = opt.plan_step(&loss, &unbounded).expect("a plan");
        (plan.full_batch_peak_bytes(), calibration)
    };
    let started = Instant::now();
    let (p1, calibration) = whole(first);
    let (p2, _) = whole(2 * first);
    let calibrate_secs = started.elapsed().as_secs_f64();
    let per_sample = p2.saturating_sub(p1) / first as u64;
    assert!(
        per_sample > 0,
        "{which:?}: the whole batch's plan does not grow with the batch: {p1} at {first}, {p2} at twice"
    );
    // Splitting goes far below the whole batch's peak, recomputing less far (the parameters,
    // their gradients and Adam's state stay).
    let target = if train && matches!(which, ZooKind::ResNet18 | ZooKind::MobileNetV2) {
        ZOO_LEFT * 3 / 2
    } else {
        ZOO_LEFT * 5 / 2
    };
    let mut batch = ((target.saturating_sub(p1) / per_sample) as i64 + first).clamp(first, 1 << 16);
    let (mut x, mut y) = model.data(batch, kind, CUDA);
    let mut failures = Vec::new();
    // The batch the allocator's replay first refused (0: none), and the request it named.
    let (mut refused_at, mut refused_request) = (0, String::new());
    let mut step = 0;
    while step < 2 {
        // Filled anew each step: the first step's Adam state takes memory the second's plan
        // would otherwise find missing.
        memory::release_cached_blocks();
        tch::Cuda::synchronize(0);
        let usable = memory::cuda_usable_memory(0).expect("usable memory");
        let filler =
            Tensor::f_empty([usable.saturating_sub(ZOO_LEFT) as i64], (Kind::Uint8, CUDA)).expect("the filler");
        let loss = model.lazy_loss(&x, &y, train);
        let options = Options::new();
        // What the step measures before it runs, measured before its plan is asked for.
        if let Err(err) = loss.calibrate(Mode::Backward, &options) {
            failures.push(format!("{name} step {step}: no calibration: {}", first_line(&err)));
            break;
        }
        let plan = match opt.plan_step(&loss, &options) {
            Ok(plan) => plan,
            // Held to what the caching allocator reserves, a step it would not place is
            // refused before it runs: the case goes on at a tenth less, as a user would.
            Err(toma::lazy::LazyError::NotPlaced { request, .. }) if step == 0 && batch > first => {
                println!("zoo {name} batch {batch}: not placed: {request}");
                if refused_at == 0 {
                    (refused_at, refused_request) = (batch, format!("{}@{}", request.segment, request.op_name));
                }
                drop(filler);
                batch = (batch * 9 / 10).max(first);
                (x, y) = model.data(batch, kind, CUDA);
                continue;
            }
            Err(err) => {
                println!("zoo {name} batch {batch} step {step}: no plan: {}", first_line(&err));
                failures.push(format!("{name} step {step}: no plan: {}", first_line(&err)));
                break;
            }
        };
        tch::Cuda::synchronize(0);
        // The state the step starts from, for replays of it on the CPU.
        report_segments(
            "zoo",
            &[
                ("model", &format!("{which:?}")),
                ("kind", &kind_name(kind)),
                ("mode", &if train { "train" } else { "eval" }),
                ("batch", &batch),
                ("step", &step),
            ],
        );
        let before = stats();
        assert!(memory::reset_cuda_peak(0));
        let started = Instant::now();
        let outcome = opt.f_backward_step_with(&loss, &options);
        tch::Cuda::synchronize(0);
        let secs = started.elapsed().as_secs_f64();
        let after = stats();
        let allocated = after.peak_allocated - before.allocated;
        let reserved = after.peak_reserved.saturating_sub(before.reserved);
        let ooms = after.ooms - before.ooms;
        let planned = plan.peak_bytes();
        let error = 100.0 * (planned as f64 - allocated as f64) / allocated as f64;
        // Both grown during the step, from a card whose cache was released before the filler.
        let gap = 100.0 * (reserved as f64 - allocated as f64) / allocated.max(1) as f64;
        println!(
            "zoo {name} batch {batch} step {step}: {} planned {} peak allocated {} ({error:+.1}%) reserved {} ({gap:+.1}% over allocated), \
             micro-batch {} x{}, segments {}, allocator OOMs {ooms}, {secs:.2} s",
            if outcome.is_ok() { "ran" } else { "FAILED" },
            mib(planned),
            mib(allocated),
            mib(reserved),
            plan.micro_batch(),
            plan.chunks(),
            plan.segments().len(),
        );
        // A miss within the tolerance still shows where it is.
        if error.abs() > 5.0 {
            println!("{plan}");
        }
        // Set by scripts/gpu-run.sh's second pass (the allocator's expandable segments).
        let allocator = std::env::var("TOMA_GPU_ZOO_TAG").unwrap_or_else(|_| "default".into());
        report(
            "zoo",
            &[
                ("allocator", &allocator),
                ("model", &format!("{which:?}")),
                ("kind", &kind_name(kind)),
                ("mode", &if train { "train" } else { "eval" }),
                ("batch", &batch),
                ("step", &step),
                ("planned", &mib(planned)),
                ("allocated", &mib(allocated)),
                ("error", &format!("{error:+.1}%")),
                ("reserved", &mib(reserved)),
                ("reserved_gap", &format!("{gap:+.1}%")),
                ("planned_reserved", &plan.reserved_bytes().map_or("none".into(), mib)),
                (
                    "reserved_error",
                    &plan.reserved_bytes().map_or("none".into(), |p| {
                        format!("{:+.1}%", 100.0 * (p as f64 - reserved as f64) / reserved.max(1) as f64)
                    }),
                ),
                ("emptied_cache", &plan.emptied_cache_bytes().map_or("none".into(), mib)),
                ("refused_at", &refused_at),
                ("refused_request", &if refused_request.is_empty() { "none" } else { &refused_request }),
                ("micro_batch", &plan.micro_batch()),
                ("chunks", &plan.chunks()),
                ("segments", &plan.segments().len()),
                ("optimizer", &mib(plan.optimizer_peak_bytes())),
                ("ooms", &ooms),
                ("ran", &outcome.is_ok()),
                ("calibrated", &calibration.measured),
                ("unmeasured", &calibration.unmeasured),
                ("calibrate_secs", &format!("{calibrate_secs:.2}")),
                ("secs", &format!("{secs:.2}")),
            ],
        );
        match outcome {
            Err(err) => failures.push(format!("{name} batch {batch} step {step}: {}", first_line(&err))),
            Ok(value) if !value.is_finite() => failures.push(format!("{name} step {step}: loss {value}")),
            Ok(_) if !within(planned, allocated) => failures
                .push(format!("{name} batch {batch} step {step}: planned {planned}, allocated {allocated}\n{plan}")),
            Ok(_) => {}
        }
        if !plan.splits() && !plan.recomputes() {
            failures.push(format!("{name} batch {batch} step {step}: neither split nor recomputed\n{plan}"));
        }
        // Held to reserved bytes: no out-of-memory on the way, and the reserved peak planned.
        if ooms > 0 {
            failures.push(format!("{name} batch {batch} step {step}: {ooms} allocator OOM(s) in a placed plan"));
        }
        if let Some(planned_reserved) = plan.reserved_bytes().filter(|_| reserved > 0) {
            let off = (planned_reserved as f64 - reserved as f64) / reserved as f64;
            if off.abs() > 0.10 {
                failures.push(format!(
                    "{name} batch {batch} step {step}: reserved {} planned, {} on the card",
                    mib(planned_reserved),
                    mib(reserved)
                ));
            }
        }
        drop(filler);
        step += 1;
    }
    memory::release_cached_blocks();
    failures
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn zoo_steps_hold_on_a_filled_card() {
    let Some(_gpu) = gpu("zoo_steps_hold_on_a_filled_card") else { return };
    warm_up();
    tch::manual_seed(42);
    let mut failures = Vec::new();
    for kind in [Kind::Float, Kind::BFloat16] {
        for (which, size, train, first) in ZOO_CASES {
            let case = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                zoo_on_a_filled_card(which, size, train, first, kind)
            }));
            match case {
                Ok(f) => failures.extend(f),
                Err(payload) => {
                    let text = first_line(&support::payload_text(payload.as_ref()));
                    println!("zoo {which:?} {} train {train}: PANICKED: {text}", kind_name(kind));
                    failures.push(format!("{which:?} {} train {train}: panicked: {text}", kind_name(kind)));
                    memory::release_cached_blocks();
                }
            }
        }
    }
    assert!(failures.is_empty(), "zoo cases that did not hold: {failures:#?}");
}

/// Each zoo model in f64 on the card, split (or, for ResNet-18 in training, recomputed under
/// the smallest budget it meets), against the CPU's eager full batch with the same weights.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn zoo_gradients_on_the_gpu_match_the_cpu() {
    let Some(_gpu) = gpu("zoo_gradients_on_the_gpu_match_the_cpu") else { return };
    tch::manual_seed(43);
    // MobileNet-V2 in training mode has dropout: no CPU run draws the same masks.
    let cases: [(ZooKind, i64, bool, i64); 5] = [
        (ZooKind::ResNet18, 64, false, 16),
        (ZooKind::ResNet18, 64, true, 64),
        (ZooKind::MobileNetV2, 64, false, 16),
        (ZooKind::Gpt2, 32, true, 16),
        (ZooKind::Lstm, 32, true, 16),
    ];
    let mut failures = Vec::new();
    for (which, size, train, n) in cases {
        let name = format!("{which:?} {}", if train { "train" } else { "eval" });
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut cpu_vs = nn::VarStore::new(Device::Cpu);
            let cpu_model = ZooModel::new(&cpu_vs, which, size);
            cpu_vs.double();
            let mut gpu_vs = nn::VarStore::new(CUDA);
            let gpu_model = ZooModel::new(&gpu_vs, which, size);
            gpu_vs.double();
            gpu_vs.copy(&cpu_vs).expect("the same weights on the GPU");
            let (x, y) = cpu_model.data(n, Kind::Double, Device::Cpu);
            let cpu_loss = cpu_model.loss(&x, &y, train);
            cpu_loss.backward();
            let loss = gpu_model.lazy_loss(&x.to_device(CUDA), &y.to_device(CUDA), train);
            let options = if train && matches!(which, ZooKind::ResNet18 | ZooKind::MobileNetV2) {
                let whole = loss
                    .measured_plan(Mode::Backward, &Options::new().budget(u64::MAX / 4))
                    .expect("a plan")
                    .full_batch_peak_bytes();
                // The smallest budget of these that recomputing meets.
                (3..10)
                    .map(|tenths| Options::new().budget(whole * tenths / 10))
                    .find(|o| loss.measured_plan(Mode::Backward, o).is_ok_and(|p| p.recomputes()))
                    .expect("a budget that recomputing meets")
            } else {
                Options::new().micro_batch(n as usize / 4)
            };
            let plan = loss.measured_plan(Mode::Backward, &options).expect("a plan");
            let value = loss.backward_with(&options).expect("the lazy step");
            tch::Cuda::synchronize(0);
            let cpu_value = cpu_loss.double_value(&[]);
            let loss_error = (value - cpu_value).abs() / cpu_value.abs();
            let difference = relative_difference(&gradients(&cpu_vs), &gradients(&gpu_vs));
            (plan.chunks(), plan.segments().len(), loss_error, difference)
        }));
        match outcome {
            Ok((chunks, segments, loss_error, difference)) => {
                println!("zoo f64 {name}: {chunks} micro-batch(es), {segments} segment(s): loss {loss_error:.1e}, gradients {difference:.2e}");
                report(
                    "zoo_grad",
                    &[
                        ("model", &format!("{which:?}")),
                        ("mode", &if train { "train" } else { "eval" }),
                        ("micro_batches", &chunks),
                        ("segments", &segments),
                        ("loss_rel_diff", &format!("{loss_error:.1e}")),
                        ("max_rel_grad_diff", &format!("{difference:.2e}")),
                    ],
                );
                if !(difference < 1e-10 && loss_error < 1e-10) || chunks * segments.max(1) < 2 {
                    failures
                        .push(format!("{name}: {chunks} x {segments}: loss {loss_error:e}, gradients {difference:e}"));
                }
            }
            Err(payload) => {
                let text = first_line(&support::payload_text(payload.as_ref()));
                println!("zoo f64 {name}: PANICKED: {text}");
                failures.push(format!("{name}: panicked: {text}"));
            }
        }
        memory::release_cached_blocks();
    }
    assert!(failures.is_empty(), "zoo gradients off: {failures:#?}");
}

// ---------------------------------------------------------------------------------------------
// 14. Mixed precision on the card: steps recorded in a `toma::autocast` region (CUDA's lists)
// against eager autocast, their plans against the allocator, and Half with the GradScaler.

/// The MLP, the CNN and the transformer block of test 4, recorded in a CUDA autocast region in
/// `Half` and in `BFloat16` (parameters in `Float`): the lazy step's loss and gradients against
/// eager autocast's (the same kernels: equal up to cuBLAS's and cuDNN's own choices), its plan
/// against the allocator's peak (test 4's tolerances: for convolutions only an overestimate
/// fails), and three `GradScaler` steps of AdamW in `Half`, whole and in 4 micro-batches, each
/// stepped with a finite loss.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn autocast_steps_on_the_gpu() {
    use toma::lazy::nn::{GradScaler, OptimizerConfig};
    let Some(_gpu) = gpu("autocast_steps_on_the_gpu") else { return };
    warm_up();
    tch::manual_seed(14);
    let mut failures = Vec::new();
    for kind in [Kind::Half, Kind::BFloat16] {
        for (model, batch) in [("mlp", 1024i64), ("cnn", 256), ("transformer", 32)] {
            let vs = nn::VarStore::new(CUDA);
            let y = Tensor::randint(10, [batch], (Kind::Int64, CUDA));
            type Run = Box<dyn Fn(bool) -> (Option<Tensor>, Option<LazyTensor>)>;
            let run: Run = match model {
                "mlp" => {
                    let (m, x, y) = (mlp(&vs), Tensor::randn([batch, 1024], (Kind::Float, CUDA)), y.shallow_clone());
                    Box::new(move |lazily| {
                        if lazily {
                            (None, Some(mlp_lazy(&m, &x, &y)))
                        } else {
                            (Some(mlp_eager(&m, &x, &y)), None)
                        }
                    })
                }
                "cnn" => {
                    let (m, x, y) =
                        (cnn(&vs), Tensor::randn([batch, 3, 64, 64], (Kind::Float, CUDA)), y.shallow_clone());
                    Box::new(move |lazily| {
                        if lazily {
                            (None, Some(cnn_lazy(&m, &x, &y)))
                        } else {
                            (Some(cnn_eager(&m, &x, &y)), None)
                        }
                    })
                }
                _ => {
                    let (m, x, y) = (block(&vs), Tensor::randn([batch, T, D], (Kind::Float, CUDA)), y.shallow_clone());
                    Box::new(move |lazily| {
                        if lazily {
                            (None, Some(block_lazy(&m, &x, &y)))
                        } else {
                            (Some(block_eager(&m, &x, &y)), None)
                        }
                    })
                }
            };
            let clear = |vs: &nn::VarStore| {
                for v in vs.trainable_variables() {
                    let _ = v.grad().f_zero_();
                }
            };
            // Warm-up, then eager autocast's loss and gradients.
            let (Some(e), _) = toma::autocast(CUDA, kind, || run(false)) else { unreachable!() };
            e.backward();
            clear(&vs);
            let (Some(e), _) = toma::autocast(CUDA, kind, || run(false)) else { unreachable!() };
            e.backward();
            let eager_loss = e.double_value(&[]);
            let eager = gradients(&vs);
            clear(&vs);
            let (_, Some(l)) = toma::autocast(CUDA, kind, || run(true)) else { unreachable!() };
            let (planned, measured, plan) = planned_and_measured(&l, batch as usize);
            let lazy_loss = f64::try_from(&l).expect("the step's loss");
            let difference = relative_difference(&eager, &gradients(&vs));
            let error = (planned as f64 - measured as f64) / measured as f64;
            let name = format!("{model} {kind:?} batch {batch}");
            println!(
                "autocast {name}: loss eager {eager_loss} lazy {lazy_loss}; gradients differ by {difference:.1e}; \
                 planned {} measured {} ({:+.1}%)",
                mib(planned),
                mib(measured),
                100.0 * error
            );
            let error = format!("{:+.1}%", 100.0 * error);
            let difference_text = format!("{difference:.1e}");
            report(
                "autocast",
                &[
                    ("model", &model),
                    ("kind", &format!("{kind:?}")),
                    ("batch", &batch),
                    ("planned", &mib(planned)),
                    ("measured", &mib(measured)),
                    ("error", &error),
                    ("gradients", &difference_text),
                ],
            );
            let (p, m) = (planned as f64, measured as f64);
            if p > m * (1.0 + OVER_TOLERANCE) + SLACK as f64 || (model != "cnn" && !within(planned, measured)) {
                failures.push(format!("{name}: planned {planned} measured {measured}\n{plan}"));
            }
            if difference > 1e-2 || (lazy_loss - eager_loss).abs() > 1e-2 * eager_loss.abs() {
                failures.push(format!("{name}: loss {lazy_loss} vs {eager_loss}, gradients {difference:e}"));
            }
            if kind == Kind::Half {
                let mut opt = nn::AdamW::default().build(&vs, 1e-4).unwrap();
                let mut scaler = GradScaler::new();
                for micro in [batch as usize, batch as usize / 4] {
                    for step in 0..3 {
                        let (_, Some(l)) = toma::autocast(CUDA, kind, || run(true)) else { unreachable!() };
                        let options = Options::new().micro_batch(micro);
                        match scaler.backward_step_with(&mut opt, &l, &options) {
                            Ok(s) if s.value.is_finite() => {
                                report(
                                    "autocast-scaler",
                                    &[
                                        ("model", &model),
                                        ("micro", &micro),
                                        ("step", &step),
                                        ("stepped", &s.stepped),
                                        ("scale", &s.scale),
                                    ],
                                );
                            }
                            other => failures.push(format!("{name} scaled step {step} micro {micro}: {other:?}")),
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 15. The zoo's GPT-2 stack step by step: where a plan of test 12 missed (f32, recomputed in 4
// segments, 9.4% under on the H200 of 2026-11-27, bf16 within 0.3%), each part measured alone.

/// The GPT-2 stack of test 12 at a batch that leaves the card free, in f32 and bf16: the whole
/// batch unsplit, recomputed at 60% and 45% of its peak, and a whole Adam step at 45%, each
/// planned against the allocator's peak. A row more than 5% off prints its plan, so that a
/// miss shows which part it is in. Held to test 4's tolerances.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn gpt2_stack_step_by_step() {
    use toma::lazy::nn::OptimizerConfig;
    use toma::lazy::Recompute;
    let Some(_gpu) = gpu("gpt2_stack_step_by_step") else { return };
    warm_up();
    tch::manual_seed(15);
    let n = 48;
    let mut failures = Vec::new();
    for kind in [Kind::Float, Kind::BFloat16] {
        let mut vs = nn::VarStore::new(CUDA);
        let model = ZooModel::new(&vs, ZooKind::Gpt2, 256);
        vs.set_kind(kind);
        let (x, y) = model.data(n, kind, CUDA);
        let mut opt = toma::lazy::nn::Adam::default().build(&vs, 1e-4).expect("Adam");
        let loss = model.lazy_loss(&x, &y, true);
        // Warm-up: cuBLAS's handles and kernels, not measured.
        let _ = planned_and_measured(&model.lazy_loss(&x.narrow(0, 0, 4), &y.narrow(0, 0, 4), true), 4);
        let (whole, measured, plan) = planned_and_measured(&loss, n as usize);
        let mut rows = vec![("whole batch".to_string(), whole, measured, plan)];
        for percent in [60, 45] {
            let options = Options::new().budget(whole * percent / 100).recompute(Recompute::Always);
            let plan = match loss.measured_plan(Mode::Backward, &options) {
                Ok(plan) => plan,
                Err(err) => {
                    failures.push(format!("{} at {percent}%: no plan: {}", kind_name(kind), first_line(&err)));
                    continue;
                }
            };
            let measured = peak_above_before(|| {
                loss.backward_with(&options).expect("the recomputed step");
            });
            let what = format!("recomputed at {percent}%, {} segments", plan.segments().len());
            rows.push((what, plan.peak_bytes(), measured, plan.to_string()));
        }
        // Gradients and Adam's state of the first step stay: the step measured is the second.
        let options = Options::new().budget(whole * 45 / 100);
        for step in 0..2 {
            let plan = opt.plan_step(&loss, &options).expect("a plan of the Adam step");
            let measured = peak_above_before(|| {
                opt.f_backward_step_with(&loss, &options).expect("the Adam step");
            });
            if step == 1 {
                let what = format!(
                    "Adam step at 45%, {} x{}, {} segments",
                    plan.micro_batch(),
                    plan.chunks(),
                    plan.segments().len()
                );
                rows.push((what, plan.peak_bytes(), measured, plan.to_string()));
            }
        }
        for (what, planned, measured, plan) in rows {
            let error = 100.0 * (planned as f64 - measured as f64) / measured as f64;
            println!(
                "gpt2 {} batch {n} {what}: planned {} measured {} ({error:+.1}%)",
                kind_name(kind),
                mib(planned),
                mib(measured)
            );
            report(
                "gpt2_steps",
                &[
                    ("kind", &kind_name(kind)),
                    ("what", &what.replace(' ', "_")),
                    ("planned", &mib(planned)),
                    ("measured", &mib(measured)),
                    ("error", &format!("{error:+.1}%")),
                ],
            );
            if error.abs() > 5.0 {
                println!("{plan}");
            }
            if !within(planned, measured) {
                failures.push(format!("{} {what}: planned {planned}, measured {measured}", kind_name(kind)));
            }
        }
        memory::release_cached_blocks();
    }
    assert!(failures.is_empty(), "GPT-2 stack rows off: {failures:#?}");
}

// ---------------------------------------------------------------------------------------------
// 16. Two threads calibrating on one card at once: CUDA's allocator counts the device, every
// thread's work, so a measurement stands only when it repeats (`measured::probe_alone`).

/// A small CNN of `width` channels on the card, its step's loss for `n` samples.
fn width_cnn_loss(vs: &nn::VarStore, width: i64, n: i64) -> LazyTensor {
    let r = vs.root();
    let same = nn::ConvConfig { padding: 1, ..Default::default() };
    let c1 = nn::conv2d(&r / "c1", 3, width, 3, same);
    let c2 = nn::conv2d(&r / "c2", width, 2 * width, 3, nn::ConvConfig { stride: 2, ..same });
    let fc = nn::linear(&r / "fc", 2 * width, 10, Default::default());
    let x = Tensor::randn([n, 3, 32, 32], (Kind::Float, CUDA));
    let y = Tensor::randint(10, [n], (Kind::Int64, CUDA));
    let (x, y) = toma::lazy::lazy((&x, &y), 0);
    x.apply(&c1)
        .relu()
        .apply(&c2)
        .relu()
        .adaptive_avg_pool2d([1, 1])
        .flatten(1, -1)
        .apply(&fc)
        .cross_entropy_for_logits(&y)
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-run.sh runs it with TOMA_CUDA_TESTS=1"]
fn two_threads_calibrating_on_one_card_plan_as_alone() {
    const CHILD: &str = "TOMA_GPU_TWO_THREADS_CHILD";
    let test = "two_threads_calibrating_on_one_card_plan_as_alone";
    if let Ok(how) = std::env::var(CHILD) {
        // A fresh process each way, so that each measures anew; each round another width.
        let rounds = |first: bool| {
            (0..6i64)
                .map(|round| {
                    tch::manual_seed(round);
                    let vs = nn::VarStore::new(CUDA);
                    let width = if first { 8 + round } else { 16 + 2 * round };
                    let loss = width_cnn_loss(&vs, width, if first { 32 } else { 24 });
                    let options = Options::new().micro_batch(8).calibrate(toma::lazy::Calibrate::Always);
                    loss.calibrate(Mode::Backward, &options).unwrap();
                    loss.plan(Mode::Backward, &options).unwrap().peak_bytes()
                })
                .collect::<Vec<u64>>()
        };
        let (a, b) = if how == "alone" {
            (rounds(true), rounds(false))
        } else {
            let first = std::thread::spawn(move || rounds(true));
            let second = std::thread::spawn(move || rounds(false));
            (first.join().unwrap(), second.join().unwrap())
        };
        let list = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        println!("\nthreads-done a={} b={}", list(&a), list(&b));
        return;
    }
    let Some(_gpu) = gpu(test) else { return };
    let parse = |s: &str| s.split(',').map(|v| v.parse::<u64>().unwrap()).collect::<Vec<_>>();
    let alone = support::child::run(test, CHILD, "alone").assert_finished("threads-done ");
    let together = support::child::run(test, CHILD, "together").assert_finished("threads-done ");
    let mut worst = 0.0f64;
    for model in ["a", "b"] {
        for (alone, together) in parse(&alone[model]).into_iter().zip(parse(&together[model])) {
            worst = worst.max(((together as f64 - alone as f64) / alone as f64).abs());
        }
    }
    report(test, &[("alone", &alone["a"]), ("together", &together["a"]), ("worst", &format!("{:.2}%", 100.0 * worst))]);
    assert!(worst <= 0.01, "plans made while another thread calibrated on the card differ by {:.2}%", 100.0 * worst);
}
