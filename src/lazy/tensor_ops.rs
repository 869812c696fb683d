//! Write a model once: [`TensorOps`] names tch's tensor methods, and both `tch::Tensor` (plain
//! delegation) and [`LazyTensor`] implement it; [`Layer`] does the same for layers. A model
//! written over `T: TensorOps` runs eagerly on tensors and lazily — planned, in micro-batches
//! when the batch does not fit — on lazy tensors, with the same `VarStore`.
//!
//! ```
//! use tch::{nn, Device, Kind, Tensor};
//! use toma::lazy::{lazy, Layer, Options, TensorOps};
//!
//! struct Mlp { l1: nn::Linear, l2: nn::Linear }
//!
//! impl Mlp {
//!     // Written once, for tensors and lazy tensors alike.
//!     fn loss<T: TensorOps>(&self, x: &T, y: &T) -> T
//!     where
//!         nn::Linear: Layer<T>,
//!     {
//!         x.apply(&self.l1).relu().apply(&self.l2).cross_entropy_for_logits(y)
//!     }
//! }
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let m = Mlp { l1: nn::linear(vs.root() / "l1", 8, 16, Default::default()), l2: nn::linear(vs.root() / "l2", 16, 4, Default::default()) };
//! let x = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
//! let y = Tensor::randint(4, [64], (Kind::Int64, Device::Cpu));
//! let eager = m.loss(&x, &y).double_value(&[]);
//! let (lx, ly) = lazy((&x, &y), 0);
//! let planned = m.loss(&lx, &ly).backward_with(&Options::new().micro_batch(16))?;
//! assert!((eager - planned).abs() < 1e-5);
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```

use std::ops::{Add, Div, Mul, Neg, Sub};

use tch::{Device, Kind, Reduction, TchError, Tensor};

use super::error::LazyError;
use super::index::TensorIndex;
use super::nn::{Layer, LayerT};
use super::ops::{Fallible, LayoutOps, LossOps, MatrixOps, NormOps, PointwiseOps, ReduceOps, WindowOps};
use super::LazyTensor;
use crate::lazy::error::OrPanic;

/// tch's operators in generic code: with `T: TensorOps + Operators`, `h + a`, `h * &self.gamma`
/// (a parameter, no [`TensorOps::constant`] needed), `h * 0.125` and `-h` work for `h: T`.
///
/// A separate bound, not part of [`TensorOps`]: with it, `h.add(&y)` on an owned `h` finds
/// std's `Add::add`, which takes `h` by value, so code written against `TensorOps` alone keeps
/// compiling. Rust cannot carry a bound on `&T` in a trait, so in generic code the left operand
/// is owned (`xs.shallow_clone() + ..` for a borrowed one) or the method is called
/// (`xs.add(&y)`). On `LazyTensor` itself every combination tch has works: `&` or owned,
/// `Tensor` and `f64` on either side.
///
/// ```
/// use tch::{nn, Device, Kind, Tensor};
/// use toma::lazy::{lazy, Layer, Operators, TensorOps};
///
/// fn scaled<T: TensorOps + Operators>(x: &T, gamma: &Tensor, linear: &nn::Linear) -> T
/// where
///     nn::Linear: Layer<T>,
/// {
///     let h = x.apply(linear);
///     (h * gamma) * 0.5 + 1.0
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let linear = nn::linear(vs.root(), 4, 4, Default::default());
/// let gamma = vs.root().ones("gamma", &[4]);
/// let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
/// let eager = scaled(&x, &gamma, &linear);
/// let lazily = scaled(&lazy(&x, 0), &gamma, &linear).to_tensor()?;
/// assert!(eager.allclose(&lazily, 1e-6, 1e-6, false));
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
pub trait Operators:
    Sized
    + Arithmetic<Self>
    + for<'a> Arithmetic<&'a Self>
    + for<'a> Arithmetic<&'a Tensor>
    + Arithmetic<Tensor>
    + Arithmetic<f64>
    + Neg<Output = Self>
{
}

