#!/usr/bin/env bash
# The main demo: a real out-of-memory caught, the batch size adapting, the cache hitting.
# Installs libtorch into .venv first if it is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/ensure-libtorch.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh
exec cargo run --quiet --example demo -- "$@"
