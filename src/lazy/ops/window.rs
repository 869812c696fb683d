//! Windows over spatial dimensions: convolutions (1-D, 2-D, transposed 2-D), 2-D pooling,
//! upsampling, pixel shuffles, and sliding windows along one dimension (`unfold`).

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{combine_flows, same_device, unary_flow, Linearity, Record};
use super::{arg, floating, requires, same_kind, shape_err};
use crate::dims::Dims;
use crate::lazy::error::LazyError;
use crate::lazy::facts::OpFacts;
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{Convolution, Flow, KernelCall, Meta, Node, Operation, Run, RunCx};
use crate::lazy::int_list::IntList;
use crate::lazy::shape;
use crate::lazy::size::Elements;
use crate::lazy::LazyTensor;

/// A convolution over `D` spatial dimensions (`conv1d`, `conv2d`, `conv3d`). Operands: x,
/// weight, optional bias.
pub(crate) struct Conv<const D: usize> {
    stride: [i64; D],
    padding: [i64; D],
    dilation: [i64; D],
    groups: i64,
}

/// A convolution's settings, hashed: what its `OpFacts::sizing` says.
fn settings_hash(lists: &[&[i64]], groups: i64) -> u64 {
    let mut h = crate::hash::mix(groups as u64);
    for list in lists {
        for &v in *list {
            h = crate::hash::mix(h ^ v as u64);
        }
        h = crate::hash::mix(h ^ 0x5e77);
    }
    h
}

/// A convolution's (or a transposed one's) kernel call on its operands.
fn convolution<'a>(
    inputs: &'a [Rc<Node>],
    output: &'a Meta,
    [stride, padding, dilation]: [&'a [i64]; 3],
    groups: i64,
    transposed: bool,
) -> KernelCall<'a> {
    KernelCall::Convolution(Convolution {
        input: &inputs[0].meta,
        weight: &inputs[1].meta,
        output,
        stride,
        padding,
        dilation,
        groups,
        transposed,
        bias: inputs.len() > 2,
        input_grad: requires(inputs, 0),
        bias_grad_only: output.requires_grad && inputs.len() > 2 && requires(inputs, 2) && !requires(inputs, 1),
    })
}

/// Input and weight, whichever of them requires a gradient: autograd's `convolution` has one
/// formula for input, weight and bias, and saves every operand it reads (libtorch guards a
/// saved operand only where one input's formula alone reads it). A frozen layer keeps its
/// input as a trained one does: planned otherwise, a GAN's generator step through its frozen
/// discriminator was 23% under.
fn conv_saves(i: usize, _inputs: &[Rc<Node>]) -> bool {
    i < 2
}

impl<const D: usize> Operation for Conv<D> {
    fn name(&self) -> &'static str {
        match D {
            1 => "conv1d",
            2 => "conv2d",
            _ => "conv3d",
        }
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        calls.push(convolution(inputs, meta, [&self.stride, &self.padding, &self.dilation], self.groups, false));
        // A batched one's bias gradient: the output gradient summed over every dimension but
        // the channels.
        if meta.shape.len() == D + 2 && requires(inputs, 2) && meta.requires_grad {
            let mask = shape::dims_mask((0..meta.shape.len()).filter(|&d| d != 1));
            calls.push(KernelCall::Reduction { of: meta, mask, backward: true });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| conv_saves(i, inputs))
            .grad_dense(true)
            .grad_contiguous(true)
            // Padding and dilation pick kernels (and their scratch) that the shapes do not show: a
            // 3×3 padded 1 and one padded 2 and dilated 2 map the same sizes.
            .sizing(settings_hash(&[&self.stride, &self.padding, &self.dilation], self.groups))
    }
}

impl<const D: usize> Run for Conv<D> {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (x, weight, bias) = (ins[0], ins[1], ins.get(2).copied());
        let (stride, padding, dilation) = (&self.stride[..], &self.padding[..], &self.dilation[..]);
        match D {
            1 => x.f_conv1d(weight, bias, stride, padding, dilation, self.groups),
            2 => x.f_conv2d(weight, bias, stride, padding, dilation, self.groups),
            _ => x.f_conv3d(weight, bias, stride, padding, dilation, self.groups),
        }
    }
}

/// A 2-D transposed convolution. Operands: x, weight (`[C_in, C_out / groups, kh, kw]`),
/// optional bias.
pub(crate) struct ConvTranspose2d {
    stride: [i64; 2],
    padding: [i64; 2],
    output_padding: [i64; 2],
    dilation: [i64; 2],
    groups: i64,
}

impl Operation for ConvTranspose2d {
    fn name(&self) -> &'static str {
        "conv_transpose2d"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        calls.push(convolution(inputs, meta, [&self.stride, &self.padding, &self.dilation], self.groups, true));
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| conv_saves(i, inputs))
            .grad_dense(true)
            .sizing(settings_hash(&[&self.stride, &self.padding, &self.output_padding, &self.dilation], self.groups))
    }
}

impl Run for ConvTranspose2d {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (x, weight, bias) = (ins[0], ins[1], ins.get(2).copied());
        x.f_conv_transpose2d(weight, bias, self.stride, self.padding, self.output_padding, self.groups, self.dilation)
    }
}

