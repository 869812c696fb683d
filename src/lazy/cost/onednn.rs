//! oneDNN's x86 convolutions on the CPU, phase by phase: for each primitive oneDNN runs, which
//! operands it reorders into blocked layouts, what it pads, and what its scratchpad holds.
//!
//! The rules were read from oneDNN's verbose log (`ONEDNN_VERBOSE=1`: each primitive, its
//! kernel and its layouts) and from a trace of every allocation libtorch's CPU allocator makes
//! (`TOMA_TRACE_CPU_ALLOCATIONS=1`), with libtorch 2.11.0 (oneDNN 3.10.2) on AVX-512, on one and
//! two threads (DEVELOPERS.md says how; `tests/lazy_peak.rs` holds what they measured). The
//! library version, the vector width and the thread count are inputs ([`OneDnn`]), not read
//! from the host here, so a plan can be made for another machine; a version other than the
//! one the rules were read on is priced by them all the same, and says so
//! ([`OneDnn::validated`]).
//!
//! Everything here is in elements of the convolution's kind; the cost layer makes bytes.

use super::work::{batch_of, chord, Scratch};
use crate::lazy::graph::Convolution;
use crate::lazy::shape;
use crate::lazy::size::Elements;

/// The libtorch release the rules were read on (it bundles oneDNN 3.10.2).
pub(crate) const READ_ON: (u32, u32) = (2, 11);

/// Fixed buffers of the weight gradient's scratchpad when the threads split the batch (read on
/// 2 threads): 21 KiB, and 25 KiB for the half-block kernel.
const WEIGHT_GRAD_SPLIT_FIXED_KIB: u64 = 21;
const WEIGHT_GRAD_SPLIT_FIXED_HALF_KIB: u64 = 25;
/// The weight gradient's scratchpad otherwise: a tenth of input and output gradient, at most
/// 48 KiB; at least 13 KiB when the input channels' blocks divide among the threads but the
/// output's do not.
const WEIGHT_GRAD_SCRATCHPAD_MAX_KIB: u64 = 48;
const WEIGHT_GRAD_SCRATCHPAD_MIN_KIB: u64 = 13;
/// No weight-gradient kernel takes a kernel side this large (a ViT patch embedding's 16×16):
/// oneDNN's gemm computes it.
const GEMM_KERNEL_SIDE: i64 = 15;
/// A padded kernel side this large may be left to the gemm forward (by a rule not read).
const LARGE_PADDED_KERNEL_SIDE: i64 = 11;
/// The gemm forward's columns cover at most this many output positions per thread.
const GEMM_FORWARD_POSITIONS: u64 = 64;
/// The gemm's small fixed buffers: 128 bytes forward and for the input gradient, 256 for the
/// weight gradient.
const GEMM_FIXED_BYTES: u64 = 128;
const GEMM_WEIGHT_GRAD_FIXED_BYTES: u64 = 256;
/// The gemm weight gradient keeps this many copies of the weight gradient per thread (read on
/// 1 and 2 threads), and its columns per thread on maps of up to this many output positions
/// (beyond, the threads share one sample's columns in pieces).
const GEMM_WEIGHT_GRAD_COPIES: u64 = 4;
const GEMM_COLUMNS_PER_THREAD_UP_TO: u64 = 256;
/// `brgconv_strided`'s scratchpad: 12 KiB, and per thread 8216 bytes and the output gradient
/// of one sample over the padded grid rounded up to 16 KiB; 4 KiB and 16 KiB per thread more
/// when a stride does not divide its side.
const BRGCONV_FIXED: u64 = 12 << 10;
const BRGCONV_PER_THREAD: u64 = 8216;
const BRGCONV_ROUND: u64 = 16 << 10;
const BRGCONV_UNEVEN_FIXED: u64 = 4 << 10;
const BRGCONV_UNEVEN_PER_THREAD: u64 = 16 << 10;
/// Fewer input channels than this stay plain in the weight gradient (a first layer).
const PLAIN_INPUT_CHANNELS: u64 = 4;

