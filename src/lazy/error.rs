//! The one error type of `toma::lazy`.

use tch::{Device, Kind, TchError};

use crate::oom::OutOfMemory;

/// Why recording, planning or running a lazy computation failed.
///
/// Recording errors (shapes, kinds, devices, arguments) are reported by the op that is being
/// recorded, before anything runs, and name the op and the shapes involved, as tch would.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LazyError {
    /// Two operands whose shapes do not fit together.
    #[error("toma::lazy: {op}: shapes {lhs:?} and {rhs:?} do not fit: {reason}")]
    Shape {
        /// The op being recorded.
        op: String,
        /// The first operand's shape.
        lhs: Vec<i64>,
        /// The second operand's shape.
        rhs: Vec<i64>,
        /// What is wrong.
        reason: String,
    },
    /// An argument that does not fit the input (a dimension, a kernel size, ..).
    #[error("toma::lazy: {op}: invalid argument for an input of shape {shape:?}: {reason}")]
    Argument {
        /// The op being recorded.
        op: String,
        /// The input's shape.
        shape: Vec<i64>,
        /// What is wrong.
        reason: String,
    },
    /// An operand of a kind the op does not take.
    #[error("toma::lazy: {op}: kind {kind:?} of an input of shape {shape:?} is not supported: {reason}")]
    Kind {
        /// The op being recorded.
        op: String,
        /// The offending kind.
        kind: Kind,
        /// The input's shape.
        shape: Vec<i64>,
        /// What the op expects.
        reason: String,
    },
    /// Operands on different devices.
    #[error("toma::lazy: {op}: operands on different devices: {lhs:?} (shape {lhs_shape:?}) and {rhs:?} (shape {rhs_shape:?})")]
    Device {
        /// The op being recorded.
        op: String,
        /// The first operand's device.
        lhs: Device,
        /// The first operand's shape.
        lhs_shape: Vec<i64>,
        /// The second operand's device.
        rhs: Device,
        /// The second operand's shape.
        rhs_shape: Vec<i64>,
    },
    /// The batch dimension cannot be followed through the op (two batch sizes, or a fixed
    /// operand that looks per-sample).
    #[error("toma::lazy: {op}: batch dimension: shapes {lhs:?} and {rhs:?}: {reason}")]
    Batch {
        /// The op being recorded.
        op: String,
        /// The first operand's shape.
        lhs: Vec<i64>,
        /// The second operand's shape.
        rhs: Vec<i64>,
        /// What is wrong.
        reason: String,
    },
    /// The computation mixes samples of the batch, so running it in micro-batches would change
    /// its result. Raised only when the batch does not fit and must be split.
    #[error(
        "toma::lazy: {} cannot be split: op #{node} `{op}` {reason}; {}",
        split_cause(*.batch, *.requested, *.peak, *.budget),
        mixing_remedy(*.splits_anyway)
    )]
    MixesBatch {
        /// Position of the op in the plan.
        node: usize,
        /// The op that mixes samples.
        op: String,
        /// How it mixes them.
        reason: String,
        /// The full batch size.
        batch: usize,
        /// Planned peak bytes of the full batch.
        peak: u64,
        /// The memory budget in bytes.
        budget: u64,
        /// The micro-batch asked for with [`Options::micro_batch`](super::Options::micro_batch),
        /// when the split was asked for rather than needed.
        requested: Option<usize>,
        /// Whether [`Options::allow_batch_mixing`](super::Options::allow_batch_mixing) would split
        /// it: the op mixes samples by statistics over the batch (batch norm, a mean over it).
        /// Not where it moves samples across the batch dimension (a `view` that folds the batch
        /// into other dimensions): the step's value then needs the whole batch at once.
        splits_anyway: bool,
    },
    /// A plan asked for before the kernel calls it needs measured were measured: on this
    /// machine no rule read here prices them ([`CpuMachine::reads_rules_of`](crate::lazy::CpuMachine::reads_rules_of)),
    /// and rules read elsewhere can be far under (an LSTM 3.6×, `Half` products on AVX512-FP16
    /// 60%). Measure them first with [`LazyTensor::calibrate`](crate::lazy::LazyTensor::calibrate)
    /// (the first step does it too), or plan by the rules anyway with
    /// [`Calibrate::Never`](crate::lazy::Calibrate::Never).
    #[error(
        "toma::lazy: the plan needs {calls} kernel call(s) measured on this machine, first `{op}`, and none was \
         measured yet: call `.calibrate(mode, &options)` on the value first (the first step measures them too), or \
         plan by rules read on another machine, which may be under, with `Options::calibrate(Calibrate::Never)`"
    )]
    NotCalibrated {
        /// Kernel calls that want measuring.
        calls: usize,
        /// The op of the first.
        op: String,
    },
    /// The value asked for cannot be put together from micro-batches.
    #[error("toma::lazy: {op} (shape {shape:?}) cannot be computed in micro-batches: {reason}")]
    NotSplittable {
        /// The op whose value was asked for.
        op: String,
        /// Its shape.
        shape: Vec<i64>,
        /// Why.
        reason: String,
    },
    /// No plan fits the budget: not the smallest micro-batch, not recomputing activations,
    /// where each was allowed. The fields name the lowest peak any plan reaches and how.
    #[error(
        "toma::lazy: {op}: no plan fits the budget of {}: the lowest peak any plan reaches is {} at op #{peak_node} `{peak_op}` ({}){}{}{}",
        sized(*.budget),
        sized(*.peak),
        plan_note(*.micro_batch, *.batch, *.segments),
        reserve_note(*.reserved),
        split_note(.split_refused.as_deref()),
        step_note(peak_op, *.step_floor, *.peak)
    )]
    DoesNotFit {
        /// The output op.
        op: String,
        /// The lowest planned peak in bytes.
        peak: u64,
        /// Where that peak is.
        peak_node: usize,
        /// The op at that peak.
        peak_op: String,
        /// The memory budget in bytes.
        budget: u64,
        /// Bytes held in reserve beside the plan: what earlier runs of this graph measured
        /// above their plans (0 when none did).
        reserved: u64,
        /// The micro-batch of the plan with the lowest peak (the whole batch when splitting is
        /// ruled out).
        micro_batch: usize,
        /// The whole batch (saturating at `u32::MAX`).
        batch: u32,
        /// How many segments that plan recomputes in (`None`: it recomputes nothing).
        segments: Option<u32>,
        /// Why the batch may not be split (the op that rules it out), when it may not.
        split_refused: Option<Box<str>>,
        /// Whether `peak` is the optimizer's step's, which holds every gradient, the state its
        /// first step creates and its temporaries at once, whatever the micro-batch: no split
        /// lowers it, and the budget must be at least `peak`.
        step_floor: bool,
    },
    /// Every plan whose allocated bytes fit the budget needs a block libtorch's CUDA caching
    /// allocator could not place: its cached free pieces are too small for it and the card
    /// cannot back a new segment (fragmentation). `request` names the smallest plan tried and
    /// the request that failed in the replay of the allocator (`Plan::reserved_bytes`).
    #[error(
        "toma::lazy: {op}: no plan is placed by the CUDA caching allocator within {}: the smallest tried: {request}{}",
        sized(*.budget),
        not_placed_hint(*.expandable, *.with_expandable)
    )]
    NotPlaced {
        /// The output op.
        op: String,
        /// The memory budget in bytes.
        budget: u64,
        /// The smallest plan tried, and the request of its step the allocator did not place.
        request: Box<crate::lazy::unplaced::UnplacedRequest>,
        /// Whether the replay used expandable segments.
        expandable: bool,
        /// Where the replay used libtorch's default segments: the bytes the same plan reserves
        /// with expandable segments, if they place it.
        with_expandable: Option<u64>,
    },
    /// `backward` on a value that is not a scalar.
    #[error("toma::lazy: backward needs a scalar loss, `{op}` has shape {shape:?}")]
    NotScalar {
        /// The output op.
        op: String,
        /// Its shape.
        shape: Vec<i64>,
    },
    /// An operation that toma::lazy cannot plan: never run eagerly behind the user's back.
    #[error("toma::lazy: `{op}` cannot be planned: {reason}")]
    Unsupported {
        /// The op.
        op: String,
        /// Why, and what to do instead.
        reason: String,
    },
    /// An op produced a shape other than the one its shape rule promised. Checked for every op
    /// the first time a graph of its structure runs at a micro-batch size on a thread; later
    /// runs of that structure (every step of a loop) take its shapes as checked.
    #[error("toma::lazy: op #{node} `{op}` produced shape {actual:?}, its shape rule promised {expected:?}")]
    ShapeRule {
        /// Position of the op in the plan.
        node: usize,
        /// The op.
        op: String,
        /// The shape the rule gave (at the micro-batch size).
        expected: Vec<i64>,
        /// The shape the op produced.
        actual: Vec<i64>,
    },
    /// libtorch failed while running an op (an out-of-memory among others).
    #[error("toma::lazy: {}`{op}` failed: {}", node.map(|n| format!("op #{n} ")).unwrap_or_default(), without_frames(source))]
    Torch {
        /// Position of the op in the plan (`None`: reading a value outside the graph).
        node: Option<usize>,
        /// The op.
        op: String,
        /// libtorch's error.
        #[source]
        source: TchError,
    },
    /// The inputs wrapped with [`lazy`](super::lazy) have no sample along their batch
    /// dimension: there is nothing to plan or run. Skip the step for an empty batch (tch would
    /// return an empty output, or a NaN mean loss).
    #[error("toma::lazy: the batch is empty (input of shape {shape:?} has size 0 along its batch dimension {dim}); skip the step for an empty batch")]
    EmptyBatch {
        /// The shape of the first input found empty.
        shape: Vec<i64>,
        /// Its batch dimension.
        dim: usize,
    },
    /// The ranks of [`Options::group`](super::Options::group) could not agree, or the gradient
    /// all-reduce failed.
    #[cfg(feature = "dist")]
    #[error("toma::lazy: {0}")]
    Dist(#[from] crate::dist::DistError),
}

