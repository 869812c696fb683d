//! tch-rs's `translation` example in its own idioms (a GRU encoder, an attention decoder with
//! dropout, greedy decoding that reads its prediction at every token), ported with the `use`
//! switch, the wrap of each sentence and one `#[toma::lazy::module]` per `impl`: the attribute
//! translates the states in signatures (`GRUState`), `zero_state` and `Tensor::cat` of lazy
//! values. Trained three steps eagerly and lazily from the same weights: the same losses and
//! weights.

use tch::{Device, Kind, Tensor};
use toma::lazy::lazy;
use toma::lazy::nn::{self, GRUState, Module, OptimizerConfig, RNN};

const MAX_LENGTH: i64 = 10;
const HIDDEN: i64 = 32;
const WORDS: i64 = 23;
const SOS: i64 = 0;
const EOS: i64 = 1;

struct Encoder {
    embedding: nn::Embedding,
    gru: nn::GRU,
}

#[toma::lazy::module]
impl Encoder {
    fn new(vs: nn::Path) -> Self {
        let embedding = nn::embedding(&vs / "enc_embedding", WORDS, HIDDEN, Default::default());
        let gru = nn::gru(&vs / "enc_gru", HIDDEN, HIDDEN, Default::default());
        Encoder { embedding, gru }
    }

    fn forward(&self, xs: &Tensor, state: &GRUState) -> (Tensor, GRUState) {
        let xs = self.embedding.forward(xs).view([1, -1]);
        let state = self.gru.step(&xs, state);
        (state.value().squeeze_dim(1), state)
    }

    fn start(&self, like: &Tensor) -> GRUState {
        let _ = like;
        self.gru.zero_state(1)
    }
}

struct Decoder {
    embedding: nn::Embedding,
    gru: nn::GRU,
    attn: nn::Linear,
    attn_combine: nn::Linear,
    linear: nn::Linear,
}

#[toma::lazy::module]
impl Decoder {
    fn new(vs: nn::Path) -> Self {
        Decoder {
            embedding: nn::embedding(&vs / "dec_embedding", WORDS, HIDDEN, Default::default()),
            gru: nn::gru(&vs / "dec_gru", HIDDEN, HIDDEN, Default::default()),
            attn: nn::linear(&vs / "attn", HIDDEN * 2, MAX_LENGTH, Default::default()),
            attn_combine: nn::linear(&vs / "attn_combine", HIDDEN * 2, HIDDEN, Default::default()),
            linear: nn::linear(&vs / "linear", HIDDEN, WORDS, Default::default()),
        }
    }

    fn forward(&self, xs: &Tensor, state: &GRUState, enc_outputs: &Tensor, is_training: bool) -> (Tensor, GRUState) {
        let xs = self.embedding.forward(xs).dropout(0.1, is_training).view([1, -1]);
        let attn_weights = Tensor::cat(&[&xs, &state.value().squeeze_dim(0)], 1).apply(&self.attn).unsqueeze(0);
        let len = enc_outputs.size()[1];
        let attn_applied = attn_weights.narrow(2, 0, len).softmax(-1, Kind::Float).bmm(enc_outputs).squeeze_dim(1);
        let xs = Tensor::cat(&[&xs, &attn_applied], 1).apply(&self.attn_combine).relu();
        let state = self.gru.step(&xs, state);
        (self.linear.forward(&state.value()).log_softmax(-1, Kind::Float).squeeze_dim(0), state)
    }
}

struct Model {
    encoder: Encoder,
    decoder: Decoder,
}

#[toma::lazy::module]
impl Model {
    /// Teacher forcing on even steps, greedy decoding (reading each prediction) on odd ones.
    fn train_loss(&self, input: &Tensor, target: &Tensor, greedy: bool) -> Tensor {
        let mut state = self.encoder.start(input);
        let mut enc_outputs = vec![];
        for i in 0..input.size()[0] {
            let (out, next) = self.encoder.forward(&input.narrow(0, i, 1), &state);
            enc_outputs.push(out);
            state = next;
        }
        let enc_outputs = Tensor::stack(&enc_outputs, 1);
        let mut loss = target.narrow(0, 0, 1).zeros_like().to_kind(Kind::Float).sum(Kind::Float);
        let mut prev = target.narrow(0, 0, 1).zeros_like() + SOS;
        for i in 0..target.size()[0] {
            let (output, next) = self.decoder.forward(&prev, &state, &enc_outputs, true);
            state = next;
            let want = target.narrow(0, i, 1);
            loss += output.nll_loss(&want);
            if greedy {
                let predicted = output.argmax(-1, false);
                if i64::try_from(&predicted).unwrap() == EOS {
                    break;
                }
                prev = predicted;
            } else {
                prev = want;
            }
        }
        loss
    }
}

