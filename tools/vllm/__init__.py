"""vLLM beside the pool (``setup.sh`` installs its CPU build in .venv-vllm)."""
