"""What libtorch's CUDA kernels allocate: the evidence behind the planner's GPU rules.

Runs eager forward + backward of the planner's models (tests/support/models.rs: an MLP, a CNN,
a pre-norm transformer block, a residual net; and the zoo's GPT-2 stack of tests/gpu.rs, in f32
and bf16) at the batch sizes of tests/gpu.rs's planner tests, with PyTorch's allocator history
on, and prints for each the peak above what was live before, and the blocks live at that peak,
each with the op that allocated it. Then times single convolutions' forward and backward to
find cuDNN's workspace, and ResNet-18's on a free card and on a filled one. One `GPU-PROBE ...`
line per measurement, for scripts/gpu-run.sh's log.

    python3 benches/gpu_memory_probe.py [mlp|cnn|transformer|res|gpt2|conv|resnet_conv ...]   # on a CUDA machine
"""
import math
import sys
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("gpu_memory_probe.py: no CUDA device")

DEV = "cuda"
MIB = float(1 << 20)
D, T, HEADS = 512, 128, 8


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(1024, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 10)

    def forward(self, x, y):
        h = F.relu(self.l2(F.relu(self.l1(x))))
        return F.nll_loss(F.log_softmax(self.l3(h), -1), y)


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 16 * 16, 10)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        return F.nll_loss(F.log_softmax(self.fc(h.flatten(1)), -1), y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.head = nn.Linear(D, 10)

    def forward(self, x, y):
        n = x.shape[0]
        qkv = self.qkv(self.ln1(x))
        q, k, v = (qkv.narrow(2, i * D, D).reshape(n, T, HEADS, D // HEADS).transpose(1, 2) for i in range(3))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // HEADS))
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, T, D)
        h = x + self.proj(attended)
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return F.cross_entropy(self.head(h.mean(1)), y)


class Gpt2Stack(nn.Module):
    """tests/gpu.rs's zoo GPT-2 stack: six of toma's `DecoderBlock` (pre-norm, causal mask,
    tanh GELU, dropout 0) over T = 256, then the mean over time and a head of 10."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(
                ln_1=nn.LayerNorm(D), c_attn=nn.Linear(D, 3 * D), attn_proj=nn.Linear(D, D),
                ln_2=nn.LayerNorm(D), c_fc=nn.Linear(D, 4 * D), mlp_proj=nn.Linear(4 * D, D),
            ))
            for _ in range(6)
        )
        self.head = nn.Linear(D, 10)

    def forward(self, x, y):
        n, t, _ = x.shape
        hs = D // HEADS
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        for b in self.blocks:
            q, k, v = (h.view(n, t, HEADS, hs).transpose(1, 2) for h in b["c_attn"](b["ln_1"](x)).chunk(3, 2))
            scores = (q @ k.transpose(-2, -1) * (1.0 / math.sqrt(hs))).masked_fill(future, float("-inf"))
            attended = (scores.softmax(-1) @ v).transpose(1, 2).contiguous().view(n, t, D)
            x = x + b["attn_proj"](attended)
            x = x + b["mlp_proj"](F.gelu(b["c_fc"](b["ln_2"](x)), approximate="tanh"))
        return F.nll_loss(F.log_softmax(self.head(x.mean(1)), -1), y)


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.down, self.bn2 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32)
        self.conv, self.proj = nn.Conv2d(32, 32, 3, padding=1), nn.Conv2d(32, 64, 1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x, y):
        h = F.relu(self.bn1(self.stem(x)))
        h = F.relu(self.bn2(self.down(h)))
        h = F.relu(self.proj(h + F.relu(self.conv(h))))
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return F.nll_loss(F.log_softmax(self.fc(h), -1), y)


def label(frames):
    """The op that asked for a block: the first aten/autograd/cuDNN frame, and the Python line."""
    names = []
    for f in frames:
        name = f.get("name", "")
        if any(k in name for k in ("at::native::", "at::_ops::", "autograd::", "cudnn", "cublas", "Backward")):
            short = name.split("(")[0]
            if short not in names:
                names.append(short)
        if len(names) == 2:
            break
    py = next((f"{f['filename'].split('/')[-1]}:{f['line']}" for f in frames if f["filename"].endswith(".py")), "")
    return " < ".join(names) + (f" @ {py}" if py else "")


def live_at_peak(trace, before_live):
    """Walks the allocator's trace; returns (peak above the start, the blocks live then)."""
    live = {}
    total = peak = 0
    at_peak = {}
    for e in trace:
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    return peak, at_peak


def probe(model_name, build, batch, make_inputs, dtype=torch.float32):
    torch.manual_seed(11)
    for warm in (min(batch, 4), batch):
        model = build().to(DEV, dtype)
        x, y = make_inputs(warm)
        x = x.to(dtype)
        torch.cuda.synchronize()
        if warm != batch:
            model(x, y).backward()
            continue
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        model(x, y).backward()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        measured = torch.cuda.max_memory_allocated() - before
        peak, blocks = live_at_peak(snap["device_traces"][0], before)
        print(f"GPU-PROBE eager model={model_name} dtype={str(dtype).split('.')[-1]} batch={batch} "
              f"peak_above_before_mib={measured / MIB:.2f} "
              f"traced_peak_mib={peak / MIB:.2f}")
        groups = Counter()
        for size, frames in blocks.values():
            groups[(size, label(frames))] += 1
        for (size, what), count in sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1]):
            print(f"    {count} x {size / MIB:10.3f} MiB  {what}")
        del model, x, y
        torch.cuda.empty_cache()


