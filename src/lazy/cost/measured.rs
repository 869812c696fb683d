//! The measured model: what a kernel call takes, measured where no validated rule prices it.
//!
//! A calibrating plan ([`Calibrate`]) runs each such node alone on stand-in inputs (the real
//! inputs and parameters where the node reads them, ones or zeros of the recorded shape and
//! layout elsewhere) at 1, 2, 8, 32 and 128 samples below its batch, each power of two above
//! 128 below it, and at the batch, under the allocator counter,
//! and prices the node by what the counter saw, in the terms the schedule adds: what the op
//! keeps for its backward, its scratch while it runs, and its backward's scratch beside the
//! output's gradient and the input gradients. The two largest sizes give a line (fixed + per
//! sample); one sample may run another kernel and is kept apart. Measurements last for the
//! process, keyed by the node's op, the settings its kernel calls name, shapes (the batch size
//! aside), layouts, kinds, device, mode and libtorch's threads; a plan finds them again at the
//! cost of a hash.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tch::{Device, Tensor};

use super::work::Curve;
use super::{CostModel, Price, Work};
use crate::lazy::graph::{KernelCall, Meta, Node, RunCx};
use crate::lazy::options::Calibrate;
use crate::lazy::shape;
use crate::memory::PeakCounter;

/// Micro-batch sizes a call is measured at below its batch, and the batch itself: kernels split
/// a batch among threads differently at a few samples than at many, so the line is drawn
/// through the two largest (a strided convolution's backward at 32 samples was 22% above the
/// line through 2 and 8; an inner-product convolution at 256 was 12% below the line through 8
/// and 32). The batch itself is measured above 128 too: oneDNN's AMX kernels pad the rows of a
/// `BFloat16` product to their tiles, and a linear's backward at 257 rows took 16% more than
/// the line through 64 and 128 (an MLP's autocast step was planned 7.4% under).
const SIZES: [i64; 5] = [1, 2, 8, 32, 128];
/// Measurements kept at most: starting over costs one more measurement each.
const CAPACITY: usize = 16384;

/// What one node was measured to take, in the schedule's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Measured {
    /// Kept by autograd until the node's backward, beyond its inputs and output.
    pub(crate) kept: Work,
    /// Scratch while the node runs.
    pub(crate) forward: Work,
    /// Scratch while its backward runs, beside the output's gradient and the input gradients.
    pub(crate) backward: Work,
    /// The fewest samples at which the call alone was seen, or foreseen from the sizes below,
    /// to take more than the budget it was measured under: no step runs that many samples of
    /// it within that budget, whatever the line through the sizes measured says.
    pub(crate) limit: Option<u64>,
}

impl Measured {
    /// `price` with what was measured in place of the rules' figures. The measurement holds
    /// everything the call took (on CUDA, the reductions' staging buffers too).
    pub(crate) fn price(&self, price: Price, training: bool) -> Price {
        if training {
            // A run without autograd (a recomputing plan's first pass) makes at most what
            // autograd would keep, and frees it as the node returns.
            Price {
                kept: self.kept,
                unsaved: self.kept,
                forward: self.forward,
                backward: self.backward,
                staged: Vec::new(),
            }
        } else {
            // Without autograd nothing is kept for a backward: what outlived the call is held
            // while it runs, at least.
            Price { unsaved: Work::ZERO, forward: self.forward.plus(self.kept), staged: Vec::new(), ..price }
        }
    }

    /// The figures, for a file: kept, forward, backward, each `per fixed single`, then the
    /// number of its curve's points and the points, `size bytes` each.
    pub(crate) fn to_line(self) -> String {
        let w = |w: Work| {
            let points = w.curve.map_or(&[][..], |c| c.points());
            let mut text = format!("{} {} {} {}", w.per, w.fixed, w.single, points.len());
            for (b, m) in points {
                text.push_str(&format!(" {b} {m}"));
            }
            text
        };
        format!("{} {} {}", w(self.kept), w(self.forward), w(self.backward))
    }

    /// A line of [`to_line`](Self::to_line)'s, or of its nine figures without curves (files
    /// written before curves were kept).
    pub(crate) fn from_line(line: &str) -> Option<Measured> {
        let v: Vec<u64> = line.split(' ').map(|x| x.parse().ok()).collect::<Option<_>>()?;
        if v.len() == 9 {
            let w = |k: usize| Work { single: v[k + 2], ..Work::line(v[k], v[k + 1]) };
            return Some(Measured { kept: w(0), forward: w(3), backward: w(6), limit: None });
        }
        let mut at = 0;
        let mut next = || {
            let (head, rest) = (v.get(at..at + 4)?, at + 4);
            let n = usize::try_from(head[3]).ok()?;
            let pairs = v.get(rest..rest.checked_add(n.checked_mul(2)?)?)?;
            at = rest + 2 * n;
            let points: Vec<(u64, u64)> = pairs.chunks(2).map(|p| (p[0], p[1])).collect();
            let curve = if points.is_empty() { None } else { Curve::intern(points) };
            Some(Work { single: head[2], curve, ..Work::line(head[0], head[1]) })
        };
        let (kept, forward, backward) = (next()?, next()?, next()?);
        (at == v.len()).then_some(Measured { kept, forward, backward, limit: None })
    }
}

