//! tch's vision models written once over [`TensorOps`] (ResNet-18/34/50, VGG-11/13/16/19 with
//! and without batch norm, AlexNet, MobileNet-V2, EfficientNet-B0): the same layers under the same variable names as
//! `tch::vision` (its weights load), runnable eagerly on tensors (tch's `ModuleT`) and
//! lazily, planned and micro-batched (`x.apply_t(&model, train)` on a [`LazyTensor`](super::LazyTensor)).
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

use tch::nn;

use super::nn::both_modules;
use super::nn::{Layer, LayerT};
use super::tensor_ops::TensorOps;

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
        let mut h = self.stem.forward(xs, train).relu().max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false);
        for layer in &self.layers {
            for block in layer {
                h = block.forward(&h, train);
            }
        }
        let h = h.adaptive_avg_pool2d([1, 1]).flatten(1, -1);
        match &self.fc {
            Some(fc) => h.apply(fc),
            None => h,
        }
    }
}

/// ResNet-18 (tch's `resnet18`, its variable names).
pub fn resnet18(p: &nn::Path, num_classes: i64) -> ResNet {
    ResNet::new(p, Some(num_classes), [2, 2, 2, 2], false)
}

/// ResNet-18 without its final layer (tch's `resnet18_no_final_layer`): the 512 pooled
/// features of each image, as transfer learning reads them: computed once, under `no_grad`,
/// in micro-batches where the data set's activations would not fit at once.
///
/// ```
/// use tch::{nn, Device, Kind, Tensor};
/// use toma::lazy::{lazy, vision, Options};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let net = vision::resnet18_no_final_layer(&vs.root());
/// let images = Tensor::randn([6, 3, 32, 32], (Kind::Float, Device::Cpu));
/// let features = tch::no_grad(|| lazy(&images, 0).apply_t(&net, false));
/// let features = features.to_tensor_with(&Options::new().micro_batch(4))?;
/// assert_eq!(features.size(), [6, 512]);
/// assert!(!features.requires_grad());
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
pub fn resnet18_no_final_layer(p: &nn::Path) -> ResNet {
    ResNet::new(p, None, [2, 2, 2, 2], false)
}

/// ResNet-34 without its final layer (tch's `resnet34_no_final_layer`).
pub fn resnet34_no_final_layer(p: &nn::Path) -> ResNet {
    ResNet::new(p, None, [3, 4, 6, 3], false)
}

/// ResNet-50 without its final layer (tch's `resnet50_no_final_layer`): 2048 features.
pub fn resnet50_no_final_layer(p: &nn::Path) -> ResNet {
    ResNet::new(p, None, [3, 4, 6, 3], true)
}

/// ResNet-34 (tch's `resnet34`).
pub fn resnet34(p: &nn::Path, num_classes: i64) -> ResNet {
    ResNet::new(p, Some(num_classes), [3, 4, 6, 3], false)
}

/// ResNet-50 (tch's `resnet50`).
pub fn resnet50(p: &nn::Path, num_classes: i64) -> ResNet {
    ResNet::new(p, Some(num_classes), [3, 4, 6, 3], true)
}

/// One entry of a VGG's `features`: a 3×3 convolution (with its batch norm), then a ReLU; or a
/// 2×2 max-pool.
enum VggFeature {
    Conv(Box<(nn::Conv2D, Option<nn::BatchNorm>)>),
    Pool,
}

/// A VGG with tch's layout and variable names (`features.N`, `classifier.{0,3,6}`), where `N`
/// counts every layer of torchvision's `Sequential` (convolutions, batch norms, ReLUs, pools).
/// As in tch, the classifier takes the 7×7 map of a 224×224 image, with no adaptive pooling.
pub struct Vgg {
    features: Vec<VggFeature>,
    classifier: [nn::Linear; 3],
}

impl std::fmt::Debug for Vgg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let convs = self.features.iter().filter(|l| matches!(l, VggFeature::Conv(..))).count();
        let bn = self.features.iter().any(|l| matches!(l, VggFeature::Conv(layers) if layers.1.is_some()));
        f.debug_struct("Vgg").field("convolutions", &convs).field("batch_norm", &bn).finish()
    }
}

