//! What measurement found plans miss: the executor measures each micro-batch against its plan
//! where an allocator counts, and records the excess here; later plans of the same graph hold
//! it in reserve.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use tch::Device;

use super::compiled::Compiled;
use super::schedule::Mode;

/// A measurement this much over its plan raises the graph's correction.
const TOLERANCE: f64 = 1.02;
/// Graphs remembered at most: starting over costs one more measurement each.
const CAPACITY: usize = 4096;

/// The corrections of the process, by graph (its fingerprint), mode and device: the most bytes
/// per sample a micro-batch measured above its plan. The one owner of that state: plans read
/// it ([`of`](Self::of)), the executor records into it ([`record`](Self::record)).
pub(crate) struct Corrections {
    by_graph: Mutex<HashMap<u64, f64>>,
}

impl Corrections {
    /// The process's corrections.
    pub(crate) fn process() -> &'static Corrections {
        static PROCESS: OnceLock<Corrections> = OnceLock::new();
        PROCESS.get_or_init(|| Corrections { by_graph: Mutex::new(HashMap::new()) })
    }

    fn key(c: &Compiled, mode: Mode) -> u64 {
        let device = match c.device() {
            Device::Cuda(i) => i as u64 + 1,
            _ => 0,
        };
        crate::hash::mix(c.fingerprint ^ crate::hash::mix(device << 1 | mode as u64))
    }

    /// The bytes per sample this graph's plans add (0 until a run measured more than planned).
    pub(crate) fn of(&self, c: &Compiled, mode: Mode) -> f64 {
        let map = self.by_graph.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        map.get(&Self::key(c, mode)).copied().unwrap_or(0.0)
    }

    /// After a micro-batch of `b` samples: the allocator measured `measured` bytes above what
    /// was in use when it started, where the plan said `planned`. A measurement more than 2%
    /// over the plan raises the graph's correction to the excess per sample (what a hidden
    /// temporary of a per-sample op costs), so that later plans of the graph hold; returns the
    /// new correction when it changed.
    pub(crate) fn record(&self, c: &Compiled, mode: Mode, b: u64, planned: u64, measured: u64) -> Option<f64> {
        if (measured as f64) <= planned as f64 * TOLERANCE {
            return None;
        }
        let per_sample = (measured - planned) as f64 / b.max(1) as f64;
        let mut map = self.by_graph.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if map.len() >= CAPACITY {
            map.clear();
        }
        let slot = map.entry(Self::key(c, mode)).or_insert(0.0);
        (per_sample > *slot).then(|| {
            *slot = per_sample;
            per_sample
        })
    }
}
