#!/usr/bin/env bash
# Builds toma's GPU test binaries here (release, against the repo's PyPI torch 2.11.0, the same
# libtorch as the GPU machines' PyTorch 2.11.0+cu130), strips them and packs them into
# gpu-bundle/toma-gpu-tests.tar.xz (git-ignored) for scripts/gpu-run.sh to run on a CUDA machine
# that has PyTorch but no Rust. Prints the bundle's size and how long it took.
#
#   scripts/gpu-bundle.sh            # then carry gpu-bundle/ to the GPU machine
#
# TOMA_BUNDLE_PROFILE=debug builds with cargo test's own profile instead of release: it reuses
# what `cargo test --all-features` (scripts/test.sh) already built, so it takes seconds where a
# cold release build of tch and torch-sys takes minutes. The GPU does the tests' heavy work
# either way.
#
# Binaries: tests/gpu.rs (the GPU tests), the library's unit tests (toma::memory's device
# branch), tests/real_oom.rs (CPU caps with CUDA's libraries loaded) and tests/dist (Gloo's
# all-reduce of CUDA tensors, two ranks on the card). Beside them: Python toma 1.1.0's wheel,
# fetched from PyPI now (never committed), benches/gpu_side_by_side.py, which runs test 7's
# workload through it there (the GPU machine has no network), and benches/gpu_pytorch_peak.py
# (PyTorch's own peak for the planner test's models).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$(date +%s)
scripts/ensure-libtorch.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh

profile="${TOMA_BUNDLE_PROFILE:-release}"
case "$profile" in
  release) profile_flag=(--release) ;;
  debug) profile_flag=() ;;
  *) echo "TOMA_BUNDLE_PROFILE must be release or debug, not $profile" >&2; exit 2 ;;
esac
out="$root/gpu-bundle"
stage="$out/stage"
rm -rf "$stage" "$out/cargo-build.json" "$out/executables.txt"
mkdir -p "$stage/bin"

# The executables cargo built, as "<name> <path>" lines: one per test target.
json="$stage/cargo-build.json"
cargo test -p toma "${profile_flag[@]}" --all-features --no-run --message-format=json \
  --lib --test gpu --test real_oom --test dist >"$json"
python3 - "$json" >"$stage/executables.txt" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["profile"]["test"]:
        kind = msg["target"]["kind"][0]
        name = "unit" if kind == "lib" else msg["target"]["name"]
        print(name, msg["executable"])
EOF
count=$(wc -l <"$stage/executables.txt")
if [ "$count" -ne 4 ]; then
  echo "expected 4 test executables, cargo reported $count:" >&2
  cat "$stage/executables.txt" >&2
  exit 1
fi

while read -r name path; do
  cp "$path" "$stage/bin/$name"
  strip --strip-all "$stage/bin/$name"
done <"$stage/executables.txt"

# Python toma is pure Python: one wheel, no dependencies beyond PyTorch and psutil, which the
# GPU machine has. Without it the run still happens and says the comparison is missing.
mkdir -p "$stage/python"
cp benches/gpu_side_by_side.py benches/gpu_memory_probe.py benches/gpu_pytorch_peak.py \
  benches/gpu_allocator_trace.py "$stage/python/"
if ! python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  -d "$stage/python" toma==1.1.0; then
  echo "warning: could not download Python toma 1.1.0: the bundle runs without the side-by-side" >&2
fi

{
  echo "toma $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+dirty')"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m), $(ldd --version | head -1)"
  echo "$(rustc --version), profile $profile"
  echo "libtorch $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  echo "binaries: $(cut -d' ' -f1 "$stage/executables.txt" | tr '\n' ' ')"
  echo "python: $(cd "$stage/python" && ls | tr '\n' ' ')"
} >"$stage/MANIFEST"

bundle="$out/toma-gpu-tests.tar.xz"
tar -C "$stage" -cf - MANIFEST bin python | xz -T0 -6 >"$bundle"
rm -rf "$stage"

size=$(stat -c %s "$bundle")
echo
echo "bundle: $bundle"
echo "size:   $((size / 1024)) KiB ($(awk -v s="$size" 'BEGIN { printf "%.1f", s / 1048576 }') MiB; carry limit 60 MiB)"
echo "took:   $(($(date +%s) - started)) s"
if [ "$size" -ge $((60 * 1024 * 1024)) ]; then
  echo "the bundle is over 60 MiB" >&2
  exit 1
fi
