//! The user-facing surface: wrapping inputs, forcing evaluation (and only then), tch's layers
//! through the adapters, recording errors that name the op and both shapes, the plan's tracing
//! event, and micro-batches that still run out of memory being halved without counting twice.
#![cfg(feature = "tch")]

use crate::support;

use std::cell::Cell;
use std::rc::Rc;

use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, TchError, Tensor};
use toma::lazy::{
    lazy,
    nn::{seq, seq_t},
    try_lazy, CustomOp, LazyError, LazyTensor, Mode, Options, TensorMeta,
};

const CPU: Device = Device::Cpu;

/// A custom identity op that counts how often it runs, to see what forces evaluation.
pub(crate) fn counting(counter: Rc<Cell<usize>>) -> CustomOp {
    CustomOp::new(
        "counted",
        |ins| Ok(ins[0].clone()),
        move |xs| {
            counter.set(counter.get() + 1);
            Ok(xs[0].shallow_clone())
        },
    )
}

/// A run follows the plan it shows: an earlier split run (here asked for) must not make a later
/// run, whose plan is the whole batch, split the same way (issue 17's "1999 x 1 ran 512, 512,
/// 512, 463").
#[test]
fn a_later_run_follows_its_own_plan_not_an_earlier_split() {
    let runs = Rc::new(Cell::new(0));
    let t = Tensor::randn([2000, 4], (Kind::Double, CPU));
    let x = counting(runs.clone()).apply(&[&lazy(&t, 0)]).unwrap().relu();
    // One key for both runs: the graph's shape alone.
    let global = Options::new().cache(toma::CacheKind::Global);
    let split = x.to_tensor_with(&global.clone().micro_batch(500)).unwrap();
    assert_eq!(runs.replace(0), 4, "asked for micro-batches of 500");
    let plan = x.plan(Mode::Forward, &global).unwrap();
    assert!(!plan.splits(), "{plan}");
    let whole = x.to_tensor_with(&global).unwrap();
    assert_eq!(runs.get(), 1, "the plan's one chunk, not the earlier split");
    assert!(whole.equal(&split));
}

#[test]
fn queries_run_nothing_and_display_forces_the_value() {
    let runs = Rc::new(Cell::new(0));
    let t = Tensor::from_slice(&[1.0f64, -2.0, 3.0]).view([3, 1]);
    let x = counting(runs.clone()).apply(&[&lazy(&t, 0)]).unwrap().relu();
    assert_eq!((x.size(), x.kind(), x.device(), x.dim(), x.numel()), (vec![3, 1], Kind::Double, CPU, 2, 3));
    assert_eq!((x.batch_dim(), x.batch_size(), x.requires_grad(), x.op_name()), (Some(0), Some(3), false, "relu"));
    let _ = x.plan(Mode::Forward, &Options::default()).unwrap();
    assert_eq!(runs.get(), 0, "shape, kind, device and plan queries do not evaluate");

    let shown = format!("{x}");
    assert!(shown.contains('3') && shown.contains('0'), "{shown}");
    assert_eq!(runs.get(), 1);
    // Debug shows the recorded facts only: `dbg!` and log lines never evaluate.
    let debugged = format!("{x:?}");
    assert_eq!(debugged, "LazyTensor[relu, [3, 1], Double, Cpu, batch dim 0]");
    assert_eq!(runs.get(), 1, "Debug evaluates nothing");

    let total = x.sum(None);
    assert_eq!(f64::try_from(&total).unwrap(), 4.0);
    assert_eq!(total.double_value(&[]), 4.0);
    assert_eq!(x.int64_value(&[2, 0]), 3);
    assert_eq!(Vec::<f64>::try_from(&x.view([-1])).unwrap(), [1.0, 0.0, 3.0]);
    assert!(x.to_tensor().unwrap().equal(&t.relu()));
    assert!(runs.get() >= 6);
}

