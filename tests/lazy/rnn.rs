//! tch's recurrent layers through `toma::lazy::nn`: the same values as libtorch's fused
//! `lstm`/`gru`, whole and in micro-batches, and models written once that train lazily with
//! the full batch's gradients.

use tch::{Device, Kind, Tensor};
use toma::lazy::nn::{self, LazyGRUState, LazyLSTMState, OptimizerConfig, RNN};
use toma::lazy::{lazy, Layer, LazyTensor, Options, TensorOps};

const CPU: Device = Device::Cpu;

fn config(layers: i64, bidirectional: bool, batch_first: bool, has_biases: bool) -> nn::RNNConfig {
    nn::RNNConfig { num_layers: layers, bidirectional, batch_first, has_biases, ..Default::default() }
}

fn close(what: &str, lazily: &Tensor, eagerly: &Tensor) {
    assert_eq!(lazily.size(), eagerly.size(), "{what}: shape");
    let diff = (lazily - eagerly).abs().max().double_value(&[]);
    assert!(diff < 1e-10, "{what}: differs by {diff}");
}

const CONFIGS: [(i64, bool, bool, bool); 4] =
    [(1, false, true, true), (2, true, true, true), (2, false, false, false), (1, true, false, true)];

#[test]
fn an_lstm_records_what_libtorch_computes() {
    let (b, t, f, h) = (5i64, 4i64, 3i64, 6i64);
    for (layers, bidi, batch_first, bias) in CONFIGS {
        let what = format!("lstm layers {layers} bidirectional {bidi} batch_first {batch_first} bias {bias}");
        let mut vs = nn::VarStore::new(CPU);
        let lstm = nn::lstm(vs.root(), f, h, config(layers, bidi, batch_first, bias));
        vs.double();
        let shape = if batch_first { [b, t, f] } else { [t, b, f] };
        let xs = Tensor::randn(shape, (Kind::Double, CPU));
        let batch_dim = if batch_first { 0 } else { 1 };
        // From the zero state.
        let (out, state) = RNN::<Tensor>::seq(&lstm, &xs);
        let (lout, lstate) = lstm.seq(&lazy(&xs, batch_dim));
        for options in [Options::new(), Options::new().micro_batch(2)] {
            close(&what, &lout.to_tensor_with(&options).unwrap(), &out);
            close(&format!("{what}: h"), &lstate.h().to_tensor_with(&options).unwrap(), &state.h());
            close(&format!("{what}: c"), &lstate.c().to_tensor_with(&options).unwrap(), &state.c());
        }
        // From a given state, batched along its dimension 1.
        let dirs = if bidi { 2 } else { 1 };
        let h0 = Tensor::randn([layers * dirs, b, h], (Kind::Double, CPU));
        let c0 = Tensor::randn([layers * dirs, b, h], (Kind::Double, CPU));
        let (out, state) = lstm.seq_init(&xs, &nn::LSTMState((h0.shallow_clone(), c0.shallow_clone())));
        let l0 = LazyLSTMState::new(LazyTensor::batched(&h0, 1).unwrap(), LazyTensor::batched(&c0, 1).unwrap());
        let (lout, lstate) = lstm.seq_init(&lazy(&xs, batch_dim), &l0);
        let options = Options::new().micro_batch(2);
        close(&format!("{what}, given state"), &lout.to_tensor_with(&options).unwrap(), &out);
        close(&format!("{what}, given state: h"), &lstate.h().to_tensor_with(&options).unwrap(), &state.h());
    }
}

