//! `TOMA_PLAN_SNAPSHOT=<file>`: every compiled graph's schedules, appended to the file, to show
//! that a change to the planner's code leaves its plans byte-identical (DEVELOPERS.md,
//! `scripts/plan-snapshot.sh`).

use std::io::Write;
use std::sync::{Mutex, OnceLock};

use super::compiled::Compiled;
use super::schedule::{Mode, Schedule, Step};
use crate::lazy::cost::measured::Calibrated;

fn file() -> Option<&'static Mutex<std::fs::File>> {
    static FILE: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = std::env::var_os("TOMA_PLAN_SNAPSHOT")?;
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path).ok()?;
        Some(Mutex::new(file))
    })
    .as_ref()
}

/// One line per graph: its structure, then for both modes and several micro-batches the
/// resolved peak and every step's bytes.
pub(super) fn write(c: &Compiled) {
    let Some(file) = file() else { return };
    let mut line = String::new();
    for (i, node) in c.nodes.iter().enumerate() {
        let inputs: Vec<usize> = c.inputs(i).collect();
        line.push_str(&format!(
            "{}{:?}{:?}{:?}{:?}{:?};",
            node.name(),
            node.meta.shape,
            node.meta.kind,
            node.meta.device,
            node.meta.flow,
            inputs
        ));
    }
    let structure = crate::hash::hash_bytes(0, line.as_bytes());
    let n = c.batch.max(1) as u64;
    let mut sizes: Vec<u64> =
        [1, 2, 3, 4, 7, 8, 16, n / 2, n.saturating_sub(1), n].into_iter().filter(|&b| b >= 1 && b <= n).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut out = format!("{structure:016x} n={n} ops={}", c.len());
    for mode in [Mode::Forward, Mode::Backward] {
        // Rules only: what a snapshot compares is the planner, not this machine's measurements.
        let rules = Calibrated::empty(mode == Mode::Backward);
        let schedule = Schedule::build(c, mode, &rules);
        for &b in &sizes {
            let mut steps: Vec<Step> = Vec::new();
            schedule.eval(b, Some(&mut steps));
            let peak = schedule.peak_at(c, b);
            let mut h = 0u64;
            for s in &steps {
                h = crate::hash::mix(h ^ crate::hash::mix(s.node as u64 ^ (s.phase as u64) << 40));
                h = crate::hash::mix(h ^ s.bytes);
                h = crate::hash::mix(h ^ s.during);
                h = crate::hash::mix(h ^ s.live);
            }
            out.push_str(&format!(" {mode:?}@{b}={peak}/{h:016x}"));
        }
    }
    out.push('\n');
    let mut f = file.lock().unwrap_or_else(|p| p.into_inner());
    let _ = f.write_all(out.as_bytes());
}
