"""Shared factories for the in-process and multi-process tests.

Only what several test files need: seeded token sequences and the ``tiny`` preset
model. Every test file keeps its own specialised factories and fixtures.
"""

from __future__ import annotations

import random

import pytest
import torch

from vertumnus.config import PRESETS, ModelConfig
from vertumnus.engine.model import Qwen3ForCausalLM
from vertumnus.engine.weights import random_model

TINY: ModelConfig = PRESETS["tiny"]
TINY_SEED = 0


def make_tokens(n: int, seed: int, vocab: int = TINY.vocab_size) -> list[int]:
    """``n`` token ids in [0, vocab), the same for the same (n, seed, vocab)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread() -> None:
    """One intra-op thread in the test process: tests run C rank threads (or beside rank
    processes) on 2 cores, and OpenMP thread pools competing for them turn a 3 ms
    forward pass into half a second."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model() -> Qwen3ForCausalLM:
    """The ``tiny`` preset with the seeded random weights the rank processes build
    (``EngineConfig.seed`` = 0), fp32 on CPU. Shared: tests must not modify it."""
    return random_model(TINY, TINY_SEED).requires_grad_(False).eval()
