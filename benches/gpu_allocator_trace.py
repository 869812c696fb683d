"""The CUDA caching allocator's own history, recorded for toma's model of it to replay on the CPU.

For each workload, from a card whose cache was released (and, for some, filled to leave a few
GiB, as tests/gpu.rs's zoo fills it), this takes PyTorch's memory snapshot (the segments and
blocks already there), records the allocator's history (`_record_memory_history`) through a
few training steps, and writes one trace file: the starting segments, the card's free bytes,
then every allocation, free, segment and out-of-memory event in order. The allocator's
settings are the environment's (`PYTORCH_CUDA_ALLOC_CONF`): scripts/gpu-run.sh runs this with
the defaults and with expandable segments. `src/lazy/cost/caching/trace.rs` replays each file
committed under tests/data/allocator-traces/ and checks the same reserved bytes at every
allocation, the same peak and the same out-of-memory.

    python3 benches/gpu_allocator_trace.py OUT_DIR [workload ...]   # on a CUDA machine

Format (text, one record a line, sizes in bytes):
    # toma allocator trace 1
    name <workload>            settings <PYTORCH_CUDA_ALLOC_CONF or ->
    torch <version>            device <name>
    card <total> <free>        what cudaMemGetInfo said when recording began
    segment <address> <stream> <small|large> <expandable 0|1> <size>:<a|f>,...
    alloc <address> <requested> <stream>
    free <address> <requested> <stream>        (free_completed)
    segment_alloc|segment_free|segment_map|segment_unmap <address> <size> <stream>
    oom <requested> <stream> <device free>
    max_reserved <bytes>       torch.cuda.max_memory_reserved() at the end (peak since start)
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint_sequential

if not torch.cuda.is_available():
    sys.exit("gpu_allocator_trace.py: no CUDA device")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_memory_probe import Gpt2Stack, Mlp  # noqa: E402  (the planner tests' models)

DEV = "cuda"


class Basic(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        h = self.b2(self.c2(h))
        return F.relu(h + (x if self.down is None else self.down(x)))


def resnet18_layers():
    """ResNet-18 as a sequence (torchvision's layout), for checkpoint_sequential."""
    stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    blocks = [stem]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        blocks += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))
    return nn.Sequential(*blocks, head)


def fill(leave):
    """One tensor taking all but `leave` bytes of what the card and the cache have free."""
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    return torch.empty(max(free - leave, 0), dtype=torch.uint8, device=DEV)


def adam_steps(model, x, y, steps=2):
    """`steps` training steps of `model(x, y)` with Adam, `.grad` set to none before each."""
    opt = torch.optim.Adam(model.parameters(), 1e-4)

    def run():
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
    return run


def mlp(batch):
    x, y = torch.randn(batch, 1024, device=DEV), torch.randint(10, (batch,), device=DEV)
    return adam_steps(Mlp().to(DEV), x, y)


def gpt2(batch):
    x, y = torch.randn(batch, 256, 512, device=DEV), torch.randint(10, (batch,), device=DEV)
    return adam_steps(Gpt2Stack().to(DEV), x, y)


def resnet_recomputed(batch, segments):
    model = resnet18_layers().to(DEV).train()
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    x, y = torch.randn(batch, 3, 128, 128, device=DEV), torch.randint(10, (batch,), device=DEV)

    def run():
        opt.zero_grad(set_to_none=True)
        out = checkpoint_sequential(model, segments, x, use_reentrant=False)
        F.cross_entropy(out, y).backward()
        opt.step()
    return run


# name -> (build the workload's state, bytes to leave free beside it or None for a free card)
WORKLOADS = {
    "mlp_4096": (lambda: mlp(4096), None),
    "mlp_16384": (lambda: mlp(16384), None),
    "gpt2_f32_48": (lambda: gpt2(48), None),
    "resnet18_recomputed_903_filled": (lambda: resnet_recomputed(903, 3), 4 << 30),
    "resnet18_recomputed_798_filled": (lambda: resnet_recomputed(798, 3), 4 << 30),
}


def segments_of(snapshot):
    for s in snapshot["segments"]:
        blocks = ",".join(f"{b['size']}:{'a' if b['state'] == 'active_allocated' else 'f'}" for b in s["blocks"]
                          if b["state"] in ("active_allocated", "inactive", "active_pending_free"))
        yield (f"segment {s['address']} {s['stream']} {s['segment_type']} {int(bool(s.get('is_expandable')))} "
               f"{blocks}")


def trace(name, out_dir):
    build, leave = WORKLOADS[name]
    torch.cuda.empty_cache()
    run = build()
    filler = fill(leave) if leave is not None else None
    torch.cuda.synchronize()
    start = torch.cuda.memory._snapshot()
    free, total = torch.cuda.mem_get_info()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    outcome = "ran"
    try:
        run()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        outcome = "out of memory"
    end = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or "-"
    tag = "expandable" if "expandable_segments:True" in settings else "default"
    lines = [
        "# toma allocator trace 1",
        f"name {name}",
        f"settings {settings}",
        f"torch {torch.__version__}",
        f"device {torch.cuda.get_device_name(0).replace(' ', '_')}",
        f"card {total} {free}",
    ]
    lines += list(segments_of(start))
    events = 0
    for e in end["device_traces"][0]:
        action = e["action"]
        if action == "alloc":
            lines.append(f"alloc {e['addr']} {e['size']} {e['stream']}")
        elif action == "free_completed":
            lines.append(f"free {e['addr']} {e['size']} {e['stream']}")
        elif action in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
            lines.append(f"{action} {e['addr']} {e['size']} {e['stream']}")
        elif action == "oom":
            # addr holds the device's free bytes for an oom entry.
            lines.append(f"oom {e['size']} {e['stream']} {e['addr']}")
        else:
            continue
        events += 1
    lines.append(f"max_reserved {torch.cuda.max_memory_reserved()}")
    path = os.path.join(out_dir, f"{name}-{tag}.trace")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"GPU-TRACE name={name} allocator={tag} outcome={outcome.replace(' ', '_')} events={events} "
          f"max_reserved_mib={torch.cuda.max_memory_reserved() / (1 << 20):.1f} file={os.path.basename(path)}")
    del filler, run
    torch.cuda.empty_cache()


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    for name in sys.argv[2:] or list(WORKLOADS):
        trace(name, out_dir)


if __name__ == "__main__":
    main()
