//! One model, written once over `TensorOps`, run eagerly on tensors and lazily in
//! micro-batches with the same `VarStore`: the same loss and the same gradients.

use tch::nn;
use tch::{Device, Kind, Tensor};
use toma::lazy::{lazy, Layer, LayerT, Options, TensorOps};

use crate::grad::{grads, relative_error, zero_grads};

const CPU: Device = Device::Cpu;

struct Net {
    conv: nn::Conv2D,
    norm: nn::LayerNorm,
    bn: nn::BatchNorm,
    fc: nn::Linear,
    head: nn::Linear,
}

impl Net {
    fn new(vs: &nn::VarStore) -> Net {
        let r = vs.root();
        Net {
            conv: nn::conv2d(&r / "conv", 3, 8, 3, nn::ConvConfig { padding: 1, ..Default::default() }),
            norm: nn::layer_norm(&r / "norm", vec![8 * 4 * 4], Default::default()),
            bn: nn::batch_norm2d(&r / "bn", 8, Default::default()),
            fc: nn::linear(&r / "fc", 8 * 4 * 4, 32, Default::default()),
            head: nn::linear(&r / "head", 16 + 16, 5, Default::default()),
        }
    }

    /// Written once: convolution, batch norm in eval mode, pooling, layer norm, a gated MLP
    /// with chunk, masks and several activations, then a classification loss.
    fn loss<T: TensorOps>(&self, x: &T, y: &T) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::LayerNorm: Layer<T>,
        nn::Linear: Layer<T>,
        nn::BatchNorm: LayerT<T>,
    {
        let h = x.apply(&self.conv).apply_t(&self.bn, false).silu().max_pool2d(&[2], &[2], &[0], &[1], false);
        let h = h.flatten(1, -1).apply(&self.norm).apply(&self.fc).gelu("tanh");
        let halves = h.chunk(2, 1);
        let gated = halves[0].mul(&halves[1].sigmoid()).leaky_relu();
        let wide = T::cat(&[&gated, &halves[1].hardswish()], 1);
        wide.apply(&self.head).log_softmax(-1, None).nll_loss(y)
    }
}

#[test]
fn a_model_written_once_runs_eagerly_and_lazily_alike() {
    tch::manual_seed(21);
    let mut vs = nn::VarStore::new(CPU);
    let net = Net::new(&vs);
    vs.double();
    let x = Tensor::randn([20, 3, 8, 8], (Kind::Double, CPU));
    let y = Tensor::randint(5, [20], (Kind::Int64, CPU));

    let eager = net.loss(&x, &y);
    let eager_value = eager.double_value(&[]);
    eager.backward();
    let eager_grads = grads(&vs);
    zero_grads(&vs);

    let (lx, ly) = lazy((&x, &y), 0);
    let value = net.loss(&lx, &ly).backward_with(&Options::new().micro_batch(6)).unwrap();
    assert!((value - eager_value).abs() <= 1e-10 * eager_value.abs(), "{value} vs {eager_value}");
    for (name, e) in eager_grads {
        let l = vs.variables()[&name].grad();
        let err = relative_error(&l, &e);
        assert!(err <= 1e-6, "{name}: gradients differ by {err:e} relative");
    }
}
