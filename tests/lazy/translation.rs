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

/// Run in a child process, alone: dropout draws from the global generator, which tests on
/// other threads would draw from between the two sides.
#[test]
fn tchs_translation_ports_with_one_attribute_an_impl_and_trains_as_eager() {
    if std::env::var_os("TOMA_TRANSLATION_CHILD").is_none() {
        let test = "translation::tchs_translation_ports_with_one_attribute_an_impl_and_trains_as_eager";
        crate::support::child::run(test, "TOMA_TRANSLATION_CHILD", "1").assert_finished("translation ");
        return;
    }
    let build = |vs: &nn::VarStore| Model { encoder: Encoder::new(vs.root()), decoder: Decoder::new(vs.root()) };
    let eager_vs = nn::VarStore::new(Device::Cpu);
    let eager = build(&eager_vs);
    let mut lazy_vs = nn::VarStore::new(Device::Cpu);
    let lazily = build(&lazy_vs);
    lazy_vs.copy(&eager_vs).unwrap();
    let mut eager_opt = nn::Adam::default().build(&eager_vs, 1e-3).unwrap();
    let mut lazy_opt = nn::Adam::default().build(&lazy_vs, 1e-3).unwrap();
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
        assert!((value - expected).abs() <= 1e-5 * expected.abs(), "step {step}: {value} lazily, {expected} eagerly");
        let lazy_vars = lazy_vs.variables();
        for (name, t) in eager_vs.variables() {
            let diff = (&t - &lazy_vars[&name]).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "step {step}: {name} differs by {diff}");
        }
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
