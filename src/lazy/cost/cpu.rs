//! The CPU model: libtorch's CPU kernels, and which convolutions libtorch hands to oneDNN
//! (its `ConvParams::use_mkldnn`) rather than to its native im2col kernel.

use std::sync::OnceLock;

use tch::Kind;

use super::onednn::OneDnn;
use super::work::Scratch;
use crate::lazy::graph::Convolution;
use crate::lazy::shape;

/// libtorch's rule: a 1×1 unstrided convolution of fewer samples than this, on one thread,
/// stays native.
const POINTWISE_ONEDNN_FROM: i64 = 16;
/// libtorch's rule: a batch of one of at most this many input elements stays native, unless
/// grouped or with a kernel larger than 3×3.
const SMALL_SINGLE_SAMPLE: i64 = 20480;
const SMALL_KERNEL_SIDE: i64 = 3;
/// A transposed convolution libtorch runs natively (not `Float`, unbatched or grouped) takes
/// its operands moved, and 32 KiB more in its backward.
const NATIVE_TRANSPOSED_BACKWARD_FIXED: u64 = 32 << 10;

/// One CPU, as libtorch runs kernels on it: its intra-op threads and its oneDNN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cpu {
    pub(crate) threads: u64,
    pub(crate) onednn: OneDnn,
}

impl Cpu {
    /// This machine: libtorch's intra-op threads (asked once), oneDNN's channel block for its
    /// vector width (16 with AVX-512, else 8), the libtorch toma was built against.
    pub(crate) fn host() -> &'static Cpu {
        static HOST: OnceLock<Cpu> = OnceLock::new();
        HOST.get_or_init(|| {
            let threads = tch::get_num_threads().max(1) as u64;
            let cpu = Cpu::new(threads, host_block(), libtorch_version());
            if !cpu.onednn.validated() {
                let (major, minor) = super::onednn::READ_ON;
                tracing::warn!(
                    libtorch = ?cpu.onednn.libtorch,
                    "toma: the planner's oneDNN convolution rules were read on libtorch {major}.{minor}; plans of \
                     CPU convolutions on this libtorch are not validated (measure them: TOMA_PLAN_SNAPSHOT, \
                     tests/lazy_peak.rs)"
                );
            }
            cpu
        })
    }

    /// A CPU of `threads` intra-op threads whose oneDNN uses channel blocks of `block`, with
    /// the libtorch release `libtorch`.
    pub(crate) fn new(threads: u64, block: u64, libtorch: Option<(u32, u32)>) -> Cpu {
        let threads = threads.max(1);
        Cpu { threads, onednn: OneDnn { libtorch, block, threads } }
    }

    /// A convolution's scratch: oneDNN's, or libtorch's native kernels'.
    pub(crate) fn convolution(&self, c: &Convolution<'_>) -> Scratch {
        if c.transposed {
            return self.transposed(c);
        }
        let mut scratch = self.contiguous_convolution(c);
        // A strided input (a view: a narrow, a transpose) is copied to a contiguous one when the
        // convolution runs, and again when its backward runs (autograd keeps the view).
        let x = c.input;
        if !shape::is_contiguous(&x.shape, &x.strides) {
            let parts = x.numel_parts();
            scratch.add(parts, parts);
        }
        scratch
    }

    /// A convolution's scratch, its input taken as contiguous.
    fn contiguous_convolution(&self, c: &Convolution<'_>) -> Scratch {
        let n = c.output.batch().map_or(1, |bd| bd.size);
        let per_sample = shape::numel(&c.input.shape) / n.max(1);
        if c.output.kind == Kind::Float && c.batched() && self.uses_onednn(c, n, per_sample) {
            let mut scratch = self.onednn.convolution(c);
            // A micro-batch of one that libtorch runs natively: the larger of the two there.
            if n > 1 && c.output.batch().is_some() && !self.uses_onednn(c, 1, per_sample) {
                let cols = columns(c);
                let at_one = |(a, c): (u64, u64)| (a + c).max(cols);
                scratch.single = Some((at_one(scratch.forward), at_one(scratch.backward)));
            }
            return scratch;
        }
        im2col(c)
    }

    /// Whether libtorch hands a batched `Float` convolution of `batch` samples of
    /// `per_sample` input elements to oneDNN (`ConvParams::use_mkldnn`).
    fn uses_onednn(&self, c: &Convolution<'_>, batch: i64, per_sample: i64) -> bool {
        let kernel = c.kernel();
        let one_by_one = kernel.iter().all(|&k| k == 1);
        let strided = c.strided() || c.dilated();
        let wide_kernel = kernel.iter().all(|&k| k > SMALL_KERNEL_SIDE);
        (!one_by_one || strided || batch >= POINTWISE_ONEDNN_FROM || self.threads > 1)
            && (c.groups > 1 || wide_kernel || batch > 1 || per_sample > SMALL_SINGLE_SAMPLE)
    }

    /// A transposed convolution: oneDNN's deconvolution when batched, ungrouped and `Float`;
    /// else libtorch's native kernel, which moves its operands.
    fn transposed(&self, c: &Convolution<'_>) -> Scratch {
        let batched = c.output.shape.len() == 4 && c.output.batch().is_some();
        if c.output.kind == Kind::Float && batched && c.groups == 1 {
            return self.onednn.transposed(c);
        }
        let elem = c.output.kind.elt_size_in_bytes().max(1) as u64;
        let (x, w, y) = (c.input.numel_parts(), c.weight.numel_parts(), c.output.numel_parts());
        let moved = (x.0 + w.0 + y.0, x.1 + w.1 + y.1);
        Scratch { forward: moved, backward: (moved.0, moved.1 + NATIVE_TRANSPOSED_BACKWARD_FIXED / elem), single: None }
    }
}

/// im2col's columns of one sample: every input channel times every kernel position, per
/// output position (none for a 1×1 unstrided, unpadded, undilated convolution).
fn columns(c: &Convolution<'_>) -> u64 {
    let one_by_one = c.kernel().iter().all(|&k| k == 1)
        && c.stride.iter().all(|&s| s == 1)
        && c.padding.iter().all(|&p| p == 0)
        && c.dilation.iter().all(|&d| d == 1);
    if one_by_one {
        return 0;
    }
    let out = &c.output.shape;
    let positions = shape::numel(&out[out.len() - c.stride.len()..]) as u64;
    (c.weight.shape[1] * c.groups * shape::numel(c.kernel())) as u64 * positions
}

/// libtorch's native convolution: im2col's columns of one sample at a time, per micro-batch
/// when batched, else of the whole input at once.
pub(crate) fn im2col(c: &Convolution<'_>) -> Scratch {
    let cols = columns(c);
    if cols == 0 {
        return Scratch::default();
    }
    let batched = c.batched();
    let work = match c.output.batch() {
        Some(_) if batched => (cols, 0),
        _ => (0, cols * if batched { c.output.shape[0] as u64 } else { 1 }),
    };
    Scratch { forward: work, backward: work, single: None }
}

/// oneDNN's channel block on this CPU: 16 with AVX-512, else 8.
fn host_block() -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return 16;
    }
    8
}

/// The libtorch release toma's shim was built against (`TOMA_LIBTORCH_VERSION`, from its
/// headers), `None` when unknown.
pub(crate) fn libtorch_version() -> Option<(u32, u32)> {
    let version = option_env!("TOMA_LIBTORCH_VERSION")?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}
