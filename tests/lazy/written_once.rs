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
        let h = x.apply(&self.conv).apply_t(&self.bn, false).silu().max_pool2d([2], [2], [0], [1], false);
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

/// A gate with no eager code of its own: a `Sequential` applying it to a tensor records it and
/// runs the record.
struct Gate;

impl toma::lazy::nn::LazyModule for Gate {
    fn lazy_forward(&self, xs: &toma::lazy::LazyTensor) -> Result<toma::lazy::LazyTensor, toma::lazy::LazyError> {
        xs.f_mul(&xs.f_sigmoid()?)
    }
}

/// Builds the same MLP twice under the same names: with tch's `nn::seq` and with toma's.
fn mlps(seed: i64) -> (nn::VarStore, nn::Sequential, nn::VarStore, toma::lazy::nn::Sequential) {
    tch::manual_seed(seed);
    let mut tch_vs = nn::VarStore::new(CPU);
    let r = tch_vs.root();
    let reference = nn::seq()
        .add(nn::linear(&r / "l1", 6, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "l2", 16, 16, Default::default()))
        .add_fn(|x| x * x.sigmoid())
        .add(nn::seq().add(nn::linear(&r / "l3", 16, 5, Default::default())).add_fn(|x| x.tanh() * 2.0));
    tch_vs.double();
    let mut vs = nn::VarStore::new(CPU);
    let r = vs.root();
    let mlp = toma::lazy::nn::seq()
        .add(nn::linear(&r / "l1", 6, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&r / "l2", 16, 16, Default::default()))
        .add(Gate)
        .add(toma::lazy::nn::seq().add(nn::linear(&r / "l3", 16, 5, Default::default())).add_fn(|x| x.tanh() * 2.0));
    vs.double();
    vs.copy(&tch_vs).unwrap();
    (tch_vs, reference, vs, mlp)
}

/// tch's `nn::seq()` MLP built with `toma::lazy::nn::seq()` instead: on a `Tensor` it gives
/// tch's own values and gradients (layers by tch's code, functions and a lazy-only layer
/// recorded and run at once, autograd intact); on lazy tensors, in micro-batches, the same.
#[test]
fn a_sequence_runs_eagerly_as_tchs_does_and_lazily_alike() {
    let (tch_vs, reference, vs, mlp) = mlps(8);
    let x = Tensor::randn([23, 6], (Kind::Double, CPU));
    let y = Tensor::randint(5, [23], (Kind::Int64, CPU));

    let expected = x.apply(&reference);
    // tch's `cross_entropy_for_logits` works in f32 whatever the logits; this test stays in f64.
    let expected_loss = expected.log_softmax(-1, None).nll_loss(&y);
    expected_loss.backward();
    let expected_grads = grads(&tch_vs);

    let out = x.apply(&mlp);
    assert!(out.allclose(&expected, 1e-12, 1e-12, false), "eager output differs from tch's");
    assert!(mlp.forward(&x).allclose(&expected, 1e-12, 1e-12, false));
    let loss = out.log_softmax(-1, None).nll_loss(&y);
    loss.backward();
    for (name, e) in &expected_grads {
        let err = relative_error(&vs.variables()[name].grad(), e);
        assert!(err <= 1e-12, "eager {name}: gradients differ by {err:e} relative");
    }
    zero_grads(&vs);

    let (lx, ly) = lazy((&x, &y), 0);
    let value =
        lx.apply(&mlp).log_softmax(-1, None).nll_loss(&ly).backward_with(&Options::new().micro_batch(7)).unwrap();
    let expected_value = expected_loss.double_value(&[]);
    assert!((value - expected_value).abs() <= 1e-10 * expected_value.abs(), "{value} vs {expected_value}");
    for (name, e) in &expected_grads {
        let err = relative_error(&vs.variables()[name].grad(), e);
        assert!(err <= 1e-6, "lazy {name}: gradients differ by {err:e} relative");
    }
    assert_eq!(mlp.forward(&lx).size(), [23, 5]);
}

