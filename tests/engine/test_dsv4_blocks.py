"""DeepSeek-V4's prefix state in the pool's paged blocks (``engine/dsv4/blocks.py``):
prompts prefilled through the worker's cache index and one store per CP rank, as the
pool runs them, resume their cached prefixes exactly against transformers, at every
CP degree, after their blocks moved to a worker of another degree, and hand off the
state of the whole prompt."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from support.dsv4 import VOCAB
from support.threads import run_ranks
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.dsv4.blocks import keeps_raw_rows
from vertumnus.engine.dsv4.model import DeepseekV4LM, command_rank, resume_rank
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.runtime.prefill import plan_prefill

CPU = torch.device("cpu")
TOL = 1e-4
BLOCK = 128


def _ids(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=gen).tolist()


def _reference(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([ids])).logits[0].float()
    return out


class Worker:
    """A degree-C worker in threads: its cache index and one store per rank."""

    def __init__(self, model: DeepseekV4LM, c: int, blocks: int = 24) -> None:
        self.model, self.c = model, c
        self.index = WorkerCacheIndex(c, blocks)
        self.stores = [
            PagedKVStore(model.config, blocks, BLOCK, torch.float32, CPU) for _ in range(c)
        ]
        self.calls: list[Any] = []

    def prefill(self, ids: list[int], handoff: bool = False) -> tuple[torch.Tensor, Any, int]:
        """Logits of the computed tokens, rank 0's state (a hand-off's), prefix length."""
        ranks = tuple(range(self.c))
        allocation, cmd = plan_prefill(self.index, ids, BLOCK, 0, ranks, "all", prefix_ids=True)
        if handoff:
            cmd = replace(cmd, export=(0, int(cmd.token_ids.numel()) - 1))

        def body(rank: int, comm: Any) -> Any:
            return command_rank(self.model, comm, self.stores[rank], cmd, cmd.token_ids)

        try:
            results, comms = run_ranks(self.c, body) if self.c > 1 else self._solo(body)
        except BaseException:
            self.index.abort(allocation)
            raise
        self.index.commit(allocation)
        self.calls = [dict(comm.calls) for comm in comms]
        logits, state = results[0]
        return logits, state, cmd.prefix_len

    def marks(self) -> list[bool]:
        """Per cached block, by depth: whether it keeps its raw rows."""
        located = sorted(self.index.locations().values(), key=lambda loc: loc.depth)
        return [keeps_raw_rows(self.stores[loc.rank], loc.slot) for loc in located]

    @staticmethod
    def _solo(body: Any) -> tuple[list[Any], list[Any]]:
        comm = SoloComm()
        return [body(0, comm)], [comm]


@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_cached_prefixes_resume_exactly_at_every_degree(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM, c: int
) -> None:
    """A prompt stores its blocks; a second prompt sharing 1,100 of its tokens resumes
    8 blocks (1,024 tokens, the end of CSA and HCA windows); the first again resumes
    all 10 of its whole blocks and computes the rest."""
    first = _ids(1300, 1)
    second = first[:1100] + _ids(500, 2)
    worker = Worker(dsv4_engine, c)
    got, _, p = worker.prefill(first)
    assert p == 0 and (got - _reference(dsv4_folder[1], first)).abs().max().item() <= TOL
    # Storing crosses nothing: a rank keeps the raw rows of the blocks it computed.
    assert all("prefix" not in calls and "blocks" not in calls for calls in worker.calls)
    marks = worker.marks()
    assert marks[0] and (all(marks) if c == 1 else not all(marks)), marks
    got, _, p = worker.prefill(second)
    assert p == 1024
    assert (got - _reference(dsv4_folder[1], second)[p:]).abs().max().item() <= TOL
    got, _, p = worker.prefill(first)
    assert p == 1280
    assert (got - _reference(dsv4_folder[1], first)[p:]).abs().max().item() <= TOL
    # One "prefix" all-gather reads the prefix.
    assert all(calls["prefix"] == 1 for calls in worker.calls)


def test_blocks_moved_to_a_worker_of_another_degree_resume_there(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM
) -> None:
    """What a split, a merge or a copy between workers does: blocks written at C = 2
    are moved, slot by slot, to a degree-4 worker (depth d on its rank d % 4) and
    adopted there; a prompt sharing them resumes exactly at C = 4."""
    first = _ids(1300, 3)
    src = Worker(dsv4_engine, 2)
    src.prefill(first)
    dst = Worker(dsv4_engine, 4)
    chain, taken = [], [0] * 4
    for loc in sorted(src.index.locations().values(), key=lambda loc: loc.depth):
        rank = loc.depth % 4
        k, v = src.stores[loc.rank].export([loc.slot])
        dst.stores[rank].install([taken[rank]], k, v)
        chain.append((loc.block_id, rank, taken[rank]))
        taken[rank] += 1
    assert len(dst.index.adopt(chain).inserted) == 10
    second = first[:1200] + _ids(300, 4)
    got, _, p = dst.prefill(second)
    assert p == 1152
    assert (got - _reference(dsv4_folder[1], second)[p:]).abs().max().item() <= TOL


@pytest.mark.parametrize("c", [1, 3])
def test_a_handoff_after_a_cached_prefix_carries_the_whole_prompt(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM, c: int
) -> None:
    """The state handed off after a prefix hit is the whole prompt's but its last
    token (cached part included): the next token decoded from it is the reference's."""
    first = _ids(1300, 5)
    worker = Worker(dsv4_engine, c)
    worker.prefill(first)
    prompt = first[:1200] + _ids(77, 6)
    _, state, p = worker.prefill(prompt, handoff=True)
    assert p == 1152 and state is not None and state.length == len(prompt) - 1
    last = torch.tensor(prompt[-1:])
    got, _ = resume_rank(dsv4_engine, SoloComm(), last, "last", state)
    want = _reference(dsv4_folder[1], prompt)[-1]
    assert got is not None and (got[0] - want).abs().max().item() <= TOL


def test_block_sizes_that_cannot_hold_the_state_are_refused(dsv4_engine: DeepseekV4LM) -> None:
    cfg = dsv4_engine.config
    assert cfg.caches_prefixes(128) and cfg.caches_prefixes(256)
    assert not cfg.caches_prefixes(64)
    assert "use blocks of 128" in (cfg.block_cache_problem(16) or "")
    # A store at a block size the cache cannot use keeps one block (none is written).
    assert PagedKVStore(cfg, 64, 16, torch.float32, CPU).num_blocks == 1
    assert PagedKVStore(cfg, 64, 128, torch.float32, CPU).num_blocks == 64