#[test]
fn lazy_wraps_tuples_arrays_and_vectors_with_one_batch_dimension() {
    let a = Tensor::zeros([4, 2], (Kind::Float, CPU));
    let b = Tensor::zeros([4], (Kind::Int64, CPU));
    let c = Tensor::zeros([3, 4], (Kind::Float, CPU));
    let (la, lb) = lazy((&a, &b), 0);
    assert_eq!((la.batch_size(), lb.batch_size()), (Some(4), Some(4)));
    let [lc] = lazy(&[c.shallow_clone()], -1);
    assert_eq!(lc.batch_dim(), Some(1));
    let v = lazy(&vec![a.shallow_clone(), a.shallow_clone()], 0i64);
    assert_eq!(v.len(), 2);
    let fixed = lazy(&a, None);
    assert_eq!(fixed.batch_dim(), None);
    let err = try_lazy((&a, &c), 0).unwrap_err();
    assert!(matches!(err, LazyError::Batch { .. }) && err.to_string().contains("[3, 4]"), "{err}");
    assert!(matches!(try_lazy(&a, 2), Err(LazyError::Argument { .. })));
}

#[test]
fn recording_errors_name_the_op_and_both_shapes() {
    let x = lazy(&Tensor::zeros([8, 3], (Kind::Float, CPU)), 0);
    let w = Tensor::zeros([4, 5], (Kind::Float, CPU));
    let err = x.f_matmul(&w).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("matmul") && text.contains("[8, 3]") && text.contains("[4, 5]"), "{text}");
    let err = x.f_add(&Tensor::zeros([2, 3], (Kind::Float, CPU))).unwrap_err();
    assert!(err.to_string().contains("add") && err.to_string().contains("[2, 3]"), "{err}");
    let err = x.f_view([5, -1]).unwrap_err();
    assert!(err.to_string().contains("view"), "{err}");
    let img = lazy(&Tensor::zeros([2, 3, 4, 4], (Kind::Float, CPU)), 0);
    let err =
        img.f_conv2d(&Tensor::zeros([6, 2, 3, 3], (Kind::Float, CPU)), None::<&Tensor>, [1], [0], [1], 1).unwrap_err();
    assert!(err.to_string().contains("conv2d") && err.to_string().contains("[6, 2, 3, 3]"), "{err}");
    // A fixed operand that has the batch's size along the batch dimension is refused: it would
    // be broadcast against every micro-batch.
    let err = x.f_add(&Tensor::zeros([8, 1], (Kind::Float, CPU))).unwrap_err();
    assert!(matches!(err, LazyError::Batch { .. }) && err.to_string().contains("lazy("), "{err}");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| x.matmul(&w))).unwrap_err();
    let message = panicked.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("matmul"), "{message}");
    // backward needs a scalar.
    assert!(matches!(x.backward(), Err(LazyError::NotScalar { .. })));
}

#[test]
fn tch_layers_record_with_their_private_settings() {
    tch::manual_seed(11);
    let vs = nn::VarStore::new(CPU);
    let r = vs.root();
    let conv = nn::conv2d(
        &r / "conv",
        4,
        6,
        3,
        nn::ConvConfig { stride: 2, padding: 2, dilation: 2, groups: 2, ..Default::default() },
    );
    let bn = nn::batch_norm2d(&r / "bn", 6, nn::BatchNormConfig { eps: 0.25, momentum: 0.5, ..Default::default() });
    let ln = nn::layer_norm(&r / "ln", vec![3], nn::LayerNormConfig { eps: 0.5, ..Default::default() });
    let emb = nn::embedding(&r / "emb", 10, 3, nn::EmbeddingConfig { padding_idx: 2, ..Default::default() });
    // Running statistics away from 0 and 1, so that eval mode differs from training mode.
    tch::no_grad(|| {
        let _ = bn.running_mean.shallow_clone().fill_(0.3);
        let _ = bn.running_var.shallow_clone().fill_(2.0);
    });
    let x = Tensor::randn([5, 4, 9, 9], (Kind::Float, CPU));
    let lx = lazy(&x, 0);
    let close = |a: &Tensor, b: &Tensor| assert!(a.allclose(b, 1e-5, 1e-5, false), "{a} vs {b}");
    close(&lx.apply(&conv).to_tensor().unwrap(), &conv.forward(&x));
    let h = conv.forward(&x);
    close(&lazy(&h, 0).apply_t(&bn, false).to_tensor().unwrap(), &bn.forward_t(&h, false));
    let small = Tensor::randn([5, 2, 3], (Kind::Float, CPU));
    close(&lazy(&small, 0).apply(&ln).to_tensor().unwrap(), &ln.forward(&small));
    let idx = Tensor::from_slice(&[1i64, 2, 3, 2, 9]).view([5, 1]);
    close(&lazy(&idx, 0).apply(&emb).to_tensor().unwrap(), &emb.forward(&idx));

    // A lazy Sequential of tch layers and functions.
    let fc = nn::linear(&r / "fc", 6, 2, Default::default());
    let model = seq_t()
        .add(nn::conv2d(&r / "c", 4, 6, 3, Default::default()))
        .add_fn_t(|x, train| x.dropout(0.5, train))
        .add_fn(|x| x.relu().adaptive_avg_pool2d([1, 1]).flatten(1, -1))
        .add(fc);
    assert_eq!(model.len(), 3 + 1);
    let out = lx.f_apply_t(&model, true).unwrap();
    assert_eq!(out.size(), [5, 2]);
    assert_eq!(model.forward_t(&x, false).size(), [5, 2]);
    let err = lx.f_apply(&seq().add_f_fn(|x| x.f_view([7, -1]))).unwrap_err();
    assert!(err.to_string().contains("view"), "{err}");
}