/// oneDNN on one x86 CPU: the libtorch release it came with, its channel block (16 with
/// AVX-512, 8 with AVX2) and libtorch's intra-op threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OneDnn {
    pub(crate) libtorch: Option<(u32, u32)>,
    pub(crate) block: u64,
    pub(crate) threads: u64,
}

impl OneDnn {
    /// Whether the rules were read on this library version (unknown counts as not).
    pub(crate) fn validated(&self) -> bool {
        self.libtorch == Some(READ_ON)
    }

    /// A batched convolution's scratch (not transposed): ungrouped (`phased`, and
    /// `strided_input_grad` for a strided one's input gradient) or grouped (`grouped`).
    pub(crate) fn convolution(&self, c: &Convolution<'_>) -> Scratch {
        if c.groups > 1 {
            return self.grouped(c, c.input_grad);
        }
        // `brgconv_strided` takes no dilation: a dilated strided input gradient is the gemm's.
        if c.input_grad && c.strided() && !c.dilated() {
            return self.strided_input_grad(c);
        }
        self.phased(c, c.input_grad)
    }

    /// Whether oneDNN's weight-gradient kernels leave a dilated convolution to its gemm: when
    /// strided, or when the dilated kernel is wider than the input.
    fn dilated_gemm(c: &Convolution<'_>) -> bool {
        let input = &c.input.shape[2..];
        c.dilated()
            && (c.strided()
                || input.iter().zip(c.kernel()).zip(c.dilation).any(|((&side, &k), &d)| (k - 1) * d + 1 > side))
    }

    /// `k` KiB in elements of `elem` bytes.
    fn kib(k: u64, elem: u64) -> u64 {
        (k << 10) / elem
    }

