"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): the paper's second model, and the one family
that is not a difference over the shared decoder (``engine/dsv4/`` is its own).

What it has that no other family has, read here into ``DeepseekV4Spec``:

- shared-KV multi-query attention: one KV head of ``head_dim`` (512) serves as both key
  and value; queries through a low-rank path (``q_lora_rank``) with an unweighted
  per-head RMSNorm; RoPE on the last ``rope_head_dim`` (64) channels only, interleaved
  pairs; the output's RoPE slice rotated back; a learned sink logit per query head;
- a sliding window (``sliding_window``, 128 raw tokens) in every layer, and per layer a
  compressor: none (sliding only), CSA (``compress_ratios`` 4: one entry per 4 tokens
  from overlapping windows of 8, of which each query reads the ``index_topk`` entries a
  lightning indexer of ``index_n_heads`` x ``index_head_dim`` scores highest) or HCA
  (128: one entry per 128 tokens, all visible); compressed layers use their own RoPE
  (``compress_rope``: theta 160,000, YaRN);
- a grouped low-rank output projection (``o_groups`` x ``o_lora_rank``);
- hyper-connections: ``hc_mult`` residual streams, mixed in and out of every block by
  weights computed from the streams (a Sinkhorn-normalised ``hc_mult`` x ``hc_mult``);
- every layer a mixture of experts with one shared expert, the first layers routed by a
  fixed token-id table (``hash_layers``), the rest by the top k of a score
  (``scoring_func``, ``sqrtsoftplus`` by default) plus a correction bias; gate and up
  clamped at ``swiglu_limit`` in routed and shared experts alike.

The legacy top-level keys DeepSeek's own ``config.json`` carries (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ``compress_rate_*``, a flat ``rope_scaling``)
are folded in as transformers folds them. FP8 block-scaled weights
(``quantization_config``: ``fp8``, ``e4m3``, ``weight_block_size``) are accepted here and
dequantized at load (``engine/fp8.py``); any other quantization is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vertumnus.config.families.common import ROPE_TYPES, Family
from vertumnus.config.tables import ConfigError

# compress_rates' keys and what each layer type compresses by (0: sliding only).
_KINDS = {"sliding_attention": 0, "compressed_sparse_attention": 4,
          "heavily_compressed_attention": 128}  # fmt: skip
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
_ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "attention_factor", "mscale", "mscale_all_dim", "truncate")  # fmt: skip


@dataclass(frozen=True)
class DeepseekV4Spec:
    """What DeepSeek-V4 has beyond ``ModelConfig``'s shape (module docstring)."""

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_head_dim: int  # the trailing channels of each head that RoPE rotates
    compress_ratios: tuple[int, ...]  # per layer: 0 (sliding only), 4 (CSA) or 128 (HCA)
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by the token-id table
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    compress_rope_theta: float
    compress_rope_type: str = "default"
    compress_rope_params: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if len(self.compress_ratios) != len(self.hash_layers):
            raise ConfigError("DeepSeek-V4: layer_types and mlp_layer_types differ in length")
        if self.scoring_func not in SCORING:
            raise ConfigError(
                f"DeepSeek-V4: unsupported scoring_func {self.scoring_func!r}; "
                f"supported: {', '.join(SCORING)}"
            )
        if self.compress_rope_type not in ("default", "yarn"):
            raise ConfigError(
                f"DeepSeek-V4: unsupported compress RoPE type {self.compress_rope_type!r}; "
                "supported: default, yarn"
            )
        if self.rope_head_dim % 2 or self.rope_head_dim <= 0:
            raise ConfigError(f"DeepSeek-V4: rope head dim must be even, got {self.rope_head_dim}")

    @property
    def largest_ratio(self) -> int:
        """The longest compression window in the model (1 when none compresses): a
        prefill's chunks under CP are multiples of it."""
        return max((r for r in self.compress_ratios if r), default=1)

    def block_problem(self, block_size: int, head_dim: int, window: int) -> str | None:
        """Why the pool's paged blocks of ``block_size`` tokens cannot hold this model's
        prefix state (``engine/dsv4/blocks.py``), or None. A block must hold whole
        windows of every compressor and of the sliding window (a multiple of the
        largest, 128), and its compressed facts must fit the V slot of ``block_size``
        rows of ``head_dim``: per CSA layer ``B/4 (D + Di)`` for the entries and indexer
        keys and ``4 (2 D + 2 Di)`` for the last window's first halves."""
        align = max(self.largest_ratio, window)
        if block_size % align:
            return (
                f"DeepSeek-V4 keeps prefixes in blocks of a multiple of {align} tokens "
                f"(whole windows of its compressors and of its sliding window), not "
                f"{block_size}: use blocks of {align} ([engine] block_size, --block-size)"
            )
        d, di = head_dim, self.index_head_dim
        for r in set(self.compress_ratios) - {0}:
            used = block_size // r * (d + di) + r * (2 * d + 2 * di) if r == 4 else 0
            if used > block_size * d:
                return (
                    f"DeepSeek-V4's compressed state of a {block_size}-token block "
                    f"({used} values per layer) does not fit its V slot ({block_size * d})"
                )
        return None

    def compress_param(self, key: str, default: float | None = None) -> float | None:
        return dict(self.compress_rope_params).get(key, default)


