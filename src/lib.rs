//! # toma: keep tch work alive when memory runs out
//!
//! Wrap the code that may run out of memory; toma runs it, catches an out-of-memory (a tch
//! error *or* a tch panic), halves the batch size or step, runs it again, and remembers the
//! size that worked so the next call starts there.
//!
//! ```
//! # #[cfg(feature = "macros")] {
//! // A body that needs more memory than there is above 100 items.
//! #[toma::batch(initial_batchsize = 512, cache = None)]
//! fn embed(batchsize: usize, items: &[f32]) -> Result<usize, String> {
//!     if batchsize > 100 {
//!         return Err("CUDA out of memory. Tried to allocate 2.00 GiB".into());
//!     }
//!     Ok(items.chunks(batchsize).count())
//! }
//! assert_eq!(embed(&[0.0; 1000]), Ok(16)); // ran at 512, 256, 128, then 64
//! # }
//! ```
//!
//! This page is the manual of the retry half. The planning half, which sizes micro-batches before
//! anything runs, is [`lazy`]; ranks that retry together are `toma::dist` (feature `dist`).
//!
//! - Attributes: [`batch`], [`range`], [`chunked`] (feature `macros`, on `fn` and `async fn`).
//! - Immediate blocks: [`execute::batch`], [`execute::range`], [`execute::chunked`].
//! - Builders the two lower to: [`Batch`], [`Range`], [`Chunked`]; how sizes move: [`Policy`];
//!   what a call did: [`Report`]; steps sized from measurement: [`Range::auto`].
//! - What counts as an out-of-memory: [`OutOfMemory`], decided in
//!   [`oom::is_out_of_memory_message`].
//! - Caches: [`CacheKind`], [`set_default_cache`], module [`cache`].
//! - Memory: [`memory`] (CUDA and CPU free memory, libtorch's allocators), [`cpu_memory`] (CPU
//!   caps: `RLIMIT_AS`, `RLIMIT_DATA`; the same module as `memory::cpu`).
//!
//! ## The three attributes
//!
//! - [`batch`] takes a first parameter `batchsize: usize` and removes it: callers do not pass it.
//!   [`range`] keeps `fn f(start: usize, end: usize, ..)` and runs the body on consecutive
//!   sub-ranges. [`chunked`] turns `fn f(chunk: Tensor, start: usize, end: usize, ..)` into
//!   `fn f(tensor: &Tensor, ..)`; `chunk` is a view, so writes land in `tensor`.
//! - Arguments: `initial_batchsize = N` (batch) or `initial_step = N | auto` (range, chunked;
//!   `auto` takes `budget`, `safety_margin`, `max_step`, `objective`: see [Auto
//!   steps](#auto-steps-sized-from-measurement)), at least 1; `dimension = D` (chunked, default 0,
//!   negative counts from the end); `cache = StacktraceMemory | Global | None` (default: the
//!   process default, see [Caches](#caches)); `policy = halve | factor(0.9) | grow | grow_up_to(N)`
//!   (default `halve`); `progress = true | always` (see [Progress](#progress)); `crate = path`
//!   when toma is reached by another path (a crate that re-exports it).
//! - The return type is `Result<T, E>` with `E: OutOfMemory` (an `Err` that is an out-of-memory is
//!   retried, others come back at once), or any other type (range and chunked: `()`). Either way
//!   a panic whose message is an out-of-memory (tch's plain methods panic) is caught and retried
//!   without printing a backtrace for each retry; other panics go on as usual.
//! - `async fn` works the same way; each attempt awaits a fresh body.
//! - What worked is remembered per call site under the default cache (`StacktraceMemory`): the
//!   line that calls the function, its callers, and the free memory. A function called from a
//!   new line starts again at the initial size and learns for that line; `cache = Global` shares
//!   one size among every caller.
//! - Mistakes are compile errors at your tokens: unknown or missing arguments, a size of 0, a
//!   first parameter that is not `batchsize: usize`, an error type that is not `OutOfMemory`, a
//!   body that moves an argument it would need again on the next attempt.
//!
//! ## Immediate blocks and builders
//!
//! [`execute`] runs a closure at once; the builders take every option. The attributes and
//! `execute` lower to the builders.
//!
//! ```
//! # #[cfg(feature = "tch")] {
//! use tch::{Device, Kind, TchError, Tensor};
//! use toma::{Batch, CacheKind, Chunked, Range};
//!
//! let fits = |size: usize| if size > 300 { Err("CUDA out of memory.".to_string()) } else { Ok(size) };
//! assert_eq!(toma::execute::batch(1024, fits), Ok(256));
//! assert_eq!(Batch::new(1024).cache(CacheKind::Global).run(fits), Ok(256));
//!
//! let mut seen = Vec::new();
//! Range::new(0, 10, 4).cache(CacheKind::None).run(|start, end| {
//!     seen.push((start, end));
//!     Ok::<(), String>(())
//! })?;
//! assert_eq!(seen, [(0, 4), (4, 8), (8, 10)]);
//!
//! // A closure that uses `?` names its error type on its last line.
//! let images = Tensor::ones([2, 100], (Kind::Float, Device::Cpu));
//! Chunked::new(&images, 64).dimension(1).cache(CacheKind::None).run(|mut chunk, _start, _end| {
//!     let _ = chunk.f_div_scalar_(255.0)?;
//!     Ok::<_, TchError>(())
//! })?;
//! assert!((images.sum(Kind::Double).double_value(&[]) - 200.0 / 255.0).abs() < 1e-6);
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A closure that uses `?` must name its error type, since `?` converts into any error:
//! `Ok::<_, TchError>(value)` as its last line (or `-> Result<_, TchError>` on the closure).
//! Without it Rust stops at E0283, `cannot satisfy _: toma::OutOfMemory`.
//!
//! Semantics: on an out-of-memory the size goes to `size / 2`; at size 1 the last out-of-memory
//! is returned (or its panic resumed). Everything of a failed attempt is dropped before the next.
//! `range` and `chunked` halve the step, as Python toma does: `range(0, 40)` at step 64 failing
//! on `[0, 40)` goes on with `[0, 32)` (a step that would repeat the failed length is halved
//! again). They never redo finished sub-ranges, and keep the smaller step for the rest of the
//! call. Bad configuration is covered under [Bad input](#bad-input).
//!
//! ## Policies and reports
//!
//! [`Policy`] says how a size moves (its docs have the table): `halve` (the default, as Python
//! toma), `factor(f)` (settles within `f` of the limit), `grow` (binary-searches upward between
//! the last success and the last failure, bounds kept in the cache). `run_with_report` says what
//! a call did: attempts, out-of-memories, first and final size, time in failed attempts, and each
//! attempt's size, outcome and measured peak ([`Report::history`]).
//!
//! ```
//! use toma::{Batch, CacheKind, Policy};
//!
//! // A batch of 65 that fails above 60: halve ends at 32, factor(0.9) at 58, grow at 60.
//! let fits = |size: usize| if size > 60 { Err("CUDA out of memory.".to_string()) } else { Ok(size) };
//! let (out, report) = Batch::new(65).cache(CacheKind::None).policy(Policy::factor(0.9)).run_with_report(fits);
//! assert_eq!(out, Ok(58));
//! assert_eq!((report.attempts, report.out_of_memory, report.final_size), (2, 1, 58));
//! let grown = (0..8).map(|_| Batch::new(65).cache(CacheKind::Global).policy(Policy::grow()).run(fits));
//! assert_eq!(grown.last(), Some(Ok(60)));
//! ```
//!
//! How close each policy gets to the limit, over 2,000 random limits, is in the repository's
//! `docs/performance.md`.
//!
//! ## Auto steps: sized from measurement
//!
//! `range` and `chunked` need no guessed step. With [`Range::auto`] (or [`Chunked::auto`],
//! [`execute::range_auto`], `initial_step = auto`) the first chunks are probes: real work, never
//! redone. toma measures each chunk's allocator peak above what was in use when the call
//! started, on the CPU and on every CUDA device libtorch has. It fits `fixed + per_item · n` per
//! device, and each next step is the largest that keeps every device under its budget. Every
//! chunk is measured again and refines the fit.
//!
//! ```
//! # #[cfg(not(feature = "tch"))] fn main() {}
//! # #[cfg(feature = "tch")] fn main() -> Result<(), tch::TchError> {
//! use tch::{Device, Kind, TchError, Tensor};
//! use toma::{CacheKind, Range};
//!
//! // 64 KiB per item under a budget of 8 MiB: at most 128 items fit.
//! // Without `budget`: each device's free memory less `safety_margin` (10%).
//! let (result, report) = Range::auto(0, 1000)
//!     .budget(8 << 20)
//!     .cache(CacheKind::None)
//!     .run_with_report(|start, end| {
//!         let rows = Tensor::f_ones([(end - start) as i64, 16 << 10], (Kind::Float, Device::Cpu))?;
//!         rows.f_sum(Kind::Float)?;
//!         Ok::<(), TchError>(())
//!     });
//! result?;
//! let auto = report.auto.unwrap();
//! assert!(auto.probes >= 2 && auto.step <= 128 && auto.over_budget == 0);
//! # Ok(())
//! # }
//! ```
//!
//! - **Probes.** The steps go 1, then at most 16 times the largest chunk measured so far, then the
//!   fitted limit. With 256 KiB items under a 64 MiB budget the chunks run 1, 16, 255, 255, ….
//!   The fit is weighted to the largest chunks and raised until it covers every measurement, so
//!   it never predicts below a peak it has seen. The growth cap is there because a line fitted on
//!   small chunks under-predicts models whose per-item cost grows with the size (resnet18: 14%
//!   low at batch 64 from sizes 1 and 2).
//! - **Measurement.** On the CPU, the first `auto` call turns on the counting allocator
//!   ([`memory::track_cpu_allocations`]) for the rest of the process, at about +0.8 µs per CPU
//!   allocation. On CUDA, toma reads the caching allocator's peak counters through the shim. A
//!   body on a GPU machine that allocates only on the CPU is held to the CPU's budget, so its
//!   step cannot grow without bound. Peak counters are process-wide, so two `auto` loops running
//!   at once measure each other (safe: smaller steps).
//! - **Out of memory.** A real out-of-memory still goes through the retry engine: the step
//!   shrinks by the policy, and the fit never issues that size again.
//! - **Cache.** The fit is remembered under the call's cache key, so the next call starts at the
//!   fitted step with no probes (`report.from_cache`, `report.auto.probes == 0`).
//! - **[`Objective::Fastest`].** Every full chunk is timed. The search explores doubling steps up
//!   to the largest that fits, times each one three times, and re-times the best and its
//!   neighbours up to six times. It judges by the median, because the first run of a new size
//!   pays allocator and kernel warm-up. A larger step must be at least 5% faster to win, and the
//!   search starts again when throughput at the chosen step drops below 80%. This pays where time
//!   per item flattens (GPU kernels saturate; on a 2-core CPU a transformer block's time per
//!   sample is flat from batch 2 to 64): the smaller step leaves memory free at no cost in
//!   speed. The search costs the chunks run at sizes that turn out slower, about three per
//!   doubling from 1.
//! - **Bad values:** a budget, `max_step` or literal step of 0, or a margin outside [0, 1), panic
//!   with a [`ConfigError`]. An `auto` option on a fixed step is a compile error.
//!
//! For training over chunks, scale each chunk's mean loss by [`share`]`(start, end, len)` before
//! one optimizer step: the summed gradients are the full batch's. `examples/resnet_auto.rs` runs
//! an unchanged `tch::vision::resnet::resnet18` that way (`cargo run --release --example
//! resnet_auto`). What adapting costs against the best fixed step is in `docs/performance.md`.
//!
//! ## Caches
//!
//! | [`CacheKind`] | key | |
//! |---|---|---|
//! | `StacktraceMemory` (default) | exact call site (`#[track_caller]`) + chain of enclosing functions (function start addresses from a stack walk of at most 8 frames in optimised builds, 14 in debug ones, no symbol resolution) + free memory in 256 MiB buckets (CPU available; GPU 0 free when a CUDA device is present) | the same line in a loop hits, also in release builds with unrolled loops; another line, or less free memory, starts again |
//! | `Global` | the decorated function, or the `execute`/`run` call site | one size for every caller |
//! | `None` | — | always the initial size |
//!
//! [`set_default_cache`] changes the default for every later call that does not name a kind. An
//! entry only goes down (success at `s` stores `min(entry, s)`, an out-of-memory at `s` stores
//! `min(entry, s / 2)`), so a slow thread cannot raise it above a size that failed. The
//! free-memory reading is shared and up to a second old (reading `/proc/meminfo` costs ~15 µs).
//! The cache holds at most 16,384 keys and starts over when full; [`cache::clear`] empties it.
//! A hit costs +41 ns (`Global`) to +1.2 µs (`StacktraceMemory`) per call.
//!
//! ## CPU memory cap
//!
//! A cap on the process's CPU memory makes libtorch fail with `DefaultCPUAllocator: can't
//! allocate memory`, which toma treats like a CUDA out-of-memory. That is how the tests and the
//! demo produce real allocator failures on a machine without a GPU.
//!
//! ```
//! # #[cfg(feature = "tch")] {
//! use tch::{Device, Kind, TchError, Tensor};
//! use toma::cpu_memory::CpuCap;
//!
//! // Bytes everywhere. libtorch with its CUDA libraries maps several GiB before allocating
//! // anything, so size a cap from what is in use: set_headroom(b) caps at in_use() + b.
//! CpuCap::Data.set_headroom(256 << 20)?; // or CpuCap::AddressSpace where no CUDA driver is loaded
//! let rows = toma::Batch::new(1024).cache(toma::CacheKind::None).run(|mebibytes| {
//!     let block = Tensor::f_empty([mebibytes as i64, 1 << 18], (Kind::Float, Device::Cpu))?;
//!     Ok::<_, TchError>(block.size()[0])
//! })?;
//! assert!(rows < 1024 && rows >= 64); // 1024 MiB and 512 MiB failed for real
//! assert!(toma::cpu_memory::available_cpu_memory() <= 256 << 20); // min(MemAvailable, headroom)
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! | cap | kernel limit | counts | use it |
//! | --- | --- | --- | --- |
//! | [`CpuCap::AddressSpace`](cpu_memory::CpuCap::AddressSpace) | `RLIMIT_AS` | all mapped address space (`VmSize`): libraries, reservations, tensors | where no CUDA driver is loaded |
//! | [`CpuCap::Data`](cpu_memory::CpuCap::Data) | `RLIMIT_DATA` | private writable memory (`VmData`): tensors, heap, thread stacks; not libraries or `PROT_NONE` reservations | on CUDA machines |
//!
//! Why two: the CUDA driver reserves inaccessible address ranges far larger than the card
//! (NVIDIA's cuda-python measured about twice the device memory for one memory pool), and those
//! count against `RLIMIT_AS`, so an address-space cap can make CUDA fail to start or to allocate.
//! They do not count against `RLIMIT_DATA`. `tests/real_oom.rs` shows both halves on the CPU:
//! under `RLIMIT_AS` a 64 GiB `PROT_NONE` reservation is refused; under `RLIMIT_DATA` it fits
//! while libtorch's allocator still fails for real and the batch converges (65536 → 1024 under a
//! 1.5 GiB headroom). Setting the address-space cap in a process that has CUDA's libraries loaded
//! logs a warning. On an H100 (`tests/gpu.rs` test 6, 4 GiB above what was in use) the data cap
//! left CUDA working whether set before or after CUDA started; the address-space cap set after
//! CUDA started did too, but set before, CUDA could not start at all (`cudaGetDeviceCount() …
//! Error 2: out of memory`).
//!
//! A cap of 0 bytes and a cap at or below what is already in use are `ErrorKind::InvalidInput`
//! errors that wrap a [`ConfigError`] (`ZeroSize`, `CapBelowUse`). A cap cannot be raised again:
//! set it once, early, or in a child process.
//!
//! **Under a cap, keep `RUST_BACKTRACE` unset** (or `0`) outside debugging. When the cap is
//! reached inside a panic that toma does not catch, Rust's panic hook allocates to capture and
//! print the backtrace; with no memory left that allocation can fail inside the hook or block on
//! the allocator's lock, and the process hangs instead of exiting with the message. toma keeps
//! the out-of-memory panics it catches away from the default hook (see [The panic
//! hook](#the-panic-hook)), so this only bites a panic that escapes (a bug, or an error the
//! caller unwraps). Leave headroom for it (`set_headroom` of a few MiB above the largest batch
//! that must fail) when backtraces are wanted.
//!
//! ## What counts as an out-of-memory
//!
//! Decided in one place, [`oom::is_out_of_memory_message`] ([`oom::classify_message`] gives the
//! [`Verdict`](oom::Verdict) without asking the machine):
//!
//! - **Out of memory:** `CUDA out of memory`, `CUDA error: out of memory`, `cuDNN error:
//!   CUDNN_STATUS_NOT_SUPPORTED` (how PyTorch reports a failed cuDNN workspace allocation),
//!   `CUDNN_STATUS_ALLOC_FAILED`, `CUBLAS_STATUS_ALLOC_FAILED`, `CUFFT_ALLOC_FAILED`,
//!   `CUSOLVER_STATUS_ALLOC_FAILED`, `CUSPARSE_STATUS_ALLOC_FAILED`, `DefaultCPUAllocator: can't
//!   allocate memory`, `DefaultCPUAllocator: not enough memory`, `std::bad_alloc`, `HIP out of
//!   memory`, `HIP error: out of memory`, `MPS backend out of memory`, `XPU out of memory`.
//! - **Out of memory when CPU memory is short** (a `CpuCap` is set, or `MemAvailable` is under an
//!   eighth of `MemTotal`; [`cpu_memory::under_pressure`]): oneDNN's `could not create a
//!   primitive`. Evidence (`tests/real_oom.rs`, scenario `onednn`): resnet18 inference under a
//!   data cap, with oneDNN's primitive cache filled by a dozen batch sizes, failed this way for
//!   every new batch size while the headroom stood at 290 MB; with
//!   `ONEDNN_PRIMITIVE_CACHE_CAPACITY=0` the same sweep never failed (seen on this project's
//!   2-core x86 machines; the H100 host's 16-core Xeon never failed this way at the same
//!   headrooms, and the test says it skipped there). `could not create a primitive descriptor`
//!   (an unsupported configuration) stays another error. Under a cap, each batch size toma tries
//!   makes oneDNN cache new kernels with their scratch space: a small
//!   `ONEDNN_PRIMITIVE_CACHE_CAPACITY` bounds that.
//! - **Anything else** is given back at once: `CUDA error: device-side assert triggered` is a
//!   bug, not a memory problem; so is CUDA failing to start under an address-space cap.
//! - **Your own:** [`oom::add_out_of_memory_marker`]`("arena exhausted")` counts a text as an
//!   out-of-memory from then on, process-wide; a builder's `.when(|text| ..)` ([`Batch::when`])
//!   decides for one call (`Some(true)` retry, `Some(false)` give back, `None` leave it to toma).
//!
//! [`OutOfMemory`] is implemented for `tch::TchError`, `str`, `String`, `std::io::Error` and boxed
//! errors (following `source()`), and for `anyhow::Error` under feature `anyhow`. Tests check the
//! decision against a corpus of real error texts (`tests/data/oom-messages.tsv`). OpenBLAS's
//! `too many memory regions` aborts the process before anything can catch it; there is nothing
//! to classify.
//!
//! ## Memory figures and CUDA
//!
//! [`memory::cuda_memory`] gives a CUDA device's free and total bytes through the driver API
//! (cudarc, loaded at run time): `None` without a driver or device, never a panic. [`memory`]
//! reads libtorch's caching allocator through a small C++ shim built against the same libtorch
//! (allocated, reserved, peak, reset, empty cache; `None` without CUDA). For the CPU, where
//! libtorch keeps no figures, [`memory::track_cpu_allocations`] wraps its CPU allocator in a
//! counter (bytes live, peak, allocations; [`memory::cpu_allocator_stats`],
//! [`memory::reset_cpu_peak`]). Between retries toma empties libtorch's CUDA cache, and it counts
//! free memory as driver free + reserved − allocated, for the device the work runs on.
//!
//! Linking CUDA through tch: nothing in a tch binary references `libtorch_cuda`, so with the
//! default `--as-needed` the linker drops it and libtorch sees no GPU. toma's own tests and
//! examples link it explicitly (`build.rs`). In your crate's `build.rs`, print
//! `cargo:rustc-link-arg=-Wl,--no-as-needed`, `cargo:rustc-link-arg=-ltorch` and
//! `cargo:rustc-link-arg=-Wl,--as-needed` (`libtorch.so` depends on `libtorch_cuda.so`).
//!
//! ## Features
//! - `tch` (default): `OutOfMemory for tch::TchError`, [`Chunked`], [`execute::chunked`], and
//!   [`lazy`] (needs libtorch; `cargo build --no-default-features` does not).
//! - `cuda` (default): CUDA free memory through cudarc's driver API, loaded at run time.
//! - `macros` (default): the attributes.
//! - `anyhow`: `OutOfMemory for anyhow::Error`, looking through its context chain.
//! - `progress`: a progress bar on stderr for `range` and `chunked` calls that ask for one
//!   ([`Range::progress`], `progress = true` on the attributes); see [`Progress`].
//! - `dist`: `toma::dist`, ranks that agree on sizes through c10d's TCPStore, and a Gloo gradient
//!   all-reduce (a C++ shim against libtorch's c10d headers).
//!
//! ## Tracing
//! Everything is logged under the target `toma`, inside one span per call:
//!
//! | span | fields |
//! |---|---|
//! | `toma.batch`, `toma.range`, `toma.chunked` | `function` (the wrapped function, or `"execute"`), `site` (`file:line:column` of the call), `initial` (batch size or step) |
//! | `toma.lazy` | `mode` (`"forward"` or `"backward"`), `op` (the output's op) |
//!
//! Inside them: a `debug` event per attempt (`size`, or `start` and `end`), an `info` event per
//! caught out-of-memory (`from`, `to`, `caught`: `"panic"` or `"error"`, `error`: the first line
//! of the message), an `info` summary of a call that caught any (`attempts`, `out_of_memory`,
//! `first_size`, `final_size`, `failed_ms`), `debug` events for cache hits and `auto` steps,
//! and an `info` event per lazy plan (`batch`, `micro_batch`, `chunks`, `peak`, `budget`). With
//! `tracing-subscriber`: `RUST_LOG=toma=info` and
//! `tracing_subscriber::fmt().with_env_filter(EnvFilter::from_default_env()).init()`
//! (`RUST_LOG=toma=info scripts/demo.sh` drops the per-attempt lines). Spans and attempt
//! histories cost a cache hit nothing unless a subscriber listens at `info` or a report is asked
//! for.
//!
//! ## Progress
//! Long `range`/`chunked` loops can show where they are (feature `progress`):
//! `#[toma::range(initial_step = 1024, progress = true)]`, or
//! `Range::new(0, n, 1024).progress(true)`.
//!
//! ```text
//! range [=============>                  ] 8704/20000 items | step 256 | 2 out of memory caught | 5060 items/s | 00:00:01 (eta 2s)
//! ```
//!
//! `progress = true` draws only when stderr is a terminal (logs and pipes stay clean);
//! `progress = always` writes a line a second anywhere. `cargo run --example progress --features
//! progress` shows it.
//!
//! ## Pictures
//! [`Report::to_svg`] draws a run (`run_with_report` keeps each attempt: size, out-of-memory or
//! not, time, measured peak) and [`lazy::Plan::to_svg`] a plan. Both are self-contained SVG
//! files; `scripts/pictures.sh` re-draws the README's two (`docs/run.svg`, `docs/plan.svg`) from
//! real runs on your machine.
//!
//! ## Bad input
//! One style throughout: a value that cannot work is a [`ConfigError`], never clamped or
//! ignored. Constructors that take values from data have `try_` forms that return it
//! ([`Batch::try_new`], [`Range::try_new`], [`Chunked::try_new`]); the plain forms and the
//! builders' setters panic with its message at your line (`#[track_caller]`, listed under each
//! `# Panics`). The CPU caps do I/O and return an `io::Error` of kind `InvalidInput` that wraps
//! the `ConfigError`. A literal 0 in an attribute is a compile error. Sizes are counts of items
//! and memory is in bytes (`u64`) everywhere. An empty range runs nothing and succeeds.
//!
//! ## The panic hook
//! tch's plain methods panic on an out-of-memory. So that a retried panic prints nothing (toma
//! logs it instead), the first retryable attempt wraps the process's panic hook once; every
//! panic that is not a caught out-of-memory reaches your hook unchanged. Set your own hook
//! before toma's first call, or turn this off with [`quiet_caught_panics`]`(false)`.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub mod autocast;
pub mod cache;
#[cfg(feature = "tch")]
mod dims;
#[cfg(feature = "dist")]
#[cfg_attr(docsrs, doc(cfg(feature = "dist")))]
pub mod dist;
mod error;
pub mod execute;
mod hash;
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub mod lazy;
pub mod memory;
#[doc(inline)]
pub use memory::cpu as cpu_memory;
pub mod oom;
mod policy;
mod progress;
mod retry;
mod svg;