    /// An ungrouped convolution's scratch, unstrided or without an input gradient, phase by
    /// phase (see [`Layouts`]): each phase's live buffers beyond what the plan counts itself
    /// (the output, the gradients), the largest phase taken. Forward: the reordered operands
    /// with the blocked output, then the blocked output with its plain copy. Backward: the
    /// input gradient's primitive, then the weight gradient's (reorders, the blocked weight
    /// gradient and a scratchpad: a reduction copy of it per extra thread when the threads must
    /// split the batch, since the channel blocks do not divide among them), then the weight
    /// gradient made plain. Where oneDNN's kernels decline (a kernel side of 15 or more,
    /// dilations, maps smaller than the kernel, padding wider than the output), its gemm's
    /// columns instead.
    fn phased(&self, c: &Convolution<'_>, input_grad: bool) -> Scratch {
        let (stride, padding) = (c.stride, c.padding);
        let weight = &c.weight.shape;
        let input = &c.input.shape;
        let elem = c.output.kind.elt_size_in_bytes().max(1) as u64;
        let pointwise = weight[2..].iter().all(|&k| k == 1);
        let l = Layouts {
            block: self.block,
            threads: self.threads,
            cin: weight[1].max(1) as u64,
            cout: weight[0].max(1) as u64,
            pointwise,
            uneven: input[2..].iter().zip(stride).any(|(&side, &s)| s > 1 && side % s != 0),
            strided: c.strided(),
            positions: shape::numel(&c.output.shape[2..]).max(0) as u64,
        };
        let (cb, cin, cout) = (l.block, l.cin, l.cout);
        let pad = Layouts::pad;
        let w = shape::numel(weight).max(0) as u64;
        let (xp, yp) = (c.input.elements(), c.output.elements());
        let threads = self.threads;
        let n = batch_of(c.output);
        let kib = |k: u64| Self::kib(k, elem);

        let one_by_one = pointwise && !l.uneven;
        // Padding wider than the output leaves the forward and the input gradient to oneDNN's
        // gemm (plain layouts, its columns per thread). A large padded kernel may be left to it
        // too (by a rule not read here): its columns are then a floor.
        let pad_beyond = padding.iter().zip(&c.output.shape[2..]).any(|(&p, &o)| p > o);
        let large_padded = weight[2..].iter().any(|&k| k >= LARGE_PADDED_KERNEL_SIDE) && padding.iter().any(|&p| p > 0);
        // The gemm's threads split the micro-batch: fewer samples than threads leave some idle.
        let gemm_columns = |k: u64| {
            threads.min(k) * cin * shape::numel(&weight[2..]).max(0) as u64 * l.positions.min(GEMM_FORWARD_POSITIONS)
                + GEMM_FIXED_BYTES / elem
        };
        let forward = chord(n, |k| {
            let (x, y) = (xp.at(k), yp.at(k));
            if pad_beyond {
                return gemm_columns(k);
            }
            let x_r = if one_by_one || cin >= cb { pad(x, cin, cb) } else { 0 };
            let w_r = if one_by_one || cin >= cb { pad(pad(w, cin, cb), cout, cb) } else { pad(w, cout, cb) };
            let y_blk = pad(y, cout, cb);
            let jit = (x_r + w_r + y_blk + l.unit_stride_copy()).saturating_sub(y).max(y_blk);
            if large_padded {
                jit.max(gemm_columns(k))
            } else {
                jit
            }
        });

        // The weight gradient's kernel: its channel blocks (input, output), and whether it
        // reads the input plain.
        let half = cb == 16 && !one_by_one && (PLAIN_INPUT_CHANNELS..cb).contains(&cin);
        let kb = if half { cb / 2 } else { cb };
        let plain_input = !one_by_one && cin < PLAIN_INPUT_CHANNELS;
        // No weight-gradient kernel takes a kernel side of 15 or more, and the half-block one
        // no input side smaller than the kernel's: oneDNN's gemm computes those on plain
        // layouts (`gemm_weight_grad`), and so it does dilated ones (`dilated_gemm`).
        let kernel = &weight[2..];
        let gemm = kernel.iter().any(|&k| k >= GEMM_KERNEL_SIDE)
            || (half && (c.dilated() || input[2..].iter().zip(kernel).any(|(&side, &k)| side < k)))
            || Self::dilated_gemm(c);
        // A dilated strided input gradient: the gemm's columns per thread, then copied out plain.
        let data_gemm = input_grad && c.strided() && c.dilated();
        let data_columns =
            |k: u64| threads.min(k) * cin * shape::numel(kernel).max(0) as u64 * l.positions + GEMM_FIXED_BYTES / elem;
        let columns = cin * shape::numel(kernel).max(0) as u64 * l.positions;
        let backward = chord(n, |k| {
            let (x, y) = (xp.at(k), yp.at(k));
            let data = if data_gemm {
                data_columns(k).max(x).saturating_sub(w)
            } else if input_grad && pad_beyond {
                gemm_columns(k).max(x).saturating_sub(w)
            } else if input_grad {
                blocked_input_grad(pad(y, cout, cb), pad(pad(w, cin, cb), cout, cb), pad(x, cin, cb), x, w)
            } else {
                0
            };
            if gemm {
                return self.gemm_weight_grad(w, columns, l.positions, elem, threads.min(k)).max(data);
            }
            let y_r = pad(y, cout, kb);
            let x_r = if plain_input { 0 } else { pad(x, cin, kb) };
            let w_blk = if plain_input { pad(w, cout, kb) } else { pad(pad(w, cin, kb), cout, kb) };
            let (nb_in, nb_out) = (if plain_input { 1 } else { cin.div_ceil(kb) }, cout.div_ceil(kb));
            // The threads that split the batch: one sample leaves one at work, with no reduction
            // (a 3→4-channel 5×5 weight gradient at one sample took 30 KiB less than the line
            // through 2 and 32 samples, measured on AVX-512 with 2 threads).
            let splitting = threads.min(k);
            let scratchpad = if splitting > 1 && nb_out % threads != 0 && nb_in % threads != 0 {
                // The batch split among threads: a reduction copy of the weight gradient per
                // extra thread, and fixed buffers.
                let fixed = if half { WEIGHT_GRAD_SPLIT_FIXED_HALF_KIB } else { WEIGHT_GRAD_SPLIT_FIXED_KIB };
                (splitting - 1) * w_blk + kib(fixed)
            } else if nb_in % threads == 0 && nb_out % threads != 0 {
                ((x + y) / 10).clamp(kib(WEIGHT_GRAD_SCRATCHPAD_MIN_KIB), kib(WEIGHT_GRAD_SCRATCHPAD_MAX_KIB))
            } else {
                ((x + y) / 10).min(kib(WEIGHT_GRAD_SCRATCHPAD_MAX_KIB))
            };
            let weights = (y_r + x_r + w_blk + scratchpad + l.unit_stride_copy()).saturating_sub(w);
            weights.max(w_blk).max(data)
        });
        Scratch { forward, backward }
    }

