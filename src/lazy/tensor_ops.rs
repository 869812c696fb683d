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

use tch::{nn, Device, Kind, Reduction, TchError, Tensor};

use super::error::LazyError;
use super::nn::{LazyModule, LazyModuleT};
use super::LazyTensor;

/// A layer as seen by a [`TensorOps`] type: tch's `Module` for `Tensor`, the lazy adapters for
/// [`LazyTensor`] (`Linear`, `Conv1D`, `Conv2D`, `LayerNorm`, `Embedding`, the lazy
/// `Sequential`, ..).
pub trait Layer<T> {
    /// The layer applied to `xs`.
    fn forward(&self, xs: &T) -> T;
}

impl<M: nn::Module> Layer<Tensor> for M {
    #[inline]
    fn forward(&self, xs: &Tensor) -> Tensor {
        nn::Module::forward(self, xs)
    }
}

impl<M: LazyModule> Layer<LazyTensor> for M {
    #[track_caller]
    fn forward(&self, xs: &LazyTensor) -> LazyTensor {
        xs.apply(self)
    }
}

/// A layer that behaves differently in training ([`Layer`] with `train`): tch's `ModuleT` for
/// `Tensor`, [`LazyModuleT`] for [`LazyTensor`].
pub trait LayerT<T> {
    /// The layer applied to `xs`.
    fn forward_t(&self, xs: &T, train: bool) -> T;
}

impl<M: nn::ModuleT> LayerT<Tensor> for M {
    #[inline]
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        nn::ModuleT::forward_t(self, xs, train)
    }
}

impl<M: LazyModuleT> LayerT<LazyTensor> for M {
    #[track_caller]
    fn forward_t(&self, xs: &LazyTensor, train: bool) -> LazyTensor {
        xs.apply_t(self, train)
    }
}

