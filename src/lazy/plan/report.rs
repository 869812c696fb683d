//! A plan as users see it: the chosen micro-batch, the peak, the per-op table and the schedule
//! step by step, printed as a table or drawn as an SVG.

use super::placement::Placement;
use crate::lazy::unplaced::UnplacedRequest;
use std::borrow::Cow;
use std::cell::OnceCell;
use std::fmt;

use tch::Kind;

use super::compiled::Compiled;
use super::schedule::{Mode, Phase, Schedule, Step};
use super::search::Decision;
use crate::lazy::cost::measured::Calibration;
use crate::lazy::cost::Work;

/// One op of a plan, at the micro-batch size.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOp {
    /// The op's name.
    pub name: Cow<'static, str>,
    /// Its output shape at the micro-batch size.
    pub shape: Vec<i64>,
    /// Its output kind.
    pub kind: Kind,
    /// Where the batch dimension is, if the value is per-sample.
    pub batch_dim: Option<usize>,
    /// Bytes its output allocates at the micro-batch size (0 for views, inputs, parameters).
    pub bytes: u64,
    /// Whether the output is a view of its first input.
    pub view: bool,
    /// Position of the op whose allocation the value lives in (its own, or a view's base).
    pub base: usize,
}

/// A memory plan: the micro-batch chosen for one output, the schedule's peak, and the
/// per-op table. Displays as a readable table.
#[derive(Clone, Debug)]
pub struct Plan {
    mode: Mode,
    batch_size: usize,
    micro_batch: usize,
    budget: u64,
    peak: u64,
    peak_step: usize,
    full_batch_peak: u64,
    per_sample_at_peak: u64,
    facts: Vec<OpRow>,
    shapes: Vec<i64>,
    ops: OnceCell<Vec<PlanOp>>,
    /// The schedule, evaluated into steps when they are asked for.
    schedule: Schedule,
    new_grads: u64,
    /// Whether micro-batches add into `.grad` in place ([`Plan::accumulates_in_place`]), and
    /// the bytes of `.grad` a later micro-batch runs with then.
    in_place: bool,
    grad_bytes: u64,
    steps: OnceCell<Vec<Step>>,
    last_use: Vec<u32>,
    /// Bytes earlier runs of this graph measured above their plans, held in reserve at the
    /// micro-batch (0: none did).
    correction: u64,
    /// The first op of each recomputed segment (empty: nothing is recomputed), and the ops that
    /// run twice.
    segments: Vec<usize>,
    recomputed: Vec<usize>,
    why: String,
    /// Estimated seconds of the planned step and of a plain whole-batch step.
    seconds: (f64, f64),
    calibration: Calibration,
    /// The optimizer's step after the backward, and its peak, where one was planned.
    optimizer: Option<(&'static str, u64)>,
    /// On a CUDA card: what the caching allocator's replay placed.
    placement: Option<Placement>,
    unplaced: Option<UnplacedRequest>,
}

impl Plan {
    /// Forward only, or forward and backward.
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// The full batch size N.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }
    /// The micro-batch size: N when the whole batch fits, else a power of two.
    pub fn micro_batch(&self) -> usize {
        self.micro_batch
    }
    /// How many micro-batches cover the batch.
    pub fn chunks(&self) -> usize {
        self.batch_size.div_ceil(self.micro_batch.max(1))
    }
    /// Whether the batch is split.
    pub fn splits(&self) -> bool {
        self.micro_batch < self.batch_size
    }
    /// Whether autograd adds each micro-batch's gradients straight into `.grad`, holding one
    /// copy of them, as plain tch does: where every parameter's `.grad` is none when the step
    /// begins (tch's `opt.zero_grad()`) and no input requires a gradient. A micro-batch that
    /// runs out of memory then starts the step again from none, at a smaller size. Otherwise
    /// each micro-batch's gradients are kept apart until its backward completes, then added,
    /// so that a failed one leaves the earlier gradients in `.grad` as they were: a second copy
    /// of them, counted in the peak.
    pub fn accumulates_in_place(&self) -> bool {
        self.in_place
    }
    /// The memory budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }
    /// Bytes held in reserve at the micro-batch because earlier runs of this graph measured
    /// more than their plans (on CUDA, or on the CPU with
    /// [`track_cpu_allocations`](crate::memory::track_cpu_allocations)); the micro-batch is
    /// chosen with them held. Each measurement bounds the excess at every size (at most itself
    /// at fewer samples, at most in proportion at more), so a fixed excess is held whole and a
    /// per-sample one scales once two sizes were measured. 0 when no run measured more.
    pub fn correction_bytes(&self) -> u64 {
        self.correction
    }
    /// [`correction_bytes`](Self::correction_bytes) per sample of the micro-batch.
    pub fn correction_bytes_per_sample(&self) -> u64 {
        self.correction.div_ceil(self.micro_batch.max(1) as u64)
    }
    /// Peak bytes of the step at the micro-batch size: the schedule's, or the optimizer's step
    /// after it where a toma `Optimizer` planned one
    /// ([`Optimizer::plan_step`](crate::lazy::nn::Optimizer::plan_step)) and it is higher.
    pub fn peak_bytes(&self) -> u64 {
        self.peak.max(self.optimizer_peak_bytes())
    }
    /// On a CUDA card (or one described with [`Options::card`](crate::lazy::Options::card)): the
    /// most bytes libtorch's caching allocator reserves for the step (segments and mapped
    /// pages), by a replay of the allocator's model with its settings: what CUDA runs out of.
    /// From an empty allocator it is at least [`Plan::peak_bytes`] less the optimizer's; the
    /// two differ by rounding, cached free pieces and whole segments. On a card toma runs on,
    /// the replay starts from the allocator's segments as the step finds them
    /// ([`memory::cuda_segments`](crate::memory::cuda_segments)), and this is what its reserved
    /// bytes grow by over the step: less where blocks cached before it serve the step. On a
    /// described card the parameters' and inputs' segments are not counted in it
    /// ([`Plan::placed_leaf_bytes`]). `None` on the CPU, whose allocator takes bytes as asked.
    pub fn reserved_bytes(&self) -> Option<u64> {
        self.placement.as_ref().map(Placement::step_reserved)
    }
    /// On a CUDA card, the bytes of cached segments the step gives back to the card before it
    /// begins (`torch.cuda.empty_cache()`): chosen where the replay places the plan only so,
    /// because a cached segment would otherwise be split for a small request and pin memory a
    /// larger one needs. 0 where the step empties nothing; `None` on the CPU.
    pub fn emptied_cache_bytes(&self) -> Option<u64> {
        self.placement.as_ref().map(|p| p.emptied)
    }
    /// On a described card, the bytes of the graph's parameters and inputs the replay placed
    /// before the step (0 on a card toma runs on, where they are on it already; `None` on the
    /// CPU).
    pub fn placed_leaf_bytes(&self) -> Option<u64> {
        self.placement.as_ref().map(|p| p.leaves)
    }
    /// On a CUDA card, where the plan of the budget's allocated bytes would not be placed by
    /// the caching allocator: that plan and the request that failed in the replay (what
    /// libtorch's "CUDA out of memory" would have said mid-step). This plan was then made under
    /// a lower budget. `None` where the first plan was placed, and on the CPU.
    pub fn unplaced(&self) -> Option<&UnplacedRequest> {
        self.unplaced.as_ref()
    }
    /// Peak bytes of the optimizer's step after the backward (the gradients, the state a first
    /// step creates, its temporaries), where one was planned; 0 otherwise.
    pub fn optimizer_peak_bytes(&self) -> u64 {
        self.optimizer.map_or(0, |(_, bytes)| bytes)
    }
    /// Peak bytes the whole batch would need.
    pub fn full_batch_peak_bytes(&self) -> u64 {
        self.full_batch_peak
    }
    /// Bytes live at the peak that scale with the batch: per sample (the peak is about
    /// `per_sample_bytes() * micro_batch() + fixed_bytes()`).
    pub fn per_sample_bytes(&self) -> u64 {
        self.per_sample_at_peak
    }
    /// Bytes live at the peak that do not scale with the batch (parameter gradients,
    /// activations of fixed operands, rounding).
    pub fn fixed_bytes(&self) -> u64 {
        self.peak.saturating_sub(self.per_sample_at_peak * self.micro_batch as u64)
    }
    /// Whether the backward recomputes activations: their segments' forwards run twice, and
    /// what they saved is dropped in between (see [`Recompute`](crate::lazy::Recompute)).
    pub fn recomputes(&self) -> bool {
        !self.segments.is_empty()
    }
    /// The position of the first op of each recomputed segment, in order (the first is 0);
    /// empty when nothing is recomputed. Every segment but the last runs twice.
    pub fn segments(&self) -> &[usize] {
        &self.segments
    }
    /// The positions of the ops that run twice (inputs and parameters aside).
    pub fn recomputed_ops(&self) -> &[usize] {
        &self.recomputed
    }
    /// What calibration measured for this plan ([`Calibrate`](crate::lazy::Calibrate)): kernel
    /// calls measured now or earlier in place of rules not validated on this machine, those
    /// that could not be, and what measuring took.
    pub fn calibration(&self) -> &Calibration {
        &self.calibration
    }
    /// Why the planner chose this plan, in a sentence.
    pub fn reason(&self) -> &str {
        &self.why
    }
    /// The estimated time of the planned step over that of a plain step of the whole batch
    /// (1.0: the same), from the cost model's prior for the device (ops launched and bytes
    /// made): a ranking of plans, not a measurement.
    pub fn estimated_time_ratio(&self) -> f64 {
        if self.seconds.1 > 0.0 {
            self.seconds.0 / self.seconds.1
        } else {
            1.0
        }
    }
    /// The step at the peak.
    pub fn peak_step(&self) -> &Step {
        &self.steps()[self.peak_step]
    }
    /// The op at the peak: its position, name and phase.
    pub fn peak_op(&self) -> (usize, &str, Phase) {
        let s = self.peak_step();
        (s.node, &self.ops()[s.node].name, s.phase)
    }
    /// The ops, in the order they run.
    pub fn ops(&self) -> &[PlanOp] {
        self.ops.get_or_init(|| {
            self.facts
                .iter()
                .map(|f| {
                    let name = Cow::Borrowed(f.name);
                    let start = f.shape_start as usize;
                    PlanOp {
                        name,
                        shape: self.shapes[start..start + f.shape_len as usize].to_vec(),
                        kind: f.kind,
                        batch_dim: f.batch_dim.map(|d| d as usize),
                        bytes: f.bytes,
                        view: f.view,
                        base: f.base as usize,
                    }
                })
                .collect()
        })
    }
    /// The schedule at the micro-batch size: forward steps (one per op), then backward steps
    /// and the gradient accumulation in a backward plan.
    pub fn steps(&self) -> &[Step] {
        self.steps.get_or_init(|| {
            let mut steps = Vec::with_capacity(self.schedule.steps.len() + 1);
            let raw = self.schedule.eval(self.micro_batch as u64, Some(&mut steps));
            // In place, autograd adds each gradient as it comes: no step of its own.
            if let Some((live, _, _)) = raw.accumulate.filter(|_| !self.in_place) {
                // Counted for all parameters that get a gradient unless that could change the
                // peak: then for those without a `.grad()` only.
                let during = live + self.new_grads;
                let node = self.facts.len() - 1;
                steps.push(Step {
                    node,
                    phase: Phase::Accumulate,
                    bytes: self.new_grads,
                    during,
                    live: self.new_grads,
                });
            }
            steps
        })
    }
    /// The plan as a picture: a self-contained SVG (no scripts, inline styles) of the bytes
    /// live during each step of the schedule at the chosen micro-batch, beside the same
    /// schedule at the whole batch (dashed) when the batch is split; the forward and backward
    /// passes shaded; the peak marked with its op; and the budget when it is within the
    /// picture's scale (else it is named in the title).
    ///
    /// Each series is a `<g data-series="..">`: `forward`, `backward`, `recompute` (one per run
    /// of recomputed forward steps, when the plan recomputes), `micro-batch`, `whole batch`
    /// (when split), `peak`, `budget` (when drawn). The title names the segments and the
    /// estimated step time of a recomputing plan.
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, Mode, Options};
    ///
    /// let w = Tensor::randn([64, 32], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let x = Tensor::randn([256, 64], (Kind::Float, Device::Cpu));
    /// let loss = lazy(&x, 0).matmul(&w).relu().sum(None);
    /// let plan = loss.plan(Mode::Backward, &Options::new().budget(64 << 10))?;
    /// let svg = plan.to_svg();
    /// assert!(svg.starts_with("<svg") && svg.contains("data-series=\"peak\""));
    /// // std::fs::write("plan.svg", svg)?;
    /// # Ok::<(), toma::lazy::LazyError>(())
    /// ```
    pub fn to_svg(&self) -> String {
        use crate::svg::{bytes, Chart, Unit};
        let steps = self.steps();
        let curve = |steps: &[Step]| -> Vec<(f64, f64)> {
            steps.iter().enumerate().map(|(k, s)| (k as f64, s.during as f64)).collect()
        };
        let micro = curve(steps);
        let whole = self.splits().then(|| {
            let mut full = Vec::with_capacity(self.schedule.steps.len());
            self.schedule.eval(self.batch_size as u64, Some(&mut full));
            curve(&full)
        });
        let top = micro.iter().chain(whole.iter().flatten()).fold(0.0f64, |m, &(_, y)| m.max(y));
        let budget_drawn = (self.budget as f64) <= 2.0 * top.max(1.0);
        let y_max = if budget_drawn { top.max(self.budget as f64) } else { top };
        let mode = match self.mode {
            Mode::Forward => "forward",
            Mode::Backward => "forward + backward",
        };
        let mut title = format!(
            "toma::lazy plan ({mode}): batch {} in {} micro-batch(es) of {}; peak {}",
            self.batch_size,
            self.chunks(),
            self.micro_batch,
            bytes(self.peak as f64)
        );
        if self.recomputes() {
            title.push_str(&format!(
                ", {} segments recomputed (est. {:.2}x a plain step)",
                self.segments.len(),
                self.estimated_time_ratio()
            ));
        }
        if !budget_drawn {
            title.push_str(&format!(", budget {} (off scale)", bytes(self.budget as f64)));
        }
        let mut chart =
            Chart::new(&title, "schedule step (ops in the order they run)", micro.len() as f64, y_max, Unit::Bytes);
        let backward_from = steps.iter().position(|s| s.phase != Phase::Forward).unwrap_or(steps.len());
        chart.band("forward", 0.0, backward_from as f64, "#2a6fdb", "forward");
        if backward_from < steps.len() {
            chart.band("backward", backward_from as f64, steps.len() as f64, "#d9822b", "backward");
        }
        // Each run of recomputed forward steps, over the backward's band.
        let mut k = 0;
        while k < steps.len() {
            if steps[k].phase != Phase::Recompute {
                k += 1;
                continue;
            }
            let start = k;
            while k < steps.len() && steps[k].phase == Phase::Recompute {
                k += 1;
            }
            chart.band("recompute", start as f64, k as f64, "#2aa876", "re-fwd");
        }
        if let Some(whole) = &whole {
            let label = format!("whole batch of {} (peak {})", self.batch_size, bytes(self.full_batch_peak as f64));
            chart.steps("whole batch", &label, whole, "#888", true);
        }
        let label = format!("micro-batch of {}", self.micro_batch);
        chart.steps("micro-batch", &label, &micro, "#1f5fbf", false);
        if budget_drawn {
            chart.hline("budget", &format!("budget {}", bytes(self.budget as f64)), self.budget as f64, "#c0392b");
        }
        let peak = &steps[self.peak_step.min(steps.len().saturating_sub(1))];
        let phase = match peak.phase {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Recompute => "recompute",
            Phase::Accumulate => "accumulate",
        };
        let op = &self.ops()[peak.node].name;
        let label = format!("peak {} at #{} {op} ({phase})", bytes(self.peak as f64), peak.node);
        chart.marker("peak", self.peak_step as f64, peak.during as f64, &label, "#c0392b");
        chart.finish()
    }

