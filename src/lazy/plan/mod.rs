//! The planner: the peak memory of a schedule of the forward (and backward) pass at a given
//! micro-batch, and the largest micro-batch whose peak fits the budget.
//!
//! # The memory model
//!
//! The schedule is the executor's: ops run in recording order (a topological order); the
//! executor drops each value after its last use. Each tensor costs its bytes rounded up to
//! 512 B (the CUDA caching allocator's block size); views cost nothing and keep their base
//! alive. Inputs and parameters are already in memory and cost nothing.
//!
//! In a backward plan, a tensor that autograd saves for an op's backward (what each op saves
//! is in [`ops`](super::ops)) lives until that op's backward has run, together with extras such
//! as max-pooling indices and dropout masks. The backward runs in reverse order: each op's
//! output gradient lives until its backward has run, and produces gradients for its inputs
//! (views of the output gradient where autograd makes them views); parameter gradients live
//! to the end, and parameters whose `.grad()` is not yet defined get one. Ops with scratch
//! space (im2col of a convolution, broadcast copies of a batched product) count it while they
//! run: what the cost layer ([`cost`](super::cost)) prices each op's kernel calls at on the
//! graph's device (on CUDA, the reduction kernel's staging buffers, not linear in the
//! micro-batch, and cuDNN's workspace).
//!
//! The peak is the largest sum over this schedule, not the sum of all tensors.
//!
//! The planner's parts, one way: [`compiled`] collects the graph; [`schedule`] simulates the
//! executor's schedule at a micro-batch; [`search`] holds it to the budget and picks the
//! micro-batch, with what [`correction`] learned from measured runs; [`report`] is the plan as
//! users see it.

mod compiled;
mod correction;
mod evidence;
mod placement;
mod recompute;
mod report;
mod reserved;
mod reuse;
mod schedule;
mod search;
mod snapshot;
mod time;

pub(crate) use compiled::Compiled;
pub(crate) use correction::Corrections;
pub(crate) use evidence::{Evidence, Machine, Measure};
pub(crate) use recompute::Segments;
pub use report::{Plan, PlanOp};
pub use schedule::{Mode, Phase, Step};
pub(crate) use search::Decision;
pub(crate) use time::{Choice, Timings};

use super::cost::measured::Calibration;
use super::error::LazyError;
use super::graph::LazyTensor;
use super::options::Options;

/// Remembers what measured runs find plans miss ([`Plan::correction_bytes`]), and what
/// calibration measured ([`Calibrate`](crate::lazy::Calibrate)), in a file, across processes:
/// reads what `path` holds for this machine (libtorch's release, its threads, the architecture,
/// the first CUDA card's multiprocessors; lines of another are skipped) and appends every new
/// measurement to it. Once this machine's lines pass 4096 and twice what they hold, the file is
/// rewritten with what they hold (other machines' lines kept). Returns how many measurements were read; a missing file is created. Without
/// it the corrections last as long as the process. Measurements happen where an allocator counts: on CUDA, or on the
/// CPU after [`track_cpu_allocations`](crate::memory::track_cpu_allocations).
///
/// ```
/// let path = std::env::temp_dir().join("toma-doc-corrections.txt");
/// let read = toma::lazy::remember_corrections(&path)?;
/// println!("{read} measurements of earlier runs");
/// # Ok::<(), std::io::Error>(())
/// ```
///
/// # Errors
/// The file's `io::Error` when it cannot be read, created or written.
pub fn remember_corrections(path: impl AsRef<std::path::Path>) -> std::io::Result<usize> {
    Corrections::process().remember_in(path.as_ref())
}

/// Collects the graph of `output` for planning and running.
pub(crate) fn compile(output: &LazyTensor) -> Result<Compiled, LazyError> {
    let c = compiled::compile(output)?;
    snapshot::write(&c);
    Ok(c)
}

