//! The CPU model: libtorch's CPU kernels, and which convolutions libtorch hands to oneDNN
//! (its `ConvParams::use_mkldnn`) rather than to its native im2col kernel.

use std::sync::OnceLock;

use tch::Kind;

use super::brgemm;
pub(crate) use super::machine::libtorch_version;
use super::machine::CpuMachine;
use super::onednn::OneDnn;
use super::work::{batch_of, chord, Scratch};
use crate::lazy::graph::{Convolution, KernelCall, Product};
use crate::lazy::shape;
use crate::lazy::size::Elements;

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

/// One CPU, as libtorch runs kernels on it: oneDNN's instruction set, its intra-op threads and
/// its oneDNN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cpu {
    pub(crate) threads: u64,
    pub(crate) onednn: OneDnn,
    /// The whole key the rules are trusted on ([`CpuMachine::reads_rules_of`]); its
    /// `bf16_onednn` says whether libtorch runs `BFloat16` convolutions and products through
    /// oneDNN here.
    pub(crate) key: CpuMachine,
}

impl Cpu {
    /// This machine: libtorch's intra-op threads (asked once), the instruction set oneDNN uses
    /// ([`CpuMachine::host`]), the libtorch toma was built against.
    pub(crate) fn host() -> &'static Cpu {
        static HOST: OnceLock<Cpu> = OnceLock::new();
        HOST.get_or_init(|| {
            let cpu = Cpu::of(&CpuMachine::host());
            if !cpu.onednn.validated() {
                let (major, minor) = super::onednn::READ_ON;
                tracing::warn!(
                    libtorch = ?cpu.onednn.libtorch,
                    "toma: the planner's oneDNN convolution rules were read on libtorch {major}.{minor}; plans of \
                     CPU convolutions on this libtorch are measured where the allocator counts, and priced by \
                     unvalidated rules elsewhere"
                );
            }
            tracing::debug!(
                machine = %CpuMachine::host(),
                aten = super::machine::aten_capability(),
                rules_read_on = %CpuMachine::rules_read_on(),
                "toma::lazy: the CPU plans are priced for"
            );
            cpu
        })
    }

    /// This machine as libtorch runs it now: [`host`](Self::host) with the intra-op threads
    /// libtorch has at this moment (`tch::set_num_threads` may have changed them since).
    pub(crate) fn current() -> Cpu {
        let host = Cpu::host();
        let threads = tch::get_num_threads().max(1) as u64;
        if threads == host.threads {
            return host.clone();
        }
        Cpu {
            threads,
            onednn: OneDnn { threads, ..host.onednn },
            key: CpuMachine { threads: threads as usize, ..host.key },
        }
    }

    /// The machine this CPU model prices for.
    pub(crate) fn machine(&self) -> CpuMachine {
        self.key
    }

    /// Whether the rule that prices `call` was read on exactly this machine, for every form of
    /// the call: products and convolutions only on the key they were read on
    /// ([`CpuMachine::reads_rules_of`] [`CpuMachine::rules_read_on`]: the libtorch release,
    /// oneDNN's instruction set, the CPU's features, libtorch's bf16 and fp16 checks, ATen's
    /// capability, at most its threads), and only in the kinds read there. Convolutions
    /// (oneDNN's and the native ones) were read in `Float`, `Double` and `Half`, but for a
    /// `Float` kernel that covers its whole input (oneDNN runs it as an inner product);
    /// products in `Float`, `Double` and `Half` (libtorch's own BLAS there; a CPU with
    /// AVX512-FP16 or AMX-FP16 hands `Half` products to oneDNN, and is another key). `BFloat16`
    /// products go through oneDNN, whose rules miss some forms (a transposed operand, a matrix
    /// times a batch, `mv` and `dot`), so they are measured everywhere. The rest are libtorch's
    /// formulas, read on its release. Under [`trust_rules`](super::machine::trust_rules)`(false)`
    /// nothing with a rule is trusted. What is not trusted is measured where an allocator
    /// counts ([`measured`](super::measured)).
    pub(crate) fn validated(&self, call: &KernelCall<'_>) -> bool {
        if !self.onednn.validated() || !super::machine::rules_trusted() {
            return false;
        }
        let machine_read = self.key.reads_rules_of(&CpuMachine::rules_read_on());
        match call {
            // A `Float` kernel that covers its whole input runs as oneDNN's inner product, whose
            // matmul scratch changes with the batch (no rule read: by rules such a layer was 11%
            // to 18% under in a DCGAN).
            KernelCall::Convolution(c) => {
                machine_read
                    && matches!(c.output.kind, Kind::Float | Kind::Double | Kind::Half)
                    && !(c.output.kind == Kind::Float && c.covers_input())
            }
            KernelCall::Product(p) => machine_read && matches!(p.out.kind, Kind::Float | Kind::Double | Kind::Half),
            // ATen's own C++ on every CPU in these kinds; the reduced kinds pack their operands
            // for oneDNN's micro-kernels where the CPU has AMX.
            KernelCall::FusedAttention { kind, .. } => matches!(kind, Kind::Float | Kind::Double),
            _ => true,
        }
    }

    /// The model of `machine`: oneDNN's channel block for its instruction set, and libtorch's
    /// bf16 check as the machine answers it.
    pub(crate) fn of(machine: &CpuMachine) -> Cpu {
        let threads = machine.threads.max(1) as u64;
        Cpu {
            threads,
            onednn: OneDnn { libtorch: machine.libtorch, block: machine.isa.block(), threads },
            key: CpuMachine { threads: threads as usize, ..*machine },
        }
    }

    /// A matrix product's scratch: oneDNN's scratchpad where libtorch hands `BFloat16` products
    /// to it (where it takes `BFloat16` convolutions); none for other kinds, which run
    /// libtorch's own BLAS. Forward: the product. Backward: one product per operand that
    /// requires a gradient, one after the other (the larger scratchpad counts): `grad @ bᵀ`, and
    /// `aᵀ @ grad` with A transposed (`(gradᵀ @ a)ᵀ` for a column-major `b` in `mm`).
    pub(crate) fn product(&self, p: &Product<'_>) -> Scratch {
        if p.out.kind != Kind::BFloat16 || !self.key.bf16_onednn {
            return Scratch::default();
        }
        let elem = p.out.kind.elt_size_in_bytes() as u64;
        let at = |b: u64, backward: bool| {
            let (products, m, k, n) = p.dims_at(b as i64);
            let pad = |dims, transposed| brgemm::scratchpad(self.threads, products, dims, transposed);
            if !backward {
                return pad((m, k, n), false).div_ceil(elem);
            }
            let [a_grad, b_grad] = p.grads;
            let a = if a_grad { pad((m, n, k), false) } else { 0 };
            let b = match (b_grad, p.batched || !p.b_column_major) {
                (false, _) => 0,
                (true, true) => pad((k, m, n), true),
                (true, false) => pad((n, m, k), true),
            };
            a.max(b).div_ceil(elem)
        };
        let n = batch_of(p.out);
        let forward = chord(n, |b| at(b, false));
        let backward = if p.out.requires_grad { chord(n, |b| at(b, true)) } else { Elements::ZERO };
        Scratch { forward, backward }
    }

    /// The fused attention kernel's scratch, in elements of `kind` (libtorch 2.11's
    /// `cpu_flash_attention` and its backward): each intra-op thread takes a block of `q_split`
    /// query rows against `kv_split` keys, in the accumulation kind (`Float` for the reduced
    /// kinds). Forward: the block's scores, the rows' maxima and sums, and a `q_split × ev`
    /// accumulator; backward: the scores and their gradient. The reduced kinds keep a copy of
    /// each block in their own kind too. `q_split` is 256 from 768 query rows on, 64 from 192,
    /// else 32; `kv_split` 512; each at most the rows there are. Measured: a causal block of 4
    /// heads of 64 over 128 tokens, 48.5 KiB forward and 64 KiB backward on 2 threads, at any
    /// batch.
    pub(crate) fn fused_attention(&self, l: i64, s: i64, ev: i64, kind: Kind) -> Scratch {
        let q_split = match l {
            768.. => 256,
            192.. => 64,
            _ => 32,
        }
        .min(l.max(0)) as u64;
        let kv_split = s.clamp(0, 512) as u64;
        let reduced = matches!(kind, Kind::BFloat16 | Kind::Half);
        // Accumulation elements, in elements of `kind`.
        let acc = if reduced { 2 } else { 1 };
        let block = q_split * kv_split;
        let forward = acc * (block + 2 * q_split + q_split * ev.max(0) as u64) + u64::from(reduced) * block;
        let backward = acc * 2 * block + u64::from(reduced) * 2 * block;
        Scratch {
            forward: Elements::line(0, self.threads * forward),
            backward: Elements::line(0, self.threads * backward),
        }
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
            scratch = scratch.plus(Scratch::both(x.elements()));
        }
        scratch
    }

    /// A convolution's scratch, its input taken as contiguous.
    fn contiguous_convolution(&self, c: &Convolution<'_>) -> Scratch {
        let n = c.output.batch().map_or(1, |bd| bd.size);
        let per_sample = shape::numel(&c.input.shape) / n.max(1);
        // libtorch hands every `BFloat16` convolution to oneDNN where the CPU passes its bf16
        // check; `Float` ones by shape; other kinds never.
        let onednn = match c.output.kind {
            Kind::Float => self.uses_onednn(c, n, per_sample),
            Kind::BFloat16 => self.key.bf16_onednn,
            _ => false,
        };
        if c.batched() && onednn {
            let mut scratch = self.onednn.convolution(c);
            // oneDNN's backward makes the weight's gradient with the bias's, wanted or not: a
            // frozen weight's is made and dropped.
            if c.bias_grad_only {
                let w = shape::numel(&c.weight.shape).max(0) as u64;
                scratch.backward = scratch.backward.plus(Elements::line(0, w));
            }
            // A `Float` micro-batch of one that libtorch runs natively: im2col's columns there.
            let float = c.output.kind == Kind::Float;
            if float && n > 1 && c.output.batch().is_some() && !self.uses_onednn(c, 1, per_sample) {
                let cols = columns(c);
                scratch =
                    Scratch { forward: scratch.forward.with_one(cols), backward: scratch.backward.with_one(cols) };
            }
            return scratch;
        }
        let mut scratch = native(c);
        // Only the bias's gradient: the native backward sums the output's gradient, no columns.
        if c.bias_grad_only && !c.input_grad {
            scratch.backward = Elements::ZERO;
        }
        scratch
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
        if c.output.kind != Kind::Float {
            return native_transposed(c);
        }
        let elem = c.output.kind.elt_size_in_bytes().max(1) as u64;
        let (x, w, y) = (c.input.elements(), c.weight.elements(), c.output.elements());
        let moved = x.plus(w).plus(y);
        Scratch { forward: moved, backward: moved.plus(Elements::line(0, NATIVE_TRANSPOSED_BACKWARD_FIXED / elem)) }
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

/// libtorch's native convolutions: grouped, dilated, or im2col.
fn native(c: &Convolution<'_>) -> Scratch {
    // 3-D: libtorch's `slow_conv3d` takes the groups at once, its columns over all of them.
    if c.groups > 1 && c.batched() && c.kernel().len() == 2 {
        return native_grouped(c);
    }
    if c.dilated() {
        // libtorch's dilated kernel fills one sample's columns at a time.
        let cols = columns(c);
        return Scratch::both(Elements::line(0, cols));
    }
    im2col(c)
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
        Some(_) if batched => Elements::line(cols, 0),
        _ => Elements::line(0, cols * if batched { c.output.shape[0] as u64 } else { 1 }),
    };
    Scratch::both(work)
}