#[test]
fn a_gru_records_what_libtorch_computes() {
    let (b, t, f, h) = (5i64, 4i64, 3i64, 6i64);
    for (layers, bidi, batch_first, bias) in CONFIGS {
        let what = format!("gru layers {layers} bidirectional {bidi} batch_first {batch_first} bias {bias}");
        let mut vs = nn::VarStore::new(CPU);
        let gru = nn::gru(vs.root(), f, h, config(layers, bidi, batch_first, bias));
        vs.double();
        let shape = if batch_first { [b, t, f] } else { [t, b, f] };
        let xs = Tensor::randn(shape, (Kind::Double, CPU));
        let batch_dim = if batch_first { 0 } else { 1 };
        let (out, state) = RNN::<Tensor>::seq(&gru, &xs);
        let (lout, lstate) = gru.seq(&lazy(&xs, batch_dim));
        for options in [Options::new(), Options::new().micro_batch(2)] {
            close(&what, &lout.to_tensor_with(&options).unwrap(), &out);
            close(&format!("{what}: h"), &lstate.value().to_tensor_with(&options).unwrap(), &state.value());
        }
        let dirs = if bidi { 2 } else { 1 };
        let h0 = Tensor::randn([layers * dirs, b, h], (Kind::Double, CPU));
        let (out, _) = gru.seq_init(&xs, &nn::GRUState(h0.shallow_clone()));
        let l0 = LazyGRUState::new(LazyTensor::batched(&h0, 1).unwrap());
        let (lout, _) = gru.seq_init(&lazy(&xs, batch_dim), &l0);
        close(&format!("{what}, given state"), &lout.to_tensor_with(&Options::new().micro_batch(3)).unwrap(), &out);
    }
}

#[test]
fn the_layers_are_tchs_variables_and_values() {
    // tch's layer and ours have the same variables (names, shapes, kinds), so a checkpoint of
    // one loads into the other, and then the same outputs. (The global generator is shared by
    // the tests' threads: the values are copied, not seeded.)
    let vs_tch = tch::nn::VarStore::new(CPU);
    let theirs = tch::nn::lstm(vs_tch.root(), 3, 4, config(2, true, true, true));
    let mut vs_ours = nn::VarStore::new(CPU);
    let ours = nn::lstm(vs_ours.root(), 3, 4, config(2, true, true, true));
    let (a, b) = (vs_tch.variables(), vs_ours.variables());
    assert_eq!(a.len(), 16);
    assert_eq!(b.len(), 16);
    for (name, t) in &a {
        assert_eq!(t.size(), b[name].size(), "{name}");
        assert_eq!(t.kind(), b[name].kind(), "{name}");
    }
    vs_ours.copy(&vs_tch).unwrap();
    let xs = Tensor::randn([2, 5, 3], (Kind::Float, CPU));
    let (x1, _) = tch::nn::RNN::seq(&theirs, &xs);
    let (x2, _) = RNN::<Tensor>::seq(&ours, &xs);
    assert!(x1.equal(&x2));
}

#[test]
fn steps_from_the_zero_state_record_the_sequence() {
    let mut vs = nn::VarStore::new(CPU);
    let lstm = nn::lstm(vs.root(), 3, 4, Default::default());
    vs.double();
    let xs = Tensor::randn([6, 5, 3], (Kind::Double, CPU));
    let (_, whole) = RNN::<Tensor>::seq(&lstm, &xs);
    let lx = lazy(&xs, 0);
    let mut state = lstm.lazy_zero_state(6);
    for t in 0..5 {
        state = lstm.step(&lx.select(1, t), &state);
    }
    close("steps", &state.h().to_tensor_with(&Options::new().micro_batch(4)).unwrap(), &whole.h());
    // The zero state itself, read as a value, is the batch's zeros.
    let zero = lstm.lazy_zero_state(6).c() + lx.select(1, 0).sum_dim_intlist(-1, false, None).view([1, 6, 1]);
    let want = xs.select(1, 0).sum_dim_intlist(-1, false, None).view([1, 6, 1]).expand([1, 6, 4], false);
    close("zero state", &zero.to_tensor_with(&Options::new().micro_batch(4)).unwrap(), &want);
}