    /// Positions of the values the executor holds after forward step `op` (its output, and
    /// earlier values still to be used), as the plan schedules them.
    pub fn held_after(&self, op: usize) -> Vec<usize> {
        (0..=op.min(self.facts.len().saturating_sub(1))).filter(|&j| self.last_use[j] as usize > op).collect()
    }
}

/// The full plan (table included) for a decision.
pub(crate) fn detail(c: Compiled, decision: Decision) -> Plan {
    let b = decision.micro_batch as u64;
    let (outcome, new_grads) = decision.outcome;
    // The per-op table is materialized only when asked for: planning copies flat facts.
    let mut shapes = Vec::with_capacity(2 * c.len());
    let mut facts = Vec::with_capacity(c.len());
    for (node, &root) in c.nodes.iter().zip(&c.root) {
        let start = shapes.len();
        shapes.extend_from_slice(&node.meta.shape);
        let batch = node.meta.batch();
        if let Some(bd) = batch {
            shapes[start + bd.dim] = b as i64 * bd.factor;
        }
        let name = node.name();
        facts.push(OpRow {
            name,
            shape_start: start as u32,
            shape_len: node.meta.shape.len() as u32,
            bytes: Work::from(node.cost.out).at(b, c.block),
            base: root,
            batch_dim: batch.map(|bd| bd.dim as u32),
            kind: node.meta.kind,
            view: node.meta.alias,
        });
    }
    Plan {
        mode: decision.mode,
        batch_size: c.batch as usize,
        micro_batch: decision.micro_batch,
        budget: decision.budget,
        peak: outcome.peak,
        peak_step: outcome.peak_step,
        full_batch_peak: decision.full_peak,
        per_sample_at_peak: outcome.peak_per_sample,
        facts,
        shapes,
        ops: OnceCell::new(),
        schedule: decision.schedule,
        new_grads,
        in_place: decision.mode == Mode::Backward && c.accumulates_in_place(),
        grad_bytes: c.param_grad_bytes,
        steps: OnceCell::new(),
        recomputed: decision.segments.as_ref().map_or_else(Vec::new, |s| s.recomputed(&c).collect()),
        segments: decision.segments.as_ref().map_or_else(Vec::new, |s| s.starts.iter().map(|&p| p as usize).collect()),
        calibration: decision.evidence.calibration(),
        last_use: c.last_use.clone(),
        correction: decision.reserved,
        why: decision.why,
        seconds: decision.seconds,
        optimizer: decision.optimizer,
        placement: decision.placement,
        unplaced: decision.unplaced,
    }
}

