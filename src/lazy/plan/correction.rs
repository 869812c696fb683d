//! What measurement found plans miss: the executor measures each micro-batch against its plan
//! where an allocator counts, and records the excess here; later plans of the same graph hold
//! it in reserve.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use tch::Device;

use super::compiled::Compiled;
use super::schedule::Mode;
use crate::lazy::cost::measured::{self, Measured};

/// A measurement this much over its plan raises the graph's correction.
const TOLERANCE: f64 = 1.02;
/// Graphs remembered at most: starting over costs one more measurement each.
const CAPACITY: usize = 4096;
/// Micro-batch sizes remembered per graph (each a bound; the oldest goes first).
const POINTS: usize = 8;

/// What earlier runs of one graph measured above their plans: the largest excess seen at each
/// micro-batch size. An excess is some fixed bytes (gradient buffers, a workspace) plus some per
/// sample (a hidden temporary), in unknown parts; each measurement bounds it at every size —
/// no more than itself at fewer samples, no more than in proportion at more — and the reserve
/// is the tightest of those bounds. A fixed excess is held whole when the search goes smaller,
/// a per-sample one grows with the micro-batch, and two sizes tell them apart.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Reserve {
    /// `(micro-batch, bytes above the plan)`.
    points: Vec<(u64, u64)>,
}

impl Reserve {
    /// The bytes to hold in reserve at micro-batch `b` (0 until a run measured more than
    /// planned).
    pub(crate) fn at(&self, b: u64) -> u64 {
        self.tightest(|seen, excess| if b <= seen { excess } else { scaled(excess, b, seen) })
    }

    /// The bytes at micro-batch `b` were every excess per-sample: the least a reserve can be,
    /// tried where the bound of [`at`](Self::at) leaves nothing that fits.
    pub(crate) fn proportional(&self, b: u64) -> u64 {
        self.tightest(|seen, excess| scaled(excess, b, seen))
    }

    /// The least of `bound(micro-batch, excess)` over the measurements (0 without any).
    fn tightest(&self, bound: impl Fn(u64, u64) -> u64) -> u64 {
        self.points.iter().map(|&(seen, excess)| bound(seen, excess)).min().unwrap_or(0)
    }

    /// Records `excess` at `b`; whether the reserve changed.
    pub(super) fn add(&mut self, b: u64, excess: u64) -> bool {
        match self.points.iter_mut().find(|(seen, _)| *seen == b) {
            Some((_, e)) if *e >= excess => false,
            Some((_, e)) => {
                *e = excess;
                true
            }
            None => {
                if self.points.len() >= POINTS {
                    self.points.remove(0);
                }
                self.points.push((b, excess));
                true
            }
        }
    }
}

/// `excess` measured at `seen` samples, in proportion at `b` (rounded up).
fn scaled(excess: u64, b: u64, seen: u64) -> u64 {
    (excess as u128 * b as u128).div_ceil(seen.max(1) as u128) as u64
}

/// The corrections of the process, by graph (its fingerprint), mode and device. The one owner
/// of that state: plans read it ([`of`](Self::of)), the executor records into it
/// ([`record`](Self::record)).
pub(crate) struct Corrections {
    by_graph: Mutex<HashMap<u64, Reserve>>,
    /// Where new measurements are appended, once [`remember_in`](Self::remember_in) was called.
    file: Mutex<Option<PathBuf>>,
}

/// What a correction was measured on, beside the graph and device in its key: libtorch's
/// release and its threads (kernels and their scratch change with both), the architecture with
/// the instruction set oneDNN uses and ATen's CPU capability (oneDNN's blocks follow it), and
/// the first CUDA card's multiprocessors and resident threads each (which size ATen's
/// reductions' staging; `none` without a card). A file's lines measured on something else are
/// not read.
fn machine() -> String {
    static GPU: OnceLock<String> = OnceLock::new();
    let gpu = GPU.get_or_init(|| match crate::memory::cuda_multiprocessors(0) {
        Some((sms, threads)) => format!("{sms}x{threads}"),
        None => "none".into(),
    });
    format!(
        "libtorch={} threads={} arch={}:{}:{} gpu={gpu}",
        option_env!("TOMA_LIBTORCH_VERSION").unwrap_or("unknown"),
        tch::get_num_threads(),
        std::env::consts::ARCH,
        crate::lazy::cost::machine::host_isa(),
        crate::lazy::cost::machine::aten_capability().to_ascii_lowercase()
    )
}

