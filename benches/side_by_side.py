"""Python toma on the two workloads of benches/side_by_side.rs; prints `name value unit` lines."""
import time

import torch
from toma import toma


def best(f, repeat, number):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            f()
        times.append((time.perf_counter() - start) / number)
    return min(times)


@toma.batch(initial_batchsize=64)
def wrapped(batchsize, x):
    return x * batchsize


def plain(batchsize, x):
    return x * batchsize


def fill_native(t):
    rows = t.shape[0]
    start = 0
    while start < rows:
        length = min(32, rows - start)
        t.narrow(0, start, length).fill_(1.0)
        start += length


def fill_toma(t):
    # toma.execute.chunked runs the function it decorates, at once.
    @toma.execute.chunked(t, 32)
    def body(chunk, start, end):
        chunk.fill_(1.0)


torch.set_num_threads(torch.get_num_threads())
print(f"python_batch_call {best(lambda: wrapped(3), 5, 5) * 1e9:.0f} ns")
print(f"python_plain_call {best(lambda: plain(64, 3), 5, 100000) * 1e9:.1f} ns")
t = torch.zeros(128, 256, 256)
print(f"python_fill_native {best(lambda: fill_native(t), 15, 1) * 1e3:.3f} ms")
print(f"python_fill_toma {best(lambda: fill_toma(t), 5, 1) * 1e3:.3f} ms")
