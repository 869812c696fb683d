//! The CUDA model: the caching allocator's blocks, and the scratch space libtorch's CUDA kernels
//! take while an op runs, besides its inputs and outputs: the staging buffer of ATen's
//! reduction kernel and cuDNN's workspace for convolutions.
//!
//! Both were read on an H100 (PyTorch 2.11.0+cu130, cuDNN 9.19): `benches/gpu_memory_probe.py`
//! lists every block live at the peak of a training step; `docs/gpu-runs/` keeps the logs and
//! the misses these rules fixed.
//!
//! - **Reductions.** A sum over many rows (the bias gradient of every `linear`, the gradient
//!   of a broadcast operand, `sum`/`mean` over dimensions) splits each output's rows across
//!   thread blocks and stages their partial sums in a buffer from the caching allocator. Its
//!   size follows the kernel's launch configuration (ATen's `Reduce.cuh`, `setReduceConfig`),
//!   which depends on the shape and on the device's multiprocessors, not linearly on the batch:
//!   none for a short reduction, then twice the input, then a cap of about 1 MiB per
//!   multiprocessor (132 MiB on an H100). [`ReduceStaging::bytes`] follows that configuration.
//! - **Convolutions.** cuDNN's engines for NCHW tensors may reorder their operands into
//!   a workspace. Which engine its heuristics pick, and so the workspace, changes with the
//!   channels, the kernel and the stride (from nothing to both operands and several MiB). The
//!   planner counts the bound: the input plus the output (gradient), plus
//!   [`CONV_WORKSPACE_FIXED`]: over for 1×1 convolutions and thin stems, never under what was
//!   seen.

use super::cpu::im2col;
use super::work::Scratch;
use crate::lazy::graph::{BatchDim, Convolution, Meta};
use crate::lazy::size::Elements;

/// The allocation granularity of the CUDA caching allocator.
pub const BLOCK: u64 = 512;

/// Rounds up to the CUDA caching allocator's block size; 0 stays 0.
pub fn round_block(bytes: u64) -> u64 {
    bytes.div_ceil(BLOCK) * BLOCK
}

/// Multiprocessors and resident threads per multiprocessor assumed where the driver cannot be
/// asked: more than any current card has, so the staging buffers are not underestimated.
const UNKNOWN_GPU: (u32, u32) = (160, 2048);

/// One CUDA device, as its kernels' launch configurations depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cuda {
    /// Multiprocessors, and resident threads per multiprocessor.
    pub(crate) gpu: (u32, u32),
}

impl Cuda {
    /// CUDA device `index` of this machine (as the driver reports it, or a card larger than
    /// any current one when it cannot be asked).
    pub(crate) fn of(index: usize) -> Cuda {
        Cuda { gpu: crate::memory::cuda_multiprocessors(index).unwrap_or(UNKNOWN_GPU) }
    }

    /// The staging buffer of a reduction of a tensor shaped like `of` over the dimensions in
    /// `mask`, if the kernel may stage.
    pub(crate) fn reduction(&self, of: &Meta, mask: u64) -> Option<ReduceStaging> {
        ReduceStaging::new(&of.shape, of.batch(), mask, of.kind.elt_size_in_bytes() as i64, self.gpu)
    }

    /// A convolution's scratch: cuDNN's bound for a batched one (both operands reordered, and
    /// a fixed workspace), libtorch's native kernel for a single unbatched sample.
    pub(crate) fn convolution(&self, c: &Convolution<'_>) -> Scratch {
        let (x, y) = (c.input.elements(), c.output.elements());
        let elem = c.output.kind.elt_size_in_bytes().max(1) as u64;
        let (forward, backward) = CONV_WORKSPACE_FIXED;
        if c.transposed {
            // Run as a convolution's backward: input, weight and output moved, and the
            // workspace.
            let w = c.weight.elements();
            let moved = x.plus(w).plus(y);
            return Scratch {
                forward: moved.plus(Elements::line(0, forward / elem)),
                backward: moved.plus(Elements::line(0, (32 << 10) / elem + backward / elem)),
            };
        }
        if !c.batched() {
            return im2col(c);
        }
        Scratch {
            forward: x.plus(y).plus(Elements::line(0, forward / elem)),
            backward: x.plus(y).plus(Elements::line(0, backward / elem)),
        }
    }
}
/// Threads of one reduction block (ATen's `max_reduce_threads` for non-complex types).
const MAX_THREADS: i64 = 512;
const WARP: i64 = 32;
/// Values each thread sums before the kernel splits a reduction across blocks, and the most.
const MIN_VALUES_PER_THREAD: i64 = 16;
const MAX_VALUES_PER_THREAD: i64 = 256;
/// Elements one thread loads at once along a contiguous reduced dimension.
const INPUT_VEC: i64 = 4;

/// The staging buffer of one CUDA reduction of a contiguous tensor: the tensor's shape (its
/// batch dimension scales with the micro-batch) and which dimensions are reduced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReduceStaging {
    shape: Vec<i64>,
    batch: Option<BatchDim>,
    /// Bit d: dimension d is reduced.
    reduced: u64,
    /// Bytes of one input element and of the accumulator.
    elem: i64,
    acc: i64,
    /// Multiprocessors and resident threads per multiprocessor of the device.
    gpu: (u32, u32),
}

