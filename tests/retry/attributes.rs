//! The attributes, with a simulated out-of-memory: exact attempt sequences per cache kind.
#![cfg(all(feature = "macros", feature = "tch"))]

use crate::support;

use std::sync::Mutex;

use support::{block_on, oom, Recorder};
use tch::{Device, Kind, Tensor};

// ---- batch -----------------------------------------------------------------------------------

static BATCH_NONE: Recorder = Recorder::new();

#[toma::batch(initial_batchsize = 64, cache = None)]
fn batch_none(batchsize: usize, limit: usize) -> Result<usize, String> {
    BATCH_NONE.push(batchsize);
    if batchsize > limit {
        return Err(oom());
    }
    Ok(batchsize)
}

#[test]
fn batch_halves_until_it_fits_and_none_remembers_nothing() {
    for _ in 0..3 {
        assert_eq!(batch_none(16), Ok(16));
        assert_eq!(BATCH_NONE.take(), [64, 32, 16]);
    }
}

#[test]
fn batch_gives_up_at_one_with_the_last_error() {
    static CALLS: Recorder = Recorder::new();
    #[toma::batch(initial_batchsize = 6, cache = None)]
    fn never_fits(batchsize: usize) -> Result<(), String> {
        CALLS.push(batchsize);
        Err(format!("CUDA out of memory at {batchsize}"))
    }
    assert_eq!(never_fits(), Err("CUDA out of memory at 1".to_string()));
    assert_eq!(CALLS.take(), [6, 3, 1]);
}

#[test]
fn batch_other_errors_stop_at_once() {
    static CALLS: Recorder = Recorder::new();
    #[toma::batch(initial_batchsize = 64, cache = None)]
    fn bad_shape(batchsize: usize) -> Result<(), tch::TchError> {
        CALLS.push(batchsize);
        Err(tch::TchError::Torch("mat1 and mat2 shapes cannot be multiplied (64x784 and 512x10)".into()))
    }
    let err = bad_shape().unwrap_err();
    assert!(err.to_string().contains("shapes cannot be multiplied"), "{err}");
    assert_eq!(CALLS.take(), [64]);
}

static BATCH_STACK: Recorder = Recorder::new();

#[toma::batch(initial_batchsize = 64)]
fn batch_default(batchsize: usize, limit: usize) -> Result<usize, String> {
    BATCH_STACK.push(batchsize);
    if batchsize > limit {
        return Err(oom());
    }
    Ok(batchsize)
}

#[test]
fn stacktrace_memory_hits_on_the_same_line_and_misses_on_another() {
    let mut results = Vec::new();
    for _ in 0..4 {
        results.push(batch_default(16));
    }
    assert_eq!(results, vec![Ok(16); 4]);
    assert_eq!(BATCH_STACK.take(), [64, 32, 16, 16, 16, 16]);
    // Another line starts again at the initial size, then remembers its own.
    assert_eq!(batch_default(16), Ok(16));
    assert_eq!(BATCH_STACK.take(), [64, 32, 16]);
    // The same function from a different enclosing function is a different key too.
    fn elsewhere() -> Result<usize, String> {
        batch_default(16)
    }
    assert_eq!(elsewhere(), Ok(16));
    assert_eq!(elsewhere(), Ok(16));
    assert_eq!(BATCH_STACK.take(), [64, 32, 16, 16]);
}

static BATCH_GLOBAL: Recorder = Recorder::new();

#[toma::batch(initial_batchsize = 64, cache = Global)]
fn batch_global(batchsize: usize, limit: usize) -> Result<usize, String> {
    BATCH_GLOBAL.push(batchsize);
    if batchsize > limit {
        return Err(oom());
    }
    Ok(batchsize)
}

#[test]
fn global_is_one_entry_per_function() {
    for _ in 0..3 {
        assert_eq!(batch_global(16), Ok(16));
    }
    assert_eq!(BATCH_GLOBAL.take(), [64, 32, 16, 16, 16]);
    // Another line shares the entry.
    assert_eq!(batch_global(16), Ok(16));
    assert_eq!(BATCH_GLOBAL.take(), [16]);
}

#[test]
fn panics_that_are_oom_are_retried_and_values_returned() {
    static CALLS: Recorder = Recorder::new();
    #[toma::batch(initial_batchsize = 64, cache = None)]
    fn plain(batchsize: usize, limit: usize) -> usize {
        CALLS.push(batchsize);
        if batchsize > limit {
            panic!("called `Result::unwrap()` on an `Err` value: Torch(\"{}\")", oom());
        }
        batchsize * 2
    }
    assert_eq!(plain(20), 32);
    assert_eq!(CALLS.take(), [64, 32, 16]);
}

