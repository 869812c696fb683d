//! Plan memory up front, run in micro-batches, get the full batch's gradients.
//!
//! Wrap the inputs with [`lazy`]; every op on them (tch's names: `relu`, `matmul`, `conv2d`,
//! `cross_entropy_for_logits`, ..) is recorded, shape-checked at once, and run only when a
//! value is needed. Then:
//!
//! - [`LazyTensor::backward`] plans the peak memory of forward and backward, picks the largest
//!   micro-batch that fits (the whole batch when it fits: no split), runs forward and backward
//!   per micro-batch and accumulates parameter gradients — equal to one full-batch backward,
//!   mean-reduced losses included — and returns the full-batch loss;
//! - [`LazyTensor::to_tensor`] (and `Display`, `Debug`, `f64::try_from`, `double_value`)
//!   computes a value, concatenating micro-batch outputs along the batch dimension;
//! - [`LazyTensor::plan`] shows the plan without running anything; [`Plan`] prints as a table.
//!
//! ```
//! use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
//! use toma::lazy::{lazy, Options};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let (l1, l2) = (nn::linear(vs.root() / "l1", 16, 32, Default::default()), nn::linear(vs.root() / "l2", 32, 4, Default::default()));
//! let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
//! let images = Tensor::randn([100, 16], (Kind::Float, Device::Cpu));
//! let labels = Tensor::randint(4, [100], (Kind::Int64, Device::Cpu));
//!
//! // The one line toma::lazy needs: the batch dimension of the inputs.
//! let (x, y) = lazy((&images, &labels), 0);
//! let loss = x.apply(&l1).relu().apply(&l2).cross_entropy_for_logits(&y);
//!
//! // A tiny budget forces micro-batches; the gradients are the full batch's all the same.
//! let options = Options::new().budget(40 << 10);
//! println!("{}", loss.plan(toma::lazy::Mode::Backward, &options)?);
//! opt.zero_grad();
//! let value = loss.backward_with(&options)?;
//! opt.step();
//! assert!(value > 0.0);
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```
//!
//! # What splits, and what does not
//!
//! A value's samples are followed through every op: elementwise ops, products, convolutions,
//! pooling, normalizations over features, views that keep samples together (`[N, T, C] ->
//! [N * T, C]`) keep them per-sample. Sums and means over the batch (`sum`, `mean`, the losses)
//! add up over micro-batches, each weighted by its share, and so do linear combinations of them
//! (`loss + 0.01 * l2`). Ops that mix samples — batch norm in training mode, softmax or layer
//! norm over the batch dimension, a batch statistic used per sample — make splitting change
//! the result: when the batch does not fit they are refused with [`LazyError::MixesBatch`]
//! naming the op, unless [`Options::allow_batch_mixing`] says otherwise. Nothing is ever run
//! eagerly on the full batch behind your back: an op the graph cannot plan is an error.
//!
//! # Plan, then verify
//!
//! Micro-batches run under the retry engine ([`Range`](crate::Range)): one that still runs out
//! of memory is halved and redone (its gradients are added only after its backward completed,
//! so nothing counts twice), and the size that worked is remembered in toma's cache, per graph
//! shape. A `tracing` info event reports each plan (peak, budget, micro-batch, chunks).

mod custom;
mod error;
mod exec;
mod graph;
mod index;
mod int_list;
pub mod models;
pub mod nn;
mod ops;
mod plan;
mod scratch;
mod shape;
mod tch_compat;
mod tensor;
mod tensor_ops;
pub mod vision;

pub use custom::{CustomOp, Saves, TensorMeta};
pub use error::LazyError;
pub use exec::TracedOp;
pub use graph::LazyTensor;
pub use index::{LazyIndexer, TensorIndex};
pub use int_list::{IntList, IntListOption};
pub use plan::{round_block, Mode, Phase, Plan, PlanOp, Step, BLOCK};
pub use tensor::{IntoLazy, OpCosts, Split};
pub use tensor_ops::{Layer, LayerT, TensorOps};

use tch::Tensor;

use crate::cache::CacheKind;
use crate::ConfigError;

/// How to plan and run: the memory budget, splitting policy and cache.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub(crate) budget: Option<u64>,
    pub(crate) margin: f64,
    pub(crate) micro_batch: Option<usize>,
    pub(crate) allow_batch_mixing: bool,
    pub(crate) cache: Option<CacheKind>,
    pub(crate) retry: bool,
    #[cfg(feature = "dist")]
    pub(crate) group: Option<crate::dist::Group>,
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

    /// The fraction of free memory kept back when the budget is not given (0.1 unless told).
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
    /// statistics): each micro-batch then uses statistics of its own samples.
    pub fn allow_batch_mixing(mut self, allow: bool) -> Self {
        self.allow_batch_mixing = allow;
        self
    }

    /// The cache that remembers micro-batch sizes after an out-of-memory (the process default
    /// unless told).
    pub fn cache(mut self, kind: CacheKind) -> Self {
        self.cache = Some(kind);
        self
    }

    /// Whether a micro-batch that runs out of memory is halved and redone (on unless told).
    pub fn retry(mut self, retry: bool) -> Self {
        self.retry = retry;
        self
    }

    /// Trains as one rank of `group` (feature `dist`): [`backward_with`](LazyTensor::backward_with)
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

/// What [`lazy`] wraps: a tensor, or a tuple, array or `Vec` of them.
pub trait Lazify {
    /// The lazy counterpart: a [`LazyTensor`], or a tuple/array/`Vec` of them.
    type Output;

