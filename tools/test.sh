#!/usr/bin/env bash
# Set up (tools/setup.sh, with the compiled replay loop; tools/browser.sh: Chromium for
# tests/browser; tools/clients/setup.sh: the benchmark clients; tools/vllm/setup.sh:
# vLLM's CPU build), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/browser.sh
# The client lane (tests/clients): aiperf and guidellm in virtualenvs of their own
# (about 2.7 GB, 2-3 minutes the first time); VERTUMNUS_CLIENT_LANE=0 leaves it out.
if [ "${VERTUMNUS_CLIENT_LANE:-1}" != 0 ]; then
  bash tools/clients/setup.sh
fi
# The vLLM lane (tests/interop): vLLM's CPU build in .venv-vllm (about 3.5 GB, 3-4
# minutes the first time); VERTUMNUS_VLLM_LANE=0 leaves it out.
if [ "${VERTUMNUS_VLLM_LANE:-1}" != 0 ]; then
  bash tools/vllm/setup.sh
fi
.venv/bin/ruff check src tests tools
.venv/bin/ruff format --check src tests tools
.venv/bin/mypy
# Where a C compiler is found, the compiled replay loop must be built and current
# (tests/policy/control/test_native.py fails instead of skipping).
if command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; then
  export VERTUMNUS_REQUIRE_NATIVE=1
fi
# Two pytest-xdist workers (VERTUMNUS_TEST_WORKERS; 0: one process), each running a
# module at a time (its module-scoped servers and rank pools start once), the slow
# lanes' modules first (tests/conftest.py): about 10 minutes on 2 cores, not 17.
.venv/bin/python -m pytest -q -n "${VERTUMNUS_TEST_WORKERS:-2}" \
  --dist loadscope --no-loadscope-reorder "$@"
