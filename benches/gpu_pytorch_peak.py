"""PyTorch's own peak for the models of tests/gpu.rs's planner test, written in PyTorch.

The `mlp`, `cnn` and `res` models of tests/support/models.rs, layer for layer, forward and
backward of the whole batch at the batch sizes tests/gpu.rs plans, measured as the Rust test
measures: the allocator's peak above what was allocated before (parameters, inputs). Prints
`GPU-RESULT pytorch_peak model=.. batch=.. allocated=..MiB reserved=..MiB` lines for
scripts/gpu-run.sh to put beside toma's plan of the same step. Needs a CUDA device.
"""
import sys

import torch
from torch import nn
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("gpu_pytorch_peak.py: no CUDA device")
DEV = torch.device("cuda", 0)
MIB = float(1 << 20)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(1024, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 10)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 16 * 16, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        return self.fc(h.flatten(1))


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.down, self.bn2 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32)
        self.conv, self.proj = nn.Conv2d(32, 32, 3, padding=1), nn.Conv2d(32, 64, 1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        h = F.relu(self.bn1(self.stem(x)))
        h = F.relu(self.bn2(self.down(h)))
        h = F.relu(self.proj(h + F.relu(self.conv(h))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


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
    F.nll_loss(F.log_softmax(model(x), -1), y).backward()
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