/// libtorch's message without the C++ frames it appends ("Exception raised from .. frame #0:
/// .."): they point into libtorch, never at the user's code. The full text stays in the
/// error's `source()`.
fn without_frames(error: &TchError) -> String {
    let text = error.to_string();
    let cut = ["\nException raised from", "\nframe #"].iter().filter_map(|m| text.find(m)).min();
    match cut {
        Some(at) => text[..at].trim_end().to_string(),
        None => text,
    }
}

/// A recording or running error turned into a panic at the user's line, as tch's panicking
/// methods do: `#[track_caller]` reaches through this (a closure passed to `unwrap_or_else`
/// would report its own line inside toma instead).
pub(crate) trait OrPanic<T> {
    /// The value, or a panic with the error's message at the caller's location.
    fn or_panic(self) -> T;
}

impl<T, E: std::fmt::Display> OrPanic<T> for Result<T, E> {
    #[track_caller]
    #[inline]
    fn or_panic(self) -> T {
        match self {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        }
    }
}

impl OutOfMemory for LazyError {
    fn is_out_of_memory(&self) -> bool {
        match self {
            LazyError::Torch { source, .. } => source.is_out_of_memory(),
            _ => false,
        }
    }
}

/// Why a batch was to be split: asked for, or too large for the budget.
fn split_cause(batch: usize, requested: Option<usize>, peak: u64, budget: u64) -> String {
    match requested {
        Some(micro) => {
            format!("the batch of {batch} was asked to run in micro-batches of {micro} (Options::micro_batch), but")
        }
        None => format!(
            "the batch of {batch} does not fit (peak {} at the full batch, budget {}) and",
            sized(peak),
            sized(budget)
        ),
    }
}

