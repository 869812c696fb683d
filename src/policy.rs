//! How the size moves: down after an out-of-memory, and (for [`Policy::grow`]) back up after
//! successes.

use crate::error::ConfigError;

/// How a retry picks its next size.
///
/// | policy | after an out-of-memory at `s` | after a success | trade-off |
/// |---|---|---|---|
/// | [`halve`](Policy::halve) (default, as Python toma) | `s / 2` | stays | fewest failed attempts; may end at half of what fits |
/// | [`factor(f)`](Policy::factor) | `⌊s·f⌋`, at least 1 below `s` | stays | ends closer to the limit (a batch of 65 that fails goes to 58 at 0.9, not 32), more failed attempts on the way down |
/// | [`grow`](Policy::grow) | halfway between the last success and `s` | probes halfway towards the last failure, or the cap | finds the largest size that fits (binary search), at the price of a failed probe now and then; remembers its bounds in the cache |
///
/// ```
/// use toma::{Batch, CacheKind, Policy};
/// let fits = |size: usize| if size > 60 { Err("CUDA out of memory.".to_string()) } else { Ok(size) };
/// assert_eq!(Batch::new(65).cache(CacheKind::None).run(fits), Ok(32));
/// assert_eq!(Batch::new(65).cache(CacheKind::None).policy(Policy::factor(0.9)).run(fits), Ok(58));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy(Kind);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Halve,
    Factor(f64),
    Grow { max: Option<usize> },
}

impl Default for Policy {
    fn default() -> Self {
        Policy::halve()
    }
}

impl Policy {
    /// `size / 2` after an out-of-memory: toma's behaviour, and the default.
    pub const fn halve() -> Self {
        Policy(Kind::Halve)
    }

    /// `⌊size · factor⌋` after an out-of-memory, always at least 1 smaller, so it never stalls.
    ///
    /// # Panics
    /// When `factor` is not strictly between 0 and 1; [`Policy::try_factor`] reports it instead.
    #[track_caller]
    pub fn factor(factor: f64) -> Self {
        Self::try_factor(factor).unwrap_or_else(|err| panic!("{err}"))
    }

    /// Like [`Policy::factor`], with a factor outside (0, 1) reported as an error.
    pub fn try_factor(factor: f64) -> Result<Self, ConfigError> {
        if factor > 0.0 && factor < 1.0 {
            Ok(Policy(Kind::Factor(factor)))
        } else {
            Err(ConfigError::InvalidFactor { factor })
        }
    }

    /// Halves after an out-of-memory like [`halve`](Policy::halve), then searches upward: each
    /// success moves halfway towards the smallest size that failed, or towards the initial size
    /// when none has. Within a range or chunked call the step grows between sub-ranges; across
    /// calls the cache keeps the bounds, so each call probes once until they meet.
    pub const fn grow() -> Self {
        Policy(Kind::Grow { max: None })
    }

    /// Like [`grow`](Policy::grow), searching up to `max` instead of the initial size.
    pub const fn grow_up_to(max: usize) -> Self {
        Policy(Kind::Grow { max: Some(max) })
    }

    /// Whether this policy searches upward after successes.
    pub fn grows(&self) -> bool {
        matches!(self.0, Kind::Grow { .. })
    }

    /// The largest size this policy will try, for a call starting at `initial`.
    pub(crate) fn cap(&self, initial: usize) -> usize {
        match self.0 {
            Kind::Grow { max: Some(max) } => max.max(1),
            _ => initial,
        }
    }

    /// The size after an out-of-memory at `failed` (≥ 2), knowing that `ok` worked (0: nothing
    /// known). Always in `1..failed`.
    pub(crate) fn shrink(&self, failed: usize, ok: usize) -> usize {
        debug_assert!(failed >= 2);
        let next = match self.0 {
            Kind::Halve => failed / 2,
            Kind::Factor(f) => (failed as f64 * f) as usize,
            Kind::Grow { .. } if ok > 0 && ok < failed => midpoint(ok, failed),
            Kind::Grow { .. } => failed / 2,
        };
        next.clamp(1, failed - 1)
    }

    /// The size to try after a success at `ok`, below `failed` (`usize::MAX`: none) and `cap`.
    pub(crate) fn after_success(&self, ok: usize, failed: usize, cap: usize) -> usize {
        if !self.grows() {
            return ok;
        }
        midpoint(ok, failed.min(cap.saturating_add(1)))
    }
}

/// Halfway from `lo` (works) towards `hi` (fails, or one past the cap); `lo` once they meet.
fn midpoint(lo: usize, hi: usize) -> usize {
    if hi > lo + 1 {
        lo + (hi - lo) / 2
    } else {
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shrink_always_goes_down_and_stays_positive() {
        for policy in [Policy::halve(), Policy::factor(0.9), Policy::factor(0.01), Policy::grow()] {
            for failed in 2..2000 {
                for ok in [0, 1, failed / 3, failed - 1, failed, failed + 5] {
                    let next = policy.shrink(failed, ok);
                    assert!((1..failed).contains(&next), "{policy:?} {failed} {ok} -> {next}");
                }
            }
        }
        assert_eq!(Policy::factor(0.9).shrink(65, 0), 58);
        assert_eq!(Policy::factor(0.9).shrink(5, 0), 4);
        assert_eq!(Policy::halve().shrink(65, 0), 32);
        assert_eq!(Policy::grow().shrink(64, 32), 48);
    }

    #[test]
    fn grow_searches_between_success_and_failure() {
        let g = Policy::grow();
        assert_eq!(g.after_success(32, 64, 1000), 48);
        assert_eq!(g.after_success(63, 64, 1000), 63);
        assert_eq!(g.after_success(100, usize::MAX, 100), 100);
        assert_eq!(g.after_success(50, usize::MAX, 100), 75);
        assert_eq!(Policy::grow_up_to(400).cap(100), 400);
        assert_eq!(Policy::halve().after_success(32, 64, 1000), 32);
    }

    #[test]
    fn bad_factors_are_errors() {
        for f in [0.0, 1.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
            assert!(Policy::try_factor(f).is_err(), "{f}");
        }
    }
}
