//! tch's layers, recorded lazily: `x.apply(&linear)` where `linear` is a `tch::nn::Linear`,
//! and [`Sequential`] / [`SequentialT`], tch's `nn::seq()` / `nn::seq_t()` for both kinds of
//! tensor.
//!
//! Adapters exist for [`nn::Linear`], [`nn::Conv1D`], [`nn::Conv2D`] (every padding mode: the
//! input is padded first, as tch does), [`nn::ConvTranspose2D`], [`nn::LayerNorm`],
//! [`nn::Embedding`] and [`nn::BatchNorm`] (through [`LazyModuleT`]). tch keeps some of their settings private (a
//! convolution's stride, a norm's epsilon); the adapters read them from the layer's `Debug`
//! text, which tch 0.24 prints in full (all of that reading is in one place, `tch_compat`, whose
//! tests fail loudly if a tch release prints it differently). A layer whose settings cannot
//! be read, or that uses something the graph cannot plan (sparse embeddings), is an
//! [`LazyError::Unsupported`] naming it: it is never run eagerly.
//!
//! A model built with [`seq`] is one definition for both uses: tch's `Module` runs it on a
//! `Tensor` (`x.apply(&mlp)`), [`LazyModule`] records it on a [`LazyTensor`]
//! (`lx.apply(&mlp)`). Its layers run eagerly as tch runs them; a function added with
//! [`add_fn`](Sequential::add_fn) takes a `&LazyTensor`; on a `Tensor` it gets the tensor's
//! eager form, whose ops call tch's methods at once (nothing recorded, autograd as usual).
//!
//! ```
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//! use toma::lazy::{lazy, nn::seq};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let mlp = seq()
//!     .add(nn::linear(vs.root() / "l1", 4, 8, Default::default()))
//!     .add_fn(|x| x.relu())
//!     .add(nn::linear(vs.root() / "l2", 8, 3, Default::default()));
//! let x = Tensor::randn([10, 4], (Kind::Float, Device::Cpu));
//! let y = Tensor::zeros([10], (Kind::Int64, Device::Cpu));
//! let eager = x.apply(&mlp).cross_entropy_for_logits(&y);          // tch, as ever
//! let (lx, ly) = lazy((&x, &y), 0);                                 // the one new line
//! let value = lx.apply(&mlp).cross_entropy_for_logits(&ly).backward()?; // micro-batched if it does not fit
//! assert!((eager.double_value(&[]) - value).abs() < 1e-5);
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```

use tch::{nn, Tensor};

/// Everything of tch's `nn` (`VarStore`, `linear`, `Adam`, ..), so that `use toma::lazy::nn;`
/// in place of `use tch::nn;` is the one changed import; the names defined here (`func`,
/// `func_t`, `seq`, `seq_t`, `Module`, `ModuleT`, ..) take the place of tch's.
pub use tch::nn::*;

pub use super::optim::{Optimizer, OptimizerConfig};
pub use super::rnn::{gru, lstm, LazyGRUState, LazyLSTMState, RecurrentState, GRU, LSTM, RNN};
pub use super::scaler::{GradScaler, ScaledStep};

use super::error::LazyError;
use super::tch_compat;
use super::LazyTensor;
use crate::lazy::error::OrPanic;

/// A layer as seen by a [`TensorOps`](super::TensorOps) type: tch's `Module` for `Tensor`, the lazy adapters for
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

/// A layer that records lazily (tch's `Module`, for [`LazyTensor`]s).
pub trait LazyModule {
    /// Records the layer on `xs`.
    ///
    /// # Errors
    /// The recording error of the layer's ops.
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError>;

    /// The layer applied to a `Tensor` by its own eager code, when it has some (tch's layers
    /// do). `None`, the default: a [`Sequential`] applying it to a tensor records
    /// [`lazy_forward`](Self::lazy_forward) and runs the record at once.
    fn eager_forward(&self, xs: &Tensor) -> Option<Tensor> {
        let _ = xs;
        None
    }
}

/// A layer that records lazily and behaves differently in training (tch's `ModuleT`).
pub trait LazyModuleT {
    /// Records the layer on `xs`, in training mode when `train`.
    ///
    /// # Errors
    /// The recording error of the layer's ops.
    fn lazy_forward_t(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError>;

    /// As [`LazyModule::eager_forward`], in training mode when `train`.
    fn eager_forward_t(&self, xs: &Tensor, train: bool) -> Option<Tensor> {
        let _ = (xs, train);
        None
    }
}

impl<M: LazyModule + ?Sized> LazyModuleT for M {
    fn lazy_forward_t(&self, xs: &LazyTensor, _train: bool) -> Result<LazyTensor, LazyError> {
        self.lazy_forward(xs)
    }

    fn eager_forward_t(&self, xs: &Tensor, _train: bool) -> Option<Tensor> {
        self.eager_forward(xs)
    }
}

/// tch's own forward, for a layer that has one.
macro_rules! eager_as_tch {
    () => {
        #[inline]
        fn eager_forward(&self, xs: &Tensor) -> Option<Tensor> {
            Some(nn::Module::forward(self, xs))
        }
    };
}

impl LazyModule for nn::Linear {
    eager_as_tch!();

    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        xs.f_linear(&self.ws, self.bs.as_ref())
    }
}

/// A convolution's input and settings: a padding mode other than zeros pads the input first
/// (as tch does) and leaves the convolution unpadded.
fn conv_input<ND: std::fmt::Debug>(
    layer: &nn::Conv<ND>,
    what: &str,
    xs: &LazyTensor,
) -> Result<(LazyTensor, tch_compat::ConvSettings), LazyError> {
    let mut c = tch_compat::conv(layer, what)?;
    let mode = match c.padding_mode.as_str() {
        "Zeros" => return Ok((xs.clone(), c)),
        "Reflect" => "reflect",
        "Replicate" => "replicate",
        "Circular" => "circular",
        other => {
            return Err(LazyError::Unsupported {
                op: what.into(),
                reason: format!(
                    "padding mode {other} is not one toma::lazy knows (Zeros, Reflect, Replicate, Circular)"
                ),
            })
        }
    };
    // `pad` takes (before, after) pairs from the last dimension backwards.
    let pad: Vec<i64> = c.padding.iter().rev().flat_map(|&p| [p, p]).collect();
    let padded = xs.f_pad(pad, mode, None)?;
    c.padding = vec![0; c.padding.len()];
    Ok((padded, c))
}

impl LazyModule for nn::Conv1D {
    eager_as_tch!();

    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let (xs, c) = conv_input(self, "nn::Conv1D", xs)?;
        xs.f_conv1d(&self.ws, self.bs.as_ref(), c.stride, c.padding, c.dilation, c.groups)
    }
}

impl LazyModule for nn::Conv2D {
    eager_as_tch!();

    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let (xs, c) = conv_input(self, "nn::Conv2D", xs)?;
        xs.f_conv2d(&self.ws, self.bs.as_ref(), c.stride, c.padding, c.dilation, c.groups)
    }
}

impl LazyModule for nn::Conv3D {
    eager_as_tch!();

    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let (xs, c) = conv_input(self, "nn::Conv3D", xs)?;
        xs.f_conv3d(&self.ws, self.bs.as_ref(), c.stride, c.padding, c.dilation, c.groups)
    }
}

impl LazyModule for nn::ConvTranspose2D {
    eager_as_tch!();

    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let c = tch_compat::conv_transpose(self, "nn::ConvTranspose2D")?;
        xs.f_conv_transpose2d(&self.ws, self.bs.as_ref(), c.stride, c.padding, c.output_padding, c.groups, c.dilation)
    }
}

impl LazyModule for nn::LayerNorm {
    eager_as_tch!();

    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let eps = tch_compat::layer_norm_eps(self)?;
        xs.f_layer_norm(&self.normalized_shape, self.ws.as_ref(), self.bs.as_ref(), eps, true)
    }
}

impl LazyModule for nn::GroupNorm {
    eager_as_tch!();

    /// Statistics per sample and group: it splits freely.
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let eps = tch_compat::group_norm_eps(self)?;
        xs.f_group_norm(self.num_groups, self.ws.as_ref(), self.bs.as_ref(), eps, true)
    }
}

impl LazyModule for nn::Embedding {
    eager_as_tch!();

    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let (padding_idx, scale, sparse) = tch_compat::embedding(self)?;
        LazyTensor::f_embedding(&self.ws, xs, padding_idx, scale, sparse)
    }
}

impl LazyModuleT for nn::BatchNorm {
    #[inline]
    fn eager_forward_t(&self, xs: &Tensor, train: bool) -> Option<Tensor> {
        Some(nn::ModuleT::forward_t(self, xs, train))
    }

    /// Eval mode uses the running statistics (splits freely); training mode normalizes with
    /// batch statistics (splitting is refused unless allowed).
    fn lazy_forward_t(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        let dim = xs.dim();
        let ok = if self.nd == 1 { dim == 2 || dim == 3 } else { dim == self.nd + 2 };
        if !ok {
            return Err(LazyError::Argument {
                op: "batch_norm".into(),
                shape: xs.size(),
                reason: format!(
                    "as nd={}, expected an input with {} dims",
                    self.nd,
                    if self.nd == 1 { 2 } else { self.nd + 2 }
                ),
            });
        }
        let (eps, momentum) = tch_compat::batch_norm(self)?;
        xs.f_batch_norm(self.ws.as_ref(), self.bs.as_ref(), &self.running_mean, &self.running_var, train, momentum, eps)
    }
}

use sealed::Step;

struct LayerStep<M>(M);

impl<M: LazyModuleT + Send> Step for LayerStep<M> {
    fn record(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        self.0.lazy_forward_t(xs, train)
    }
    fn eager(&self, xs: &Tensor, train: bool) -> Option<Tensor> {
        self.0.eager_forward_t(xs, train)
    }
}

struct FnStep<F>(F);

impl<F: Fn(&LazyTensor, bool) -> Result<LazyTensor, LazyError> + Send> Step for FnStep<F> {
    fn record(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        (self.0)(xs, train)
    }
    fn eager(&self, _: &Tensor, _: bool) -> Option<Tensor> {
        None
    }
}

/// The steps shared by [`Sequential`] and [`SequentialT`].
#[derive(Default)]
struct Steps(Vec<Box<dyn Step>>);

impl Steps {
    fn push_layer<M: LazyModuleT + Send + 'static>(&mut self, layer: M) {
        self.0.push(Box::new(LayerStep(layer)));
    }

    fn push_fn(&mut self, f: impl Fn(&LazyTensor, bool) -> Result<LazyTensor, LazyError> + Send + 'static) {
        self.0.push(Box::new(FnStep(f)));
    }

    fn record(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        let mut x = xs.clone();
        for step in &self.0 {
            x = step.record(&x, train)?;
        }
        Ok(x)
    }

    /// Each step eagerly: a layer by its own code, a function (or a lazy-only layer) on the
    /// value so far in its eager form, each op run at once.
    fn run(&self, xs: &Tensor, train: bool) -> Result<Tensor, LazyError> {
        let mut x = xs.shallow_clone();
        for step in &self.0 {
            x = eager_step(&**step, x, train)?;
        }
        Ok(x)
    }

    /// Every step's output, up to the `n`th, as tch's `forward_all_t`: its first step runs
    /// whatever `n` is, and an empty sequence gives its input.
    fn all<X: SequenceInput>(&self, xs: &X, train: bool, n: Option<usize>) -> Result<Vec<X>, LazyError> {
        let Some(first) = self.0.first() else { return Ok(vec![xs.again()]) };
        let n = n.unwrap_or(self.0.len()).clamp(1, self.0.len());
        let mut outputs = Vec::with_capacity(n);
        outputs.push(X::through(&**first, xs, train)?);
        for step in &self.0[1..n] {
            let x = X::through(&**step, outputs.last().expect("the first step's output"), train)?;
            outputs.push(x);
        }
        Ok(outputs)
    }
}

fn eager_step(step: &dyn Step, x: Tensor, train: bool) -> Result<Tensor, LazyError> {
    match step.eager(&x, train) {
        Some(y) => Ok(y),
        None => super::exec::run_eagerly(&step.record(&LazyTensor::from_eager(x), train)?),
    }
}

/// What a sequence's `forward_all` and `forward_all_t` take: a `Tensor` (each step runs at
/// once, as in tch) or a [`LazyTensor`] (each step is recorded).
pub trait SequenceInput: sealed::Through {}

impl SequenceInput for Tensor {}
impl SequenceInput for LazyTensor {}

// Public names in a private module: `SequenceInput` names them, users cannot.
mod sealed {
    use super::{LazyError, LazyTensor, Tensor};

    /// One step of a sequence: its recording, and its eager form when it has one.
    pub trait Step: Send {
        fn record(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError>;
        fn eager(&self, xs: &Tensor, train: bool) -> Option<Tensor>;
    }

    /// One step of a sequence on this kind of tensor.
    pub trait Through: Sized {
        fn through(step: &dyn Step, x: &Self, train: bool) -> Result<Self, LazyError>;
        fn again(&self) -> Self;
    }

    impl Through for Tensor {
        fn through(step: &dyn Step, x: &Tensor, train: bool) -> Result<Tensor, LazyError> {
            super::eager_step(step, x.shallow_clone(), train)
        }
        fn again(&self) -> Tensor {
            self.shallow_clone()
        }
    }

    impl Through for LazyTensor {
        fn through(step: &dyn Step, x: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
            step.record(x, train)
        }
        fn again(&self) -> LazyTensor {
            self.clone()
        }
    }
}

/// A sequence of layers and functions, as tch's `nn::Sequential`, for tensors and lazy tensors:
/// tch's `Module` (`x.apply(&seq)` on a `Tensor`) and [`LazyModule`] (`lx.apply(&seq)`). See the
/// [module docs](self). For layers that behave differently in training, use [`seq_t`].
#[must_use]
pub struct Sequential {
    steps: Steps,
}

/// A sequence that knows training from evaluation, as tch's `nn::SequentialT`: tch's
/// `ModuleT` (`x.apply_t(&seq, train)`) and [`LazyModuleT`] (`lx.apply_t(&seq, train)`).
#[must_use]
pub struct SequentialT {
    steps: Steps,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sequential[{} layers]", self.steps.0.len())
    }
}

impl std::fmt::Debug for SequentialT {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SequentialT[{} layers]", self.steps.0.len())
    }
}

/// An empty [`Sequential`] (tch's `nn::seq`).
pub fn seq() -> Sequential {
    Sequential { steps: Steps::default() }
}

/// An empty [`SequentialT`] (tch's `nn::seq_t`).
pub fn seq_t() -> SequentialT {
    SequentialT { steps: Steps::default() }
}

/// The methods `Sequential` and `SequentialT` share, as tch's two sequences share them.
macro_rules! shared_methods {
    () => {
        /// Appends a function, as tch's `add_fn` (`|x| x.relu()`). A panicking op panics at
        /// forward; use [`add_f_fn`](Self::add_f_fn) for errors instead.
        pub fn add_fn<F: Fn(&LazyTensor) -> LazyTensor + Send + 'static>(mut self, f: F) -> Self {
            self.steps.push_fn(move |xs, _| Ok(f(xs)));
            self
        }

        /// Appends a fallible function (`|x| x.f_relu()`).
        pub fn add_f_fn<F: Fn(&LazyTensor) -> Result<LazyTensor, LazyError> + Send + 'static>(mut self, f: F) -> Self {
            self.steps.push_fn(move |xs, _| f(xs));
            self
        }

        /// The number of layers and functions.
        pub fn len(&self) -> usize {
            self.steps.0.len()
        }

        /// Whether there is none.
        pub fn is_empty(&self) -> bool {
            self.steps.0.is_empty()
        }
    };
}

impl Sequential {
    /// Appends a layer (`nn::Linear`, `nn::Conv2D`, another `Sequential`, ..), as tch's `add`.
    // Named as tch's `Sequential::add`, on purpose.
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: LazyModule + Send + 'static>(mut self, layer: M) -> Self {
        self.steps.push_layer(layer);
        self
    }

    shared_methods!();

    /// Every layer's output, up to the `n`th (all of them for `None`), as tch's
    /// `Sequential::forward_all`: on a `Tensor` each runs at once, on a [`LazyTensor`] each is
    /// recorded.
    ///
    /// # Panics
    /// When a step's ops cannot be recorded or run, as tch's layers panic; see
    /// [`f_forward_all`](Self::f_forward_all).
    #[track_caller]
    pub fn forward_all<X: SequenceInput>(&self, xs: &X, n: Option<usize>) -> Vec<X> {
        self.steps.all(xs, false, n).or_panic()
    }

    /// [`forward_all`](Self::forward_all), with the error returned.
    ///
    /// # Errors
    /// The first step's error that cannot be recorded or run.
    pub fn f_forward_all<X: SequenceInput>(&self, xs: &X, n: Option<usize>) -> Result<Vec<X>, LazyError> {
        self.steps.all(xs, false, n)
    }
}

impl SequentialT {
    /// Appends a layer (`nn::Linear`, `nn::BatchNorm`, another sequence, ..), as tch's `add`.
    // Named as tch's `SequentialT::add`, on purpose.
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: LazyModuleT + Send + 'static>(mut self, layer: M) -> Self {
        self.steps.push_layer(layer);
        self
    }

    shared_methods!();

    /// Appends a function of the training flag (`|x, train| x.dropout(0.1, train)`), as tch's
    /// `add_fn_t`.
    pub fn add_fn_t<F: Fn(&LazyTensor, bool) -> LazyTensor + Send + 'static>(mut self, f: F) -> Self {
        self.steps.push_fn(move |xs, train| Ok(f(xs, train)));
        self
    }

    /// Every layer's output, up to the `n`th (all of them for `None`), as tch's
    /// `SequentialT::forward_all_t`: on a `Tensor` each runs at once, on a [`LazyTensor`] each
    /// is recorded. tch-rs's neural style transfer reads a VGG's layers so:
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, nn};
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let conv = nn::ConvConfig { padding: 1, ..Default::default() };
    /// let net = nn::seq_t()
    ///     .add(nn::conv2d(vs.root() / "0", 3, 8, 3, conv))
    ///     .add_fn(|xs| xs.relu())
    ///     .add_fn(|xs| xs.max_pool2d_default(2));
    /// let image = Tensor::rand([1, 3, 16, 16], (Kind::Float, Device::Cpu));
    /// let eager = net.forward_all_t(&image, false, Some(2));
    /// let recorded = net.forward_all_t(&lazy(&image, None), false, Some(2));
    /// assert_eq!(recorded.len(), 2);
    /// assert!(recorded[1].to_tensor()?.allclose(&eager[1], 1e-6, 1e-6, false));
    /// # Ok::<(), toma::lazy::LazyError>(())
    /// ```
    ///
    /// # Panics
    /// When a step's ops cannot be recorded or run, as tch's layers panic; see
    /// [`f_forward_all_t`](Self::f_forward_all_t).
    #[track_caller]
    pub fn forward_all_t<X: SequenceInput>(&self, xs: &X, train: bool, n: Option<usize>) -> Vec<X> {
        self.steps.all(xs, train, n).or_panic()
    }

    /// [`forward_all_t`](Self::forward_all_t), with the error returned.
    ///
    /// # Errors
    /// The first step's error that cannot be recorded or run.
    pub fn f_forward_all_t<X: SequenceInput>(
        &self,
        xs: &X,
        train: bool,
        n: Option<usize>,
    ) -> Result<Vec<X>, LazyError> {
        self.steps.all(xs, train, n)
    }
}