impl Vgg {
    /// `blocks`: the output channels of each block's convolutions; a pool ends every block.
    fn new(p: &nn::Path, blocks: &[&[i64]], num_classes: i64, batch_norm: bool) -> Vgg {
        let f = p / "features";
        let mut features = Vec::new();
        // Index of the next layer in torchvision's `features` Sequential.
        let mut index = 0;
        let mut c_in = 3;
        for block in blocks {
            for &c_out in *block {
                let config = nn::ConvConfig { padding: 1, ..Default::default() };
                let conv = nn::conv2d(&f / index.to_string(), c_in, c_out, 3, config);
                let bn = batch_norm.then(|| nn::batch_norm2d(&f / (index + 1).to_string(), c_out, Default::default()));
                index += if batch_norm { 3 } else { 2 };
                features.push(VggFeature::Conv(Box::new((conv, bn))));
                c_in = c_out;
            }
            features.push(VggFeature::Pool);
            index += 1;
        }
        let c = p / "classifier";
        let classifier = [
            nn::linear(&c / "0", 512 * 7 * 7, 4096, Default::default()),
            nn::linear(&c / "3", 4096, 4096, Default::default()),
            nn::linear(&c / "6", 4096, num_classes, Default::default()),
        ];
        Vgg { features, classifier }
    }

    /// The layers of tch's `SequentialT`, in its order: each convolution, batch norm and ReLU,
    /// the pools, then the flattening, the classifier's linears, ReLUs and dropouts.
    fn layers(&self) -> Vec<VggLayer<'_>> {
        let mut layers = Vec::with_capacity(3 * self.features.len() + 8);
        for feature in &self.features {
            match feature {
                VggFeature::Conv(conv) => {
                    layers.push(VggLayer::Conv(&conv.0));
                    layers.extend(conv.1.as_ref().map(VggLayer::BatchNorm));
                    layers.push(VggLayer::Relu);
                }
                VggFeature::Pool => layers.push(VggLayer::Pool),
            }
        }
        let [fc1, fc2, fc3] = &self.classifier;
        layers.push(VggLayer::Flatten);
        for fc in [fc1, fc2] {
            layers.extend([VggLayer::Linear(fc), VggLayer::Relu, VggLayer::Dropout]);
        }
        layers.push(VggLayer::Linear(fc3));
        layers
    }

    /// The model on `xs` (`[N, 3, 224, 224]`), written once for tensors and lazy tensors.
    pub fn forward_t<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
        nn::Linear: Layer<T>,
    {
        // Each output let go as the next is made (the eager model's memory, as tch's).
        let layers = self.layers();
        let (first, rest) = layers.split_first().expect("a VGG has layers");
        rest.iter().fold(first.forward(xs, train), |x, layer| layer.forward(&x, train))
    }

    /// Every layer's output up to the `n`th (all for `None`), as tch's `SequentialT::forward_all_t`
    /// on tch's VGG, whose layers these are in its order (convolutions, batch norms, ReLUs and
    /// pools, then the classifier's): tch-rs's neural style transfer reads `[0, 2, 5, 7, 10]` of
    /// `vgg16`, its convolutions' outputs. The first layer runs whatever `n` is.
    pub fn forward_all_t<T: TensorOps>(&self, xs: &T, train: bool, n: Option<usize>) -> Vec<T>
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
        nn::Linear: Layer<T>,
    {
        let layers = self.layers();
        let n = n.unwrap_or(layers.len()).clamp(1, layers.len());
        let mut outputs: Vec<T> = Vec::with_capacity(n);
        for layer in &layers[..n] {
            let x = layer.forward(outputs.last().unwrap_or(xs), train);
            outputs.push(x);
        }
        outputs
    }
}

