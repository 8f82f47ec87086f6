"""Fixtures for every test folder. Factories and helpers are plain functions in the
``support`` package; here only what pytest must manage: the test process's thread
count, models and checkpoints built once, the check that no rank process outlives
the module that started it; and at collection, the ``slow`` mark on the lanes of
whole servers and, in a pytest-xdist worker, the order its modules are handed out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from support.factories import TINY
from support.processes import live_child_pids
from support.reference import Checkpoint, make_checkpoint
from vertumnus.engine.model import CausalLM
from vertumnus.engine.weights import random_model

TINY_SEED = 0  # EngineConfig.seed's default: the weights the rank processes build
# The lanes of whole servers, benchmark clients, vLLM and a browser: minutes, not
# seconds. Marked ``slow`` so that ``-m "not slow"`` leaves them out of a quick local
# run; tools/test.sh (and so CI) runs them.
SLOW_FOLDERS = ("e2e", "clients", "interop", "browser")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if (
            item.path.is_relative_to(tests)
            and item.path.relative_to(tests).parts[0] in SLOW_FOLDERS
        ):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (tools/test.sh)
        items[:] = longest_first(items)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` module by module, the slow lanes' modules first, then the other
    modules that start processes, then the rest; in each module its own order. Run
    with ``--dist loadscope --no-loadscope-reorder``, whose workers take modules in
    this order: the long ones start early, the short ones fill in at the end."""
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)

    def rank(module: list[pytest.Item]) -> int:
        if any(item.get_closest_marker("slow") for item in module):
            return 0
        return 1 if any(item.get_closest_marker("multiproc") for item in module) else 2

    return [item for module in sorted(modules.values(), key=rank) for item in module]


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