impl LazyModule for Sequential {
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        self.steps.record(xs, false)
    }

    fn eager_forward(&self, xs: &Tensor) -> Option<Tensor> {
        Some(nn::Module::forward(self, xs))
    }
}

impl LazyModuleT for SequentialT {
    fn lazy_forward_t(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        self.steps.record(xs, train)
    }

    fn eager_forward_t(&self, xs: &Tensor, train: bool) -> Option<Tensor> {
        Some(nn::ModuleT::forward_t(self, xs, train))
    }
}

impl nn::Module for Sequential {
    /// Runs every step eagerly (see the [module docs](self)).
    ///
    /// # Panics
    /// When a function's ops cannot be recorded or run, as tch's layers panic.
    #[track_caller]
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.steps.run(xs, false).or_panic()
    }
}

impl nn::ModuleT for SequentialT {
    /// Runs every step eagerly, in training mode when `train`.
    ///
    /// # Panics
    /// When a function's ops cannot be recorded or run, as tch's layers panic.
    #[track_caller]
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.steps.run(xs, train).or_panic()
    }
}

// ---------------------------------------------------------------------------------------------
// tch's closures as layers, and the traits an `impl ModuleT` return names.

/// A layer that runs on tensors and records on lazy tensors: what `-> impl Module` names when
/// this module is imported as `nn` in place of `tch::nn`. Every type that is both tch's
/// `Module` and a [`LazyModule`] is one ([`func`], [`seq`], tch's layers).
///
/// Importing it in place of tch's `Module` keeps `layer.forward(&xs)` working on tensors (tch's
/// method, under the same name) and makes it work on lazy tensors (the layer recorded, as
/// `lx.apply(&layer)`). Do not import both (the method would be ambiguous). Its `forward` is
/// generic over the kind of tensor ([`Forward`]), so it is not called on a `dyn Module`: call
/// tch's `nn::Module::forward` there.
pub trait Module: nn::Module + LazyModule {
    /// tch's `Module::forward` on a `Tensor`; on a [`LazyTensor`] the layer recorded, as
    /// `xs.apply(self)`: one method call for both kinds of tensor.
    ///
    /// # Panics
    /// On a lazy tensor, when the layer's ops cannot be recorded (as `apply`).
    #[track_caller]
    fn forward<X: Forward>(&self, xs: &X) -> X
    where
        Self: Sized,
    {
        X::forward_of(self, xs)
    }
}