    /// A grouped convolution's scratch, phase by phase. Layouts pad channels to blocks of the
    /// group's width (16, 8 or 4 channels), a depthwise convolution's to blocks of 16 over all
    /// of them. Forward: the reordered input and weight with the blocked output, then the
    /// blocked output with its plain copy (a strided 1×1 convolution first copies its input at
    /// unit stride, a sample per thread). Backward: the input gradient's primitive, then its
    /// blocked result copied out plain; then the weight gradient's: a depthwise 3×3, and groups
    /// of a multiple of 8 channels, reorder the output gradient and the input the same way (no
    /// scratchpad: the threads split the groups); other kernels and group widths, and maps
    /// smaller than the kernel (but with groups of 16 channels), go to oneDNN's gemm on plain
    /// layouts (`gemm_weight_grad`). In 3-D, a depthwise convolution runs other kernels
    /// (`depthwise_3d`), and groups of 8 channels have no half-block weight-gradient kernel: the
    /// gemm takes every group width but multiples of 16 (`gemm_weight_grad_3d`).
    fn grouped(&self, c: &Convolution<'_>, input_grad: bool) -> Scratch {
        let groups = c.groups;
        let block = self.block as i64;
        let weight = &c.weight.shape;
        let kernel = &weight[2..];
        let cin = (weight[1] * groups.max(1)).max(1);
        let o = c.output.shape[1].max(1);
        let (xp, yp) = (c.input.elements(), c.output.elements());
        let w = shape::numel(weight).max(0) as u64;
        let elem = c.output.kind.elt_size_in_bytes().max(1) as u64;
        let n = batch_of(c.output);
        let (cb, cin_u, o_u) = (block as u64, cin as u64, o as u64);
        let copies = if kernel.iter().all(|&k| k == 1) && c.strided() {
            self.threads * cin_u.div_ceil(cb) * cb * shape::numel(&c.output.shape[2..]).max(0) as u64
        } else {
            0
        };
        // The channels each layout pads to: a depthwise convolution's to whole blocks over all
        // of them, a grouped one's to blocks of its group's width (16, 8 or 4 channels).
        let per_group = weight[1].max(1) as u64;
        let depthwise = per_group == 1 && o == cin;
        let volumetric = kernel.len() == 3;
        if volumetric && depthwise {
            return self.depthwise_3d(c, input_grad);
        }
        let group_block = [16, 8, 4].into_iter().find(|&g| per_group % g == 0).unwrap_or(1);
        let (x_ch, y_ch) = if depthwise {
            (cin_u.div_ceil(cb) * cb, o_u.div_ceil(cb) * cb)
        } else {
            let g = groups.max(1) as u64;
            (g * per_group.div_ceil(group_block) * group_block, g * (o_u / g).div_ceil(group_block) * group_block)
        };
        let positions_per_kernel = shape::numel(kernel).max(0) as u64;
        let w_r = positions_per_kernel * if depthwise { y_ch } else { y_ch * x_ch / groups.max(1) as u64 };
        let forward = chord(n, |k| {
            let (x, y) = (xp.at(k), yp.at(k));
            let (x_r, y_r) = (x / cin_u * x_ch, y / o_u * y_ch);
            (x_r + w_r + y_r + copies).saturating_sub(y).max(y_r)
        });
        // As ungrouped, the depthwise and the half-block (8 channels a group) kernels take no
        // input side smaller than the kernel's.
        let small_map = c.input.shape[2..].iter().zip(kernel).any(|(&side, &k)| side < k);
        let gemm = ((small_map || c.dilated()) && (depthwise || per_group % 16 != 0))
            || Self::dilated_gemm(c)
            || if depthwise {
                kernel.iter().any(|&k| k != 3)
            } else {
                // 3-D has no half-block kernel.
                per_group % if volumetric { 16 } else { 8 } != 0
            };
        let positions = shape::numel(&c.output.shape[2..]).max(0) as u64;
        let columns = per_group * positions_per_kernel * positions;
        let backward = chord(n, |k| {
            let (x, y) = (xp.at(k), yp.at(k));
            let (x_r, y_r) = (x / cin_u * x_ch, y / o_u * y_ch);
            let data = if input_grad { blocked_input_grad(y_r, w_r, x_r, x, w) } else { 0 };
            let weights = if gemm && volumetric {
                let (columns, slice) = Self::slice_columns(c);
                self.gemm_weight_grad_3d(w, columns, slice, elem)
            } else if gemm {
                // The threads split the groups, whatever the samples.
                self.gemm_weight_grad(w, columns, positions, elem, self.threads)
            } else {
                (y_r + x_r + w_r).saturating_sub(w).max(w_r)
            };
            data.max(weights)
        });
        Scratch { forward, backward }
    }