def _layer_ratios(raw: dict[str, Any], n: int) -> tuple[int, ...]:
    rates = {**{k: v for k, v in _KINDS.items() if v}, **(raw.get("compress_rates") or {})}
    for legacy, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                         ("compress_rate_hca", "heavily_compressed_attention")):  # fmt: skip
        if raw.get(legacy) is not None:
            rates[kind] = raw[legacy]
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention",
                    128: "heavily_compressed_attention"}  # fmt: skip
        try:
            types = [by_ratio[int(r)] for r in raw["compress_ratios"]]
        except KeyError as exc:
            raise ConfigError(f"DeepSeek-V4: unsupported compress ratio {exc}") from None
    if types is None:  # transformers' default: 2 HCA, then HCA and CSA alternating
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(n - 2, 0))
        ]
    types = list(types)[:n]
    unknown = sorted(set(types) - set(_KINDS))
    if unknown or len(types) != n:
        raise ConfigError(f"DeepSeek-V4: layer_types must give one of {sorted(_KINDS)} per layer")
    ratios = tuple(0 if t == "sliding_attention" else int(rates[t]) for t in types)
    if any(r < 0 for r in ratios):
        raise ConfigError(f"DeepSeek-V4: compress rates must be positive, got {rates}")
    return ratios


def _hash_layers(raw: dict[str, Any], n: int) -> tuple[bool, ...]:
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        hashed = raw.get("num_hash_layers", 3)
        kinds = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    kinds = list(kinds)[:n]
    if set(kinds) - {"hash_moe", "moe"} or len(kinds) != n:
        raise ConfigError("DeepSeek-V4: mlp_layer_types must give hash_moe or moe per layer")
    return tuple(k == "hash_moe" for k in kinds)


def _ropes(raw: dict[str, Any], head_dim: int) -> tuple[float, int, dict[str, Any]]:
    """The main RoPE's theta, the rotated channels, and the compress RoPE's fields."""
    params = raw.get("rope_parameters") or {}
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    if nested:
        main, compress = params["main"], dict(params["compress"])
        partial = main.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    else:
        flat = {**(raw.get("rope_scaling") or {}), **params}
        main = {"rope_theta": raw.get("rope_theta", 10_000.0)}
        compress = {k: v for k, v in flat.items() if k not in ("main", "compress")}
        compress["rope_theta"] = raw.get("compress_rope_theta", 160_000.0)
        partial = raw.get("partial_rotary_factor")
    if partial is None:
        rope_dim = raw.get("qk_rope_head_dim", 64)
    else:
        rope_dim = int(head_dim * float(partial))
    if main.get("rope_type", "default") != "default":
        raise ConfigError("DeepSeek-V4: the main RoPE must be the default type")
    kind = compress.get("rope_type", compress.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"DeepSeek-V4: unsupported compress RoPE type {kind!r}")
    if kind == "yarn":  # transformers: V4's compressed RoPE is not scaled by YaRN's mscale
        compress.setdefault("attention_factor", 1.0)
    kept = tuple((k, float(compress[k])) for k in _ROPE_KEYS if compress.get(k) is not None)
    fields = {
        "compress_rope_theta": float(compress.get("rope_theta", 160_000.0)),
        "compress_rope_type": kind,
        "compress_rope_params": kept,
    }
    return float(main.get("rope_theta", 10_000.0)), int(rope_dim), fields


def _refuse(raw: dict[str, Any]) -> None:
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        fmt = quant.get("fmt", "e4m3") if isinstance(quant, dict) else None
        if method != "fp8" or fmt != "e4m3" or quant.get("expert_dtype") not in (None, "fp8"):
            raise ConfigError(
                f"DeepSeek-V4: unsupported quantization_config {quant!r}; supported: fp8 "
                "(e4m3, block scales), or the bf16/fp32 weights save_pretrained writes"
            )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"unsupported hidden_act {act!r}; supported: silu")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError("DeepSeek-V4: attention_bias and mlp_bias are not supported")


def read(raw: dict[str, Any]) -> dict[str, Any]:
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")  # fmt: skip
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"config.json lacks required fields: {', '.join(missing)}")
    _refuse(raw)
    n, head_dim = int(raw["num_hidden_layers"]), int(raw.get("head_dim", 512))
    theta, rope_dim, compress = _ropes(raw, head_dim)
    spec = DeepseekV4Spec(
        q_lora_rank=int(raw.get("q_lora_rank", 1024)),
        o_groups=int(raw.get("o_groups", 8)),
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        rope_head_dim=rope_dim,
        compress_ratios=_layer_ratios(raw, n),
        hash_layers=_hash_layers(raw, n),
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        **compress,
    )
    moe = int(raw["moe_intermediate_size"])
    return dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=moe,  # the shared expert's width
        num_hidden_layers=n,
        num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=1,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 1_048_576)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=False,
        sliding_window=int(raw.get("sliding_window", 128)),
        attention_sinks=True,
        num_experts=int(raw["n_routed_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=moe,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        dsv4=spec,
    )


FAMILY = Family("DeepseekV4ForCausalLM", "deepseek_v4", read)