impl<T> Operators for T where
    T: Arithmetic<T>
        + for<'a> Arithmetic<&'a T>
        + for<'a> Arithmetic<&'a Tensor>
        + Arithmetic<Tensor>
        + Arithmetic<f64>
        + Neg<Output = T>
{
}

/// `+ - * /` with a right operand of type `R`, each giving `Self`: the rows of [`Operators`].
pub trait Arithmetic<R>:
    Sized + Add<R, Output = Self> + Sub<R, Output = Self> + Mul<R, Output = Self> + Div<R, Output = Self>
{
}

impl<T, R> Arithmetic<R> for T where T: Add<R, Output = T> + Sub<R, Output = T> + Mul<R, Output = T> + Div<R, Output = T>
{}

/// tch's tensor methods, for models written once for tensors and lazy tensors. Each
/// comes as in tch, with tch's arguments: `f_op` returns the error, `op` panics with it.
/// Tensor operands are `&Self` (activations, targets) or `&Tensor` (parameters,
/// constants); integer lists take what tch takes (`-1`, `[0, 2]`, `&vec`, see
/// [`IntList`](crate::lazy::IntList)); `view` takes tch's `Shape` (tuples); `i(..)` takes
/// tch's indices.
///
/// The ops come in families, one trait each, all required here, so that a bound
/// `T: TensorOps` offers every method: [`PointwiseOps`], [`LayoutOps`], [`MatrixOps`],
/// [`WindowOps`], [`NormOps`], [`ReduceOps`], [`LossOps`]. Call them as methods
/// (`x.relu()`), or name the family (`PointwiseOps::relu(&x)`).
///
/// On a `Tensor`, tch's inherent methods are found first, so eager code is unchanged.
/// `i` is a trait method in tch too (`tch::IndexOp`): with both traits imported, call it
/// as `TensorOps::i(&x, ..)` or `IndexOp::i(&x, ..)`.
pub trait TensorOps:
    Fallible + PointwiseOps + LayoutOps + MatrixOps + WindowOps + NormOps + ReduceOps + LossOps
{
    /// The sizes.
    fn size(&self) -> Vec<i64>;
    /// The sizes of a 1-D tensor.
    ///
    /// # Errors
    /// For another number of dimensions.
    fn size1(&self) -> Result<i64, Self::Error>;
    /// The sizes of a 2-D tensor.
    ///
    /// # Errors
    /// For another number of dimensions.
    fn size2(&self) -> Result<(i64, i64), Self::Error>;
    /// The sizes of a 3-D tensor.
    ///
    /// # Errors
    /// For another number of dimensions.
    fn size3(&self) -> Result<(i64, i64, i64), Self::Error>;
    /// The sizes of a 4-D tensor.
    ///
    /// # Errors
    /// For another number of dimensions.
    fn size4(&self) -> Result<(i64, i64, i64, i64), Self::Error>;
    /// The number of dimensions.
    fn dim(&self) -> usize {
        self.size().len()
    }
    /// The element kind.
    fn kind(&self) -> Kind;
    /// The device.
    fn device(&self) -> Device;
    /// A constant of the model (a mask, position ids, a lookup table): the tensor itself,
    /// or a fixed operand of a lazy graph (the same for every sample, never split).
    fn constant(tensor: &Tensor) -> Self;
    /// `layer` applied to `self` (tch's `apply`).
    #[track_caller]
    fn apply<L: Layer<Self> + ?Sized>(&self, layer: &L) -> Self {
        layer.forward(self)
    }
    /// `layer` applied to `self` when there is one, else `self` (tch's `apply_opt`).
    #[track_caller]
    fn apply_opt<L: Layer<Self>>(&self, layer: &Option<L>) -> Self {
        match layer {
            Some(layer) => layer.forward(self),
            None => self.shallow_clone(),
        }
    }
    /// The same value, sharing its storage (tch's `shallow_clone`; a lazy tensor's clone).
    fn shallow_clone(&self) -> Self;
    /// tch's `max_pool2d_default`: `ksize × ksize` windows, stride `ksize`, no padding.
    #[track_caller]
    fn max_pool2d_default(&self, ksize: i64) -> Self {
        self.max_pool2d([ksize, ksize], [ksize, ksize], [0, 0], [1, 1], false)
    }
    /// tch's `avg_pool2d_default`, which divides by 1 (a divisor override): each window's sum.
    #[track_caller]
    fn avg_pool2d_default(&self, ksize: i64) -> Self {
        self.avg_pool2d([ksize, ksize], [ksize, ksize], [0, 0], false, true, 1)
    }
    /// `layer` applied to `self` in training or not (tch's `apply_t`).
    #[track_caller]
    fn apply_t<L: LayerT<Self> + ?Sized>(&self, layer: &L, train: bool) -> Self {
        layer.forward_t(self, train)
    }
    /// Indexes with tch's grammar: `x.f_i((.., 1..3, -1))` (tch's `IndexOp::f_i`).
    ///
    /// # Errors
    /// An index that does not apply.
    fn f_i(&self, index: impl TensorIndex) -> Result<Self, Self::Error>;
    /// Like [`f_i`](Self::f_i), panicking with its error (tch's `IndexOp::i`).
    #[track_caller]
    fn i(&self, index: impl TensorIndex) -> Self {
        self.f_i(index).or_panic()
    }
    /// A `[N, -1]` view (tch's `flat_view`, which has no fallible form).
    fn flat_view(&self) -> Self;
    /// Splits into `chunks` pieces along `dim` (tch's `chunk`).
    ///
    /// # Errors
    /// The op's error.
    fn f_chunk(&self, chunks: i64, dim: i64) -> Result<Vec<Self>, Self::Error>;
    /// Like [`f_chunk`](Self::f_chunk), panicking with its error.
    #[track_caller]
    fn chunk(&self, chunks: i64, dim: i64) -> Vec<Self> {
        self.f_chunk(chunks, dim).or_panic()
    }
    /// Splits into pieces of `split_size` along `dim` (tch's `split`).
    ///
    /// # Errors
    /// The op's error.
    fn f_split(&self, split_size: i64, dim: i64) -> Result<Vec<Self>, Self::Error>;
    /// Like [`f_split`](Self::f_split), panicking with its error.
    #[track_caller]
    fn split(&self, split_size: i64, dim: i64) -> Vec<Self> {
        self.f_split(split_size, dim).or_panic()
    }
    /// Concatenates along `dim` (tch's `Tensor::cat`).
    ///
    /// # Errors
    /// The op's error.
    fn f_cat(tensors: &[&Self], dim: i64) -> Result<Self, Self::Error>;
    /// Like [`f_cat`](Self::f_cat), panicking with its error.
    #[track_caller]
    fn cat(tensors: &[&Self], dim: i64) -> Self {
        Self::f_cat(tensors, dim).or_panic()
    }
    /// Joins along a new dimension `dim` (tch's `Tensor::stack`).
    ///
    /// # Errors
    /// The op's error.
    fn f_stack(tensors: &[&Self], dim: i64) -> Result<Self, Self::Error>;
    /// Like [`f_stack`](Self::f_stack), panicking with its error.
    #[track_caller]
    fn stack(tensors: &[&Self], dim: i64) -> Self {
        Self::f_stack(tensors, dim).or_panic()
    }
    /// The `k` largest (or smallest) entries along `dim`, and their indices (tch's `topk`).
    ///
    /// # Errors
    /// The op's error.
    fn f_topk(&self, k: i64, dim: i64, largest: bool, sorted: bool) -> Result<(Self, Self), Self::Error>;
    /// Like [`f_topk`](Self::f_topk), panicking with its error.
    #[track_caller]
    fn topk(&self, k: i64, dim: i64, largest: bool, sorted: bool) -> (Self, Self) {
        self.f_topk(k, dim, largest, sorted).or_panic()
    }
    /// The maximum along `dim`, and its index (tch's `max_dim`).
    ///
    /// # Errors
    /// The op's error.
    fn f_max_dim(&self, dim: i64, keepdim: bool) -> Result<(Self, Self), Self::Error>;
    /// Like [`f_max_dim`](Self::f_max_dim), panicking with its error.
    #[track_caller]
    fn max_dim(&self, dim: i64, keepdim: bool) -> (Self, Self) {
        self.f_max_dim(dim, keepdim).or_panic()
    }
    /// The minimum along `dim`, and its index (tch's `min_dim`).
    ///
    /// # Errors
    /// The op's error.
    fn f_min_dim(&self, dim: i64, keepdim: bool) -> Result<(Self, Self), Self::Error>;
    /// Like [`f_min_dim`](Self::f_min_dim), panicking with its error.
    #[track_caller]
    fn min_dim(&self, dim: i64, keepdim: bool) -> (Self, Self) {
        self.f_min_dim(dim, keepdim).or_panic()
    }
    /// The values sorted along `dim`, and their indices (tch's `sort`).
    ///
    /// # Errors
    /// The op's error.
    fn f_sort(&self, dim: i64, descending: bool) -> Result<(Self, Self), Self::Error>;
    /// Like [`f_sort`](Self::f_sort), panicking with its error.
    #[track_caller]
    fn sort(&self, dim: i64, descending: bool) -> (Self, Self) {
        self.f_sort(dim, descending).or_panic()
    }
    /// Einstein summation over `tensors` (tch's `Tensor::einsum`).
    ///
    /// # Errors
    /// The op's error.
    fn f_einsum(equation: &str, tensors: &[&Self], path: Option<&[i64]>) -> Result<Self, Self::Error>;
    /// Like [`f_einsum`](Self::f_einsum), panicking with its error.
    #[track_caller]
    fn einsum(equation: &str, tensors: &[&Self], path: Option<&[i64]>) -> Self {
        Self::f_einsum(equation, tensors, path).or_panic()
    }
    /// A copy that shares nothing with `self` (tch's `copy`).
    fn copy(&self) -> Self;
    /// One-hot encoding of integer labels in `labels` classes, in `Float` (tch's `onehot`).
    fn onehot(&self, labels: i64) -> Self;
    /// The share of rows whose largest logit is at the target (tch's `accuracy_for_logits`).
    fn accuracy_for_logits(&self, targets: &Self) -> Self;
    /// Rows of `weight` picked by `indices` (tch's `Tensor::embedding`).
    ///
    /// # Errors
    /// The op's error; on a lazy tensor, `sparse` gradients are not planned.
    fn f_embedding(
        weight: &Tensor,
        indices: &Self,
        padding_idx: i64,
        scale_grad_by_freq: bool,
        sparse: bool,
    ) -> Result<Self, Self::Error>;
    /// Like [`f_embedding`](Self::f_embedding), panicking with its error.
    #[track_caller]
    fn embedding(weight: &Tensor, indices: &Self, padding_idx: i64, scale_grad_by_freq: bool, sparse: bool) -> Self {
        Self::f_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse).or_panic()
    }
    /// Attention of `query` over `key`/`value` (tch's
    /// `Tensor::scaled_dot_product_attention`): an optional mask (boolean, or added to
    /// the scores), dropout, causal masking, a scale (default `1/√d`), grouped-query heads.
    ///
    /// # Errors
    /// The op's error.
    #[allow(clippy::too_many_arguments)]
    fn f_scaled_dot_product_attention(
        query: &Self,
        key: &Self,
        value: &Self,
        attn_mask: Option<&Self>,
        dropout_p: f64,
        is_causal: bool,
        scale: impl Into<Option<f64>>,
        enable_gqa: bool,
    ) -> Result<Self, Self::Error>;
    /// Like [`f_scaled_dot_product_attention`](Self::f_scaled_dot_product_attention),
    /// panicking with its error.
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    fn scaled_dot_product_attention(
        query: &Self,
        key: &Self,
        value: &Self,
        attn_mask: Option<&Self>,
        dropout_p: f64,
        is_causal: bool,
        scale: impl Into<Option<f64>>,
        enable_gqa: bool,
    ) -> Self {
        Self::f_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            .or_panic()
    }
    /// Batch normalization (tch's `batch_norm`): with batch statistics in training (a
    /// lazy split is refused unless allowed), with the running ones otherwise.
    ///
    /// # Errors
    /// The op's error; on a lazy tensor, running statistics are required.
    #[allow(clippy::too_many_arguments)]
    fn f_batch_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
        cudnn_enabled: bool,
    ) -> Result<Self, Self::Error>;
    /// Like [`f_batch_norm`](Self::f_batch_norm), panicking with its error.
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    fn batch_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
        cudnn_enabled: bool,
    ) -> Self {
        self.f_batch_norm(weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled).or_panic()
    }
    /// Cross-entropy of logits against class indices, averaged (tch has no fallible form).
    fn cross_entropy_for_logits(&self, targets: &Self) -> Self;
    /// Negative log-likelihood of log-probabilities against class indices, averaged.
    fn nll_loss(&self, targets: &Self) -> Self;
    /// Negative log-likelihood with class weights, a reduction and an ignored index
    /// (tch's `f_nll_loss`).
    ///
    /// # Errors
    /// The op's error.
    fn f_nll_loss(
        &self,
        target: &Self,
        weight: Option<&Tensor>,
        reduction: Reduction,
        ignore_index: i64,
    ) -> Result<Self, Self::Error>;
    /// Like [`f_nll_loss`](Self::f_nll_loss), panicking with its error (tch's `g_nll_loss`).
    #[track_caller]
    fn g_nll_loss(&self, target: &Self, weight: Option<&Tensor>, reduction: Reduction, ignore_index: i64) -> Self {
        self.f_nll_loss(target, weight, reduction, ignore_index).or_panic()
    }
}

