"""Small random DeepSeek-V4 checkpoints written by transformers (the trusted
implementation), as ``save_pretrained`` writes them: the reference of the DeepSeek-V4
engine tests.

Four layers cover every kind: sliding only, CSA (ratio 4, indexer top-k small enough
that the choice matters from the 33rd token on; 16 index heads, so that an exact tie
of scores at the top-k boundary, which transformers' ``topk`` breaks by its algorithm,
is improbable), HCA (ratio 128), CSA again; the first
and last route their experts by the token-id table, the middle two by score. The
window is the model's 128 and the compress RoPE is YaRN, as in DeepSeek-V4-Flash.
Every parameter and buffer is seeded (the sinks, position biases and hyper-connection
bases too, which transformers initialises to constants).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

from support.tokenizer import make_tokenizer
from vertumnus.engine.dsv4.load import seed_tensors

VOCAB = 256
TYPES = ["sliding_attention", "compressed_sparse_attention",
         "heavily_compressed_attention", "compressed_sparse_attention"]  # fmt: skip


def dsv4_config(**over: Any) -> transformers.DeepseekV4Config:
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, head_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, index_n_heads=16, index_head_dim=16,
        index_topk=8, layer_types=TYPES, mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"],
        hc_mult=4, sliding_window=128, max_position_embeddings=16_384,
        rope_parameters={"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1},
    )  # fmt: skip
    cfg = transformers.DeepseekV4Config(**{**fields, **over})
    cfg._attn_implementation = "eager"
    return cfg


def make_dsv4(seed: int = 5, **over: Any) -> transformers.DeepseekV4ForCausalLM:
    """transformers' DeepSeek-V4 in fp32 with every tensor seeded: matrices N(0,
    1/fan_in), embeddings N(0, 1), norms and scales 1 + N(0, 0.1^2), the small vectors
    N(0, 0.3^2), the hash tables uniform over the experts."""
    cfg = dsv4_config(**over)
    model = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    seed_tensors(named, cfg.n_routed_experts, seed)
    return model


def write_dsv4_folder(
    folder: Path, seed: int = 5, tokenizer: bool = False, **over: Any
) -> transformers.PreTrainedModel:
    """``make_dsv4`` saved into ``folder`` (``tokenizer``: with a tokenizer and chat
    template, its end of turn the end-of-sequence id, as ``serve`` needs); returns the
    transformers model."""
    model = make_dsv4(seed, **over)
    if tokenizer:
        eos = make_tokenizer(folder, model.config.vocab_size)
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    return model
