#!/usr/bin/env bash
# Set up (tools/setup.sh, and tools/browser.sh: Chromium for tests/browser), then
# lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bash tools/browser.sh
.venv/bin/ruff check src tests tools
.venv/bin/ruff format --check src tests tools
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
