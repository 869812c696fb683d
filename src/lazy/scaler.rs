//! Loss scaling for `Half` training: tch has no `GradScaler`; this one works with toma's
//! [`Optimizer`] on either kind of loss, and with split steps.
//!
//! `Half`'s range ends at 65504 and its smallest normal value is about 6e-5: small gradients
//! flush to zero. The scaler multiplies the loss by a large power of two before the backward,
//! divides the gradients by it after (exactly: a power of two), and steps only when every
//! gradient is finite. A step with an infinity or a NaN is skipped and the scale halved; after
//! `growth_interval` finite steps in a row it doubles. In a split step each micro-batch's scaled
//! gradients are summed into `.grad`, so one micro-batch's overflow makes the sum infinite and
//! skips the whole step. `BFloat16` has `Float`'s range and needs no scaler.
//!
//! ```
//! use tch::{Device, Kind, Tensor};
//! use toma::lazy::{lazy, nn, nn::GradScaler, nn::OptimizerConfig, Options};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let model = nn::linear(vs.root(), 4, 3, Default::default());
//! let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
//! let mut scaler = GradScaler::new();
//! let x = Tensor::randn([32, 4], (Kind::Float, Device::Cpu));
//! let y = Tensor::randint(3, [32], (Kind::Int64, Device::Cpu));
//! let (lx, ly) = lazy((&x, &y), 0);
//! let loss = lx.apply(&model).cross_entropy_for_logits(&ly);
//! let step = scaler.backward_step_with(&mut opt, &loss, &Options::new().micro_batch(8))?;
//! assert!(step.stepped && step.value.is_finite());
//! assert_eq!(f64::try_from(&loss)?, step.value, "the loss reads unscaled");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use tch::{Kind, Tensor};

use super::error::LazyError;
use super::optim::{Loss, Optimizer};
use super::options::Options;
use crate::ConfigError;

/// Loss scaling for mixed-precision training in `Half` (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct GradScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
    /// Finite steps in a row since the scale last changed.
    good: u32,
}

/// What one scaled step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaledStep<V> {
    /// The loss's value, unscaled (`()` for a `Tensor` loss, as tch's steps return).
    pub value: V,
    /// Whether the optimizer stepped: false when a gradient was infinite or NaN.
    pub stepped: bool,
    /// The scale the step used.
    pub scale: f64,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new()
    }
}

impl GradScaler {
    /// PyTorch's defaults: a scale of 2¹⁶, doubled after 2000 finite steps, halved on an
    /// overflow.
    pub fn new() -> GradScaler {
        GradScaler { scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, good: 0 }
    }

