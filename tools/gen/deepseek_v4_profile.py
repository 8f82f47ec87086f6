"""Derive the DeepSeek-V4-Flash / H100 execution-time profile (the second model of
``tools.gen.derive_gpu_profile``: ``--model deepseek-v4-flash``).

The method is the Qwen3 one (``derive_gpu_profile``; docs/gpu-profile.md, "DeepSeek-V4-Flash"):
each coefficient of E_C(R, P) from the model's shape and H100 throughput, with the same
efficiencies, step cost and collective latencies. What differs, and why:

- The shape is transformers' ``DeepseekV4Config`` defaults (they describe V4-Flash),
  read at run time; parameters are counted here from it.
- W is the model's own attention work (``attention_work``): 20 CSA and 23 HCA layers,
  each with a 128-token sliding window, no full layer.
- Weights are FP8: projections and experts run at the FP8 peak, at the Qwen3 efficiency.
- 284 GB of FP8 weights fit on no single H100, so a degree-C worker shards the routed
  experts over its C ranks (expert parallelism) and replicates the rest: each rank streams
  its share per step, and each token's routed copies on other ranks cross NVLink twice
  (dispatch in FP8, combine in bf16). Degrees 1 and 2 are notional (the reference).
- No paper figure calibrates ``a_C`` for this model. ``a_C`` is the Qwen3 calibration's
  non-communication part (the parallel efficiency the paper's system loses with CP, per
  token) plus this model's own CP traffic: the compressed entries (and indexer keys) a
  rank receives, not the raw KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tools.gen import derive_gpu_profile as qwen3
from vertumnus.attention_work import AttentionMix, Compressed, LayerKind
from vertumnus.perfmodel import DegreeCoeffs

FP8_PEAK_FLOPS = 1979e12  # H100 SXM dense FP8 tensor-core peak
BF16_PEAK_FLOPS = qwen3.PEAK_FLOPS
KV_BYTES = 2  # bf16 KV, compressed entries and indexer keys
WEIGHT_BYTES = 1  # FP8 (block scales: 4 B per 128x128 block, 0.02 %, left out)
# The indexer's cost per scored entry against an attention pair: the brief's ratio of
# index_n_heads * index_head_dim to num_heads * head_dim (0.25). FLOPs alone give 0.125
# (the indexer has QK^T only, attention QK^T and PV); the rest is its lower efficiency
# (scores written out, a ReLU-weighted sum over heads, a top-k over them).
INDEX_WEIGHT = 0.25
# Per layer and step when C > 1: the halo exchange, the compressed entries' all-gather,
# and the experts' dispatch and combine.
COLLECTIVES_PER_LAYER = 4
HALO_CHUNKS = 2  # a rank's two zigzag chunks each need the window's halo
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    experts: int
    top_k: int
    shared_experts: int
    moe_intermediate: int
    vocab: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    window: int
    csa_ratio: int
    hca_ratio: int
    hc_mult: int
    layer_types: tuple[str, ...]


def shape() -> Shape:
    """transformers' DeepseekV4Config defaults (V4-Flash)."""
    from transformers import DeepseekV4Config

    c = DeepseekV4Config()
    rates = c.compress_rates
    return Shape(
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        head_dim=c.head_dim,
        q_lora_rank=c.q_lora_rank,
        o_groups=c.o_groups,
        o_lora_rank=c.o_lora_rank,
        experts=c.n_routed_experts,
        top_k=c.num_experts_per_tok,
        shared_experts=c.n_shared_experts,
        moe_intermediate=c.moe_intermediate_size,
        vocab=c.vocab_size,
        index_heads=c.index_n_heads,
        index_head_dim=c.index_head_dim,
        index_topk=c.index_topk,
        window=c.sliding_window,
        csa_ratio=rates["compressed_sparse_attention"],
        hca_ratio=rates["heavily_compressed_attention"],
        hc_mult=c.hc_mult,
        layer_types=tuple(c.layer_types),
    )


def layer_kind(s: Shape, layer_type: str) -> LayerKind:
    if layer_type == "compressed_sparse_attention":
        return Compressed(s.window, s.csa_ratio, s.index_topk, INDEX_WEIGHT)
    if layer_type == "heavily_compressed_attention":
        return Compressed(s.window, s.hca_ratio, None, 0.0)
    return s.window


