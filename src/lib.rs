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
//! - Attributes: [`batch`], [`range`], [`chunked`] (feature `macros`, on `fn` and `async fn`).
//! - Immediate blocks: [`execute::batch`], [`execute::range`], [`execute::chunked`].
//! - Builders the two lower to: [`Batch`], [`Range`], [`Chunked`]; how sizes move: [`Policy`];
//!   what a call did: [`Report`].
//! - What counts as an out-of-memory: [`OutOfMemory`], decided in [`oom::is_out_of_memory_message`].
//! - Caches: [`CacheKind`], [`set_default_cache`], module [`cache`].
//! - Memory: [`memory`] (CUDA and CPU free memory, libtorch's allocators), [`cpu_memory`] (CPU
//!   caps: `RLIMIT_AS`, `RLIMIT_DATA`; the same module as `memory::cpu`).
//!
//! ## Features
//! - `tch` (default): `OutOfMemory for tch::TchError`, [`Chunked`], [`execute::chunked`].
//! - `cuda` (default): CUDA free memory through the driver, loaded at run time.
//! - `macros` (default): the attributes.
//! - `progress`: a progress bar on stderr for `range` and `chunked` calls that ask for one
//!   ([`Range::progress`], `progress = true` on the attributes); see [`Progress`].
//! - `anyhow`: `OutOfMemory for anyhow::Error`.
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
//! `tracing_subscriber::fmt().with_env_filter(EnvFilter::from_default_env()).init()`.
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
