#!/usr/bin/env bash
# The main demo: a real out-of-memory caught, the batch size adapting, the cache hitting.
# Installs libtorch into .venv first if it is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/ensure-libtorch.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh
# Build first with cargo's progress on screen (a cold build of tch takes minutes), then run.
echo "toma demo: building (a first build compiles libtorch's bindings: 2-4 minutes)" >&2
cargo build --example demo
exec cargo run --quiet --example demo -- "$@"
