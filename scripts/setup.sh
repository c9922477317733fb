#!/usr/bin/env bash
# Set up lmforge in ./.venv (idempotent). torch is installed *before* the package, pinned
# to 2.13.0, so that pip never resolves an unpinned torch (which would pull gigabytes of
# CUDA wheels onto a CPU machine). A torch that is already importable is honoured:
# the venv then sees the system site-packages and no torch is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LMFORGE_VENV:-.venv}
EXTRAS=${LMFORGE_EXTRAS:-}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: using the torch already installed for $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
. "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${LMFORGE_TORCH_VERSION:-2.13.0}"
fi
# Re-install the package only when its metadata changed (keeps repeated runs fast).
stamp="$VENV/.lmforge-installed"
want="$(cat pyproject.toml | sha1sum | cut -c1-16)-${EXTRAS}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # uv installs the ~200 packages of the test extras in seconds where pip takes a minute and a
  # half (BENCHMARKS.md); torch, installed above, already satisfies them. Bytecode is compiled at
  # install, as pip does: where PYTHONDONTWRITEBYTECODE is set, every process would otherwise
  # compile what it imports from source (a suite 45% slower). Where uv cannot be had or fails, pip.
  if python -m pip install -q uv && python -m uv pip install -q --compile-bytecode --python "$VENV/bin/python" -e ".${EXTRAS:+[$EXTRAS]}"; then
    :
  else
    echo "setup: uv was not usable; installing with pip"
    python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
  fi
  echo "$want" > "$stamp"
fi
# The package is installed editable: its own sources are not in site-packages, so the install above
# compiled none of them. Where PYTHONDONTWRITEBYTECODE is set, every lmforge process (a run, its
# supervisor, each torchrun rank, each CLI call) would compile them again: ~0.4 CPU s per training
# process (BENCHMARKS.md). Compiled once here (seconds); an edited file is compiled again in memory.
python -m compileall -q -j 0 lmforge tests bench examples >/dev/null || true