/// One layer of tch's VGG `SequentialT`.
enum VggLayer<'a> {
    Conv(&'a nn::Conv2D),
    BatchNorm(&'a nn::BatchNorm),
    Relu,
    Pool,
    Flatten,
    Linear(&'a nn::Linear),
    Dropout,
}

impl VggLayer<'_> {
    fn forward<T: TensorOps>(&self, x: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
        nn::Linear: Layer<T>,
    {
        match self {
            VggLayer::Conv(conv) => x.apply(*conv),
            VggLayer::BatchNorm(bn) => x.apply_t(*bn, train),
            VggLayer::Relu => x.relu(),
            VggLayer::Pool => x.max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false),
            VggLayer::Flatten => x.flatten(1, -1),
            VggLayer::Linear(fc) => x.apply(*fc),
            VggLayer::Dropout => x.dropout(0.5, train),
        }
    }
}

/// An AlexNet as tch's `alexnet`: its layout and variable names (`features.{0,3,6,8,10}`,
/// `classifier.{1,4,6}`), and its second convolution (stride 2, padding 1, where torchvision's
/// has stride 1, padding 2), so outputs equal tch's on the same weights. Inputs of at least
/// about 100×100 (the features are pooled to 6×6 at the end).
pub struct AlexNet {
    convs: [nn::Conv2D; 5],
    classifier: [nn::Linear; 3],
}

impl std::fmt::Debug for AlexNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlexNet").finish_non_exhaustive()
    }
}

impl AlexNet {
    fn new(p: &nn::Path, num_classes: i64) -> AlexNet {
        let f = p / "features";
        // (index, in, out, kernel, padding, stride)
        let shapes = [
            (0, 3, 64, 11, 2, 4),
            (3, 64, 192, 5, 1, 2),
            (6, 192, 384, 3, 1, 1),
            (8, 384, 256, 3, 1, 1),
            (10, 256, 256, 3, 1, 1),
        ];
        let convs = shapes.map(|(i, c_in, c_out, k, padding, stride)| {
            nn::conv2d(&f / i.to_string(), c_in, c_out, k, nn::ConvConfig { stride, padding, ..Default::default() })
        });
        let c = p / "classifier";
        let classifier = [
            nn::linear(&c / "1", 256 * 6 * 6, 4096, Default::default()),
            nn::linear(&c / "4", 4096, 4096, Default::default()),
            nn::linear(&c / "6", 4096, num_classes, Default::default()),
        ];
        AlexNet { convs, classifier }
    }

    /// The model on `xs` (`[N, 3, H, W]`), written once for tensors and lazy tensors.
    pub fn forward_t<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::Linear: Layer<T>,
    {
        let pool = |h: T| h.max_pool2d([3, 3], [2, 2], [0, 0], [1, 1], false);
        let [c1, c2, c3, c4, c5] = &self.convs;
        let h = pool(xs.apply(c1).relu());
        let h = pool(h.apply(c2).relu());
        let h = h.apply(c3).relu().apply(c4).relu();
        let h = pool(h.apply(c5).relu()).adaptive_avg_pool2d([6, 6]).flatten(1, -1);
        let [fc1, fc2, fc3] = &self.classifier;
        let h = h.dropout(0.5, train).apply(fc1).relu();
        h.dropout(0.5, train).apply(fc2).relu().apply(fc3)
    }
}

both_modules!(ResNet, Vgg, AlexNet, MobileNetV2, EfficientNet);

/// A convolution, its batch norm and a ReLU6, under `p/0` and `p/1` (padding keeps the size).
#[derive(Debug)]
struct ConvBnRelu6 {
    conv: nn::Conv2D,
    bn: nn::BatchNorm,
}

impl ConvBnRelu6 {
    fn new(p: nn::Path, c_in: i64, c_out: i64, ksize: i64, stride: i64, groups: i64) -> Self {
        let config = nn::ConvConfig { stride, padding: (ksize - 1) / 2, groups, bias: false, ..Default::default() };
        ConvBnRelu6 {
            conv: nn::conv2d(&p / 0, c_in, c_out, ksize, config),
            bn: nn::batch_norm2d(&p / 1, c_out, Default::default()),
        }
    }

    fn forward<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
    {
        xs.apply(&self.conv).apply_t(&self.bn, train).relu6()
    }
}

/// MobileNet-V2's inverted residual: a 1×1 expansion (unless the ratio is 1), a 3×3 depthwise
/// convolution, a linear 1×1 projection; the input is added back when the shape allows.
#[derive(Debug)]
struct InvertedResidual {
    expand: Option<ConvBnRelu6>,
    depthwise: ConvBnRelu6,
    project: nn::Conv2D,
    bn: nn::BatchNorm,
    residual: bool,
}

