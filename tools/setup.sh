#!/usr/bin/env bash
# Set up Vertumnus in ./.venv: torch first (the CPU build of 2.13.0 on machines without
# an NVIDIA GPU, a CUDA build where nvidia-smi sees one), then the package and its test
# extra. Idempotent: a second run only checks. Override the torch requirement with
# VERTUMNUS_TORCH (e.g. VERTUMNUS_TORCH="torch==2.13.0+cu128").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if [ -n "${VERTUMNUS_TORCH:-}" ]; then
    "${PIP[@]}" install "$VERTUMNUS_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" install "torch>=2.5"          # CUDA build from the default index
  else
    "${PIP[@]}" install "torch==2.13.0"       # CPU build (this project's machines keep it on disk)
  fi
fi
"${PIP[@]}" install -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
# The replay loop compiled by mypyc (src/vertumnus/native.py); without a C compiler
# the pure module runs, slower, with the same results.
.venv/bin/python -m tools.build_native \
  || echo "warning: the compiled replay loop was not built; the pure Python one runs" >&2
.venv/bin/python -c "import vertumnus, torch; print(f'vertumnus ready: torch {torch.__version__}')"
