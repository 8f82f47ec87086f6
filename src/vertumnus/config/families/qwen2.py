"""Qwen2 (Qwen2.5) and Qwen2-MoE: no q/k norm, biases on q, k and v (not o), and
sliding windows only where ``use_sliding_window`` asks (Qwen2: layers from
``max_window_layers`` on; Qwen2-MoE: even layers below it). Qwen2-MoE adds a shared
expert beside the routed ones, scaled by a sigmoid gate of its own."""

from __future__ import annotations

from typing import Any

from vertumnus.config.families.common import Family, experts, shape, windows


def _windows(raw: dict[str, Any], moe: bool) -> dict[str, Any]:
    if not raw.get("use_sliding_window"):
        return windows({**raw, "sliding_window": None, "layer_types": None})
    top = raw.get("max_window_layers", 28)
    rule = (lambda i: i % 2 == 0 and i < top) if moe else (lambda i: i >= top)
    return windows(raw, rule)


def read_dense(raw: dict[str, Any]) -> dict[str, Any]:
    return {**shape(raw), **_windows(raw, moe=False), "qk_norm": False, "attention_bias": True}


def read_moe(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        **shape(raw),
        **_windows(raw, moe=True),
        **experts(raw, "num_experts", "moe_intermediate_size"),
        "qk_norm": False,
        "attention_bias": bool(raw.get("qkv_bias", True)),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size", 0)),
    }


FAMILIES = (
    Family("Qwen2ForCausalLM", "qwen2", read_dense),
    Family("Qwen2MoeForCausalLM", "qwen2_moe", read_moe),
)
