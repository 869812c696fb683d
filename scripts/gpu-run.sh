#!/usr/bin/env bash
# Runs the bundle of scripts/gpu-bundle.sh on a CUDA machine: needs PyTorch 2.11 for `python3`
# (its lib folder is the libtorch the binaries load), no Rust and no network. Unpacks the
# bundle, runs every binary with TOMA_CUDA_TESTS=1, and ends with a Markdown summary to paste
# into the README. Exits non-zero when a binary fails.
#
#   scripts/gpu-run.sh [gpu-bundle/toma-gpu-tests.tar.xz]
#
# Environment: PYTHON (default python3), TOMA_GPU_TIMEOUT (seconds per binary, default 480),
# TOMA_GPU_LOG (a file for the full output; default: a temporary one, named at the end).
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
  timeout "$timeout_s" "$bin" --test-threads=1 --nocapture 2>&1 | tee -a "$log"
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
