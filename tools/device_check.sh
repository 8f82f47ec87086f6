#!/usr/bin/env bash
# The device check: on a machine with one NVIDIA GPU, measure what a CPU cannot
# (tools/device/README.md): exactness on CUDA against transformers, the C = 1 prefill
# of Qwen3-30B-A3B's shape (time, MFU, against transformers and the shipped profile),
# a measured degree-1 profile, the host link; CP across ranks is recorded as skipped.
#
#   tools/device_check.sh [--dry-run] [--out DIR] [--peak-tflops T] [--budget-s S]
#
# --dry-run: the same code on the CPU with small shapes, in well under a minute (CI).
# Writes DIR/device_check.json and DIR/qwen3-30b-a3b-<gpu>-measured.json and prints
# a table. The Python: $PYTHON, else .venv/bin/python, else build/device-venv (made
# by an earlier run), else python3, the first whose torch (with CUDA unless a dry
# run), transformers and the project's dependencies import, with src/ on PYTHONPATH.
# If none has them (a GPU run only): a virtual environment in build/device-venv,
# seeing the system's packages when a Python there has a CUDA torch (so that torch
# is not downloaded again), with the project and transformers installed into it, and
# torch (VERTUMNUS_TORCH, default torch==2.13.0: a CUDA build from the default
# index) only where no CUDA torch is found. What was found or installed is printed
# and recorded in the JSON ("env").
set -uo pipefail
CALLER=$(pwd)
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DRY=0
OUT=""
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --out) OUT="${2:?--out needs a folder}"; shift 2 ;;
    --out=*) OUT="${1#--out=}"; shift ;;
    *) PASS+=("$1"); shift ;;
  esac
done
OUT=${OUT:-"$ROOT/results/device-check-$(date -u +%Y%m%dT%H%M%SZ)"}
case "$OUT" in /*) ;; *) OUT="$CALLER/$OUT" ;; esac  # relative to where it was called
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "[device_check] $*" >&2; }

# The import check: 0 if this Python can run the check (with CUDA unless a dry run).
env_ok() {
  "$1" - "$2" >/dev/null 2>&1 <<'EOF'
import sys
import torch, transformers, numpy, scipy  # noqa: F401
import vertumnus.engine.zigzag, vertumnus.runtime.prefill, vertumnus.runtime.host_link  # noqa
sys.exit(0 if sys.argv[1] == "cpu" or torch.cuda.is_available() else 1)
EOF
}
has_cuda_torch() {
  "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1
}
describe() {
  "$1" -c "import sys, torch; print(f'{sys.executable}: torch {torch.__version__}, CUDA ' + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'not available'))" 2>&1 | tail -1
}

NEED=cuda
[ "$DRY" = 1 ] && NEED=cpu
CANDIDATES=()
[ -n "${PYTHON:-}" ] && CANDIDATES+=("$PYTHON")
CANDIDATES+=(.venv/bin/python build/device-venv/bin/python python3)
PY=""
for cand in "${CANDIDATES[@]}"; do
  if command -v "$cand" >/dev/null 2>&1 && env_ok "$cand" "$NEED"; then PY=$cand; break; fi
done
if [ -n "$PY" ]; then
  NOTE="found: $(describe "$PY")"
elif [ "$DRY" = 1 ]; then
  say "no Python here has torch, transformers and the project's dependencies; run tools/setup.sh"
  exit 2
else
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >&2
  BASE=""
  for cand in "${CANDIDATES[@]}"; do
    if command -v "$cand" >/dev/null 2>&1 && has_cuda_torch "$cand"; then BASE=$cand; break; fi
  done
  VENV=build/device-venv
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  mkdir -p build
  if [ -n "$BASE" ]; then
    say "no ready Python; $BASE has a CUDA torch: $VENV sees its packages, installing the project"
    "$BASE" -m venv --system-site-packages "$VENV" \
      && timeout 600 "${PIP[@]}" install -e . "transformers>=4.51"
    NOTE="installed: the project and transformers into $VENV over $(describe "$BASE")"
  else
    TORCH=${VERTUMNUS_TORCH:-torch==2.13.0}
    say "no CUDA torch found: $VENV with $TORCH, the project and transformers (needs a registry)"
    python3 -m venv "$VENV" \
      && timeout 900 "${PIP[@]}" install "$TORCH" \
      && timeout 600 "${PIP[@]}" install -e . "transformers>=4.51"
    NOTE="installed: $TORCH, the project and transformers into $VENV"
  fi
  if env_ok "$VENV/bin/python" cuda; then
    PY=$VENV/bin/python
    NOTE="$NOTE; now $(describe "$PY")"
  else
    # Run anyway with the best Python there is: the JSON records that CUDA is missing.
    for cand in "$VENV/bin/python" "${CANDIDATES[@]}"; do
      if command -v "$cand" >/dev/null 2>&1 && env_ok "$cand" cpu; then PY=$cand; break; fi
    done
    NOTE="$NOTE; FAILED: no Python with a CUDA torch, transformers and the project"
    if [ -z "$PY" ]; then
      say "$NOTE"
      printf '{"dry_run": false, "env": "%s", "steps_ran": false}\n' "${NOTE//\"/\'}" \
        >"$OUT/device_check.json"
      exit 2
    fi
  fi
fi
say "python: $NOTE"
MODE=""
[ "$DRY" = 1 ] && MODE="--dry-run"
exec "$PY" -m tools.device.check $MODE --out "$OUT" --env-note "$NOTE" \
  --command "tools/device_check.sh${MODE:+ $MODE} --out $OUT${PASS[*]:+ ${PASS[*]}}" \
  ${PASS[@]+"${PASS[@]}"}
