"""Vertumnus inside engines people run: ``vllm/``, a KV connector that lets a vLLM
decode instance take its prompts' KV from the prefill pool."""
