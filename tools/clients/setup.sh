#!/usr/bin/env bash
# Install the client lane's benchmark clients, each into a virtual environment of
# its own under .venv-clients/ (git-ignored): aiperf (NVIDIA AI-Perf, needs no torch)
# and guidellm (which needs torch: the CPU build 2.13.0 goes in first, so that pip
# takes no CUDA build). Versions are pinned to those the lane was checked with.
# Idempotent: a client already installed at its version is left as it is.
# PYTHON picks the interpreter (3.11 to 3.13; default: python3.11, else python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
AIPERF=aiperf==0.13.0
GUIDELLM=guidellm==0.8.1
TORCH=torch==2.13.0
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENVS=.venv-clients

install() {  # install NAME REQUIREMENT... (the last one is the client)
  local name=$1 venv=$VENVS/$1
  shift
  local want=${*: -1}
  local have=""
  [ -x "$venv/bin/$name" ] && have=$("$venv/bin/python" -m pip show "$name" 2>/dev/null || true)
  if grep -qx "Version: ${want#*==}" <<<"$have"; then
    echo "$name: ${want#*==} already in $venv"
    return
  fi
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  for req in "$@"; do
    # (this machine's pip configuration names index folders that may be absent)
    "${pip[@]}" install "$req" 2> >(grep -v "^WARNING: Location" >&2)
  done
  echo "$name: ${want#*==} in $venv ($(du -sh "$venv" | cut -f1))"
}

install aiperf "$AIPERF"
install guidellm "$TORCH" "$GUIDELLM"
if "$VENVS/guidellm/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is None)"; then
  echo "warning: guidellm's venv has a CUDA build of torch" >&2
fi
echo "clients ready under $VENVS/: run python -m tools.clients.run_lane"
