"""Benchmark clients nobody here wrote (aiperf, guidellm) against a whole ``serve``:
``python -m tools.clients.run_lane`` (``setup.sh`` installs them)."""