#[test]
fn the_plan_is_reported_as_a_tracing_event() {
    let vs = nn::VarStore::new(CPU);
    let fc = nn::linear(vs.root(), 3, 2, Default::default());
    let x = Tensor::randn([10, 3], (Kind::Float, CPU));
    let y = Tensor::randint(2, [10], (Kind::Int64, CPU));
    support::events::record();
    let (lx, ly) = lazy((&x, &y), 0);
    lx.apply(&fc).cross_entropy_for_logits(&ly).backward_with(&Options::new().micro_batch(4)).unwrap();
    let events = support::events::snapshot();
    // Other tests run at the same time: find this one's plan by its batch and micro-batch.
    let plan = events
        .iter()
        .map(|e| &e.fields)
        .find(|e| {
            e.get("message").is_some_and(|m| m.contains("plan"))
                && e.get("batch").is_some_and(|b| b == "10")
                && e.get("micro_batch").is_some_and(|m| m == "4")
        })
        .expect("a plan event");
    assert_eq!(plan["micro_batch"], "4");
    assert_eq!(plan["chunks"], "3");
    assert_eq!(plan["batch"], "10");
    assert_eq!(plan["mode"], "Backward");
    for field in ["peak", "budget", "full_batch_peak"] {
        assert!(plan[field].parse::<u64>().is_ok(), "{field}: {plan:?}");
    }
}

/// An op whose shape rule lies fails its step with the rule's and the op's shapes, on every
/// run: a graph's shapes count as checked only once a run of it got through.
#[test]
fn a_shape_rule_that_lies_fails_every_run() {
    let doubling =
        CustomOp::new("doubling", |ins: &[TensorMeta]| Ok(ins[0].clone()), |xs| Tensor::f_cat(&[xs[0], xs[0]], 1));
    let t = Tensor::randn([6, 3], (Kind::Double, CPU));
    for _ in 0..3 {
        let x = doubling.apply(&[&lazy(&t, 0)]).unwrap().relu();
        match x.to_tensor() {
            Err(LazyError::ShapeRule { op, expected, actual, .. }) => {
                assert_eq!((op.as_str(), expected, actual), ("doubling", vec![6, 3], vec![6, 6]));
            }
            other => panic!("expected a shape-rule error, got {other:?}"),
        }
    }
    // The same structure with an honest rule runs, again and again.
    let honest = CustomOp::new("doubling", |ins: &[TensorMeta]| Ok(ins[0].clone()), |xs| xs[0].f_mul_scalar(2.0));
    for _ in 0..3 {
        let x = honest.apply(&[&lazy(&t, 0)]).unwrap().relu();
        assert!(x.to_tensor().unwrap().equal(&(&t * 2.0).relu()));
    }
}