#[test]
fn non_oom_panics_resume_with_their_payload() {
    static CALLS: Recorder = Recorder::new();
    #[toma::batch(initial_batchsize = 8, cache = None)]
    fn explode(batchsize: usize) {
        CALLS.push(batchsize);
        std::panic::panic_any(1234_u32);
    }
    let payload = std::panic::catch_unwind(explode).unwrap_err();
    assert_eq!(payload.downcast_ref::<u32>(), Some(&1234));
    assert_eq!(CALLS.take(), [8]);
}

#[test]
fn an_oom_panic_at_size_one_is_resumed() {
    #[toma::batch(initial_batchsize = 4, cache = None)]
    fn always(batchsize: usize) -> usize {
        panic!("CUDA out of memory. Tried to allocate {batchsize} GiB");
    }
    let payload = std::panic::catch_unwind(always).unwrap_err();
    let text = payload.downcast_ref::<String>().expect("formatted panic");
    assert!(text.contains("allocate 1 GiB"), "{text}");
}

#[test]
fn question_mark_and_early_return_keep_their_meaning() {
    #[toma::batch(initial_batchsize = 8, cache = None)]
    fn parse(batchsize: usize, text: &str) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
        if batchsize > 2 {
            return Err("CUDA error: out of memory".into());
        }
        let n: usize = text.parse()?;
        Ok(n + batchsize)
    }
    assert_eq!(parse("40").unwrap(), 42);
    assert!(parse("x").unwrap_err().to_string().contains("invalid digit"));
}

struct Model {
    scale: usize,
    seen: Mutex<Vec<usize>>,
}

impl Model {
    #[toma::batch(initial_batchsize = 32, cache = None)]
    fn forward(&self, batchsize: usize, limit: usize) -> Result<usize, String> {
        self.seen.lock().unwrap().push(batchsize);
        if batchsize > limit {
            return Err(oom());
        }
        Ok(batchsize * self.scale)
    }
}

#[test]
fn methods_keep_their_receiver() {
    let model = Model { scale: 3, seen: Mutex::new(Vec::new()) };
    assert_eq!(model.forward(10), Ok(24));
    assert_eq!(*model.seen.lock().unwrap(), [32, 16, 8]);
}

#[test]
fn generic_functions_work() {
    #[toma::batch(initial_batchsize = 16, cache = None)]
    fn first<T: Clone + std::fmt::Debug>(batchsize: usize, items: &[T]) -> Result<Vec<T>, String> {
        if batchsize > 4 {
            return Err(oom());
        }
        Ok(items.iter().take(batchsize).cloned().collect())
    }
    assert_eq!(first(&["a", "b", "c", "d", "e"]), Ok(vec!["a", "b", "c", "d"]));
}

// ---- range -----------------------------------------------------------------------------------

static RANGE_CALLS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

#[toma::range(initial_step = 64, cache = None)]
fn range_limited(start: usize, end: usize, limit: usize) -> Result<(), String> {
    RANGE_CALLS.lock().unwrap().push((start, end));
    if end - start > limit {
        return Err(oom());
    }
    Ok(())
}

#[test]
fn range_exact_sequence() {
    let _serial = support::serial();
    RANGE_CALLS.lock().unwrap().clear();
    range_limited(0, 128, 16).unwrap();
    let mut expected = vec![(0, 64), (0, 32), (0, 16)];
    expected.extend((1..8).map(|i| (16 * i, 16 * (i + 1))));
    assert_eq!(*RANGE_CALLS.lock().unwrap(), expected);
}