impl ReduceStaging {
    /// The reduction of a tensor of `shape` (with `batch`, of elements of `elem` bytes) over the
    /// dimensions whose bit is set in `reduced`, on a device of `gpu` multiprocessors and
    /// threads per multiprocessor. `None` when nothing is reduced.
    pub(crate) fn new(
        shape: &[i64],
        batch: Option<BatchDim>,
        reduced: u64,
        elem: i64,
        gpu: (u32, u32),
    ) -> Option<ReduceStaging> {
        if reduced == 0 || shape.len() > 64 {
            return None;
        }
        // ATen accumulates reduced floats of 16 bits in `float`, the rest in their own type.
        let acc = elem.max(4);
        Some(ReduceStaging { shape: shape.to_vec(), batch, reduced, elem, acc, gpu })
    }

    /// Bytes of staging buffer and semaphores at micro-batch `b` (each rounded to the caching
    /// allocator's block), 0 when the kernel reduces within blocks.
    pub(crate) fn at(&self, b: u64) -> u64 {
        // The planner asks this for every candidate micro-batch: the batch dimension's size is
        // put in place as the dimensions are walked, without a copy of the shape.
        let batch = self.batch.map(|bd| (bd.dim, b as i64 * bd.factor));
        self.bytes(batch)
    }

    /// The launch configuration of ATen's reduction kernel for the shape (with the batch
    /// dimension at `batch`'s size), and what it stages.
    fn bytes(&self, batch: Option<(usize, i64)>) -> u64 {
        let shape = self.shape.iter().enumerate().map(|(d, &size)| match batch {
            Some((dim, at)) if dim == d => at,
            _ => size,
        });
        // The kernel's iterator drops dimensions of size 1 and merges neighbours of one kind
        // (reduced or kept); reduced dimensions come first, each kind in memory order.
        let (mut rows, mut outputs) = (1i64, 1i64);
        // Runs of reduced dimensions (each merges into one), the extent of the innermost run of
        // kept ones (it decides how outputs are vectorised), and the innermost dimension's kind.
        let (mut reduced_runs, mut innermost_kept, mut kept_run) = (0, 1i64, KeptRun::NotYet);
        let (mut innermost_reduced, mut previous) = (None::<bool>, None::<bool>);
        for (d, size) in shape.enumerate().rev() {
            if size == 0 {
                return 0;
            }
            if size == 1 {
                continue;
            }
            let is_reduced = self.reduced & (1 << d) != 0;
            innermost_reduced.get_or_insert(is_reduced);
            if is_reduced {
                rows *= size;
                reduced_runs += usize::from(previous != Some(true));
                if kept_run == KeptRun::In {
                    kept_run = KeptRun::Done;
                }
            } else {
                outputs *= size;
                if kept_run != KeptRun::Done {
                    kept_run = KeptRun::In;
                    innermost_kept *= size;
                }
            }
            previous = Some(is_reduced);
        }
        if rows <= 1 {
            return 0; // nothing to reduce: a copy
        }
        let on_fastest = innermost_reduced != Some(false);
        let mut output_vec = 1;
        let (mut dim0, dim1) = if on_fastest { (rows, outputs) } else { (outputs, rows) };
        if on_fastest {
            if dim0 > 128 && reduced_runs == 1 && self.elem <= 4 {
                dim0 /= INPUT_VEC;
            }
        } else {
            output_vec = [4, 2, 1].into_iter().find(|v| innermost_kept % v == 0).unwrap_or(1);
            dim0 /= output_vec;
        }
        // Block shape: lanes along dim0 (a warp at most), warps along dim1.
        let max_threads = MAX_THREADS / output_vec;
        let pow2 = |n: i64| if n < max_threads { last_pow2(n) } else { max_threads };
        let (dim0_pow2, dim1_pow2) = (pow2(dim0), pow2(dim1));
        let mut width = dim0_pow2.min(WARP);
        let height = dim1_pow2.min(max_threads / width);
        width = dim0_pow2.min(max_threads / height);
        let (mut step_input, mut step_output) = (1i64, 1i64);
        if on_fastest {
            step_input *= width;
        } else {
            step_output *= width;
        }
        let split_across_warps = div_up(rows, step_input) >= (height * 16).min(MAX_VALUES_PER_THREAD);
        if split_across_warps {
            step_input *= height;
        } else {
            step_output *= height;
        }
        let (sms, threads_per_sm) = (i64::from(self.gpu.0), i64::from(self.gpu.1));
        let target_grid = sms * (threads_per_sm / (width * height)).max(1);
        let grid = div_up(outputs / output_vec, step_output);
        let values_per_thread = div_up(rows, step_input);
        if !split_across_warps || values_per_thread < MAX_VALUES_PER_THREAD || grid > target_grid {
            return 0;
        }
        let ctas = div_up(target_grid, grid)
            .min(div_up(values_per_thread, MIN_VALUES_PER_THREAD))
            .max(div_up(values_per_thread, MAX_VALUES_PER_THREAD));
        if ctas <= 1 {
            return 0;
        }
        let mut staging = self.acc * outputs * ctas;
        if !on_fastest {
            staging *= width * output_vec;
        }
        let semaphores = 4 * grid;
        round_block(staging as u64) + round_block(semaphores as u64)
    }
}

