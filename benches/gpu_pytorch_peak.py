"""PyTorch's own peak for the models of tests/gpu.rs's planner test, written in PyTorch.

The `mlp`, `cnn` and `res` models of tests/support/models.rs, layer for layer (as
benches/gpu_memory_probe.py writes them), forward and
backward of the whole batch at the batch sizes tests/gpu.rs plans, measured as the Rust test
measures: the allocator's peak above what was allocated before (parameters, inputs). Prints
`GPU-RESULT pytorch_peak model=.. batch=.. allocated=..MiB reserved=..MiB` lines for
scripts/gpu-run.sh to put beside toma's plan of the same step. Needs a CUDA device.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_pytorch_peak.py: no CUDA device")
# The models as benches/gpu_memory_probe.py writes them (its forward returns the loss).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_memory_probe import Cnn, Mlp, Res  # noqa: E402

DEV = torch.device("cuda", 0)
MIB = float(1 << 20)


MODELS = [
    ("mlp", Mlp, (1024,), [256, 1024, 4096, 16384]),
    ("cnn", Cnn, (3, 64, 64), [64, 256, 1024]),
    ("res", Res, (3, 64, 64), [64, 256, 1024]),
]


def peak(model, shape, n):
    x = torch.randn((n, *shape), device=DEV)
    y = torch.randint(10, (n,), device=DEV)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    model(x, y).backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before, torch.cuda.max_memory_reserved() - reserved_before)


torch.manual_seed(7)
print(f"PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(0)}")
for name, build, shape, batches in MODELS:
    model = build().to(DEV).train()
    peak(model, shape, 4)  # warm-up: handles and kernels, not measured
    for n in batches:
        torch.cuda.empty_cache()
        allocated, reserved = peak(model, shape, n)
        print(f"GPU-RESULT pytorch_peak model={name} batch={n} allocated={allocated / MIB:.1f}MiB reserved={reserved / MIB:.1f}MiB")
    del model
    torch.cuda.empty_cache()