/// `seq_t()`: batch norm and dropout follow the training flag eagerly as tch's `seq_t()` does,
/// and a recording error on a tensor panics with the op named, as tch's layers panic.
#[test]
fn a_training_sequence_follows_the_flag_eagerly() {
    tch::manual_seed(3);
    let tch_vs = nn::VarStore::new(CPU);
    let reference = nn::seq_t()
        .add(nn::linear(tch_vs.root() / "fc", 4, 8, Default::default()))
        .add(nn::batch_norm1d(tch_vs.root() / "bn", 8, Default::default()))
        .add_fn_t(|x, train| x.dropout(0.0, train));
    let vs = nn::VarStore::new(CPU);
    let net = toma::lazy::nn::seq_t()
        .add(nn::linear(vs.root() / "fc", 4, 8, Default::default()))
        .add(nn::batch_norm1d(vs.root() / "bn", 8, Default::default()))
        .add_fn_t(|x, train| x.dropout(0.0, train));
    let mut vs = vs;
    vs.copy(&tch_vs).unwrap();
    let x = Tensor::randn([16, 4], (Kind::Float, CPU));
    for train in [true, false, true] {
        let (a, b) = (x.apply_t(&net, train), x.apply_t(&reference, train));
        assert!(a.allclose(&b, 1e-6, 1e-6, false), "train = {train}");
    }
    // Running statistics moved alike in both.
    let (stats, expected) = (vs.variables(), tch_vs.variables());
    assert!(stats["bn.running_mean"].allclose(&expected["bn.running_mean"], 1e-6, 1e-6, false));
    assert_eq!(net.forward_t(&lazy(&x, 0), true).size(), [16, 8]);

    let bad = toma::lazy::nn::seq().add_fn(|x| x.view([7, -1]));
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bad.forward(&x))).unwrap_err();
    let text = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(text.contains("view"), "{text}");
    let _ = net.forward_t(&x, false);
}

/// Written once with tch's own argument forms: tuple shapes, a bare `i64` for dims, `None` for
/// all dims, `i(..)`, `size3`, arrays by value and by reference.
fn tch_forms<T: TensorOps>(x: &T, table: &Tensor, mean: &Tensor, var: &Tensor) -> T {
    let (b, t, c) = x.size3().unwrap();
    let h = x.view((b * t, c)).view([b, t, c]).permute([0, 2, 1]).permute([0, 2, 1]);
    let q = h.i((.., 1.., ..)).narrow(1, 0, t - 1);
    let k = h.i((.., ..t - 1));
    let att = T::scaled_dot_product_attention(&q, &k, &k, None, 0.0, true, None, false);
    let tokens = T::constant(&Tensor::arange(t - 1, (Kind::Int64, Device::Cpu)).remainder(table.size()[0]));
    let pos = T::embedding(table, &tokens, -1, false, false);
    let h = att.add(&pos).batch_norm(None, None, Some(mean), Some(var), false, 0.1, 1e-5, true);
    let mask = h.gt(0.0);
    let h = h.where_self(&mask, &h.mul_scalar(0.1)).expand([b, t - 1, c], false);
    let parts = h.split(2, -1);
    let first = parts[0].sum_dim_intlist(-1, true, Kind::Double);
    let all = h.sum_dim_intlist(None::<i64>, true, None);
    assert_eq!(all.size(), [1, 1, 1]);
    let flat = h.flat_view().add(&first.flat_view().repeat([1, c]));
    flat.mean_dim([-1], false, None).add(&all.view(1).squeeze()).sum(Kind::Double)
}

#[test]
fn tch_argument_forms_compile_and_agree_eagerly_and_lazily() {
    tch::manual_seed(11);
    let x = Tensor::randn([6, 5, 4], (Kind::Double, CPU));
    let table = Tensor::randn([3, 4], (Kind::Double, CPU));
    let (mean, var) = (Tensor::randn([4], (Kind::Double, CPU)), Tensor::rand([4], (Kind::Double, CPU)) + 0.5);
    let eager = tch_forms(&x, &table, &mean, &var).double_value(&[]);
    let lazy_value = tch_forms(&lazy(&x, 0), &table, &mean, &var).to_tensor().unwrap().double_value(&[]);
    assert!((eager - lazy_value).abs() <= 1e-10 * eager.abs().max(1.0), "{eager} vs {lazy_value}");
    let micro =
        tch_forms(&lazy(&x, 0), &table, &mean, &var).to_tensor_with(&Options::new().micro_batch(4)).unwrap_err();
    // The whole-tensor mean of `all` mixes samples; splitting it is refused, not wrong.
    assert!(matches!(micro, toma::lazy::LazyError::MixesBatch { .. }), "{micro}");
}
