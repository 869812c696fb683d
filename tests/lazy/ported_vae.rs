//! tch-rs's VAE example (`examples/vae`), ported as `docs/porting.md` says: the `use` lines
//! switch `tch::nn` to `toma::lazy::nn`, `#[toma::lazy::module]` goes on the `impl VAE` block
//! and on `fn loss`, and the batch is wrapped with `lazy(..)`. Everything else is tch-rs's code:
//! the inherent `encode`/`decode`/`forward` over `&Tensor`, `std.randn_like()`,
//! `binary_cross_entropy::<Tensor>`, `backward_step`, the loss read after the step, and the
//! sampling path that calls `decode` on a `Tensor`. Its split step has the eager step's loss and
//! gradients (f64, from the same seed: the noise is drawn when recorded). Compiled under
//! `-D warnings` by CI's clippy: the port leaves no unused import.

use tch::{Device, Kind, Reduction, Tensor};
use toma::lazy::nn::{self, Module, OptimizerConfig};

struct Vae {
    fc1: nn::Linear,
    fc21: nn::Linear,
    fc22: nn::Linear,
    fc3: nn::Linear,
    fc4: nn::Linear,
}

#[toma::lazy::module]
impl Vae {
    fn new(vs: &nn::Path) -> Self {
        Vae {
            fc1: nn::linear(vs / "fc1", 784, 400, Default::default()),
            fc21: nn::linear(vs / "fc21", 400, 20, Default::default()),
            fc22: nn::linear(vs / "fc22", 400, 20, Default::default()),
            fc3: nn::linear(vs / "fc3", 20, 400, Default::default()),
            fc4: nn::linear(vs / "fc4", 400, 784, Default::default()),
        }
    }

    fn encode(&self, xs: &Tensor) -> (Tensor, Tensor) {
        let h1 = xs.apply(&self.fc1).relu();
        (self.fc21.forward(&h1), self.fc22.forward(&h1))
    }

    fn decode(&self, zs: &Tensor) -> Tensor {
        zs.apply(&self.fc3).relu().apply(&self.fc4).sigmoid()
    }

    fn forward(&self, xs: &Tensor) -> (Tensor, Tensor, Tensor) {
        let (mu, logvar) = self.encode(&xs.view([-1, 784]));
        let std = (&logvar * 0.5).exp();
        let eps = std.randn_like();
        (self.decode(&(&mu + eps * std)), mu, logvar)
    }
}

// Reconstruction + KL divergence losses summed over all elements and batch dimension.
#[toma::lazy::module]
fn loss(recon_x: &Tensor, x: &Tensor, mu: &Tensor, logvar: &Tensor) -> Tensor {
    let bce = recon_x.binary_cross_entropy::<Tensor>(&x.view([-1, 784]), None, Reduction::Sum);
    // See Appendix B from VAE paper:
    //     Kingma and Welling. Auto-Encoding Variational Bayes. ICLR, 2014
    // https://arxiv.org/abs/1312.6114
    // 0.5 * sum(1 + log(sigma^2) - mu^2 - sigma^2)
    let kld = -0.5 * (1i64 + logvar - mu.pow_tensor_scalar(2) - logvar.exp()).sum(tch::Kind::Float);
    bce + kld
}

#[test]
fn tch_rs_vae_ports_with_two_attributes_and_trains_in_micro_batches() {
    if std::env::var_os("TOMA_VAE_CHILD").is_none() {
        // Alone in a child: other tests' draws would fall between the seed and the noise.
        let out = crate::support::child::run(
            "ported_vae::tch_rs_vae_ports_with_two_attributes_and_trains_in_micro_batches",
            "TOMA_VAE_CHILD",
            "1",
        );
        out.assert_finished("vae ");
        return;
    }
    let device = Device::Cpu;
    let mut vs = nn::VarStore::new(device);
    let vae = Vae::new(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
    vs.double();
    let bimages = Tensor::rand([32, 784], (Kind::Double, device));
    // The eager step, then the same step lazily in micro-batches of 8 from the same weights.
    let mut eager_vs = nn::VarStore::new(device);
    let eager_vae = Vae::new(&eager_vs.root());
    eager_vs.double();
    eager_vs.copy(&vs).unwrap();
    tch::manual_seed(7);
    let (recon_batch, mu, logvar) = eager_vae.forward(&bimages);
    let eager_loss = loss(&recon_batch, &bimages, &mu, &logvar);
    eager_loss.backward();
    let eager_grads: Vec<Tensor> = eager_vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();

    tch::manual_seed(7);
    let bimages_lazy = toma::lazy::lazy(&bimages, 0);
    let (recon_batch, mu, logvar) = vae.forward(&bimages_lazy);
    let loss = loss(&recon_batch, &bimages_lazy, &mu, &logvar);
    opt.f_backward_step_with(&loss, &toma::lazy::Options::new().micro_batch(8)).unwrap();
    let train_loss = f64::try_from(&loss).unwrap();
    assert!((train_loss - eager_loss.double_value(&[])).abs() <= 1e-9 * train_loss.abs(), "{train_loss}");
    // The KL term is summed in Float (`sum(Kind::Float)`, as tch-rs writes it): gradients agree
    // to Float's precision, relative to the largest.
    let lazy_grads: Vec<Tensor> = vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();
    let scale = eager_grads.iter().map(|g| g.abs().max().double_value(&[])).fold(1e-12, f64::max);
    for (e, l) in eager_grads.iter().zip(&lazy_grads) {
        let off = (e - l).abs().max().double_value(&[]) / scale;
        assert!(off < 1e-6, "gradients differ by {off:e}");
    }
    // The sampling path, eagerly: decode on a Tensor.
    let sample = tch::no_grad(|| Tensor::randn([64, 20], (Kind::Double, device)));
    let images = vae.decode(&sample);
    assert_eq!(images.size(), [64, 784]);
    println!("\nvae loss={train_loss}");
}
