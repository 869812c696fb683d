# Source this: points cargo and the loader at the repo's libtorch (scripts/ensure-libtorch.sh).
_toma_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_toma_venv="${TOMA_VENV:-$_toma_root/.venv}"
export LIBTORCH_USE_PYTORCH=1
export PATH="$_toma_venv/bin:$PATH"
_toma_torch_lib="$("$_toma_venv/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)"
if [ -n "$_toma_torch_lib" ]; then
  export LD_LIBRARY_PATH="$_toma_torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
unset _toma_root _toma_venv _toma_torch_lib