/// A user's GRU steps are one `gru_cell` op each (the cell eager tch's step runs): the same
/// states and gradients as eager steps, bit for bit in `Float`, from the zero state and from a
/// given one, with and without biases, whole and in micro-batches.
#[test]
fn gru_steps_are_libtorchs_cell_as_eager_steps() {
    let (b, t, f, h) = (6i64, 4i64, 3i64, 5i64);
    for bias in [true, false] {
        for given in [false, true] {
            for micro in [6usize, 4] {
                let what = format!("bias {bias}, given state {given}, micro-batch {micro}");
                let vs = nn::VarStore::new(CPU);
                let gru = nn::gru(vs.root(), f, h, config(1, false, true, bias));
                let xs = Tensor::randn([b, t, f], (Kind::Float, CPU)).set_requires_grad(true);
                let h0 = Tensor::randn([1, b, h], (Kind::Float, CPU));
                let mut eager = if given { nn::GRUState(h0.shallow_clone()) } else { gru.zero_state(b) };
                for k in 0..t {
                    eager = RNN::<Tensor>::step(&gru, &xs.select(1, k), &eager);
                }
                let eager_loss = eager.value().square().sum(None);
                eager_loss.backward();
                let params: Vec<Tensor> = vs.trainable_variables();
                let expected: Vec<Tensor> = params.iter().chain([&xs]).map(|v| v.grad().copy()).collect();
                for v in params.iter().chain([&xs]) {
                    let _ = v.grad().zero_();
                }

                let lx = lazy(&xs, 0);
                let mut state = if given {
                    LazyGRUState::new(LazyTensor::batched(&h0, 1).unwrap())
                } else {
                    gru.lazy_zero_state(b)
                };
                for k in 0..t {
                    state = gru.step(&lx.select(1, k), &state);
                }
                let loss = state.value().square().sum(None);
                let names = op_names(&loss);
                assert_eq!(names.iter().filter(|n| *n == "gru_cell").count(), t as usize, "{what}: {names:?}");
                assert!(!names.iter().any(|n| n == "sigmoid"), "{what}: {names:?}");
                let value = loss.backward_with(&Options::new().micro_batch(micro)).unwrap();
                let got: Vec<Tensor> = params.iter().chain([&xs]).map(|v| v.grad().copy()).collect();
                if micro == b as usize {
                    assert_eq!(value, eager_loss.double_value(&[]), "{what}: the loss");
                    for (g, e) in got.iter().zip(&expected) {
                        assert!(g.equal(e), "{what}: a gradient differs from eager's");
                    }
                } else {
                    assert!((value - eager_loss.double_value(&[])).abs() <= 1e-5 * value.abs(), "{what}: the loss");
                    for (g, e) in got.iter().zip(&expected) {
                        let diff = (g - e).abs().max().double_value(&[]);
                        assert!(diff < 1e-5, "{what}: a gradient differs by {diff}");
                    }
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_named() {
    let vs = nn::VarStore::new(CPU);
    let lstm = nn::lstm(vs.root(), 3, 4, Default::default());
    let err = lstm.f_seq(&lazy(&Tensor::zeros([2, 5, 7], (Kind::Float, CPU)), 0)).unwrap_err().to_string();
    assert!(err.contains("input_size") && err.contains("lstm"), "{err}");
    let err = lstm.f_seq(&lazy(&Tensor::zeros([2, 5], (Kind::Float, CPU)), 0)).unwrap_err().to_string();
    assert!(err.contains("3-D"), "{err}");
    let err = lstm.f_seq(&lazy(&Tensor::zeros([2, 5, 3], (Kind::Double, CPU)), 0)).unwrap_err().to_string();
    assert!(err.contains("to_kind"), "{err}");
    let wrong = LazyLSTMState::new(
        LazyTensor::batched(&Tensor::zeros([2, 2, 4], (Kind::Float, CPU)), 1).unwrap(),
        LazyTensor::batched(&Tensor::zeros([2, 2, 4], (Kind::Float, CPU)), 1).unwrap(),
    );
    let err = lstm.f_seq_init(&lazy(&Tensor::zeros([2, 5, 3], (Kind::Float, CPU)), 0), &wrong).unwrap_err().to_string();
    assert!(err.contains("[layers * directions, batch, hidden]"), "{err}");
}

const VOCAB: i64 = 11;

/// A char-RNN language model, written once (tch's `cross_entropy_for_logits` computes in f32,
/// so the log-softmax is spelled out to compare in f64): one-hot characters, a 2-layer LSTM, a linear head.
fn char_rnn_loss<T: TensorOps>(lstm: &impl RNN<T>, head: &impl Layer<T>, xs: &T, ys: &T) -> T {
    let (out, _) = lstm.seq(xs);
    head.forward(&out).view([-1, VOCAB]).log_softmax(-1, None).nll_loss(&ys.view([-1]))
}

/// A GRU sequence-to-sequence model, written once: the encoder's final state starts the
/// decoder (teacher forcing), embeddings on both sides.
#[allow(clippy::too_many_arguments)]
fn seq2seq_loss<T: TensorOps, R: RNN<T>>(
    src_emb: &impl Layer<T>,
    tgt_emb: &impl Layer<T>,
    encoder: &R,
    decoder: &R,
    head: &impl Layer<T>,
    src: &T,
    tgt_in: &T,
    tgt_out: &T,
) -> T {
    let (_, state) = encoder.seq(&src_emb.forward(src));
    let (out, _) = decoder.seq_init(&tgt_emb.forward(tgt_in), &state);
    head.forward(&out).view([-1, VOCAB]).log_softmax(-1, None).nll_loss(&tgt_out.view([-1]))
}

fn assert_same_variables(what: &str, a: &nn::VarStore, b: &nn::VarStore, tol: f64) {
    for (name, e) in a.variables() {
        let l = &b.variables()[&name];
        let diff = (&e - l).abs().max().double_value(&[]);
        assert!(diff < tol, "{what}: {name} differs by {diff}");
    }
}

#[test]
fn a_char_rnn_trains_in_micro_batches_as_the_full_batch() {
    let build = |vs: &nn::VarStore| {
        let lstm = nn::lstm(vs.root() / "lstm", VOCAB, 16, config(2, false, true, true));
        let head = nn::linear(vs.root() / "head", 16, VOCAB, Default::default());
        (lstm, head)
    };
    let mut eager_vs = nn::VarStore::new(CPU);
    let (eager_lstm, eager_head) = build(&eager_vs);
    eager_vs.double();
    let mut lazy_vs = nn::VarStore::new(CPU);
    let (lazy_lstm, lazy_head) = build(&lazy_vs);
    lazy_vs.double();
    lazy_vs.copy(&eager_vs).unwrap();
    let mut eager_opt = nn::Adam::default().build(&eager_vs, 1e-2).unwrap();
    let mut lazy_opt = nn::Adam::default().build(&lazy_vs, 1e-2).unwrap();
    let chars = Tensor::randint(VOCAB, [10, 9], (Kind::Int64, CPU));
    let xs = chars.narrow(1, 0, 8).onehot(VOCAB).to_kind(Kind::Double);
    let ys = chars.narrow(1, 1, 8).contiguous();
    for step in 0..3 {
        let loss = char_rnn_loss(&eager_lstm, &eager_head, &xs, &ys);
        let eager_value = loss.double_value(&[]);
        eager_opt.backward_step(&loss);
        let (lx, ly) = lazy((&xs, &ys), 0);
        let loss = char_rnn_loss(&lazy_lstm, &lazy_head, &lx, &ly);
        let value = lazy_opt.f_backward_step_with(&loss, &Options::new().micro_batch(3)).unwrap();
        assert!((value - eager_value).abs() < 1e-9, "step {step}: loss {value} lazily, {eager_value} eagerly");
        assert_same_variables(&format!("char-rnn step {step}"), &eager_vs, &lazy_vs, 1e-6);
    }
}

#[test]
fn a_gru_seq2seq_trains_in_micro_batches_as_the_full_batch() {
    let build = |vs: &nn::VarStore| {
        let p = vs.root();
        let src_emb = nn::embedding(&p / "src", VOCAB, 8, Default::default());
        let tgt_emb = nn::embedding(&p / "tgt", VOCAB, 8, Default::default());
        let encoder = nn::gru(&p / "enc", 8, 12, Default::default());
        let decoder = nn::gru(&p / "dec", 8, 12, Default::default());
        let head = nn::linear(&p / "head", 12, VOCAB, Default::default());
        (src_emb, tgt_emb, encoder, decoder, head)
    };
    let mut eager_vs = nn::VarStore::new(CPU);
    let e = build(&eager_vs);
    eager_vs.double();
    let mut lazy_vs = nn::VarStore::new(CPU);
    let l = build(&lazy_vs);
    lazy_vs.double();
    lazy_vs.copy(&eager_vs).unwrap();
    let mut eager_opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&eager_vs, 0.1).unwrap();
    let mut lazy_opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&lazy_vs, 0.1).unwrap();
    let src = Tensor::randint(VOCAB, [9, 6], (Kind::Int64, CPU));
    let tgt = Tensor::randint(VOCAB, [9, 6], (Kind::Int64, CPU));
    let (tgt_in, tgt_out) = (tgt.narrow(1, 0, 5).contiguous(), tgt.narrow(1, 1, 5).contiguous());
    for step in 0..3 {
        eager_opt.zero_grad();
        let loss = seq2seq_loss(&e.0, &e.1, &e.2, &e.3, &e.4, &src, &tgt_in, &tgt_out);
        let eager_value = loss.double_value(&[]);
        loss.backward();
        eager_opt.step();
        let (ls, li, lo) = lazy((&src, &tgt_in, &tgt_out), 0);
        let loss = seq2seq_loss(&l.0, &l.1, &l.2, &l.3, &l.4, &ls, &li, &lo);
        let value = lazy_opt.f_backward_step_with(&loss, &Options::new().micro_batch(4)).unwrap();
        assert!((value - eager_value).abs() < 1e-9, "step {step}: loss {value} lazily, {eager_value} eagerly");
        assert_same_variables(&format!("seq2seq step {step}"), &eager_vs, &lazy_vs, 1e-6);
    }
    // Inference through the same module, outputs indexed as tch's examples do.
    let xs = Tensor::randn([3, 4, 8], (Kind::Double, CPU));
    let eager_last = RNN::<Tensor>::seq(&l.2, &xs).0.select(1, -1).apply(&l.4);
    let lazy_last = l.2.seq(&lazy(&xs, 0)).0.select(1, -1).apply(&l.4);
    close("inference", &lazy_last.to_tensor_with(&Options::new().micro_batch(2)).unwrap(), &eager_last);
}

/// tch's char-RNN example's imports and sampling loop, unchanged but for the imports:
/// `zero_state` and `step` on tensors, `forward` through the combined `Module`.
mod char_rnn_as_tch_writes_it {
    use tch::{Device, Kind, Tensor};
    use toma::lazy::nn::{self, Linear, Module, LSTM, RNN};

    pub(super) fn sample(lstm: &LSTM, linear: &Linear, labels: i64) -> Vec<i64> {
        let mut state = lstm.zero_state(1);
        let mut last_label = 0i64;
        let mut out = Vec::new();
        for _ in 0..5 {
            let input = Tensor::zeros([1, labels], (Kind::Float, Device::Cpu));
            let _ = input.narrow(1, last_label, 1).fill_(1.0);
            state = lstm.step(&input, &state);
            let sampled_y = linear.forward(&state.h()).squeeze_dim(0).softmax(-1, Kind::Float).multinomial(1, false);
            last_label = sampled_y.int64_value(&[0]);
            out.push(last_label)
        }
        out
    }

    pub(super) fn model(vs: &nn::VarStore, labels: i64) -> (LSTM, Linear) {
        (nn::lstm(vs.root(), labels, 8, Default::default()), nn::linear(vs.root() / "l", 8, labels, Default::default()))
    }
}

#[test]
fn tchs_sampling_loop_compiles_unchanged() {
    let vs = nn::VarStore::new(CPU);
    let (lstm, linear) = char_rnn_as_tch_writes_it::model(&vs, 7);
    assert_eq!(char_rnn_as_tch_writes_it::sample(&lstm, &linear, 7).len(), 5);
}

/// The ops of a recorded loss's plan, by name.
fn op_names(loss: &LazyTensor) -> Vec<String> {
    let plan = loss.plan(toma::lazy::Mode::Backward, &Options::new().calibrate(toma::lazy::Calibrate::Never)).unwrap();
    plan.ops().iter().map(|op| op.name.to_string()).collect()
}

/// A sequence is one op on libtorch's fused kernel, however long; steps the user takes are
/// recorded as steps (an LSTM's from small ops, a GRU's as libtorch's cell).
#[test]
fn a_sequence_is_one_fused_op_and_steps_stay_steps() {
    let vs = nn::VarStore::new(CPU);
    let lstm = nn::lstm(vs.root() / "lstm", 3, 8, config(2, true, true, true));
    let gru = nn::gru(vs.root() / "gru", 16, 8, Default::default());
    let xs = Tensor::randn([4, 200, 3], (Kind::Float, CPU));
    let lx = lazy(&xs, 0);
    let (out, state) = lstm.seq(&lx);
    let (out, _) = gru.seq_init(&out, &nn::LazyGRUState::new(state.h().narrow(0, 0, 1)));
    let names = op_names(&out.sum(None));
    assert_eq!(names.iter().filter(|n| *n == "lstm").count(), 1, "{names:?}");
    assert_eq!(names.iter().filter(|n| *n == "gru").count(), 1, "{names:?}");
    assert!(names.len() < 40, "{} ops for two recurrent layers over 200 steps: {names:?}", names.len());
    let mut state = lstm.lazy_zero_state(4);
    for t in 0..3 {
        state = lstm.step(&lx.select(1, t), &state);
    }
    let names = op_names(&state.h().sum(None));
    assert!(!names.iter().any(|n| n == "lstm"), "steps recorded on the fused kernel: {names:?}");
    assert!(names.iter().any(|n| n == "sigmoid"), "{names:?}");
}

/// In `Float` (oneDNN's kernel on a CPU), whole and in micro-batches: the values, the states
/// and the gradients of libtorch's own call.
#[test]
fn the_fused_kernel_in_float_matches_tch_whole_and_split() {
    for (layers, bidi, batch_first, bias) in CONFIGS {
        let what = format!("float lstm/gru layers {layers} bidirectional {bidi} batch_first {batch_first} bias {bias}");
        let vs = nn::VarStore::new(CPU);
        let lstm = nn::lstm(vs.root() / "lstm", 5, 7, config(layers, bidi, batch_first, bias));
        let gru = nn::gru(vs.root() / "gru", 5, 7, config(layers, bidi, batch_first, bias));
        let (b, t) = (6i64, 9i64);
        let shape = if batch_first { [b, t, 5] } else { [t, b, 5] };
        let xs = Tensor::randn(shape, (Kind::Float, CPU));
        let batch_dim = if batch_first { 0 } else { 1 };
        let eager = {
            let (o1, s1) = RNN::<Tensor>::seq(&lstm, &xs);
            let (o2, s2) = RNN::<Tensor>::seq(&gru, &xs);
            (o1.square().sum(Kind::Float)
                + o2.tanh().sum(Kind::Float)
                + s1.c().sum(Kind::Float) * 0.5
                + s2.value().sum(Kind::Float) * 0.25)
                .copy()
        };
        let mut opt = nn::Sgd::default().build(&vs, 0.0).unwrap();
        opt.zero_grad();
        eager.backward();
        let grads: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(k, v)| (k, v.grad().copy())).collect();
        for micro in [6usize, 4, 1] {
            opt.zero_grad();
            let lx = lazy(&xs, batch_dim);
            let (o1, s1) = lstm.seq(&lx);
            let (o2, s2) = gru.seq(&lx);
            let loss = o1.square().sum(Kind::Float)
                + o2.tanh().sum(Kind::Float)
                + s1.c().sum(Kind::Float) * 0.5
                + s2.h().sum(Kind::Float) * 0.25;
            let value = loss.backward_with(&Options::new().micro_batch(micro)).unwrap();
            let want = eager.double_value(&[]);
            assert!((value - want).abs() < 1e-4 * want.abs().max(1.0), "{what} micro {micro}: {value} vs {want}");
            for (name, g) in &grads {
                let diff = (vs.variables()[name].grad() - g).abs().max().double_value(&[]);
                assert!(diff < 1e-4, "{what} micro {micro}: gradient of {name} differs by {diff}");
            }
        }
    }
}

/// In an autocast region the steps' products are cast as libtorch's autocast casts them, so
/// the recurrence is recorded step by step there.
/// In an autocast region the fused kernel runs in libtorch's autocast, as eager code runs it
/// (on a CPU, `lstm` on oneDNN's layers in `BFloat16`; `gru` on its cells' products): the
/// value and the gradients equal eager autocast's bit for bit, sequences and steps alike.
#[test]
fn an_autocast_region_runs_the_fused_kernel_as_eager_autocast() {
    for gru in [false, true] {
        let vs = nn::VarStore::new(CPU);
        let emb = nn::embedding(vs.root() / "emb", 40, 32, Default::default());
        let lstm = nn::lstm(vs.root() / "lstm", 32, 64, Default::default());
        let cell = nn::gru(vs.root() / "gru", 32, 64, Default::default());
        let head = nn::linear(vs.root() / "head", 64, 40, Default::default());
        let xs = Tensor::randint(40, [41, 24], (Kind::Int64, CPU));
        let ys = Tensor::randint(40, [41, 24], (Kind::Int64, CPU));
        let fused = if gru { "gru" } else { "lstm" };
        let eager = toma::autocast(CPU, Kind::BFloat16, || {
            let embedded = emb.forward(&xs);
            let out = if gru {
                Ok(RNN::<Tensor>::seq(&cell, &embedded).0)
            } else {
                // tch's own call, which unwraps: here its error, to say it.
                let flat: Vec<&Tensor> = lstm.flat_weights();
                let zeros = lstm.zero_state(41);
                embedded.f_lstm(&[&zeros.0 .0, &zeros.0 .1], &flat, true, 1, 0.0, true, false, true).map(|r| r.0)
            };
            out.map(|out| head.forward(&out).view([-1, 40]).cross_entropy_for_logits(&ys.view([-1])))
        });
        let loss = || {
            toma::autocast(CPU, Kind::BFloat16, || {
                let (lx, ly) = lazy((&xs, &ys), 0);
                let embedded = emb.forward(&lx);
                let out = if gru { cell.seq(&embedded).0 } else { lstm.seq(&embedded).0 };
                head.forward(&out).view([-1, 40]).cross_entropy_for_logits(&ly.view([-1]))
            })
        };
        let eager = match eager {
            Ok(eager) => eager,
            Err(err) => {
                // A CPU without oneDNN's BFloat16 LSTM: eager autocast cannot run it at all.
                // Lazily the steps are recorded from small ops instead, and train.
                println!("{fused}: eager autocast fails on this CPU ({err}); recorded as steps");
                assert!(!op_names(&loss()).iter().any(|n| n == fused));
                assert!(loss().backward().unwrap().is_finite());
                continue;
            }
        };
        eager.backward();
        let trained: Vec<Tensor> = vs.trainable_variables().into_iter().filter(|v| v.grad().defined()).collect();
        let expected: Vec<Tensor> = trained.iter().map(|v| v.grad().copy()).collect();
        for v in &trained {
            let _ = v.grad().zero_();
        }
        let loss = loss();
        let names = op_names(&loss);
        assert!(names.iter().any(|n| n == fused), "{names:?}");
        assert_eq!(loss.backward().unwrap(), eager.double_value(&[]), "{fused}: the loss");
        for (v, e) in trained.iter().zip(&expected) {
            assert!(v.grad().equal(e), "{fused}: a gradient differs from eager autocast's");
        }
    }
    // A user's steps too: eager tch runs a step as a sequence of one (a GRU's: an LSTM's
    // needs oneDNN's BFloat16 LSTM, which not every CPU has).
    let vs = nn::VarStore::new(CPU);
    let gru = nn::gru(vs.root() / "gru", 3, 8, Default::default());
    let xs = Tensor::randn([4, 5, 3], (Kind::Float, CPU));
    let (eager, lazily) = toma::autocast(CPU, Kind::BFloat16, || {
        let (mut e, mut l) = (gru.zero_state(4), gru.lazy_zero_state(4));
        let lx = lazy(&xs, 0);
        for t in 0..5 {
            e = RNN::<Tensor>::step(&gru, &xs.select(1, t), &e);
            l = gru.step(&lx.select(1, t), &l);
        }
        (e.0, l.h())
    });
    assert!(lazily.to_tensor().unwrap().equal(&eager), "steps differ from eager autocast's");
}
