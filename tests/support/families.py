"""Small random checkpoints of every family the engine serves, written by
transformers (the trusted implementation) with a tokenizer and chat template, as a
user's folder would be: the reference of the family tests (``tests/engine/
test_families.py``) and of the end-to-end ones.

Each case is a transformers config over a shared small shape (GQA 4/2, head_dim 16,
3 layers), with the features that make its family differ switched on: RoPE scaling,
sliding windows shorter and longer than a KV block, q/k/v biases, sinks, experts
with biases, a shared expert. Weights are seeded as ``reference.seed_weights``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from support.reference import seed_weights
from support.tokenizer import make_tokenizer

VOCAB = 384
SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)
MOE: dict[str, Any] = dict(num_experts_per_tok=2)


def _rope(theta: float = 10_000.0, **scaling: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **scaling}}


def _llama(**over: Any) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**{**SHAPE, **_rope(), **over})


CASES: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    # Llama 3.1's RoPE scaling with tied embeddings and head_dim != hidden / heads.
    "llama3": lambda: _llama(
        head_dim=24,
        tie_word_embeddings=True,
        **_rope(
            500_000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "llama-linear": lambda: _llama(**_rope(rope_type="linear", factor=4.0), attention_bias=True),
    "llama-dynamic": lambda: _llama(**_rope(rope_type="dynamic", factor=2.0)),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, **_rope(), sliding_window=24),
    "mistral-full": lambda: transformers.MistralConfig(**SHAPE, **_rope(), sliding_window=None),
    # Sliding from layer 1 on (max_window_layers = 1), window shorter than a block.
    "qwen2": lambda: transformers.Qwen2Config(
        **SHAPE, **_rope(), use_sliding_window=True, sliding_window=12, max_window_layers=1
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **{**SHAPE, "intermediate_size": 48},
        **_rope(),
        **MOE,
        num_local_experts=4,
        sliding_window=20,
    ),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **SHAPE,
        **_rope(),
        **MOE,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    # Window 8 on layers 0 and 2, full attention on layer 1; sinks on all; YaRN.
    "gpt-oss": lambda: transformers.GptOssConfig(
        **{**SHAPE, "intermediate_size": 32},
        **MOE,
        num_local_experts=4,
        sliding_window=8,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 256,
        },
    ),
}


def make_family_model(case: str, seed: int = 11) -> transformers.PreTrainedModel:
    """transformers' model of ``case`` in fp32, eager attention, seeded weights."""
    cfg = CASES[case]()
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    seed_weights(model, seed)
    return model


def write_family_folder(case: str, folder: Path, seed: int = 11, shard: bool = False) -> Any:
    """Save ``case`` into ``folder`` as ``save_pretrained`` does (``shard``: several
    safetensors files with their index), with a tokenizer and chat template; the
    end-of-sequence id is the tokenizer's end of turn. Returns the transformers model."""
    model = make_family_model(case, seed)
    eos = make_tokenizer(folder, VOCAB)
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    with torch.no_grad():
        model.save_pretrained(folder, max_shard_size="60KB" if shard else "5GB")
    return model
