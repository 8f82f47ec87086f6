"""Arithmetic of the speed step: a prefill's FLOPs, and whether the model fits.

FLOPs of a prefill of R new tokens after P cached ones (the MFU's numerator):
2 x the active parameters per token for each of the R tokens (attention projections,
router, the top-k experts' SwiGLU, or a dense layer's MLP; the embedding lookup
excluded), 2 x hidden x vocabulary for the LM head of the last token only, and
4 x query heads x head dim x layers per query-key pair for attention (QK^T and PV),
over the pairs a causal prefill computes, W(R, P) = R*P + R(R+1)/2 per full layer
(bounded by the window on a sliding-window layer: ``config.model.attention_mix``).

Memory: the weights (the parameters of the model as built, counted on the meta
device), the paged KV store and the peak activations of one layer at the longest
prefill, with a margin for the allocator and the baseline's own buffers. ``fit_layers``
gives the most layers (at most asked) that fit the device's free memory.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from vertumnus.config import ModelConfig
from vertumnus.config.model import attention_mix
from vertumnus.engine.kv_store import store_shape
from vertumnus.engine.model import CausalLM

ACTIVATION_MARGIN = 1.5  # transformers' forward and the caching allocator's slack
RESERVE_BYTES = 2 << 30  # cuBLAS workspaces, kernels' scratch, fragmentation


def active_params_per_token(cfg: ModelConfig) -> int:
    """Parameters each token multiplies by, embedding and LM head excluded."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * cfg.num_attention_heads * d * 2 + h * cfg.num_key_value_heads * d * 2
    total = 0
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_sparse_layer(layer):
            experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
            total += attention + cfg.num_experts * h + experts
        else:
            total += attention + 3 * h * cfg.intermediate_size
    return total


def prefill_flops(cfg: ModelConfig, uncached: int, cached: int = 0) -> dict[str, float]:
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    parts = {
        "token_local": 2.0 * active_params_per_token(cfg) * uncached,
        "lm_head": 2.0 * cfg.hidden_size * cfg.vocab_size,
        "attention": float(per_pair) * attention_mix(cfg).work(uncached, cached),
    }
    return {**parts, "total": sum(parts.values())}


def param_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = CausalLM(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied LM head counted once


def kv_store_bytes(cfg: ModelConfig, tokens: int, block: int, itemsize: int) -> int:
    blocks = -(-tokens // block) + 1
    numel = 1
    for n in store_shape(cfg, blocks, block):
        numel *= n
    return 2 * numel * itemsize


def activation_bytes(cfg: ModelConfig, tokens: int, itemsize: int) -> int:
    """Peak buffers of one layer's forward at ``tokens``: the residual stream and
    norms, q/k/v before and after norm and RoPE, the attention output, and for a
    sparse layer the tokens gathered per expert with their outputs and the experts'
    hidden activations (the router's fp32 probabilities and indices besides)."""
    h, d, k = cfg.hidden_size, cfg.head_dim, max(cfg.num_experts_per_tok, 1)
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    per_token = 8 * h + 3 * qkv + 2 * cfg.num_attention_heads * d
    if cfg.is_moe:
        per_token += 4 * k * h + 4 * k * cfg.moe_intermediate_size
        extra = 8 * cfg.num_experts + 32 * k
    else:
        per_token += 3 * cfg.intermediate_size
        extra = 0
    return tokens * (per_token * itemsize + extra)


def estimate(
    cfg: ModelConfig, max_tokens: int, capacity_tokens: int, block: int, itemsize: int
) -> dict[str, int]:
    parts = {
        "weights": param_count(cfg) * itemsize,
        "kv_store": kv_store_bytes(cfg, capacity_tokens, block, itemsize),
        "activations": int(ACTIVATION_MARGIN * activation_bytes(cfg, max_tokens, itemsize)),
        "reserve": RESERVE_BYTES,
    }
    return {**parts, "total": sum(parts.values())}


def fit_layers(
    cfg: ModelConfig,
    free_bytes: int | None,
    max_tokens: int,
    capacity_tokens: int,
    block: int,
    itemsize: int,
) -> tuple[ModelConfig, dict[str, Any]]:
    """``cfg`` with the most layers (at most its own) whose estimate fits in
    ``free_bytes`` (None: not known, the model as asked), and the record of why."""
    asked = cfg.num_hidden_layers
    layers = asked
    if free_bytes is not None:
        while layers > 1:
            need = estimate(
                replace(cfg, num_hidden_layers=layers), max_tokens, capacity_tokens, block, itemsize
            )
            if need["total"] <= free_bytes:
                break
            layers -= 1
    chosen = replace(cfg, num_hidden_layers=layers)
    need = estimate(chosen, max_tokens, capacity_tokens, block, itemsize)
    record: dict[str, Any] = {
        "free_bytes": free_bytes,
        "estimate_bytes": need,
        "layers_asked": asked,
        "layers": layers,
        "reduced": layers < asked,
    }
    if layers < asked:
        full = estimate(cfg, max_tokens, capacity_tokens, block, itemsize)["total"]
        record["reason"] = (
            f"{asked} layers need about {full / 2**30:.1f} GiB at {max_tokens} tokens, "
            f"{(free_bytes or 0) / 2**30:.1f} GiB are free: {layers} layers measured"
        )
    if free_bytes is not None and need["total"] > free_bytes:
        raise MemoryError(f"even one layer needs {need['total'] / 2**30:.1f} GiB")
    return chosen, record
