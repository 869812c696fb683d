//! tch's optimizer step for lazy losses: `opt.backward_step(&loss)` with `loss` a
//! [`LazyTensor`] plans the step, runs it (in micro-batches when the batch does not fit) and
//! steps, as tch's `backward_step` does for a `Tensor`.
//!
//! tch's `Optimizer::backward_step` takes a `&Tensor` and, being inherent, cannot be extended.
//! [`OptimizerConfig`] (imported with `use toma::lazy::nn;` in place of `use tch::nn;`) builds
//! the same tch optimizer, wrapped in an [`Optimizer`] whose step methods take either kind of
//! loss; everything else is tch's (`set_lr`, `zero_grad`, `clip_grad_norm`, .. through `Deref`).
//!
//! The budget covers the whole step: the backward, in micro-batches or recomputing as the plan
//! says, and the optimizer's step after it, which holds every gradient, the state a first step
//! creates and its temporaries ([`Optimizer::plan_step`]). A step that cannot fit is refused
//! before anything runs. After the step the loss keeps the value it computed: reading it runs
//! nothing.
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
    /// toma keeps which optimizer it is and its parameters, so that a lazy step's plan counts
    /// the optimizer's step ([`Optimizer::plan_step`]).
    ///
    /// # Errors
    /// tch's, when the optimizer cannot be made.
    fn build(self, vs: &nn::VarStore, lr: f64) -> Result<Optimizer, TchError>
    where
        Self: Sized + 'static,
    {
        let rule = StepRule::of(&self);
        let params = vs.trainable_variables();
        nn::OptimizerConfig::build(self, vs, lr).map(|opt| Optimizer { opt, rule, params, stepped: false })
    }
}

impl<C: nn::OptimizerConfig> OptimizerConfig for C {}

/// What one of libtorch's optimizers takes in its step, per parameter, in multiples of the
/// parameter: the state its first step creates (kept from then on) and the temporaries each
/// step makes (one parameter at a time). Read from libtorch 2.11's C++ optimizers, which tch
/// runs, against the CPU allocator (`tests/lazy_peak.rs::whole_steps_peak_as_planned`):
/// - SGD: a momentum buffer with momentum; a temporary with weight decay, one more with
///   Nesterov;
/// - Adam: the two moments (and the maximum with AMSGrad); the root of the second moment and
///   its quotient, and a decayed gradient with weight decay;
/// - AdamW: the same, its weight decay in place;
/// - RMSprop: the mean square (a momentum buffer with momentum, the mean with `centered`);
///   the root, and a decayed gradient with weight decay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StepRule {
    name: &'static str,
    state: u64,
    temporaries: u64,
}

impl StepRule {
    fn of(config: &dyn std::any::Any) -> Option<StepRule> {
        let some = |b: bool| u64::from(b);
        if let Some(c) = config.downcast_ref::<nn::Sgd>() {
            let momentum = c.momentum != 0.0;
            let temporaries = some(c.wd != 0.0) + some(momentum && c.nesterov);
            return Some(StepRule { name: "SGD", state: some(momentum), temporaries });
        }
        if let Some(c) = config.downcast_ref::<nn::Adam>() {
            return Some(StepRule { name: "Adam", state: 2 + some(c.amsgrad), temporaries: 2 + some(c.wd != 0.0) });
        }
        if let Some(c) = config.downcast_ref::<nn::AdamW>() {
            return Some(StepRule { name: "AdamW", state: 2 + some(c.amsgrad), temporaries: 2 });
        }
        if let Some(c) = config.downcast_ref::<nn::RmsProp>() {
            let state = 1 + some(c.momentum != 0.0) + some(c.centered);
            return Some(StepRule { name: "RMSprop", state, temporaries: 1 + some(c.wd != 0.0) });
        }
        None
    }
}

/// tch's `nn::Optimizer` whose step methods take a `Tensor` or a [`LazyTensor`] loss (see the
/// [module docs](self)). Derefs to tch's optimizer for everything else.
///
/// A lazy step is planned whole: the backward, then the optimizer's step, which holds every
/// gradient, the state a first step creates and its temporaries at once. A step that cannot fit
/// the budget is refused before anything runs ([`LazyError::DoesNotFit`], naming the step).
/// Parameters added to the `VarStore` after `build`, and optimizers other than tch's four, are
/// stepped as ever but not planned.
#[derive(Debug)]
pub struct Optimizer {
    opt: nn::Optimizer,
    rule: Option<StepRule>,
    /// The trainable variables at `build`, in the optimizer's order.
    params: Vec<Tensor>,
    /// Whether a lazy step has run (its state exists).
    stepped: bool,
}