/// The kinds of tensor a layer's [`Module::forward`] and [`ModuleT::forward_t`] take: tch's
/// `Tensor` (tch's own forward) and [`LazyTensor`] (the layer recorded).
pub trait Forward: Sized {
    /// `m` on `xs`.
    fn forward_of<M: Module>(m: &M, xs: &Self) -> Self;
    /// `m` on `xs`, in training mode when `train`.
    fn forward_t_of<M: ModuleT>(m: &M, xs: &Self, train: bool) -> Self;
}

impl Forward for Tensor {
    fn forward_of<M: Module>(m: &M, xs: &Tensor) -> Tensor {
        nn::Module::forward(m, xs)
    }

    fn forward_t_of<M: ModuleT>(m: &M, xs: &Tensor, train: bool) -> Tensor {
        nn::ModuleT::forward_t(m, xs, train)
    }
}

impl Forward for LazyTensor {
    #[track_caller]
    fn forward_of<M: Module>(m: &M, xs: &LazyTensor) -> LazyTensor {
        xs.apply(m)
    }

    #[track_caller]
    fn forward_t_of<M: ModuleT>(m: &M, xs: &LazyTensor, train: bool) -> LazyTensor {
        xs.apply_t(m, train)
    }
}

impl<M: nn::Module + LazyModule + ?Sized> Module for M {}