#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use autocast::autocast;
pub use cache::{default_cache, set_default_cache, CacheKind};
pub use error::ConfigError;
pub use oom::OutOfMemory;
pub use policy::Policy;
pub use progress::Progress;
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use retry::Chunked;
#[cfg(all(feature = "dist", feature = "tch"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "dist", feature = "tch"))))]
pub use retry::GroupedChunked;
pub use retry::{
    quiet_caught_panics, share, Attempt, AutoReport, Batch, DeviceFit, MeasuredDevice, Objective, Range, Report,
};
#[cfg(feature = "dist")]
#[cfg_attr(docsrs, doc(cfg(feature = "dist")))]
pub use retry::{GroupedBatch, GroupedRange};

/// Retries a function with a halved batch size on out-of-memory, remembering the size that
/// worked.
///
/// On `fn f(batchsize: usize, a: A, ..) -> R` it generates `fn f(a: A, ..) -> R`: callers do not
/// pass the batch size. Arguments: `initial_batchsize = N` (required, at least 1; any `usize`
/// expression, a literal 0 is a compile error), `cache = StacktraceMemory | Global | None`
/// (default: [`default_cache`]) and `policy = halve | factor(f) | grow | grow_up_to(n)` (or any
/// [`Policy`] expression; default `halve`). It lowers to [`Batch`]; see there for the semantics.
///
/// `R` is `Result<T, E>` with `E: OutOfMemory` — an `Err` that is an out-of-memory is
/// retried — or any other type. Either way an out-of-memory panic (tch's plain methods panic)
/// is caught and retried silently; other panics propagate unchanged. Works on `async fn` and
/// on methods (`&self` comes first, then `batchsize`). The body runs once per attempt, so it
/// may not move an argument it does not own again: take references, or clone.
///
/// ```
/// use tch::{Device, Kind, Tensor};
///
/// #[toma::batch(initial_batchsize = 1024)]
/// fn total(batchsize: usize, data: &Tensor) -> Result<f64, tch::TchError> {
///     let mut sum = 0.0;
///     for part in data.f_split(batchsize as i64, 0)? {
///         sum += part.f_sum(Kind::Double)?.f_double_value(&[])?;
///     }
///     Ok(sum)
/// }
///
/// let data = Tensor::ones([3000], (Kind::Float, Device::Cpu));
/// assert_eq!(total(&data)?, 3000.0);
/// # Ok::<(), tch::TchError>(())
/// ```
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
#[doc(inline)]
pub use toma_macros::batch;