def attention_mix(s: Shape) -> AttentionMix:
    return AttentionMix.of_layers(layer_kind(s, t) for t in s.layer_types)


def layer_params(s: Shape, layer_type: str) -> dict[str, int]:
    """One layer's weight matrices (norms, sinks and position biases left out: 0.01 %)."""
    h, d = s.hidden, s.head_dim
    expert = 3 * h * s.moe_intermediate  # gate, up, down
    params = {
        "attention": h * s.q_lora_rank  # q_a
        + s.q_lora_rank * s.heads * d  # q_b
        + h * d  # kv (one head, K = V)
        + s.heads * d * s.o_lora_rank  # grouped o_a: o_groups x (heads*d/o_groups -> o_lora)
        + s.o_groups * s.o_lora_rank * h,  # o_b
        "compressor": 0,
        "indexer": 0,
        "router": s.experts * h,
        "shared_experts": s.shared_experts * expert,
        "routed_experts": s.experts * expert,
        "hyper_connections": 2 * (2 + s.hc_mult) * s.hc_mult * s.hc_mult * h,
    }
    if layer_type == "compressed_sparse_attention":  # two overlapping series: 2 x head dim
        params["compressor"] = 2 * h * 2 * d
        idx = s.index_heads * s.index_head_dim
        params["indexer"] = 2 * h * 2 * s.index_head_dim + s.q_lora_rank * idx + h * s.index_heads
    elif layer_type == "heavily_compressed_attention":
        params["compressor"] = 2 * h * d
    return params


def state_bytes_per_token(s: Shape) -> float:
    """Cached state per token that grows with the sequence: CSA's entries and indexer
    keys (one per csa_ratio tokens), HCA's entries (one per hca_ratio)."""
    total = 0.0
    for t in s.layer_types:
        if t == "compressed_sparse_attention":
            total += (s.head_dim + s.index_head_dim) * KV_BYTES / s.csa_ratio
        elif t == "heavily_compressed_attention":
            total += s.head_dim * KV_BYTES / s.hca_ratio
    return total


