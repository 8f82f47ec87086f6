"""The transformers config of a ``ModelConfig``: the reverse of
``ModelConfig.from_dir``, for what compares the engine with transformers on the same
weights (the benchmarks under ``tools/bench/``, the device check). transformers is
imported when called; the engine does not need it."""

from __future__ import annotations

from typing import Any

from vertumnus.config import ModelConfig


def _rope(theta: float) -> dict[str, Any]:
    """transformers >= 5 takes RoPE as ``rope_parameters``, 4.x as ``rope_theta``."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def hf_config(cfg: ModelConfig) -> Any:
    """transformers' ``Qwen3Config`` or ``Qwen3MoeConfig`` of ``cfg`` (SDPA attention)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        **_rope(cfg.rope_theta),
    )
    out: transformers.PretrainedConfig
    if cfg.is_moe:
        out = transformers.Qwen3MoeConfig(
            **common,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
    else:
        out = transformers.Qwen3Config(**common, use_sliding_window=False)
    out._attn_implementation = "sdpa"
    return out
