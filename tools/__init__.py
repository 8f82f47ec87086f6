"""The project's tools, one package run from the repository root as modules
(``.venv/bin/python -m tools.bench.prefill --help``): ``bench/`` the benchmarks,
``experiments/`` the simulator's experiments and reports, ``gen/`` generated files,
``clients/`` benchmark clients nobody here wrote against ``serve``, ``device/`` the
GPU check (``device_check.sh``), ``vllm/`` vLLM beside the pool, ``browser.py``
headless Chromium for the dashboard benchmark and the browser tests. Tools import
one another as ``tools.<folder>.<module>`` and nothing from ``tests/``; the tests
import ``tools`` through pytest's ``pythonpath`` (pyproject.toml)."""
