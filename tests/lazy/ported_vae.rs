//! A variational autoencoder written in the idioms of tch-rs's `vae` example (our own code): the
//! model's inherent methods over `&Tensor` returning tuples, noise from `randn_like`, a
//! reconstruction loss by `binary_cross_entropy::<Tensor>(.., None, ..)` plus a KL term with
//! operators on both sides, `backward_step`, the loss read with `f64::try_from` after the step,
//! and a sampling path that decodes a `Tensor`. Ported as `docs/porting.md` (section 6) says:
//! the `use` lines switch `tch::nn` to `toma::lazy::nn`, `#[toma::lazy::module]` goes on the
//! `impl` block and on the loss function, and the batch is wrapped with `lazy(..)`. Its split
//! step has the eager step's loss and gradients (f64, from one seed: the noise is drawn when
//! recorded). CI's clippy builds it with `-D warnings`: the port leaves no unused import.

use tch::{Device, Kind, Reduction, Tensor};
use toma::lazy::nn::{self, Module, OptimizerConfig};

const PIXELS: i64 = 196;
const LATENT: i64 = 6;

struct Autoencoder {
    hidden: nn::Linear,
    mean: nn::Linear,
    log_variance: nn::Linear,
    expand: nn::Linear,
    pixels: nn::Linear,
}

#[toma::lazy::module]
impl Autoencoder {
    fn new(p: &nn::Path) -> Self {
        let c = Default::default;
        Autoencoder {
            hidden: nn::linear(p / "hidden", PIXELS, 48, c()),
            mean: nn::linear(p / "mean", 48, LATENT, c()),
            log_variance: nn::linear(p / "log_variance", 48, LATENT, c()),
            expand: nn::linear(p / "expand", LATENT, 48, c()),
            pixels: nn::linear(p / "pixels", 48, PIXELS, c()),
        }
    }

    /// The posterior's mean and log-variance.
    fn encode(&self, images: &Tensor) -> (Tensor, Tensor) {
        let h = images.apply(&self.hidden).tanh();
        (self.mean.forward(&h), self.log_variance.forward(&h))
    }

    fn decode(&self, codes: &Tensor) -> Tensor {
        codes.apply(&self.expand).tanh().apply(&self.pixels).sigmoid()
    }

    /// Reconstruction, mean and log-variance, through a sample of the posterior.
    fn forward(&self, images: &Tensor) -> (Tensor, Tensor, Tensor) {
        let (mean, log_variance) = self.encode(&images.view([-1, PIXELS]));
        let sigma = (&log_variance * 0.5).exp();
        let code = &mean + sigma.randn_like() * &sigma;
        (self.decode(&code), mean, log_variance)
    }
}

/// Summed binary cross-entropy of the reconstruction, plus the posterior's KL divergence from
/// the unit normal.
#[toma::lazy::module]
fn elbo_loss(reconstruction: &Tensor, images: &Tensor, mean: &Tensor, log_variance: &Tensor) -> Tensor {
    let fit = reconstruction.binary_cross_entropy::<Tensor>(&images.view([-1, PIXELS]), None, Reduction::Sum);
    let divergence = (mean.pow_tensor_scalar(2) + log_variance.exp() - 1i64 - log_variance).sum(Kind::Double) * 0.5;
    fit + divergence
}

#[test]
fn a_vae_in_tch_rs_idioms_ports_with_two_attributes_and_trains_in_micro_batches() {
    if std::env::var_os("TOMA_VAE_CHILD").is_none() {
        // Alone in a child: other tests' draws would fall between the seed and the noise.
        let out = crate::support::child::run(
            "ported_vae::a_vae_in_tch_rs_idioms_ports_with_two_attributes_and_trains_in_micro_batches",
            "TOMA_VAE_CHILD",
            "1",
        );
        out.assert_finished("vae ");
        return;
    }
    let device = Device::Cpu;
    let mut vs = nn::VarStore::new(device);
    let model = Autoencoder::new(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    vs.double();
    let images = Tensor::rand([24, PIXELS], (Kind::Double, device));
    // The eager step, then the same step lazily in micro-batches of 8 from the same weights.
    let mut eager_vs = nn::VarStore::new(device);
    let eager_model = Autoencoder::new(&eager_vs.root());
    eager_vs.double();
    eager_vs.copy(&vs).unwrap();
    tch::manual_seed(7);
    let (reconstruction, mean, log_variance) = eager_model.forward(&images);
    let eager_loss = elbo_loss(&reconstruction, &images, &mean, &log_variance);
    eager_loss.backward();
    let eager_grads: Vec<Tensor> = eager_vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();

    tch::manual_seed(7);
    let images = toma::lazy::lazy(&images, 0);
    let (reconstruction, mean, log_variance) = model.forward(&images);
    let loss = elbo_loss(&reconstruction, &images, &mean, &log_variance);
    opt.f_backward_step_with(&loss, &toma::lazy::Options::new().micro_batch(8)).unwrap();
    let printed = f64::try_from(&loss).unwrap();
    let eager_value = eager_loss.double_value(&[]);
    assert!((printed - eager_value).abs() <= 1e-9 * eager_value.abs(), "{printed} vs {eager_value}");
    let lazy_grads: Vec<Tensor> = vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();
    let scale = eager_grads.iter().map(|g| g.abs().max().double_value(&[])).fold(1e-12, f64::max);
    for (e, l) in eager_grads.iter().zip(&lazy_grads) {
        let off = (e - l).abs().max().double_value(&[]) / scale;
        assert!(off < 1e-9, "gradients differ by {off:e}");
    }
    // Sampling, eagerly: the same method on a Tensor.
    let codes = tch::no_grad(|| Tensor::randn([5, LATENT], (Kind::Double, device)));
    assert_eq!(model.decode(&codes).size(), [5, PIXELS]);
    println!("\nvae loss={printed}");
}