/// [`Module`] for layers that know training from evaluation: what `-> impl ModuleT` names
/// ([`func_t`], [`seq_t`], `nn::BatchNorm`, anything that is a [`Module`]). Its `forward_t`
/// is tch's, as `Module::forward` is.
pub trait ModuleT: nn::ModuleT + LazyModuleT {
    /// tch's `ModuleT::forward_t` on a `Tensor`; on a [`LazyTensor`] the layer recorded, as
    /// `xs.apply_t(self, train)`: one method call for both kinds of tensor.
    ///
    /// # Panics
    /// On a lazy tensor, when the layer's ops cannot be recorded (as `apply_t`).
    #[track_caller]
    fn forward_t<X: Forward>(&self, xs: &X, train: bool) -> X
    where
        Self: Sized,
    {
        X::forward_t_of(self, xs, train)
    }

    /// tch's `ModuleT::batch_accuracy_for_logits`, in scope with this trait as with tch's
    /// (tch's examples call it after the import is switched).
    fn batch_accuracy_for_logits(&self, xs: &Tensor, ys: &Tensor, d: tch::Device, batch_size: i64) -> f64 {
        nn::ModuleT::batch_accuracy_for_logits(self, xs, ys, d, batch_size)
    }
}

impl<M: nn::ModuleT + LazyModuleT + ?Sized> ModuleT for M {}

