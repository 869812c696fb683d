//! Real allocator failures, not simulated ones: each scenario caps its own address space
//! (`RLIMIT_AS`) so that libtorch's CPU allocator fails with
//! `DefaultCPUAllocator: can't allocate memory`, and checks that toma's retries get the work done.
//!
//! A cap can never be raised again, so every scenario runs in a child process: the test
//! re-executes this test binary filtered to itself, with `TOMA_REAL_OOM_CHILD=<scenario>` set.
//! The child does the capped work and asserts; the parent checks that the child succeeded and
//! that it reached the end of the scenario (it prints a marker), and shows its output if not.
#![cfg(all(feature = "tch", feature = "macros", target_os = "linux"))]

mod support;

use std::collections::BTreeMap;

use std::time::Instant;

use support::cap_memory;
use support::child::Child;
use support::events::{self, Recorded};
use support::Recorder;
use toma::cpu_memory::CpuCap;

use tch::{Device, Kind, TchError, Tensor};
use toma::OutOfMemory;

const CHILD_ENV: &str = "TOMA_REAL_OOM_CHILD";
const DONE: &str = "TOMA_REAL_OOM_DONE";
const MIB: u64 = 1 << 20;
/// Floats in one MiB: a row of this many `f32` is 1 MiB.
const MIB_FLOATS: i64 = 262_144;
const CPU_FLOAT: (Kind, Device) = (Kind::Float, Device::Cpu);
const ALLOCATOR_OOM: &str = "DefaultCPUAllocator: can't allocate memory";

// ---------------------------------------------------------------------------------------------
// Parent side

/// Runs the test `test` again in a child process with `scenario` set; returns what the child
/// did and the `key=value` pairs of its end-marker line.
///
/// Fails (printing everything the child wrote) when the child fails, or when it did not print
/// the scenario's end marker: a test name that matches nothing would otherwise "pass".
fn run_in_child(test: &str, scenario: &str) -> (Child, BTreeMap<String, String>) {
    let child = support::child::run(test, CHILD_ENV, scenario);
    let fields = child.assert_finished(&format!("{DONE} {scenario} "));
    println!("{}", child.report);
    (child, fields)
}

/// `Some(scenario)` in a child process.
fn child_scenario() -> Option<String> {
    std::env::var(CHILD_ENV).ok()
}

// ---------------------------------------------------------------------------------------------
// Child side: the cap

/// Warms libtorch up (its thread pool, its first allocations) and caps the address space at
/// what is in use now plus `headroom_gib`. Returns the headroom in bytes.
fn cap_address_space(headroom_gib: f64) -> u64 {
    cap_memory(CpuCap::AddressSpace, headroom_gib)
}

/// Whether a 64 GiB `PROT_NONE` reservation, the kind the CUDA driver makes for its address
/// space, can be mapped now (it is unmapped again at once).
fn reservation_like_cudas_fits() -> bool {
    let bytes = 64 << 30;
    // SAFETY: a fresh inaccessible mapping, unmapped below; nothing refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: `p` is the mapping of `bytes` made above.
    unsafe { libc::munmap(p, bytes) };
    true
}

