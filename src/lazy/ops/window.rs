//! Windows over spatial dimensions: convolutions (1-D, 2-D, transposed 2-D), 2-D pooling and
//! upsampling.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::IntoLazy;
use super::record::{combine_flows, same_device, unary_flow, Linearity, Record};
use super::{arg, floating, panicking, requires, same_kind, shape_err};
use crate::lazy::error::LazyError;
use crate::lazy::graph::{Flow, Meta, Node, Operation, RunCx, Scratch};
use crate::lazy::int_list::IntList;
use crate::lazy::scratch;
use crate::lazy::shape;
use crate::lazy::LazyTensor;

pub(crate) enum Window {
    /// Operands: x, weight, optional bias.
    Conv1d {
        stride: [i64; 1],
        padding: [i64; 1],
        dilation: [i64; 1],
        groups: i64,
    },
    /// Operands: x, weight, optional bias.
    Conv2d {
        stride: [i64; 2],
        padding: [i64; 2],
        dilation: [i64; 2],
        groups: i64,
    },
    MaxPool2d {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
        dilation: [i64; 2],
        ceil_mode: bool,
    },
    AvgPool2d {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: Option<i64>,
    },
    AdaptiveAvgPool2d {
        output: [i64; 2],
    },
    UpsampleNearest2d {
        output: [i64; 2],
        /// `scales_h`, `scales_w` as given (libtorch's source step when set).
        scales: [Option<f64>; 2],
    },
    /// Scales, when given, change how output positions map onto the input (as in libtorch).
    UpsampleBilinear2d {
        output: [i64; 2],
        align_corners: bool,
        scales: [Option<f64>; 2],
    },
    /// Operands: x, weight (`[C_in, C_out / groups, kh, kw]`), optional bias.
    ConvTranspose2d {
        stride: [i64; 2],
        padding: [i64; 2],
        output_padding: [i64; 2],
        dilation: [i64; 2],
        groups: i64,
    },
}

/// A convolution's settings, as slices over its spatial dimensions.
#[derive(Clone, Copy)]
struct Settings<'a> {
    stride: &'a [i64],
    padding: &'a [i64],
    dilation: &'a [i64],
    groups: i64,
}

impl Settings<'_> {
    fn strided(&self) -> bool {
        self.stride.iter().any(|&s| s != 1)
    }

    fn dilated(&self) -> bool {
        self.dilation.iter().any(|&d| d != 1)
    }

    /// Whether oneDNN's weight-gradient kernels leave a dilated convolution to its gemm: when
    /// strided, or when the dilated kernel is wider than the input (measured).
    fn dilated_gemm(&self, input: &[i64], kernel: &[i64]) -> bool {
        self.dilated()
            && (self.strided()
                || input.iter().zip(kernel).zip(self.dilation).any(|((&side, &k), &d)| (k - 1) * d + 1 > side))
    }
}

impl Window {
    /// A convolution's settings, whatever its dimensions.
    fn convolution(&self) -> Option<Settings<'_>> {
        match self {
            Window::Conv1d { stride, padding, dilation, groups } => {
                Some(Settings { stride, padding, dilation, groups: *groups })
            }
            Window::Conv2d { stride, padding, dilation, groups } => {
                Some(Settings { stride, padding, dilation, groups: *groups })
            }
            _ => None,
        }
    }
}

impl Operation for Window {
    fn name(&self) -> &'static str {
        match self {
            Window::Conv1d { .. } => "conv1d",
            Window::Conv2d { .. } => "conv2d",
            Window::MaxPool2d { .. } => "max_pool2d",
            Window::AvgPool2d { .. } => "avg_pool2d",
            Window::AdaptiveAvgPool2d { .. } => "adaptive_avg_pool2d",
            Window::UpsampleNearest2d { .. } => "upsample_nearest2d",
            Window::UpsampleBilinear2d { .. } => "upsample_bilinear2d",
            Window::ConvTranspose2d { .. } => "conv_transpose2d",
        }
    }

    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let x = ins[0];
        match self {
            Window::Conv1d { stride, padding, dilation, groups } => {
                let (weight, bias) = (ins[1], ins.get(2).copied());
                x.f_conv1d(weight, bias, stride, padding, dilation, *groups)
            }
            Window::Conv2d { stride, padding, dilation, groups } => {
                let (weight, bias) = (ins[1], ins.get(2).copied());
                x.f_conv2d(weight, bias, stride, padding, dilation, *groups)
            }
            Window::MaxPool2d { kernel, stride, padding, dilation, ceil_mode } => {
                x.f_max_pool2d(kernel, stride, padding, dilation, *ceil_mode)
            }
            Window::AvgPool2d { kernel, stride, padding, ceil_mode, count_include_pad, divisor_override } => {
                x.f_avg_pool2d(kernel, stride, padding, *ceil_mode, *count_include_pad, *divisor_override)
            }
            Window::AdaptiveAvgPool2d { output } => x.f_adaptive_avg_pool2d(output),
            Window::UpsampleNearest2d { output, scales } => x.f_upsample_nearest2d(output, scales[0], scales[1]),
            Window::UpsampleBilinear2d { output, align_corners, scales: [h, w] } => {
                x.f_upsample_bilinear2d(output, *align_corners, *h, *w)
            }
            Window::ConvTranspose2d { stride, padding, output_padding, dilation, groups } => {
                let (weight, bias) = (ins[1], ins.get(2).copied());
                x.f_conv_transpose2d(weight, bias, stride, padding, output_padding, *groups, dilation)
            }
        }
    }

    fn saves_input(&self, i: usize, inputs: &[Rc<Node>]) -> bool {
        match self {
            // Input and weight, each for the other's gradient.
            Window::Conv1d { .. } | Window::Conv2d { .. } | Window::ConvTranspose2d { .. } => match i {
                0 => requires(inputs, 1),
                1 => requires(inputs, 0),
                _ => false,
            },
            // Upsampling needs only the sizes for its backward.
            Window::UpsampleNearest2d { .. } | Window::UpsampleBilinear2d { .. } => false,
            _ => i == 0,
        }
    }

    fn saved_extra(&self, _inputs: &[Rc<Node>], meta: &Meta) -> Option<(u64, u64, Kind)> {
        match self {
            // Indices of the maxima, one int64 per output element.
            Window::MaxPool2d { .. } => {
                let (a, c) = meta.numel_parts();
                Some((a, c, Kind::Int64))
            }
            _ => None,
        }
    }

    fn scratch(&self, inputs: &[Rc<Node>], meta: &Meta) -> Scratch {
        if let Window::ConvTranspose2d { stride, padding, groups, .. } = self {
            return transposed_scratch(inputs, meta, stride, padding, *groups);
        }
        let Some(settings) = self.convolution() else {
            return Scratch::default();
        };
        let mut scratch = self.conv_scratch(inputs, meta, settings);
        // A strided input (a view: a narrow, a transpose) is copied to a contiguous one when the
        // convolution runs, and again when its backward runs (autograd keeps the view).
        let x = &inputs[0].meta;
        if !meta.device.is_cuda() && !shape::is_contiguous(&x.shape, &x.strides) {
            let (a, c) = x.numel_parts();
            scratch.forward = (scratch.forward.0 + a, scratch.forward.1 + c);
            scratch.backward = (scratch.backward.0 + a, scratch.backward.1 + c);
        }
        scratch
    }
}