    /// Wraps with batch dimension `batch` (`None`: no batch dimension).
    ///
    /// # Errors
    /// [`LazyError::Argument`] when a tensor has no such dimension, [`LazyError::Batch`] when
    /// the tensors' batch sizes differ.
    fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError>;

    /// The batch sizes of what is wrapped, to check that they agree.
    #[doc(hidden)]
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>);
}

impl Lazify for &Tensor {
    type Output = LazyTensor;
    fn lazify(self, batch: Option<i64>) -> Result<LazyTensor, LazyError> {
        match batch {
            Some(dim) => LazyTensor::batched(self, dim),
            None => Ok(LazyTensor::fixed(self)),
        }
    }
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
        if let Some(dim) = batch {
            let shape = self.size();
            if let Ok(d) = shape::wrap_dim(dim, shape.len()) {
                if let Some(&size) = shape.get(d) {
                    sizes.push((shape, size));
                }
            }
        }
    }
}

macro_rules! lazify_tuple {
    ($($name:ident),+) => {
        impl<$($name: Lazify),+> Lazify for ($($name,)+) {
            type Output = ($($name::Output,)+);
            #[allow(non_snake_case)]
            fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError> {
                let ($($name,)+) = self;
                Ok(($($name.lazify(batch)?,)+))
            }
            #[allow(non_snake_case)]
            fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
                let ($($name,)+) = self;
                $($name.batch_sizes(batch, sizes);)+
            }
        }
    };
}

lazify_tuple!(A);
lazify_tuple!(A, B);
lazify_tuple!(A, B, C);
lazify_tuple!(A, B, C, D);
lazify_tuple!(A, B, C, D, E);
lazify_tuple!(A, B, C, D, E, F);

impl<const K: usize> Lazify for &[Tensor; K] {
    type Output = [LazyTensor; K];
    fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError> {
        let v = self.as_slice().lazify(batch)?;
        Ok(v.try_into().unwrap_or_else(|_| unreachable!("K tensors give K lazy tensors")))
    }
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
        self.as_slice().batch_sizes(batch, sizes)
    }
}

impl Lazify for &[Tensor] {
    type Output = Vec<LazyTensor>;
    fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError> {
        self.iter().map(|t| t.lazify(batch)).collect()
    }
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
        for t in self.iter() {
            t.batch_sizes(batch, sizes);
        }
    }
}

impl Lazify for &Vec<Tensor> {
    type Output = Vec<LazyTensor>;
    fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError> {
        self.as_slice().lazify(batch)
    }
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
        self.as_slice().batch_sizes(batch, sizes)
    }
}

/// A batch dimension argument: `0`, `-1`, `Some(0)`, or `None` for no batch dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchDimArg(pub Option<i64>);

impl From<i32> for BatchDimArg {
    fn from(d: i32) -> Self {
        BatchDimArg(Some(i64::from(d)))
    }
}
impl From<i64> for BatchDimArg {
    fn from(d: i64) -> Self {
        BatchDimArg(Some(d))
    }
}
impl From<usize> for BatchDimArg {
    fn from(d: usize) -> Self {
        BatchDimArg(Some(d as i64))
    }
}
impl From<Option<i64>> for BatchDimArg {
    fn from(d: Option<i64>) -> Self {
        BatchDimArg(d)
    }
}

/// Wraps inputs for lazy recording, all with the same batch dimension: a tensor, or a tuple,
/// array or `Vec` of them (`lazy((&input, &label), 0)`, as koila's `lazy(input, label,
/// batch=0)`).
///
/// # Panics
/// When a tensor has no such dimension, or the tensors' batch sizes differ; [`try_lazy`]
/// reports these as errors.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let input = Tensor::randn([8, 3, 4, 4], (Kind::Float, Device::Cpu));
/// let label = Tensor::zeros([8], (Kind::Int64, Device::Cpu));
/// let (x, y) = toma::lazy::lazy((&input, &label), 0);
/// assert_eq!((x.batch_dim(), y.batch_size()), (Some(0), Some(8)));
/// ```
#[track_caller]
pub fn lazy<L: Lazify>(inputs: L, batch: impl Into<BatchDimArg>) -> L::Output {
    try_lazy(inputs, batch).unwrap_or_else(|e| panic!("{e}"))
}

/// Like [`lazy`], with bad dimensions and mismatched batch sizes reported as errors.
///
/// # Errors
/// [`LazyError::Argument`] for a dimension a tensor lacks, [`LazyError::Batch`] for batch
/// sizes that differ.
pub fn try_lazy<L: Lazify>(inputs: L, batch: impl Into<BatchDimArg>) -> Result<L::Output, LazyError> {
    let batch = batch.into().0;
    let mut sizes = Vec::new();
    inputs.batch_sizes(batch, &mut sizes);
    if let Some((first_shape, first)) = sizes.first() {
        if let Some((shape, size)) = sizes.iter().find(|(_, s)| s != first) {
            return Err(LazyError::Batch {
                op: "lazy".into(),
                lhs: first_shape.clone(),
                rhs: shape.clone(),
                reason: format!("batch sizes {first} and {size} differ along dimension {batch:?}"),
            });
        }
    }
    inputs.lazify(batch)
}

impl LazyTensor {
    /// Runs the first micro-batch of `micro_batch` samples and reports, per op, the value the
    /// executor produced (shape, bytes allocated) and what it held afterwards: the facts the
    /// plan predicts, for checking a plan or debugging one.
    ///
    /// # Errors
    /// As [`to_tensor`](Self::to_tensor).
    pub fn trace(&self, mode: Mode, micro_batch: usize) -> Result<Vec<TracedOp>, LazyError> {
        exec::trace(self, mode, micro_batch)
    }
}