    /// A depthwise 3-D convolution's scratch, phase by phase: oneDNN 3.10.2 has no blocked 3-D
    /// depthwise kernel (read from its verbose log and the allocator's trace,
    /// `tests/lazy_peak.rs::one_convolution_at_a_time` with a depth). Forward, `brdgmm_dw` on
    /// channels-last layouts: the input reordered, the weight padded to channel blocks, the
    /// output made channels-last, then copied contiguous (three outputs live at once). The
    /// input gradient is the gemm's on plain layouts: the columns of one depth slice of the
    /// output per thread beside the gradient's buffer, which is then copied out. The weight
    /// gradient is the gemm's too (`gemm_weight_grad_3d`).
    fn depthwise_3d(&self, c: &Convolution<'_>, input_grad: bool) -> Scratch {
        let weight = &c.weight.shape;
        let (xp, yp) = (c.input.elements(), c.output.elements());
        let w = shape::numel(weight).max(0) as u64;
        let elem = c.output.kind.elt_size_in_bytes().max(1) as u64;
        let n = batch_of(c.output);
        let w_r = Layouts::pad(w, c.output.shape[1].max(1) as u64, self.block);
        let forward = chord(n, |k| {
            let (x, y) = (xp.at(k), yp.at(k));
            (x + w_r + y).max(3 * y) - y
        });
        let (columns, slice) = Self::slice_columns(c);
        let data_columns = self.threads * columns + GEMM_FIXED_BYTES / elem;
        let weights = self.gemm_weight_grad_3d(w, columns, slice, elem);
        let backward = chord(n, |k| {
            let x = xp.at(k);
            let data = if input_grad { x.max(data_columns).saturating_sub(w) } else { 0 };
            data.max(weights)
        });
        Scratch { forward, backward }
    }

    /// A 3-D convolution's gemm columns for one depth slice of its output (a group's input
    /// channels times the kernel, over the slice's positions), and the slice's positions.
    fn slice_columns(c: &Convolution<'_>) -> (u64, u64) {
        let out = &c.output.shape;
        let slice = shape::numel(&out[out.len() - 2..]).max(0) as u64;
        let per_group = c.weight.shape[1].max(1) as u64;
        (per_group * shape::numel(c.kernel()).max(0) as u64 * slice, slice)
    }

    /// oneDNN's gemm weight gradient of a 3-D convolution, in elements: a thread's columns (one
    /// depth slice of the output) and four copies of the weight gradient, on every thread when
    /// a slice has at most 256 positions, else on one; fixed bytes.
    fn gemm_weight_grad_3d(&self, w: u64, columns: u64, slice: u64, elem: u64) -> u64 {
        let threads = if slice <= GEMM_COLUMNS_PER_THREAD_UP_TO { self.threads } else { 1 };
        threads * (GEMM_WEIGHT_GRAD_COPIES * w + columns) + GEMM_WEIGHT_GRAD_FIXED_BYTES / elem
    }

