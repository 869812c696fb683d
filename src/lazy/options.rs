//! How to plan and run: the memory budget, splitting policy and cache.

use crate::cache::CacheKind;
use crate::ConfigError;

/// Whether a backward that does not fit may drop saved activations after the forward and
/// compute them again before their backward ([`Options::recompute`]).
///
/// Recomputing keeps the whole batch together: batch norm's statistics, running statistics and
/// losses over pairs of samples (InfoNCE, `z · zᵀ`) stay the full batch's, where splitting the
/// batch would change them (and is refused unless [`Options::allow_batch_mixing`]). Each
/// recomputed op runs twice, bit for bit the same (random ops replay the generator's state).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Recompute {
    /// The plan that fits with the lowest estimated step time: the whole batch, micro-batches,
    /// recomputed segments, or segments in micro-batches. A computation that mixes samples is
    /// never split: it recomputes, or fails with the lowest peak any plan reaches.
    #[default]
    Auto,
    /// Never recompute: split the batch, as before recomputing existed.
    Never,
    /// Recompute before splitting, whenever the whole batch does not fit as it is; split the
    /// recomputing plan only where recomputing alone does not fit.
    Always,
}

/// Whether a plan measures kernel calls before pricing them ([`Options::calibrate`]).
///
/// The allocator measures the truth on every machine; the planner's rules are a prior, read on
/// one machine ([`CpuMachine::rules_read_on`](crate::lazy::CpuMachine::rules_read_on): one
/// libtorch release, oneDNN's AVX-512 kernels, 1 and 2 threads, a few kinds). Under `Auto`, a
/// call whose memory depends on the library's kernel choice (convolutions, oneDNN's `BFloat16`
/// products, CUDA's convolutions) is measured unless its rule was read on exactly
/// this machine ([`CpuMachine::host`](crate::lazy::CpuMachine::host): the libtorch release,
/// the instruction set oneDNN uses, the threads), and so is a call no rule knows (a
/// [`CustomOp`](crate::lazy::CustomOp)). The call runs alone at 1, 2, 8, 32 and 128 samples
/// below its batch, each power of two from 256 below it, and at the batch, on stand-in inputs
/// under the allocator counter (every power of two between where one line does not fit them),
/// and the plan uses what the counter saw. A step measures before it plans;
/// [`LazyTensor::plan`](crate::lazy::LazyTensor::plan) runs nothing, and finds what
/// [`LazyTensor::calibrate`](crate::lazy::LazyTensor::calibrate) or an earlier step measured
/// (what it lacks, it prices by rules and says so). A call is measured once per
/// shape in a process (and across processes with
/// [`remember_corrections`](crate::lazy::remember_corrections)); the printed plan says how many
/// calls were measured, what that took, how many the rules priced and for which machine.
/// Measuring needs an allocator that counts: CUDA's, or the CPU's after
/// [`track_cpu_allocations`](crate::memory::track_cpu_allocations).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Calibrate {
    /// Measure the calls no rule read on this machine prices, where an allocator counts.
    #[default]
    Auto,
    /// Never measure: rules only (steps run nothing before they run the graph).
    Never,
    /// Measure every call a rule prices, validated or not, and every custom op: what a plan
    /// would be on a machine where no rule was read.
    Always,
}

/// How to plan and run: the memory budget, splitting policy and cache.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub(crate) budget: Option<u64>,
    pub(crate) margin: f64,
    pub(crate) micro_batch: Option<usize>,
    pub(crate) allow_batch_mixing: bool,
    pub(crate) cache: Option<CacheKind>,
    pub(crate) retry: bool,
    pub(crate) recompute: Recompute,
    pub(crate) calibrate: Calibrate,
    /// The optimizer's step that follows the backward, when a toma `Optimizer` runs it.
    pub(crate) step: Option<OptimizerStep>,
    pub(crate) card: Option<crate::lazy::CudaCard>,
    pub(crate) expandable_segments: Option<bool>,
    #[cfg(feature = "dist")]
    pub(crate) group: Option<crate::dist::Group>,
}

/// An optimizer's step after the backward, as a plan counts it: each trainable parameter in
/// the optimizer's order (its storage's address and bytes), the state the step keeps per
/// parameter and the temporaries it makes per parameter, each in multiples of the parameter
/// (the facts of each optimizer are in `lazy::optim`), and whether the step creates its state
/// (the first one).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct OptimizerStep {
    pub(crate) name: &'static str,
    pub(crate) params: Vec<(usize, u64)>,
    pub(crate) state: u64,
    pub(crate) temporaries: u64,
    pub(crate) first: bool,
}