/// Asserts that the OOM events match the failed attempts (all but the last) and their kind.
fn assert_oom_events(events: &[Recorded], attempts: &[usize], caught: &str) {
    assert_eq!(events.len(), attempts.len() - 1, "one info event per caught OOM: {events:#?}");
    for (event, pair) in events.iter().zip(attempts.windows(2)) {
        assert_eq!(event.field("from"), pair[0].to_string(), "{event:?}");
        assert_eq!(event.field("to"), pair[1].to_string(), "{event:?}");
        assert_eq!(event.field("caught"), caught, "{event:?}");
        // The allocator's own text, cut to one line, whether it came as an error or a panic.
        assert!(event.field("error").contains(ALLOCATOR_OOM), "{event:?}");
        assert!(!event.field("error").contains("\\n"), "one line: {event:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// a. Batch, with tch's `f_` methods: out-of-memory arrives as `Err(TchError::Torch(..))`.

static BATCH_ATTEMPTS: Recorder = Recorder::new();
static BATCH_ERRORS: Recorder<String> = Recorder::new();

fn take_attempts() -> Vec<usize> {
    BATCH_ATTEMPTS.take()
}

fn recorded(err: TchError) -> TchError {
    BATCH_ERRORS.push(err.to_string());
    err
}

/// `batchsize` rows of 1 MiB, each element touched; gives back the batch size that worked.
#[toma::batch(initial_batchsize = 65536, cache = Global)]
fn ones_mib_rows(batchsize: usize) -> Result<usize, TchError> {
    BATCH_ATTEMPTS.push(batchsize);
    let mut rows = Tensor::f_zeros([batchsize as i64, MIB_FLOATS], CPU_FLOAT).map_err(recorded)?;
    let _ = rows.f_add_scalar_(1.0).map_err(recorded)?;
    // Reductions without a temporary: the body needs `batchsize` MiB and nothing more.
    let min = rows.f_min().and_then(|m| m.f_double_value(&[])).map_err(recorded)?;
    let max = rows.f_max().and_then(|m| m.f_double_value(&[])).map_err(recorded)?;
    assert_eq!((min, max), (1.0, 1.0), "every element was touched");
    Ok(batchsize)
}

/// Under a cap of `kind` (scenario `scenario`): the first call converges through real
/// allocator errors, the second hits the Global cache.
fn child_batch_errors(kind: CpuCap, scenario: &str) {
    events::record();
    let headroom = cap_memory(kind, 1.5);
    // Why CUDA machines want the data cap: only the address-space cap refuses reservations
    // like the driver's.
    assert_eq!(reservation_like_cudas_fits(), kind == CpuCap::Data, "{kind} and a PROT_NONE reservation");
    let other = if kind == CpuCap::Data { CpuCap::AddressSpace } else { CpuCap::Data };
    assert_eq!(other.limit().unwrap(), None, "only {kind} is set");
    let available = toma::cpu_memory::available_cpu_memory();
    assert!(available <= headroom, "available {available} B counts the headroom under {kind}, {headroom} B");

    let started = Instant::now();
    let converged = ones_mib_rows().expect("converges to a batch size that fits");
    let first = take_attempts();
    let first_secs = started.elapsed().as_secs_f64();
    println!("first call: attempts {first:?} -> {converged} in {first_secs:.2} s");

    assert_eq!(first.last(), Some(&converged));
    support::assert_halving(&first, 65536);
    assert!(first.len() >= 2, "the initial 64 GiB allocation must fail under the cap: {first:?}");
    assert!(converged > 0 && converged as u64 * MIB <= headroom, "{converged} MiB does not fit in {headroom} B");
    let errors = BATCH_ERRORS.take();
    assert_eq!(errors.len(), first.len() - 1, "one allocator error per failed attempt: {errors:#?}");
    for err in &errors {
        assert!(err.contains(ALLOCATOR_OOM), "not a real allocator failure: {err}");
    }
    assert_oom_events(&events::take_caught_ooms(), &first, "error");

    // Global cache: the second call starts at the size that worked.
    let again = ones_mib_rows().expect("the cached size works again");
    let second = take_attempts();
    println!("second call: attempts {second:?} -> {again}");
    assert_eq!(second, [converged], "a cache hit makes exactly one attempt");
    assert_eq!(again, converged);
    assert!(events::take_caught_ooms().is_empty());
    assert!(BATCH_ERRORS.take().is_empty());

    println!("{DONE} {scenario} converged={converged} attempts={} secs={first_secs:.2}", first.len());
}

#[test]
fn batch_with_tch_errors_converges_under_a_real_cap() {
    if let Some(scenario) = child_scenario() {
        assert_eq!(scenario, "batch_errors");
        return child_batch_errors(CpuCap::AddressSpace, "batch_errors");
    }
    let (_, fields) = run_in_child("batch_with_tch_errors_converges_under_a_real_cap", "batch_errors");
    let converged: usize = fields["converged"].parse().unwrap();
    assert!((1..=1536).contains(&converged), "{fields:?}");
    assert!(fields["attempts"].parse::<usize>().unwrap() >= 2, "{fields:?}");
}

// ---------------------------------------------------------------------------------------------
// b. Batch, with tch's plain methods: out-of-memory arrives as a panic.

/// As [`ones_mib_rows`], with panicking methods and no cache.
#[toma::batch(initial_batchsize = 65536, cache = None)]
fn ones_mib_rows_panicking(batchsize: usize) -> usize {
    BATCH_ATTEMPTS.push(batchsize);
    let mut rows = Tensor::zeros([batchsize as i64, MIB_FLOATS], CPU_FLOAT);
    let _ = rows.fill_(1.0);
    let (min, max) = (rows.min().double_value(&[]), rows.max().double_value(&[]));
    assert_eq!((min, max), (1.0, 1.0), "every element was touched");
    batchsize
}

fn child_batch_panics() {
    events::record();
    let headroom = cap_address_space(1.5);

    let converged = ones_mib_rows_panicking();
    let first = take_attempts();
    println!("first call: attempts {first:?} -> {converged}");
    assert_eq!(first.last(), Some(&converged));
    support::assert_halving(&first, 65536);
    assert!(first.len() >= 2, "the initial 64 GiB allocation must fail under the cap: {first:?}");
    assert!(converged > 0 && converged as u64 * MIB <= headroom, "{converged} MiB does not fit in {headroom} B");
    let events = events::take_caught_ooms();
    assert_oom_events(&events, &first, "panic");

    // No cache: the second call starts over at the initial size and ends at the same size.
    let again = ones_mib_rows_panicking();
    let second = take_attempts();
    println!("second call: attempts {second:?} -> {again}");
    support::assert_halving(&second, 65536);
    assert_eq!(again, converged);
    assert_eq!(events::take_caught_ooms().len(), second.len() - 1);

    println!("{DONE} batch_panics converged={converged} attempts={}", first.len());
}

#[test]
fn batch_with_tch_panics_converges_under_a_real_cap() {
    if let Some(scenario) = child_scenario() {
        assert_eq!(scenario, "batch_panics");
        return child_batch_panics();
    }
    let (child, fields) = run_in_child("batch_with_tch_panics_converges_under_a_real_cap", "batch_panics");
    assert!((1..=1536).contains(&fields["converged"].parse::<usize>().unwrap()), "{fields:?}");
    // Caught out-of-memory panics are silenced by toma's panic hook: none reaches stderr.
    assert!(!child.stderr.contains(ALLOCATOR_OOM), "a caught OOM panic was printed:\n{}", child.stderr);
}

// ---------------------------------------------------------------------------------------------
// c. Chunked over a big tensor: each chunk needs a temporary as large as itself.

/// Chunks of the 1 GiB tensors below: 1024 slices of 1 MiB.
const SLICES: i64 = 1024;
static CHUNK_RANGES: Recorder<(usize, usize)> = Recorder::new();

/// Slice `i` becomes `2 i + 1` (from `i`): a slice done twice would read `4 i + 3`, one skipped `i`.
///
/// `f_add` (not `f_mul_scalar`): tch 0.24's `f_` methods that take a `Scalar` panic on a libtorch
/// error instead of returning it (the temporary `Scalar`'s `Drop` finds the pending error first),
/// and this body is to exercise the `Err` path.
fn double_plus_one(chunk: &mut Tensor) -> Result<(), TchError> {
    let mut computed = chunk.f_add(chunk)?; // a temporary of the chunk's size
    let _ = computed.f_add_scalar_(1.0)?; // in place: allocates nothing
    chunk.f_copy_(&computed)
}

/// Rows: chunks along dimension 0 of a `[SLICES, MIB_FLOATS]` tensor.
#[toma::chunked(initial_step = 1024, dimension = 0, cache = None)]
fn double_plus_one_rows(mut chunk: Tensor, start: usize, end: usize) -> Result<(), TchError> {
    CHUNK_RANGES.push((start, end));
    assert_eq!(chunk.size(), [(end - start) as i64, MIB_FLOATS], "the chunk is rows [start, end)");
    double_plus_one(&mut chunk)
}

/// Columns: chunks along the last dimension of a `[MIB_FLOATS, SLICES]` tensor (strided views).
#[toma::chunked(initial_step = 1024, dimension = -1, cache = None)]
fn double_plus_one_columns(mut chunk: Tensor, start: usize, end: usize) -> Result<(), TchError> {
    CHUNK_RANGES.push((start, end));
    assert_eq!(chunk.size(), [MIB_FLOATS, (end - start) as i64], "the chunk is columns [start, end)");
    double_plus_one(&mut chunk)
}

/// Checks the recorded chunk attempts of one call over `SLICES` slices; returns the step that
/// worked (the longest finished chunk) and the number of finished chunks.
fn check_chunk_attempts(headroom: u64) -> (usize, usize) {
    let ranges = CHUNK_RANGES.take();
    println!("chunk attempts: {ranges:?}");
    let len = SLICES as usize;
    assert!(ranges.len() >= 2 && ranges[1].0 == 0, "the 1 GiB temporary must fail under the cap: {ranges:?}");
    let done = support::check_halving_ranges(&ranges, len);
    let step = done.iter().map(|r| r.1 - r.0).max().unwrap();
    assert!(step < len && step as u64 * MIB <= headroom, "step {step}: {ranges:?}");
    let events = events::take_caught_ooms();
    assert_eq!(events.len(), ranges.len() - done.len(), "one info event per failed chunk: {events:#?}");
    assert!(events.iter().all(|e| e.field("caught") == "error"), "returned as Err, not panicked: {events:#?}");
    (step, done.len())
}

/// Asserts that slice `i` along `dimension` of `tensor` holds `2 i + 1` everywhere.
fn assert_each_slice_written_once(tensor: &Tensor, dimension: i64) {
    let other = 1 - dimension;
    let (min, max) = (tensor.amin([other], false), tensor.amax([other], false));
    let (min, max) = (Vec::<f32>::try_from(&min).unwrap(), Vec::<f32>::try_from(&max).unwrap());
    assert_eq!(min.len(), SLICES as usize);
    for i in 0..SLICES as usize {
        let expected = 2.0 * i as f32 + 1.0;
        assert_eq!((min[i], max[i]), (expected, expected), "slice {i} along {dimension} (2 i + 1 expected)");
    }
}

fn child_chunked() {
    events::record();
    // 1 GiB, allocated before the cap: row i holds i everywhere.
    let rows = Tensor::arange(SLICES, CPU_FLOAT).view([SLICES, 1]).repeat([1, MIB_FLOATS]);
    let headroom = cap_address_space(0.75);

    double_plus_one_rows(&rows).expect("every chunk is done");
    let (row_step, row_chunks) = check_chunk_attempts(headroom);
    assert_each_slice_written_once(&rows, 0);
    drop(rows);

    // The same 1 GiB again, under the cap now, as columns: column j holds j everywhere.
    let columns = Tensor::arange(SLICES, CPU_FLOAT).view([1, SLICES]).repeat([MIB_FLOATS, 1]);
    double_plus_one_columns(&columns).expect("every chunk is done");
    let (column_step, column_chunks) = check_chunk_attempts(headroom);
    assert_each_slice_written_once(&columns, 1);

    println!(
        "{DONE} chunked step={row_step} chunks={row_chunks} column_step={column_step} column_chunks={column_chunks}"
    );
}

#[test]
fn chunked_halves_its_step_under_a_real_cap_and_writes_each_slice_once() {
    if let Some(scenario) = child_scenario() {
        assert_eq!(scenario, "chunked");
        return child_chunked();
    }
    let (_, fields) = run_in_child("chunked_halves_its_step_under_a_real_cap_and_writes_each_slice_once", "chunked");
    assert!(fields["step"].parse::<usize>().unwrap() < 1024, "{fields:?}");
    assert!(fields["column_step"].parse::<usize>().unwrap() < 1024, "{fields:?}");
}

// ---------------------------------------------------------------------------------------------
// c2. The data-segment cap (`RLIMIT_DATA`, for CUDA machines): the same real allocator failure,
//     while address-space reservations like the CUDA driver's still fit.

#[test]
fn batch_converges_under_a_real_data_segment_cap() {
    if let Some(scenario) = child_scenario() {
        assert_eq!(scenario, "batch_data_cap");
        return child_batch_errors(CpuCap::Data, "batch_data_cap");
    }
    let (_, fields) = run_in_child("batch_converges_under_a_real_data_segment_cap", "batch_data_cap");
    assert!((1..=1536).contains(&fields["converged"].parse::<usize>().unwrap()), "{fields:?}");
}

// ---------------------------------------------------------------------------------------------
// d. Negative controls: an error that is not an out-of-memory is not retried, and an
//    out-of-memory at batch size 1 is given back.

/// A shape mismatch, whatever the batch size.
#[toma::batch(initial_batchsize = 64, cache = None)]
fn mismatched_matmul(batchsize: usize) -> Result<usize, TchError> {
    BATCH_ATTEMPTS.push(batchsize);
    let a = Tensor::f_ones([batchsize as i64, 3], CPU_FLOAT)?;
    let b = Tensor::f_ones([4, 5], CPU_FLOAT)?;
    let _ = a.f_matmul(&b)?;
    Ok(batchsize)
}

/// The same mismatch through the panicking method.
#[toma::batch(initial_batchsize = 64, cache = None)]
fn mismatched_matmul_panicking(batchsize: usize) -> usize {
    BATCH_ATTEMPTS.push(batchsize);
    let a = Tensor::ones([batchsize as i64, 3], CPU_FLOAT);
    let _ = a.matmul(&Tensor::ones([4, 5], CPU_FLOAT));
    batchsize
}

/// 64 GiB whatever the batch size: fails at every size, 1 included.
#[toma::batch(initial_batchsize = 8, cache = None)]
fn always_too_big(batchsize: usize) -> Result<(), TchError> {
    BATCH_ATTEMPTS.push(batchsize);
    let _ = Tensor::f_zeros([64 * 1024, MIB_FLOATS], CPU_FLOAT)?;
    Ok(())
}

fn child_not_oom() {
    events::record();
    cap_address_space(1.5);

    let err = mismatched_matmul().expect_err("a shape mismatch cannot succeed");
    assert_eq!(take_attempts(), [64], "a non-OOM error is returned after one attempt");
    assert!(matches!(&err, TchError::Torch(_)), "{err:?}");
    assert!(!err.is_out_of_memory() && err.to_string().contains("cannot be multiplied"), "{err}");

    let payload = std::panic::catch_unwind(mismatched_matmul_panicking).expect_err("a shape mismatch panics");
    assert_eq!(take_attempts(), [64], "a non-OOM panic is resumed after one attempt");
    let text = support::payload_text(payload.as_ref());
    assert!(text.contains("cannot be multiplied"), "the panic is resumed unchanged: {text}");
    assert!(events::take_caught_ooms().is_empty(), "nothing was an out-of-memory");

    let err = always_too_big().expect_err("64 GiB never fits");
    let attempts = take_attempts();
    assert_eq!(attempts, [8, 4, 2, 1], "retried down to 1, then given back");
    assert!(err.is_out_of_memory() && err.to_string().contains(ALLOCATOR_OOM), "{err}");
    assert_oom_events(&events::take_caught_ooms(), &attempts, "error");

    println!("{DONE} not_oom ok=1");
}

#[test]
fn errors_that_are_not_oom_propagate_at_once_under_a_real_cap() {
    if let Some(scenario) = child_scenario() {
        assert_eq!(scenario, "not_oom");
        return child_not_oom();
    }
    run_in_child("errors_that_are_not_oom_propagate_at_once_under_a_real_cap", "not_oom");
}

// ---------------------------------------------------------------------------------------------
// e. oneDNN's `could not create a primitive` under the data cap: an out-of-memory (the cap is
//    memory pressure), caught, and the range over the images still gets every logit right.

const IMAGES: i64 = 16;
const ONEDNN_FAILURE: &str = "could not create a primitive";

/// The panic text of `f`, if it panics.
fn panic_text<R>(f: impl FnOnce() -> R) -> Option<String> {
    let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).err()?;
    Some(support::payload_text(payload.as_ref()))
}

fn child_onednn(headroom_gib: f64) {
    use tch::nn::ModuleT;
    // As many threads as this project's 2-core machines use: oneDNN's memory per kernel
    // depends on them.
    tch::set_num_threads(2);
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let net = tch::vision::resnet::resnet18(&vs.root(), 1000);
    let _no_grad = tch::no_grad_guard();
    tch::manual_seed(5);
    let images = Tensor::randn([IMAGES, 3, 224, 224], CPU_FLOAT);
    // Reference logits one image at a time, before the cap (batch 1's kernels are cached now).
    let reference: Vec<Tensor> = (0..IMAGES).map(|i| net.forward_t(&images.narrow(0, i, 1), false)).collect();
    let reference = Tensor::cat(&reference, 0);
    let headroom = cap_memory(CpuCap::Data, headroom_gib);
    // oneDNN caches a kernel with its scratch space for every new batch size: other sizes fill
    // that cache until a new one cannot be created (the allocator may fail first for the
    // largest). Caught here, outside toma, with the default panic hook silenced.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut onednn_failed_at = None;
    // What the other sizes did, for the report: ran, or failed otherwise (the allocator first).
    let (mut ran, mut other) = (0, 0);
    for b in (2..=40).rev() {
        let text = panic_text(|| net.forward_t(&Tensor::zeros([b, 3, 224, 224], CPU_FLOAT), false));
        match text {
            Some(t) if t.contains(ONEDNN_FAILURE) => {
                onednn_failed_at = Some(b);
                break;
            }
            Some(_) => other += 1,
            None => ran += 1,
        }
    }
    std::panic::set_hook(hook);
    let Some(failed_at) = onednn_failed_at else {
        // A CPU whose oneDNN kernels take less memory (all ran: less headroom may reproduce), or
        // whose allocator fails first (more may): the parent tries another headroom.
        println!("{DONE} onednn reproduced=false headroom_mib={} ran={ran} failed_otherwise={other}", headroom / MIB);
        return;
    };
    assert!(toma::cpu_memory::under_pressure(), "a cap is set: memory is under pressure");
    assert_eq!(toma::oom::classify_message(ONEDNN_FAILURE), toma::oom::Verdict::UnderPressure);

    // The range: each sub-range's logits into `out`; new batch sizes fail as above until one
    // whose kernels oneDNN already has.
    events::record();
    let out = Tensor::zeros([IMAGES, 1000], CPU_FLOAT);
    let mut steps = Vec::new();
    let started = Instant::now();
    toma::Range::new(0, IMAGES as usize, IMAGES as usize)
        .cache(toma::CacheKind::None)
        .run(|start, end| {
            steps.push(end - start);
            let logits = net.forward_t(&images.narrow(0, start as i64, (end - start) as i64), false);
            out.narrow(0, start as i64, (end - start) as i64).copy_(&logits);
            Ok::<(), TchError>(())
        })
        .expect("the range completes");
    let caught = events::take_caught_ooms();
    assert!(
        caught.iter().any(|e| e.field("error").contains(ONEDNN_FAILURE)),
        "oneDNN's failure was caught as an out-of-memory: {caught:#?}"
    );
    let difference = (&out - &reference).abs().max().double_value(&[]);
    assert!(difference < 1e-4, "logits differ from the uncapped ones by {difference}");
    println!(
        "{DONE} onednn reproduced=true headroom_mib={} onednn_failed_at={failed_at} steps={steps:?} caught={} max_diff={difference:.1e} secs={:.2}",
        headroom / MIB,
        caught.len(),
        started.elapsed().as_secs_f64()
    );
}

/// Headrooms under the data cap to try, in GiB, until oneDNN's failure reproduces: where its
/// cache fills first depends on the CPU (an H100 machine's 16-core CPU needed other values than
/// this project's 2-core ones) and on its instruction set. 0.5 GiB reproduces on this project's
/// AVX-512 machines (2026-11-23: at batch 18, in 9 s); under AVX2 kernels (2026-11-27, an AMD
/// EPYC, `ONEDNN_MAX_CPU_ISA=AVX2`) the allocator failed first at 0.5 GiB in one run, at 0.75
/// and 1.0 GiB in another, and 0.75 GiB reproduced in a third: more headroom lets oneDNN's cache
/// fill before the allocator runs out. A headroom that does not reproduce costs its child ~17 s.
const ONEDNN_HEADROOMS: [&str; 6] = ["0.5", "0.75", "1.0", "1.25", "1.5", "2.0"];

#[test]
fn onednn_primitive_failures_under_a_data_cap_are_caught() {
    const TEST: &str = "onednn_primitive_failures_under_a_data_cap_are_caught";
    if let Some(scenario) = child_scenario() {
        let headroom = scenario.strip_prefix("onednn:").expect("an onednn scenario");
        return child_onednn(headroom.parse().expect("a headroom in GiB"));
    }
    for headroom in ONEDNN_HEADROOMS {
        let child = support::child::run(TEST, CHILD_ENV, &format!("onednn:{headroom}"));
        let fields = child.assert_finished(&format!("{DONE} onednn "));
        println!("{}", child.report);
        if fields["reproduced"] == "true" {
            assert!(fields["caught"].parse::<usize>().unwrap() >= 1, "{fields:?}");
            return;
        }
        // Every size ran: more headroom runs them too.
        if fields["failed_otherwise"] == "0" {
            break;
        }
    }
    // Whether the cache or the allocator runs out first varies from run to run: on this
    // project's AVX-512 machines 0.5 GiB reproduced every time (2026-11-23), on an AVX2 one
    // (2026-11-27) the allocator ran out first at 0.5 and 0.75 GiB and every size ran at 1.0 GiB
    // in one fresh clone, where a warm tree reproduced at 0.5. What a reproduction would check
    // of the verdict is checked without it.
    assert_eq!(toma::oom::classify_message(ONEDNN_FAILURE), toma::oom::Verdict::UnderPressure);
    println!(
        "{TEST}: skipped: oneDNN never failed to create a primitive before the allocator ran out, on this CPU at headrooms {ONEDNN_HEADROOMS:?} GiB"
    );
}
