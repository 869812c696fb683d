//! tch's optimizer step for lazy losses: `opt.backward_step(&loss)` with `loss` a
//! [`LazyTensor`] plans the step, runs it (in micro-batches when the batch does not fit) and
//! steps, as tch's `backward_step` does for a `Tensor`.
//!
//! tch's `Optimizer::backward_step` takes a `&Tensor` and, being inherent, cannot be extended.
//! [`OptimizerConfig`] (imported with `use toma::lazy::nn;` in place of `use tch::nn;`) builds
//! the same tch optimizer, wrapped in an [`Optimizer`] whose step methods take either kind of
//! loss; everything else is tch's (`set_lr`, `zero_grad`, `clip_grad_norm`, .. through `Deref`).
//!
//! ```
//! use tch::{Device, Kind, Tensor};
//! use toma::lazy::{lazy, nn, nn::OptimizerConfig, Options};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let model = nn::linear(vs.root(), 4, 3, Default::default());
//! let mut opt = nn::AdamW::default().build(&vs, 1e-3)?;
//! let x = Tensor::randn([32, 4], (Kind::Float, Device::Cpu));
//! let y = Tensor::randint(3, [32], (Kind::Int64, Device::Cpu));
//! let (lx, ly) = lazy((&x, &y), 0);
//! let loss = lx.apply(&model).cross_entropy_for_logits(&ly);
//! let value = opt.backward_step_clip(&loss, 0.5); // the loss, as `backward` returns it
//! assert!(value.is_finite());
//! // Read after the step, as tch's examples print it: the step's value, nothing run again.
//! assert_eq!(f64::try_from(&loss)?, value);
//! // Options (a budget, a micro-batch) as `backward_with` takes them:
//! opt.f_backward_step_with(&loss, &Options::new().micro_batch(8))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ops::{Deref, DerefMut};

use tch::{nn, TchError, Tensor};

use super::error::LazyError;
use super::graph::LazyTensor;
use super::options::Options;
use crate::lazy::error::OrPanic;

/// tch's `OptimizerConfig` (`nn::Adam::default()`, `nn::AdamW`, `nn::Sgd`, ..), building an
/// [`Optimizer`] that steps lazy losses too. Implemented for every tch optimizer config.
pub trait OptimizerConfig: nn::OptimizerConfig {
    /// The optimizer over `vs`'s trainable variables at learning rate `lr`, as tch's `build`.
    ///
    /// # Errors
    /// tch's, when the optimizer cannot be made.
    fn build(self, vs: &nn::VarStore, lr: f64) -> Result<Optimizer, TchError>
    where
        Self: Sized,
    {
        nn::OptimizerConfig::build(self, vs, lr).map(Optimizer)
    }
}

impl<C: nn::OptimizerConfig> OptimizerConfig for C {}

/// tch's `nn::Optimizer` whose step methods take a `Tensor` or a [`LazyTensor`] loss (see the
/// [module docs](self)). Derefs to tch's optimizer for everything else.
#[derive(Debug)]
pub struct Optimizer(pub nn::Optimizer);

/// How the gradients are clipped between backward and step, as tch's three step methods do.
#[derive(Clone, Copy, Debug)]
enum Clip {
    None,
    Value(f64),
    Norm(f64),
}

/// A loss the optimizer can step on: tch's `Tensor` (stepped by tch, as ever) or a
/// [`LazyTensor`] (planned, maybe micro-batched, then stepped).
pub trait Loss {
    /// What a step returns: `()` for a `Tensor`, as tch's methods return; the loss value for a
    /// lazy loss, computed by its backward pass anyway.
    type Value;

    #[doc(hidden)]
    fn step(
        &self,
        opt: &mut nn::Optimizer,
        clip: ClipSetting,
        options: Option<&Options>,
    ) -> Result<Self::Value, LazyError>;
}

#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct ClipSetting(Clip);

impl Loss for Tensor {
    type Value = ();

    fn step(&self, opt: &mut nn::Optimizer, clip: ClipSetting, _: Option<&Options>) -> Result<(), LazyError> {
        match clip.0 {
            Clip::None => opt.backward_step(self),
            Clip::Value(max) => opt.backward_step_clip(self, max),
            Clip::Norm(max) => opt.backward_step_clip_norm(self, max),
        }
        Ok(())
    }
}

impl Loss for LazyTensor {
    type Value = f64;

    fn step(&self, opt: &mut nn::Optimizer, clip: ClipSetting, options: Option<&Options>) -> Result<f64, LazyError> {
        // As tch's step: gradients set to none first, so the plan counts their creation.
        opt.zero_grad();
        let value = match options {
            Some(options) => self.backward_with(options)?,
            None => self.backward()?,
        };
        match clip.0 {
            Clip::None => {}
            Clip::Value(max) => opt.clip_grad_value(max),
            Clip::Norm(max) => opt.clip_grad_norm(max),
        }
        opt.step();
        Ok(value)
    }
}

macro_rules! steps {
    ($($(#[$doc:meta])* $name:ident $f_name:ident $with:ident ($($max:ident)?) $clip:expr;)*) => {$(
        $(#[$doc])*
        ///
        /// # Panics
        /// When a lazy loss cannot be planned or run (use the `f_` form for the error), as
        /// tch's methods panic on a failing backward.
        #[track_caller]
        pub fn $name<L: Loss + ?Sized>(&mut self, loss: &L $(, $max: f64)?) -> L::Value {
            loss.step(&mut self.0, ClipSetting($clip), None).or_panic()
        }

        $(#[$doc])*
        ///
        /// # Errors
        /// The lazy loss's planning or running error; the parameters are then not stepped.
        pub fn $f_name<L: Loss + ?Sized>(&mut self, loss: &L $(, $max: f64)?) -> Result<L::Value, LazyError> {
            loss.step(&mut self.0, ClipSetting($clip), None)
        }

        $(#[$doc])*
        /// With `options` for a lazy loss (a budget, a micro-batch, a `dist` group), as
        /// [`LazyTensor::backward_with`] takes them; a `Tensor` loss ignores them.
        ///
        /// # Errors
        /// The lazy loss's planning or running error; the parameters are then not stepped.
        pub fn $with<L: Loss + ?Sized>(&mut self, loss: &L $(, $max: f64)?, options: &Options) -> Result<L::Value, LazyError> {
            loss.step(&mut self.0, ClipSetting($clip), Some(options))
        }
    )*};
}

impl Optimizer {
    steps! {
        /// Gradients set to none, the backward pass, the step: tch's `backward_step`.
        backward_step f_backward_step f_backward_step_with () Clip::None;
        /// As [`backward_step`](Self::backward_step), each gradient clamped to ±`max` before
        /// the step: tch's `backward_step_clip`.
        backward_step_clip f_backward_step_clip f_backward_step_clip_with (max) Clip::Value(max);
        /// As [`backward_step`](Self::backward_step), the gradients' total norm clipped to
        /// `max` before the step: tch's `backward_step_clip_norm`.
        backward_step_clip_norm f_backward_step_clip_norm f_backward_step_clip_norm_with (max) Clip::Norm(max);
    }

    /// tch's optimizer.
    pub fn into_inner(self) -> nn::Optimizer {
        self.0
    }
}

impl Deref for Optimizer {
    type Target = nn::Optimizer;
    fn deref(&self) -> &nn::Optimizer {
        &self.0
    }
}

impl DerefMut for Optimizer {
    fn deref_mut(&mut self) -> &mut nn::Optimizer {
        &mut self.0
    }
}