def conv_workspace():
    """cuDNN's extra bytes for one convolution, forward and backward (input and weight), beside
    the bound the planner counts (src/lazy/cost/cuda.rs): the input plus the output (gradient),
    plus 2 MiB forward and 16 MiB backward. `within` says whether the bound held."""
    cases = [  # cin, cout, size, kernel, stride, batch, dtype
        (3, 32, 64, 3, 1, 64, torch.float32),
        (32, 64, 32, 3, 1, 64, torch.float32),
        (32, 32, 32, 3, 1, 64, torch.float32),
        (3, 32, 64, 3, 1, 1024, torch.float32),
        (32, 64, 32, 3, 1, 1024, torch.float32),
        (4, 32, 64, 3, 1, 256, torch.float32),
        (6, 32, 64, 3, 1, 256, torch.float32),
        (16, 32, 64, 3, 2, 256, torch.float32),
        (32, 64, 32, 1, 1, 256, torch.float32),
        (64, 64, 16, 3, 1, 256, torch.float32),
        (3, 64, 112, 7, 2, 64, torch.float32),
        (8, 64, 32, 3, 1, 256, torch.float16),
        (3, 64, 32, 3, 1, 256, torch.float16),
    ]
    for (cin, cout, hw, k, stride, batch, dtype) in cases:
        conv = nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2).to(DEV, dtype)
        x = torch.randn(batch, cin, hw, hw, device=DEV, dtype=dtype, requires_grad=True)
        fwd, bwd, in_bytes, out_bytes = conv_extra(conv, x)
        rule_fwd = in_bytes + out_bytes + 2 * (1 << 20)
        rule_bwd = in_bytes + out_bytes + 16 * (1 << 20)
        within = fwd <= rule_fwd and bwd <= rule_bwd
        print(f"GPU-PROBE conv cin={cin} cout={cout} hw={hw} k={k} stride={stride} batch={batch} "
              f"dtype={str(dtype).split('.')[-1]} forward_extra_mib={fwd / MIB:.2f} bound_forward_mib={rule_fwd / MIB:.2f} "
              f"backward_extra_mib={bwd / MIB:.2f} bound_backward_mib={rule_bwd / MIB:.2f} within={within} "
              f"input_mib={in_bytes / MIB:.2f} output_mib={out_bytes / MIB:.2f} cudnn={torch.backends.cudnn.version()}")
        del conv, x
        torch.cuda.empty_cache()


def conv_extra(conv, x, leave=None):
    """Bytes one convolution takes beyond its output, forward, and beyond its gradients,
    backward (the second of two runs: algorithms are chosen at the first), with the input's and
    output's sizes. With `leave`, the card is filled before the measured run so that only that
    many bytes are free: cuDNN's elastic workspace then shrinks to what is there."""
    elem = x.element_size()
    filler = None
    for run in range(2):
        out = conv(x)
        g = torch.ones_like(out)
        if run == 1 and leave is not None:
            del filler
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            filler = torch.empty(max(free - leave, 0), dtype=torch.uint8, device=DEV)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out2 = conv(x)
        torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated() - base - out2.numel() * elem
        del out2
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = torch.autograd.grad(out, (x, *conv.parameters()), g, retain_graph=True)
        torch.cuda.synchronize()
        bwd = torch.cuda.max_memory_allocated() - base - sum(t.numel() for t in grads) * elem
        in_bytes, out_bytes = x.numel() * elem, out.numel() * elem
        del grads, out, g
    del filler
    return fwd, bwd, in_bytes, out_bytes


