//! tch's vision models written once over [`TensorOps`]: the same layers under the same variable
//! names as `tch::vision` (its weights load), runnable eagerly on tensors (tch's `ModuleT`) and
//! lazily, planned and micro-batched (`x.apply_t(&model, train)` on a [`LazyTensor`]).
//!
//! Batch norm in training mode normalizes with statistics over the batch: a lazy run in
//! training mode is refused for splitting unless [`Options::allow_batch_mixing`] says
//! otherwise; in eval mode it splits freely.
//!
//! ```
//! use tch::{nn, Device, Kind, Tensor};
//! use toma::lazy::{lazy, vision, Options};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = vision::resnet18(&vs.root(), 10);
//! let images = Tensor::randn([8, 3, 32, 32], (Kind::Float, Device::Cpu));
//! let eager = images.apply_t(&net, false);
//! let planned = lazy(&images, 0).apply_t(&net, false).to_tensor_with(&Options::new().micro_batch(4))?;
//! assert!(planned.allclose(&eager, 1e-4, 1e-4, false));
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```
//!
//! [`Options::allow_batch_mixing`]: super::Options::allow_batch_mixing

use tch::{nn, Tensor};

use super::error::LazyError;
use super::nn::LazyModuleT;
use super::tensor_ops::{Layer, LayerT, TensorOps};
use super::LazyTensor;

fn conv(p: nn::Path, c_in: i64, c_out: i64, ksize: i64, padding: i64, stride: i64) -> nn::Conv2D {
    nn::conv2d(p, c_in, c_out, ksize, nn::ConvConfig { stride, padding, bias: false, ..Default::default() })
}

/// A convolution and its batch norm.
struct ConvBn {
    conv: nn::Conv2D,
    bn: nn::BatchNorm,
}

impl ConvBn {
    fn new(
        conv_path: nn::Path,
        bn_path: nn::Path,
        c_in: i64,
        c_out: i64,
        ksize: i64,
        padding: i64,
        stride: i64,
    ) -> Self {
        ConvBn {
            conv: conv(conv_path, c_in, c_out, ksize, padding, stride),
            bn: nn::batch_norm2d(bn_path, c_out, Default::default()),
        }
    }

    fn forward<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
    {
        xs.apply(&self.conv).apply_t(&self.bn, train)
    }
}

/// A residual block: basic (two 3×3 convolutions) or bottleneck (1×1, 3×3, 1×1).
struct Block {
    convs: Vec<ConvBn>,
    downsample: Option<ConvBn>,
}

impl Block {
    fn basic(p: nn::Path, c_in: i64, c_out: i64, stride: i64) -> Self {
        Block {
            convs: vec![
                ConvBn::new(&p / "conv1", &p / "bn1", c_in, c_out, 3, 1, stride),
                ConvBn::new(&p / "conv2", &p / "bn2", c_out, c_out, 3, 1, 1),
            ],
            downsample: Self::downsample(&p / "downsample", c_in, c_out, stride),
        }
    }

    fn bottleneck(p: nn::Path, c_in: i64, c_out: i64, stride: i64) -> Self {
        let e_dim = 4 * c_out;
        Block {
            convs: vec![
                ConvBn::new(&p / "conv1", &p / "bn1", c_in, c_out, 1, 0, 1),
                ConvBn::new(&p / "conv2", &p / "bn2", c_out, c_out, 3, 1, stride),
                ConvBn::new(&p / "conv3", &p / "bn3", c_out, e_dim, 1, 0, 1),
            ],
            downsample: Self::downsample(&p / "downsample", c_in, e_dim, stride),
        }
    }

    fn downsample(p: nn::Path, c_in: i64, c_out: i64, stride: i64) -> Option<ConvBn> {
        (stride != 1 || c_in != c_out).then(|| ConvBn::new(&p / "0", &p / "1", c_in, c_out, 1, 0, stride))
    }

    fn forward<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
    {
        let mut ys = self.convs[0].forward(xs, train);
        for conv in &self.convs[1..] {
            ys = conv.forward(&ys.relu(), train);
        }
        match &self.downsample {
            Some(d) => d.forward(xs, train).add(&ys),
            None => xs.add(&ys),
        }
        .relu()
    }
}

/// A ResNet with tch's layout and variable names (`conv1`, `bn1`, `layer1.0.conv1`, ..,
/// `fc`).
pub struct ResNet {
    stem: ConvBn,
    layers: Vec<Vec<Block>>,
    fc: Option<nn::Linear>,
}

impl std::fmt::Debug for ResNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let blocks: Vec<usize> = self.layers.iter().map(Vec::len).collect();
        f.debug_struct("ResNet").field("blocks", &blocks).field("classifier", &self.fc.is_some()).finish()
    }
}

impl ResNet {
    fn new(p: &nn::Path, nclasses: Option<i64>, counts: [i64; 4], bottleneck: bool) -> ResNet {
        let stem = ConvBn::new(p / "conv1", p / "bn1", 3, 64, 7, 3, 2);
        let e = if bottleneck { 4 } else { 1 };
        let mut c_in = 64;
        let mut layers = Vec::new();
        for (i, (&count, c_out)) in counts.iter().zip([64, 128, 256, 512]).enumerate() {
            let lp = p / format!("layer{}", i + 1);
            let stride = if i == 0 { 1 } else { 2 };
            let mut blocks = Vec::new();
            for b in 0..count {
                let bp = &lp / b.to_string();
                let s = if b == 0 { stride } else { 1 };
                blocks.push(if bottleneck {
                    Block::bottleneck(bp, c_in, c_out, s)
                } else {
                    Block::basic(bp, c_in, c_out, s)
                });
                c_in = e * c_out;
            }
            layers.push(blocks);
        }
        let fc = nclasses.map(|n| nn::linear(p / "fc", 512 * e, n, Default::default()));
        ResNet { stem, layers, fc }
    }

    /// The model on `xs` (`[N, 3, H, W]`), written once for tensors and lazy tensors.
    pub fn forward_t<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
        nn::Linear: Layer<T>,
    {
        let mut h = self.stem.forward(xs, train).relu().max_pool2d(&[3, 3], &[2, 2], &[1, 1], &[1, 1], false);
        for layer in &self.layers {
            for block in layer {
                h = block.forward(&h, train);
            }
        }
        let h = h.adaptive_avg_pool2d(&[1, 1]).flatten(1, -1);
        match &self.fc {
            Some(fc) => h.apply(fc),
            None => h,
        }
    }
}

impl nn::ModuleT for ResNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        ResNet::forward_t(self, xs, train)
    }
}

/// Records the model; a shape that does not fit panics with the recording error, as tch's
/// eager model panics.
impl LazyModuleT for ResNet {
    fn lazy_forward_t(&self, xs: &LazyTensor, train: bool) -> Result<LazyTensor, LazyError> {
        Ok(ResNet::forward_t(self, xs, train))
    }
}

/// ResNet-18 (tch's `resnet18`, its variable names).
pub fn resnet18(p: &nn::Path, num_classes: i64) -> ResNet {
    ResNet::new(p, Some(num_classes), [2, 2, 2, 2], false)
}

/// ResNet-34 (tch's `resnet34`).
pub fn resnet34(p: &nn::Path, num_classes: i64) -> ResNet {
    ResNet::new(p, Some(num_classes), [3, 4, 6, 3], false)
}

/// ResNet-50 (tch's `resnet50`).
pub fn resnet50(p: &nn::Path, num_classes: i64) -> ResNet {
    ResNet::new(p, Some(num_classes), [3, 4, 6, 3], true)
}