/// A file with more of this machine's lines than this, and more than twice what they hold after
/// reading, is rewritten with only what they hold (appending every change grows it forever).
const TRIM_ABOVE: usize = 4096;

/// One remembered measurement: `machine \t key \t micro-batch \t excess`.
fn line(machine: &str, key: u64, b: u64, excess: u64) -> String {
    format!("{machine}\t{key:016x}\t{b}\t{excess}\n")
}

/// Replaces the file at `path` by `trimmed`, unless it changed since it was read (`read` bytes
/// long then: another process appended): through a file of this process's own, renamed over it.
fn trim(path: &Path, read: u64, trimmed: &str) -> std::io::Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(".trim-{}", std::process::id()));
    let tmp = path.with_file_name(name);
    std::fs::write(&tmp, trimmed)?;
    let unchanged = std::fs::metadata(path).map(|m| m.len() == read).unwrap_or(false);
    let renamed = if unchanged { std::fs::rename(&tmp, path) } else { Ok(()) };
    if !unchanged || renamed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    renamed
}

/// The tag of a calibration's line: `machine \t calibration \t key \t figures`.
const CALIBRATION: &str = "calibration";

fn calibration_line(machine: &str, key: u64, m: &Measured) -> String {
    format!("{machine}\t{CALIBRATION}\t{key:016x}\t{}\n", m.to_line())
}

fn parse_calibration(line: &str, machine: &str) -> Option<(u64, Measured)> {
    let mut fields = line.split('\t');
    if fields.next()? != machine || fields.next()? != CALIBRATION {
        return None;
    }
    let key = u64::from_str_radix(fields.next()?, 16).ok()?;
    Some((key, Measured::from_line(fields.next()?)?))
}

fn parse(line: &str, machine: &str) -> Option<(u64, u64, u64)> {
    let mut fields = line.split('\t');
    if fields.next()? != machine {
        return None;
    }
    let key = u64::from_str_radix(fields.next()?, 16).ok()?;
    let b = fields.next()?.parse().ok()?;
    let excess = fields.next()?.parse().ok()?;
    Some((key, b, excess))
}

