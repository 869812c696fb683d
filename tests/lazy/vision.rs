//! `toma::lazy::vision` against tch's own models on one `VarStore`: the same variable names
//! (tch's weights load), the same outputs eagerly and lazily, and, micro-batched, the same
//! gradients as one eager backward.

use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};
use toma::lazy::{lazy, vision, Options};

use crate::grad::{grads, relative_error, zero_grads};

const CPU: Device = Device::Cpu;

#[test]
fn resnets_match_tchs_own_on_one_var_store() {
    tch::manual_seed(31);
    for (name, depth) in [("resnet18", 18), ("resnet50", 50)] {
        let tch_vs = nn::VarStore::new(CPU);
        let theirs: Box<dyn ModuleT> = match depth {
            18 => Box::new(tch::vision::resnet::resnet18(&tch_vs.root(), 7)),
            _ => Box::new(tch::vision::resnet::resnet50(&tch_vs.root(), 7)),
        };
        let mut vs = nn::VarStore::new(CPU);
        let ours = match depth {
            18 => vision::resnet18(&vs.root(), 7),
            _ => vision::resnet50(&vs.root(), 7),
        };
        // The same names and shapes: tch's weights load.
        let names = |vs: &nn::VarStore| {
            let mut v: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
            v.sort();
            v
        };
        assert_eq!(names(&vs), names(&tch_vs), "{name}: variable names");
        vs.copy(&tch_vs).unwrap();
        let x = Tensor::randn([6, 3, 32, 32], (Kind::Float, CPU));
        let expected = theirs.forward_t(&x, false);
        let eager = ours.forward_t(&x, false);
        assert!(eager.allclose(&expected, 1e-5, 1e-5, false), "{name}: eager outputs");
        let planned = lazy(&x, 0).apply_t(&ours, false).to_tensor_with(&Options::new().micro_batch(4)).unwrap();
        assert!(planned.allclose(&expected, 1e-4, 1e-4, false), "{name}: lazy outputs");
    }
}

/// One eager backward of `net`'s NLL on `(x, y)` against one lazy backward in micro-batches
/// of `micro`: every gradient within 1e-6 relative (the var store in `Double`).
fn assert_micro_batched_gradients<M: ModuleT + toma::lazy::nn::LazyModuleT>(
    vs: &nn::VarStore,
    net: &M,
    x: &Tensor,
    y: &Tensor,
    micro: usize,
) {
    zero_grads(vs);
    net.forward_t(x, false).log_softmax(-1, None).nll_loss(y).backward();
    let eager = grads(vs);
    zero_grads(vs);
    let (lx, ly) = lazy((x, y), 0);
    lx.apply_t(net, false)
        .log_softmax(-1, None)
        .nll_loss(&ly)
        .backward_with(&Options::new().micro_batch(micro))
        .unwrap();
    let variables = vs.variables();
    for (name, e) in eager {
        let err = relative_error(&variables[&name].grad(), &e);
        assert!(err <= 1e-6, "{name}: gradients differ by {err:e} relative");
    }
}

#[test]
fn a_resnet18_step_micro_batched_has_the_full_batchs_gradients() {
    tch::manual_seed(32);
    let mut vs = nn::VarStore::new(CPU);
    let net = vision::resnet18(&vs.root(), 5);
    vs.double();
    let x = Tensor::randn([10, 3, 32, 32], (Kind::Double, CPU));
    let y = Tensor::randint(5, [10], (Kind::Int64, CPU));
    assert_micro_batched_gradients(&vs, &net, &x, &y, 3);
}

/// The same names and shapes as tch's model on another var store: tch's weights load.
fn same_variables(ours: &nn::VarStore, theirs: &nn::VarStore, name: &str) {
    let names = |vs: &nn::VarStore| {
        let mut v: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
        v.sort();
        v
    };
    assert_eq!(names(ours), names(theirs), "{name}: variable names");
}