impl Window {
    /// A convolution's scratch, its input taken as contiguous.
    fn conv_scratch(&self, inputs: &[Rc<Node>], meta: &Meta, settings: Settings<'_>) -> Scratch {
        let mut scratch = Scratch::default();
        let Settings { stride, padding, dilation, groups } = settings;
        let w = &inputs[1].meta.shape;
        let out = &meta.shape;
        let spatial = stride.len();
        let batched = out.len() == spatial + 2;
        if meta.device.is_cuda() && batched {
            // cuDNN may reorder both operands (see `scratch`): their bytes, and a few MiB.
            let ((ip, ic), (op, oc)) = (inputs[0].meta.numel_parts(), meta.numel_parts());
            let elem = meta.kind.elt_size_in_bytes().max(1) as u64;
            let (forward, backward) = scratch::CONV_WORKSPACE_FIXED;
            scratch.forward = (ip + op, ic + oc + forward / elem);
            scratch.backward = (ip + op, ic + oc + backward / elem);
            // The bias gradient: the output gradient summed over every dimension but channels.
            if requires(inputs, 2) && meta.requires_grad {
                scratch.stage(true, meta, shape::dims_mask((0..out.len()).filter(|&d| d != 1)));
            }
            return scratch;
        }
        let kernel = &w[2..];
        let one_by_one = kernel.iter().all(|&k| k == 1)
            && stride.iter().all(|&s| s == 1)
            && padding.iter().all(|&p| p == 0)
            && dilation.iter().all(|&d| d == 1);
        // im2col: every input channel times every kernel position, per output position.
        let positions = shape::numel(&out[out.len() - spatial..]) as u64;
        let cols = if one_by_one { 0 } else { (w[1] * groups * shape::numel(kernel)) as u64 * positions };
        // A batch of one of a small input runs natively (im2col below), and so does a micro-batch
        // of one of a larger batch that oneDNN runs: at one sample, the larger of the two.
        let n = meta.batch().map_or(1, |bd| bd.size);
        let per_sample = shape::numel(&inputs[0].meta.shape) / n.max(1);
        if meta.kind == Kind::Float && batched && onednn(w, stride, dilation, groups, n, per_sample) {
            let mut scratch = onednn_scratch(inputs, meta, requires(inputs, 0), settings);
            if n > 1 && meta.batch().is_some() && !onednn(w, stride, dilation, groups, 1, per_sample) {
                let at_one = |(a, c): (u64, u64)| (a + c).max(cols);
                scratch.one = Some((at_one(scratch.forward), at_one(scratch.backward)));
            }
            return scratch;
        }
        if one_by_one {
            return scratch;
        }
        let work = match meta.batch() {
            Some(_) if batched => (cols, 0),
            _ => (0, cols * if batched { out[0] as u64 } else { 1 }),
        };
        scratch.forward = work;
        scratch.backward = work;
        scratch
    }
}

/// Whether libtorch hands a batched `Float` convolution on the CPU to oneDNN: its rule
/// (`ConvParams::use_mkldnn`): a 1×1 unstrided convolution of fewer than 16 samples on one
/// thread stays native, and so does a batch of one of a small input (at most 20480 elements)
/// unless it is grouped or its kernel is larger than 3×3.
fn onednn(weight: &[i64], stride: &[i64], dilation: &[i64], groups: i64, batch: i64, per_sample: i64) -> bool {
    let one_by_one = weight[2..].iter().all(|&k| k == 1);
    let strided = stride.iter().any(|&s| s != 1) || dilation.iter().any(|&d| d != 1);
    let wide_kernel = weight[2..].iter().all(|&k| k > 3);
    (!one_by_one || strided || batch >= 16 || threads() > 1)
        && (groups > 1 || wide_kernel || batch > 1 || per_sample > 20480)
}