/// What a plan keeps of each op until its table is asked for (compact: a large graph's plan
/// is built often and read rarely).
#[derive(Clone, Debug)]
struct OpRow {
    /// The op's name (custom ops' names are interned: static too).
    name: &'static str,
    shape_start: u32,
    shape_len: u32,
    bytes: u64,
    base: u32,
    batch_dim: Option<u32>,
    kind: Kind,
    view: bool,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (peak_node, peak_name, peak_phase) = self.peak_op();
        let mode = match self.mode {
            Mode::Forward => "forward",
            Mode::Backward => "forward + backward",
        };
        writeln!(
            f,
            "toma::lazy plan ({mode}): batch {} -> micro-batch {} x {} chunk(s); peak {} at #{peak_node} {peak_name} ({}); \
             budget {}; whole batch would peak at {}",
            self.batch_size,
            self.micro_batch,
            self.chunks(),
            crate::svg::bytes(self.peak as f64),
            peak_phase.name(),
            crate::svg::bytes(self.budget as f64),
            crate::svg::bytes(self.full_batch_peak as f64),
        )?;
        if let Some(p) = &self.placement {
            writeln!(
                f,
                "reserved: peak {} allocated, {} reserved by the CUDA caching allocator ({}{})",
                crate::svg::bytes(p.step_allocated() as f64),
                crate::svg::bytes(p.step_reserved() as f64),
                if p.expandable { "expandable segments" } else { "default segments" },
                match (p.leaves, p.held) {
                    _ if p.emptied > 0 => format!(
                        "; the cache emptied first: {} of cached segments back to the card",
                        crate::svg::bytes(p.emptied as f64)
                    ),
                    (0, (0, _)) => String::new(),
                    (0, (reserved, allocated)) => format!(
                        "; beside the {} the card's allocator held before the step, {} of it cached",
                        crate::svg::bytes(reserved as f64),
                        crate::svg::bytes(reserved.saturating_sub(allocated) as f64)
                    ),
                    (leaves, _) =>
                        format!("; parameters and inputs placed first: {}", crate::svg::bytes(leaves as f64)),
                },
            )?;
        }
        if self.recomputes() {
            let spans: Vec<String> = self
                .segments
                .iter()
                .enumerate()
                .map(|(k, &start)| {
                    let end = self.segments.get(k + 1).map_or(self.facts.len(), |&e| e) - 1;
                    format!("#{start}..#{end}")
                })
                .collect();
            writeln!(
                f,
                "recomputes: {} segments ({}); {} ops run twice, every segment's but the last",
                self.segments.len(),
                spans.join(", "),
                self.recomputed.len()
            )?;
        }
        writeln!(
            f,
            "why: {}; estimated step time {:.2}x a plain whole-batch step",
            self.why,
            self.estimated_time_ratio()
        )?;
        let casts: Vec<Kind> = self.facts.iter().filter(|f| f.name == "autocast").map(|f| f.kind).collect();
        if !casts.is_empty() {
            let mut counted: Vec<(Kind, usize)> = Vec::new();
            for kind in casts {
                match counted.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, n)) => *n += 1,
                    None => counted.push((kind, 1)),
                }
            }
            let said: Vec<String> =
                counted.iter().map(|(k, n)| format!("{n} cast{} to {k:?}", if *n == 1 { "" } else { "s" })).collect();
            writeln!(
                f,
                "autocast: {}, recorded in the region as libtorch's autocast inserts them; their copies in the peak",
                said.join(", ")
            )?;
        }
        if let Some((name, bytes)) = self.optimizer {
            let verdict = if bytes > self.peak { "the step's peak" } else { "below the backward's peak" };
            writeln!(
                f,
                "optimizer: {name}'s step after the backward peaks at {} (the gradients, the state a first step creates, its temporaries): {verdict}",
                crate::svg::bytes(bytes as f64)
            )?;
        }
        let cal = &self.calibration;
        if cal.measured + cal.remembered > 0 {
            writeln!(
                f,
                "calibrated: {} kernel call(s) measured in {:.1} ms, {} measured earlier, {} priced by rules trusted on this machine's key (Options::calibrate)",
                cal.measured,
                cal.elapsed.as_secs_f64() * 1e3,
                cal.remembered,
                cal.by_rules
            )?;
        } else if cal.by_rules > 0 {
            // Off the rules' key, what rules still price is libtorch's own formulas (saved
            // tensors, temporaries), never a product's or a convolution's kernel.
            let off_key = cal.machine.is_some_and(|m| !m.reads_rules_of(&crate::lazy::CpuMachine::rules_read_on()));
            let which = if off_key {
                "libtorch's formulas (no kernel rule: not the rules' machine)"
            } else {
                "rules trusted on this machine's key"
            };
            writeln!(f, "priced by {which}: {} kernel call(s), none measured", cal.by_rules)?;
        }
        if let Some(machine) = cal.machine.filter(|_| !cal.is_empty()) {
            writeln!(f, "machine: {machine}; rules read on {}", crate::lazy::CpuMachine::rules_read_on())?;
        }
        if cal.unmeasured > 0 {
            writeln!(
                f,
                "not calibrated: {} kernel call(s) priced by rules not validated here, which may be under ({})",
                cal.unmeasured,
                cal.why_unmeasured.as_deref().unwrap_or("not measured")
            )?;
        }
        if self.correction > 0 {
            writeln!(
                f,
                "verified: an earlier run of this graph measured more than its plan; held in reserve at micro-batch {}: {} ({} per sample)",
                self.micro_batch,
                crate::svg::bytes(self.correction as f64),
                crate::svg::bytes(self.correction_bytes_per_sample() as f64)
            )?;
        }
        if self.mode == Mode::Backward && self.splits() && self.in_place {
            writeln!(
                f,
                "gradients: added into .grad in place, one copy (it is none: opt.zero_grad()); every micro-batch after \
                 the first runs with all {} of it, the table's steps being the first's: in the peak",
                crate::svg::bytes(self.grad_bytes as f64)
            )?;
        } else if self.mode == Mode::Backward && self.splits() && self.new_grads > 0 {
            writeln!(
                f,
                "gradients: each micro-batch's kept apart until its backward completes, then added (.grad holds \
                 earlier gradients, which a failed micro-batch must leave as they were); the first creates {} of .grad \
                 that does not exist yet, every later one runs with it: in the peak",
                crate::svg::bytes(self.new_grads as f64)
            )?;
        } else if self.mode == Mode::Backward && self.splits() {
            writeln!(
                f,
                "gradients: each micro-batch's kept apart until its backward completes, then added into .grad (it \
                 holds earlier gradients, which a failed micro-batch must leave as they were): in the peak"
            )?;
        }
        writeln!(
            f,
            "peak = {} per sample x {} + {} fixed",
            crate::svg::bytes(self.per_sample_at_peak as f64),
            self.micro_batch,
            crate::svg::bytes(self.fixed_bytes() as f64)
        )?;
        writeln!(
            f,
            "{:>5}  {:<9} {:<26} {:<24} {:>10} {:>10} {:>10}",
            "#", "phase", "op", "shape", "bytes", "peak", "live"
        )?;
        for (k, s) in self.steps().iter().enumerate() {
            let op = &self.ops()[s.node];
            let phase = match s.phase {
                Phase::Forward => "fwd",
                Phase::Backward => "bwd",
                Phase::Recompute => "re-fwd",
                Phase::Accumulate => "acc",
            };
            let mut name = op.name.to_string();
            if op.view {
                name.push_str(" (view)");
            }
            if let Some(d) = op.batch_dim {
                name.push_str(&format!(" [b@{d}]"));
            }
            let marker = if k == self.peak_step { "  <- peak" } else { "" };
            let shape = format!("{:?}", op.shape);
            let (node, name) = if s.phase == Phase::Accumulate {
                (String::new(), "grad += micro-batch".to_string())
            } else {
                (s.node.to_string(), name)
            };
            writeln!(
                f,
                "{node:>5}  {phase:<9} {name:<26} {shape:<24} {:>10} {:>10} {:>10}{marker}",
                crate::svg::bytes(s.bytes as f64),
                crate::svg::bytes(s.during as f64),
                crate::svg::bytes(s.live as f64)
            )?;
        }
        Ok(())
    }
}