impl InvertedResidual {
    fn new(p: nn::Path, c_in: i64, c_out: i64, stride: i64, ratio: i64) -> Self {
        let hidden = ratio * c_in;
        let expand = (ratio != 1).then(|| ConvBnRelu6::new(&p / 0, c_in, hidden, 1, 1, 1));
        let at = i64::from(ratio != 1);
        InvertedResidual {
            expand,
            depthwise: ConvBnRelu6::new(&p / at, hidden, hidden, 3, stride, hidden),
            project: nn::conv2d(&p / (at + 1), hidden, c_out, 1, nn::ConvConfig { bias: false, ..Default::default() }),
            bn: nn::batch_norm2d(&p / (at + 2), c_out, Default::default()),
            residual: stride == 1 && c_in == c_out,
        }
    }

    fn forward<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
    {
        let h = match &self.expand {
            Some(expand) => self.depthwise.forward(&expand.forward(xs, train), train),
            None => self.depthwise.forward(xs, train),
        };
        let h = h.apply(&self.project).apply_t(&self.bn, train);
        if self.residual {
            xs.add(&h)
        } else {
            h
        }
    }
}

/// MobileNet-V2 as tch's `mobilenet::v2`: its layout and variable names (`features.0`,
/// `features.N.conv.M`, `classifier.1`); ReLU6 where tch writes `relu().clamp_max(6)` (the same
/// values), and the spatial mean in the input's kind.
pub struct MobileNetV2 {
    stem: ConvBnRelu6,
    blocks: Vec<InvertedResidual>,
    head: ConvBnRelu6,
    classifier: nn::Linear,
}

impl std::fmt::Debug for MobileNetV2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MobileNetV2").field("blocks", &self.blocks.len()).finish_non_exhaustive()
    }
}

impl MobileNetV2 {
    fn new(p: &nn::Path, num_classes: i64) -> MobileNetV2 {
        // (expansion ratio, output channels, repeats, first stride): the paper's table 2.
        const SETTINGS: [(i64, i64, i64, i64); 7] =
            [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)];
        let f = p / "features";
        let stem = ConvBnRelu6::new(&f / 0, 3, 32, 3, 2, 1);
        let (mut c_in, mut index) = (32, 1);
        let mut blocks = Vec::new();
        for (ratio, c_out, repeats, stride) in SETTINGS {
            for i in 0..repeats {
                let stride = if i == 0 { stride } else { 1 };
                blocks.push(InvertedResidual::new(&f / index / "conv", c_in, c_out, stride, ratio));
                c_in = c_out;
                index += 1;
            }
        }
        let head = ConvBnRelu6::new(&f / index, c_in, 1280, 1, 1, 1);
        let classifier = nn::linear(p / "classifier" / 1, 1280, num_classes, Default::default());
        MobileNetV2 { stem, blocks, head, classifier }
    }

    /// The model on `xs` (`[N, 3, H, W]`), written once for tensors and lazy tensors.
    pub fn forward_t<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
        nn::Linear: Layer<T>,
    {
        let mut h = self.stem.forward(xs, train);
        for block in &self.blocks {
            h = block.forward(&h, train);
        }
        let h = self.head.forward(&h, train).mean_dim([2, 3], false, None);
        h.dropout(0.2, train).apply(&self.classifier)
    }
}

/// MobileNet-V2 (tch's `mobilenet::v2`).
pub fn mobilenet_v2(p: &nn::Path, num_classes: i64) -> MobileNetV2 {
    MobileNetV2::new(p, num_classes)
}

const VGG11: &[&[i64]] = &[&[64], &[128], &[256, 256], &[512, 512], &[512, 512]];
const VGG13: &[&[i64]] = &[&[64, 64], &[128, 128], &[256, 256], &[512, 512], &[512, 512]];
const VGG16: &[&[i64]] = &[&[64, 64], &[128, 128], &[256, 256, 256], &[512, 512, 512], &[512, 512, 512]];
const VGG19: &[&[i64]] = &[&[64, 64], &[128, 128], &[256, 256, 256, 256], &[512, 512, 512, 512], &[512, 512, 512, 512]];