#[test]
fn vgg16_and_alexnet_match_tchs_own_on_one_var_store() {
    tch::manual_seed(33);
    // VGG-16 (its classifier takes a 224×224 image's 7×7 map) and VGG-11 with batch norm.
    for (name, bn) in [("vgg16", false), ("vgg11_bn", true)] {
        let tch_vs = nn::VarStore::new(CPU);
        let theirs =
            if bn { tch::vision::vgg::vgg11_bn(&tch_vs.root(), 4) } else { tch::vision::vgg::vgg16(&tch_vs.root(), 4) };
        let mut vs = nn::VarStore::new(CPU);
        let ours = if bn { vision::vgg11_bn(&vs.root(), 4) } else { vision::vgg16(&vs.root(), 4) };
        same_variables(&vs, &tch_vs, name);
        vs.copy(&tch_vs).unwrap();
        let x = Tensor::randn([2, 3, 224, 224], (Kind::Float, CPU));
        let expected = theirs.forward_t(&x, false);
        assert!(ours.forward_t(&x, false).allclose(&expected, 1e-5, 1e-5, false), "{name}: eager outputs");
        let planned = lazy(&x, 0).apply_t(&ours, false).to_tensor_with(&Options::new().micro_batch(1)).unwrap();
        assert!(planned.allclose(&expected, 1e-4, 1e-4, false), "{name}: lazy outputs");
    }
    let tch_vs = nn::VarStore::new(CPU);
    let theirs = tch::vision::alexnet::alexnet(&tch_vs.root(), 4);
    let mut vs = nn::VarStore::new(CPU);
    let ours = vision::alexnet(&vs.root(), 4);
    same_variables(&vs, &tch_vs, "alexnet");
    vs.copy(&tch_vs).unwrap();
    let x = Tensor::randn([3, 3, 128, 128], (Kind::Float, CPU));
    let expected = theirs.forward_t(&x, false);
    assert!(ours.forward_t(&x, false).allclose(&expected, 1e-5, 1e-5, false), "alexnet: eager outputs");
    let planned = lazy(&x, 0).apply_t(&ours, false).to_tensor_with(&Options::new().micro_batch(2)).unwrap();
    assert!(planned.allclose(&expected, 1e-4, 1e-4, false), "alexnet: lazy outputs");
}

#[test]
fn an_alexnet_step_micro_batched_has_the_full_batchs_gradients() {
    tch::manual_seed(34);
    let mut vs = nn::VarStore::new(CPU);
    let net = vision::alexnet(&vs.root(), 3);
    vs.double();
    let x = Tensor::randn([5, 3, 128, 128], (Kind::Double, CPU));
    let y = Tensor::randint(3, [5], (Kind::Int64, CPU));
    assert_micro_batched_gradients(&vs, &net, &x, &y, 2);
}

/// `ours` against tch's `theirs` (built under `tch_vs` with the same seed's variables): the
/// same names, outputs equal eagerly and lazily in micro-batches of `micro`, and a
/// micro-batched step (eval-mode batch norm: per sample) with the full batch's gradients.
fn like_tchs_own<M: ModuleT + toma::lazy::nn::LazyModuleT>(
    name: &str,
    mut vs: nn::VarStore,
    ours: &M,
    tch_vs: &nn::VarStore,
    theirs: &impl ModuleT,
    x: &Tensor,
    micro: usize,
) {
    same_variables(&vs, tch_vs, name);
    vs.copy(tch_vs).unwrap();
    let expected = theirs.forward_t(x, false);
    assert!(ours.forward_t(x, false).allclose(&expected, 1e-5, 1e-5, false), "{name}: eager outputs");
    let planned = lazy(x, 0).apply_t(ours, false).to_tensor_with(&Options::new().micro_batch(micro)).unwrap();
    assert!(planned.allclose(&expected, 1e-4, 1e-4, false), "{name}: lazy outputs");
    vs.double();
    let x = x.to_kind(Kind::Double);
    let y = Tensor::randint(expected.size()[1], [x.size()[0]], (Kind::Int64, CPU));
    assert_micro_batched_gradients(&vs, ours, &x, &y, micro);
}

#[test]
fn mobilenet_v2_matches_tchs_own_and_splits_exactly() {
    tch::manual_seed(35);
    let tch_vs = nn::VarStore::new(CPU);
    let theirs = tch::vision::mobilenet::v2(&tch_vs.root(), 5);
    let vs = nn::VarStore::new(CPU);
    let ours = vision::mobilenet_v2(&vs.root(), 5);
    let x = Tensor::randn([4, 3, 64, 64], (Kind::Float, CPU));
    like_tchs_own("mobilenet_v2", vs, &ours, &tch_vs, &theirs, &x, 3);
}

#[test]
fn efficientnet_b0_matches_tchs_own_and_splits_exactly() {
    tch::manual_seed(36);
    let tch_vs = nn::VarStore::new(CPU);
    let theirs = tch::vision::efficientnet::b0(&tch_vs.root(), 5);
    let vs = nn::VarStore::new(CPU);
    let ours = vision::efficientnet_b0(&vs.root(), 5);
    // 67×67: odd sizes take "same" padding's uneven split.
    let x = Tensor::randn([3, 3, 67, 67], (Kind::Float, CPU));
    like_tchs_own("efficientnet_b0", vs, &ours, &tch_vs, &theirs, &x, 2);
}