/// What calibration did for a plan ([`Calibrate`]): kernel calls measured for it, found
/// measured earlier, and left to their rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Calibration {
    /// Calls measured for this plan (each alone, at 1, 2, 8, 32 and 128 samples below its batch,
    /// each power of two from 256 below it, and at the batch).
    pub measured: usize,
    /// Calls measured earlier in the process, or read from a remembered file.
    pub remembered: usize,
    /// Calls that wanted measuring and were not: no allocator counts (the CPU's until
    /// [`track_cpu_allocations`](crate::memory::track_cpu_allocations)), or the call failed on
    /// stand-in inputs. Their rules price them.
    pub unmeasured: usize,
    /// Why the first unmeasured call was not measured.
    pub why_unmeasured: Option<String>,
    /// The op of the first unmeasured call.
    pub first_unmeasured: Option<String>,
    /// Of the unmeasured calls, those never tried: a plan runs nothing, and a calibration or
    /// the first step would measure them.
    pub awaiting: usize,
    /// Calls priced by rules read on exactly this machine, not measured
    /// ([`CpuMachine::rules_read_on`](crate::lazy::CpuMachine::rules_read_on)).
    pub by_rules: usize,
    /// The CPU the plan priced for (`None` on CUDA).
    pub machine: Option<crate::lazy::CpuMachine>,
    /// What measuring took for this plan.
    pub elapsed: Duration,
}

impl Calibration {
    /// Whether calibration measured, found, missed or left to rules anything (whether a plan
    /// mentions it).
    pub fn is_empty(&self) -> bool {
        self.measured + self.remembered + self.unmeasured + self.by_rules == 0
    }
}

/// One graph's calibration: the measured price of each node that has one.
#[derive(Debug)]
pub(crate) struct Calibrated {
    pub(crate) summary: Calibration,
    /// `(node position, measured)`, by position (shared by the plans of one graph).
    by_node: Rc<[(u32, Measured)]>,
    training: bool,
    /// What was measured now, by key: what a file of corrections remembers.
    pub(crate) new: Vec<(u64, Measured)>,
    /// Whether a measurement was cut short by the budget: kept for this plan only.
    short: bool,
}

impl Calibrated {
    pub(crate) fn training(&self) -> bool {
        self.training
    }

    /// The fewest samples some measured call alone takes more than the budget at
    /// ([`Measured::limit`]): no micro-batch of that many fits.
    pub(crate) fn limit(&self) -> Option<u64> {
        self.by_node.iter().filter_map(|(_, m)| m.limit).min()
    }

    /// `(node position, measured)` for each node with a measured price, by position.
    pub(crate) fn by_node(&self) -> &[(u32, Measured)] {
        &self.by_node
    }
}

/// Measurements by key (keys are mixed already: no hashing again).
type Table = HashMap<u64, Option<Measured>, BuildHasherDefault<crate::hash::PassThrough>>;

/// The process's measurements, by key; `None`: the call failed on stand-in inputs.
fn table() -> &'static Mutex<Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(Table::default()))
}

fn lookup(key: u64) -> Option<Option<Measured>> {
    table().lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get(&key).copied()
}

/// Records a measurement (made now, or read from a file).
pub(crate) fn insert(key: u64, measured: Option<Measured>) {
    let mut table = table().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if table.len() >= CAPACITY {
        table.clear();
    }
    table.insert(key, measured);
}

/// What identifies a node's measurement: its op and settings, the shapes (batch size aside),
/// layouts, kinds and flows of its output and inputs, the mode, device and threads.
fn key<'a>(node: &'a Node, training: bool, threads: u64, calls: &mut Vec<KernelCall<'a>>) -> u64 {
    use crate::hash::mix;
    let shapes = *node.calibration_key.get_or_init(|| {
        let device = match node.meta.device {
            Device::Cuda(i) => i as u64 + 1,
            _ => 0,
        };
        let mut h = crate::hash::hash_bytes(node.facts.sizing, node.name().as_bytes());
        h = mix(h ^ (device << 24));
        // What the rules see of the op's settings (a loss's flags change its temporaries; a
        // convolution's padding, its kernel), so that two ops alike in shapes stay apart.
        calls.clear();
        node.kernels(calls);
        for call in calls.iter() {
            h = mix(h ^ crate::hash::hash_of(call));
        }
        // Measured up to a batch below the largest usual size: a line no larger batch may
        // reuse. Above it the batch is a size of its own ([`extra_key`]).
        h = mix(h ^ batch(node).map_or(1, |n| n.min(USUAL_LARGEST)) as u64);
        for meta in std::iter::once(&node.meta).chain(node.inputs.iter().map(|x| &x.meta)) {
            let bd = meta.batch();
            let flags = u64::from(meta.requires_grad) | u64::from(meta.alias) << 1;
            h = mix(h ^ meta.kind as u64 ^ flags << 8 ^ bd.map_or(0, |bd| bd.dim as u64 + 1) << 16);
            // The layout as stand-ins make it: the order of the strides and the broadcast ones
            // (their values grow with the batch where it is not the outermost dimension).
            for (d, (&s, &st)) in meta.shape.iter().zip(&meta.strides).enumerate() {
                let s = match bd {
                    Some(bd) if bd.dim == d => bd.factor,
                    _ => s,
                };
                let outer = meta.strides.iter().filter(|&&o| o > st).count() as u64;
                h = mix(mix(h ^ s as u64) ^ outer ^ u64::from(st == 0) << 32);
            }
        }
        h
    });
    mix(shapes ^ u64::from(training) ^ (threads << 8))
}

/// Graphs calibrated lately on this thread, by structure, mode, threads and `how`: a graph
/// planned again, or recorded anew by the next step of a training loop, is found whole at the
/// cost of one lookup.
const RECENT: usize = 64;