impl OptimizerStep {
    /// Bytes the step takes above what the backward left, over the parameters that get a
    /// gradient (`reached`, by address): the first step creates each parameter's state as it
    /// reaches it, its temporaries beside; a later one only its temporaries.
    pub(crate) fn bytes(&self, reached: impl Fn(usize) -> bool) -> u64 {
        let mut state = 0u64;
        let mut peak = 0u64;
        for &(_, bytes) in self.params.iter().filter(|(a, _)| reached(*a)) {
            if self.first {
                state += self.state * bytes;
            }
            peak = peak.max(state + self.temporaries * bytes);
        }
        peak
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            budget: None,
            margin: 0.1,
            micro_batch: None,
            allow_batch_mixing: false,
            cache: None,
            retry: true,
            recompute: Recompute::Auto,
            calibrate: Calibrate::Auto,
            step: None,
            card: None,
            expandable_segments: None,
            #[cfg(feature = "dist")]
            group: None,
        }
    }
}

impl Options {
    /// The defaults: the budget is the free memory of the inputs' device less 10 %.
    pub fn new() -> Self {
        Self::default()
    }

    /// A budget in bytes, instead of the device's free memory.
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// Plans for a CUDA card described rather than present ([`CudaCard`](crate::lazy::CudaCard)):
    /// [`LazyTensor::plan`](crate::lazy::LazyTensor::plan) then prices the graph for that card
    /// and holds it to what the card's caching allocator can reserve, on any machine. The budget
    /// is what the card has left once `in_use` and the graph's own parameters and inputs are
    /// placed, less the margin, unless [`Options::budget`] sets it. Plans only: a step run with
    /// a card refuses.
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, CudaCard, Mode, Options};
    /// let w = Tensor::randn([512, 512], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let x = Tensor::zeros([4096, 512], (Kind::Float, Device::Cpu));
    /// let loss = lazy(&x, 0).matmul(&w).relu().matmul(&w).sum(None);
    /// let card = CudaCard::new(32 << 20); // a 32 MiB card: 9 MiB of it for `x` and `w`
    /// let plan = loss.plan(Mode::Backward, &Options::new().card(card))?;
    /// assert!(plan.splits() || plan.recomputes());
    /// assert!(plan.reserved_bytes().unwrap() >= plan.peak_bytes());
    /// println!("{plan}");
    /// # Ok::<(), toma::lazy::LazyError>(())
    /// ```
    pub fn card(mut self, card: crate::lazy::CudaCard) -> Self {
        self.card = Some(card);
        self
    }

    /// Runs CUDA steps with the caching allocator's expandable segments on (`true`) or off:
    /// toma sets them through libtorch's allocator settings before the step plans (as
    /// `PYTORCH_ALLOC_CONF=expandable_segments:True` would, without the environment variable),
    /// and plans with them. The setting is the process's, as PyTorch's own is: it holds for
    /// segments made afterwards, by every thread.
    ///
    /// Expandable segments map memory in pages (2 MiB, 20 MiB) into one growing range per pool
    /// and stream, so freed pages rejoin their neighbours: prefer them where batch shapes vary
    /// from step to step, or where a plan reports reserved bytes well above allocated ones
    /// (fragmentation). The replay of libtorch's allocator says how much they save
    /// ([`Plan::reserved_bytes`](crate::lazy::Plan::reserved_bytes)). Unset by default: libtorch's own settings
    /// (its environment variable) stand.
    pub fn expandable_segments(mut self, on: bool) -> Self {
        self.expandable_segments = Some(on);
        self
    }

    /// The fraction of free memory kept back when the budget is not given (0.1 unless told).
    ///
    /// The plan counts what tensors hold (`max_memory_allocated`); on CUDA the caching
    /// allocator reserves more, and a card filled to its last GiBs can refuse a large block
    /// while enough memory is free in pieces. On an H200 a recomputed ResNet-18 planned at 89%
    /// of what was left ran out so under the default allocator and ran at 0.0% of its plan with
    /// `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (`docs/gpu.md`). Without that setting,
    /// keep back more where single activations are a large share of the budget.
    ///
    /// # Panics
    /// When `fraction` is not in `[0, 1)` (NaN included): [`ConfigError::OutOfRange`].
    #[track_caller]
    pub fn safety_margin(mut self, fraction: f64) -> Self {
        if !(0.0..1.0).contains(&fraction) {
            panic!("{}", ConfigError::OutOfRange { what: "safety margin", range: "[0, 1)", value: fraction });
        }
        self.margin = fraction;
        self
    }

    /// Runs micro-batches of this size (at most the batch), whatever the plan says.
    ///
    /// # Panics
    /// When `size` is 0: [`ConfigError::ZeroSize`].
    #[track_caller]
    pub fn micro_batch(mut self, size: usize) -> Self {
        if size == 0 {
            panic!("{}", ConfigError::ZeroSize { what: "micro-batch size" });
        }
        self.micro_batch = Some(size);
        self
    }

    /// Splits even a computation that mixes samples (batch norm in training, batch
    /// statistics): each micro-batch then uses statistics of its own samples. Batch norm's
    /// running statistics still move once per step: each micro-batch starts from the values
    /// before the step, and their updates are averaged by share (for equal micro-batches,
    /// `(1 - momentum) · old + momentum · mean of the micro-batches' statistics`).
    pub fn allow_batch_mixing(mut self, allow: bool) -> Self {
        self.allow_batch_mixing = allow;
        self
    }

    /// The cache that remembers micro-batch sizes after an out-of-memory (the process default
    /// unless told). A step's key names its graph, not its call site: under `StacktraceMemory`,
    /// the graph and the free memory, with no stack walked.
    pub fn cache(mut self, kind: CacheKind) -> Self {
        self.cache = Some(kind);
        self
    }

    /// Whether a backward that does not fit may recompute activations instead of (or as well
    /// as) splitting the batch: [`Recompute::Auto`] unless told. Forward-only plans keep no
    /// activations, so this never changes them.
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, Mode, Options, Recompute};
    ///
    /// let w = Tensor::randn([32, 32], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    /// let (mean, var) = (Tensor::zeros([32], (Kind::Double, Device::Cpu)), Tensor::ones([32], (Kind::Double, Device::Cpu)));
    /// let x = Tensor::randn([256, 32], (Kind::Double, Device::Cpu));
    /// let mut h = lazy(&x, 0);
    /// for _ in 0..8 {
    ///     // Batch norm in training mode: the batch may not be split.
    ///     h = h.matmul(&w).batch_norm(None::<&Tensor>, None::<&Tensor>, &mean, &var, true, 0.1, 1e-5).relu();
    /// }
    /// let loss = h.sum(None);
    /// let whole = loss.plan(Mode::Backward, &Options::new().recompute(Recompute::Never))?.peak_bytes();
    /// let plan = loss.plan(Mode::Backward, &Options::new().budget(whole * 7 / 10))?;
    /// assert!(plan.recomputes() && !plan.splits() && plan.peak_bytes() <= whole * 7 / 10);
    /// loss.backward_with(&Options::new().budget(whole * 7 / 10))?;
    /// assert!(w.grad().defined());
    /// # Ok::<(), toma::lazy::LazyError>(())
    /// ```
    pub fn recompute(mut self, recompute: Recompute) -> Self {
        self.recompute = recompute;
        self
    }

    /// Whether kernel calls without a rule validated on this machine are measured before they
    /// are priced ([`Calibrate`]; `Auto` unless told).
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, Calibrate, CustomOp, Mode, Options};
    ///
    /// // An op of our own that takes scratch space no rule knows of.
    /// let op = CustomOp::new("scaled", |ins| Ok(ins[0].clone()), |xs| {
    ///     let scratch = xs[0].f_repeat([4, 1])?;
    ///     xs[0].f_mul_scalar(scratch.numel() as f64)
    /// });
    /// toma::memory::track_cpu_allocations();
    /// let x = Tensor::randn([64, 32], (Kind::Float, Device::Cpu));
    /// let y = op.apply(&[&lazy(&x, 0)])?.sum(None);
    /// y.calibrate(Mode::Forward, &Options::new())?;
    /// let measured = y.plan(Mode::Forward, &Options::new())?;
    /// let rules = y.plan(Mode::Forward, &Options::new().calibrate(Calibrate::Never))?;
    /// assert_eq!(measured.calibration().measured + measured.calibration().remembered, 1);
    /// assert!(measured.peak_bytes() > rules.peak_bytes(), "the scratch is planned");
    /// # Ok::<(), toma::lazy::LazyError>(())
    /// ```
    pub fn calibrate(mut self, calibrate: Calibrate) -> Self {
        self.calibrate = calibrate;
        self
    }

    /// Whether a micro-batch that runs out of memory is halved and redone, and a training step
    /// that may not be split is planned again under a lower budget (on unless told).
    pub fn retry(mut self, retry: bool) -> Self {
        self.retry = retry;
        self
    }

    /// Trains as one rank of `group` (feature `dist`): [`backward_with`](crate::lazy::LazyTensor::backward_with)
    /// weighs every mean-reduced loss by the *global* count of samples (or counted targets),
    /// summed over the ranks, then sums every parameter's `.grad()` across the ranks (c10d Gloo).
    /// Each rank plans and splits its own batch under its own budget (ranks on different cards
    /// use different micro-batches, and may hold different batch sizes); afterwards every
    /// rank's `.grad()` equals one backward over the union of all ranks' batches, and every
    /// rank gets the loss of that union.
    ///
    /// Every rank must call it for the same model (the same graph) in step. Zero the gradients
    /// before each step (`opt.zero_grad()`): the sum covers the whole `.grad()`, so gradients
    /// left from an earlier step would be summed again. Parameters that reach the graph only
    /// through eager ops (a fixed operand computed from them) get their gradient through those
    /// ops and are not summed; sum them with [`Group::all_reduce_sum`](crate::dist::Group::all_reduce_sum).
    #[cfg(feature = "dist")]
    #[cfg_attr(docsrs, doc(cfg(feature = "dist")))]
    pub fn group(mut self, group: &crate::dist::Group) -> Self {
        self.group = Some(group.clone());
        self
    }
}
