#!/usr/bin/env bash
# Python toma (from PyPI) and Rust toma on the same two workloads, in one go, on this machine:
#   1. a #[toma::batch] / @toma.batch call that needs no retry (default StacktraceMemory cache);
#   2. toma's own benchmark: fill zeros(128, 256, 256) with 1.0 in chunks of 32 rows.
# Installs libtorch (and Python toma into the same venv) if missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/ensure-libtorch.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh
python -c 'import toma' 2>/dev/null || python -m pip install --quiet --disable-pip-version-check toma==1.1.0 psutil
cargo bench --quiet --bench side_by_side >/tmp/toma-rust.$$ 2>/dev/null || cargo bench --bench side_by_side >/tmp/toma-rust.$$
python -W ignore benches/side_by_side.py >/tmp/toma-python.$$
python - /tmp/toma-python.$$ /tmp/toma-rust.$$ <<'PY'
import sys
v = {}
lines = [line for path in sys.argv[1:] for line in open(path)]
for line in lines:
    parts = line.split()
    if len(parts) == 3:
        v[parts[0]] = float(parts[1])
rows = [
    ("batch call, no retry (ns)", v["python_batch_call"], v["rust_batch_call"], "python plain call %.0f ns" % v["python_plain_call"]),
    ("chunked fill 128x256x256 by 32 (ms)", v["python_fill_toma"], v["rust_fill_toma"],
     "native loops: python %.3f ms, rust %.3f ms" % (v["python_fill_native"], v["rust_fill_native"])),
]
print("machine: %d cores; Rust built by cargo bench (release)" % __import__('os').cpu_count())
print("| workload | Python toma 1.1.0 | Rust toma | Python / Rust | baseline |")
print("|---|---|---|---|---|")
for name, py, rs, base in rows:
    digits = 0 if "(ns)" in name else 3
    print(f"| {name} | {py:,.{digits}f} | {rs:,.{digits}f} | {py / rs:,.0f}x | {base} |")
PY
rm -f /tmp/toma-rust.$$ /tmp/toma-python.$$
