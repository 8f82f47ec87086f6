"""Fixtures for every test folder. Factories and helpers are plain functions in the
``support`` package; here only what pytest must manage: the test process's thread
count, models and checkpoints built once, and the check that no rank process
outlives the module that started it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from support.factories import TINY
from support.processes import live_child_pids
from support.reference import Checkpoint, make_checkpoint
from vertumnus.engine.model import CausalLM
from vertumnus.engine.weights import random_model

TINY_SEED = 0  # EngineConfig.seed's default: the weights the rank processes build


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread() -> None:
    """One intra-op thread in the test process: tests run C rank threads (or beside rank
    processes) on 2 cores, and OpenMP thread pools competing for them turn a 3 ms
    forward pass into half a second."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model() -> CausalLM:
    """The ``tiny`` preset with the seeded random weights the rank processes build
    (``EngineConfig.seed`` = 0), fp32 on CPU. Shared: tests must not modify it."""
    return random_model(TINY, TINY_SEED).requires_grad_(False).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """An untied reference checkpoint (``support.reference``) in a folder of its own,
    one per module. Modules that need another kind define their own ``checkpoint``."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen3-untied"), tie_word_embeddings=False)


@pytest.fixture(scope="module")
def no_leftover_ranks() -> Iterator[None]:
    """Fails the module if a rank process (a ``multiprocessing`` child) it started
    is still alive when the module ends."""
    before = live_child_pids()
    yield
    assert live_child_pids() - before == set(), "rank processes outlived the module"