/// libtorch's intra-op threads, asked once.
fn threads() -> i32 {
    static THREADS: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *THREADS.get_or_init(tch::get_num_threads)
}

/// oneDNN's channel block on this CPU: 16 with AVX-512, else 8.
fn channel_block() -> i64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return 16;
    }
    8
}

/// A oneDNN convolution's scratch on the CPU (libtorch 2.11, x86-64), planned phase by phase as
/// oneDNN's verbose log and an allocation trace show them: ungrouped (`phased_scratch`, and
/// `strided_input_grad` for a strided one's input gradient) or grouped (`grouped_scratch`).
fn onednn_scratch(inputs: &[Rc<Node>], meta: &Meta, input_grad: bool, settings: Settings<'_>) -> Scratch {
    if settings.groups > 1 {
        return grouped_scratch(inputs, meta, input_grad, settings);
    }
    // `brgconv_strided` takes no dilation: a dilated strided input gradient is oneDNN's gemm's.
    if input_grad && settings.strided() && !settings.dilated() {
        return strided_input_grad(inputs, meta, settings);
    }
    phased_scratch(inputs, meta, input_grad, settings)
}

/// The layouts of an ungrouped convolution's primitives, as oneDNN picks them on this CPU
/// (read from its verbose log, libtorch 2.11 on AVX-512; `b` is the channel block):
/// - forward: an input of fewer than a block of channels stays plain (a first layer), else it
///   is padded to whole blocks; a 1×1 convolution (unless a stride leaves part of the input
///   out) always pads it, and when strided copies it at unit stride, a sample per thread. The
///   weight and the output are padded to whole blocks of output channels;
/// - weight gradient: the output gradient and the input padded the same way, except that
///   fewer than four input channels stay plain and fewer than a block use a half block;
/// - input gradient (unstrided): output gradient, weight and input gradient padded to blocks.
#[derive(Clone, Copy)]
struct Layouts {
    block: u64,
    cin: u64,
    cout: u64,
    pointwise: bool,
    /// A strided 1×1 convolution whose stride does not divide the input: the general kernel.
    uneven: bool,
    strided: bool,
    /// Output positions of one sample.
    positions: u64,
}

impl Layouts {
    /// `n` elements over `c` channels, padded to whole blocks of `b`.
    fn pad(n: u64, c: u64, b: u64) -> u64 {
        n / c.max(1) * c.div_ceil(b) * b
    }

    /// The unit-stride copy of a strided 1×1 convolution's input, a sample per thread.
    fn unit_stride_copy(&self) -> u64 {
        if self.pointwise && self.strided && !self.uneven {
            threads().max(1) as u64 * self.cin.div_ceil(self.block) * self.block * self.positions
        } else {
            0
        }
    }
}

