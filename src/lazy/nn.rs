//! tch's layers, recorded lazily: `x.apply(&linear)` where `linear` is a `tch::nn::Linear`,
//! and a lazy [`Sequential`].
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
//! ```
//! use tch::{nn, Device, Kind, Tensor};
//! use toma::lazy::{lazy, nn::seq};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let model = seq()
//!     .add(nn::linear(vs.root() / "l1", 4, 8, Default::default()))
//!     .add_fn(|x| x.relu())
//!     .add(nn::linear(vs.root() / "l2", 8, 3, Default::default()));
//! let (x, y) = lazy((&Tensor::randn([10, 4], (Kind::Float, Device::Cpu)), &Tensor::zeros([10], (Kind::Int64, Device::Cpu))), 0);
//! let loss = model.forward(&x)?.cross_entropy_for_logits(&y);
//! let value = loss.backward()?; // micro-batched if the batch does not fit
//! assert!(value.is_finite());
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```

use tch::nn;

use super::error::LazyError;
use super::tch_compat;
use super::LazyTensor;

/// A layer that records lazily (tch's `Module`, for [`LazyTensor`]s).
pub trait LazyModule {
    /// Records the layer on `xs`.
    ///
    /// # Errors
    /// The recording error of the layer's ops.
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError>;
}

/// A layer that records lazily and behaves differently in training (tch's `ModuleT`).
pub trait LazyModuleT {
    /// Records the layer on `xs`, in training mode when `train`.
    ///
    /// # Errors
    /// The recording error of the layer's ops.
    fn lazy_forward_t(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError>;
}

impl<M: LazyModule + ?Sized> LazyModuleT for M {
    fn lazy_forward_t(&self, xs: &LazyTensor, _train: bool) -> Result<LazyTensor, LazyError> {
        self.lazy_forward(xs)
    }
}

impl LazyModule for nn::Linear {
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
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let (xs, c) = conv_input(self, "nn::Conv1D", xs)?;
        xs.f_conv1d(&self.ws, self.bs.as_ref(), c.stride, c.padding, c.dilation, c.groups)
    }
}

impl LazyModule for nn::Conv2D {
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let (xs, c) = conv_input(self, "nn::Conv2D", xs)?;
        xs.f_conv2d(&self.ws, self.bs.as_ref(), c.stride, c.padding, c.dilation, c.groups)
    }
}

impl LazyModule for nn::ConvTranspose2D {
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let c = tch_compat::conv_transpose(self, "nn::ConvTranspose2D")?;
        xs.f_conv_transpose2d(&self.ws, self.bs.as_ref(), c.stride, c.padding, c.output_padding, c.groups, c.dilation)
    }
}

impl LazyModule for nn::LayerNorm {
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let eps = tch_compat::layer_norm_eps(self)?;
        xs.f_layer_norm(&self.normalized_shape, self.ws.as_ref(), self.bs.as_ref(), eps)
    }
}

impl LazyModule for nn::Embedding {
    fn lazy_forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        let (padding_idx, scale, sparse) = tch_compat::embedding(self)?;
        if sparse {
            return Err(LazyError::Unsupported {
                op: "nn::Embedding".into(),
                reason: "sparse gradients are not planned; use a dense embedding".into(),
            });
        }
        LazyTensor::f_embedding(&self.ws, xs, padding_idx, scale)
    }
}

impl LazyModuleT for nn::BatchNorm {
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

type LayerFn = dyn Fn(&LazyTensor, bool) -> Result<LazyTensor, LazyError>;

/// A lazy sequence of layers and functions (tch's `SequentialT`, recording).
#[must_use]
pub struct Sequential {
    layers: Vec<Box<LayerFn>>,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sequential[{} layers]", self.layers.len())
    }
}

/// An empty [`Sequential`].
pub fn seq() -> Sequential {
    Sequential { layers: Vec::new() }
}

impl Sequential {
    /// Appends a layer (`nn::Linear`, `nn::Conv2D`, `nn::BatchNorm`, another `Sequential`, ..).
    // Named as tch's `Sequential::add`, on purpose.
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: LazyModuleT + 'static>(mut self, layer: M) -> Self {
        self.layers.push(Box::new(move |xs, train| layer.lazy_forward_t(xs, train)));
        self
    }

    /// Appends a function, as tch's `add_fn` (`|x| x.relu()`). A panicking op panics at
    /// [`forward`](Self::forward); use [`add_f_fn`](Self::add_f_fn) for errors instead.
    pub fn add_fn<F: Fn(&LazyTensor) -> LazyTensor + 'static>(mut self, f: F) -> Self {
        self.layers.push(Box::new(move |xs, _| Ok(f(xs))));
        self
    }

    /// Appends a fallible function (`|x| x.f_relu()`).
    pub fn add_f_fn<F: Fn(&LazyTensor) -> Result<LazyTensor, LazyError> + 'static>(mut self, f: F) -> Self {
        self.layers.push(Box::new(move |xs, _| f(xs)));
        self
    }

    /// Appends a function of the training flag (`|x, train| x.dropout(0.1, train)`).
    pub fn add_fn_t<F: Fn(&LazyTensor, bool) -> LazyTensor + 'static>(mut self, f: F) -> Self {
        self.layers.push(Box::new(move |xs, train| Ok(f(xs, train))));
        self
    }

    /// The number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether there is no layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Records every layer in eval mode.
    ///
    /// # Errors
    /// The first layer's recording error.
    pub fn forward(&self, xs: &LazyTensor) -> Result<LazyTensor, LazyError> {
        self.forward_t(xs, false)
    }

    /// Records every layer, in training mode when `train`.
    ///
    /// # Errors
    /// The first layer's recording error.
    pub fn forward_t(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        let mut x = xs.clone();
        for layer in &self.layers {
            x = layer(&x, train)?;
        }
        Ok(x)
    }
}

impl LazyModuleT for Sequential {
    fn lazy_forward_t(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        self.forward_t(xs, train)
    }
}