thread_local! {
    static CALIBRATED: std::cell::RefCell<Vec<(u64, Rc<Calibrated>)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Measures what `nodes` need measured under `how`, or finds it measured; `structure` is the
/// hash of the graph's ops, shapes and wiring that plans key on, `model` says which calls its
/// rules were validated for. Without `measure`, only finds: nothing runs, and what was never
/// measured is counted unmeasured, with the reason.
#[allow(clippy::too_many_arguments)]
pub(crate) fn calibrate(
    nodes: &[Rc<Node>],
    structure: u64,
    model: &CostModel,
    training: bool,
    how: Calibrate,
    measure: bool,
    room: u64,
    also: &[u64],
) -> Rc<Calibrated> {
    if how == Calibrate::Never || nodes.is_empty() {
        return Rc::new(Calibrated::empty(training));
    }
    let threads = tch::get_num_threads().max(0) as u64;
    let trusted = super::machine::rules_trusted();
    let graph = crate::hash::mix(
        structure ^ u64::from(training) << 62 ^ (threads << 48) ^ (how as u64) << 60 ^ u64::from(trusted) << 58,
    ) ^ also.iter().filter(|&&b| b > 0).fold(0, |h, &b| crate::hash::mix(h ^ b));
    let recent = CALIBRATED.with(|c| c.borrow().iter().find(|(k, _)| *k == graph).map(|(_, cal)| cal.clone()));
    if let Some(cal) = recent {
        // Found whole: what it measured is measured earlier now.
        let found = cal.summary.measured + cal.summary.remembered;
        let summary = Calibration { measured: 0, remembered: found, elapsed: Duration::ZERO, ..cal.summary.clone() };
        return Rc::new(Calibrated { summary, by_node: cal.by_node.clone(), training, new: Vec::new(), short: false });
    }
    let cal = Rc::new(measure_graph(nodes, model, training, how, threads, measure, room, also));
    // Graphs whose calls could not all be measured, or were measured only up to the budget,
    // are tried again (a counter may start; a plan may have more room).
    if cal.summary.unmeasured == 0 && !cal.short {
        CALIBRATED.with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= RECENT {
                c.remove(0);
            }
            c.push((graph, cal.clone()));
        });
    }
    cal
}

impl Calibrated {
    /// Nothing measured: every node priced by its rules.
    pub(crate) fn empty(training: bool) -> Calibrated {
        Calibrated { summary: Calibration::default(), by_node: Rc::new([]), training, new: Vec::new(), short: false }
    }
}

#[allow(clippy::too_many_arguments)]
fn measure_graph(
    nodes: &[Rc<Node>],
    model: &CostModel,
    training: bool,
    how: Calibrate,
    threads: u64,
    may_measure: bool,
    room: u64,
    also: &[u64],
) -> Calibrated {
    let mut cal = Calibrated::empty(training);
    let mut by_node = Vec::new();
    let mut calls: Vec<KernelCall<'_>> = Vec::new();
    let mut wanted = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        if node.is_source() {
            continue;
        }
        let known = node.facts.kernels_known;
        calls.clear();
        node.kernels(&mut calls);
        node.note_kernel_calls(!calls.is_empty());
        if known && calls.is_empty() {
            continue;
        }
        let wants = how == Calibrate::Always || !known || calls.iter().any(|call| !model.validated(call));
        if wants {
            wanted.push(i);
        } else {
            cal.summary.by_rules += 1;
        }
    }
    cal.summary.machine = model.cpu_machine();
    if wanted.is_empty() {
        return cal;
    }
    let device = match nodes.last().map(|x| x.meta.device) {
        Some(Device::Cuda(i)) => Some(i),
        _ => None,
    };
    // The thread's own count where it has one: another thread's work at the same time is not
    // this call's (two threads calibrating at once planned +304% and +26% otherwise).
    let own = if may_measure { PeakCounter::own(device) } else { None };
    let counter = own.as_ref().map(|(c, _)| *c);
    let started = Instant::now();
    let mut generator = None;
    // Found ones are read under one lock; the others are measured without it.
    // A plan that runs nothing takes a measurement without the sizes `also` adds where there is
    // none with them (measured before the micro-batch was asked for).
    let known: Vec<(u64, Option<Option<Measured>>)> = {
        let table = table().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        wanted
            .iter()
            .map(|&i| {
                let base = key(&nodes[i], training, threads, &mut calls);
                let key = base ^ extra_key(&nodes[i], also);
                let found =
                    table.get(&key).copied().or_else(|| (!may_measure).then(|| table.get(&base).copied()).flatten());
                (key, found)
            })
            .collect()
    };
    for (i, (key, known)) in wanted.into_iter().zip(known) {
        let node = &nodes[i];
        let known = if known.is_none() { lookup(key) } else { known };
        // Measured up to this budget before (a training loop under one budget): found there.
        let short_key = crate::hash::mix(key ^ room.rotate_left(17) ^ 0x5f0e7);
        let known = match known {
            None => match lookup(short_key) {
                Some(Some(m)) => {
                    cal.short = true;
                    Some(Some(m))
                }
                _ => None,
            },
            known => known,
        };
        // A plan that runs nothing prices what was measured of this call at other batches
        // where its own batch was not: the usual sizes' line reaches it. A step measures it
        // there, so this graph's calibration is not kept whole.
        let known = match known {
            None if !may_measure => {
                let priced = from_points(node, base_key(node, training, threads), also);
                cal.short |= priced.is_some();
                priced.map(Some)
            }
            known => known,
        };
        let found = match known {
            Some(Some(m)) => {
                cal.summary.remembered += 1;
                Some(m)
            }
            Some(None) => {
                cal.summary.why_unmeasured.get_or_insert_with(|| format!("{} failed on stand-in inputs", node.name()));
                None
            }
            None => {
                let Some(counter) = counter else {
                    cal.summary.unmeasured += 1;
                    cal.summary.first_unmeasured.get_or_insert_with(|| node.name().to_string());
                    if !may_measure {
                        cal.summary.awaiting += 1;
                        cal.summary.why_unmeasured.get_or_insert_with(|| {
                            if PeakCounter::for_device(device).is_some() {
                                "a plan runs nothing: LazyTensor::calibrate, or the first step, measures it".into()
                            } else {
                                "no allocator counts, so nothing can measure it: call \
                                 toma::memory::track_cpu_allocations() early, then LazyTensor::calibrate"
                                    .into()
                            }
                        });
                        continue;
                    }
                    cal.summary.why_unmeasured.get_or_insert_with(|| {
                        "no allocator counts: call toma::memory::track_cpu_allocations() to measure CPU kernels".into()
                    });
                    continue;
                };
                // Random ops draw from libtorch's generator: the step must draw what it would
                // have drawn without calibration. Without the shim it cannot be restored, and
                // nothing is measured.
                let state = generator.get_or_insert_with(|| crate::memory::generator_state(device).ok());
                if state.is_none() {
                    cal.summary.unmeasured += 1;
                    cal.summary.first_unmeasured.get_or_insert_with(|| node.name().to_string());
                    cal.summary.why_unmeasured.get_or_insert_with(|| {
                        "the libtorch shim is not built: libtorch's generator could not be restored".into()
                    });
                    continue;
                }
                let result = catch_unwind(AssertUnwindSafe(|| {
                    measure(node, base_key(node, training, threads), counter, training, model.block(), room, also)
                }))
                .unwrap_or_else(|_| Err("it panicked".into()));
                match result {
                    Ok((m, true)) => {
                        tracing::debug!(op = node.name(), key, ?m, "toma::lazy: measured a kernel call");
                        cal.summary.measured += 1;
                        cal.new.push((key, m));
                        insert(key, Some(m));
                        Some(m)
                    }
                    Ok((m, false)) => {
                        // Cut short by the budget: it prices this plan, and is measured whole
                        // when a plan with more room asks for it.
                        tracing::debug!(
                            op = node.name(),
                            key,
                            ?m,
                            "toma::lazy: measured a kernel call up to the budget"
                        );
                        cal.summary.measured += 1;
                        cal.short = true;
                        cal.new.push((short_key, m));
                        insert(short_key, Some(m));
                        Some(m)
                    }
                    Err(why) => {
                        tracing::debug!(op = node.name(), %why, "toma::lazy: could not measure a kernel call");
                        // An out-of-memory may pass: only a call that fails otherwise is not
                        // tried again.
                        if !crate::oom::is_out_of_memory_message(&why) {
                            insert(key, None);
                        }
                        cal.summary
                            .why_unmeasured
                            .get_or_insert_with(|| format!("{} on stand-in inputs: {why}", node.name()));
                        None
                    }
                }
            }
        };
        match found {
            Some(m) => by_node.push((i as u32, m)),
            None => {
                cal.summary.unmeasured += 1;
                cal.summary.first_unmeasured.get_or_insert_with(|| node.name().to_string());
            }
        }
    }
    if let Some(Some(state)) = generator {
        if let Err(error) = crate::memory::set_generator_state(device, &state) {
            tracing::warn!(%error, "toma::lazy: calibration could not restore libtorch's generator");
        }
    }
    if cal.summary.measured > 0 {
        cal.summary.elapsed = started.elapsed();
    }
    drop(own);
    cal.by_node = by_node.into();
    cal
}