/// A closure as a layer, as tch's `nn::Func`, for both kinds of tensor: the closure takes a
/// `&LazyTensor` (tch's tensor methods are there by the same names), is recorded as written
/// on a lazy tensor, and on a `Tensor` runs as tch's closure would: each op calls tch's method
/// at once (with autograd), nothing recorded. (An op with no such direct path, a rare one, is
/// recorded and run at once.)
pub struct Func<'a> {
    f: Box<dyn 'a + Fn(&LazyTensor) -> LazyTensor + Send>,
}

/// A closure of a tensor and the training flag.
type ForwardFn<'a> = Box<dyn 'a + Fn(&LazyTensor, bool) -> LazyTensor + Send>;

/// [`Func`] with the training flag, as tch's `nn::FuncT`.
pub struct FuncT<'a> {
    f: ForwardFn<'a>,
}

impl std::fmt::Debug for Func<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("func")
    }
}

impl std::fmt::Debug for FuncT<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("func_t")
    }
}

/// A layer from a closure, as tch's `nn::func`: `nn::func(|xs| xs.relu() * 2.0)`.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// use toma::lazy::{lazy, nn};
///
/// fn gelu_block<'a>(p: nn::Path<'a>) -> impl nn::Module + 'a {
///     let up = nn::linear(&p / "up", 4, 16, Default::default());
///     let down = nn::linear(&p / "down", 16, 4, Default::default());
///     nn::func(move |xs| xs.apply(&up).gelu("none").apply(&down))
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let block = gelu_block(vs.root());
/// let x = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
/// let eager = x.apply(&block);
/// let lazily = lazy(&x, 0).apply(&block).to_tensor()?;
/// assert!(eager.allclose(&lazily, 1e-6, 1e-6, false));
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
pub fn func<'a, F: 'a + Fn(&LazyTensor) -> LazyTensor + Send>(f: F) -> Func<'a> {
    Func { f: Box::new(f) }
}