def derive() -> tuple[dict[int, DegreeCoeffs], dict[str, Any], AttentionMix]:
    s = shape()
    per_layer = [layer_params(s, t) for t in s.layer_types]
    total = {k: sum(p[k] for p in per_layer) for k in per_layer[0]}
    embeddings = 2 * s.vocab * s.hidden  # embedding and LM head
    routed = total["routed_experts"]
    active = sum(total.values()) - routed + routed * s.top_k // s.experts
    flops_per_token = 2 * active
    flops_per_pair = 4 * s.heads * s.head_dim * s.layers  # QK^T and PV, every layer
    raw_kv_bytes_per_token = s.layers * s.head_dim * KV_BYTES  # one shared K=V head
    state_bytes = state_bytes_per_token(s)
    window_bytes = s.layers * s.window * s.head_dim * KV_BYTES  # one window's raw rows
    # A cached block keeps its entries and its last window of raw rows (a hit may end there).
    cache_bytes_per_token = state_bytes + window_bytes / BLOCK_TOKENS

    c_compute = flops_per_token / (qwen3.TOKEN_LOCAL_EFFICIENCY * FP8_PEAK_FLOPS)
    alpha = flops_per_pair / (qwen3.ATTENTION_EFFICIENCY * BF16_PEAK_FLOPS)
    # Expert parallelism: per token and MoE layer, top_k copies of the hidden state go out
    # in FP8 (with a 4 B scale per 128 values) and come back in bf16; (C-1)/C of them to
    # other ranks. Each rank moves its own R/C tokens: a c-like term.
    ep_bytes_per_token = s.layers * s.top_k * (s.hidden * (1 + 4 / 128) + s.hidden * 2)
    b_local = 2 * state_bytes / qwen3.HBM_BYTES_S

    def comm_per_token(degree: int) -> float:
        """The compressed entries and indexer keys a rank receives, per token."""
        return (degree - 1) / degree * state_bytes / qwen3.NVLINK_BUS_BYTES_S

    def ep_per_token(degree: int) -> float:
        return (degree - 1) / degree * ep_bytes_per_token / qwen3.NVLINK_BUS_BYTES_S

    dense_bytes = (sum(total.values()) - routed) * WEIGHT_BYTES
    halo_bytes = HALO_CHUNKS * (s.window - 1) * s.head_dim * KV_BYTES * s.layers

    def weight_stream_s(degree: int) -> float:
        return (dense_bytes + routed * WEIGHT_BYTES / degree) / qwen3.HBM_BYTES_S

    def d_of(degree: int) -> float:
        if degree == 1:
            return qwen3.STEP_S + weight_stream_s(1)
        latency = qwen3.COLLECTIVE_LATENCY_S + qwen3.COLLECTIVE_LATENCY_PER_RANK_S * (degree - 1)
        per_layer = (
            COLLECTIVES_PER_LAYER * latency
            + qwen3.CP_KERNELS_PER_LAYER_S
            + qwen3.STRAGGLER_PER_LAYER_S * math.log2(degree)
        )
        halo_s = halo_bytes / qwen3.NVLINK_BUS_BYTES_S
        return qwen3.STEP_S + weight_stream_s(degree) + (s.layers + 1) * per_layer + halo_s

    # The Qwen3 calibration's a_C less its raw-KV all-gather: what CP loses per token
    # besides its bytes (docs/gpu-profile.md, "What a_C is").
    q_coeffs, q_facts = qwen3.derive()
    q_kv = q_facts["kv_bytes_per_token"]
    residual = {
        c: q_coeffs[c].a - (c - 1) / c * q_kv / qwen3.NVLINK_BUS_BYTES_S if c > 1 else 0.0
        for c in qwen3.DEGREES
    }
    mix = attention_mix(s)
    coeffs = {
        c: DegreeCoeffs(
            d=d_of(c),
            a=residual[c] + comm_per_token(c),
            b=b_local + comm_per_token(c),
            c=c_compute + ep_per_token(c),
            alpha=alpha,
            attention=mix,
        )
        for c in qwen3.DEGREES
    }
    facts: dict[str, Any] = {
        "params_total": sum(total.values()) + embeddings,
        "params_routed_experts": routed,
        "active_params_per_token": active,
        "active_params_with_embeddings": active + embeddings,
        "flops_per_token": flops_per_token,
        "flops_per_token_pair": flops_per_pair,
        "csa_layers": s.layer_types.count("compressed_sparse_attention"),
        "hca_layers": s.layer_types.count("heavily_compressed_attention"),
        "sliding_layers": s.layer_types.count("sliding_attention"),
        "index_weight": INDEX_WEIGHT,
        "raw_kv_bytes_per_token": raw_kv_bytes_per_token,
        "compressed_state_bytes_per_token": state_bytes,
        "window_bytes_per_prefix": window_bytes,
        "cache_bytes_per_token": cache_bytes_per_token,
        "fp8_peak_flops": FP8_PEAK_FLOPS,
        "bf16_peak_flops": BF16_PEAK_FLOPS,
        "token_local_efficiency": qwen3.TOKEN_LOCAL_EFFICIENCY,
        "attention_efficiency": qwen3.ATTENTION_EFFICIENCY,
        "c_compute": c_compute,
        "ep_bytes_per_token": ep_bytes_per_token,
        "dense_weight_bytes": dense_bytes,
        "routed_weight_bytes": routed * WEIGHT_BYTES,
        "halo_bytes_per_step": halo_bytes,
        **{f"weight_stream_s_{c}": weight_stream_s(c) for c in qwen3.DEGREES},
        **{f"a_residual_from_qwen3_{c}": residual[c] for c in qwen3.DEGREES[1:]},
        **{f"comm_share_of_a_{c}": comm_per_token(c) / coeffs[c].a for c in qwen3.DEGREES[1:]},
        **{f"ep_share_of_c_{c}": ep_per_token(c) / coeffs[c].c for c in qwen3.DEGREES[1:]},
        "e1_at_64k_s": coeffs[1].predict(1, qwen3.CALIBRATION_TOKENS, 0),
    }
    return coeffs, facts, mix


PROVENANCE_METHOD = (
    "derived from DeepseekV4Config's defaults (V4-Flash) and H100 throughput with the "
    "Qwen3 derivation's efficiencies; FP8 token-local compute; routed experts sharded over "
    "a worker's ranks; a_C = the Qwen3 calibration's non-communication a_C plus this "
    "model's compressed-entry traffic; no paper figure calibrates it; see docs/gpu-profile.md"
)