/// What one node takes at one micro-batch size: kept, forward scratch, backward scratch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Point {
    kept: u64,
    forward: u64,
    backward: u64,
}

/// The batch of `node`'s values, if it has one.
fn batch(node: &Node) -> Option<i64> {
    std::iter::once(&node.meta)
        .chain(node.inputs.iter().map(|x| &x.meta))
        .filter_map(|m| m.batch().map(|bd| bd.size.max(1)))
        .max()
}

/// The largest of the usual [`SIZES`].
const USUAL_LARGEST: i64 = SIZES[SIZES.len() - 1];

/// The largest size `node` is measured at: its batch (plans never go past it).
fn largest_size(node: &Node) -> i64 {
    batch(node).unwrap_or(1)
}

/// [`key`] of a node already keyed: the usual sizes' key, which its sizes' points are cached by.
fn base_key(node: &Node, training: bool, threads: u64) -> u64 {
    key(node, training, threads, &mut Vec::new())
}

/// The sizes `node` is measured at: [`SIZES`] below its batch, the powers of two above them
/// below it, the batch, and the sizes of
/// `also` below it (a micro-batch asked for and its remainder: kernels' scratch need not be a
/// line between the sizes measured).
/// `[1]` for a node without a batch.
fn sizes(node: &Node, also: &[u64]) -> Vec<i64> {
    let Some(n) = batch(node) else { return vec![1] };
    let mut sizes: Vec<i64> = SIZES.iter().copied().filter(|&b| b < n).collect();
    // Above the usual sizes, each power of two a budget's search may choose (256, 512, ..).
    sizes.extend((1..).map(|k| USUAL_LARGEST << k).take_while(|&b| b < n));
    sizes.push(largest_size(node));
    sizes.extend(also.iter().map(|&b| b as i64).filter(|&b| b > 1 && b < largest_size(node)));
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// What a node's key adds to [`key`] for the sizes beyond the usual ones ([`sizes`]): its batch
/// above the largest usual size, and the sizes `also` adds. Each size's point is measured once
/// ([`point_table`]): a batch of another size above the usual ones costs one more point.
fn extra_key(node: &Node, also: &[u64]) -> u64 {
    let Some(n) = batch(node) else { return 0 };
    let ours = |b: &&u64| **b > 1 && (**b as i64) <= n && !SIZES.contains(&(**b as i64));
    let h = also.iter().filter(ours).fold(0, |h, &b| crate::hash::mix(h ^ b ^ 0x616c_736f));
    if n > USUAL_LARGEST {
        crate::hash::mix(h ^ n as u64 ^ 0x6261_7463)
    } else {
        h
    }
}

/// Points measured, by [`base_key`] and size: what one size of one call took, found again when
/// another batch or micro-batch of the same call wants it.
type Points = HashMap<u64, (Point, u64), BuildHasherDefault<crate::hash::PassThrough>>;

fn point_table() -> &'static Mutex<Points> {
    static TABLE: OnceLock<Mutex<Points>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(Points::default()))
}