/// Runs a function over consecutive sub-ranges of `[start, end)`, halving the step on
/// out-of-memory.
///
/// On `fn f(start: usize, end: usize, ..) -> R` it keeps the signature; the body is called on
/// `[s, min(s + step, end))` for consecutive `s`, each index exactly once, in order. A failure
/// halves the step (again, while the step would not be shorter than a failed clipped last
/// sub-range), and the failed sub-range is retried; finished ones are never redone. `R` is `()` or
/// `Result<(), E>` with `E: OutOfMemory`. Arguments: `initial_step = N` (required), `cache` and
/// `policy`, as for [`batch`]. It lowers to [`Range`].
///
/// ```
/// use std::sync::Mutex;
/// static DONE: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
///
/// #[toma::range(initial_step = 4096, cache = None)]
/// fn process(start: usize, end: usize) -> Result<(), String> {
///     if end - start > 1024 {
///         return Err("CUDA out of memory. Tried to allocate 8.00 GiB".into());
///     }
///     DONE.lock().unwrap().push((start, end));
///     Ok(())
/// }
///
/// process(0, 2000)?;
/// // [0, 2000) at step 4096 failed: the step halved to 2048, then 1024 (shorter than 2000).
/// assert_eq!(*DONE.lock().unwrap(), [(0, 1024), (1024, 2000)]);
/// # Ok::<(), String>(())
/// ```
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
#[doc(inline)]
pub use toma_macros::range;