#[test]
fn range_clips_the_last_sub_range() {
    let _serial = support::serial();
    RANGE_CALLS.lock().unwrap().clear();
    range_limited(10, 150, 64).unwrap();
    assert_eq!(*RANGE_CALLS.lock().unwrap(), [(10, 74), (74, 138), (138, 150)]);
    RANGE_CALLS.lock().unwrap().clear();
    range_limited(0, 70, 16).unwrap();
    let calls = RANGE_CALLS.lock().unwrap().clone();
    assert_eq!(calls, [(0, 64), (0, 32), (0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]);
    RANGE_CALLS.lock().unwrap().clear();
    range_limited(5, 5, 1).unwrap();
    assert!(RANGE_CALLS.lock().unwrap().is_empty());
}

#[test]
fn range_unit_bodies_retry_on_panics() {
    static SEEN: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
    #[toma::range(initial_step = 8, cache = None)]
    fn fill(mut start: usize, end: usize) {
        if end - start > 2 {
            panic!("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes");
        }
        while start < end {
            SEEN.lock().unwrap().push((start, start + 1));
            start += 1;
        }
    }
    fill(3, 8);
    let seen = SEEN.lock().unwrap().clone();
    assert_eq!(seen, (3..8).map(|i| (i, i + 1)).collect::<Vec<_>>());
}

// ---- chunked ---------------------------------------------------------------------------------

#[toma::chunked(initial_step = 16, cache = None)]
fn write_rows(mut chunk: Tensor, start: usize, end: usize, limit: usize) -> Result<(), tch::TchError> {
    if end - start > limit {
        return Err(tch::TchError::Torch(oom()));
    }
    // Adds 1 to every row of the view: a row written twice would read 2.
    let _ = chunk.g_add_scalar_(1.0);
    Ok(())
}

#[test]
fn chunked_writes_every_row_once_on_dim_0() {
    let t = Tensor::zeros([37, 5], (Kind::Float, Device::Cpu));
    write_rows(&t, 6).unwrap();
    assert_eq!(t, Tensor::ones([37, 5], (Kind::Float, Device::Cpu)));
}

#[toma::chunked(initial_step = 16, dimension = 1, cache = None)]
fn write_columns(mut chunk: Tensor, start: usize, end: usize) -> Result<(), String> {
    if end - start > 4 {
        return Err(oom());
    }
    assert_eq!(chunk.size(), [3, (end - start) as i64]);
    let _ = chunk.g_add_scalar_(start as f64 + 1.0);
    Ok(())
}

#[test]
fn chunked_writes_every_row_once_on_dim_1() {
    let t = Tensor::zeros([3, 10], (Kind::Float, Device::Cpu));
    write_columns(&t).unwrap();
    // All 10 columns (step 16) fail, then 8 (half the step) fail, then chunks of 4: each
    // column got its chunk's start + 1.
    let expected = Tensor::from_slice(&[1f32, 1., 1., 1., 5., 5., 5., 5., 9., 9.]).expand([3, 10], false);
    assert_eq!(t, expected);
}

#[test]
fn chunked_plain_body_with_panicking_tch() {
    #[toma::chunked(initial_step = 8, dimension = -1, cache = None)]
    fn double(mut chunk: Tensor, start: usize, end: usize) {
        if end - start > 3 {
            panic!("{}", tch::TchError::Torch(oom()));
        }
        let _ = chunk.g_mul_scalar_(2.0);
    }
    let t = Tensor::ones([2, 7], (Kind::Double, Device::Cpu));
    double(&t);
    assert_eq!(t.sum(Kind::Double).double_value(&[]), 28.0);
}

// ---- async -----------------------------------------------------------------------------------

#[test]
fn async_batch_range_and_chunked() {
    static CALLS: Recorder = Recorder::new();
    #[toma::batch(initial_batchsize = 64, cache = None)]
    async fn fetch(batchsize: usize, limit: usize) -> Result<usize, String> {
        CALLS.push(batchsize);
        support::yield_now().await;
        if batchsize > limit {
            return Err(oom());
        }
        let doubled: usize = format!("{}", batchsize * 2).parse().map_err(|e| format!("{e}"))?;
        Ok(doubled)
    }
    assert_eq!(block_on(fetch(16)), Ok(32));
    assert_eq!(CALLS.take(), [64, 32, 16]);

    static RANGES: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
    #[toma::range(initial_step = 4, cache = None)]
    async fn walk(start: usize, end: usize) {
        support::yield_now().await;
        if end - start > 2 {
            panic!("CUDA out of memory. Tried to allocate 4 GiB");
        }
        RANGES.lock().unwrap().push((start, end));
    }
    block_on(walk(0, 5));
    assert_eq!(*RANGES.lock().unwrap(), [(0, 2), (2, 4), (4, 5)]);

    #[toma::chunked(initial_step = 4, cache = None)]
    async fn add(mut chunk: Tensor, start: usize, end: usize) -> Result<(), tch::TchError> {
        support::yield_now().await;
        if end - start > 1 {
            return Err(tch::TchError::Torch(oom()));
        }
        let _ = chunk.f_add_scalar_(1.0)?;
        Ok(())
    }
    let t = Tensor::zeros([6], (Kind::Float, Device::Cpu));
    block_on(add(&t)).unwrap();
    assert_eq!(t, Tensor::ones([6], (Kind::Float, Device::Cpu)));
}

/// Parameters named like the expansion's own bindings (`next`, `result`, `err`) are the
/// caller's values inside the body, not the expansion's.
#[test]
fn async_parameters_named_like_the_expansion_are_not_shadowed() {
    static SEEN: Mutex<Vec<(usize, usize, usize, usize)>> = Mutex::new(Vec::new());
    #[toma::range(initial_step = 2, cache = None)]
    async fn walk(start: usize, end: usize, next: usize, result: usize, err: usize) -> Result<(), String> {
        support::yield_now().await;
        SEEN.lock().unwrap().push((start, next, result, err));
        let _ = end;
        Ok(())
    }
    block_on(walk(0, 4, 7, 8, 9)).unwrap();
    assert_eq!(*SEEN.lock().unwrap(), [(0, 7, 8, 9), (2, 7, 8, 9)]);
}

#[test]
fn policies_on_attributes() {
    static CALLS: Recorder = Recorder::new();
    #[toma::batch(initial_batchsize = 65, cache = None, policy = factor(0.9))]
    fn gentle(batchsize: usize) -> Result<usize, String> {
        CALLS.push(batchsize);
        if batchsize > 60 {
            return Err(oom());
        }
        Ok(batchsize)
    }
    assert_eq!(gentle(), Ok(58));
    assert_eq!(CALLS.take(), [65, 58]);

    const POLICY: toma::Policy = toma::Policy::grow_up_to(40);
    static RANGES: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
    #[toma::range(initial_step = 8, cache = None, policy = POLICY)]
    fn widen(start: usize, end: usize) {
        RANGES.lock().unwrap().push((start, end));
    }
    widen(0, 100);
    // No failure: the step grows halfway towards the cap after every success.
    let lengths: Vec<usize> = RANGES.lock().unwrap().iter().map(|(s, e)| e - s).collect();
    assert_eq!(lengths, [8, 24, 32, 36]);
}

/// `crate = path`: for a crate that re-exports toma under another name.
mod facade {
    pub use toma as memory_retry;
}

#[test]
fn the_crate_argument_names_toma_by_another_path() {
    #[toma::batch(initial_batchsize = 16, cache = None, policy = factor(0.5), crate = facade::memory_retry)]
    fn halves(batchsize: usize) -> Result<usize, String> {
        if batchsize > 4 {
            return Err(oom());
        }
        Ok(batchsize)
    }
    assert_eq!(halves(), Ok(4));

    #[toma::range(initial_step = 4, crate = crate::attributes::facade::memory_retry)]
    async fn walk(start: usize, end: usize) -> Result<(), String> {
        let _ = (start, end);
        Ok(())
    }
    assert_eq!(block_on(walk(0, 10)), Ok(()));
}

// ---- progress --------------------------------------------------------------------------------

#[toma::range(initial_step = 64, cache = None, progress = always)]
fn range_with_progress(start: usize, end: usize) -> Result<(), String> {
    if end - start > 16 {
        return Err(oom());
    }
    Ok(())
}

#[toma::range(initial_step = 64, cache = None, progress = true)]
fn range_with_terminal_progress(start: usize, end: usize) -> Result<(), String> {
    if end - start > 16 {
        return Err(oom());
    }
    Ok(())
}

/// `progress = always` writes to a stderr that is not a terminal (a pipe here); `progress =
/// true` writes only to a terminal. With feature `progress`; without it, neither writes.
#[test]
fn progress_writes_only_where_asked() {
    if std::env::var_os("TOMA_PROGRESS_CHILD").is_some() {
        range_with_terminal_progress(0, 100).unwrap();
        eprintln!("-- terminal only above, always below --");
        range_with_progress(0, 100).unwrap();
        return;
    }
    let child = support::child::run("attributes::progress_writes_only_where_asked", "TOMA_PROGRESS_CHILD", "1");
    assert!(child.status.success(), "{}", child.report);
    let (terminal, always) =
        child.stderr.split_once("-- terminal only above, always below --").expect("the marker line");
    assert!(!terminal.contains("items"), "progress = true wrote to a pipe:\n{}", child.report);
    if cfg!(feature = "progress") {
        let last = always.lines().rfind(|l| l.contains("items")).unwrap_or_else(|| panic!("{}", child.report));
        assert!(last.contains("100/100 items"), "{last}");
        assert!(last.contains("out of memory caught"), "{last}");
        assert!(!last.contains("| 0 out of memory caught"), "the two caught are counted: {last}");
    } else {
        assert!(!always.contains("items"), "{}", child.report);
    }
}
