//! The zoo of the GPU run's test 12 (`tests/gpu.rs`): ResNet-18, MobileNet-V2, a GPT-2 block
//! stack and an LSTM, written once for tensors and lazy tensors. The card tests rebuild the
//! plans of that run's log from them (`tests/lazy/zoo_replay.rs`).

use tch::{nn, Device, Kind, Tensor};
use toma::lazy::LazyTensor;

/// What the filled card leaves: the default budget is this less the safety margin.
pub const ZOO_LEFT: u64 = 4 << 30;
pub const ZOO_VOCAB: i64 = 64;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ZooKind {
    ResNet18,
    MobileNetV2,
    Gpt2,
    Lstm,
}

pub enum ZooNet {
    ResNet(Box<toma::lazy::vision::ResNet>),
    Mobile(Box<toma::lazy::vision::MobileNetV2>),
    Gpt(Vec<toma::lazy::models::DecoderBlock>, nn::Linear),
    Lstm(toma::lazy::nn::LSTM, nn::Linear),
}

pub struct ZooModel {
    pub net: ZooNet,
    pub which: ZooKind,
    /// Image side, or sequence length.
    pub size: i64,
}

impl ZooModel {
    pub fn new(vs: &nn::VarStore, which: ZooKind, size: i64) -> ZooModel {
        let root = vs.root();
        let net = match which {
            ZooKind::ResNet18 => ZooNet::ResNet(Box::new(toma::lazy::vision::resnet18(&root, 10))),
            ZooKind::MobileNetV2 => ZooNet::Mobile(Box::new(toma::lazy::vision::mobilenet_v2(&root, 10))),
            ZooKind::Gpt2 => {
                let config =
                    toma::lazy::models::BlockConfig { dropout: 0.0, ..toma::lazy::models::BlockConfig::gpt2(512, 8) };
                let blocks = (0..6).map(|i| toma::lazy::models::DecoderBlock::new(&root / "h" / i, config)).collect();
                ZooNet::Gpt(blocks, nn::linear(&root / "head", 512, 10, Default::default()))
            }
            ZooKind::Lstm => {
                let config = toma::lazy::nn::RNNConfig { num_layers: 2, batch_first: true, ..Default::default() };
                ZooNet::Lstm(
                    toma::lazy::nn::lstm(&root / "lstm", ZOO_VOCAB, 512, config),
                    nn::linear(&root / "head", 512, ZOO_VOCAB, Default::default()),
                )
            }
        };
        ZooModel { net, which, size }
    }

    /// Inputs and labels of `n` samples on `device`, the inputs in `kind`.
    pub fn data(&self, n: i64, kind: Kind, device: Device) -> (Tensor, Tensor) {
        let s = self.size;
        match self.which {
            ZooKind::ResNet18 | ZooKind::MobileNetV2 => {
                (Tensor::randn([n, 3, s, s], (kind, device)), Tensor::randint(10, [n], (Kind::Int64, device)))
            }
            ZooKind::Gpt2 => {
                (Tensor::randn([n, s, 512], (kind, device)), Tensor::randint(10, [n], (Kind::Int64, device)))
            }
            ZooKind::Lstm => (
                Tensor::randn([n, s, ZOO_VOCAB], (kind, device)),
                Tensor::randint(ZOO_VOCAB, [n, s], (Kind::Int64, device)),
            ),
        }
    }

    /// The loss, written once for tensors and lazy tensors.
    pub fn loss<T: toma::lazy::TensorOps>(&self, x: &T, y: &T, train: bool) -> T
    where
        nn::Conv2D: toma::lazy::Layer<T>,
        nn::BatchNorm: toma::lazy::nn::LayerT<T>,
        nn::Linear: toma::lazy::Layer<T>,
        nn::LayerNorm: toma::lazy::Layer<T>,
        toma::lazy::nn::LSTM: toma::lazy::nn::RNN<T>,
    {
        use toma::lazy::nn::RNN;
        match &self.net {
            ZooNet::ResNet(net) => net.forward_t(x, train).log_softmax(-1, None).nll_loss(y),
            ZooNet::Mobile(net) => net.forward_t(x, train).log_softmax(-1, None).nll_loss(y),
            ZooNet::Gpt(blocks, head) => {
                let mut h = blocks[0].forward_t(x, train);
                for block in &blocks[1..] {
                    h = block.forward_t(&h, train);
                }
                h.mean_dim(1, false, None).apply(head).log_softmax(-1, None).nll_loss(y)
            }
            ZooNet::Lstm(lstm, head) => {
                let (out, _) = lstm.seq(x);
                out.apply(head).view([-1, ZOO_VOCAB]).log_softmax(-1, None).nll_loss(&y.view([-1]))
            }
        }
    }

    pub fn lazy_loss(&self, x: &Tensor, y: &Tensor, train: bool) -> LazyTensor {
        let (lx, ly) = toma::lazy::lazy((x, y), 0);
        self.loss(&lx, &ly, train)
    }
}

/// The zoo's cases: model, input size, whether in training mode (the CNNs' batch norm then
/// mixes samples: recompute), and the first batch planned.
pub const ZOO_CASES: [(ZooKind, i64, bool, i64); 6] = [
    (ZooKind::ResNet18, 128, false, 64),
    (ZooKind::ResNet18, 128, true, 64),
    (ZooKind::MobileNetV2, 128, false, 64),
    (ZooKind::MobileNetV2, 128, true, 64),
    (ZooKind::Gpt2, 256, true, 16),
    (ZooKind::Lstm, 128, true, 64),
];

pub fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "f32",
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        Kind::Double => "f64",
        _ => "other",
    }
}
