"""Llama (2, 3.x and their fine-tunes): the shared decoder without q/k norm; RoPE
scaled ``llama3``, ``linear`` or ``dynamic``; optional biases on q, k, v and o.

``dynamic`` (NTK) RoPE rescales its frequencies from the length of each forward pass
beyond ``max_position_embeddings``; below that it is the default RoPE, and the engine
never goes past ``max_position_embeddings``, so it serves it as the default, exactly.
``mlp_bias`` is refused."""

from __future__ import annotations

from typing import Any

from vertumnus.config.families.common import Family, shape
from vertumnus.config.tables import ConfigError


def read(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias (biases on the MLP projections) is not supported")
    bias = bool(raw.get("attention_bias", False))
    return {**shape(raw), "qk_norm": False, "attention_bias": bias, "o_proj_bias": bias}


FAMILY = Family("LlamaForCausalLM", "llama", read)