#[test]
fn an_oom_in_a_micro_batch_halves_it_and_never_counts_twice() {
    // An op that "runs out of memory" above 3 samples, with libtorch's CPU allocator text.
    let attempts = Rc::new(std::cell::RefCell::new(Vec::new()));
    let seen = attempts.clone();
    let picky = CustomOp::new(
        "picky",
        |ins: &[TensorMeta]| Ok(ins[0].clone()),
        move |xs| {
            let rows = xs[0].size()[0];
            seen.borrow_mut().push(rows);
            if rows > 3 {
                return Err(TchError::Torch(format!(
                    "DefaultCPUAllocator: can't allocate memory: you tried to allocate {rows} bytes"
                )));
            }
            xs[0].f_mul_scalar(1.0)
        },
    );
    let mut vs = nn::VarStore::new(CPU);
    let fc = nn::linear(vs.root(), 3, 2, Default::default());
    vs.double();
    let x = Tensor::randn([13, 3], (Kind::Double, CPU));
    let y = Tensor::randint(2, [13], (Kind::Int64, CPU));
    let loss = || {
        let (lx, ly) = lazy((&x, &y), 0);
        picky.apply(&[&lx.apply(&fc)]).unwrap().cross_entropy_for_logits(&ly)
    };
    let options = Options::new().micro_batch(8).cache(toma::CacheKind::Global);
    let value = loss().backward_with(&options).unwrap();
    let first: Vec<i64> = attempts.borrow_mut().drain(..).collect();
    assert_eq!(first[..3], [8, 4, 2], "halved twice: {first:?}");
    assert!(first[3..].iter().all(|&r| r <= 2), "{first:?}");
    let lazy_grads: Vec<Tensor> = vs.trainable_variables().iter().map(|v| v.grad().copy()).collect();

    for mut v in vs.trainable_variables() {
        v.zero_grad();
    }
    let eager = fc.forward(&x).log_softmax(-1, None).nll_loss(&y);
    assert!((eager.double_value(&[]) - value).abs() < 1e-12);
    eager.backward();
    for (l, v) in lazy_grads.iter().zip(vs.trainable_variables()) {
        assert!(l.allclose(&v.grad(), 1e-10, 1e-12, false), "no micro-batch counted twice");
    }
    // The size that worked is remembered for this graph: the next run starts there.
    loss().backward_with(&options).unwrap();
    let second: Vec<i64> = attempts.borrow_mut().drain(..).collect();
    assert!(second.iter().all(|&r| r <= 2), "{second:?}");
}

#[test]
fn unplannable_things_are_errors_not_eager_runs() {
    // A sparse embedding's gradient is a sparse tensor the planner does not model.
    let vs = nn::VarStore::new(CPU);
    let emb = nn::embedding(vs.root(), 10, 3, nn::EmbeddingConfig { sparse: true, ..Default::default() });
    let ids = lazy(&Tensor::randint(10, [2, 5], (Kind::Int64, CPU)), 0);
    let err = ids.f_apply(&emb).unwrap_err();
    assert!(matches!(err, LazyError::Unsupported { .. }) && err.to_string().contains("sparse"), "{err}");
}

#[test]
fn gradients_flow_to_tied_parameters_and_through_eager_transforms() {
    // One parameter used twice (tied weights) gets one, summed, gradient, also through a view
    // of it made eagerly (`w.transpose`, an op on `w`); `&w * 0.5` computed eagerly is not a
    // leaf: its gradient is sent back through its own graph.
    let w = Tensor::randn([3, 3], (Kind::Double, CPU)).set_requires_grad(true);
    let x = Tensor::randn([6, 3], (Kind::Double, CPU));
    let lazy_loss = lazy(&x, 0).matmul(&w).tanh().matmul(&w.transpose(0, 1)).matmul(&(&w * 0.5)).sum(None);
    let value = lazy_loss.backward_with(&Options::new().micro_batch(4)).unwrap();
    let lazy_grad = w.grad().copy();
    let mut w2 = w.shallow_clone();
    w2.zero_grad();
    let eager = x.matmul(&w).tanh().matmul(&w.transpose(0, 1)).matmul(&(&w * 0.5)).sum(None);
    eager.backward();
    assert!((eager.double_value(&[]) - value).abs() < 1e-10);
    assert!(lazy_grad.allclose(&w.grad(), 1e-10, 1e-12, false));
}