impl Optimizer {
    /// The plan of `opt.backward_step(&loss)` with `options`: the backward in micro-batches or
    /// recomputing as it would run, and the optimizer's step after it
    /// ([`Plan::optimizer_peak_bytes`](crate::lazy::Plan::optimizer_peak_bytes)). Sets the
    /// gradients to none first, as the step does, so that the plan counts their creation.
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, nn, nn::OptimizerConfig, Mode, Options};
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let model = nn::linear(vs.root(), 256, 256, Default::default());
    /// let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    /// let x = Tensor::randn([8, 256], (Kind::Float, Device::Cpu));
    /// let loss = lazy(&x, 0).apply(&model).square().mean(None);
    /// let plan = opt.plan_step(&loss, &Options::new())?;
    /// // Adam's first step: two moments per parameter beside the gradients.
    /// assert!(plan.optimizer_peak_bytes() > 3 * 256 * 256 * 4);
    /// assert!(plan.to_string().contains("Adam's step"));
    /// let too_small = Options::new().budget(plan.optimizer_peak_bytes() - 1);
    /// assert!(opt.f_backward_step_with(&loss, &too_small).is_err(), "refused before running");
    /// assert!(!model.ws.grad().defined(), "nothing ran");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`LazyTensor::plan`]; [`LazyError::DoesNotFit`] when the step cannot fit.
    pub fn plan_step(&mut self, loss: &LazyTensor, options: &Options) -> Result<crate::lazy::Plan, LazyError> {
        self.opt.zero_grad();
        loss.plan(crate::lazy::Mode::Backward, &self.with_step(options))
    }

    /// `options` with this optimizer's step in them.
    fn with_step(&self, options: &Options) -> Options {
        let mut options = options.clone();
        options.step = self.rule.map(|rule| crate::lazy::options::OptimizerStep {
            name: rule.name,
            params: self
                .params
                .iter()
                .map(|p| (p.data_ptr() as usize, (p.numel() * p.kind().elt_size_in_bytes()) as u64))
                .collect(),
            state: rule.state,
            temporaries: rule.temporaries,
            first: !self.stepped,
        });
        options
    }
}

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
    fn step(&self, opt: &mut Optimizer, clip: ClipSetting, options: Option<&Options>)
        -> Result<Self::Value, LazyError>;

    /// Gradients set to none, then the backward pass of the loss times `scale` (a
    /// [`GradScaler`](crate::lazy::nn::GradScaler)'s); no step. A lazy loss's value is the
    /// unscaled one.
    #[doc(hidden)]
    fn backward_scaled(
        &self,
        opt: &mut Optimizer,
        scale: f64,
        options: Option<&Options>,
    ) -> Result<Self::Value, LazyError>;
}

#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct ClipSetting(Clip);

impl Loss for Tensor {
    type Value = ();

    fn backward_scaled(&self, opt: &mut Optimizer, scale: f64, _: Option<&Options>) -> Result<(), LazyError> {
        opt.opt.zero_grad();
        let scaled =
            self.f_mul_scalar(scale).map_err(|source| LazyError::Torch { node: None, op: "mul".into(), source })?;
        scaled.f_backward().map_err(|source| LazyError::Torch { node: None, op: "backward".into(), source })
    }

    fn step(&self, opt: &mut Optimizer, clip: ClipSetting, _: Option<&Options>) -> Result<(), LazyError> {
        match clip.0 {
            Clip::None => opt.opt.backward_step(self),
            Clip::Value(max) => opt.opt.backward_step_clip(self, max),
            Clip::Norm(max) => opt.opt.backward_step_clip_norm(self, max),
        }
        // Its state exists now: a lazy step after it creates none.
        opt.stepped = true;
        Ok(())
    }
}

impl Loss for LazyTensor {
    type Value = f64;

    fn backward_scaled(&self, opt: &mut Optimizer, scale: f64, options: Option<&Options>) -> Result<f64, LazyError> {
        opt.opt.zero_grad();
        let options = opt.with_step(options.unwrap_or(&Options::default()));
        let scaled = self.f_mul_scalar(scale)?;
        let value = scaled.backward_with(&options)? / scale;
        // Read afterwards, the loss is the step's (unscaled) value.
        self.node().stepped.set(Some(value));
        Ok(value)
    }

    fn step(&self, opt: &mut Optimizer, clip: ClipSetting, options: Option<&Options>) -> Result<f64, LazyError> {
        // As tch's step: gradients set to none first, so the plan counts their creation.
        opt.opt.zero_grad();
        let options = opt.with_step(options.unwrap_or(&Options::default()));
        let value = self.backward_with(&options)?;
        match clip.0 {
            Clip::None => {}
            Clip::Value(max) => opt.opt.clip_grad_value(max),
            Clip::Norm(max) => opt.opt.clip_grad_norm(max),
        }
        opt.opt.step();
        opt.stepped = true;
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
            loss.step(self, ClipSetting($clip), None).or_panic()
        }

        $(#[$doc])*
        ///
        /// # Errors
        /// The lazy loss's planning or running error; the parameters are then not stepped.
        pub fn $f_name<L: Loss + ?Sized>(&mut self, loss: &L $(, $max: f64)?) -> Result<L::Value, LazyError> {
            loss.step(self, ClipSetting($clip), None)
        }

        $(#[$doc])*
        /// With `options` for a lazy loss (a budget, a micro-batch, a `dist` group), as
        /// [`LazyTensor::backward_with`] takes them; a `Tensor` loss ignores them.
        ///
        /// # Errors
        /// The lazy loss's planning or running error; the parameters are then not stepped.
        pub fn $with<L: Loss + ?Sized>(&mut self, loss: &L $(, $max: f64)?, options: &Options) -> Result<L::Value, LazyError> {
            loss.step(self, ClipSetting($clip), Some(options))
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

    /// The parameters at `build` (their gradients are what a step reads), for the scaler.
    pub(crate) fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    /// tch's step, as after a backward; the optimizer's state exists then.
    pub(crate) fn step_after_backward(&mut self) {
        self.opt.step();
        self.stepped = true;
    }

    /// tch's optimizer.
    pub fn into_inner(self) -> nn::Optimizer {
        self.opt
    }
}

impl Deref for Optimizer {
    type Target = nn::Optimizer;
    fn deref(&self) -> &nn::Optimizer {
        &self.opt
    }
}

impl DerefMut for Optimizer {
    fn deref_mut(&mut self) -> &mut nn::Optimizer {
        &mut self.opt
    }
}
