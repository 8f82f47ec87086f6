#!/usr/bin/env bash
# Set up (tools/setup.sh, with the compiled replay loop, and tools/browser.sh: Chromium
# for tests/browser), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/browser.sh
.venv/bin/ruff check src tests tools
.venv/bin/ruff format --check src tests tools
.venv/bin/mypy
# Where a C compiler is found, the compiled replay loop must be built and current
# (tests/policy/control/test_native.py fails instead of skipping).
if command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; then
  export VERTUMNUS_REQUIRE_NATIVE=1
fi
.venv/bin/python -m pytest -q "$@"
