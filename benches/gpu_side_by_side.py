"""Python toma 1.1.0 on the GPU workload of tests/gpu.rs's `side_by_side_with_python_toma_rust_half`.

A batch of `rows` rows of 64 MiB of ones plus a temporary as large, from a first size of about
four times the card, with toma's default cache; then 10 more calls. Prints the same
`GPU-RESULT side_by_side ...` line as the Rust half, for scripts/gpu-run.sh to put beside it.
Needs a CUDA device, PyTorch, and Python toma (gpu-run.sh installs the wheel the bundle carries).
"""
import statistics
import sys
import time

import torch
from toma import toma

ROW_FLOATS = 16 << 20
ROW_BYTES = ROW_FLOATS * 4
LATER_CALLS = 10
GIB = float(1 << 30)

if not torch.cuda.is_available():
    sys.exit("gpu_side_by_side.py: no CUDA device")


def rows_beyond_the_card():
    # The Rust half's: the next power of two of 2 x total / 64 MiB (the driver's total).
    rows = 2 * torch.cuda.mem_get_info(0)[1] // ROW_BYTES
    return 1 << (rows - 1).bit_length()


attempts = []


@toma.batch(initial_batchsize=rows_beyond_the_card())
def rows_side_by_side(batchsize):
    attempts.append(batchsize)
    x = torch.ones(batchsize, ROW_FLOATS, device="cuda")
    y = x + x
    # Reductions to one value; .item() waits for the card, as the Rust half's double_value.
    assert (y.min().item(), y.max().item()) == (2.0, 2.0)
    return batchsize


def ooms():
    return torch.cuda.memory_stats(0).get("num_ooms", 0)


def main():
    total = torch.cuda.mem_get_info(0)[1]
    # The Rust half's warm-up: cuBLAS and the kernels exist before the first call.
    a = torch.ones(256, 256, device="cuda")
    (a @ a).sum().item()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    calls = []
    for _ in range(LATER_CALLS + 1):
        before = ooms()
        started = time.perf_counter()
        rows = rows_side_by_side()
        torch.cuda.synchronize()
        secs = time.perf_counter() - started
        calls.append((list(attempts), ooms() - before, rows, secs))
        attempts.clear()
    for i, (tried, oom, rows, secs) in enumerate(calls):
        print(f"side by side, python call {i}: attempts {tried}, allocator OOMs {oom}, {rows} rows, {secs:.3f} s")
    first, later = calls[0], calls[1:]
    fields = {
        "impl": "python-toma-1.1.0",
        "card": f"{total / GIB:.2f}GiB",
        "first_rows": first[0][0],
        "converge_secs": f"{first[3]:.3f}",
        "converge_ooms": first[1],
        "final_rows": first[2],
        "later_calls": len(later),
        "later_attempts": sum(len(c[0]) for c in later),
        "later_ooms": sum(c[1] for c in later),
        "later_median_ms": f"{1e3 * statistics.median(c[3] for c in later):.1f}",
    }
    print("GPU-RESULT side_by_side " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


if __name__ == "__main__":
    main()