/// Runs a function on consecutive chunks of a tensor along one dimension, halving the chunk on
/// out-of-memory.
///
/// On `fn f(chunk: Tensor, start: usize, end: usize, ..) -> R` (`mut chunk` allowed) it
/// generates `fn f(tensor: &Tensor, ..) -> R`; `chunk` is
/// `tensor.narrow(dimension, start, end - start)`, a view, so writes into it land in `tensor`.
/// `R` is `()` or `Result<(), E>` with `E: OutOfMemory`. Arguments: `initial_step = N`
/// (required), `dimension = D` (default 0; negative counts from the last), `cache` and
/// `policy`, as for [`batch`]. It lowers to [`Chunked`].
///
/// ```
/// use tch::{Device, Kind, Tensor};
///
/// #[toma::chunked(initial_step = 64, dimension = 1)]
/// fn scale(mut chunk: Tensor, start: usize, _end: usize) {
///     let _ = chunk.g_mul_scalar_(2.0);
/// }
///
/// let images = Tensor::ones([2, 100], (Kind::Float, Device::Cpu));
/// scale(&images);
/// assert_eq!(images.sum(Kind::Double).double_value(&[]), 400.0);
/// ```
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
#[doc(inline)]
pub use toma_macros::chunked;

/// What the attributes expand to. Not a public API: it changes without notice.
#[doc(hidden)]
pub mod __private {
    pub use crate::cache::{CacheKind, Site};
    pub use crate::policy::Policy;
    pub use crate::progress::Progress;
    pub use crate::retry::Objective;
    pub use crate::retry::{
        infallible, typed_future, unwrap_infallible, Batch, BatchAttempts, CatchUnwind, Range, RangeAttempts,
    };
    #[cfg(feature = "tch")]
    pub use crate::retry::{Chunked, ChunkedAttempts};
    pub use core::ops::ControlFlow;
    pub use core::panic::Location;
    #[cfg(feature = "tch")]
    pub use tch::Tensor;

    /// The parts of a cache key, one by one, for `benches/overhead.rs`.
    pub mod key_parts {
        /// The bounded stack walk behind `StacktraceMemory` keys.
        pub fn stack_hash() -> u64 {
            crate::hash::stack_hash()
        }
        /// The shared free-memory reading (up to a second old).
        pub fn free_memory_reading() -> (u64, Option<u64>) {
            crate::memory::free_memory_reading()
        }
    }
}