impl TensorOps for Tensor {
    #[inline]
    fn size(&self) -> Vec<i64> {
        Tensor::size(self)
    }
    #[inline]
    fn size1(&self) -> Result<i64, TchError> {
        Tensor::size1(self)
    }
    #[inline]
    fn size2(&self) -> Result<(i64, i64), TchError> {
        Tensor::size2(self)
    }
    #[inline]
    fn size3(&self) -> Result<(i64, i64, i64), TchError> {
        Tensor::size3(self)
    }
    #[inline]
    fn size4(&self) -> Result<(i64, i64, i64, i64), TchError> {
        Tensor::size4(self)
    }
    #[inline]
    fn dim(&self) -> usize {
        Tensor::dim(self)
    }
    #[inline]
    fn kind(&self) -> Kind {
        Tensor::kind(self)
    }
    #[inline]
    fn device(&self) -> Device {
        Tensor::device(self)
    }
    #[inline]
    fn constant(tensor: &Tensor) -> Self {
        tensor.shallow_clone()
    }
    #[inline]
    fn shallow_clone(&self) -> Self {
        Tensor::shallow_clone(self)
    }
    #[inline]
    fn f_i(&self, index: impl TensorIndex) -> Result<Self, TchError> {
        index.index_tensor(self)
    }
    #[inline]
    fn flat_view(&self) -> Self {
        Tensor::flat_view(self)
    }
    #[inline]
    fn f_chunk(&self, chunks: i64, dim: i64) -> Result<Vec<Self>, TchError> {
        Tensor::f_chunk(self, chunks, dim)
    }
    #[inline]
    fn f_split(&self, split_size: i64, dim: i64) -> Result<Vec<Self>, TchError> {
        Tensor::f_split(self, split_size, dim)
    }
    #[inline]
    fn f_cat(tensors: &[&Tensor], dim: i64) -> Result<Tensor, TchError> {
        Tensor::f_cat(tensors, dim)
    }
    #[inline]
    fn f_stack(tensors: &[&Tensor], dim: i64) -> Result<Tensor, TchError> {
        Tensor::f_stack(tensors, dim)
    }
    #[inline]
    fn f_topk(&self, k: i64, dim: i64, largest: bool, sorted: bool) -> Result<(Tensor, Tensor), TchError> {
        Tensor::f_topk(self, k, dim, largest, sorted)
    }
    fn f_max_dim(&self, dim: i64, keepdim: bool) -> Result<(Tensor, Tensor), TchError> {
        Tensor::f_max_dim(self, dim, keepdim)
    }
    fn f_min_dim(&self, dim: i64, keepdim: bool) -> Result<(Tensor, Tensor), TchError> {
        Tensor::f_min_dim(self, dim, keepdim)
    }
    #[inline]
    fn f_sort(&self, dim: i64, descending: bool) -> Result<(Tensor, Tensor), TchError> {
        Tensor::f_sort(self, dim, descending)
    }
    #[inline]
    fn f_einsum(equation: &str, tensors: &[&Tensor], path: Option<&[i64]>) -> Result<Tensor, TchError> {
        Tensor::f_einsum(equation, tensors, path)
    }
    #[inline]
    fn copy(&self) -> Tensor {
        Tensor::copy(self)
    }
    #[inline]
    fn onehot(&self, labels: i64) -> Tensor {
        Tensor::onehot(self, labels)
    }
    #[inline]
    fn accuracy_for_logits(&self, targets: &Tensor) -> Tensor {
        Tensor::accuracy_for_logits(self, targets)
    }
    #[inline]
    fn f_embedding(
        weight: &Tensor,
        indices: &Tensor,
        padding_idx: i64,
        scale_grad_by_freq: bool,
        sparse: bool,
    ) -> Result<Tensor, TchError> {
        Tensor::f_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    }
    #[inline]
    fn f_scaled_dot_product_attention(
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        attn_mask: Option<&Tensor>,
        dropout_p: f64,
        is_causal: bool,
        scale: impl Into<Option<f64>>,
        enable_gqa: bool,
    ) -> Result<Tensor, TchError> {
        Tensor::f_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    }
    #[inline]
    fn f_batch_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
        cudnn_enabled: bool,
    ) -> Result<Tensor, TchError> {
        Tensor::f_batch_norm(self, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
    }
    #[inline]
    fn cross_entropy_for_logits(&self, targets: &Tensor) -> Tensor {
        Tensor::cross_entropy_for_logits(self, targets)
    }
    #[inline]
    fn nll_loss(&self, targets: &Tensor) -> Tensor {
        Tensor::nll_loss(self, targets)
    }
    #[inline]
    fn f_nll_loss(
        &self,
        target: &Tensor,
        weight: Option<&Tensor>,
        reduction: Reduction,
        ignore_index: i64,
    ) -> Result<Tensor, TchError> {
        Tensor::f_nll_loss(self, target, weight, reduction, ignore_index)
    }
}