    /// oneDNN's gemm weight gradient on `threads` threads at work (an ungrouped one's split the
    /// samples, so fewer samples leave some idle), in elements: copies of the weight gradient
    /// per thread, fixed bytes, and the columns (`columns` elements for one sample) of each
    /// thread on small maps; on larger maps the threads share one sample's columns in pieces.
    fn gemm_weight_grad(&self, w: u64, columns: u64, positions: u64, elem: u64, threads: u64) -> u64 {
        let threads = threads.max(1);
        let column_threads = if positions <= GEMM_COLUMNS_PER_THREAD_UP_TO { threads } else { 1 };
        GEMM_WEIGHT_GRAD_COPIES * threads * w + column_threads * columns + GEMM_WEIGHT_GRAD_FIXED_BYTES / elem
    }

    /// The backward of an ungrouped strided convolution with an input gradient: three phases,
    /// one after another, so its scratch is the largest of them:
    /// - the input gradient (oneDNN's `brgconv_strided`): the output gradient reordered to
    ///   channels-last, the weight with its input channels padded (to a block, or two blocks
    ///   from one on), and a scratchpad (`brgconv_strided_scratchpad`);
    /// - that gradient made plain: for a moment three copies of the input's size are live;
    /// - the weight gradient: as without an input gradient.
    fn strided_input_grad(&self, c: &Convolution<'_>) -> Scratch {
        let weights = self.phased(c, false);
        let elem = c.output.kind.elt_size_in_bytes().max(1) as u64;
        let block = self.block;
        let input = &c.input.shape;
        let cin = input[1].max(1) as u64;
        let w = shape::numel(&c.weight.shape).max(0) as u64;
        let padded_cin = if cin <= block { block } else { cin.div_ceil(2 * block) * 2 * block };
        let (x, y) = (c.input.elements(), c.output.elements());
        let scratchpad =
            self.brgconv_strided_scratchpad(c.output.shape[1].max(1) as u64, &input[2..], c.stride, c.padding, elem);
        let fixed = w * padded_cin / cin - w + scratchpad;
        let n = batch_of(c.output);
        let backward = chord(n, |k| {
            // The lines at `k` (a weight gradient's own value at one sample aside).
            let at = |e: Elements| e.per * k + e.fixed;
            let data = at(y) + fixed;
            let copies = (2 * at(x)).saturating_sub(w);
            at(weights.backward).max(data).max(copies)
        });
        Scratch { forward: weights.forward, backward }
    }

    /// `brgconv_strided`'s scratchpad, in elements of `elem` bytes: fixed buffers, and per
    /// thread a buffer and `channels` of one sample over the grid of the padded `sides` divided
    /// by the stride, rounded up; more when a stride does not divide its side.
    fn brgconv_strided_scratchpad(
        &self,
        channels: u64,
        sides: &[i64],
        stride: &[i64],
        padding: &[i64],
        elem: u64,
    ) -> u64 {
        let grid: u64 = sides
            .iter()
            .zip(stride.iter().zip(padding))
            .map(|(&side, (&s, &p))| ((side + 2 * p).max(1) as u64).div_ceil(s.max(1) as u64))
            .product();
        let threads = self.threads;
        let per_thread = (channels * grid * elem).div_ceil(BRGCONV_ROUND) * BRGCONV_ROUND;
        let uneven = sides.iter().zip(stride).any(|(&side, &s)| s > 1 && side % s != 0);
        let uneven_extra = if uneven { BRGCONV_UNEVEN_FIXED + threads * BRGCONV_UNEVEN_PER_THREAD } else { 0 };
        (BRGCONV_FIXED + threads * (BRGCONV_PER_THREAD + per_thread) + uneven_extra) / elem
    }