/// Generates the trait's methods (each as `f_name`, fallible, and `name`, panicking, as tch
/// pairs them) and both implementations: `Tensor`'s calls tch's method of the same name,
/// `LazyTensor`'s the lazy one.
macro_rules! tensor_ops {
    ($( $(#[$doc:meta])* $name:ident / $f:ident ( $($arg:ident : $ty:ty),* ); )*) => {
        /// tch's tensor methods, for models written once for tensors and lazy tensors. Each
        /// comes as in tch: `f_op` returns the error, `op` panics with it. Tensor operands are
        /// `&Self` (activations, targets) or `&Tensor` (parameters, constants).
        pub trait TensorOps: Sized {
            /// What a failing op returns: `TchError` for tensors, [`LazyError`] for lazy ones.
            type Error: std::error::Error;

            /// The sizes.
            fn size(&self) -> Vec<i64>;
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
            /// Layer normalization over the trailing `normalized_shape`.
            ///
            /// # Errors
            /// The op's error.
            fn f_layer_norm(
                &self,
                normalized_shape: &[i64],
                weight: Option<&Tensor>,
                bias: Option<&Tensor>,
                eps: f64,
            ) -> Result<Self, Self::Error>;
            /// Like [`f_layer_norm`](Self::f_layer_norm), panicking with its error.
            #[track_caller]
            fn layer_norm(&self, normalized_shape: &[i64], weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Self {
                self.f_layer_norm(normalized_shape, weight, bias, eps).unwrap_or_else(|e| panic!("{e}"))
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
            /// Cross-entropy of logits against class indices, averaged (tch has no fallible form).
            fn cross_entropy_for_logits(&self, targets: &Self) -> Self;
            /// Negative log-likelihood of log-probabilities against class indices, averaged.
            fn nll_loss(&self, targets: &Self) -> Self;
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
            fn f_chunk(&self, chunks: i64, dim: i64) -> Result<Vec<Self>, TchError> {
                Tensor::f_chunk(self, chunks, dim)
            }
            #[inline]
            fn f_layer_norm(
                &self,
                normalized_shape: &[i64],
                weight: Option<&Tensor>,
                bias: Option<&Tensor>,
                eps: f64,
            ) -> Result<Self, TchError> {
                Tensor::f_layer_norm(self, normalized_shape, weight, bias, eps, true)
            }
            #[inline]
            fn f_cat(tensors: &[&Tensor], dim: i64) -> Result<Tensor, TchError> {
                Tensor::f_cat(tensors, dim)
            }
            #[inline]
            fn cross_entropy_for_logits(&self, targets: &Tensor) -> Tensor {
                Tensor::cross_entropy_for_logits(self, targets)
            }
            #[inline]
            fn nll_loss(&self, targets: &Tensor) -> Tensor {
                Tensor::nll_loss(self, targets)
            }
            $(
                #[inline]
                #[allow(clippy::too_many_arguments)]
                fn $f(&self, $($arg: $ty),*) -> Result<Self, TchError> {
                    Tensor::$f(self, $($arg),*)
                }
            )*
        }

        impl TensorOps for LazyTensor {
            type Error = LazyError;

            fn size(&self) -> Vec<i64> {
                LazyTensor::size(self)
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
            fn f_chunk(&self, chunks: i64, dim: i64) -> Result<Vec<Self>, LazyError> {
                LazyTensor::f_chunk(self, chunks, dim)
            }
            fn f_layer_norm(
                &self,
                normalized_shape: &[i64],
                weight: Option<&Tensor>,
                bias: Option<&Tensor>,
                eps: f64,
            ) -> Result<Self, LazyError> {
                LazyTensor::f_layer_norm(self, normalized_shape, weight, bias, eps)
            }
            fn f_cat(tensors: &[&LazyTensor], dim: i64) -> Result<LazyTensor, LazyError> {
                LazyTensor::f_cat(tensors, dim)
            }
            #[track_caller]
            fn cross_entropy_for_logits(&self, targets: &LazyTensor) -> LazyTensor {
                LazyTensor::cross_entropy_for_logits(self, targets)
            }
            #[track_caller]
            fn nll_loss(&self, targets: &LazyTensor) -> LazyTensor {
                LazyTensor::nll_loss(self, targets)
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
    /// `self + other`.
    add / f_add(other: &Self);
    /// `self - other`.
    sub / f_sub(other: &Self);
    /// `self * other`.
    mul / f_mul(other: &Self);
    /// `self / other`.
    div / f_div(other: &Self);
    /// Elementwise maximum.
    maximum / f_maximum(other: &Self);
    /// Elementwise minimum.
    minimum / f_minimum(other: &Self);
    /// `self + s`.
    add_scalar / f_add_scalar(s: f64);
    /// `self - s`.
    sub_scalar / f_sub_scalar(s: f64);
    /// `self * s`.
    mul_scalar / f_mul_scalar(s: f64);
    /// `self / s`.
    div_scalar / f_div_scalar(s: f64);
    /// `self ^ s`.
    pow_tensor_scalar / f_pow_tensor_scalar(s: f64);
    /// Softmax along `dim`.
    softmax / f_softmax(dim: i64, kind: Option<Kind>);
    /// Log-softmax along `dim`.
    log_softmax / f_log_softmax(dim: i64, kind: Option<Kind>);
    /// Matrix product (`torch.matmul`).
    matmul / f_matmul(other: &Self);
    /// Batched matrix product.
    bmm / f_bmm(other: &Self);
    /// `self @ weightᵀ + bias`.
    linear / f_linear(weight: &Tensor, bias: Option<&Tensor>);
    /// 1-D convolution.
    conv1d / f_conv1d(weight: &Tensor, bias: Option<&Tensor>, stride: &[i64], padding: &[i64], dilation: &[i64], groups: i64);
    /// 2-D convolution.
    conv2d / f_conv2d(weight: &Tensor, bias: Option<&Tensor>, stride: &[i64], padding: &[i64], dilation: &[i64], groups: i64);
    /// 2-D max pooling.
    max_pool2d / f_max_pool2d(kernel: &[i64], stride: &[i64], padding: &[i64], dilation: &[i64], ceil_mode: bool);
    /// 2-D average pooling.
    avg_pool2d / f_avg_pool2d(kernel: &[i64], stride: &[i64], padding: &[i64], ceil_mode: bool, count_include_pad: bool, divisor_override: Option<i64>);
    /// 2-D adaptive average pooling.
    adaptive_avg_pool2d / f_adaptive_avg_pool2d(output_size: &[i64]);
    /// Dropout.
    dropout / f_dropout(p: f64, train: bool);
    /// Dropout of whole channels.
    feature_dropout / f_feature_dropout(p: f64, train: bool);
    /// Alpha dropout.
    alpha_dropout / f_alpha_dropout(p: f64, train: bool);
    /// Alpha dropout of whole channels.
    feature_alpha_dropout / f_feature_alpha_dropout(p: f64, train: bool);
    /// A view with another shape.
    view / f_view(shape: &[i64]);
    /// Another shape, copying where a view cannot.
    reshape / f_reshape(shape: &[i64]);
    /// Flattens dimensions `start..=end`.
    flatten / f_flatten(start_dim: i64, end_dim: i64);
    /// Swaps two dimensions.
    transpose / f_transpose(dim0: i64, dim1: i64);
    /// Reorders the dimensions.
    permute / f_permute(dims: &[i64]);
    /// Inserts a dimension of size 1.
    unsqueeze / f_unsqueeze(dim: i64);
    /// Removes a dimension of size 1.
    squeeze_dim / f_squeeze_dim(dim: i64);
    /// `length` entries of `dim` from `start`.
    narrow / f_narrow(dim: i64, start: i64, length: i64);
    /// The value in another kind.
    to_kind / f_to_kind(kind: Kind);
    /// A contiguous copy (or the value itself).
    contiguous / f_contiguous();
    /// The sum of all elements.
    sum / f_sum(kind: Option<Kind>);
    /// The mean of all elements.
    mean / f_mean(kind: Option<Kind>);
    /// Sums over `dims`.
    sum_dim_intlist / f_sum_dim_intlist(dims: &[i64], keepdim: bool, kind: Option<Kind>);
    /// Means over `dims`.
    mean_dim / f_mean_dim(dims: &[i64], keepdim: bool, kind: Option<Kind>);
    /// Maxima over `dims`.
    amax / f_amax(dims: &[i64], keepdim: bool);
    /// `value` where `mask` is true.
    masked_fill / f_masked_fill(mask: &Self, value: f64);
    /// The lower triangle.
    tril / f_tril(diagonal: i64);
    /// The upper triangle.
    triu / f_triu(diagonal: i64);
    /// Mean squared error.
    mse_loss / f_mse_loss(target: &Self, reduction: Reduction);
    /// Smooth L1 loss.
    smooth_l1_loss / f_smooth_l1_loss(target: &Self, reduction: Reduction, beta: f64);
    /// Huber loss.
    huber_loss / f_huber_loss(target: &Self, reduction: Reduction, delta: f64);
    /// Cross-entropy of logits against class indices, with class weights, a reduction, an
    /// ignored index and label smoothing.
    cross_entropy_loss / f_cross_entropy_loss(target: &Self, weight: Option<&Tensor>, reduction: Reduction, ignore_index: i64, label_smoothing: f64);
    /// Kullback-Leibler divergence (the input holds log-probabilities).
    kl_div / f_kl_div(target: &Self, reduction: Reduction, log_target: bool);
    /// Entries along `dim` at `index`.
    gather / f_gather(dim: i64, index: &Self, sparse_grad: bool);
    /// Entry `index` of `dim`, the dimension removed.
    select / f_select(dim: i64, index: i64);
    /// Root-mean-square normalization over the trailing `normalized_shape`.
    rms_norm / f_rms_norm(normalized_shape: &[i64], weight: Option<&Tensor>, eps: Option<f64>);
    /// Bilinear upsampling to `output_size`.
    upsample_bilinear2d / f_upsample_bilinear2d(output_size: &[i64], align_corners: bool, scales_h: Option<f64>, scales_w: Option<f64>);
    /// Pads the trailing dimensions (`"constant"` with `value`, `"reflect"`, `"replicate"`,
    /// `"circular"`).
    pad / f_pad(pad: &[i64], mode: &str, value: Option<f64>);
    /// 2-D transposed convolution.
    conv_transpose2d / f_conv_transpose2d(weight: &Tensor, bias: Option<&Tensor>, stride: &[i64], padding: &[i64], output_padding: &[i64], groups: i64, dilation: &[i64]);
}