def resnet_convs():
    """ResNet-18's convolutions at the zoo's 128x128 input and micro-batch 512 (tests/gpu.rs
    test 12), in f32 and bf16, each on a free card and on one filled to leave its input and
    output and 64 MiB: test 12 planned ResNet-18 in eval 6% over in f32 and 72% over in bf16
    on a filled card after calibrating these on a free one. `calibrated_mib` is what a free
    card shows (what calibration measures), `filled_mib` what the filled card took."""
    shapes = [  # cin, cout, size, kernel, stride
        (3, 64, 128, 7, 2), (64, 64, 32, 3, 1), (64, 128, 32, 3, 2), (64, 128, 32, 1, 2),
        (128, 128, 16, 3, 1), (128, 256, 16, 3, 2), (256, 256, 8, 3, 1), (256, 512, 8, 3, 2),
        (512, 512, 4, 3, 1),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for (cin, cout, hw, k, stride) in shapes:
            conv = nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False).to(DEV, dtype)
            x = torch.randn(512, cin, hw, hw, device=DEV, dtype=dtype, requires_grad=True)
            fwd, bwd, in_bytes, out_bytes = conv_extra(conv, x)
            try:
                ffwd, fbwd, _, _ = conv_extra(conv, x, leave=in_bytes + out_bytes + (64 << 20))
            except torch.cuda.OutOfMemoryError:  # the filler's rounding left too little
                ffwd = fbwd = float("nan")
                torch.cuda.empty_cache()
            print(f"GPU-PROBE resnet_conv cin={cin} cout={cout} hw={hw} k={k} stride={stride} batch=512 "
                  f"dtype={str(dtype).split('.')[-1]} input_mib={in_bytes / MIB:.2f} output_mib={out_bytes / MIB:.2f} "
                  f"forward_calibrated_mib={fwd / MIB:.2f} forward_filled_mib={ffwd / MIB:.2f} "
                  f"backward_calibrated_mib={bwd / MIB:.2f} backward_filled_mib={fbwd / MIB:.2f}")
            del conv, x
            torch.cuda.empty_cache()


def main():
    print(f"GPU-PROBE torch={torch.__version__} cuda={torch.version.cuda} device={torch.cuda.get_device_name(0)} "
          f"tf32_matmul={torch.backends.cuda.matmul.allow_tf32} tf32_cudnn={torch.backends.cudnn.allow_tf32}")
    mlp_in = lambda n: (torch.randn(n, 1024, device=DEV), torch.randint(10, (n,), device=DEV))
    cnn_in = lambda n: (torch.randn(n, 3, 64, 64, device=DEV), torch.randint(10, (n,), device=DEV))
    blk_in = lambda n: (torch.randn(n, T, D, device=DEV), torch.randint(10, (n,), device=DEV))
    gpt_in = lambda n: (torch.randn(n, 256, D, device=DEV), torch.randint(10, (n,), device=DEV))
    models = sys.argv[1:] or ["mlp", "cnn", "transformer", "res", "gpt2"]
    if "mlp" in models:
        for batch in (256, 1024, 4096, 16384):
            probe("mlp", Mlp, batch, mlp_in)
    if "cnn" in models:
        for batch in (64, 256, 1024):
            probe("cnn", Cnn, batch, cnn_in)
    if "transformer" in models:
        for batch in (8, 32, 128):
            probe("transformer", Block, batch, blk_in)
    if "res" in models:
        for batch in (64, 1024):
            probe("res", Res, batch, cnn_in)
    if "gpt2" in models:
        # The zoo's f32 step was 9.4% over its plan on an H200, its bf16 step within 0.3%.
        for dtype, batch in ((torch.float32, 48), (torch.bfloat16, 48), (torch.float32, 162)):
            probe("gpt2", Gpt2Stack, batch, gpt_in, dtype)
    if "conv" in models or not sys.argv[1:]:
        conv_workspace()
    if "resnet_conv" in models or not sys.argv[1:]:
        resnet_convs()


if __name__ == "__main__":
    main()