/// The model twice from the same weights, each with its Adam: the eager copy, then the lazy one.
fn two_copies<M>(build: impl Fn(&nn::VarStore) -> M) -> [(nn::VarStore, M, nn::Optimizer); 2] {
    let eager_vs = nn::VarStore::new(Device::Cpu);
    let eager = build(&eager_vs);
    let mut lazy_vs = nn::VarStore::new(Device::Cpu);
    let lazily = build(&lazy_vs);
    lazy_vs.copy(&eager_vs).unwrap();
    let eager_opt = nn::Adam::default().build(&eager_vs, 1e-3).unwrap();
    let lazy_opt = nn::Adam::default().build(&lazy_vs, 1e-3).unwrap();
    [(eager_vs, eager, eager_opt), (lazy_vs, lazily, lazy_opt)]
}

/// A step's losses `(lazily, eagerly)` and the weights after it agree.
fn same_step(step: i64, (value, expected): (f64, f64), lazy_vs: &nn::VarStore, eager_vs: &nn::VarStore) {
    assert!((value - expected).abs() <= 1e-5 * expected.abs(), "step {step}: {value} lazily, {expected} eagerly");
    let lazy_vars = lazy_vs.variables();
    for (name, t) in eager_vs.variables() {
        let diff = (&t - &lazy_vars[&name]).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "step {step}: {name} differs by {diff}");
    }
}

/// Run in a child process, alone: dropout draws from the global generator, which tests on
/// other threads would draw from between the two sides.
#[test]
fn tchs_translation_ports_with_one_attribute_an_impl_and_trains_as_eager() {
    if std::env::var_os("TOMA_TRANSLATION_CHILD").is_none() {
        let test = "translation::tchs_translation_ports_with_one_attribute_an_impl_and_trains_as_eager";
        crate::support::child::run(test, "TOMA_TRANSLATION_CHILD", "1").assert_finished("translation ");
        return;
    }
    let [(eager_vs, eager, mut eager_opt), (lazy_vs, lazily, mut lazy_opt)] =
        two_copies(|vs| Model { encoder: Encoder::new(vs.root()), decoder: Decoder::new(vs.root()) });
    for step in 0..4 {
        let input = Tensor::randint_low(2, WORDS, [7], (Kind::Int64, Device::Cpu));
        let target = Tensor::randint_low(2, WORDS, [6], (Kind::Int64, Device::Cpu));
        let greedy = step % 2 == 1;
        tch::manual_seed(step);
        let loss = eager.train_loss(&input, &target, greedy);
        eager_opt.backward_step(&loss);
        let expected = loss.double_value(&[]);
        tch::manual_seed(step);
        let (li, lt) = lazy((&input, &target), None);
        let loss = lazily.train_loss(&li, &lt, greedy);
        let value = lazy_opt.backward_step(&loss);
        same_step(step, (value, expected), &lazy_vs, &eager_vs);
    }
    println!("\ntranslation done=1");
}

/// tch-rs's translation example pads the encoder's outputs to `MAX_LENGTH` with a
/// `Tensor::zeros` constant, in an `if`/`else` whose other branch is the outputs themselves.
/// Written so, with a `let` annotated `Tensor` for the pad and a branch that gives a constant
/// beside one that gives a lazy value, the body compiles for both kinds under the attribute.
#[toma::lazy::module]
fn padded_score(outputs: &Tensor) -> Tensor {
    let len = outputs.size()[0];
    let pad: Tensor = Tensor::zeros([(MAX_LENGTH - len).max(0), HIDDEN], (Kind::Float, Device::Cpu));
    let padded = if len >= MAX_LENGTH { outputs.narrow(0, 0, MAX_LENGTH) } else { Tensor::cat(&[outputs, &pad], 0) };
    let first = if len > MAX_LENGTH {
        Tensor::zeros([1, HIDDEN], (Kind::Float, Device::Cpu))
    } else {
        padded.narrow(0, 0, 1) * 2.0
    };
    (padded.square().sum(Kind::Float) + first.sum(Kind::Float)).mean(Kind::Float)
}

#[test]
fn a_lazy_body_pads_with_constants_as_tchs_translation_does() {
    for len in [4, MAX_LENGTH + 3] {
        let mut x = Tensor::randn([len, HIDDEN], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let eager = padded_score(&x);
        eager.backward();
        let expected = x.grad().copy();
        x.zero_grad();
        let value = padded_score(&lazy(&x, None)).backward().unwrap();
        assert!((value - eager.double_value(&[])).abs() < 1e-5, "length {len}");
        let diff = (x.grad() - &expected).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "length {len}: gradients differ by {diff}");
    }
}

/// tch's `Tensor::cat` and `Tensor::stack` take owned tensors as well as references
/// (`Borrow<Tensor>`): a list written out of owned values, a name bound to a reference (the
/// argument) and references to temporaries compiles for both kinds under the attribute. So
/// do tch's `*_like` methods called by their path (`Tensor::ones_like(&b)`), annotated or not.
#[toma::lazy::module]
fn stacked_features(xs: &Tensor, w: &Tensor) -> Tensor {
    let a = xs.relu();
    let b = xs.matmul(w);
    let ones: Tensor = Tensor::ones_like(&b);
    let stacked = Tensor::stack(&[a, b * ones, Tensor::full_like(xs, 0.5)], 0);
    let joined = Tensor::cat(&[xs, &stacked.sum_dim_intlist(0, false, None), &xs.tanh()], 1);
    joined.square().mean(None)
}