/// What to do about [`LazyError::MixesBatch`].
fn mixing_remedy(splits_anyway: bool) -> &'static str {
    match splits_anyway {
        true => "use Options::allow_batch_mixing(true) to split anyway (each micro-batch then uses its own statistics)",
        false => {
            "no option splits it, as the step's value then needs the whole batch at once: give the step the whole \
             batch's budget, or keep the batch dimension whole through the op"
        }
    }
}

/// How the lowest plan of [`LazyError::DoesNotFit`] runs.
fn plan_note(micro_batch: usize, batch: u32, segments: Option<u32>) -> String {
    let split = if micro_batch as u64 >= u64::from(batch) {
        format!("the whole batch of {batch}")
    } else {
        format!("in micro-batches of {micro_batch} of a batch of {batch}")
    };
    match segments {
        Some(s) => format!("recomputing activations in {s} segments, {split}"),
        None => split,
    }
}

/// Bytes as a person reads them, the exact count beside (`40.2 MiB (42152345 B)`).
/// What to do about [`LazyError::NotPlaced`].
fn not_placed_hint(expandable: bool, with_expandable: Option<u64>) -> String {
    match (expandable, with_expandable) {
        (true, _) => "; give a larger budget".into(),
        (false, Some(reserved)) => format!(
            "; with expandable segments the same plan is placed, {} reserved: set \
             Options::expandable_segments(true) (or `expandable_segments:True` in a described card's settings)",
            sized(reserved)
        ),
        (false, None) => "; expandable segments would not place it either: give a larger budget".into(),
    }
}

fn sized(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} B")
    } else {
        format!("{} ({bytes} B)", crate::svg::bytes(bytes as f64))
    }
}

/// Why splitting was ruled out, for [`LazyError::DoesNotFit`]'s message.
fn split_note(refused: Option<&str>) -> String {
    match refused {
        Some(why) => format!("; splitting the batch is ruled out: {why}"),
        None => String::new(),
    }
}

/// The optimizer's part of [`LazyError::DoesNotFit`]'s message: what to give.
fn step_note(step: &str, floor: bool, needs: u64) -> String {
    match floor {
        true => format!(
            "; the {step} alone needs {} (every gradient, the state its first step creates, its temporaries) \
             whatever the micro-batch: no split lowers it; give a budget of at least {}",
            sized(needs),
            sized(needs)
        ),
        false => String::new(),
    }
}

/// The reserve's part of [`LazyError::DoesNotFit`]'s message.
fn reserve_note(reserved: u64) -> String {
    if reserved == 0 {
        String::new()
    } else {
        format!(
            " and {} held in reserve for what earlier runs of this graph measured above their plans",
            sized(reserved)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_frames_are_dropped_from_the_message() {
        let source = TchError::Torch(
            "mat1 and mat2 shapes cannot be multiplied (4x3 and 2x3)\nException raised from meta at \
             /pytorch/aten/src/ATen/native/LinearAlgebra.cpp:197 (most recent call first):\nframe #0: \
             c10::Error::Error(c10::SourceLocation, std::string) + 0x96"
                .into(),
        );
        let e = LazyError::Torch { node: Some(3), op: "mm".into(), source };
        let text = e.to_string();
        assert!(text.ends_with("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x3)"), "{text}");
        assert!(text.starts_with("toma::lazy: op #3 `mm` failed: "), "{text}");
        // The whole text is still there for whoever walks the chain.
        let inner = std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default();
        assert!(inner.contains("frame #0"), "{inner}");
    }
}