/// 2-D or 3-D max pooling; keeps the indices of the maxima for its backward.
pub(crate) struct MaxPool<const D: usize> {
    kernel: [i64; D],
    stride: [i64; D],
    padding: [i64; D],
    dilation: [i64; D],
    ceil_mode: bool,
}

impl<const D: usize> Operation for MaxPool<D> {
    fn name(&self) -> &'static str {
        if D == 3 {
            "max_pool3d"
        } else {
            "max_pool2d"
        }
    }

    fn kernels<'a>(&'a self, _inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // One int64 index per output element.
        calls.push(KernelCall::Keeps { elements: meta.elements(), kind: Kind::Int64 });
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 0).grad_dense(true)
    }
}

impl<const D: usize> Run for MaxPool<D> {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (k, s, p, d) = (&self.kernel[..], &self.stride[..], &self.padding[..], &self.dilation[..]);
        if D == 3 {
            ins[0].f_max_pool3d(k, s, p, d, self.ceil_mode)
        } else {
            ins[0].f_max_pool2d(k, s, p, d, self.ceil_mode)
        }
    }
}

/// 2-D or 3-D average pooling.
pub(crate) struct AvgPool<const D: usize> {
    kernel: [i64; D],
    stride: [i64; D],
    padding: [i64; D],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: Option<i64>,
}

impl<const D: usize> Operation for AvgPool<D> {
    fn name(&self) -> &'static str {
        if D == 3 {
            "avg_pool3d"
        } else {
            "avg_pool2d"
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 0).grad_dense(true)
    }
}

impl<const D: usize> Run for AvgPool<D> {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let AvgPool { kernel, stride, padding, ceil_mode, count_include_pad, divisor_override } = self;
        let (k, s, p) = (&kernel[..], &stride[..], &padding[..]);
        if D == 3 {
            ins[0].f_avg_pool3d(k, s, p, *ceil_mode, *count_include_pad, *divisor_override)
        } else {
            ins[0].f_avg_pool2d(k, s, p, *ceil_mode, *count_include_pad, *divisor_override)
        }
    }
}

/// 2-D adaptive average pooling to `output` (`[h, w]`).
pub(crate) struct AdaptiveAvgPool2d {
    output: [i64; 2],
}

impl Operation for AdaptiveAvgPool2d {
    fn name(&self) -> &'static str {
        "adaptive_avg_pool2d"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| i == 0)
    }
}

impl Run for AdaptiveAvgPool2d {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_adaptive_avg_pool2d(self.output)
    }
}

/// Nearest-neighbour upsampling to `output`; its backward needs only the sizes.
pub(crate) struct UpsampleNearest2d {
    output: [i64; 2],
    /// `scales_h`, `scales_w` as given (libtorch's source step when set).
    scales: [Option<f64>; 2],
}

impl Operation for UpsampleNearest2d {
    fn name(&self) -> &'static str {
        "upsample_nearest2d"
    }
}

impl Run for UpsampleNearest2d {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_upsample_nearest2d(self.output, self.scales[0], self.scales[1])
    }
}

/// Bilinear upsampling to `output`; scales, when given, change how output positions map onto
/// the input (as in libtorch). Its backward needs only the sizes.
pub(crate) struct UpsampleBilinear2d {
    output: [i64; 2],
    align_corners: bool,
    scales: [Option<f64>; 2],
}

impl Operation for UpsampleBilinear2d {
    fn name(&self) -> &'static str {
        "upsample_bilinear2d"
    }
}

impl Run for UpsampleBilinear2d {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_upsample_bilinear2d(self.output, self.align_corners, self.scales[0], self.scales[1])
    }
}

/// Nearest-neighbour upsampling of `[N, C, L]` to `output` entries; its backward needs only
/// the sizes.
pub(crate) struct UpsampleNearest1d {
    output: i64,
    /// `scales` as given (libtorch's source step when set).
    scales: Option<f64>,
}

impl Operation for UpsampleNearest1d {
    fn name(&self) -> &'static str {
        "upsample_nearest1d"
    }
}

impl Run for UpsampleNearest1d {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_upsample_nearest1d([self.output], self.scales)
    }
}

/// `pixel_shuffle` (`[.., C·r², H, W]` to `[.., C, H·r, W·r]`) or its inverse `pixel_unshuffle`:
/// a copy with the entries moved; its backward is the other one, on the gradient (nothing
/// kept). libtorch's CPU kernel copies a strided input contiguous first.
pub(crate) struct PixelShuffle {
    factor: i64,
    unshuffle: bool,
}

impl Operation for PixelShuffle {
    fn name(&self) -> &'static str {
        if self.unshuffle {
            "pixel_unshuffle"
        } else {
            "pixel_shuffle"
        }
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], _meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        let x = &inputs[0].meta;
        if !shape::is_contiguous(&x.shape, &x.strides) {
            calls.push(KernelCall::Temporaries { forward: x.elements(), backward: Elements::ZERO });
        }
    }
}

impl Run for PixelShuffle {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        if self.unshuffle {
            ins[0].f_pixel_unshuffle(self.factor)
        } else {
            ins[0].f_pixel_shuffle(self.factor)
        }
    }
}

/// Every window of `size` entries along `dim`, `step` apart, as a new last dimension: a view
/// (windows may overlap). Its gradient is a new tensor of the input's shape, the windows'
/// gradients added where they overlap.
pub(crate) struct Unfold {
    dim: i64,
    size: i64,
    step: i64,
}