/// An ungrouped convolution's scratch, unstrided or without an input gradient, phase by phase
/// (see `Layouts`): each phase's live buffers beyond what the plan counts itself (the output,
/// the gradients), the largest phase taken. Forward: the reordered operands with the blocked
/// output, then the blocked output with its plain copy. Backward: the input gradient's
/// primitive, then the weight gradient's (reorders, the blocked weight gradient and a
/// scratchpad: a reduction copy of it per extra thread when the threads must split the
/// batch, since the channel blocks do not divide among them), then the weight gradient made
/// plain. Where oneDNN's kernels decline (a kernel side of 15 or more, dilations, maps smaller
/// than the kernel, padding wider than the output: see below), its gemm's columns instead.
/// Measured one convolution at a time (`tests/lazy_peak.rs::one_convolution_at_a_time`, 700
/// shapes over channels 1..64, kernels 1/3/5, strides 1/2, maps 2..32, batches 2..32): backward
/// never under by more than 10%, forward within 5% but 22 (all under 5 KiB).
fn phased_scratch(inputs: &[Rc<Node>], meta: &Meta, input_grad: bool, settings: Settings<'_>) -> Scratch {
    let Settings { stride, padding, .. } = settings;
    let weight = &inputs[1].meta.shape;
    let input = &inputs[0].meta.shape;
    let elem = meta.kind.elt_size_in_bytes().max(1) as u64;
    let pointwise = weight[2..].iter().all(|&k| k == 1);
    let strided = stride.iter().any(|&s| s != 1);
    let l = Layouts {
        block: channel_block() as u64,
        cin: weight[1].max(1) as u64,
        cout: weight[0].max(1) as u64,
        pointwise,
        uneven: input[2..].iter().zip(stride).any(|(&side, &s)| s > 1 && side % s != 0),
        strided,
        positions: shape::numel(&meta.shape[2..]).max(0) as u64,
    };
    let (b, cin, cout) = (l.block, l.cin, l.cout);
    let pad = Layouts::pad;
    let w = shape::numel(weight).max(0) as u64;
    let (xp, yp) = (inputs[0].meta.numel_parts(), meta.numel_parts());
    let threads = threads().max(1) as u64;
    let n = batch_of(meta);
    let kib = |k: u64| (k << 10) / elem;

    let one_by_one = pointwise && !l.uneven;
    // Padding wider than the output leaves the forward and the input gradient to oneDNN's gemm
    // (plain layouts, its columns: at most 64 output positions per thread). A large padded
    // kernel may be left to it too (by a rule not read here): its columns are then a floor.
    let pad_beyond = padding.iter().zip(&meta.shape[2..]).any(|(&p, &o)| p > o);
    let large_padded = weight[2..].iter().any(|&k| k >= 11) && padding.iter().any(|&p| p > 0);
    let gemm_columns = threads * cin * shape::numel(&weight[2..]).max(0) as u64 * l.positions.min(64) + 128 / elem;
    let forward = chord(n, |k| {
        let (x, y) = (xp.0 * k + xp.1, yp.0 * k + yp.1);
        if pad_beyond {
            return gemm_columns;
        }
        let x_r = if one_by_one || cin >= b { pad(x, cin, b) } else { 0 };
        let w_r = if one_by_one || cin >= b { pad(pad(w, cin, b), cout, b) } else { pad(w, cout, b) };
        let y_blk = pad(y, cout, b);
        let jit = (x_r + w_r + y_blk + l.unit_stride_copy()).saturating_sub(y).max(y_blk);
        if large_padded {
            jit.max(gemm_columns)
        } else {
            jit
        }
    });

    // The weight gradient's kernel: its channel blocks (input, output), and whether it reads
    // the input plain.
    let half = b == 16 && !one_by_one && (4..b).contains(&cin);
    let kb = if half { b / 2 } else { b };
    let plain_input = !one_by_one && cin < 4;
    // No weight-gradient kernel takes a kernel side of 15 or more (a patch embedding's 16×16),
    // and the half-block one no input side smaller than the kernel's: oneDNN's gemm computes
    // those on plain layouts (`gemm_weight_grad`), and so it does dilated ones (see `Settings`).
    let kernel = &weight[2..];
    let gemm = kernel.iter().any(|&k| k >= 15)
        || (half && (settings.dilated() || input[2..].iter().zip(kernel).any(|(&side, &k)| side < k)))
        || settings.dilated_gemm(&input[2..], kernel);
    // A dilated strided input gradient: the gemm's columns per thread, then copied out plain.
    let data_gemm = input_grad && settings.strided() && settings.dilated();
    let data_columns = threads * cin * shape::numel(kernel).max(0) as u64 * l.positions + 128 / elem;
    let columns = cin * shape::numel(kernel).max(0) as u64 * l.positions;
    let backward = chord(n, |k| {
        let (x, y) = (xp.0 * k + xp.1, yp.0 * k + yp.1);
        let data = if data_gemm {
            data_columns.max(x).saturating_sub(w)
        } else if input_grad && pad_beyond {
            gemm_columns.max(x).saturating_sub(w)
        } else if input_grad {
            blocked_input_grad(pad(y, cout, b), pad(pad(w, cin, b), cout, b), pad(x, cin, b), x, w)
        } else {
            0
        };
        if gemm {
            return gemm_weight_grad(w, columns, l.positions, elem).max(data);
        }
        let y_r = pad(y, cout, kb);
        let x_r = if plain_input { 0 } else { pad(x, cin, kb) };
        let w_blk = if plain_input { pad(w, cout, kb) } else { pad(pad(w, cin, kb), cout, kb) };
        let (nb_in, nb_out) = (if plain_input { 1 } else { cin.div_ceil(kb) }, cout.div_ceil(kb));
        let scratchpad = if threads > 1 && nb_out % threads != 0 && nb_in % threads != 0 {
            // The batch split among threads: a reduction copy of the weight gradient per extra
            // thread, and fixed buffers (21 KiB; 25 KiB for the half-block kernel).
            (threads - 1) * w_blk + kib(if half { 25 } else { 21 })
        } else if nb_in % threads == 0 && nb_out % threads != 0 {
            ((x + y) / 10).clamp(kib(13), kib(48))
        } else {
            ((x + y) / 10).min(kib(48))
        };
        let weights = (y_r + x_r + w_blk + scratchpad + l.unit_stride_copy()).saturating_sub(w);
        weights.max(w_blk).max(data)
    });
    Scratch { forward, backward, ..Scratch::default() }
}