#[test]
fn lists_of_owned_values_and_references_concatenate_as_eagerly() {
    let w = Tensor::randn([HIDDEN, HIDDEN], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::randn([8, HIDDEN], (Kind::Float, Device::Cpu));
    let eager = stacked_features(&x, &w);
    eager.backward();
    let expected = w.grad().copy();
    for micro in [8, 3] {
        let _ = w.grad().zero_();
        let value = stacked_features(&lazy(&x, 0), &lazy(&w, None))
            .backward_with(&toma::lazy::Options::new().micro_batch(micro));
        let value = value.unwrap();
        assert!((value - eager.double_value(&[])).abs() < 1e-5, "micro-batch {micro}");
        let diff = (w.grad() - &expected).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "micro-batch {micro}: gradients differ by {diff}");
    }
}

/// Upstream's `Model::train_loss` takes the sentences as token lists and makes its tensors
/// itself: a method whose only `Tensor` is its result. Ported with the wrap of the encoder's
/// tokens (`lazy(.., None)`, which the attribute makes a no-op on tch's side), its loss and
/// next input as upstream writes them (a constant and a field that then take lazy values), it
/// takes the kind
/// the caller asks for (`let loss: Tensor = model.train_loss(..)`), and the attribute names its
/// lazy twin `lazy_train_loss`, as `zero_state` has `lazy_zero_state`.
struct Translator {
    encoder: Encoder,
    decoder: Decoder,
    /// The first input, a tensor held by the model as upstream's `decoder_start` is.
    start: Tensor,
}

#[toma::lazy::module]
impl Translator {
    // Upstream's `loss = loss + ..`, kept as written.
    #[allow(clippy::assign_op_pattern)]
    fn train_loss(&self, input: &[i64], target: &[i64], greedy: bool) -> Tensor {
        let mut state = self.encoder.gru.zero_state(1);
        let mut enc_outputs = vec![];
        for &s in input {
            let s = lazy(&Tensor::from_slice(&[s]), None);
            let (out, next) = self.encoder.forward(&s, &state);
            enc_outputs.push(out);
            state = next;
        }
        let enc_outputs = Tensor::stack(&enc_outputs, 1);
        // Upstream's accumulator, a constant that then takes the terms: lazy from the start.
        let mut loss = Tensor::from(0f32).to_device(Device::Cpu);
        let mut prev = self.start.shallow_clone();
        for &s in target {
            let (output, next) = self.decoder.forward(&prev, &state, &enc_outputs, true);
            state = next;
            let target_tensor = Tensor::from_slice(&[s]).to_device(Device::Cpu);
            loss = loss + output.nll_loss(&target_tensor);
            let (_, output) = output.topk(1, -1, true, true);
            if i64::try_from(&output).unwrap() == EOS {
                break;
            }
            prev = if greedy { output.view([1]) } else { target_tensor };
        }
        loss
    }

    /// A method calling another whose only `Tensor` is its result: each body calls its own kind.
    fn reversed_loss(&self, input: &[i64], target: &[i64]) -> Tensor {
        let reversed: Vec<i64> = input.iter().rev().copied().collect();
        self.train_loss(&reversed, target, false) * 0.5
    }
}

#[test]
fn a_method_whose_only_tensor_is_its_result_has_a_lazy_twin() {
    if std::env::var_os("TOMA_TRANSLATION_CHILD").is_none() {
        let test = "translation::a_method_whose_only_tensor_is_its_result_has_a_lazy_twin";
        crate::support::child::run(test, "TOMA_TRANSLATION_CHILD", "1").assert_finished("translator ");
        return;
    }
    let [(eager_vs, eager, mut eager_opt), (lazy_vs, lazily, mut lazy_opt)] = two_copies(|vs| Translator {
        encoder: Encoder::new(vs.root()),
        decoder: Decoder::new(vs.root()),
        start: Tensor::from_slice(&[SOS]),
    });
    for step in 0..4 {
        let input: Vec<i64> = Tensor::randint_low(2, WORDS, [7], (Kind::Int64, Device::Cpu)).try_into().unwrap();
        let target: Vec<i64> = Tensor::randint_low(2, WORDS, [6], (Kind::Int64, Device::Cpu)).try_into().unwrap();
        let greedy = step % 2 == 1;
        tch::manual_seed(step);
        // The caller asks for the kind: `Tensor` runs the body as written.
        let loss: Tensor =
            if step == 3 { eager.reversed_loss(&input, &target) } else { eager.train_loss(&input, &target, greedy) };
        eager_opt.backward_step(&loss);
        let expected = loss.double_value(&[]);
        tch::manual_seed(step);
        let loss = match step {
            3 => lazily.lazy_reversed_loss(&input, &target),
            // The caller's annotation picks the kind too.
            2 => {
                let loss: toma::lazy::LazyTensor = lazily.train_loss(&input, &target, greedy);
                loss
            }
            _ => lazily.lazy_train_loss(&input, &target, greedy),
        };
        let value = lazy_opt.backward_step(&loss);
        same_step(step, (value, expected), &lazy_vs, &eager_vs);
    }
    println!("\ntranslator done=1");
}
