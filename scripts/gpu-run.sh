#!/usr/bin/env bash
# Runs the bundle of scripts/gpu-bundle.sh on a CUDA machine: needs PyTorch 2.11 for `python3`
# (its lib folder is the libtorch the binaries load), no Rust and no network. Unpacks the
# bundle, runs every binary with TOMA_CUDA_TESTS=1, then Python toma on the side-by-side
# workload (when the bundle carries its wheel), and ends with a Markdown summary to paste into
# docs/gpu.md. Exits non-zero when a binary or the Python half fails.
#
#   scripts/gpu-run.sh [gpu-bundle/toma-gpu-tests.tar.xz]
#
# Environment: PYTHON (default python3), TOMA_GPU_TIMEOUT (seconds per binary, default 480),
# TOMA_GPU_LOG (a file for the full output; default: a temporary one, named at the end),
# TOMA_TRACE_DIR (where the allocator traces go; default: beside the log's temporary folder).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:-$root/gpu-bundle/toma-gpu-tests.tar.xz}"
python="${PYTHON:-python3}"
timeout_s="${TOMA_GPU_TIMEOUT:-480}"
[ -f "$bundle" ] || { echo "no bundle at $bundle: run scripts/gpu-bundle.sh where Rust is" >&2; exit 2; }

work="$(mktemp -d)"
log="${TOMA_GPU_LOG:-$work/gpu-run.log}"
# Python's tarfile rather than tar -J: the machine may lack the xz program, never Python.
"$python" - "$bundle" "$work" <<'EOF' || { echo "cannot unpack $bundle" >&2; exit 2; }
import sys, tarfile
with tarfile.open(sys.argv[1]) as bundle:
    try:
        bundle.extractall(sys.argv[2], filter="data")
    except TypeError:  # Python before 3.12 and its backports: no filters
        bundle.extractall(sys.argv[2])
EOF

torch_dir="$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)"
[ -d "$torch_dir/lib" ] || { echo "$python has no PyTorch: the binaries need its libtorch" >&2; exit 2; }
torch_version="$("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)"
export LD_LIBRARY_PATH="$torch_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TOMA_CUDA_TESTS=1
export RUST_BACKTRACE=1

gpu="no nvidia-smi"
if command -v nvidia-smi >/dev/null; then
  gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  gpu="${gpu%%,*} (driver${gpu#*,})"
fi

{
  echo "== machine: $gpu; PyTorch $torch_version at $torch_dir"
  sed 's/^/== bundle: /' "$work/MANIFEST"
} | tee "$log"