/// A grouped oneDNN convolution's scratch on the CPU, phase by phase as oneDNN's verbose log and
/// an allocation trace show it (libtorch 2.11, AVX-512). Layouts pad channels to blocks of the
/// group's width (16, 8 or 4 channels), a depthwise convolution's to blocks of 16 over all of
/// them. Forward: the reordered input and weight with the blocked output, then the blocked
/// output with its plain copy (a strided 1×1 convolution first copies its input at unit
/// stride, a sample per thread). Backward: the input gradient's primitive, then its blocked
/// result copied out plain; then the weight gradient's: a depthwise 3×3, and groups of a
/// multiple of 8 channels, reorder the output gradient and the input the same way (no
/// scratchpad: the threads split the groups); other kernels and group widths, and maps
/// smaller than the kernel (but with groups of 16 channels), go to oneDNN's
/// gemm on plain layouts (`gemm_weight_grad`). Measured on 23 shapes (depthwise 3×3 to 9×9, strides
/// 1/2, groups of 4 to 32 channels): within 3%.
fn grouped_scratch(inputs: &[Rc<Node>], meta: &Meta, input_grad: bool, settings: Settings<'_>) -> Scratch {
    let Settings { stride, groups, .. } = settings;
    let strided = stride.iter().any(|&s| s != 1);
    let block = channel_block();
    let weight = &inputs[1].meta.shape;
    let kernel = &weight[2..];
    let cin = (weight[1] * groups.max(1)).max(1);
    let o = meta.shape[1].max(1);
    let (xp, yp) = (inputs[0].meta.numel_parts(), meta.numel_parts());
    let w = shape::numel(weight).max(0) as u64;
    let elem = meta.kind.elt_size_in_bytes().max(1) as u64;
    let n = batch_of(meta);
    let (b, cin_u, o_u) = (block as u64, cin as u64, o as u64);
    let copies = if kernel.iter().all(|&k| k == 1) && strided {
        threads().max(1) as u64 * cin_u.div_ceil(b) * b * shape::numel(&meta.shape[2..]).max(0) as u64
    } else {
        0
    };
    // The channels each layout pads to: a depthwise convolution's to whole blocks over all of
    // them, a grouped one's to blocks of its group's width (16, 8 or 4 channels).
    let per_group = weight[1].max(1) as u64;
    let depthwise = per_group == 1 && o == cin;
    let group_block = [16, 8, 4].into_iter().find(|&g| per_group % g == 0).unwrap_or(1);
    let (x_ch, y_ch) = if depthwise {
        (cin_u.div_ceil(b) * b, o_u.div_ceil(b) * b)
    } else {
        let g = groups.max(1) as u64;
        (g * per_group.div_ceil(group_block) * group_block, g * (o_u / g).div_ceil(group_block) * group_block)
    };
    let positions_per_kernel = shape::numel(kernel).max(0) as u64;
    let w_r = positions_per_kernel * if depthwise { y_ch } else { y_ch * x_ch / groups.max(1) as u64 };
    // Forward: the reordered input and weight with the blocked output, then the blocked output
    // with its plain copy.
    let forward = chord(n, |k| {
        let (x, y) = (xp.0 * k + xp.1, yp.0 * k + yp.1);
        let (x_r, y_r) = (x / cin_u * x_ch, y / o_u * y_ch);
        (x_r + w_r + y_r + copies).saturating_sub(y).max(y_r)
    });
    // As ungrouped, the depthwise and the half-block (8 channels a group) kernels take no input
    // side smaller than the kernel's.
    let small_map = inputs[0].meta.shape[2..].iter().zip(kernel).any(|(&side, &k)| side < k);
    let gemm = ((small_map || settings.dilated()) && (depthwise || per_group % 16 != 0))
        || settings.dilated_gemm(&inputs[0].meta.shape[2..], kernel)
        || if depthwise { kernel.iter().any(|&k| k != 3) } else { per_group % 8 != 0 };
    let positions = shape::numel(&meta.shape[2..]).max(0) as u64;
    let columns = per_group * positions_per_kernel * positions;
    let backward = chord(n, |k| {
        let (x, y) = (xp.0 * k + xp.1, yp.0 * k + yp.1);
        let (x_r, y_r) = (x / cin_u * x_ch, y / o_u * y_ch);
        let data = if input_grad { blocked_input_grad(y_r, w_r, x_r, x, w) } else { 0 };
        let weights = if gemm {
            gemm_weight_grad(w, columns, positions, elem)
        } else {
            (y_r + x_r + w_r).saturating_sub(w).max(w_r)
        };
        data.max(weights)
    });
    Scratch { forward, backward, ..Scratch::default() }
}

/// oneDNN's gemm weight gradient, in elements: four copies of the weight gradient per thread,
/// 256 bytes, and the columns (`columns` elements for one sample) of each thread on maps of up
/// to 256 output positions; on larger maps the threads share one sample's columns in pieces
/// (measured on 2 threads: 15/16 of them). Measured on 1 and 2 threads.
fn gemm_weight_grad(w: u64, columns: u64, positions: u64, elem: u64) -> u64 {
    let threads = threads().max(1) as u64;
    let column_threads = if positions <= 256 { threads } else { 1 };
    4 * threads * w + column_threads * columns + 256 / elem
}

/// The batch a cost is planned at (1 when the tensor has no batch dimension).
fn batch_of(meta: &Meta) -> u64 {
    meta.batch().map_or(1, |bd| bd.size.max(1)) as u64
}

/// A cost that is not linear in the micro-batch (`at(k)` at `k` samples, convex: the larger of
/// linear costs), as the chord of its graph between one sample and the full batch `n`: exact at
/// both ends, above it in between, where micro-batches fall.
fn chord(n: u64, at: impl Fn(u64) -> u64) -> (u64, u64) {
    if n <= 1 {
        return (0, at(1));
    }
    let slope = at(n).saturating_sub(at(1)).div_ceil(n - 1);
    (slope, at(1).saturating_sub(slope))
}

/// The backward of an ungrouped strided convolution with an input gradient, on the CPU: three
/// phases, one after another, so its scratch is the largest of them (read from oneDNN's verbose
/// log and the allocator's trace, libtorch 2.11 on AVX-512: the first two phases matched 414
/// traced shapes over channels 1..64, kernels 1/3/5, maps 4..32, batches 2..32 within 3%):
/// - the input gradient (oneDNN's `brgconv_strided`): the output gradient reordered to
///   channels-last, the weight with its input channels padded (to a block, or two blocks from
///   one on), and a scratchpad of fixed buffers plus, per thread, the output gradient of one
///   sample over the padded input's grid rounded up to 16 KiB;
/// - that gradient made plain: for a moment three copies of the input's size are live;
/// - the weight gradient: as without an input gradient.
fn strided_input_grad(inputs: &[Rc<Node>], meta: &Meta, settings: Settings<'_>) -> Scratch {
    let Settings { stride, padding, .. } = settings;
    let weights = onednn_scratch(inputs, meta, false, settings);
    let elem = meta.kind.elt_size_in_bytes().max(1) as u64;
    let block = channel_block();
    let input = &inputs[0].meta.shape;
    let cin = input[1].max(1) as u64;
    let w = shape::numel(&inputs[1].meta.shape).max(0) as u64;
    let padded_cin = if cin <= block as u64 { block as u64 } else { cin.div_ceil(2 * block as u64) * 2 * block as u64 };
    let (x, y) = (inputs[0].meta.numel_parts(), meta.numel_parts());
    let scratchpad = brgconv_strided_scratchpad(meta.shape[1].max(1) as u64, &input[2..], stride, padding, elem);
    let fixed = w * padded_cin / cin - w + scratchpad;
    let n = batch_of(meta);
    let backward = chord(n, |k| {
        let at = |(a, c): (u64, u64)| a * k + c;
        let data = at(y) + fixed;
        let copies = (2 * at(x)).saturating_sub(w);
        at(weights.backward).max(data).max(copies)
    });
    Scratch { forward: weights.forward, backward, ..Scratch::default() }
}

