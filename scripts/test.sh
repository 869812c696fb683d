#!/usr/bin/env bash
# The full test suite: formatting, lints, tests with all features and with none, docs.
# Installs libtorch into .venv first if it is missing. `.ci/run` calls exactly this.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/ensure-libtorch.sh
# The test that renders the pictures in a browser (skipped, and saying so, where it cannot install).
scripts/ensure-chromium.sh
# gloo's headers for feature `dist`'s Gloo process group (Debian's libgloo-dev, 49 kB).
scripts/ensure-gloo-headers.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh

started=$SECONDS
step() { printf '\n==> [%ss] %s\n' "$((SECONDS - started))" "$*"; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "layers: the import graph of src/ has no cycle"
python3 scripts/layers.py
step "tch-methods: docs/tch-example-methods.csv says which of tch's example methods run lazily"
python3 scripts/tch-methods.py
step "cargo clippy (all targets, all features, -D warnings)"
cargo clippy --workspace --all-targets --all-features -- -D warnings
step "cargo clippy (all targets, no default features, -D warnings)"
cargo clippy --workspace --all-targets --no-default-features -- -D warnings
# The peak suites run twice: as users run them, and with no rule trusted (TOMA_TRUST_RULES=0:
# every priced call measured). A machine nobody here has dispatches kernels nobody read rules
# for, and measurement alone must plan them. On a CPU with AVX-512 or AVX-VNNI that second run
# is also an AVX2 CPU's (oneDNN and ATen capped: the kernels oneDNN picks there); without
# either, the first run used the AVX2 kernels already. The second run goes beside the first
# pass: it counts its own process's bytes, and what it costs in time hides behind the tests
# that wait on one core.
cap=()
if grep -qwE 'avx512f|avx_vnni' /proc/cpuinfo 2>/dev/null; then
  cap=(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)
fi
step "cargo test (all features); beside it, the peak suites with no rule trusted ${cap[*]}"
# Tests and doctests, not the examples: clippy above type-checks them, and linking each against
# libtorch here would run nothing.
cargo test --workspace --all-features --lib --bins --tests --no-run
peak_suites="$(cargo test --workspace --all-features --test lazy_peak --test lazy_recompute --no-run \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        print(message["executable"])')"
rules_off_log="$(mktemp)"
(
  status=0
  for suite in $peak_suites; do
    echo "--- $suite, TOMA_TRUST_RULES=0 ${cap[*]}"
    env "${cap[@]}" TOMA_TRUST_RULES=0 "$suite" || status=$?
  done
  exit "$status"
) >"$rules_off_log" 2>&1 &
rules_off=$!
trap 'kill "$rules_off" 2>/dev/null || true' EXIT
cargo test --workspace --all-features --lib --bins --tests
cargo test --workspace --all-features --doc
step "the peak suites with no rule trusted (TOMA_TRUST_RULES=0 ${cap[*]}), run beside the tests above"
rules_off_status=0
wait "$rules_off" || rules_off_status=$?
trap - EXIT
cat "$rules_off_log"
if [ "$rules_off_status" -ne 0 ] || [ "$(grep -c '^test result: ok' "$rules_off_log")" -ne 2 ]; then
  echo "the peak suites failed with no rule trusted (exit $rules_off_status)" >&2
  exit 1
fi
step "machine tests as an AVX2 CPU (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)"
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 cargo test --workspace --all-features --test lazy -- machine:: plan:: op_table::
step "cargo test (no default features: no libtorch, no CUDA, no macros)"
cargo test --workspace --no-default-features
step "compile-error UI tests (macros without libtorch: trybuild builds its own copy)"
cargo test -p toma --no-default-features --features macros --test ui
step "GPU test bundle (packed here; scripts/gpu-run.sh runs it on a CUDA machine)"
TOMA_BUNDLE_PROFILE=debug scripts/gpu-bundle.sh
step "cargo doc (no warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --all-features --no-deps
step "docs.rs build: its features, no libtorch (tch's doc-only bindings; the shim is skipped)"
env -u LIBTORCH_USE_PYTORCH -u LIBTORCH DOCS_RS=1 RUSTDOCFLAGS="-D warnings" \
  cargo doc -p toma --no-deps --no-default-features --features "tch/doc-only,cuda,macros,anyhow,progress"
step "cargo publish --dry-run (both crates packaged and built from the packages, without libtorch; the C++ shims packaged)"
# Built without tch: verifying with libtorch would build torch-sys's C++ again from the
# registry copy (a minute), and the tests above already built the shims from these files.
cargo publish --dry-run --workspace --allow-dirty --no-default-features --features macros
listed="$(cargo package -p toma --list --allow-dirty 2>/dev/null)"
for file in build.rs src/shim/toma_shim.cpp src/shim/toma_shim.h src/shim/toma_dist.cpp src/shim/toma_dist.h; do
  grep -qx "$file" <<<"$listed" || { echo "the toma package lacks $file" >&2; exit 1; }
done
step "all checks passed"
