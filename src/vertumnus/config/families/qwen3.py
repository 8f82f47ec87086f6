"""Qwen3 and Qwen3-MoE: the shared decoder as it is (per-head q/k RMSNorm, optional
attention biases on all four projections, softmax top-k experts)."""

from __future__ import annotations

from typing import Any

from vertumnus.config.families.common import Family, experts, shape, windows


def read_dense(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    dims = shape(raw)
    # Qwen3 marks its sliding layers from ``max_window_layers`` on.
    fields = windows(
        raw if raw.get("use_sliding_window") else {**raw, "sliding_window": None},
        lambda i: i >= raw.get("max_window_layers", raw["num_hidden_layers"]),
    )
    return {**dims, **fields, "attention_bias": bias, "o_proj_bias": bias}


def read_moe(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        **read_dense(raw),
        **experts(raw, "num_experts", "moe_intermediate_size"),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }


FAMILIES = (
    Family("Qwen3ForCausalLM", "qwen3", read_dense),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", read_moe),
)
