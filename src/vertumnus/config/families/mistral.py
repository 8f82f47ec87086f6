"""Mistral: Llama's decoder with a sliding window on every layer (``sliding_window``;
null: full attention)."""

from __future__ import annotations

from typing import Any

from vertumnus.config.families.common import Family, shape, windows
from vertumnus.config.tables import ConfigError


def read(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("layer_types"):
        # transformers itself ignores a Mistral's layer_types (Ministral has them).
        raise ConfigError("a Mistral config with layer_types (Ministral) is not supported")
    return {**shape(raw), **windows(raw), "qk_norm": False}


FAMILY = Family("MistralForCausalLM", "mistral", read)
