//! Values read while a step is recording (`i64::try_from`, `f64::try_from`, `double_value`,
//! `int64_value`, `Display`): computed once, whole, as eager code computes them, and the step
//! continues from them. A greedy decoder that reads its output at every token, dropout on,
//! trains exactly as eager tch does, whole and in micro-batches.

use std::cell::Cell;
use std::rc::Rc;

use tch::{Device, Kind, Tensor};
use toma::lazy::nn::{self, OptimizerConfig, RNN};
use toma::lazy::{lazy, Layer, LazyTensor, Options};

use crate::api::counting;

const CPU: Device = Device::Cpu;
const VOCAB: i64 = 13;
const HIDDEN: i64 = 16;
const EOS: i64 = 1;
const DROPOUT: f64 = 0.1;

/// An attention decoder over a GRU encoder, as tch-rs's translation example builds one.
struct Seq2Seq {
    src_emb: nn::Embedding,
    tgt_emb: nn::Embedding,
    encoder: nn::GRU,
    decoder: nn::GRU,
    attn: nn::Linear,
    combine: nn::Linear,
    head: nn::Linear,
}

impl Seq2Seq {
    fn new(vs: &nn::VarStore, max_len: i64) -> Seq2Seq {
        let p = vs.root();
        Seq2Seq {
            src_emb: nn::embedding(&p / "src_emb", VOCAB, HIDDEN, Default::default()),
            tgt_emb: nn::embedding(&p / "tgt_emb", VOCAB, HIDDEN, Default::default()),
            encoder: nn::gru(&p / "encoder", HIDDEN, HIDDEN, Default::default()),
            decoder: nn::gru(&p / "decoder", HIDDEN, HIDDEN, Default::default()),
            attn: nn::linear(&p / "attn", 2 * HIDDEN, max_len, Default::default()),
            combine: nn::linear(&p / "combine", 2 * HIDDEN, HIDDEN, Default::default()),
            head: nn::linear(&p / "head", HIDDEN, VOCAB, Default::default()),
        }
    }
}

/// The loss of decoding `tgt` (`[batch, len]`) from `src` (`[batch, len]`) greedily, with
/// dropout on the decoder's embeddings: each token's prediction is read to feed the next and
/// to stop once every sentence produced end-of-sentence. Written once for tensors and lazy
/// values: the state's type, the wrap and the read differ.
macro_rules! greedy_loss {
    ($name:ident, $t:ty, $zero:ident, $wrap:expr, $h:expr, $read:expr) => {
        fn $name(m: &Seq2Seq, src: &Tensor, tgt: &Tensor) -> $t {
            let wrap = $wrap;
            let (batch, src_len) = (src.size()[0], src.size()[1]);
            let mut state = m.encoder.$zero(batch);
            let mut outputs: Vec<$t> = Vec::new();
            for t in 0..src_len {
                let x = m.src_emb.forward(&wrap(&src.narrow(1, t, 1).squeeze_dim(1)));
                state = m.encoder.step(&x, &state);
                outputs.push($h(&state).squeeze_dim(0));
            }
            let encoded = <$t>::stack(&outputs.iter().collect::<Vec<_>>(), 1);
            let mut input = wrap(&Tensor::zeros([batch], (Kind::Int64, CPU)));
            let mut loss: Option<$t> = None;
            for k in 0..tgt.size()[1] {
                let embedded = m.tgt_emb.forward(&input).dropout(DROPOUT, true);
                let h = $h(&state).squeeze_dim(0);
                let weights = m.attn.forward(&<$t>::cat(&[&embedded, &h], 1)).narrow(1, 0, src_len).softmax(-1, None);
                let applied = weights.unsqueeze(1).bmm(&encoded).squeeze_dim(1);
                let x = m.combine.forward(&<$t>::cat(&[&embedded, &applied], 1)).relu();
                state = m.decoder.step(&x, &state);
                let logits = m.head.forward(&$h(&state).squeeze_dim(0)).log_softmax(-1, None);
                let term = logits.nll_loss(&wrap(&tgt.narrow(1, k, 1).squeeze_dim(1)));
                loss = Some(match loss {
                    None => term,
                    Some(sum) => sum + term,
                });
                let next = logits.argmax(-1, false);
                let unfinished: i64 = $read(&next.ne(EOS as f64).sum(Kind::Int64));
                if unfinished == 0 {
                    break;
                }
                input = next;
            }
            loss.expect("one token at least")
        }
    };
}

greedy_loss!(
    eager_loss,
    Tensor,
    zero_state,
    |t: &Tensor| t.shallow_clone(),
    |s: &nn::GRUState| s.0.shallow_clone(),
    |t: &Tensor| i64::try_from(t).unwrap()
);
greedy_loss!(
    lazy_loss,
    LazyTensor,
    lazy_zero_state,
    |t: &Tensor| lazy(t, 0),
    |s: &nn::LazyGRUState| s.h(),
    |t: &LazyTensor| i64::try_from(t).unwrap()
);

fn largest_difference(a: &nn::VarStore, b: &nn::VarStore) -> f64 {
    let b = b.variables();
    a.variables().iter().map(|(name, t)| (t - &b[name]).abs().max().double_value(&[])).fold(0.0, f64::max)
}

