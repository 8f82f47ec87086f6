"""Hugging Face transformers as the reference: small Qwen3 checkpoints written by
transformers (the trusted implementation), their logits, and the check that a
prefill over rank processes matches them. Used by the engine, runtime and e2e tests
that load a checkpoint folder."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from vertumnus.config import ModelConfig
from vertumnus.runtime.prefill import PrefillOutcome

# Shape of the reference checkpoint: small, but with grouped-query attention
# (4 query heads on 2 KV heads), head_dim != hidden / heads, and 3 layers.
HF_SHAPE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)
HF_ROPE_THETA = 10_000.0
NUM_LAYERS: int = HF_SHAPE["num_hidden_layers"]
VOCAB: int = HF_SHAPE["vocab_size"]
# fp32 against fp32: the CP engine and transformers differ only in summation order.
ATOL = 1e-4


def rope_settings(theta: float) -> dict[str, Any]:
    """RoPE keyword arguments of a transformers config: transformers >= 5 takes them as
    ``rope_parameters``, 4.x as ``rope_theta``."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def hf_config(
    tie_word_embeddings: bool, rope_theta: float = HF_ROPE_THETA, **shape: Any
) -> transformers.Qwen3Config:
    """A dense Qwen3 config of ``HF_SHAPE``, with ``shape`` over it."""
    return transformers.Qwen3Config(
        **{**HF_SHAPE, **shape},
        **rope_settings(rope_theta),
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        architectures=["Qwen3ForCausalLM"],
    )


def seed_weights(model: torch.nn.Module, seed: int) -> None:
    """Matrices (and expert stacks) N(0, 1/fan_in), embeddings N(0, 1), norms
    1 + N(0, 0.1^2), in parameter-name order: the same weights for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))


def make_hf_model(tie_word_embeddings: bool, seed: int = 1234) -> transformers.Qwen3ForCausalLM:
    """A transformers Qwen3 with seeded weights of a larger scale than its default init
    (``seed_weights``), so that activations keep their scale and logits are well
    separated."""
    cfg = hf_config(tie_word_embeddings)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    seed_weights(model, seed)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == tie_word_embeddings, "lm_head tying differs from the config"
    return model


def make_hf_moe(
    norm_topk_prob: bool = True, seed: int = 7, top_k: int = 3, vocab_size: int = VOCAB
) -> transformers.Qwen3MoeForCausalLM:
    """A transformers Qwen3-MoE of three layers: sparse, dense (``mlp_only_layers``),
    sparse; 8 experts, top ``top_k``; ``moe_intermediate_size`` 24 (2I != H: a
    transposed fused layout is told apart); weights seeded as ``seed_weights``."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        **rope_settings(10_000.0),
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    seed_weights(model, seed)
    return model


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder written by transformers and the model that wrote it."""

    hf: transformers.Qwen3ForCausalLM
    model_dir: Path
    config: ModelConfig  # as Vertumnus reads it from the folder


def make_checkpoint(model_dir: Path, tie_word_embeddings: bool, seed: int = 1234) -> Checkpoint:
    hf = make_hf_model(tie_word_embeddings, seed)
    hf.save_pretrained(model_dir)
    return Checkpoint(hf, model_dir, ModelConfig.from_dir(model_dir))


def edit_tensors(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Rewrite the single-file checkpoint in ``model_dir`` after ``edit`` of its tensors."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def drop_tensor(model_dir: Path, name: str) -> None:
    """Rewrite the single-file checkpoint in ``model_dir`` without tensor ``name``."""

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        assert name in tensors, f"{name} not in {sorted(tensors)}"
        del tensors[name]

    edit_tensors(model_dir, drop)


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``: exactly ``n`` new ids."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
    )
    return [int(t) for t in out[0, len(prompt) :]]


@torch.inference_mode()
def hf_logits(model: transformers.PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    """fp32 logits [len(tokens), vocab] of the whole sequence, no cache."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0].float()


def assert_prompt_logprobs(
    logprobs: dict[str, Any], hf: transformers.PreTrainedModel, prompt: Sequence[int]
) -> None:
    """An answer's prompt log-probabilities (OpenAI completions' ``logprobs``) are
    transformers' within ``ATOL`` (the first token has none); its top entry (k = 1) is
    the most likely token's."""
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)[:-1]
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = torch.tensor(logprobs["token_logprobs"][1:], dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0.0, atol=ATOL)
    best = torch.tensor([max(top.values()) for top in logprobs["top_logprobs"][1:]])
    torch.testing.assert_close(best, ref.max(dim=-1).values, rtol=0.0, atol=ATOL)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return float((a - b).abs().max())


def assert_exact(
    out: PrefillOutcome, checkpoint: Checkpoint, tokens: Sequence[int], cached_tokens: int
) -> None:
    """``out`` reused ``cached_tokens`` and computed the rest of ``tokens`` with
    transformers' logits there (``logits="all"``), one K/V all-gather per layer."""
    assert out.cached_tokens == cached_tokens, f"cached {out.cached_tokens}, not {cached_tokens}"
    assert out.computed_tokens == len(tokens) - cached_tokens, f"computed {out.computed_tokens}"
    ref = hf_logits(checkpoint.hf, tokens)[cached_tokens:]
    diff = max_abs_diff(out.logits, ref)
    assert diff < ATOL, f"max |logit difference| {diff:.3g} >= {ATOL}"
    assert out.first_token == int(ref[-1].argmax()), f"first token {out.first_token}"
    # Every rank: one all-gather of K/V per layer, one of the final hidden states.
    expected = {"kv": NUM_LAYERS, "out": 1}
    assert out.collectives == expected, f"collectives {out.collectives}, not {expected}"
