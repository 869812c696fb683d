//! `toma::lazy::models`: a GPT-2 decoder block and an encoder block, written once, give the
//! same outputs eagerly and lazily, and micro-batched, the full batch's gradients.

use tch::nn;
use tch::{Device, Kind, Tensor};
use toma::lazy::models::{BlockConfig, DecoderBlock, EncoderBlock};
use toma::lazy::{lazy, Options, TensorOps};

use crate::grad::{grads, relative_error, zero_grads};

const CPU: Device = Device::Cpu;

#[test]
fn decoder_and_encoder_blocks_run_eagerly_and_lazily_alike() {
    tch::manual_seed(41);
    let mut vs = nn::VarStore::new(CPU);
    let config = BlockConfig { dropout: 0.0, ..BlockConfig::gpt2(32, 4) };
    let decoder = DecoderBlock::new(&vs.root() / "h" / 0, config);
    let encoder = EncoderBlock::new(vs.root() / "enc", config);
    vs.double();
    let (n, t) = (7, 10);
    let x = Tensor::randn([n, t, 32], (Kind::Double, CPU));
    let y = Tensor::randint(32, [n], (Kind::Int64, CPU));
    // Each sample pads a different number of trailing positions (at least one key stays).
    let lengths = Tensor::randint_low(1, t + 1, [n, 1, 1, 1], (Kind::Int64, CPU));
    let padding = Tensor::arange(t, (Kind::Int64, CPU)).view([1, 1, 1, t]).ge_tensor(&lengths);

    fn loss<T: TensorOps>(d: &DecoderBlock, e: &EncoderBlock, x: &T, padding: &T, y: &T) -> T
    where
        nn::Linear: toma::lazy::Layer<T>,
        nn::LayerNorm: toma::lazy::Layer<T>,
    {
        let h = e.forward_t(&d.forward_t(x, false), Some(padding), false);
        h.select(1, 0).cross_entropy_loss(y, None, tch::Reduction::Mean, -100, 0.0)
    }

    zero_grads(&vs);
    let eager = loss(&decoder, &encoder, &x, &padding, &y);
    let eager_value = eager.double_value(&[]);
    eager.backward();
    let want = grads(&vs);
    for micro in [1, 3] {
        zero_grads(&vs);
        let (lx, lp, ly) = lazy((&x, &padding, &y), 0);
        let value = loss(&decoder, &encoder, &lx, &lp, &ly).backward_with(&Options::new().micro_batch(micro)).unwrap();
        assert!((value - eager_value).abs() <= 1e-10 * eager_value.abs(), "micro {micro}: {value} vs {eager_value}");
        let got = grads(&vs);
        for (name, w) in &want {
            let err = relative_error(&got[name], w);
            assert!(err <= 1e-6, "micro {micro}: {name} differs by {err:e} relative");
        }
    }
    // The decoder alone, as a forward: causal (a prefix's outputs ignore what follows).
    let full = decoder.forward_t(&x, false);
    let prefix = decoder.forward_t(&x.narrow(1, 0, 4), false);
    assert!(full.narrow(1, 0, 4).allclose(&prefix, 1e-10, 1e-10, false), "causal");
    let planned = decoder.forward_t(&lazy(&x, 0), false).to_tensor_with(&Options::new().micro_batch(2)).unwrap();
    assert!(planned.allclose(&full, 1e-10, 1e-10, false));
}

#[test]
fn gpt2_blocks_use_gpt2s_names() {
    let vs = nn::VarStore::new(CPU);
    let _ = DecoderBlock::new(&vs.root() / "h" / 0, BlockConfig::gpt2(16, 2));
    let mut names: Vec<String> = vs.variables().into_keys().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "h.0.attn.c_attn.bias",
            "h.0.attn.c_attn.weight",
            "h.0.attn.c_proj.bias",
            "h.0.attn.c_proj.weight",
            "h.0.ln_1.bias",
            "h.0.ln_1.weight",
            "h.0.ln_2.bias",
            "h.0.ln_2.weight",
            "h.0.mlp.c_fc.bias",
            "h.0.mlp.c_fc.weight",
            "h.0.mlp.c_proj.bias",
            "h.0.mlp.c_proj.weight",
        ]
    );
}

/// Blocks stack in a `toma::lazy::nn::seq_t()` (tch's `ModuleT` and the lazy one): the stack's
/// loss and gradients eagerly equal its micro-batched lazy ones.
#[test]
fn blocks_stack_in_a_sequence_for_both_uses() {
    tch::manual_seed(43);
    let mut vs = nn::VarStore::new(CPU);
    let config = BlockConfig { dropout: 0.0, ..BlockConfig::gpt2(16, 2) };
    let stack = toma::lazy::nn::seq_t()
        .add(DecoderBlock::new(&vs.root() / "h" / 0, config))
        .add(DecoderBlock::new(&vs.root() / "h" / 1, config))
        .add(EncoderBlock::new(vs.root() / "enc", config))
        .add_fn(|h| h.mean_dim(1, false, None));
    let head = nn::linear(vs.root() / "head", 16, 5, Default::default());
    vs.double();
    let x = Tensor::randn([9, 6, 16], (Kind::Double, CPU));
    let y = Tensor::randint(5, [9], (Kind::Int64, CPU));

    zero_grads(&vs);
    let eager = x.apply_t(&stack, true).apply(&head).log_softmax(-1, None).nll_loss(&y);
    let eager_value = eager.double_value(&[]);
    eager.backward();
    let eager_grads = grads(&vs);

    zero_grads(&vs);
    let (lx, ly) = lazy((&x, &y), 0);
    let loss = lx.apply_t(&stack, true).apply(&head).log_softmax(-1, None).nll_loss(&ly);
    let value = loss.backward_with(&Options::new().micro_batch(4)).unwrap();
    assert!((value - eager_value).abs() <= 1e-10 * eager_value.abs(), "{value} vs {eager_value}");
    for (name, e) in eager_grads {
        let err = relative_error(&vs.variables()[&name].grad(), &e);
        assert!(err <= 1e-6, "{name}: gradients differ by {err:e} relative");
    }
}
