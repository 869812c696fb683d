//! Configuration errors: the builders' `try_` forms return them, their plain forms panic with
//! their message.

/// A configuration that cannot run: returned by the builders' `try_` forms (and inside the
/// `io::Error` of a CPU cap), the message of the panic of their plain forms. See the crate
/// docs' "Bad input" section.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A size, step or byte count of 0 where at least 1 is needed: no attempt could ever run.
    #[error("toma: the {what} must be at least 1, got 0")]
    ZeroSize {
        /// What was 0: `"initial batch size"`, `"initial step"`, `"micro-batch size"`, ….
        what: &'static str,
    },
    /// A fraction outside the range it must lie in.
    #[error("toma: the {what} must lie in {range}, got {value}")]
    OutOfRange {
        /// What was set: `"safety margin"`, ….
        what: &'static str,
        /// The allowed range, as text (`"[0, 1)"`).
        range: &'static str,
        /// The value given.
        value: f64,
    },
    /// A CPU memory cap at or below what the process already uses: every later allocation
    /// would fail. Size it with [`CpuCap::set_headroom`](crate::cpu_memory::CpuCap::set_headroom).
    #[error(
        "toma: a CPU memory cap ({limit}) of {cap} bytes is at or below the {in_use} bytes this process \
         already uses; every allocation would fail (size it from CpuCap::in_use, or use CpuCap::set_headroom)"
    )]
    CapBelowUse {
        /// The kernel limit: `RLIMIT_AS` or `RLIMIT_DATA`.
        limit: &'static str,
        /// The cap asked for (after the hard limit).
        cap: u64,
        /// Bytes of that figure in use.
        in_use: u64,
    },
    /// A range whose start lies after its end.
    #[error("toma: range start {start} is after its end {end}")]
    StartAfterEnd {
        /// The range's start.
        start: usize,
        /// The range's end.
        end: usize,
    },
    /// A [`Policy::factor`](crate::Policy::factor) outside (0, 1): it would not shrink.
    #[error("toma: a shrink factor must be strictly between 0 and 1, got {factor}")]
    InvalidFactor {
        /// The factor asked for.
        factor: f64,
    },
    /// Caching-allocator settings libtorch would refuse (`PYTORCH_ALLOC_CONF`'s syntax:
    /// `key:value` pairs separated by commas).
    #[error("toma: libtorch would refuse the allocator settings `{settings}`: {reason}")]
    AllocatorSettings {
        /// The settings given.
        settings: String,
        /// Why, as libtorch's parser would say.
        reason: String,
    },
    /// A chunking dimension the tensor does not have.
    #[error("toma: dimension {dimension} is out of range for a tensor with {ndim} dimension(s)")]
    DimensionOutOfRange {
        /// The dimension asked for.
        dimension: i64,
        /// The number of dimensions the tensor has.
        ndim: usize,
    },
}

pub(crate) fn nonzero(size: usize, what: &'static str) -> Result<usize, ConfigError> {
    if size == 0 {
        Err(ConfigError::ZeroSize { what })
    } else {
        Ok(size)
    }
}