/// Where the walk from the innermost dimension is in the first run of kept dimensions.
#[derive(Clone, Copy, PartialEq, Eq)]
enum KeptRun {
    NotYet,
    In,
    Done,
}

/// The largest power of two not above `n` (1 for 0 and 1).
fn last_pow2(n: i64) -> i64 {
    if n <= 1 {
        1
    } else {
        1 << (63 - n.leading_zeros())
    }
}

fn div_up(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// Fixed bytes of cuDNN's workspace for a 2-d convolution on CUDA, beside the reordered
/// operands, forward and backward: the most the probe saw above the operands was 0.2 MiB
/// forward and 9.8 MiB backward (a 7×7 stem's weight gradient).
pub(crate) const CONV_WORKSPACE_FIXED: (u64, u64) = (2 << 20, 16 << 20);

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    /// An H100 SXM: 132 multiprocessors of 2048 threads.
    const H100: (u32, u32) = (132, 2048);

    fn staging(shape: &[i64], reduced: &[usize]) -> u64 {
        let mask = reduced.iter().fold(0u64, |m, &d| m | 1 << d);
        let s = ReduceStaging { shape: shape.to_vec(), batch: None, reduced: mask, elem: 4, acc: 4, gpu: H100 };
        s.bytes(None)
    }

    /// The staging buffers benches/gpu_memory_probe.py saw on an H100 (blocks live at the peak
    /// of a training step, allocated by `structured_sum_out`), as bias gradients of `linear`.
    #[test]
    fn bias_gradients_stage_what_the_h100_showed() {
        let semaphores = 512;
        assert_eq!(staging(&[4096, 4096], &[0]), 128 * MIB + semaphores, "mlp, batch 4096");
        assert_eq!(staging(&[1024, 4096], &[0]), 32 * MIB + semaphores, "mlp, batch 1024");
        assert_eq!(staging(&[256, 4096], &[0]), 0, "mlp, batch 256: no block split");
        assert_eq!(staging(&[128 * 128, 512], &[0]), 64 * MIB + semaphores, "transformer fc2, batch 128");
        assert_eq!(staging(&[32 * 128, 512], &[0]), 16 * MIB + semaphores, "transformer fc2, batch 32");
        assert_eq!(staging(&[8 * 128, 2048], &[0]), 16 * MIB + semaphores, "transformer fc1, batch 8");
        // [N, T, C] reduced over N and T is the same reduction as [N T, C].
        assert_eq!(staging(&[8, 128, 2048], &[0, 1]), staging(&[1024, 2048], &[0]));
    }

    /// The planner's path: the batch dimension takes the micro-batch's size.
    #[test]
    fn at_a_micro_batch_the_batch_dimension_scales() {
        let batch = Some(BatchDim { dim: 0, size: 8, factor: 128 });
        let s = ReduceStaging { shape: vec![8 * 128, 2048], batch, reduced: 1, elem: 4, acc: 4, gpu: H100 };
        assert_eq!(s.at(8), staging(&[1024, 2048], &[0]));
        assert_eq!(s.at(32), staging(&[4096, 2048], &[0]));
        assert_eq!(s.at(1), staging(&[128, 2048], &[0]));
    }

    #[test]
    fn the_buffer_is_capped_by_the_device_then_grows_slowly() {
        // From about 1 MiB per multiprocessor (the grid fills the card)...
        let capped = staging(&[16384, 4096], &[0]);
        assert_eq!(capped, 4 * 4096 * 66 * 128 + 512);
        assert!(staging(&[65536, 4096], &[0]) < 2 * capped);
        // ...to an eighth of the input for very long reductions (256 values a thread at most).
        let long = staging(&[1 << 22, 64], &[0]);
        assert!(long > 0 && long <= (1u64 << 22) * 64 * 4 / 4, "{long}");
    }

    #[test]
    fn reductions_within_blocks_stage_nothing_or_little() {
        // Over the last dimension, many outputs: each block finishes its own rows.
        assert_eq!(staging(&[4096, 4096], &[1]), 0);
        // One output (a loss): a few partial sums per block.
        let all = staging(&[1 << 20, 64], &[0, 1]);
        assert!(all > 0 && all < MIB, "{all}");
        // Nothing reduced, or only dimensions of size 1.
        assert_eq!(staging(&[4096, 1, 64], &[1]), 0);
    }

    #[test]
    fn nothing_reduced_stages_nothing() {
        assert!(ReduceStaging::new(&[4096, 4096], None, 1, 4, H100).is_some());
        assert_eq!(ReduceStaging::new(&[4096, 4096], None, 0, 4, H100), None);
    }
}
