#!/usr/bin/env bash
# Every plan the test suite makes, with a corpus of random convolutions and several samples of
# the generated models, as sorted lines (one per graph: its structure and, for both modes and
# several micro-batches, the peak and a hash of every step's bytes) in the file given.
# A refactor of the planner must leave this file byte-identical:
#   git stash; scripts/plan-snapshot.sh /tmp/before.txt; git stash pop
#   scripts/plan-snapshot.sh /tmp/after.txt; diff /tmp/before.txt /tmp/after.txt
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="$(realpath -m "${1:?usage: scripts/plan-snapshot.sh <output file>}")"
# shellcheck source=scripts/env.sh
source scripts/env.sh
raw="$(mktemp)"
trap 'rm -f "$raw"' EXIT
export TOMA_PLAN_SNAPSHOT="$raw"
# proptest draws its shapes from a fixed seed, so that two runs plan the same graphs.
export PROPTEST_RNG_SEED=20261124
cargo test --quiet --all-features --test lazy -- --test-threads=1 >/dev/null
for seed in default 1 2 3 12345 777; do
  if [ "$seed" = default ]; then unset TOMA_PEAK_SEED; else export TOMA_PEAK_SEED=$seed; fi
  TOMA_CORPUS=3000 cargo test --quiet --all-features --test lazy_peak -- --include-ignored >/dev/null
done
sort -u "$raw" >"$out"
echo "$(wc -l <"$out") distinct graphs planned -> $out"