fn point_key(base: u64, b: u64) -> u64 {
    crate::hash::mix(base ^ b.rotate_left(40) ^ 0x706f_696e)
}

/// What the points measured of `node` at its [`sizes`] price it at, where every usual size
/// below its batch was measured (at another batch of the same call).
fn from_points(node: &Node, base: u64, also: &[u64]) -> Option<Measured> {
    let table = point_table().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let n = batch(node)?;
    let mut points = Vec::new();
    for b in sizes(node, also) {
        match table.get(&point_key(base, b as u64)) {
            Some((p, _)) => points.push((b as u64, *p)),
            None if SIZES.contains(&b) || b == n.min(USUAL_LARGEST) => return None,
            None => {}
        }
    }
    drop(table);
    Some(price_points(&points))
}

/// What `b` samples of the call keyed `base` took, if measured before.
fn cached_point(base: u64, b: u64) -> Option<(Point, u64)> {
    point_table().lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get(&point_key(base, b)).copied()
}

/// [`probe_alone`] at `b` samples, or what it measured there before.
fn point(
    node: &Node,
    base: u64,
    b: i64,
    counter: PeakCounter,
    training: bool,
    block: u64,
) -> Result<(Point, u64), String> {
    let key = point_key(base, b as u64);
    if let Some(found) = cached_point(base, b as u64) {
        return Ok(found);
    }
    let measured = probe_alone(node, b, counter, training, block)?;
    let mut table = point_table().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if table.len() >= CAPACITY {
        table.clear();
    }
    table.insert(key, measured);
    Ok(measured)
}

/// Measures `node` alone at each of its [`sizes`], and fits the line; where the line misses a
/// size (threads split a few samples otherwise than many; a kernel's workspace stops growing),
/// every power of two between 2 and the largest size is measured too, and the price follows
/// the measurements between them: the sizes a budget chooses between are priced as measured.
///
/// Measuring is part of the step and held to its budget: a size whose stand-ins and run would
/// take more than `room` (foreseen from the last size, in proportion to the samples) is not
/// measured, nor is any above one that ran out of memory; the line through the sizes measured
/// prices the rest. A first step then peaks within its budget, calibration included (a CNN at
/// 0.6× its eager peak took 1.84× the budget when calibration measured at the whole batch).
fn measure(
    node: &Node,
    base: u64,
    counter: PeakCounter,
    training: bool,
    block: u64,
    room: u64,
    also: &[u64],
) -> Result<(Measured, bool), String> {
    let wanted = sizes(node, also);
    let largest_wanted = wanted.last().copied().unwrap_or(1) as u64;
    let mut points = Vec::with_capacity(SIZES.len() + 3);
    // `(samples, bytes taken)` of the last two sizes measured.
    let (mut prev, mut last) = (None::<(u64, u64)>, None::<(u64, u64)>);
    // Past the room (or an out-of-memory), only sizes measured before are taken: they cost
    // nothing now.
    let mut limit = None;
    for b in wanted {
        let b = b as u64;
        if let Some(found) = cached_point(base, b) {
            points.push((b, found.0));
            (prev, last) = (last, Some((b, found.1)));
            if found.1 > room {
                limit = limit.or(Some(b));
            }
            continue;
        }
        if limit.is_some() {
            continue;
        }
        if let Some((b_last, took)) = last {
            // Foreseen by the last two sizes' slope where there are two (what a call holds is
            // mostly its weights' copies and gradients, the same at every size), else in
            // proportion to the samples.
            let foreseen = match prev {
                Some((b_prev, took_prev)) if b_last > b_prev => {
                    took + took.saturating_sub(took_prev).div_ceil(b_last - b_prev) * (b - b_last)
                }
                _ => took.saturating_mul(b) / b_last.max(1),
            };
            if foreseen > room {
                tracing::debug!(
                    op = node.name(),
                    samples = b,
                    room,
                    "toma::lazy: a size calibration's room cannot hold"
                );
                limit = Some(b);
                continue;
            }
        }
        match point(node, base, b as i64, counter, training, block) {
            Ok((point, took)) => {
                points.push((b, point));
                (prev, last) = (last, Some((b, took)));
            }
            Err(why) if !points.is_empty() && crate::oom::is_out_of_memory_message(&why) => {
                tracing::debug!(
                    op = node.name(),
                    samples = b,
                    "toma::lazy: calibration ran out of memory; measured smaller"
                );
                limit = Some(b);
            }
            Err(why) => return Err(why),
        }
    }
    let series =
        |points: &[(u64, Point)], f: fn(&Point) -> u64| points.iter().map(|(b, p)| (*b, f(p))).collect::<Vec<_>>();
    let parts: [fn(&Point) -> u64; 3] = [|p| p.kept, |p| p.forward, |p| p.backward];
    if parts.iter().any(|&f| {
        let series = series(&points, f);
        off_the_line(&series, fit(&series))
    }) {
        let largest = points.last().map_or(1, |p| p.0);
        let mut b = 4;
        while b < largest {
            if !points.iter().any(|p| p.0 == b) {
                points.push((b, point(node, base, b as i64, counter, training, block)?.0));
            }
            b *= 2;
        }
        points.sort_by_key(|p| p.0);
    }
    tracing::trace!(op = node.name(), ?points, "toma::lazy: a kernel call measured at each size");
    // Seen over the room: priced for this budget only.
    let whole = limit.is_none() && points.last().is_some_and(|p| p.0 >= largest_wanted);
    Ok((Measured { limit, ..price_points(&points) }, whole))
}

/// The price of the points measured, each part priced by its own series ([`priced`]).
fn price_points(points: &[(u64, Point)]) -> Measured {
    let series = |f: fn(&Point) -> u64| points.iter().map(|(b, p)| (*b, f(p))).collect::<Vec<_>>();
    Measured {
        kept: priced(&series(|p| p.kept)),
        forward: priced(&series(|p| p.forward)),
        backward: priced(&series(|p| p.backward)),
        limit: None,
    }
}

