"""Benchmarks: ``python -m tools.bench.NAME --help``; ``harness.py`` records the
machine and the run in each one's JSON."""