/// A layer from a closure of the training flag, as tch's `nn::func_t`:
/// `nn::func_t(|xs, train| xs.dropout(0.1, train))`.
pub fn func_t<'a, F: 'a + Fn(&LazyTensor, bool) -> LazyTensor + Send>(f: F) -> FuncT<'a> {
    FuncT { f: Box::new(f) }
}

/// Runs a closure on a tensor: its ops run at once on `xs` (what it recorded, if anything, is
/// run at the end).
#[track_caller]
fn record_and_run(xs: &Tensor, record: impl FnOnce(&LazyTensor) -> LazyTensor) -> Tensor {
    super::exec::run_eagerly(&record(&LazyTensor::from_eager(xs.shallow_clone()))).or_panic()
}

impl LazyModule for Func<'_> {
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        Ok((self.f)(xs))
    }
}

impl nn::Module for Func<'_> {
    /// The closure run on `xs`: each op calls tch's method at once.
    ///
    /// # Panics
    /// When an op of the closure fails, as tch's ops panic.
    fn forward(&self, xs: &Tensor) -> Tensor {
        record_and_run(xs, |x| (self.f)(x))
    }
}

impl LazyModuleT for FuncT<'_> {
    fn lazy_forward_t(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        Ok((self.f)(xs, train))
    }
}

