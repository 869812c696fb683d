#!/usr/bin/env bash
# Re-draws the README's pictures (docs/plan.svg, docs/run.svg) from real runs on this machine.
# Installs libtorch into .venv first if it is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/ensure-libtorch.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh
cargo run --quiet --example pictures -- docs