impl Operation for Unfold {
    fn name(&self) -> &'static str {
        "unfold"
    }
}

impl Run for Unfold {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_unfold(self.dim, self.size, self.step)
    }
}

/// Output shape of 3-D pooling of a `[C, D, H, W]` or `[N, C, D, H, W]` input, as libtorch
/// checks it (`dilation` all 1 for average pooling, which also takes no input smaller than its
/// kernel, padded or not).
/// A pooling window's kernel, stride (the kernel's where empty) and padding, `D` values each
/// (one value means it along every dimension), as libtorch reads them; an average pooling's
/// divisor (`Some(..)`) may not be 0.
#[allow(clippy::type_complexity)]
fn window<const D: usize>(
    kernel: &impl IntList,
    stride: &impl IntList,
    padding: &impl IntList,
    divisor_override: Option<Option<i64>>,
) -> Result<([i64; D], [i64; D], [i64; D]), String> {
    let kernel = shape::spatial::<D>(kernel.as_slice(), "kernel_size")?;
    let stride = match stride.as_slice() {
        [] => kernel,
        s => shape::spatial::<D>(s, "stride")?,
    };
    let padding = shape::spatial::<D>(padding.as_slice(), "padding")?;
    if divisor_override == Some(Some(0)) {
        return Err("divisor must be not zero".into());
    }
    Ok((kernel, stride, padding))
}

fn pool3d_shape(
    input: &[i64],
    kernel: [i64; 3],
    stride: [i64; 3],
    padding: [i64; 3],
    dilation: [i64; 3],
    ceil_mode: bool,
    average: bool,
) -> Result<Vec<i64>, String> {
    let n = input.len();
    if n != 4 && n != 5 {
        return Err(format!("expected a 4-D or 5-D input, got {n} dims"));
    }
    if kernel.iter().chain(&stride).chain(&dilation).any(|&v| v < 1) {
        return Err(format!("kernel {kernel:?}, stride {stride:?} and dilation {dilation:?} must be positive"));
    }
    if input[n - 4..].contains(&0) {
        return Err("expected non-empty channels and spatial dimensions".into());
    }
    if average && (0..3).any(|i| input[n - 3 + i] < kernel[i]) {
        return Err(format!("input image {:?} smaller than kernel size {kernel:?}", &input[n - 3..]));
    }
    let mut out = input.to_vec();
    for i in 0..3 {
        if padding[i] < 0 || padding[i] > kernel[i] / 2 {
            return Err(format!(
                "pad should be at most half of effective kernel size, got padding {padding:?} for kernel {kernel:?}"
            ));
        }
        let size = shape::window_out(input[n - 3 + i], kernel[i], padding[i], stride[i], dilation[i], ceil_mode);
        if size < 1 {
            return Err(format!("output size is too small ({size}) for input {:?}", &input[n - 3..]));
        }
        out[n - 3 + i] = size;
    }
    Ok(out)
}

/// The one value of a 1-D window setting (`[k]` or `k`); `default` for an empty list (a
/// stride that means the kernel size).
fn one_of(op: &str, shape: &[i64], values: &[i64], what: &str, default: Option<i64>) -> Result<i64, LazyError> {
    match (values, default) {
        ([v], _) => Ok(*v),
        ([], Some(d)) => Ok(d),
        _ => Err(arg(op, shape, format!("{what} must be a single value, got {values:?}"))),
    }
}

#[toma_macros::tensor_methods(WindowOps, "Windows over spatial dimensions: convolutions, pooling, upsampling (a family of [`TensorOps`](crate::lazy::TensorOps)).")]
impl LazyTensor {
    // -----------------------------------------------------------------------------------------
    // Convolutions