/// `brgconv_strided`'s scratchpad, in elements of `elem` bytes (read on 1 and 2 threads): 12
/// KiB, and per thread 8 KiB and `channels` of one sample over the grid of the padded `sides`
/// divided by the stride, rounded up to 16 KiB; 4 KiB and 16 KiB per thread more when a stride
/// does not divide its side.
fn brgconv_strided_scratchpad(channels: u64, sides: &[i64], stride: &[i64], padding: &[i64], elem: u64) -> u64 {
    let grid: u64 = sides
        .iter()
        .zip(stride.iter().zip(padding))
        .map(|(&side, (&s, &p))| ((side + 2 * p).max(1) as u64).div_ceil(s.max(1) as u64))
        .product();
    let threads = threads().max(1) as u64;
    let per_thread = (channels * grid * elem).div_ceil(16 << 10) * (16 << 10);
    let uneven = sides.iter().zip(stride).any(|(&side, &s)| s > 1 && side % s != 0);
    ((12 << 10) + threads * (8216 + per_thread) + if uneven { (4 << 10) + threads * (16 << 10) } else { 0 }) / elem
}

/// An input gradient made blocked (`x_r`, from the blocked output gradient `y_r` and weight
/// `w_r`), then copied out plain once those two are freed: its scratch beyond the plain input
/// gradient `x` and weight gradient `w` the plan counts itself.
fn blocked_input_grad(y_r: u64, w_r: u64, x_r: u64, x: u64, w: u64) -> u64 {
    (y_r + w_r + x_r).saturating_sub(x + w).max(x_r.saturating_sub(w))
}

/// A transposed convolution's scratch: libtorch runs it as the backward of a convolution
/// (oneDNN's deconvolution for batched `Float` on the CPU, cuDNN's on CUDA). On the CPU, an
/// ungrouped one phase by phase, as oneDNN's verbose log and an allocation trace show it:
/// forward, a strided one through `brgconv_strided` (channels-last input, the weight padded, a
/// scratchpad sized as a strided convolution's input gradient, then its result made plain and
/// contiguous: three copies of the output live at once), an unstrided one blocked (input,
/// weight and output padded to channel blocks, and with a bias an output-sized buffer); backward, the
/// weight gradient from the blocked output gradient and input (with a scratchpad of up to
/// 48 KiB), the input gradient blocked and copied out plain, the weight gradient made plain.
fn transposed_scratch(inputs: &[Rc<Node>], meta: &Meta, stride: &[i64], padding: &[i64], groups: i64) -> Scratch {
    let elem = meta.kind.elt_size_in_bytes().max(1) as u64;
    let batched = meta.shape.len() == 4 && meta.batch().is_some();
    if meta.device.is_cuda() || meta.kind != Kind::Float || !batched || groups != 1 {
        let add = |a: (u64, u64), b: (u64, u64)| (a.0 + b.0, a.1 + b.1);
        let moved = add(add(inputs[0].meta.numel_parts(), inputs[1].meta.numel_parts()), meta.numel_parts());
        let mut scratch =
            Scratch { forward: moved, backward: add(moved, (0, (32 << 10) / elem)), ..Scratch::default() };
        if meta.device.is_cuda() {
            let (forward, backward) = scratch::CONV_WORKSPACE_FIXED;
            scratch.forward.1 += forward / elem;
            scratch.backward.1 += backward / elem;
        }
        return scratch;
    }
    let b = channel_block() as u64;
    let pad = Layouts::pad;
    let weight = &inputs[1].meta.shape;
    let (cin, cout) = (weight[0].max(1) as u64, meta.shape[1].max(1) as u64);
    let w = shape::numel(weight).max(0) as u64;
    let w_blk = pad(pad(w, cin, b), cout, b);
    let (xp, yp) = (inputs[0].meta.numel_parts(), meta.numel_parts());
    let n = batch_of(meta);
    let strided = stride.iter().any(|&s| s != 1);
    // The strided kernel's scratchpad: as a strided convolution's input gradient, on the input's
    // channels over the padded output's grid.
    let scratchpad = brgconv_strided_scratchpad(cin, &meta.shape[2..], stride, padding, elem);
    let forward = chord(n, |k| {
        let (x, y) = (xp.0 * k + xp.1, yp.0 * k + yp.1);
        if strided {
            (scratchpad + x + pad(w, cout, 2 * b)).max(2 * y)
        } else {
            // With a bias, an output-sized buffer more (the unstrided kernel adds it apart).
            let bias = if inputs.len() > 2 { pad(y, cout, b) + 128 / elem } else { 0 };
            (pad(x, cin, b) + w_blk + pad(y, cout, b) + bias).saturating_sub(y)
        }
    });
    let input_grad = requires(inputs, 0);
    // The weight gradient is a convolution's, reading the output gradient as its input: fewer
    // than 4 of its channels stay plain, fewer than a block take half blocks (as `Layouts`).
    let plain = cout < 4;
    let kb = if b == 16 && (4..b).contains(&cout) { b / 2 } else { b };
    let w_weights = if plain { pad(w, cin, kb) } else { pad(pad(w, cin, kb), cout, kb) };
    let backward = chord(n, |k| {
        let (x, y) = (xp.0 * k + xp.1, yp.0 * k + yp.1);
        let (y_w, x_w) = (if plain { 0 } else { pad(y, cout, kb) }, pad(x, cin, kb));
        let weights = (y_w + x_w + w_weights + ((x + y) / 10).min((48 << 10) / elem)).saturating_sub(w);
        // The input gradient (a convolution of the output gradient), blocked, then copied out.
        let (x_r, y_r) = (pad(x, cin, b), pad(y, cout, b));
        let data = if input_grad { blocked_input_grad(y_r, w_blk, x_r, x, w) } else { 0 };
        weights.max(data).max(w_weights)
    });
    Scratch { forward, backward, ..Scratch::default() }
}

