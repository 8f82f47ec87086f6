"""What every family reads alike from a ``config.json``: the decoder's shape, its RoPE,
its sliding windows, its experts; and the refusals every family shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vertumnus.config.tables import ConfigError

# (pattern, replacement) for ``re.sub`` over checkpoint tensor names: the checkpoint's
# name -> the shared decoder's (``engine/model.py``, Qwen3's names).
Renames = tuple[tuple[str, str], ...]

# RoPE types the engine computes (``engine/rope.py``), as transformers names them.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# The scalar parameters a RoPE type may carry (kept as ``ModelConfig.rope_params``).
_ROPE_KEYS = (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate",
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One architecture: its names, how its ``config.json`` maps onto ``ModelConfig``
    (``read``: the fields, given the raw dict) and what its checkpoints call tensors
    (``renames``; ``expert_layout`` names a fused expert layout ``engine/weights.py``
    unpacks: "standard" or "gpt_oss")."""

    architecture: str
    model_type: str
    read: Callable[[dict[str, Any]], dict[str, Any]]
    renames: Renames = ()
    expert_layout: str = "standard"


REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")  # fmt: skip


def shape(raw: dict[str, Any]) -> dict[str, Any]:
    """The dense decoder's shape and norms, the fields every family has."""
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"config.json lacks required fields: {', '.join(missing)}")
    refuse_common(raw)
    heads = raw["num_attention_heads"]
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 40_960),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        **rope(raw),
    )


def refuse_common(raw: dict[str, Any]) -> None:
    """What no family here implements: quantized weights, another activation, a
    partial rotary dimension."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise ConfigError(
            f"quantized checkpoints are not supported (quantization_config: quant_method "
            f"{method!r}); give the bf16 or fp32 weights that save_pretrained writes"
        )
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ConfigError(f"unsupported hidden_act {act!r}; supported: silu")
    rope_dict = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = rope_dict.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"partial RoPE (partial_rotary_factor {partial}) is not supported")


def rope(raw: dict[str, Any], default_theta: float = 10_000.0) -> dict[str, Any]:
    """``rope_theta``, ``rope_type`` and its parameters, from transformers 5's
    ``rope_parameters`` or 4.x's ``rope_theta`` and ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if "rope_type" not in params and "type" not in params:  # 4.x: the type in rope_scaling
        params = {**scaling, **params}
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    kept = tuple((key, float(params[key])) for key in _ROPE_KEYS if params.get(key) is not None)
    return {"rope_theta": float(theta), "rope_type": rope_type, "rope_params": kept}


def windows(raw: dict[str, Any], derive: Callable[[int], bool] | None = None) -> dict[str, Any]:
    """``sliding_window`` and which layers use it: ``layer_types`` as written, else
    ``derive(layer)`` (a family's rule), else every layer when a window is given."""
    window = raw.get("sliding_window") or None
    if window is None:
        return {"sliding_window": None, "layer_types": ()}
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        rule = derive or (lambda _: window is not None)
        types = ["sliding_attention" if rule(i) else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"unsupported layer_types {unknown}; supported: full and sliding")
    if "sliding_attention" not in types:
        return {"sliding_window": None, "layer_types": ()}
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def experts(raw: dict[str, Any], count_key: str, size_key: str) -> dict[str, Any]:
    """The mixture-of-experts fields under their names in this family's config."""
    count = raw.get(count_key, raw.get("num_experts", raw.get("num_local_experts")))
    found = {
        count_key: count,
        "num_experts_per_tok": raw.get("num_experts_per_tok"),
        size_key: raw.get(size_key),
    }
    missing = [k for k, v in found.items() if v is None]
    if missing:
        raise ConfigError(f"config.json lacks MoE fields: {', '.join(missing)}")
    return {
        "num_experts": int(count),  # type: ignore[arg-type]
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw[size_key]),
    }