    /// Starts from `scale` instead of 2¹⁶.
    ///
    /// # Errors
    /// [`ConfigError::OutOfRange`] for a scale that is not finite and positive.
    pub fn with_scale(self, scale: f64) -> Result<GradScaler, ConfigError> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(ConfigError::OutOfRange { what: "loss scale", range: "(0, inf)", value: scale });
        }
        Ok(GradScaler { scale, ..self })
    }

    /// Multiplies the scale by `factor` (> 1) after `interval` (≥ 1) finite steps in a row.
    ///
    /// # Errors
    /// [`ConfigError::OutOfRange`] for a factor not above 1 or an interval of 0.
    pub fn growth(self, factor: f64, interval: u32) -> Result<GradScaler, ConfigError> {
        if !(factor.is_finite() && factor > 1.0) {
            return Err(ConfigError::OutOfRange { what: "growth factor", range: "(1, inf)", value: factor });
        }
        if interval == 0 {
            return Err(ConfigError::OutOfRange { what: "growth interval", range: "[1, inf)", value: 0.0 });
        }
        Ok(GradScaler { growth_factor: factor, growth_interval: interval, ..self })
    }

    /// The scale the next step uses.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Gradients set to none, the backward pass of the loss times the scale, the gradients
    /// unscaled, and the optimizer's step unless one of them is infinite or NaN; then the
    /// scale is adjusted.
    ///
    /// # Errors
    /// As [`Optimizer::f_backward_step`]: the lazy loss's planning or running error (nothing
    /// is stepped and the scale is kept).
    pub fn backward_step<L: Loss + ?Sized>(
        &mut self,
        opt: &mut Optimizer,
        loss: &L,
    ) -> Result<ScaledStep<L::Value>, LazyError> {
        self.step(opt, loss, None)
    }

    /// [`backward_step`](Self::backward_step) with `options` for a lazy loss (a budget, a
    /// micro-batch, ..); a `Tensor` loss ignores them.
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step).
    pub fn backward_step_with<L: Loss + ?Sized>(
        &mut self,
        opt: &mut Optimizer,
        loss: &L,
        options: &Options,
    ) -> Result<ScaledStep<L::Value>, LazyError> {
        self.step(opt, loss, Some(options))
    }

    fn step<L: Loss + ?Sized>(
        &mut self,
        opt: &mut Optimizer,
        loss: &L,
        options: Option<&Options>,
    ) -> Result<ScaledStep<L::Value>, LazyError> {
        let scale = self.scale;
        let value = loss.backward_scaled(opt, scale, options)?;
        let finite = unscale(opt.parameters(), scale).map_err(|source| LazyError::Torch {
            node: None,
            op: "unscale gradients".into(),
            source,
        })?;
        if finite {
            opt.step_after_backward();
            self.good += 1;
            if self.good >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.good = 0;
            }
        } else {
            tracing::info!(
                scale,
                "toma::lazy: a gradient is infinite or NaN; the step is skipped and the scale lowered"
            );
            self.scale *= self.backoff_factor;
            self.good = 0;
        }
        Ok(ScaledStep { value, stepped: finite, scale })
    }
}

/// Divides every gradient by `scale` in place; whether all are finite (one read of a flag
/// summed on the device, not one per tensor). A gradient holds an infinity or a NaN exactly
/// when its minimum or maximum does (both propagate NaN): two numbers a gradient, where
/// `isfinite` makes a mask and, of a float, an absolute value of its size (a Half MLP's
/// scaled step peaked 13% above its backward there, outside its plan).
fn unscale(params: &[Tensor], scale: f64) -> Result<bool, tch::TchError> {
    let _no_grad = tch::no_grad_guard();
    let mut bad: Option<Tensor> = None;
    for p in params {
        let mut g = p.grad();
        if !g.defined() || g.numel() == 0 {
            continue;
        }
        let _ = g.f_mul_scalar_(1.0 / scale)?;
        let (lo, hi) = g.f_aminmax(None, false)?;
        let ends = Tensor::f_stack(&[lo, hi], 0)?;
        let here = ends.f_isfinite()?.f_logical_not()?.f_any()?.f_to_kind(Kind::Int64)?;
        bad = Some(match bad {
            None => here,
            Some(b) => b.f_add(&here)?,
        });
    }
    Ok(bad.map_or(Ok(0), |b| b.f_int64_value(&[]))? == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// A NaN or an infinity of either sign anywhere in any gradient is found; finite ones pass,
    /// unscaled in place; an empty gradient is skipped.
    #[test]
    fn unscale_finds_every_non_finite_value() {
        let grads_of = |values: &[f32]| {
            let p = Tensor::zeros([values.len() as i64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            (&p * Tensor::from_slice(values)).sum(None).backward();
            p
        };
        let empty = Tensor::zeros([0], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        empty.sum(None).backward();
        let finite = grads_of(&[2.0, -4.0, 6.0]);
        assert!(unscale(&[finite.shallow_clone(), empty], 2.0).unwrap());
        assert_eq!(Vec::<f32>::try_from(finite.grad()).unwrap(), [1.0, -2.0, 3.0]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let params = [grads_of(&[1.0, 2.0]), grads_of(&[1.0, bad, 3.0])];
            assert!(!unscale(&params, 2.0).unwrap(), "{bad} not found");
        }
    }
}