impl LazyTensor {
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
        weight: impl IntoLazy,
        bias: Option<impl IntoLazy>,
        stride: impl IntList,
        padding: impl IntList,
        output_padding: impl IntList,
        groups: i64,
        dilation: impl IntList,
    ) -> Result<LazyTensor, LazyError> {
        let name = "conv_transpose2d";
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let sx = &self.node.meta.shape;
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
        let sw = &w.node.meta.shape;
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
            if b.node.meta.shape != [c_out] {
                return Err(shape_err(name, sw, &b.node.meta.shape, format!("the bias must be [{c_out}]")));
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
        let out =
            if batched { vec![sx[0], c_out, spatial[0], spatial[1]] } else { vec![c_out, spatial[0], spatial[1]] };
        let op = Window::ConvTranspose2d { stride, padding, output_padding, dilation, groups };
        self.record_convolution(name, &w, b.as_ref(), out, 2, op)
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
        let n = &self.node;
        let name = "upsample_bilinear2d";
        let scales = [scales_h.into(), scales_w.into()];
        let (output, out) = self.upsampled(name, output_size.as_slice(), scales)?;
        floating(name, n)?;
        let flow = self.pool_flow(name, &out)?;
        let op = Window::UpsampleBilinear2d { output, align_corners, scales };
        Ok(Record::new(op, vec![n.clone()], out, n.meta.kind, n.meta.device).flow(flow).finish())
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
        weight: impl IntoLazy,
        bias: Option<impl IntoLazy>,
        stride: impl IntList,
        padding: impl IntList,
        dilation: impl IntList,
        groups: i64,
    ) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let (stride, padding, dilation) = (stride.as_slice(), padding.as_slice(), dilation.as_slice());
        self.convolution::<2>("conv2d", &w, b.as_ref(), [stride, padding, dilation], groups, |s, p, d| Window::Conv2d {
            stride: s,
            padding: p,
            dilation: d,
            groups,
        })
    }

    /// 1-D convolution, as tch's `conv1d`: `self` is `[N, C, L]` (or `[C, L]`), `weight`
    /// `[O, C / groups, k]`; `stride`, `padding` and `dilation` take 1 value.
    ///
    /// # Errors
    /// As [`f_conv2d`](Self::f_conv2d).
    #[allow(clippy::too_many_arguments)]
    pub fn f_conv1d(
        &self,
        weight: impl IntoLazy,
        bias: Option<impl IntoLazy>,
        stride: impl IntList,
        padding: impl IntList,
        dilation: impl IntList,
        groups: i64,
    ) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let (stride, padding, dilation) = (stride.as_slice(), padding.as_slice(), dilation.as_slice());
        self.convolution::<1>("conv1d", &w, b.as_ref(), [stride, padding, dilation], groups, |s, p, d| Window::Conv1d {
            stride: s,
            padding: p,
            dilation: d,
            groups,
        })
    }

    /// Records a convolution over `D` spatial dimensions.
    fn convolution<const D: usize>(
        &self,
        name: &'static str,
        w: &LazyTensor,
        b: Option<&LazyTensor>,
        [stride, padding, dilation]: [&[i64]; 3],
        groups: i64,
        op: impl FnOnce([i64; D], [i64; D], [i64; D]) -> Window,
    ) -> Result<LazyTensor, LazyError> {
        let sx = &self.node.meta.shape;
        let a = |r: String| arg(name, sx, r);
        let stride = shape::spatial::<D>(stride, "stride").map_err(a)?;
        let padding = shape::spatial::<D>(padding, "padding").map_err(a)?;
        let dilation = shape::spatial::<D>(dilation, "dilation").map_err(a)?;
        let sw = &w.node.meta.shape;
        let out = shape::conv(sx, sw, b.map(|b| b.node.meta.shape.as_slice()), stride, padding, dilation, groups)
            .map_err(|r| shape_err(name, sx, sw, r))?;
        self.record_convolution(name, w, b, out, D, op(stride, padding, dilation))
    }

    /// Records a convolution (plain or transposed) over `spatial` dimensions whose output shape
    /// is already checked: one device, floating kinds, and only a batched input's first
    /// dimension per-sample.
    fn record_convolution(
        &self,
        name: &'static str,
        w: &LazyTensor,
        b: Option<&LazyTensor>,
        out: Vec<i64>,
        spatial: usize,
        op: Window,
    ) -> Result<LazyTensor, LazyError> {
        let x = &self.node;
        let mut nodes = vec![x, &w.node];
        if let Some(b) = b {
            nodes.push(&b.node);
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
        let inputs = nodes.into_iter().cloned().collect();
        Ok(Record::new(op, inputs, out, x.meta.kind, device).flow(flow).finish())
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
        let n = &self.node;
        let name = "upsample_nearest2d";
        let (output, out) = self.upsampled(name, output_size.as_slice(), scales)?;
        let flow = self.pool_flow(name, &out)?;
        let op = Window::UpsampleNearest2d { output, scales };
        Ok(Record::new(op, vec![n.clone()], out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// An `output_size` of two values (`[h, w]`), as the 2-D resizing ops take it.
    fn output_pair(&self, name: &str, output_size: &[i64]) -> Result<[i64; 2], LazyError> {
        output_size
            .try_into()
            .map_err(|_| arg(name, &self.node.meta.shape, format!("output_size must be 2 values, got {output_size:?}")))
    }

    /// An upsampling's checked output size and output shape: a non-empty 4-D input, sizes of at
    /// least 1, and positive scales where given.
    fn upsampled(
        &self,
        name: &str,
        output_size: &[i64],
        scales: [Option<f64>; 2],
    ) -> Result<([i64; 2], Vec<i64>), LazyError> {
        let shape = &self.node.meta.shape;
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
        Ok((output, out))
    }

    fn pool_flow(&self, name: &str, out: &[i64]) -> Result<(Flow, Option<String>), LazyError> {
        let nd = self.node.meta.shape.len();
        unary_flow(name, &self.node, out, |d| (d + 2 < nd).then_some(d), Linearity::Nonlinear)
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
        let n = &self.node;
        let name = "max_pool2d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let kernel = shape::pair(kernel.as_slice(), "kernel_size").map_err(a)?;
        let stride =
            if stride.as_slice().is_empty() { kernel } else { shape::pair(stride.as_slice(), "stride").map_err(a)? };
        let padding = shape::pair(padding.as_slice(), "padding").map_err(a)?;
        let dilation = shape::pair(dilation.as_slice(), "dilation").map_err(a)?;
        let out = shape::pool2d(&n.meta.shape, kernel, stride, padding, dilation, ceil_mode).map_err(a)?;
        let flow = self.pool_flow(name, &out)?;
        let op = Window::MaxPool2d { kernel, stride, padding, dilation, ceil_mode };
        Ok(Record::new(op, vec![n.clone()], out, n.meta.kind, n.meta.device).flow(flow).finish())
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
        let n = &self.node;
        let name = "avg_pool2d";
        let a = |r: String| arg(name, &n.meta.shape, r);
        let kernel = shape::pair(kernel.as_slice(), "kernel_size").map_err(a)?;
        let stride =
            if stride.as_slice().is_empty() { kernel } else { shape::pair(stride.as_slice(), "stride").map_err(a)? };
        let padding = shape::pair(padding.as_slice(), "padding").map_err(a)?;
        let divisor_override = divisor_override.into();
        if divisor_override == Some(0) {
            return Err(a("divisor must be not zero".into()));
        }
        floating(name, n)?;
        let out = shape::pool2d(&n.meta.shape, kernel, stride, padding, [1, 1], ceil_mode).map_err(a)?;
        let flow = self.pool_flow(name, &out)?;
        let op = Window::AvgPool2d { kernel, stride, padding, ceil_mode, count_include_pad, divisor_override };
        Ok(Record::new(op, vec![n.clone()], out, n.meta.kind, n.meta.device).flow(flow).finish())
    }

    /// 2-D adaptive average pooling to `output_size` (`[h, w]`).
    ///
    /// # Errors
    /// [`LazyError::Argument`] for a non 3-/4-D input or a bad size.
    pub fn f_adaptive_avg_pool2d(&self, output_size: impl IntList) -> Result<LazyTensor, LazyError> {
        let n = &self.node;
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
        Ok(Record::new(Window::AdaptiveAvgPool2d { output }, vec![n.clone()], out, n.meta.kind, n.meta.device)
            .flow(flow)
            .finish())
    }
}

panicking! {
    conv1d => f_conv1d(weight: impl IntoLazy, bias: Option<impl IntoLazy>, stride: impl IntList, padding: impl IntList, dilation: impl IntList, groups: i64);
    conv2d => f_conv2d(weight: impl IntoLazy, bias: Option<impl IntoLazy>, stride: impl IntList, padding: impl IntList, dilation: impl IntList, groups: i64);
    max_pool2d => f_max_pool2d(kernel: impl IntList, stride: impl IntList, padding: impl IntList, dilation: impl IntList, ceil_mode: bool);
    avg_pool2d => f_avg_pool2d(kernel: impl IntList, stride: impl IntList, padding: impl IntList, ceil_mode: bool, count_include_pad: bool, divisor_override: impl Into<Option<i64>>);
    adaptive_avg_pool2d => f_adaptive_avg_pool2d(output_size: impl IntList);
    upsample_nearest2d => f_upsample_nearest2d(output_size: impl IntList, scales_h: impl Into<Option<f64>>, scales_w: impl Into<Option<f64>>);
    upsample_bilinear2d => f_upsample_bilinear2d(output_size: impl IntList, align_corners: bool, scales_h: impl Into<Option<f64>>, scales_w: impl Into<Option<f64>>);
    conv_transpose2d => f_conv_transpose2d(weight: impl IntoLazy, bias: Option<impl IntoLazy>, stride: impl IntList, padding: impl IntList, output_padding: impl IntList, groups: i64, dilation: impl IntList);
}