impl nn::ModuleT for FuncT<'_> {
    /// The closure run on `xs`: each op calls tch's method at once.
    ///
    /// # Panics
    /// When an op of the closure fails, as tch's ops panic.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        record_and_run(xs, |x| (self.f)(x, train))
    }
}

/// `ModuleT` for tensors and `LazyModuleT` for lazy tensors, both by the one `forward_t`.
macro_rules! both_modules {
    ($($model:ty),*) => {$(
        impl tch::nn::ModuleT for $model {
            fn forward_t(&self, xs: &tch::Tensor, train: bool) -> tch::Tensor {
                <$model>::forward_t(self, xs, train)
            }
        }

        /// Records the model; a shape that does not fit panics with the recording error, as
        /// tch's eager model panics.
        impl $crate::lazy::nn::LazyModuleT for $model {
            fn lazy_forward_t(
                &self,
                xs: &$crate::lazy::LazyTensor,
                train: bool,
            ) -> Result<$crate::lazy::LazyTensor, $crate::lazy::LazyError> {
                Ok(<$model>::forward_t(self, xs, train))
            }
        }
    )*};
}
pub(crate) use both_modules;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lazy::graph::RECORDED;
    use tch::{Device, Kind};

    fn recorded() -> u64 {
        RECORDED.with(std::cell::Cell::get)
    }

    #[test]
    fn a_func_on_a_tensor_records_nothing() {
        let vs = VarStore::new(Device::Cpu);
        let p = vs.root();
        let (ln, qkv, proj) = (
            layer_norm(&p / "ln", vec![8], Default::default()),
            linear(&p / "qkv", 8, 24, Default::default()),
            linear(&p / "proj", 8, 8, Default::default()),
        );
        let gamma = p.ones("gamma", &[8]);
        let block = func_t(move |xs, train| {
            let (b, t, c) = xs.size3().unwrap();
            let parts = xs.apply(&ln).apply(&qkv).split(c, 2);
            let heads = |x: &LazyTensor| x.view([b, t, 2, c / 2]).transpose(1, 2);
            let (q, k, v) = (heads(&parts[0]), heads(&parts[1]), heads(&parts[2]));
            let att = (q.matmul(&k.transpose(-2, -1)) * 0.5).softmax(-1, Kind::Float).dropout(0.1, train);
            let y = att.matmul(&v).transpose(1, 2).contiguous().view([b, t, c]).apply(&proj);
            (xs + y.gelu("none")) * &gamma - 1.0
        });
        let x = Tensor::randn([2, 5, 8], (Kind::Float, Device::Cpu));
        let before = recorded();
        let eager = x.apply_t(&block, false);
        assert_eq!(recorded(), before, "the common ops call tch's methods directly");
        let lazily = crate::lazy::lazy(&x, 0).apply_t(&block, false).to_tensor().unwrap();
        assert!(recorded() > before, "a lazy tensor records");
        assert!(eager.allclose(&lazily, 1e-5, 1e-5, false));
        // An op without a direct path (a composite loss) is recorded and run at once: still eager.
        let target = Tensor::ones([2, 5, 8], (Kind::Float, Device::Cpu));
        let odd = func(move |xs| {
            LazyTensor::f_margin_ranking_loss(xs, &xs.neg(), &target, 0.5, tch::Reduction::Mean).unwrap() + 0.0
        });
        let before = recorded();
        let y = x.apply(&odd);
        assert!(recorded() > before, "recorded");
        let expected = (&x - x.neg()).neg().g_add_scalar(0.5).clamp_min(0.0).mean(Kind::Float);
        assert!(y.allclose(&expected, 1e-6, 1e-6, false), "{y} against {expected}");
    }

    /// The ops with no method of tch's own name (static methods, integer scalars, composite
    /// losses) call tch directly on values computed at once too: nothing recorded, tch's result.
    #[test]
    fn ops_without_a_twin_on_a_tensor_record_nothing() {
        use crate::lazy::LazyTensor;
        let x = Tensor::randn([4, 6], (Kind::Float, Device::Cpu));
        let img = Tensor::randn([2, 3, 5, 5], (Kind::Float, Device::Cpu));
        let ints = Tensor::from_slice(&[3i64, -2, 7, 5]);
        let labels = Tensor::from_slice(&[1i64, 0, 3, 5]);
        let table = Tensor::randn([10, 6], (Kind::Float, Device::Cpu));
        let (ones, zeros, weight) = (
            Tensor::ones([3], (Kind::Float, Device::Cpu)),
            Tensor::zeros([3], (Kind::Float, Device::Cpu)),
            Tensor::rand([6], (Kind::Float, Device::Cpu)),
        );
        type Case<'a> = (&'a str, Box<dyn Fn(&LazyTensor, &LazyTensor, &LazyTensor) -> LazyTensor + 'a>, Tensor);
        let cases: Vec<Case> = vec![
            ("2 * x", Box::new(|x, _, _| 2 * x), 2 * &x),
            ("x + 1", Box::new(|x, _, _| x + 1), &x + 1),
            ("x / 2", Box::new(|x, _, _| x / 2), &x / 2),
            ("7 - ints", Box::new(|_, _, i| 7 - i), 7 - &ints),
            ("ints * 3", Box::new(|_, _, i| i * 3), &ints * 3),
            ("2 / x", Box::new(|x, _, _| x.rdiv_scalar(2.0)), x.reciprocal() * 2.0),
            ("cat", Box::new(|x, _, _| LazyTensor::cat(&[x, x], 1)), Tensor::cat(&[&x, &x], 1)),
            ("stack", Box::new(|x, _, _| LazyTensor::stack(&[x, x], 0)), Tensor::stack(&[&x, &x], 0)),
            (
                "einsum",
                Box::new(|x, _, _| LazyTensor::einsum("ij,kj->ik", &[x, x], None::<i64>)),
                Tensor::einsum("ij,kj->ik", &[&x, &x], None::<i64>),
            ),
            (
                "cross_entropy",
                Box::new(|x, _, _| x.cross_entropy_for_logits(&labels)),
                x.cross_entropy_for_logits(&labels),
            ),
            (
                "nll_loss",
                Box::new(|x, _, _| {
                    x.log_softmax(-1, Kind::Float).f_nll_loss(&labels, Some(&weight), tch::Reduction::Sum, 3).unwrap()
                }),
                x.log_softmax(-1, Kind::Float).g_nll_loss(&labels, Some(&weight), tch::Reduction::Sum, 3),
            ),
            (
                "embedding",
                Box::new(|_, _, i| LazyTensor::embedding(&table, &i.abs(), -1, false, false)),
                Tensor::embedding(&table, &ints.abs(), -1, false, false),
            ),
            (
                "batch_norm",
                Box::new(|_, m, _| {
                    m.batch_norm(Some(&weight.narrow(0, 0, 3)), Some(&zeros), &zeros, &ones, false, 0.1, 1e-5)
                }),
                Tensor::batch_norm(
                    &img,
                    Some(&weight.narrow(0, 0, 3)),
                    Some(&zeros),
                    Some(&zeros),
                    Some(&ones),
                    false,
                    0.1,
                    1e-5,
                    true,
                ),
            ),
            ("flat_view", Box::new(|_, m, _| m.flat_view()), img.flat_view()),
        ];
        for (name, op, expected) in &cases {
            let (a, m, i) = (
                LazyTensor::from_eager(x.shallow_clone()),
                LazyTensor::from_eager(img.shallow_clone()),
                LazyTensor::from_eager(ints.shallow_clone()),
            );
            let before = recorded();
            let got = op(&a, &m, &i);
            assert_eq!(recorded(), before, "{name} recorded a node");
            let got = got.eager_value().unwrap_or_else(|| panic!("{name} is computed at once"));
            assert_eq!(got.kind(), expected.kind(), "{name}");
            assert!(got.equal(expected), "{name}: {got} against {expected}");
        }
        // A static method over tch tensors alone still records (fixed operands of a graph).
        let before = recorded();
        let emb = LazyTensor::embedding(&table, &ints.abs(), -1, false, false);
        assert!(emb.eager_value().is_none() && recorded() > before, "tensors alone are fixed operands");
    }
}
