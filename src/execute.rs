//! Run a block at once with out-of-memory retries: the immediate form of the attributes.
//!
//! Each function is [`#[track_caller]`](https://doc.rust-lang.org/reference/attributes/codegen.html#the-track_caller-attribute):
//! the cache key is the line that calls it. They use the process default cache
//! ([`crate::set_default_cache`]); the builders ([`Batch`], [`Range`], [`Chunked`](crate::Chunked))
//! take a cache kind of their own.
//!
//! ```
//! let total: Result<usize, String> = toma::execute::batch(256, |batchsize| {
//!     if batchsize > 50 { return Err("CUDA out of memory. Tried to allocate 1 GiB".into()) }
//!     Ok(batchsize)
//! });
//! assert_eq!(total, Ok(32));
//! ```
//!
//! A closure that uses `?` must name its error type, since `?` converts into any error: end it
//! with `Ok::<_, E>(value)`. Without it, Rust stops at E0283 (`cannot satisfy _: OutOfMemory`).
//!
//! ```
//! # #[cfg(feature = "tch")] {
//! use tch::{Device, Kind, TchError, Tensor};
//! let sum = toma::execute::batch(64, |bs| {
//!     let ones = Tensor::f_ones([bs as i64, 8], (Kind::Float, Device::Cpu))?;
//!     Ok::<_, TchError>(ones.f_sum(Kind::Double)?.f_double_value(&[])?)
//! });
//! assert_eq!(sum.unwrap(), 64.0 * 8.0);
//! # }
//! ```

use crate::oom::OutOfMemory;
use crate::retry::{Batch, Range};

/// Runs `body(batchsize)` from `initial_batchsize`, halving on out-of-memory; see [`Batch::run`].
///
/// # Panics
/// When `initial_batchsize` is 0, and when the body panics with something that is not an
/// out-of-memory (or with an out-of-memory at batch size 1): that panic is resumed.
#[track_caller]
pub fn batch<T, E, F>(initial_batchsize: usize, body: F) -> Result<T, E>
where
    E: OutOfMemory,
    F: FnMut(usize) -> Result<T, E>,
{
    Batch::new(initial_batchsize).run(body)
}

/// Runs `body(start, end)` over `[start, end)` in sub-ranges of at most `initial_step`, halving
/// the step on out-of-memory; see [`Range::run`].
///
/// # Panics
/// When `initial_step` is 0 or `start > end`, and as [`batch`] for the body's panics.
#[track_caller]
pub fn range<E, F>(start: usize, end: usize, initial_step: usize, body: F) -> Result<(), E>
where
    E: OutOfMemory,
    F: FnMut(usize, usize) -> Result<(), E>,
{
    Range::new(start, end, initial_step).run(body)
}

/// Runs `body(chunk, start, end)` on chunks of `tensor` along dimension 0 of at most
/// `initial_step` rows, halving on out-of-memory; see [`Chunked::run`](crate::Chunked::run).
/// For another dimension use `Chunked::new(tensor, step).dimension(d).run(..)`.
///
/// # Panics
/// When `initial_step` is 0 or `tensor` is a scalar, and as [`batch`] for the body's panics.
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
#[track_caller]
pub fn chunked<E, F>(tensor: &tch::Tensor, initial_step: usize, body: F) -> Result<(), E>
where
    E: OutOfMemory,
    F: FnMut(tch::Tensor, usize, usize) -> Result<(), E>,
{
    crate::Chunked::new(tensor, initial_step).run(body)
}

/// Runs `body(start, end)` over `[start, end)` with the step sized from measured memory (the
/// free memory of each device in use, less 10%); see [`Range::auto`]. For a budget or other
/// options use the builder: `Range::auto(start, end).budget(bytes).run(..)`.
///
/// # Panics
/// When `start > end`, and as [`batch`] for the body's panics.
#[track_caller]
pub fn range_auto<E, F>(start: usize, end: usize, body: F) -> Result<(), E>
where
    E: OutOfMemory,
    F: FnMut(usize, usize) -> Result<(), E>,
{
    Range::auto(start, end).run(body)
}

/// Runs `body(chunk, start, end)` on chunks of `tensor` along dimension 0 with the step sized
/// from measured memory; see [`Chunked::auto`](crate::Chunked::auto).
///
/// # Panics
/// When `tensor` is a scalar, and as [`batch`] for the body's panics.
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
#[track_caller]
pub fn chunked_auto<E, F>(tensor: &tch::Tensor, body: F) -> Result<(), E>
where
    E: OutOfMemory,
    F: FnMut(tch::Tensor, usize, usize) -> Result<(), E>,
{
    crate::Chunked::auto(tensor).run(body)
}

/// [`range`] with its progress on stderr when stderr is a terminal (feature `progress`; see
/// [`Progress`](crate::Progress)). For other settings use the builder:
/// `Range::new(start, end, step).progress(Progress::Always).run(..)`.
///
/// # Panics
/// As [`range`].
#[track_caller]
pub fn range_with_progress<E, F>(start: usize, end: usize, initial_step: usize, body: F) -> Result<(), E>
where
    E: OutOfMemory,
    F: FnMut(usize, usize) -> Result<(), E>,
{
    Range::new(start, end, initial_step).progress(true).run(body)
}

/// [`chunked`] with its progress on stderr when stderr is a terminal (feature `progress`).
///
/// # Panics
/// As [`chunked`].
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
#[track_caller]
pub fn chunked_with_progress<E, F>(tensor: &tch::Tensor, initial_step: usize, body: F) -> Result<(), E>
where
    E: OutOfMemory,
    F: FnMut(tch::Tensor, usize, usize) -> Result<(), E>,
{
    crate::Chunked::new(tensor, initial_step).progress(true).run(body)
}