    /// 1-D convolution, as tch's `conv1d`: `self` is `[N, C, L]` (or `[C, L]`), `weight`
    /// `[O, C / groups, k]`; `stride`, `padding` and `dilation` take 1 value.
    ///
    /// # Errors
    /// As [`f_conv2d`](Self::f_conv2d).
    #[allow(clippy::too_many_arguments)]
    pub fn f_conv1d(
        &self,
        #[fixed] weight: impl IntoLazy,
        #[fixed] bias: Option<impl IntoLazy>,
        stride: impl IntList,
        padding: impl IntList,
        dilation: impl IntList,
        groups: i64,
    ) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let (stride, padding, dilation) = (stride.as_slice(), padding.as_slice(), dilation.as_slice());
        self.convolution::<1>("conv1d", &w, b.as_ref(), [stride, padding, dilation], groups)
    }

    /// 2-D convolution, as tch's `conv2d`: `self` is `[N, C, H, W]` (or `[C, H, W]`), `weight`
    /// `[O, C / groups, kh, kw]`; `stride`, `padding` and `dilation` take 1 or 2 values.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when input and weight do not fit, [`LazyError::Argument`] for bad
    /// parameters, [`LazyError::Kind`], [`LazyError::Device`].
    #[allow(clippy::too_many_arguments)]
    pub fn f_conv2d(
        &self,
        #[fixed] weight: impl IntoLazy,
        #[fixed] bias: Option<impl IntoLazy>,
        stride: impl IntList,
        padding: impl IntList,
        dilation: impl IntList,
        groups: i64,
    ) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let (stride, padding, dilation) = (stride.as_slice(), padding.as_slice(), dilation.as_slice());
        self.convolution::<2>("conv2d", &w, b.as_ref(), [stride, padding, dilation], groups)
    }

    /// 3-D convolution, as tch's `conv3d`: `self` is `[N, C, D, H, W]` (or `[C, D, H, W]`),
    /// `weight` `[O, C / groups, kd, kh, kw]`; `stride`, `padding` and `dilation` take 1 or 3
    /// values.
    ///
    /// # Errors
    /// As [`f_conv2d`](Self::f_conv2d).
    #[allow(clippy::too_many_arguments)]
    pub fn f_conv3d(
        &self,
        #[fixed] weight: impl IntoLazy,
        #[fixed] bias: Option<impl IntoLazy>,
        stride: impl IntList,
        padding: impl IntList,
        dilation: impl IntList,
        groups: i64,
    ) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let (stride, padding, dilation) = (stride.as_slice(), padding.as_slice(), dilation.as_slice());
        self.convolution::<3>("conv3d", &w, b.as_ref(), [stride, padding, dilation], groups)
    }

    /// 2-D transposed convolution, as tch's `conv_transpose2d`: `self` is `[N, C_in, H, W]` (or
    /// `[C_in, H, W]`), `weight` `[C_in, C_out / groups, kh, kw]`, `bias` `[C_out]`; `stride`,
    /// `padding`, `output_padding` and `dilation` take 1 or 2 values. Each output side is
    /// `(in − 1)·stride − 2·padding + dilation·(k − 1) + output_padding + 1`.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when input, weight and bias do not fit, [`LazyError::Argument`] for
    /// bad parameters (an `output_padding` not below the stride or the dilation, an empty
    /// output), [`LazyError::Kind`], [`LazyError::Device`].
    #[allow(clippy::too_many_arguments)]
    pub fn f_conv_transpose2d(
        &self,
        #[fixed] weight: impl IntoLazy,
        #[fixed] bias: Option<impl IntoLazy>,
        stride: impl IntList,
        padding: impl IntList,
        output_padding: impl IntList,
        groups: i64,
        dilation: impl IntList,
    ) -> Result<LazyTensor, LazyError> {
        let name = "conv_transpose2d";
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let sx = &self.node().meta.shape;
        let a = |r: String| arg(name, sx, r);
        let stride = shape::spatial::<2>(stride.as_slice(), "stride").map_err(a)?;
        let padding = shape::spatial::<2>(padding.as_slice(), "padding").map_err(a)?;
        let output_padding = shape::spatial::<2>(output_padding.as_slice(), "output_padding").map_err(a)?;
        let dilation = shape::spatial::<2>(dilation.as_slice(), "dilation").map_err(a)?;
        if groups < 1
            || stride.iter().chain(&dilation).any(|&v| v < 1)
            || padding.iter().chain(&output_padding).any(|&v| v < 0)
        {
            return Err(a(format!(
                "groups, stride and dilation must be positive, padding and output_padding non-negative: \
                 groups {groups}, stride {stride:?}, padding {padding:?}, output_padding {output_padding:?}, dilation {dilation:?}"
            )));
        }
        if (0..2).any(|i| output_padding[i] >= stride[i].max(dilation[i])) {
            return Err(a(format!(
                "output padding must be smaller than either stride or dilation, got output_padding {output_padding:?}, stride {stride:?}, dilation {dilation:?}"
            )));
        }
        let sw = &w.node().meta.shape;
        let batched = sx.len() == 4;
        if !(batched || sx.len() == 3) || sw.len() != 4 {
            return Err(shape_err(name, sx, sw, "expected a 3-D or 4-D input and a 4-D weight"));
        }
        let c_in = sx[sx.len() - 3];
        if sw[0] != c_in || c_in % groups != 0 {
            return Err(shape_err(
                name,
                sx,
                sw,
                format!("the weight's first dimension must be the {c_in} input channels, divisible by groups {groups}"),
            ));
        }
        let c_out = sw[1] * groups;
        if let Some(b) = &b {
            if b.node().meta.shape != [c_out] {
                return Err(shape_err(name, sw, &b.node().meta.shape, format!("the bias must be [{c_out}]")));
            }
        }
        let spatial: Vec<i64> = (0..2)
            .map(|i| {
                let input = sx[sx.len() - 2 + i];
                (input - 1) * stride[i] - 2 * padding[i] + dilation[i] * (sw[2 + i] - 1) + output_padding[i] + 1
            })
            .collect();
        if spatial.iter().any(|&v| v < 1) {
            return Err(a(format!("the output would be empty: {spatial:?}")));
        }
        let out = if batched {
            [sx[0], c_out, spatial[0], spatial[1]].into()
        } else {
            [c_out, spatial[0], spatial[1]].into()
        };
        let op = ConvTranspose2d { stride, padding, output_padding, dilation, groups };
        self.record_convolution(name, &w, b.as_ref(), out, 2, op)
    }

    /// Records a convolution over `D` spatial dimensions.
    fn convolution<const D: usize>(
        &self,
        name: &'static str,
        w: &LazyTensor,
        b: Option<&LazyTensor>,
        [stride, padding, dilation]: [&[i64]; 3],
        groups: i64,
    ) -> Result<LazyTensor, LazyError> {
        let sx = &self.node().meta.shape;
        let a = |r: String| arg(name, sx, r);
        let stride = shape::spatial::<D>(stride, "stride").map_err(a)?;
        let padding = shape::spatial::<D>(padding, "padding").map_err(a)?;
        let dilation = shape::spatial::<D>(dilation, "dilation").map_err(a)?;
        let sw = &w.node().meta.shape;
        let out = shape::conv(sx, sw, b.map(|b| b.node().meta.shape.as_slice()), stride, padding, dilation, groups)
            .map_err(|r| shape_err(name, sx, sw, r))?;
        self.record_convolution(name, w, b, out, D, Conv::<D> { stride, padding, dilation, groups })
    }

    /// Records a convolution (plain or transposed) over `spatial` dimensions whose output shape
    /// is already checked: one device, floating kinds, and only a batched input's first
    /// dimension per-sample.
    fn record_convolution(
        &self,
        name: &'static str,
        w: &LazyTensor,
        b: Option<&LazyTensor>,
        out: Dims,
        spatial: usize,
        op: impl Operation + 'static,
    ) -> Result<LazyTensor, LazyError> {
        let x = self.node();
        let mut nodes = vec![x, w.node()];
        if let Some(b) = b {
            nodes.push(b.node());
        }
        let device = same_device(name, &nodes)?;
        floating(name, x)?;
        for p in &nodes[1..] {
            same_kind(name, x, p)?;
        }
        let batched = x.meta.shape.len() == spatial + 2;
        let mapped: Vec<Option<usize>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| n.meta.batch().filter(|bd| i == 0 && batched && bd.dim == 0).map(|_| 0))
            .collect();
        let flow = combine_flows(name, &nodes, &mapped, &out, Linearity::Nonlinear, false)?;
        let inputs = inputs_of(nodes);
        Ok(Record::new(op, inputs, out, x.meta.kind, device).flow(flow).finish())
    }

    // -----------------------------------------------------------------------------------------
    // Pooling

    /// 1-D max pooling over the last dimension of `[C, L]` or `[N, C, L]`, as tch's
    /// `max_pool1d` (an empty `stride` means the kernel size). Recorded as libtorch computes
    /// it with a gradient: a 2-D pooling of the `[.., 1, L]` view.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a list that is not one value, or what `max_pool2d` refuses.
    pub fn f_max_pool1d(
        &self,
        kernel: impl IntList,
        stride: impl IntList,
        padding: impl IntList,
        dilation: impl IntList,
        ceil_mode: bool,
    ) -> Result<LazyTensor, LazyError> {
        let name = "max_pool1d";
        let (k, st, p) = self.window_1d(name, kernel.as_slice(), stride.as_slice(), padding.as_slice())?;
        let d = one_of(name, &self.node().meta.shape, dilation.as_slice(), "dilation", None)?;
        self.pooled_1d(name)?.f_max_pool2d([1, k], [1, st], [0, p], [1, d], ceil_mode)?.f_squeeze_dim(-2)
    }

    /// 1-D average pooling over the last dimension, as tch's `avg_pool1d` (libtorch's own
    /// composite: a 2-D pooling of the `[.., 1, L]` view).
    ///
    /// # Errors
    /// As [`f_max_pool1d`](Self::f_max_pool1d).
    pub fn f_avg_pool1d(
        &self,
        kernel: impl IntList,
        stride: impl IntList,
        padding: impl IntList,
        ceil_mode: bool,
        count_include_pad: bool,
    ) -> Result<LazyTensor, LazyError> {
        let name = "avg_pool1d";
        let (k, st, p) = self.window_1d(name, kernel.as_slice(), stride.as_slice(), padding.as_slice())?;
        self.pooled_1d(name)?
            .f_avg_pool2d([1, k], [1, st], [0, p], ceil_mode, count_include_pad, None)?
            .f_squeeze_dim(-2)
    }

    /// 1-D adaptive average pooling to `output_size` entries, as tch's `adaptive_avg_pool1d`
    /// (libtorch's composite over the `[.., 1, L]` view).
    ///
    /// # Errors
    /// As [`f_max_pool1d`](Self::f_max_pool1d).
    pub fn f_adaptive_avg_pool1d(&self, output_size: impl IntList) -> Result<LazyTensor, LazyError> {
        let name = "adaptive_avg_pool1d";
        let o = one_of(name, &self.node().meta.shape, output_size.as_slice(), "output_size", None)?;
        self.pooled_1d(name)?.f_adaptive_avg_pool2d([1, o])?.f_squeeze_dim(-2)
    }

    /// A 1-D window's kernel, stride (the kernel's when empty) and padding, one value each.
    fn window_1d(
        &self,
        name: &str,
        kernel: &[i64],
        stride: &[i64],
        padding: &[i64],
    ) -> Result<(i64, i64, i64), LazyError> {
        let shape = &self.node().meta.shape;
        let k = one_of(name, shape, kernel, "kernel_size", None)?;
        Ok((k, one_of(name, shape, stride, "stride", Some(k))?, one_of(name, shape, padding, "padding", None)?))
    }

    /// The `[.., 1, L]` view a 1-D pooling runs on, for a 2-D or 3-D input.
    fn pooled_1d(&self, name: &str) -> Result<LazyTensor, LazyError> {
        let s = &self.node().meta.shape;
        if s.len() != 2 && s.len() != 3 {
            return Err(arg(name, s, format!("expected a 2-D or 3-D input, got {} dims", s.len())));
        }
        self.f_unsqueeze(-2)
    }

    /// 2-D max pooling, as tch's `max_pool2d` (an empty `stride` means the kernel size).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for parameters libtorch refuses (a padding over half the
    /// kernel, an output smaller than 1, ..).
    pub fn f_max_pool2d(
        &self,
        kernel: impl IntList,
        stride: impl IntList,
        padding: impl IntList,
        dilation: impl IntList,
        ceil_mode: bool,
    ) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let name = "max_pool2d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let (kernel, stride, padding) = window::<2>(&kernel, &stride, &padding, None).map_err(a)?;
        let dilation = shape::pair(dilation.as_slice(), "dilation").map_err(a)?;
        let out = shape::pool2d(&n.meta.shape, kernel, stride, padding, dilation, ceil_mode).map_err(a)?;
        let flow = self.pool_flow(name, &out)?;
        let op = MaxPool::<2> { kernel, stride, padding, dilation, ceil_mode };
        Ok(Record::new(op, inputs_of([n]), out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// 2-D average pooling, as tch's `avg_pool2d` (an empty `stride` means the kernel size).
    ///
    /// # Errors
    /// As [`f_max_pool2d`](Self::f_max_pool2d); also a `divisor_override` of 0.
    #[allow(clippy::too_many_arguments)]
    pub fn f_avg_pool2d(
        &self,
        kernel: impl IntList,
        stride: impl IntList,
        padding: impl IntList,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: impl Into<Option<i64>>,
    ) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let name = "avg_pool2d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let divisor_override = divisor_override.into();
        let (kernel, stride, padding) = window::<2>(&kernel, &stride, &padding, Some(divisor_override)).map_err(a)?;
        floating(name, n)?;
        let out = shape::pool2d(&n.meta.shape, kernel, stride, padding, [1, 1], ceil_mode).map_err(a)?;
        let flow = self.pool_flow(name, &out)?;
        let op = AvgPool::<2> { kernel, stride, padding, ceil_mode, count_include_pad, divisor_override };
        Ok(Record::new(op, inputs_of([n]), out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// 2-D max pooling over `ksize × ksize` windows, stride `ksize`, no padding, as tch's
    /// `max_pool2d_default`.
    ///
    /// # Errors
    /// As [`f_max_pool2d`](Self::f_max_pool2d).
    #[lazy_only]
    pub fn f_max_pool2d_default(&self, ksize: i64) -> Result<LazyTensor, LazyError> {
        self.f_max_pool2d([ksize, ksize], [ksize, ksize], [0, 0], [1, 1], false)
    }

    /// 2-D pooling over `ksize × ksize` windows, stride `ksize`, no padding, exactly as tch's
    /// `avg_pool2d_default`, which passes a divisor override of 1: each window's *sum*.
    ///
    /// # Errors
    /// As [`f_avg_pool2d`](Self::f_avg_pool2d).
    #[lazy_only]
    pub fn f_avg_pool2d_default(&self, ksize: i64) -> Result<LazyTensor, LazyError> {
        self.f_avg_pool2d([ksize, ksize], [ksize, ksize], [0, 0], false, true, 1)
    }

    /// 2-D adaptive average pooling to `output_size` (`[h, w]`).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a non 3-/4-D input or a bad size.
    pub fn f_adaptive_avg_pool2d(&self, output_size: impl IntList) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let name = "adaptive_avg_pool2d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let output = self.output_pair(name, output_size.as_slice())?;
        let s = &n.meta.shape;
        if s.len() != 3 && s.len() != 4 {
            return Err(a(format!("expected a 3-D or 4-D input, got {} dims", s.len())));
        }
        if s[s.len() - 3..].contains(&0) || output.iter().any(|&v| v < 0) {
            return Err(a(format!("non-empty input and non-negative output size expected, got output {output:?}")));
        }
        floating(name, n)?;
        let mut out = s.clone();
        let nd = out.len();
        out[nd - 2..].copy_from_slice(&output);
        let flow = self.pool_flow(name, &out)?;
        Ok(Record::new(AdaptiveAvgPool2d { output }, inputs_of([n]), out, n.meta.kind, n.meta.device)
            .flow(flow)
            .finish())
    }

    /// 3-D max pooling of `[N, C, D, H, W]` (or `[C, D, H, W]`), as tch's `max_pool3d` (an
    /// empty `stride` means the kernel size); each setting takes 1 or 3 values.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for parameters libtorch refuses (a padding over half the
    /// kernel, an output smaller than 1, ..).
    pub fn f_max_pool3d(
        &self,
        kernel_size: impl IntList,
        stride: impl IntList,
        padding: impl IntList,
        dilation: impl IntList,
        ceil_mode: bool,
    ) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let name = "max_pool3d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let (kernel, stride, padding) = window::<3>(&kernel_size, &stride, &padding, None).map_err(a)?;
        let dilation = shape::spatial::<3>(dilation.as_slice(), "dilation").map_err(a)?;
        let out = pool3d_shape(&n.meta.shape, kernel, stride, padding, dilation, ceil_mode, false).map_err(a)?;
        let nd = out.len();
        let flow = unary_flow(name, n, &out, |d| (d + 3 < nd).then_some(d), Linearity::Nonlinear)?;
        let op = MaxPool::<3> { kernel, stride, padding, dilation, ceil_mode };
        Ok(Record::new(op, inputs_of([n]), out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// 3-D average pooling, as tch's `avg_pool3d` (an empty `stride` means the kernel size).
    ///
    /// # Errors
    /// As [`f_max_pool3d`](Self::f_max_pool3d); also a `divisor_override` of 0 and integers.
    #[allow(clippy::too_many_arguments)]
    pub fn f_avg_pool3d(
        &self,
        kernel_size: impl IntList,
        stride: impl IntList,
        padding: impl IntList,
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: impl Into<Option<i64>>,
    ) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let name = "avg_pool3d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let divisor_override = divisor_override.into();
        let (kernel, stride, padding) =
            window::<3>(&kernel_size, &stride, &padding, Some(divisor_override)).map_err(a)?;
        floating(name, n)?;
        let out = pool3d_shape(&n.meta.shape, kernel, stride, padding, [1; 3], ceil_mode, true).map_err(a)?;
        let nd = out.len();
        let flow = unary_flow(name, n, &out, |d| (d + 3 < nd).then_some(d), Linearity::Nonlinear)?;
        let op = AvgPool::<3> { kernel, stride, padding, ceil_mode, count_include_pad, divisor_override };
        Ok(Record::new(op, inputs_of([n]), out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    fn pool_flow(&self, name: &str, out: &[i64]) -> Result<(Flow, Option<String>), LazyError> {
        let nd = self.node().meta.shape.len();
        unary_flow(name, self.node(), out, |d| (d + 2 < nd).then_some(d), Linearity::Nonlinear)
    }

    // -----------------------------------------------------------------------------------------
    // Upsampling

    /// Nearest-neighbour upsampling of `[N, C, L]` to `output_size` (`[l]`), as tch's
    /// `upsample_nearest1d`; `scales`, when given, sets the source step as in libtorch (the
    /// output size is `output_size` either way).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a non 3-D or empty input, a size that is not one value of at
    /// least 1, or a scale that is not positive.
    pub fn f_upsample_nearest1d(
        &self,
        output_size: impl IntList,
        scales: impl Into<Option<f64>>,
    ) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let name = "upsample_nearest1d";
        let shape = &n.meta.shape;
        let a = |r: String| arg(name, shape, r);
        let scales = scales.into();
        let output = one_of(name, shape, output_size.as_slice(), "output_size", None)?;
        if shape.len() != 3 || shape[1..].contains(&0) || output < 1 {
            return Err(a(format!("expected a non-empty 3-D input and an output size of at least 1, got {output}")));
        }
        if scales.is_some_and(|s| s.is_nan() || s <= 0.0) {
            return Err(a(format!("scales must be positive, got {scales:?}")));
        }
        let mut out = shape.clone();
        out[2] = output;
        let flow = unary_flow(name, n, &out, |d| (d < 2).then_some(d), Linearity::Nonlinear)?;
        let op = UpsampleNearest1d { output, scales };
        Ok(Record::new(op, inputs_of([n]), out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// Nearest-neighbour upsampling of `[N, C, H, W]` to `output_size` (`[h, w]`), as tch's
    /// `upsample_nearest2d`; `scales_h`/`scales_w`, when given, set the source step as in
    /// libtorch (the output size is `output_size` either way).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a non 4-D input, a size below 1, or a scale that is not
    /// positive.
    pub fn f_upsample_nearest2d(
        &self,
        output_size: impl IntList,
        scales_h: impl Into<Option<f64>>,
        scales_w: impl Into<Option<f64>>,
    ) -> Result<LazyTensor, LazyError> {
        let scales = [scales_h.into(), scales_w.into()];
        let n = self.node();
        let name = "upsample_nearest2d";
        let (output, out) = self.upsampled(name, output_size.as_slice(), scales)?;
        let flow = self.pool_flow(name, &out)?;
        let op = UpsampleNearest2d { output, scales };
        Ok(Record::new(op, inputs_of([n]), out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// Bilinear upsampling of `[N, C, H, W]` to `output_size` (`[h, w]`), as tch's
    /// `upsample_bilinear2d` (`align_corners`, and optional scales that change how output
    /// positions map onto the input, as in libtorch).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a non 4-D input, a size below 1 or a scale that is not
    /// positive, [`LazyError::Kind`] for integers.
    pub fn f_upsample_bilinear2d(
        &self,
        output_size: impl IntList,
        align_corners: bool,
        scales_h: impl Into<Option<f64>>,
        scales_w: impl Into<Option<f64>>,
    ) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let name = "upsample_bilinear2d";
        let scales = [scales_h.into(), scales_w.into()];
        let (output, out) = self.upsampled(name, output_size.as_slice(), scales)?;
        floating(name, n)?;
        let flow = self.pool_flow(name, &out)?;
        let op = UpsampleBilinear2d { output, align_corners, scales };
        Ok(Record::new(op, inputs_of([n]), out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// An `output_size` of two values (`[h, w]`), as the 2-D resizing ops take it.
    fn output_pair(&self, name: &str, output_size: &[i64]) -> Result<[i64; 2], LazyError> {
        output_size.try_into().map_err(|_| {
            arg(name, &self.node().meta.shape, format!("output_size must be 2 values, got {output_size:?}"))
        })
    }

    /// An upsampling's checked output size and output shape: a non-empty 4-D input, sizes of at
    /// least 1, and positive scales where given.
    fn upsampled(
        &self,
        name: &str,
        output_size: &[i64],
        scales: [Option<f64>; 2],
    ) -> Result<([i64; 2], Vec<i64>), LazyError> {
        let shape = &self.node().meta.shape;
        let a = |r: String| arg(name, shape, r);
        let output = self.output_pair(name, output_size)?;
        if shape.len() != 4 || output.iter().any(|&v| v < 1) || shape[2..].contains(&0) {
            return Err(a(format!("expected a non-empty 4-D input and an output size of at least 1, got {output:?}")));
        }
        if scales.iter().flatten().any(|&s| s.is_nan() || s <= 0.0) {
            return Err(a(format!("scales must be positive, got {scales:?}")));
        }
        let mut out = shape.clone();
        out[2..].copy_from_slice(&output);
        Ok((output, out.to_vec()))
    }

    // -----------------------------------------------------------------------------------------
    // Rearranging: pixel shuffles and sliding windows

    /// Rearranges `[.., C·r², H, W]` into `[.., C, H·r, W·r]` (`r` the `upscale_factor`), as
    /// tch's `pixel_shuffle`. Per sample when the batch is a leading dimension; a batch along
    /// the channels or the sides moves entries between samples.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for fewer than 3 dimensions, a factor below 1, or channels not
    /// divisible by its square.
    pub fn f_pixel_shuffle(&self, upscale_factor: i64) -> Result<LazyTensor, LazyError> {
        self.pixel_shuffled("pixel_shuffle", upscale_factor, false)
    }

    /// Rearranges `[.., C, H·r, W·r]` into `[.., C·r², H, W]` (`r` the `downscale_factor`), as
    /// tch's `pixel_unshuffle`: the inverse of `pixel_shuffle`, split as it is.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for fewer than 3 dimensions, a factor below 1, or sides not
    /// divisible by it.
    pub fn f_pixel_unshuffle(&self, downscale_factor: i64) -> Result<LazyTensor, LazyError> {
        self.pixel_shuffled("pixel_unshuffle", downscale_factor, true)
    }

    fn pixel_shuffled(&self, name: &'static str, r: i64, unshuffle: bool) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let shape = &n.meta.shape;
        let a = |r: String| arg(name, shape, r);
        let nd = shape.len();
        if nd < 3 {
            return Err(a(format!("expects input to have at least 3 dimensions, but got {nd}")));
        }
        if r < 1 {
            return Err(a(format!("the factor must be greater than 0, but got {r}")));
        }
        let (c, h, w) = (shape[nd - 3], shape[nd - 2], shape[nd - 1]);
        let mut out = shape.clone();
        if unshuffle {
            if h % r != 0 || w % r != 0 {
                return Err(a(format!("the height {h} and width {w} must be divisible by the factor {r}")));
            }
            out[nd - 3..].copy_from_slice(&[c * r * r, h / r, w / r]);
        } else {
            if c % (r * r) != 0 {
                return Err(a(format!("the channels {c} must be divisible by the square of the factor {r}")));
            }
            out[nd - 3..].copy_from_slice(&[c / (r * r), h * r, w * r]);
        }
        let (flow, mixes) = match n.meta.batch() {
            Some(bd) if bd.dim + 3 >= nd => {
                (Flow::Opaque, Some(format!("moves entries between samples (the batch dimension {})", bd.dim)))
            }
            _ => unary_flow(name, n, &out, Some, Linearity::Structural)?,
        };
        let op = PixelShuffle { factor: r, unshuffle };
        Ok(Record::new(op, inputs_of([n]), out, n.meta.kind, n.meta.device).flow((flow, mixes)).finish())
    }

    /// Every window of `size` entries along `dimension`, `step` apart, as a new last dimension
    /// of `size` (a view: windows may overlap), as tch's `unfold`. Per sample unless
    /// `dimension` is the batch dimension (windows across samples).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a bad dimension, a `size` outside `0..=` the dimension's
    /// size, or a `step` below 1.
    pub fn f_unfold(&self, dimension: i64, size: i64, step: i64) -> Result<LazyTensor, LazyError> {
        let n = self.node();
        let m = &n.meta;
        let name = "unfold";
        let a = |r: String| arg(name, &m.shape, r);
        let d = shape::wrap_dim(dimension, m.shape.len()).map_err(a)?;
        let max = m.shape.get(d).copied().unwrap_or(1);
        if size > max || size < 0 {
            return Err(a(format!("maximum size for tensor at dimension {d} is {max} but size is {size}")));
        }
        if step < 1 {
            return Err(a(format!("step is {step} but must be > 0")));
        }
        let (mut out, mut strides) = (m.shape.clone(), m.strides.clone());
        out.push(size);
        strides.push(m.strides.get(d).copied().unwrap_or(1));
        if d < m.shape.len() {
            out[d] = (m.shape[d] - size) / step + 1;
            strides[d] *= step;
        }
        let (flow, mixes) = match m.batch() {
            Some(bd) if bd.dim == d => {
                (Flow::Opaque, Some(format!("`unfold` takes windows along the batch dimension {d}")))
            }
            _ => unary_flow(name, n, &out, Some, Linearity::Structural)?,
        };
        let op = Unfold { dim: d as i64, size, step };
        Ok(Record::new(op, inputs_of([n]), out, m.kind, m.device).flow((flow, mixes)).view(strides.to_vec()).finish())
    }
}