impl Corrections {
    /// The process's corrections.
    pub(crate) fn process() -> &'static Corrections {
        static PROCESS: OnceLock<Corrections> = OnceLock::new();
        PROCESS.get_or_init(Corrections::new)
    }

    fn new() -> Corrections {
        Corrections { by_graph: Mutex::new(HashMap::new()), file: Mutex::new(None) }
    }

    /// Reads what `path` remembers for this machine and appends every new measurement to it
    /// from now on; returns how many measurements were read. A missing file is created.
    pub(crate) fn remember_in(&self, path: &Path) -> std::io::Result<usize> {
        let machine = machine();
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let mut read = 0;
        // What the file holds for this machine, once each: the lines a trimmed file keeps.
        let mut kept: Vec<String> = Vec::new();
        let mut calibrations: HashMap<u64, Measured> = HashMap::new();
        {
            let mut map = self.by_graph.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            for line in text.lines() {
                if let Some((key, b, excess)) = parse(line, &machine) {
                    map.entry(key).or_default().add(b.max(1), excess);
                    read += 1;
                } else if let Some((key, m)) = parse_calibration(line, &machine) {
                    measured::insert(key, Some(m));
                    calibrations.insert(key, m);
                    read += 1;
                } else if !line.is_empty() {
                    // Another machine's, or a form this version does not read: kept as it is.
                    kept.push(line.to_owned());
                }
            }
            let held: usize = map.values().map(|r| r.points.len()).sum::<usize>() + calibrations.len();
            if read > TRIM_ABOVE && read > 2 * held {
                for (key, reserve) in map.iter() {
                    kept.extend(reserve.points.iter().map(|&(b, e)| line(&machine, *key, b, e).trim_end().to_owned()));
                }
                kept.extend(
                    calibrations.iter().map(|(key, m)| calibration_line(&machine, *key, m).trim_end().to_owned()),
                );
                let mut trimmed = kept.join("\n");
                trimmed.push('\n');
                if let Err(error) = trim(path, text.len() as u64, &trimmed) {
                    tracing::warn!(%error, path = %path.display(), "toma::lazy: could not trim the corrections file");
                }
            }
        }
        // Writable now, or an error now: not a warning at the first measurement.
        std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        *self.file.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(path.to_owned());
        Ok(read)
    }

    /// Appends one measurement to the file, if one was given (a failure is a warning: the
    /// process keeps its own corrections either way).
    fn append(&self, key: u64, b: u64, excess: u64) {
        self.write(&line(&machine(), key, b, excess));
    }

    /// Appends what calibration measured now to the file, if one was given.
    pub(crate) fn remember_calibrations(&self, measured: &[(u64, Measured)]) {
        if measured.is_empty() {
            return;
        }
        let machine = machine();
        let lines: String = measured
            .iter()
            .map(|(key, m)| format!("{machine}\t{CALIBRATION}\t{key:016x}\t{}\n", m.to_line()))
            .collect();
        self.write(&lines);
    }

    fn write(&self, lines: &str) {
        let file = self.file.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(path) = file.as_ref() else { return };
        let written =
            std::fs::OpenOptions::new().append(true).open(path).and_then(|mut f| f.write_all(lines.as_bytes()));
        if let Err(error) = written {
            tracing::warn!(%error, path = %path.display(), "toma::lazy: could not remember a correction");
        }
    }

    /// The graph, device and mode, and whether calibration priced any of its nodes: an excess
    /// over the rules' plan is not one over the measured plan.
    fn key(c: &Compiled, mode: Mode, calibrated: bool) -> u64 {
        let device = match c.device() {
            Device::Cuda(i) => i as u64 + 1,
            _ => 0,
        };
        let calibrated = u64::from(calibrated);
        crate::hash::mix(c.fingerprint ^ crate::hash::mix(device << 2 | calibrated << 1 | mode as u64))
    }

    /// What this graph's plans hold in reserve (`calibrated`: whether calibration priced any
    /// of its nodes).
    pub(crate) fn of(&self, c: &Compiled, mode: Mode, calibrated: bool) -> Reserve {
        let map = self.by_graph.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        map.get(&Self::key(c, mode, calibrated)).cloned().unwrap_or_default()
    }

    /// After a micro-batch of `b` samples: the allocator measured `measured` bytes above what
    /// was in use when it started, where the plan said `planned`. A measurement more than 2%
    /// over the plan is remembered, so that later plans of the graph hold; returns the reserve
    /// at `b` when it changed.
    pub(crate) fn record(
        &self,
        c: &Compiled,
        (mode, calibrated): (Mode, bool),
        b: u64,
        planned: u64,
        measured: u64,
    ) -> Option<u64> {
        if (measured as f64) <= planned as f64 * TOLERANCE {
            return None;
        }
        let mut map = self.by_graph.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if map.len() >= CAPACITY {
            map.clear();
        }
        let key = Self::key(c, mode, calibrated);
        let reserve = map.entry(key).or_default();
        let changed = reserve.add(b.max(1), measured - planned).then(|| reserve.at(b.max(1)));
        drop(map);
        if changed.is_some() {
            self.append(key, b.max(1), measured - planned);
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::Reserve;
    use std::path::Path;

    fn reserve(points: &[(u64, u64)]) -> Reserve {
        let mut r = Reserve::default();
        for &(b, e) in points {
            r.add(b, e);
        }
        r
    }

    /// One measurement bounds the excess at every size; two tell fixed from per-sample.
    #[test]
    fn a_reserve_never_falls_below_what_was_measured() {
        assert_eq!(Reserve::default().at(64), 0);
        let one = reserve(&[(8, 800)]);
        // Fewer samples: the excess may be fixed, so all of it is held.
        assert_eq!((one.at(1), one.at(8)), (800, 800));
        // More: at most in proportion.
        assert_eq!(one.at(16), 1600);
        // A fixed excess seen at two sizes is held whole at both and between.
        let fixed = reserve(&[(8, 800), (2, 800)]);
        assert_eq!((fixed.at(2), fixed.at(4), fixed.at(8), fixed.at(16)), (800, 800, 800, 1600));
        // A per-sample one shrinks with the micro-batch.
        let per_sample = reserve(&[(8, 800), (2, 200)]);
        assert_eq!((per_sample.at(1), per_sample.at(2), per_sample.at(4), per_sample.at(16)), (200, 200, 400, 1600));
        // A smaller excess at a size already seen changes nothing.
        let mut r = reserve(&[(8, 800)]);
        assert!(!r.add(8, 500));
        assert!(r.add(8, 900));
        assert_eq!(r.at(8), 900);
    }

    /// Measurements written to a file come back in another `Corrections` of the same machine,
    /// and lines of another machine are not read.
    #[test]
    #[cfg(feature = "tch")]
    fn a_remembered_file_brings_measurements_back() {
        use super::{line, machine, Corrections};
        let path = std::env::temp_dir().join(format!("toma-corrections-{}.txt", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let first = Corrections::new();
        assert_eq!(first.remember_in(&path).unwrap(), 0);
        first.append(42, 8, 800);
        first.append(42, 2, 200);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| {
                std::io::Write::write_all(&mut f, line("libtorch=0.0.0 threads=1 arch=x", 42, 4, 4000).as_bytes())
            })
            .unwrap();
        let second = Corrections::new();
        assert_eq!(second.remember_in(&path).unwrap(), 2, "this machine's two lines, not the other's");
        let map = second.by_graph.lock().unwrap();
        assert_eq!(map[&42], reserve(&[(8, 800), (2, 200)]));
        drop(map);
        assert!(machine().starts_with("libtorch="));
        let _ = std::fs::remove_file(&path);
        // A file grown past its bound by repeated measurements is rewritten with what it holds;
        // other machines' lines stay.
        let grown = std::env::temp_dir().join(format!("toma-corrections-grown-{}.txt", std::process::id()));
        let mut text = line("libtorch=0.0.0 threads=1 arch=x", 7, 4, 40);
        for excess in 0..(super::TRIM_ABOVE as u64 + 10) {
            text.push_str(&line(&machine(), 9, 2, excess));
        }
        std::fs::write(&grown, text).unwrap();
        assert_eq!(Corrections::new().remember_in(&grown).unwrap(), super::TRIM_ABOVE + 10);
        let trimmed = std::fs::read_to_string(&grown).unwrap();
        assert_eq!(trimmed.lines().count(), 2, "{trimmed}");
        assert!(trimmed.contains(&line(&machine(), 9, 2, super::TRIM_ABOVE as u64 + 9)));
        let again = Corrections::new();
        assert_eq!(again.remember_in(&grown).unwrap(), 1);
        assert_eq!(again.by_graph.lock().unwrap()[&9], reserve(&[(2, super::TRIM_ABOVE as u64 + 9)]));
        let _ = std::fs::remove_file(&grown);
        // A path that cannot be written is an error at once.
        assert!(Corrections::new().remember_in(Path::new("/nonexistent-dir/x/corrections.txt")).is_err());
    }
}