/// libtorch's native transposed convolution (`slow_conv_transpose2d`, for the kinds oneDNN
/// does not take): its columns are the output's channels (of a group) times the kernel, over the
/// input's positions; the forward fills them for the whole micro-batch, the backward one sample
/// at a time. Grouped, one group at a time: the forward copies the group's input slice, the
/// backward keeps the output gradient's and the input's slices beside the columns with an input
/// gradient, else the input gradient's finished groups (read from the CPU allocator's trace on
/// `Double`, libtorch 2.11: exact on four shapes).
fn native_transposed(c: &Convolution<'_>) -> Scratch {
    let groups = c.groups.max(1) as u64;
    let out = &c.output.shape;
    let spatial = c.stride.len();
    let input_positions = shape::numel(&c.input.shape[c.input.shape.len() - spatial..]).max(0) as u64;
    let channels = out[out.len() - spatial - 1].max(0) as u64 / groups;
    let columns = channels * shape::numel(c.kernel()).max(0) as u64 * input_positions;
    let (xp, yp) = (c.input.elements(), c.output.elements());
    let n = batch_of(c.output);
    if groups == 1 {
        let per_sample =
            if c.output.batch().is_some() { Elements::line(columns, 0) } else { Elements::line(0, columns * n) };
        return Scratch { forward: per_sample, backward: Elements::line(0, columns) };
    }
    // A group's channels of one sample are contiguous already: slices are copied from two on.
    let slice = |elements: u64, k: u64| if k > 1 { elements / groups } else { 0 };
    let forward = chord(n, |k| slice(xp.at(k), k) + columns * k);
    let backward = chord(n, |k| {
        let (x, y) = (xp.at(k), yp.at(k));
        if c.input_grad {
            columns + slice(y, k) + slice(x, k)
        } else {
            columns + slice(x, k) * (groups - 1)
        }
    });
    Scratch { forward, backward }
}