/// A view of a parameter made with tch (min-gpt's `self.ws.tr()`, a row range, a reshape, an
/// expansion) is recorded as an op on the parameter: its gradient lands in the parameter's
/// `.grad` as a plain step's does, whole or in micro-batches, with no operand of its own.
#[test]
fn views_of_parameters_are_ops_on_them() {
    let vs = nn::VarStore::new(CPU);
    let w = vs.root().randn("w", &[4, 6], 0.0, 1.0);
    let b = vs.root().randn("b", &[6], 0.0, 1.0);
    let x = Tensor::randn([7, 6], (Kind::Float, CPU));
    assert_eq!(LazyTensor::fixed(&w.tr()).op_name(), "transpose");
    assert_eq!(LazyTensor::fixed(&w.permute([1, 0]).unsqueeze(0)).op_name(), "as_strided");
    assert_eq!(LazyTensor::fixed(&w.narrow(0, 1, 2)).op_name(), "as_strided");
    assert_eq!(LazyTensor::fixed(&w).op_name(), "leaf");
    // Computed, not a view: an operand of its own.
    assert_eq!(LazyTensor::fixed(&(&w * 2.0)).op_name(), "leaf");
    // Made under no_grad, autograd does not know it as a view: a leaf of its own.
    assert_eq!(LazyTensor::fixed(&tch::no_grad(|| w.tr())).op_name(), "leaf");
    let step = |x: &LazyTensor| {
        let h = x.matmul(&w.tr()).tanh().matmul(&w.narrow(0, 1, 2).view([3, 4]).tr());
        (h + b.narrow(0, 1, 3).unsqueeze(0)).square().sum(None) + (b.expand([2, 6], false) * 0.5).sum(None)
    };
    let eager = {
        let h = x.matmul(&w.tr()).tanh().matmul(&w.narrow(0, 1, 2).view([3, 4]).tr());
        (h + b.narrow(0, 1, 3).unsqueeze(0)).square().sum(None) + (b.expand([2, 6], false) * 0.5).sum(None)
    };
    eager.backward();
    let want = [w.grad().copy(), b.grad().copy()];
    for micro in [7, 3] {
        for p in [&w, &b] {
            let mut p = p.shallow_clone();
            p.zero_grad();
        }
        let value = step(&lazy(&x, 0)).backward_with(&Options::new().micro_batch(micro)).unwrap();
        assert!((value - eager.double_value(&[])).abs() < 1e-3 * value.abs(), "micro-batch {micro}");
        for (p, want) in [&w, &b].into_iter().zip(&want) {
            assert!(p.grad().allclose(want, 1e-4, 1e-5, false), "micro-batch {micro}: {} against {want}", p.grad());
        }
    }
}

/// Options refuse values that cannot work, naming the `ConfigError`, instead of clamping them.
#[test]
fn options_refuse_bad_values() {
    let text = |f: fn() -> Options| support::payload_text(std::panic::catch_unwind(f).unwrap_err().as_ref());
    assert!(text(|| Options::new().micro_batch(0)).contains("micro-batch size must be at least 1"));
    for margin in [
        || Options::new().safety_margin(f64::NAN),
        || Options::new().safety_margin(1.0),
        || Options::new().safety_margin(-0.1),
    ] {
        assert!(text(margin).contains("safety margin must lie in [0, 1)"));
    }
    assert_eq!(Options::new().safety_margin(0.0).micro_batch(3), Options::new().safety_margin(0.0).micro_batch(3));
}

/// tch's convolution layers with every padding mode, and its transposed convolution, as lazy
/// layers: the same values as tch's own forward, split or not.
#[test]
fn tch_conv_layers_with_padding_modes_and_transposed_ones_run_lazily() {
    use tch::nn::{self, Module};
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let r = vs.root();
    let x = tch::Tensor::randn([5, 4, 9, 8], (tch::Kind::Float, tch::Device::Cpu));
    let options = toma::lazy::Options::new().micro_batch(2);
    for (i, mode) in
        [nn::PaddingMode::Zeros, nn::PaddingMode::Reflect, nn::PaddingMode::Replicate, nn::PaddingMode::Circular]
            .into_iter()
            .enumerate()
    {
        let conv = nn::conv2d(
            &r / format!("c{i}"),
            4,
            6,
            3,
            nn::ConvConfig { padding: 2, stride: 2, padding_mode: mode, ..Default::default() },
        );
        let want = conv.forward(&x);
        let got = toma::lazy::lazy(&x, 0).apply(&conv).to_tensor_with(&options).unwrap();
        assert!(got.allclose(&want, 1e-5, 1e-5, false), "{mode:?}");
    }
    let config = nn::ConvTransposeConfig { stride: 2, padding: 1, output_padding: 1, groups: 2, ..Default::default() };
    let t = nn::conv_transpose2d(&r / "t", 4, 6, 3, config);
    let want = t.forward(&x);
    let got = toma::lazy::lazy(&x, 0).apply(&t).to_tensor_with(&options).unwrap();
    assert_eq!(got.size(), want.size());
    assert!(got.allclose(&want, 1e-5, 1e-5, false), "conv_transpose2d");
}