declare -a rows=()
failed=0
for bin in "$work"/bin/*; do
  name="$(basename "$bin")"
  missing="$(ldd "$bin" 2>&1 | grep 'not found' || true)"
  if [ -n "$missing" ]; then
    echo "== $name: libraries not found:" | tee -a "$log"
    echo "$missing" | tee -a "$log"
    rows+=("| $name | FAILED: libraries not found ($(echo "$missing" | awk '{print $1}' | tr '\n' ' ')) |")
    failed=1
    continue
  fi
  echo "== $name" | tee -a "$log"
  # This binary's own result line: grep only what it adds to the log.
  lines_before=$(wc -l <"$log")
  started=$(date +%s)
  # One test at a time: they share the card (tests/gpu.rs also takes turns itself).
  # The GPU tests are #[ignore]d for machines without one: include them here.
  # tests/dist: its GPU test and the CPU Gloo sum beside it (the rest need no card).
  filter=()
  [ "$name" = dist ] && filter=(gloo)
  timeout "$timeout_s" "$bin" "${filter[@]}" --include-ignored --test-threads=1 --nocapture 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  secs=$(($(date +%s) - started))
  result="$(tail -n +"$((lines_before + 1))" "$log" | grep -E '^test result:' | tail -1 | sed 's/^test result: //')"
  if [ "$rc" -eq 0 ]; then
    rows+=("| $name | $result (${secs} s) |")
  else
    [ "$rc" -eq 124 ] && result="timed out after ${timeout_s} s"
    rows+=("| $name | FAILED, exit $rc: $result (${secs} s) |")
    failed=1
  fi
done

# The zoo again with the caching allocator's expandable segments: whether what a filled card
# refuses is fragmentation (free memory in pieces) rather than the plan.
if [ -x "$work/bin/gpu" ]; then
  echo "== gpu zoo, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" | tee -a "$log"
  started=$(date +%s)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOMA_GPU_ZOO_TAG=expandable \
    timeout "$timeout_s" "$work/bin/gpu" zoo_steps --include-ignored --test-threads=1 --nocapture 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  result="$(grep -E '^test result:' "$log" | tail -1 | sed 's/^test result: //')"
  rows+=("| gpu zoo, expandable segments | $([ "$rc" -eq 0 ] || echo "FAILED, exit $rc: ")$result ($(($(date +%s) - started)) s) |")
fi

# The Python half of test 7's side-by-side: Python toma from the bundle's wheel, installed
# into a folder of its own (no network there, nothing of the machine's changed).
side="$work/python/gpu_side_by_side.py"
wheel="$(ls "$work"/python/toma-*.whl 2>/dev/null | head -1)"
if [ -f "$side" ] && [ -n "$wheel" ]; then
  echo "== python-toma ($(basename "$wheel"))" | tee -a "$log"
  started=$(date +%s)
  if "$python" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$work/site" "$wheel" >>"$log" 2>&1; then
    PYTHONPATH="$work/site" PYTHONUNBUFFERED=1 timeout "$timeout_s" "$python" -W ignore "$side" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
  else
    echo "pip could not install $wheel" | tee -a "$log"
    rc=1
  fi
  secs=$(($(date +%s) - started))
  if [ "$rc" -eq 0 ]; then
    rows+=("| python-toma | ran (${secs} s) |")
  else
    rows+=("| python-toma | FAILED, exit $rc (${secs} s) |")
    failed=1
  fi
else
  echo "== python-toma: not in the bundle (no wheel or script): no side-by-side" | tee -a "$log"
  rows+=("| python-toma | not in the bundle: no side-by-side |")
fi

# PyTorch's own peak for the planner test's models, written in PyTorch: beside toma's plans.
pytorch_peak="$work/python/gpu_pytorch_peak.py"
if [ -f "$pytorch_peak" ]; then
  echo "== pytorch peak" | tee -a "$log"
  started=$(date +%s)
  PYTHONUNBUFFERED=1 timeout "$timeout_s" "$python" -W ignore "$pytorch_peak" 2>&1 | tee -a "$log"
  if [ "${PIPESTATUS[0]}" -eq 0 ]; then
    rows+=("| pytorch peak | ran ($(($(date +%s) - started)) s) |")
  else
    rows+=("| pytorch peak | FAILED (see the log) |")
    failed=1
  fi
fi

# What libtorch's kernels allocate, seen through PyTorch's own allocator history: the evidence
# for the planner's CUDA rules (src/lazy/cost/cuda.rs). Diagnostic: its lines go to the log only.
probe="$work/python/gpu_memory_probe.py"
if [ -f "$probe" ]; then
  echo "== memory probe" | tee -a "$log"
  if PYTHONUNBUFFERED=1 timeout "$timeout_s" "$python" -W ignore "$probe" >>"$log" 2>&1; then
    rows+=("| memory probe | ran ($(grep -c '^GPU-PROBE' "$log") lines in the log) |")
  else
    rows+=("| memory probe | FAILED (see the log) |")
    failed=1
  fi
fi

# The caching allocator's own history, for its model's replay on the CPU
# (src/lazy/cost/caching/trace.rs): commit the files under tests/data/allocator-traces/.
tracer="$work/python/gpu_allocator_trace.py"
traces="${TOMA_TRACE_DIR:-$work/traces}"
if [ -f "$tracer" ]; then
  echo "== allocator traces into $traces" | tee -a "$log"
  ok=1
  PYTHONUNBUFFERED=1 timeout "$timeout_s" "$python" -W ignore "$tracer" "$traces" 2>&1 | tee -a "$log" || ok=0
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 timeout "$timeout_s" \
    "$python" -W ignore "$tracer" "$traces" 2>&1 | tee -a "$log" || ok=0
  if [ "$ok" -eq 1 ]; then
    rows+=("| allocator traces | $(ls "$traces" | wc -l) files in $traces |")
  else
    rows+=("| allocator traces | FAILED (see the log) |")
    failed=1
  fi
fi
echo
echo "### GPU run: $gpu, PyTorch $torch_version"
echo
sed 's/^/    /' "$work/MANIFEST"
echo
echo "| binary | result |"
echo "|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "| measurement | values |"
echo "|---|---|"
grep -E '^GPU-RESULT ' "$log" | while read -r _ name fields; do
  echo "| $name | ${fields// /, } |"
done
skipped="$(grep -cE ': skipped: ' "$log" || true)"
echo
echo "Skipped tests: $skipped (lines with \": skipped: \" in the log). Full log: $log"
exit "$failed"