impl TensorOps for LazyTensor {
    fn size(&self) -> Vec<i64> {
        LazyTensor::size(self)
    }
    fn size1(&self) -> Result<i64, LazyError> {
        LazyTensor::size1(self)
    }
    fn size2(&self) -> Result<(i64, i64), LazyError> {
        LazyTensor::size2(self)
    }
    fn size3(&self) -> Result<(i64, i64, i64), LazyError> {
        LazyTensor::size3(self)
    }
    fn size4(&self) -> Result<(i64, i64, i64, i64), LazyError> {
        LazyTensor::size4(self)
    }
    fn dim(&self) -> usize {
        LazyTensor::dim(self)
    }
    fn kind(&self) -> Kind {
        LazyTensor::kind(self)
    }
    fn device(&self) -> Device {
        LazyTensor::device(self)
    }
    fn constant(tensor: &Tensor) -> Self {
        LazyTensor::fixed(tensor)
    }
    fn shallow_clone(&self) -> Self {
        self.clone()
    }
    fn f_i(&self, index: impl TensorIndex) -> Result<Self, LazyError> {
        LazyTensor::f_i(self, index)
    }
    #[track_caller]
    fn flat_view(&self) -> Self {
        LazyTensor::flat_view(self)
    }
    fn f_chunk(&self, chunks: i64, dim: i64) -> Result<Vec<Self>, LazyError> {
        LazyTensor::f_chunk(self, chunks, dim)
    }
    fn f_split(&self, split_size: i64, dim: i64) -> Result<Vec<Self>, LazyError> {
        LazyTensor::f_split(self, split_size, dim)
    }
    fn f_cat(tensors: &[&LazyTensor], dim: i64) -> Result<LazyTensor, LazyError> {
        LazyTensor::f_cat(tensors, dim)
    }
    fn f_stack(tensors: &[&LazyTensor], dim: i64) -> Result<LazyTensor, LazyError> {
        LazyTensor::f_stack(tensors, dim)
    }
    fn f_topk(&self, k: i64, dim: i64, largest: bool, sorted: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        LazyTensor::f_topk(self, k, dim, largest, sorted)
    }
    fn f_max_dim(&self, dim: i64, keepdim: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        LazyTensor::f_max_dim(self, dim, keepdim)
    }
    fn f_min_dim(&self, dim: i64, keepdim: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        LazyTensor::f_min_dim(self, dim, keepdim)
    }
    fn f_sort(&self, dim: i64, descending: bool) -> Result<(LazyTensor, LazyTensor), LazyError> {
        LazyTensor::f_sort(self, dim, descending)
    }
    fn f_einsum(equation: &str, tensors: &[&LazyTensor], path: Option<&[i64]>) -> Result<LazyTensor, LazyError> {
        LazyTensor::f_einsum(equation, tensors, path)
    }
    #[track_caller]
    fn copy(&self) -> LazyTensor {
        LazyTensor::f_copy(self).or_panic()
    }
    #[track_caller]
    fn onehot(&self, labels: i64) -> LazyTensor {
        LazyTensor::f_onehot(self, labels).or_panic()
    }
    #[track_caller]
    fn accuracy_for_logits(&self, targets: &LazyTensor) -> LazyTensor {
        LazyTensor::f_accuracy_for_logits(self, targets).or_panic()
    }
    fn f_embedding(
        weight: &Tensor,
        indices: &LazyTensor,
        padding_idx: i64,
        scale_grad_by_freq: bool,
        sparse: bool,
    ) -> Result<LazyTensor, LazyError> {
        LazyTensor::f_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    }
    fn f_scaled_dot_product_attention(
        query: &LazyTensor,
        key: &LazyTensor,
        value: &LazyTensor,
        attn_mask: Option<&LazyTensor>,
        dropout_p: f64,
        is_causal: bool,
        scale: impl Into<Option<f64>>,
        enable_gqa: bool,
    ) -> Result<LazyTensor, LazyError> {
        LazyTensor::f_scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        )
    }
    fn f_batch_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
        cudnn_enabled: bool,
    ) -> Result<LazyTensor, LazyError> {
        let _ = cudnn_enabled;
        let (Some(mean), Some(var)) = (running_mean, running_var) else {
            return Err(LazyError::Unsupported {
                op: "batch_norm".into(),
                reason: "batch norm without running statistics is not planned; pass running_mean and running_var"
                    .into(),
            });
        };
        LazyTensor::f_batch_norm(self, weight, bias, mean, var, training, momentum, eps)
    }
    #[track_caller]
    fn cross_entropy_for_logits(&self, targets: &LazyTensor) -> LazyTensor {
        LazyTensor::cross_entropy_for_logits(self, targets)
    }
    #[track_caller]
    fn nll_loss(&self, targets: &LazyTensor) -> LazyTensor {
        LazyTensor::nll_loss(self, targets)
    }
    fn f_nll_loss(
        &self,
        target: &LazyTensor,
        weight: Option<&Tensor>,
        reduction: Reduction,
        ignore_index: i64,
    ) -> Result<LazyTensor, LazyError> {
        LazyTensor::f_nll_loss(self, target, weight, reduction, ignore_index)
    }
}