/// libtorch's native grouped convolution (kinds oneDNN does not take, `Double` among them): one
/// group at a time, over the whole micro-batch (one sample's columns at a time when dilated). Forward: each group's input copied contiguous
/// and its columns, its output kept until the groups' outputs are concatenated. Backward, per
/// group: the output gradient's and the input's slices copied, the columns; with an input
/// gradient, the groups' pieces of it are kept until concatenated (read from the CPU
/// allocator's trace, libtorch 2.11).
fn native_grouped(c: &Convolution<'_>) -> Scratch {
    let groups = c.groups.max(1) as u64;
    let (xp, yp) = (c.input.elements(), c.output.elements());
    let w = shape::numel(&c.weight.shape).max(0) as u64;
    let columns = columns(c) / groups;
    let n = batch_of(c.output);
    // The columns of the micro-batch, or of one sample (dilated).
    let cols = |k: u64| if c.dilated() { columns } else { columns * k };
    // A group's channels of one sample are contiguous already: slices are copied from two on.
    let slice = |elements: u64, k: u64| if k > 1 { elements / groups } else { 0 };
    let forward = chord(n, |k| {
        let (x, y) = (xp.at(k), yp.at(k));
        y.max(slice(x, k) + cols(k))
    });
    let backward = chord(n, |k| {
        let (x, y) = (xp.at(k), yp.at(k));
        let group = slice(y, k) + slice(x, k) + cols(k);
        let pieces = if c.input_grad { x + w } else { w };
        group.max(pieces)
    });
    Scratch { forward, backward }
}
