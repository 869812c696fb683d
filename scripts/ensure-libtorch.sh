#!/usr/bin/env bash
# Installs libtorch (PyTorch 2.11.0 from PyPI, the build tch 0.24 expects) into an ignored venv
# inside the repo, once. Prints nothing but progress; safe to run again (idempotent).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TOMA_VENV:-$root/.venv}"
torch_version="2.11.0"

have_torch() {
  [ -x "$venv/bin/python" ] &&
    "$venv/bin/python" - "$torch_version" <<'PY' >/dev/null 2>&1
import sys, importlib.metadata as m
sys.exit(0 if m.version("torch").split("+")[0] == sys.argv[1] else 1)
PY
}

if have_torch; then
  exit 0
fi
# The wheel and its CUDA libraries take ~4.6 GiB installed; without a cache pip needs little
# more. Below that pip would fail anyway, halfway and with ENOSPC.
need_kb=$((46 * 1024 * 1024 / 10))
mkdir -p "$(dirname "$venv")"
free_kb="$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 { print $4 }')"
if [ -n "$free_kb" ] && [ "$free_kb" -lt "$need_kb" ]; then
  echo "toma: torch==$torch_version needs ~4.6 GiB free under $(dirname "$venv"); $((free_kb / 1024)) MiB are." >&2
  echo "toma: free some space (old clones' .venv and target/ are the usual culprits), or set TOMA_VENV to a disk with room." >&2
  exit 1
fi
echo "toma: installing torch==$torch_version into $venv (once; ~1 min, ~4.7 GB)" >&2
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "torch==$torch_version"
have_torch || { echo "toma: torch==$torch_version did not install into $venv" >&2; exit 1; }