    /// A batched ungrouped transposed convolution (oneDNN's deconvolution), phase by phase.
    /// Forward: a strided one through `brgconv_strided` (channels-last input, the weight
    /// padded, a scratchpad sized as a strided convolution's input gradient, then its result
    /// made plain and contiguous: three copies of the output live at once), an unstrided one
    /// blocked (input, weight and output padded to channel blocks, and with a bias an
    /// output-sized buffer). Backward: the weight gradient from the blocked output gradient and
    /// input (with a scratchpad of up to 48 KiB), the input gradient blocked and copied out
    /// plain, the weight gradient made plain.
    pub(crate) fn transposed(&self, c: &Convolution<'_>) -> Scratch {
        let elem = c.output.kind.elt_size_in_bytes().max(1) as u64;
        let cb = self.block;
        let pad = Layouts::pad;
        let weight = &c.weight.shape;
        let (cin, cout) = (weight[0].max(1) as u64, c.output.shape[1].max(1) as u64);
        let w = shape::numel(weight).max(0) as u64;
        let w_blk = pad(pad(w, cin, cb), cout, cb);
        let (xp, yp) = (c.input.elements(), c.output.elements());
        let n = batch_of(c.output);
        let strided = c.strided();
        // The strided kernel's scratchpad: as a strided convolution's input gradient, on the
        // input's channels over the padded output's grid.
        let scratchpad = self.brgconv_strided_scratchpad(cin, &c.output.shape[2..], c.stride, c.padding, elem);
        let forward = chord(n, |k| {
            let (x, y) = (xp.at(k), yp.at(k));
            if strided {
                (scratchpad + x + pad(w, cout, 2 * cb)).max(2 * y)
            } else {
                // With a bias, an output-sized buffer more (the unstrided kernel adds it apart).
                let bias = if c.bias { pad(y, cout, cb) + GEMM_FIXED_BYTES / elem } else { 0 };
                (pad(x, cin, cb) + w_blk + pad(y, cout, cb) + bias).saturating_sub(y)
            }
        });
        // The weight gradient is a convolution's, reading the output gradient as its input:
        // fewer than 4 of its channels stay plain, fewer than a block take half blocks.
        let plain = cout < PLAIN_INPUT_CHANNELS;
        let kb = if cb == 16 && (PLAIN_INPUT_CHANNELS..cb).contains(&cout) { cb / 2 } else { cb };
        let w_weights = if plain { pad(w, cin, kb) } else { pad(pad(w, cin, kb), cout, kb) };
        let backward = chord(n, |k| {
            let (x, y) = (xp.at(k), yp.at(k));
            let (y_w, x_w) = (if plain { 0 } else { pad(y, cout, kb) }, pad(x, cin, kb));
            let scratchpad = ((x + y) / 10).min(Self::kib(WEIGHT_GRAD_SCRATCHPAD_MAX_KIB, elem));
            let weights = (y_w + x_w + w_weights + scratchpad).saturating_sub(w);
            // The input gradient (a convolution of the output gradient), blocked, then copied out.
            let (x_r, y_r) = (pad(x, cin, cb), pad(y, cout, cb));
            let data = if c.input_grad { blocked_input_grad(y_r, w_blk, x_r, x, w) } else { 0 };
            weights.max(data).max(w_weights)
        });
        Scratch { forward, backward }
    }
}

/// The layouts of an ungrouped convolution's primitives, as oneDNN picks them (`block` is the
/// channel block):
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
    threads: u64,
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
    /// `n` elements over `c` channels, padded to whole blocks of `cb` channels.
    fn pad(n: u64, c: u64, cb: u64) -> u64 {
        n / c.max(1) * c.div_ceil(cb) * cb
    }

    /// The unit-stride copy of a strided 1×1 convolution's input, a sample per thread.
    fn unit_stride_copy(&self) -> u64 {
        if self.pointwise && self.strided && !self.uneven {
            self.threads * self.cin.div_ceil(self.block) * self.block * self.positions
        } else {
            0
        }
    }
}

/// An input gradient made blocked (`x_r`, from the blocked output gradient `y_r` and weight
/// `w_r`), then copied out plain once those two are freed: its scratch beyond the plain input
/// gradient `x` and weight gradient `w` the plan counts itself.
fn blocked_input_grad(y_r: u64, w_r: u64, x_r: u64, x: u64, w: u64) -> u64 {
    (y_r + w_r + x_r).saturating_sub(x + w).max(x_r.saturating_sub(w))
}
