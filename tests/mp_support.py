"""Helpers of the multi-process tests (``test_mp_*.py``, ``test_cli.py``).

A small Qwen3 checkpoint written by Hugging Face transformers (the trusted reference
implementation) and its reference logits, seeded prompts, the engine settings these
tests run under on a 2-core machine, and process-hygiene checks: what a test module
started must be gone when it ends. Plain helpers, no fixtures: each test module
owns its fixtures. (Assertions here carry their own messages: pytest does not
rewrite this module.)
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.runtime.worker import PrefillOutcome

# Shape of the reference checkpoint: small, but with grouped-query attention
# (4 query heads on 2 KV heads), head_dim != hidden / heads, and 3 layers.
HF_SHAPE = dict(
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
NUM_LAYERS = HF_SHAPE["num_hidden_layers"]
VOCAB = HF_SHAPE["vocab_size"]
BLOCK_SIZE = 16
# fp32 against fp32: the CP engine and transformers differ only in summation order.
ATOL = 1e-4
# Rank start-up and per-step deadline: spawned ranks import torch and rendezvous,
# which takes seconds on 2 shared cores; a hung step fails after this long.
RANK_TIMEOUT_S = 60.0


def engine_config(**overrides: object) -> EngineConfig:
    """CPU, fp32, one intra-op thread per rank (ranks outnumber cores here)."""
    base: dict[str, object] = dict(
        block_size=BLOCK_SIZE,
        device="cpu",
        dtype="float32",
        threads_per_rank=1,
        rank_timeout_s=RANK_TIMEOUT_S,
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def make_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """``n`` token ids in [0, vocab), the same for the same arguments."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


# -- the reference checkpoint ---------------------------------------------------------


def hf_config(tie_word_embeddings: bool) -> transformers.Qwen3Config:
    # transformers >= 5 takes RoPE settings as ``rope_parameters``; 4.x as ``rope_theta``.
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope: dict[str, object] = {
            "rope_parameters": {"rope_type": "default", "rope_theta": HF_ROPE_THETA}
        }
    else:
        rope = {"rope_theta": HF_ROPE_THETA}
    return transformers.Qwen3Config(
        **HF_SHAPE,
        **rope,
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
    (matrices N(0, 1/fan_in), embeddings N(0, 1), norms 1 + N(0, 0.1^2)), so that
    activations keep their scale and logits are well separated."""
    cfg = hf_config(tie_word_embeddings)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    seed_weights(model, seed)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == tie_word_embeddings, "lm_head tying differs from the config"
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


def drop_tensor(model_dir: Path, name: str) -> None:
    """Rewrite the single-file checkpoint in ``model_dir`` without tensor ``name``."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    assert name in tensors, f"{name} not in {sorted(tensors)}"
    del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})


@torch.inference_mode()
def hf_logits(model: transformers.Qwen3ForCausalLM, tokens: Sequence[int]) -> torch.Tensor:
    """fp32 logits [len(tokens), vocab] of the whole sequence, no cache."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0].float()


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


# -- process hygiene ------------------------------------------------------------------


def live_child_pids() -> set[int]:
    """Pids of this process's live ``multiprocessing`` children (rank processes)."""
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def pids_in_session(sid: int) -> set[int]:
    """Pids of live (non-zombie) processes in session ``sid`` (Linux /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        # After the parenthesised command name: state ppid pgrp session ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.add(int(entry))
    return found