/// What a step does before it runs: gathers the evidence (measuring what is missing where
/// `measure` allows) and the machine, then plans with them.
pub(crate) fn decide(c: &Compiled, mode: Mode, options: &Options, measure: Measure) -> Result<Decision, LazyError> {
    if options.card.is_some() {
        return Err(LazyError::Unsupported {
            op: c.output().name().into(),
            reason: "a described card (Options::card) is only planned for: its tensors are not on it;                      plan with LazyTensor::plan, or run without the card"
                .into(),
        });
    }
    // Only CUDA's allocator reads them: the CPU path stays as it is.
    if let (Some(on), tch::Device::Cuda(_)) = (options.expandable_segments, c.device()) {
        expandable_segments(on);
    }
    let machine = Machine::now(options, c);
    let evidence = Evidence::gather(c, mode, options, measure, &machine);
    if let Some(d) = reuse::find(c, mode, options, &machine, &evidence) {
        return Ok(d);
    }
    let machine = machine.read_card(c.device());
    let d = reserved::plan(c, mode, options, &machine, &evidence)?;
    reuse::keep(c, mode, options, &machine, &evidence, &d);
    Ok(d)
}

/// Plans `output` in `mode` under `options` with the evidence at hand: runs nothing. Refuses
/// where calls that want measuring were never measured though an allocator could: a plan
/// asked before measuring is never under by rules read elsewhere.
pub(crate) fn plan(output: &LazyTensor, mode: Mode, options: &Options) -> Result<Plan, LazyError> {
    let c = compile_for(output, mode)?;
    if let Some(card) = &options.card {
        // Priced for the card, by rules: nothing here measures what that card takes.
        let c = c.for_cuda(card.gpu());
        let machine = Machine::now(options, &c);
        let decision = reserved::plan(&c, mode, options, &machine, &Evidence::none(mode))?;
        return Ok(report::detail(c, decision));
    }
    let decision = decide(&c, mode, options, Measure::Never)?;
    let cal = decision.evidence.calibration();
    if cal.awaiting > 0 && crate::memory::PeakCounter::for_device(cuda_ordinal(c.device())).is_some() {
        return Err(LazyError::NotCalibrated {
            calls: cal.awaiting,
            op: cal.first_unmeasured.unwrap_or_else(|| output.op_name().to_string()),
        });
    }
    Ok(report::detail(c, decision))
}

/// Sets libtorch's expandable segments on or off ([`Options::expandable_segments`]), where they
/// are not so already; a failure (no shim) is logged once and the settings stay.
pub(crate) fn expandable_segments(on: bool) {
    use crate::lazy::cost::caching::Config;
    if Config::libtorch().is_some_and(|c| c.expandable_segments == on) {
        return;
    }
    let settings = if on { "expandable_segments:True" } else { "expandable_segments:False" };
    if let Err(e) = crate::memory::set_allocator_settings(settings) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!(error = %e, "toma::lazy: could not set {settings}"));
    }
}

/// The CUDA ordinal of a device (`None`: the CPU's allocator and generator).
pub(crate) fn cuda_ordinal(device: tch::Device) -> Option<usize> {
    match device {
        tch::Device::Cuda(i) => Some(i),
        _ => None,
    }
}

/// Measures what no rule read on this machine prices in the plan of `output` in `mode`
/// (under `options.calibrate`), for later plans and steps to find.
pub(crate) fn calibrate(output: &LazyTensor, mode: Mode, options: &Options) -> Result<Calibration, LazyError> {
    let c = compile_for(output, mode)?;
    let machine = Machine::now(options, &c);
    Ok(Evidence::gather(&c, mode, options, Measure::Now, &machine).calibration())
}

/// [`compile`], refusing a backward of what is not a scalar.
fn compile_for(output: &LazyTensor, mode: Mode) -> Result<Compiled, LazyError> {
    let c = compile(output)?;
    if mode == Mode::Backward && !output.node().meta.shape.is_empty() && output.numel() != 1 {
        return Err(LazyError::NotScalar { op: output.op_name().into(), shape: output.size() });
    }
    Ok(c)
}
