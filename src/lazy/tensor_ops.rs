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

use tch::{Device, Kind, Reduction, TchError, Tensor};

use super::error::LazyError;
use super::index::TensorIndex;
use super::int_list::{IntList, IntListOption};
use super::nn::{Layer, LayerT};
use super::LazyTensor;

/// Passes a trait argument on to tch: integer lists as slices, optional ones as `Option`s,
/// anything else as it is.
macro_rules! tch_arg {
    ($a:ident) => {
        $a
    };
    ($a:ident, list) => {
        $a.as_slice()
    };
    ($a:ident, option) => {
        $a.as_option()
    };
}

/// Generates the trait's methods (each as `f_name`, fallible, and `name`, panicking, as tch
/// pairs them) and both implementations: `Tensor`'s calls tch's method of the same name,
/// `LazyTensor`'s the lazy one. An argument marked `=> list` or `=> option` is a toma
/// [`IntList`]/[`IntListOption`], handed to tch as a slice.
macro_rules! tensor_ops {
    ($( $(#[$doc:meta])* $name:ident / $f:ident ( $($arg:ident : $ty:ty $(=> $conv:ident)?),* ); )*) => {
        /// tch's tensor methods, for models written once for tensors and lazy tensors. Each
        /// comes as in tch, with tch's arguments: `f_op` returns the error, `op` panics with it.
        /// Tensor operands are `&Self` (activations, targets) or `&Tensor` (parameters,
        /// constants); integer lists take what tch takes (`-1`, `[0, 2]`, `&vec`, see
        /// [`IntList`]); `view` takes tch's `Shape` (tuples); `i(..)` takes tch's indices.
        ///
        /// On a `Tensor`, tch's inherent methods are found first, so eager code is unchanged.
        /// `i` is a trait method in tch too (`tch::IndexOp`): with both traits imported, call it
        /// as `TensorOps::i(&x, ..)` or `IndexOp::i(&x, ..)`.
        pub trait TensorOps: Sized {
            /// What a failing op returns: `TchError` for tensors, [`LazyError`] for lazy ones.
            type Error: std::error::Error;

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
                self.f_i(index).unwrap_or_else(|e| panic!("{e}"))
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
                self.f_chunk(chunks, dim).unwrap_or_else(|e| panic!("{e}"))
            }
            /// Splits into pieces of `split_size` along `dim` (tch's `split`).
            ///
            /// # Errors
            /// The op's error.
            fn f_split(&self, split_size: i64, dim: i64) -> Result<Vec<Self>, Self::Error>;
            /// Like [`f_split`](Self::f_split), panicking with its error.
            #[track_caller]
            fn split(&self, split_size: i64, dim: i64) -> Vec<Self> {
                self.f_split(split_size, dim).unwrap_or_else(|e| panic!("{e}"))
            }
            /// Concatenates along `dim` (tch's `Tensor::cat`).
            ///
            /// # Errors
            /// The op's error.
            fn f_cat(tensors: &[&Self], dim: i64) -> Result<Self, Self::Error>;
            /// Like [`f_cat`](Self::f_cat), panicking with its error.
            #[track_caller]
            fn cat(tensors: &[&Self], dim: i64) -> Self {
                Self::f_cat(tensors, dim).unwrap_or_else(|e| panic!("{e}"))
            }
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
                Self::f_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse).unwrap_or_else(|e| panic!("{e}"))
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
                    .unwrap_or_else(|e| panic!("{e}"))
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
                self.f_batch_norm(weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
                    .unwrap_or_else(|e| panic!("{e}"))
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
            fn f_nll_loss(&self, target: &Self, weight: Option<&Tensor>, reduction: Reduction, ignore_index: i64) -> Result<Self, Self::Error>;
            /// Like [`f_nll_loss`](Self::f_nll_loss), panicking with its error (tch's `g_nll_loss`).
            #[track_caller]
            fn g_nll_loss(&self, target: &Self, weight: Option<&Tensor>, reduction: Reduction, ignore_index: i64) -> Self {
                self.f_nll_loss(target, weight, reduction, ignore_index).unwrap_or_else(|e| panic!("{e}"))
            }
            $(
                $(#[$doc])*
                ///
                /// # Errors
                /// The op's error: libtorch's, or what recording found.
                #[allow(clippy::too_many_arguments)]
                fn $f(&self, $($arg: $ty),*) -> Result<Self, Self::Error>;
                #[doc = concat!("Like [`", stringify!($f), "`](Self::", stringify!($f), "), panicking with its error.")]
                #[track_caller]
                #[allow(clippy::too_many_arguments)]
                fn $name(&self, $($arg: $ty),*) -> Self {
                    self.$f($($arg),*).unwrap_or_else(|e| panic!("{e}"))
                }
            )*
        }

        impl TensorOps for Tensor {
            type Error = TchError;

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
            fn f_nll_loss(&self, target: &Tensor, weight: Option<&Tensor>, reduction: Reduction, ignore_index: i64) -> Result<Tensor, TchError> {
                Tensor::f_nll_loss(self, target, weight, reduction, ignore_index)
            }
            $(
                #[inline]
                #[allow(clippy::too_many_arguments)]
                fn $f(&self, $($arg: $ty),*) -> Result<Self, TchError> {
                    Tensor::$f(self, $(tch_arg!($arg $(, $conv)?)),*)
                }
            )*
        }

        impl TensorOps for LazyTensor {
            type Error = LazyError;

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
                LazyTensor::f_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
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
                        reason: "batch norm without running statistics is not planned; pass running_mean and running_var".into(),
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
            fn f_nll_loss(&self, target: &LazyTensor, weight: Option<&Tensor>, reduction: Reduction, ignore_index: i64) -> Result<LazyTensor, LazyError> {
                LazyTensor::f_nll_loss(self, target, weight, reduction, ignore_index)
            }
            $(
                #[allow(clippy::too_many_arguments)]
                fn $f(&self, $($arg: $ty),*) -> Result<Self, LazyError> {
                    LazyTensor::$f(self, $($arg),*)
                }
            )*
        }
    };
}

tensor_ops! {
    /// `max(x, 0)`.
    relu / f_relu();
    /// The logistic sigmoid.
    sigmoid / f_sigmoid();
    /// The hyperbolic tangent.
    tanh / f_tanh();
    /// `e^x`.
    exp / f_exp();
    /// The natural logarithm.
    log / f_log();
    /// `-x`.
    neg / f_neg();
    /// The square root.
    sqrt / f_sqrt();
    /// The absolute value.
    abs / f_abs();
    /// GELU, `"none"` or `"tanh"`.
    gelu / f_gelu(approximate: &str);
    /// SiLU.
    silu / f_silu();
    /// Softplus.
    softplus / f_softplus();
    /// Leaky ReLU.
    leaky_relu / f_leaky_relu();
    /// ELU.
    elu / f_elu();
    /// Hard swish.
    hardswish / f_hardswish();
    /// Hard sigmoid.
    hardsigmoid / f_hardsigmoid();
    /// ReLU6.
    relu6 / f_relu6();
    /// Mish.
    mish / f_mish();
    /// The sine.
    sin / f_sin();
    /// The cosine.
    cos / f_cos();
    /// `x²`.
    square / f_square();
    /// `min(max(x, min), max)`.
    clamp / f_clamp(min: f64, max: f64);
    /// `max(x, min)`.
    clamp_min / f_clamp_min(min: f64);
    /// `min(x, max)`.
    clamp_max / f_clamp_max(max: f64);
    /// `1 / sqrt(x)`.
    rsqrt / f_rsqrt();
    /// `1 / x`.
    reciprocal / f_reciprocal();
    /// The error function.
    erf / f_erf();
    /// `log(sigmoid(x))`.
    log_sigmoid / f_log_sigmoid();
    /// `self + other`.
    add / f_add(other: &Self);
    /// `self - other`.
    sub / f_sub(other: &Self);
    /// `self * other`.
    mul / f_mul(other: &Self);
    /// `self / other`.
    div / f_div(other: &Self);
    /// `self ^ exponent`, elementwise.
    pow / f_pow(exponent: &Self);
    /// Elementwise maximum.
    maximum / f_maximum(other: &Self);
    /// Elementwise minimum.
    minimum / f_minimum(other: &Self);
    /// `self == other`, elementwise (booleans).
    eq_tensor / f_eq_tensor(other: &Self);
    /// `self != other`, elementwise.
    ne_tensor / f_ne_tensor(other: &Self);
    /// `self < other`, elementwise.
    lt_tensor / f_lt_tensor(other: &Self);
    /// `self <= other`, elementwise.
    le_tensor / f_le_tensor(other: &Self);
    /// `self > other`, elementwise.
    gt_tensor / f_gt_tensor(other: &Self);
    /// `self >= other`, elementwise.
    ge_tensor / f_ge_tensor(other: &Self);
    /// `self == s`, elementwise (booleans).
    eq / f_eq(s: f64);
    /// `self != s`.
    ne / f_ne(s: f64);
    /// `self < s`.
    lt / f_lt(s: f64);
    /// `self <= s`.
    le / f_le(s: f64);
    /// `self > s`.
    gt / f_gt(s: f64);
    /// `self >= s`.
    ge / f_ge(s: f64);
    /// `self + s`.
    add_scalar / f_add_scalar(s: f64);
    /// `self - s`.
    sub_scalar / f_sub_scalar(s: f64);
    /// `s - self`.
    rsub_scalar / f_rsub_scalar(s: f64);
    /// `self * s`.
    mul_scalar / f_mul_scalar(s: f64);
    /// `self / s`.
    div_scalar / f_div_scalar(s: f64);
    /// `self ^ s`.
    pow_tensor_scalar / f_pow_tensor_scalar(s: f64);
    /// Softmax along `dim`.
    softmax / f_softmax(dim: i64, kind: impl Into<Option<Kind>>);
    /// Log-softmax along `dim`.
    log_softmax / f_log_softmax(dim: i64, kind: impl Into<Option<Kind>>);
    /// Matrix product (`torch.matmul`).
    matmul / f_matmul(other: &Self);
    /// Batched matrix product.
    bmm / f_bmm(other: &Self);
    /// `beta · self + alpha · batch1 @ batch2`.
    baddbmm / f_baddbmm(batch1: &Self, batch2: &Self, beta: f64, alpha: f64);
    /// `self @ weightᵀ + bias`.
    linear / f_linear(weight: &Tensor, bias: Option<&Tensor>);
    /// 1-D convolution.
    conv1d / f_conv1d(weight: &Tensor, bias: Option<&Tensor>, stride: impl IntList => list, padding: impl IntList => list, dilation: impl IntList => list, groups: i64);
    /// 2-D convolution.
    conv2d / f_conv2d(weight: &Tensor, bias: Option<&Tensor>, stride: impl IntList => list, padding: impl IntList => list, dilation: impl IntList => list, groups: i64);
    /// 2-D transposed convolution.
    conv_transpose2d / f_conv_transpose2d(weight: &Tensor, bias: Option<&Tensor>, stride: impl IntList => list, padding: impl IntList => list, output_padding: impl IntList => list, groups: i64, dilation: impl IntList => list);
    /// 2-D max pooling.
    max_pool2d / f_max_pool2d(kernel_size: impl IntList => list, stride: impl IntList => list, padding: impl IntList => list, dilation: impl IntList => list, ceil_mode: bool);
    /// 2-D average pooling.
    avg_pool2d / f_avg_pool2d(kernel_size: impl IntList => list, stride: impl IntList => list, padding: impl IntList => list, ceil_mode: bool, count_include_pad: bool, divisor_override: impl Into<Option<i64>>);
    /// 2-D adaptive average pooling.
    adaptive_avg_pool2d / f_adaptive_avg_pool2d(output_size: impl IntList => list);
    /// Nearest-neighbour upsampling to `output_size`.
    upsample_nearest2d / f_upsample_nearest2d(output_size: impl IntList => list, scales_h: impl Into<Option<f64>>, scales_w: impl Into<Option<f64>>);
    /// Bilinear upsampling to `output_size`.
    upsample_bilinear2d / f_upsample_bilinear2d(output_size: impl IntList => list, align_corners: bool, scales_h: impl Into<Option<f64>>, scales_w: impl Into<Option<f64>>);
    /// Pads the trailing dimensions (`"constant"` with `value`, `"reflect"`, `"replicate"`,
    /// `"circular"`).
    pad / f_pad(pad: impl IntList => list, mode: &str, value: impl Into<Option<f64>>);
    /// Dropout.
    dropout / f_dropout(p: f64, train: bool);
    /// Dropout of whole channels.
    feature_dropout / f_feature_dropout(p: f64, train: bool);
    /// Alpha dropout.
    alpha_dropout / f_alpha_dropout(p: f64, train: bool);
    /// Alpha dropout of whole channels.
    feature_alpha_dropout / f_feature_alpha_dropout(p: f64, train: bool);
    /// A view with another shape (tch's `Shape`: `(b, -1)`, `[2, 3]`, `&sizes[..]`, ..).
    view / f_view(shape: impl tch::Shape);
    /// Another shape, copying where a view cannot.
    reshape / f_reshape(shape: impl IntList => list);
    /// Flattens dimensions `start..=end`.
    flatten / f_flatten(start_dim: i64, end_dim: i64);
    /// Swaps two dimensions.
    transpose / f_transpose(dim0: i64, dim1: i64);
    /// Reorders the dimensions.
    permute / f_permute(dims: impl IntList => list);
    /// Inserts a dimension of size 1.
    unsqueeze / f_unsqueeze(dim: i64);
    /// Removes every dimension of size 1.
    squeeze / f_squeeze();
    /// Removes a dimension of size 1.
    squeeze_dim / f_squeeze_dim(dim: i64);
    /// `length` entries of `dim` from `start`.
    narrow / f_narrow(dim: i64, start: i64, length: i64);
    /// Broadcasts to `size` (a view; `implicit` only marks the op for tracing).
    expand / f_expand(size: impl IntList => list, implicit: bool);
    /// Tiles `repeats` times along each dimension.
    repeat / f_repeat(repeats: impl IntList => list);
    /// Entries of `dim` at the positions in `index`.
    index_select / f_index_select(dim: i64, index: &Self);
    /// Entries along `dim` at `index`.
    gather / f_gather(dim: i64, index: &Self, sparse_grad: bool);
    /// Entry `index` of `dim`, the dimension removed.
    select / f_select(dim: i64, index: i64);
    /// The value in another kind.
    to_kind / f_to_kind(kind: Kind);
    /// A contiguous copy (or the value itself).
    contiguous / f_contiguous();
    /// The same value, no gradient flowing back through it.
    detach / f_detach();
    /// The sum of all elements.
    sum / f_sum(kind: impl Into<Option<Kind>>);
    /// The mean of all elements.
    mean / f_mean(kind: impl Into<Option<Kind>>);
    /// Sums over `dims` (`None`: every dimension).
    sum_dim_intlist / f_sum_dim_intlist(dims: impl IntListOption => option, keepdim: bool, kind: impl Into<Option<Kind>>);
    /// Means over `dims` (`None`: every dimension).
    mean_dim / f_mean_dim(dims: impl IntListOption => option, keepdim: bool, kind: impl Into<Option<Kind>>);
    /// Maxima over `dims`.
    amax / f_amax(dims: impl IntList => list, keepdim: bool);
    /// The largest element.
    max / f_max();
    /// `log(sum(exp(x)))` over `dims`, computed stably.
    logsumexp / f_logsumexp(dims: impl IntList => list, keepdim: bool);
    /// `value` where `mask` is true.
    masked_fill / f_masked_fill(mask: &Self, value: f64);
    /// `self` where `condition` is true, else `other`.
    where_self / f_where_self(condition: &Self, other: &Self);
    /// The lower triangle.
    tril / f_tril(diagonal: i64);
    /// The upper triangle.
    triu / f_triu(diagonal: i64);
    /// Layer normalization over the trailing `normalized_shape` (libtorch ignores
    /// `cudnn_enable`).
    layer_norm / f_layer_norm(normalized_shape: impl IntList => list, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64, cudnn_enable: bool);
    /// Group normalization over `num_groups` groups of channels.
    group_norm / f_group_norm(num_groups: i64, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64, cudnn_enabled: bool);
    /// Root-mean-square normalization over the trailing `normalized_shape`.
    rms_norm / f_rms_norm(normalized_shape: impl IntList => list, weight: Option<&Tensor>, eps: impl Into<Option<f64>>);
    /// Mean squared error.
    mse_loss / f_mse_loss(target: &Self, reduction: Reduction);
    /// Binary cross-entropy of logits (a lazy tensor takes no `weight`/`pos_weight` yet).
    binary_cross_entropy_with_logits / f_binary_cross_entropy_with_logits(target: &Self, weight: Option<&Tensor>, pos_weight: Option<&Tensor>, reduction: Reduction);
    /// Smooth L1 loss.
    smooth_l1_loss / f_smooth_l1_loss(target: &Self, reduction: Reduction, beta: f64);
    /// Huber loss.
    huber_loss / f_huber_loss(target: &Self, reduction: Reduction, delta: f64);
    /// Cross-entropy of logits against class indices, with class weights, a reduction, an
    /// ignored index and label smoothing.
    cross_entropy_loss / f_cross_entropy_loss(target: &Self, weight: Option<&Tensor>, reduction: Reduction, ignore_index: i64, label_smoothing: f64);
    /// Kullback-Leibler divergence (the input holds log-probabilities).
    kl_div / f_kl_div(target: &Self, reduction: Reduction, log_target: bool);
}