/// Three steps of the decoder, eagerly and lazily from the same weights and seeds: the losses
/// and the weights after each step are the same (the lazy backward sums some gradients in
/// another order: equal to rounding). `read_first` reads the loss before its step.
fn train_both(batch: i64, micro_batch: Option<usize>, read_first: bool) {
    let options = micro_batch.map_or_else(Options::new, |m| Options::new().micro_batch(m));
    let mut eager_vs = nn::VarStore::new(CPU);
    let eager = Seq2Seq::new(&eager_vs, 8);
    eager_vs.double();
    let mut lazy_vs = nn::VarStore::new(CPU);
    let lazily = Seq2Seq::new(&lazy_vs, 8);
    lazy_vs.double();
    lazy_vs.copy(&eager_vs).unwrap();
    let mut eager_opt = nn::Adam::default().build(&eager_vs, 1e-2).unwrap();
    let mut lazy_opt = nn::Adam::default().build(&lazy_vs, 1e-2).unwrap();
    let what = format!("batch {batch}, micro-batches {micro_batch:?}, loss read first: {read_first}");
    for step in 0..3 {
        let src = Tensor::randint(VOCAB, [batch, 5], (Kind::Int64, CPU));
        let tgt = Tensor::randint(VOCAB, [batch, 7], (Kind::Int64, CPU));
        tch::manual_seed(step);
        eager_opt.zero_grad();
        let loss = eager_loss(&eager, &src, &tgt);
        eager_opt.backward_step(&loss);
        let expected = loss.double_value(&[]);
        tch::manual_seed(step);
        lazy_opt.zero_grad();
        let loss = lazy_loss(&lazily, &src, &tgt);
        if read_first {
            assert_eq!(f64::try_from(&loss).unwrap(), expected, "{what}: the loss read before its step");
        }
        let value = lazy_opt.f_backward_step_with(&loss, &options).unwrap();
        assert!(
            (value - expected).abs() <= 1e-12 * expected.abs(),
            "{what}, step {step}: {value} lazily, {expected} eagerly"
        );
        let diff = largest_difference(&eager_vs, &lazy_vs);
        assert!(diff < 1e-10, "{what}, step {step}: weights differ by {diff}");
    }
}

/// Run in a child process, alone: dropout draws from the global generator, which tests on
/// other threads would draw from between the two sides.
#[test]
fn a_decoder_that_reads_every_token_trains_as_eager_with_dropout() {
    if std::env::var_os("TOMA_READS_CHILD").is_none() {
        let test = "reads::a_decoder_that_reads_every_token_trains_as_eager_with_dropout";
        crate::support::child::run(test, "TOMA_READS_CHILD", "1").assert_finished("decoder-reads ");
        return;
    }
    // One sentence a step, as tch-rs's translation example trains.
    train_both(1, None, false);
    // Several, in uneven micro-batches: what each token's read computed is sliced per micro-batch.
    train_both(7, Some(3), false);
    train_both(7, Some(2), true);
    train_both(7, None, true);
    println!("\ndecoder-reads done=1");
}

/// A read computes what it needs once; later reads and the step take it from there. Without
/// grad mode (inference), a read is planned as `to_tensor` plans it, and kept nowhere.
#[test]
fn a_read_while_recording_computes_nothing_twice() {
    let runs = Rc::new(Cell::new(0));
    let w = Tensor::randn([4, 3], (Kind::Double, CPU)).set_requires_grad(true);
    let x = Tensor::randn([6, 4], (Kind::Double, CPU));
    let hidden = counting(runs.clone()).apply(&[&lazy(&x, 0).matmul(&w)]).unwrap().tanh();
    let first = hidden.sum(None).double_value(&[]);
    assert_eq!(runs.get(), 1);
    assert_eq!(hidden.op_name(), "tanh", "the value keeps its name once computed");
    let second = f64::try_from(&hidden.square().mean(None)).unwrap();
    assert_eq!(runs.get(), 1, "the second read starts from the first's values");
    let loss = hidden.square().sum(None) + hidden.sum(None) * 0.0;
    loss.backward_with(&Options::new().micro_batch(4)).unwrap();
    assert_eq!(runs.get(), 1, "the step starts from them too");
    let eager = x.matmul(&w.detach().set_requires_grad(true)).tanh();
    assert!((eager.sum(None).double_value(&[]) - first).abs() < 1e-12);
    assert!((eager.square().mean(None).double_value(&[]) - second).abs() < 1e-12);
    let expected = {
        let w2 = w.detach().set_requires_grad(true);
        x.matmul(&w2).tanh().square().sum(None).backward();
        w2.grad()
    };
    let diff = (w.grad() - expected).abs().max().double_value(&[]);
    assert!(diff < 1e-12, "gradient differs by {diff}");

    // Inference: nothing is kept, every read runs what it reads.
    runs.set(0);
    let value = tch::no_grad(|| {
        let hidden = counting(runs.clone()).apply(&[&lazy(&x, 0).matmul(&w)]).unwrap().tanh();
        let _ = f64::try_from(&hidden.sum(None)).unwrap();
        f64::try_from(&hidden.mean(None)).unwrap()
    });
    assert_eq!(runs.get(), 2);
    assert!((value - x.matmul(&w).tanh().mean(None).double_value(&[])).abs() < 1e-12);
}