/// VGG-11 (tch's `vgg11`).
pub fn vgg11(p: &nn::Path, num_classes: i64) -> Vgg {
    Vgg::new(p, VGG11, num_classes, false)
}

/// VGG-11 with batch norm (tch's `vgg11_bn`).
pub fn vgg11_bn(p: &nn::Path, num_classes: i64) -> Vgg {
    Vgg::new(p, VGG11, num_classes, true)
}

/// VGG-13 (tch's `vgg13`).
pub fn vgg13(p: &nn::Path, num_classes: i64) -> Vgg {
    Vgg::new(p, VGG13, num_classes, false)
}

/// VGG-16 (tch's `vgg16`).
pub fn vgg16(p: &nn::Path, num_classes: i64) -> Vgg {
    Vgg::new(p, VGG16, num_classes, false)
}

/// VGG-16 with batch norm (tch's `vgg16_bn`).
pub fn vgg16_bn(p: &nn::Path, num_classes: i64) -> Vgg {
    Vgg::new(p, VGG16, num_classes, true)
}

/// VGG-19 (tch's `vgg19`).
pub fn vgg19(p: &nn::Path, num_classes: i64) -> Vgg {
    Vgg::new(p, VGG19, num_classes, false)
}

/// AlexNet (tch's `alexnet`).
pub fn alexnet(p: &nn::Path, num_classes: i64) -> AlexNet {
    AlexNet::new(p, num_classes)
}

/// A convolution with TensorFlow's "same" padding (zeros, the odd one after), as EfficientNet's
/// weights expect; then a batch norm (EfficientNet's epsilon and momentum) and, unless it is a
/// projection, swish. Under `p/0` and `p/1`.
#[derive(Debug)]
struct SameConvBn {
    conv: nn::Conv2D,
    kernel: i64,
    stride: i64,
    bn: nn::BatchNorm,
    swish: bool,
}

/// `x · sigmoid(x)`, as tch's EfficientNet computes it.
fn swish<T: TensorOps>(x: &T) -> T {
    x.mul(&x.sigmoid())
}

/// Pads `x` for a "same" convolution of `kernel` and `stride` (nothing when none is needed).
fn same_padding<T: TensorOps>(x: &T, kernel: i64, stride: i64) -> Option<T> {
    let size = x.size();
    let pad = |input: i64| (((input + stride - 1) / stride - 1) * stride + kernel - input).max(0);
    let (ph, pw) = (pad(size[2]), pad(size[3]));
    (ph > 0 || pw > 0).then(|| x.pad([pw / 2, pw - pw / 2, ph / 2, ph - ph / 2], "constant", Some(0.0)))
}

impl SameConvBn {
    fn new(p: nn::Path, c_in: i64, c_out: i64, kernel: i64, stride: i64, groups: i64, swish: bool) -> Self {
        let config = nn::ConvConfig { stride, groups, bias: false, ..Default::default() };
        let bn = nn::BatchNormConfig { momentum: 0.01, eps: 1e-3, ..Default::default() };
        SameConvBn {
            conv: nn::conv2d(&p / 0, c_in, c_out, kernel, config),
            kernel,
            stride,
            bn: nn::batch_norm2d(&p / 1, c_out, bn),
            swish,
        }
    }

    fn forward<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
    {
        let h = match same_padding(xs, self.kernel, self.stride) {
            Some(padded) => padded.apply(&self.conv),
            None => xs.apply(&self.conv),
        };
        let h = h.apply_t(&self.bn, train);
        if self.swish {
            swish(&h)
        } else {
            h
        }
    }
}

/// EfficientNet's mobile inverted bottleneck: expansion (unless the ratio is 1), a depthwise
/// convolution, squeeze-and-excitation, a linear projection; the input added back when the
/// shape allows.
#[derive(Debug)]
struct MbConv {
    expand: Option<SameConvBn>,
    depthwise: SameConvBn,
    squeeze: (nn::Conv2D, nn::Conv2D),
    project: SameConvBn,
    residual: bool,
}

