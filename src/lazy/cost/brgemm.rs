//! oneDNN's x86 `BFloat16` matrix products (its `brg_matmul` on AVX-512 BF16), which libtorch
//! runs for `mm`, `addmm` and `bmm` in `BFloat16` where the CPU passes its bf16 check, with a
//! scratchpad it allocates from libtorch's CPU allocator for each call.
//!
//! Read from the CPU allocator's trace (`TOMA_TRACE_CPU_ALLOCATIONS=1`, `ONEDNN_VERBOSE=1`),
//! libtorch 2.11.0 (oneDNN 3.10.2), AVX-512 BF16, on one and two threads: `linear` with rows
//! 16 to 4096, inputs 64 to 2048 and outputs 10 to 2048; `bmm` of 16 and 64 `[128, 64]` and
//! `[128, 128]` matrices. Each thread holds a copy of a block of B (repacked for the kernel),
//! an `f32` accumulator of a block of rows, and, when A arrives transposed (a weight's
//! gradient, `aᵀ @ grad`), a copy of a block of A; the blocks do not depend on the number of
//! products a `bmm` makes. Exact on the shapes above where the output has 256 rows or more
//! (A's rows, for a transposed A); below, where oneDNN splits rows among threads, within a few
//! KiB, or above.

/// Bytes of one `BFloat16` product's scratchpad on `threads` threads: `[m, k] @ [k, n]`, A
/// plain (row-major) or transposed (read as `Aᵀ` of a row-major `[k, m]`), `products` of them.
pub(crate) fn scratchpad(threads: u64, products: u64, (m, k, n): (u64, u64, u64), a_transposed: bool) -> u64 {
    if m == 0 || k == 0 || n == 0 {
        return 0;
    }
    let threads = threads.max(1);
    let n_blocks = n.div_ceil(64);
    // Rows per block: at most 256; split among threads when the products and column blocks
    // alone leave some thread idle.
    let rows = |m: u64| {
        let blk = m.min(256);
        if products * m.div_ceil(blk) * n_blocks < threads && m >= 32 {
            m.div_ceil(threads).next_multiple_of(16).min(blk)
        } else {
            blk
        }
    };
    let columns = n.min(64);
    let per_thread = if !a_transposed {
        // B's block of `k_blk` rows by 64 columns; the rows' accumulator.
        let k_blk = if k <= 512 {
            k.next_multiple_of(32)
        } else if k <= 1024 {
            512
        } else {
            1024
        };
        2 * k_blk * 64 + 4 * columns * rows(m)
    } else if k <= 512 {
        // A's copy, its rows padded by 32 elements at 512.
        let k_blk = k.next_multiple_of(32);
        let lda = if k_blk == 512 { k_blk + 32 } else { k_blk };
        let m_blk = rows(m);
        2 * k_blk * 64 + m_blk * (2 * lda + 4 * columns)
    } else if m >= 256 {
        // A long contraction: blocks of 512, B copied over up to 1024 columns.
        2 * 512 * n.min(1024) + 256 * (2 * 544 + 4 * columns)
    } else {
        // Few rows: they are split among threads, each accumulating whole rows of the output.
        let m_blk = if threads > 1 && m >= 32 { m.div_ceil(threads) } else { m };
        2 * 512 * 64 + m_blk * (2 * 544 + 4 * n)
    };
    let shared = if a_transposed { 512 } else { 384 };
    threads * (per_thread + 640) + shared
}

#[cfg(test)]
mod tests {
    use super::scratchpad;

    /// Read on libtorch 2.11.0 (AVX-512 BF16): `linear` of `[rows, in]` to `out` is the
    /// product `(rows, in, out)` forward, `(rows, out, in)` for the input's gradient and the
    /// transposed `(out, rows, in)` for the weight's.
    #[test]
    fn scratchpads_as_measured() {
        // (threads, (m, k, n), transposed, bytes)
        let measured = [
            (2, (1024, 512, 2048), false, 263_808),
            (2, (1024, 2048, 512), false, 394_880),
            (2, (2048, 1024, 512), true, 1_738_496),
            (2, (2048, 256, 512), true, 460_544),
            (1, (2048, 256, 512), true, 230_528),
            (1, (128, 1024, 1024), true, 730_240),
            (2, (128, 1024, 1024), true, 796_416),
            (1, (512, 512, 512), true, 410_752),
            (1, (2048, 1024, 2048), true, 1_393_792),
            (1, (16, 2048, 512), false, 136_192),
            (1, (16, 10, 512), false, 9_216),
            (1, (256, 512, 10), false, 76_800),
            (2, (256, 512, 10), false, 142_976),
            (2, (256, 64, 64), false, 83_584),
            (1, (64, 16, 64), true, 25_728),
        ];
        for (threads, dims, transposed, bytes) in measured {
            assert_eq!(scratchpad(threads, 1, dims, transposed), bytes, "{threads} threads, {dims:?}, {transposed}");
        }
        // `bmm`: per matrix blocks, whatever the number of products.
        assert_eq!(scratchpad(2, 16, (128, 64, 128), false), 83_584);
        assert_eq!(scratchpad(2, 64, (64, 128, 128), true), 100_096);
        assert_eq!(scratchpad(2, 64, (128, 128, 64), true), 165_632);
    }
}