/// `apply_opt`, as tch's: the layer when there is one, the value itself otherwise; the same
/// through `TensorOps` for tensors and lazy tensors.
#[test]
fn apply_opt_applies_a_layer_when_there_is_one() {
    use toma::lazy::TensorOps;
    let vs = nn::VarStore::new(CPU);
    let some = Some(nn::linear(vs.root() / "l", 4, 3, Default::default()));
    let none: Option<nn::Linear> = None;
    let x = Tensor::randn([5, 4], (Kind::Float, CPU));
    let eager = TensorOps::apply_opt(&x, &some);
    let planned = TensorOps::apply_opt(&lazy(&x, 0), &some).to_tensor().unwrap();
    assert!(planned.allclose(&eager, 1e-6, 1e-6, false));
    assert_eq!(eager.size(), [5, 3]);
    assert!(TensorOps::apply_opt(&lazy(&x, 0), &none).to_tensor().unwrap().equal(&x));
    assert!(TensorOps::apply_opt(&x, &none).equal(&x));
}

/// tch's indexing and tuple shapes on lazy tensors, against tch's own on the same tensor.
#[test]
fn indexing_and_tuple_shapes_follow_tch() {
    use tch::{IndexOp, NewAxis};
    let x = Tensor::randn([4, 6, 5], (Kind::Float, CPU));
    let l = lazy(&x, 0);
    let picks = Tensor::from_slice(&[4i64, 0, 2]);
    let cases: Vec<(Tensor, toma::lazy::LazyTensor)> = vec![
        (x.i((.., 1..3, -1)), l.i((.., 1..3, -1))),
        (x.i((.., NewAxis, 2..)), l.i((.., NewAxis, 2..))),
        (x.i((.., ..=2, &picks)), l.i((.., ..=2, &picks))),
        (x.i((.., 1)), l.i((.., 1))),
        (x.i((.., .., 1..=3)), l.i((.., .., 1..=3))),
        (x.view((4, 30)), l.view((4, 30))),
        (x.view((4, 3, 10)), l.view((4, 3, -1))),
        (x.reshape([4, -1, 5]), l.reshape([4, -1, 5])),
    ];
    for (k, (eager, lazy_t)) in cases.into_iter().enumerate() {
        assert_eq!(lazy_t.size(), eager.size(), "case {k}");
        let options = toma::lazy::Options::new().micro_batch(3);
        assert!(lazy_t.to_tensor_with(&options).unwrap().equal(&eager), "case {k}");
    }
    // Picking samples mixes them: recorded, but not split.
    assert_eq!(l.i(1).size(), [6, 5]);
    assert!(l.f_i((.., .., .., 0)).is_err(), "too many indices");
}

/// `+=`, `-=`, `*=` and `/=` take what the operators take (a lazy value, a tensor, a number)
/// and give the name the new value; another handle of the old one keeps it.
#[test]
fn compound_assignments_record_a_new_value() {
    let t = Tensor::from_slice(&[1.0f64, 2.0, 3.0]).view([3, 1]);
    let two = Tensor::from_slice(&[2.0f64]);
    let mut x = lazy(&t, 0);
    let before = x.clone();
    x += &before;
    x -= 1.0;
    x *= 3;
    x /= &two;
    x += before.clone();
    let expected = ((&t + &t - 1.0) * 3) / &two + &t;
    assert!(x.to_tensor().unwrap().equal(&expected));
    assert!(before.to_tensor().unwrap().equal(&t), "the old value is kept");
}