/// Whether the line `w` (the [`fit`]) misses a size from two on by more than 2% (and 1 KiB).
fn off_the_line(points: &[(u64, u64)], w: Work) -> bool {
    points.iter().filter(|&&(b, _)| b > 1).any(|&(b, m)| (w.per * b + w.fixed).abs_diff(m) > (m / 50).max(1024))
}

/// The [`fit`], with the measurements as its curve where the line misses one of them.
fn priced(points: &[(u64, u64)]) -> Work {
    let mut w = fit(points);
    if off_the_line(points, w) {
        w.curve = Curve::intern(points.iter().copied().filter(|&(b, _)| b > 1).collect());
        if w.curve.is_some() {
            if let Some(&(_, one)) = points.iter().find(|&&(b, _)| b == 1) {
                w.single = one.max(1);
            }
        }
    }
    w
}

/// The line through the two largest sizes, raised to be under none of the sizes from two on
/// (fixed + per sample), and the value at one sample apart where it is off the line (one sample
/// may run another kernel). Through the origin when one size from two on was measured.
fn fit(points: &[(u64, u64)]) -> Work {
    let lined: Vec<(u64, u64)> = points.iter().copied().filter(|&(b, _)| b > 1).collect();
    let one = points.iter().find(|&&(b, _)| b == 1).map(|&(_, m)| m);
    let (per, fixed) = match lined.as_slice() {
        [] => return Work::line(0, one.unwrap_or(0)),
        [(b, m)] => (m.div_ceil(*b), 0),
        [.., (b_prev, prev), (b_last, last)] => {
            let per = last.saturating_sub(*prev).div_ceil(b_last - b_prev);
            (per, lined.iter().map(|&(b, m)| m.saturating_sub(per * b)).max().unwrap_or(0))
        }
    };
    let single = match one {
        Some(m) if m != per + fixed => m.max(1),
        _ => 0,
    };
    Work { single, ..Work::line(per, fixed) }
}

/// Bytes as the allocator counts them.
fn rounded(bytes: u64, block: u64) -> u64 {
    bytes.div_ceil(block.max(1)) * block.max(1)
}

/// Tries at measuring alone before a measurement takes the thread's own count.
const TRIES: usize = 8;

/// [`probe`] where no other thread's work reached the count: toma's own measurements take
/// turns, and one that another thread's allocations reached is made again; after [`TRIES`],
/// the thread's own count measures it (it misses only what the workers of the op's parallel
/// loops allocate: 5% of a native `Double` convolution's backward at 64 samples). CUDA counts a
/// device's work, every thread's, and tells no thread apart: there a measurement stands when
/// it repeats, the same figures from as many allocations and frees ([`repeated`]); after
/// [`TRIES`], the smallest stands (another thread's work only adds to a peak).
fn probe_alone(node: &Node, b: i64, counter: PeakCounter, training: bool, block: u64) -> Result<(Point, u64), String> {
    static TURN: Mutex<()> = Mutex::new(());
    let mut seen: Vec<(i64, (Point, u64))> = Vec::new();
    for _ in 0..TRIES {
        let turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (mark, events) = (counter.mark(), counter.device_events());
        let measured = probe(node, b, counter, training, block)?;
        if let (Some(before), Some(after)) = (events, counter.device_events()) {
            seen.push((after - before, measured));
            if let Some(m) = repeated(&seen) {
                return Ok(m);
            }
            continue;
        }
        if !counter.interfered(mark) {
            return Ok(measured);
        }
        drop(turn);
        tracing::debug!(op = node.name(), samples = b, "toma::lazy: another thread allocated while measuring; again");
        std::thread::sleep(Duration::from_millis(1));
    }
    if let Some(least) = seen.iter().map(|(_, m)| *m).min_by_key(|(_, took)| *took) {
        tracing::debug!(
            op = node.name(),
            samples = b,
            "toma::lazy: no measurement repeated on the device; the least stands"
        );
        return Ok(least);
    }
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    probe(node, b, counter.own_only(), training, block)
}

/// The measurement the last two of `seen` agree on (as many allocations and frees, the same
/// figures), if they do.
fn repeated(seen: &[(i64, (Point, u64))]) -> Option<(Point, u64)> {
    match seen {
        [.., a, b] if a == b => Some(b.1),
        _ => None,
    }
}