impl MbConv {
    fn new(p: nn::Path, ratio: i64, kernel: i64, stride: i64, c_in: i64, c_out: i64) -> Self {
        let p = &p / "block";
        let hidden = ratio * c_in;
        let expand = (ratio != 1).then(|| SameConvBn::new(&p / 0, c_in, hidden, 1, 1, 1, true));
        let at = i64::from(ratio != 1);
        let squeezed = (c_in / 4).max(1);
        let se = &p / (at + 1);
        MbConv {
            expand,
            depthwise: SameConvBn::new(&p / at, hidden, hidden, kernel, stride, hidden, true),
            squeeze: (
                nn::conv2d(&se / "fc1", hidden, squeezed, 1, Default::default()),
                nn::conv2d(&se / "fc2", squeezed, hidden, 1, Default::default()),
            ),
            project: SameConvBn::new(&p / (at + 2), hidden, c_out, 1, 1, 1, false),
            residual: stride == 1 && c_in == c_out,
        }
    }

    fn forward<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
    {
        let h = match &self.expand {
            Some(expand) => self.depthwise.forward(&expand.forward(xs, train), train),
            None => self.depthwise.forward(xs, train),
        };
        let (fc1, fc2) = &self.squeeze;
        let scale = swish(&h.adaptive_avg_pool2d([1, 1]).apply(fc1)).apply(fc2).sigmoid();
        let h = self.project.forward(&scale.mul(&h), train);
        if self.residual {
            h.add(xs)
        } else {
            h
        }
    }
}

/// EfficientNet-B0 as tch's `efficientnet::b0`: its layout and variable names (`features.0`,
/// `features.S.R.block.M`, `classifier.1`), "same" padding and swish.
pub struct EfficientNet {
    stem: SameConvBn,
    blocks: Vec<MbConv>,
    head: SameConvBn,
    classifier: nn::Linear,
}

impl std::fmt::Debug for EfficientNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EfficientNet").field("blocks", &self.blocks.len()).finish_non_exhaustive()
    }
}

impl EfficientNet {
    fn b0(p: &nn::Path, num_classes: i64) -> EfficientNet {
        // (expansion ratio, kernel, first stride, input channels, output channels, repeats).
        const STAGES: [(i64, i64, i64, i64, i64, i64); 7] = [
            (1, 3, 1, 32, 16, 1),
            (6, 3, 2, 16, 24, 2),
            (6, 5, 2, 24, 40, 2),
            (6, 3, 2, 40, 80, 3),
            (6, 5, 1, 80, 112, 3),
            (6, 5, 2, 112, 192, 4),
            (6, 3, 1, 192, 320, 1),
        ];
        let f = p / "features";
        let stem = SameConvBn::new(&f / 0, 3, 32, 3, 2, 1, true);
        let mut blocks = Vec::new();
        for (stage, (ratio, kernel, stride, c_in, c_out, repeats)) in STAGES.into_iter().enumerate() {
            for r in 0..repeats {
                let (c_in, stride) = if r == 0 { (c_in, stride) } else { (c_out, 1) };
                blocks.push(MbConv::new(&f / (stage + 1) / r, ratio, kernel, stride, c_in, c_out));
            }
        }
        let head = SameConvBn::new(&f / (STAGES.len() + 1), 320, 1280, 1, 1, 1, true);
        let classifier = nn::linear(p / "classifier" / 1, 1280, num_classes, Default::default());
        EfficientNet { stem, blocks, head, classifier }
    }

    /// The model on `xs` (`[N, 3, H, W]`), written once for tensors and lazy tensors.
    pub fn forward_t<T: TensorOps>(&self, xs: &T, train: bool) -> T
    where
        nn::Conv2D: Layer<T>,
        nn::BatchNorm: LayerT<T>,
        nn::Linear: Layer<T>,
    {
        let mut h = self.stem.forward(xs, train);
        for block in &self.blocks {
            h = block.forward(&h, train);
        }
        let h = self.head.forward(&h, train).adaptive_avg_pool2d([1, 1]);
        h.squeeze_dim(-1).squeeze_dim(-1).apply(&self.classifier)
    }
}

/// EfficientNet-B0 (tch's `efficientnet::b0`).
pub fn efficientnet_b0(p: &nn::Path, num_classes: i64) -> EfficientNet {
    EfficientNet::b0(p, num_classes)
}