/// Runs `node` at `b` samples under the counter: forward, then (training, when a gradient
/// flows) its backward from a gradient of ones. Also returns the most it had allocated at once,
/// stand-ins included.
fn probe(node: &Node, b: i64, counter: PeakCounter, training: bool, block: u64) -> Result<(Point, u64), String> {
    const UNREAD: &str = "the allocator counter cannot be read";
    let base = counter.in_use().ok_or(UNREAD)?;
    let grad_of = |x: &Meta| training && x.requires_grad && shape::is_floating(x.kind);
    let updated = node.facts.updated.clone();
    let ins = node
        .inputs
        .iter()
        .enumerate()
        .map(|(k, x)| {
            let t = stand_in(x, b)?;
            // Running statistics are updated in place: the model's own stay as they are.
            let t = if updated.contains(&k) { t.f_detach_copy()? } else { t };
            Ok(if grad_of(&x.meta) { t.set_requires_grad(true) } else { t })
        })
        .collect::<Result<Vec<Tensor>, tch::TchError>>()
        .map_err(|e| e.to_string())?;
    let refs: Vec<&Tensor> = ins.iter().collect();
    let cx = RunCx { meta: &node.meta, start: 0, b };
    let bytes = |b_: crate::lazy::size::Bytes| rounded(b_.per * b as u64 + b_.fixed, block);
    let (before, previous) = counter.start().ok_or(UNREAD)?;
    // The counter's earlier peak comes back however this ends (an op that panics included).
    struct End(PeakCounter, u64);
    impl Drop for End {
        fn drop(&mut self) {
            self.0.end(self.1);
        }
    }
    let _end = End(counter, previous);
    // The operands the op's facts say autograd does not keep (it keeps a copy, priced as kept):
    // at some sizes the kernel needs no copy and autograd keeps the operand itself.
    let unsaved = |k: usize| training && !node.facts.saved.contains(k) && !node.meta.alias;
    let uses: Vec<Option<(i64, i64)>> =
        ins.iter().enumerate().map(|(k, t)| if unsaved(k) { crate::memory::storage_use(t) } else { None }).collect();
    (|| -> Result<(Point, u64), String> {
        let run = || node.run(&refs, &cx);
        let out = if training { tch::with_grad(run) } else { tch::no_grad(run) }.map_err(|e| e.to_string())?;
        let (peak, after) = (counter.peak().ok_or(UNREAD)?, counter.in_use().ok_or(UNREAD)?);
        let out_bytes = bytes(node.cost.out);
        // Operands autograd now holds though the facts say it does not: kept in their place.
        let held: u64 = ins
            .iter()
            .zip(&uses)
            .filter_map(|(t, was)| {
                let (before, bytes) = (*was)?;
                let (now, _) = crate::memory::storage_use(t)?;
                (now > before).then_some(rounded(bytes.max(0) as u64, block))
            })
            .sum();
        let kept = after.saturating_sub(before + out_bytes) + held;
        let forward = peak.saturating_sub(before + out_bytes + kept);
        let wrt: Vec<(usize, &Tensor)> =
            ins.iter().enumerate().filter(|(k, _)| grad_of(&node.inputs[*k].meta)).collect();
        if !training || !out.requires_grad() || wrt.is_empty() {
            return Ok((Point { kept, forward, backward: 0 }, peak.saturating_sub(base)));
        }
        let seed = out.f_ones_like().map_err(|e| e.to_string())?;
        let surrogate =
            tch::with_grad(|| out.f_mul(&seed).and_then(|p| p.f_sum(p.kind()))).map_err(|e| e.to_string())?;
        // The seed stays held: freed as the product's backward returns, it would lower what
        // is live under the node's backward below what the counter started from.
        drop(out);
        let forward_peak = peak;
        let (before, _) = counter.start().ok_or(UNREAD)?;
        let tensors: Vec<&Tensor> = wrt.iter().map(|(_, t)| *t).collect();
        let grads = tch::with_grad(|| Tensor::f_run_backward(&[&surrogate], &tensors, false, false))
            .map_err(|e| e.to_string())?;
        let peak = counter.peak().ok_or(UNREAD)?;
        drop((grads, seed));
        // What the schedule counts beside the scratch: the output's gradient, and each input's
        // that is not a view of it.
        let aliases = |k: usize| node.facts.grad_alias.contains(k);
        let grads: u64 = wrt.iter().filter(|(k, _)| !aliases(*k)).map(|(k, _)| bytes(node.inputs[*k].cost.grad)).sum();
        let backward = peak.saturating_sub(before + bytes(node.cost.grad) + grads);
        Ok((Point { kept, forward, backward }, peak.max(forward_peak).saturating_sub(base)))
    })()
}

/// A tensor standing in for `x` at `b` samples: a source's own (an input narrowed to `b`, where
/// it has as many, a parameter as it is), detached; otherwise ones (`true` for booleans: a mask
/// selects every entry, as the rules plan a data-dependent selection; zeros for integers, which
/// index) in the recorded layout: the dimensions in the order of their strides, broadcast ones
/// expanded.
fn stand_in(x: &Node, b: i64) -> Result<Tensor, tch::TchError> {
    let short = x.meta.batch().is_some_and(|bd| bd.size < b);
    if x.is_source() && !short {
        let t = x.run(&[], &RunCx { meta: &x.meta, start: 0, b })?;
        return Ok(t.detach());
    }
    let meta = &x.meta;
    let shape = meta.shape_at(b);
    let options = (meta.kind, meta.device);
    let fill = |dims: &[i64]| {
        if shape::is_floating(meta.kind) || meta.kind == tch::Kind::Bool {
            Tensor::f_ones(dims, options)
        } else {
            Tensor::f_zeros(dims, options)
        }
    };
    if meta.strides.len() != shape.len() {
        return fill(&shape);
    }
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by(|&p, &q| meta.strides[q].cmp(&meta.strides[p]));
    let physical: Vec<i64> = order.iter().map(|&d| if meta.strides[d] == 0 { 1 } else { shape[d] }).collect();
    let mut inverse = vec![0i64; shape.len()];
    for (p, &d) in order.iter().enumerate() {
        inverse[d] = p as i64;
    }
    let t = fill(&physical)?.f_permute(&inverse)?;
    if meta.strides.contains(&0) {
        t.f_expand(shape.as_slice(), false)
    } else {
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// On a device whose count every thread reaches, a measurement stands once two in a row
    /// agree: as many allocations and frees, the same figures.
    #[test]
    fn a_device_measurement_stands_when_it_repeats() {
        let p = |kept| (Point { kept, forward: 10, backward: 20 }, kept + 30);
        assert_eq!(repeated(&[(4, p(100))]), None, "one measurement");
        assert_eq!(repeated(&[(4, p(100)), (4, p(100))]), Some(p(100)));
        // Another thread's blocks: more events, or a higher figure.
        assert_eq!(repeated(&[(4, p(100)), (6, p(100))]), None);
        assert_eq!(repeated(&[(4, p(100)), (4, p(140))]), None);
        assert_eq!(repeated(&[(4, p(140)), (4, p(100)), (4, p(100))]), Some(p(100)));
    }

    /// Two sizes give a line never under either; one sample off the line is kept apart.
    #[test]
    fn a_line_through_what_was_measured() {
        assert_eq!(fit(&[(1, 700)]), Work::line(0, 700));
        // One size from two on: through the origin, one sample apart.
        assert_eq!(fit(&[(1, 300), (2, 500)]), Work { single: 300, ..Work::line(250, 0) });
        assert_eq!(fit(&[(1, 250), (2, 500)]), Work::line(250, 0));
        let w = fit(&[(1, 1000), (2, 500), (8, 1700)]);
        assert_eq!((w.per, w.fixed), (200, 100));
        assert_eq!((w.at(2, 1), w.at(8, 1), w.at(1, 1)), (500, 1700, 1000));
        // A fixed workspace: as large at every size.
        assert_eq!(fit(&[(1, 4096), (2, 4096), (8, 4096)]), Work::line(0, 4096));
        // Less at more samples (threads split otherwise): the larger of the two is held.
        let w = fit(&[(1, 10), (2, 900), (8, 600)]);
        assert!(w.at(2, 1) >= 900 && w.at(8, 1) >= 600, "{w:?}");
        assert_eq!(w.at(1, 1), 10);
        // Four sizes: the slope of the two largest, raised to be under none from two on.
        let points = [(1, 10), (2, 500), (8, 1700), (32, 7000)];
        let w = fit(&points);
        assert_eq!(w.per, 221);
        assert!(points[1..].iter().all(|&(b, m)| w.at(b, 1) >= m), "{w:?}");
        assert_eq!(w.at(1, 1), 10);
        let m = Measured { kept: w, forward: Work::line(3, 0), backward: Work::ZERO, limit: None };
        assert_eq!(Measured::from_line(&m.to_line()), Some(m));
        assert_eq!(Measured::from_line("1 2 3"), None);
    }

    /// A workspace that stops growing below some size (a grouped convolution's backward on AVX2:
    /// flat to 8 samples, then growing) is priced as measured at every size between, where the
    /// raised line was 39% over at 8; a line that holds needs no curve.
    #[test]
    fn a_bent_measurement_is_priced_as_measured() {
        let points = [(1, 100), (2, 200_964), (4, 200_964), (8, 200_964), (16, 304_000), (32, 511_684)];
        let w = priced(&points);
        for &(b, m) in &points {
            assert_eq!(w.at(b, 1), m, "at {b}: {w:?}");
        }
        assert_eq!(w.at(12, 1), 200_964 + (304_000 - 200_964) / 2, "interpolated");
        assert_eq!(w.at(64, 1), 511_684 + 32 * w.per, "beyond: the line's slope");
        assert!(fit(&points).at(8, 1) > 270_000, "the line alone is far over at 8");
        let straight = priced(&[(1, 10), (2, 500), (8, 1700), (32, 6500)]);
        assert_eq!(straight.curve, None);
        let m = Measured { kept: w, forward: straight, backward: Work::ZERO, limit: None };
        assert_eq!(Measured::from_line(&m.to_line()), Some(m));
        assert_eq!(
            Measured::from_line("1 2 3 4 5 6 7 8 9"),
            Some(Measured {
                kept: Work { single: 3, ..Work::line(1, 2) },
                forward: Work { single: 6, ..Work::line(4, 5) },
                backward: Work { single: 9, ..Work::line(7, 8) },
                limit: None,
            }),
            "a line of a file written before curves"
        );
        let sum = w.plus(straight);
        assert_eq!(sum.at(8, 1), 200_964 + straight.at(8, 1));
    }

    /// A measurement serves every batch of the same per-sample shapes, and only those settings:
    /// a 3×3 padded 1 and one padded 2 and dilated 2 map the same sizes and are kept apart.
    #[test]
    fn keys_tell_settings_apart_and_not_batch_sizes() {
        let w = Tensor::zeros([4, 4, 3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let conv = |n: i64, pad: i64, dil: i64| {
            let x = Tensor::zeros([n, 4, 8, 8], (Kind::Float, Device::Cpu));
            let y = crate::lazy::lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, pad, dil, 1);
            key(y.node(), true, 2, &mut Vec::new())
        };
        assert_eq!(conv(128, 1, 1), conv(160, 1, 1));
        // Above the usual sizes the batch is a size of its own, measured once per batch.
        let extra = |n: i64, also: &[u64]| {
            let x = Tensor::zeros([n, 4, 8, 8], (Kind::Float, Device::Cpu));
            extra_key(crate::lazy::lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1).node(), also)
        };
        assert_eq!(extra(100, &[]), 0);
        assert_ne!(extra(257, &[]), extra(300, &[]));
        assert_ne!(extra(257, &[]), extra(257, &[64, 1]));
        assert_eq!(extra(257, &[]), extra(257, &[128, 1]), "128 is a usual size, and one sample too");
        assert_ne!(conv(2, 1, 1), conv(128, 1, 1), "measured at 2 samples at most: not a line for 128");
        assert_ne!(conv(2, 1, 1), conv(2, 2, 2));
        assert_ne!(conv(2, 1, 1), {
            let x = Tensor::zeros([2, 4, 8, 8], (Kind::Float, Device::Cpu));
            let y = crate::lazy::lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1);
            key(y.node(), false, 2, &mut Vec::new())
        });
    }

    /// Stand-ins keep the recorded layout: a transposed operand arrives transposed.
    #[test]
    fn stand_ins_keep_the_layout() {
        let x = Tensor::zeros([6, 4, 3], (Kind::Float, Device::Cpu));
        let lx = crate::lazy::lazy(&x, 0);
        let t = lx.transpose(1, 2);
        let s = stand_in(t.node(), 2).unwrap();
        assert_eq!(s.size(), [2, 3, 4]);
        assert_eq!(s.stride(), [12, 1, 3]);
        let s = stand_in(lx.node(), 2).unwrap();
        assert_eq!(s.size(), [2, 4, 3], "an input, narrowed");
    }
}
