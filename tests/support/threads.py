"""The C ranks of one CP worker as threads of the test process, sharing a
``ThreadGroup``, with one KV store per rank and a ``WorkerCacheIndex`` that hands out
slots through ``plan_prefill``, as in production: the harness of the in-process
engine tests, which compare it with single-process references."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from support.factories import BLOCK_SIZE, TINY
from vertumnus.config import ModelConfig
from vertumnus.engine.comm import ThreadComm, ThreadGroup
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.messages import PrefillCommand
from vertumnus.engine.model import CausalLM
from vertumnus.engine.zigzag import prefill_rank
from vertumnus.policy.cache.index import BlockAllocation, WorkerCacheIndex
from vertumnus.runtime.prefill import plan_prefill

BLOCKS_PER_RANK = 16
CPU = torch.device("cpu")


def run_ranks(c: int, body: Callable[[int, ThreadComm], Any]) -> tuple[list[Any], list[ThreadComm]]:
    """Run ``body(rank, comm)`` on C threads; return per-rank results and comms.

    An exception on one rank breaks the group's barrier, so its peers stop waiting in
    an all-gather; the first exception is re-raised here.
    """
    group = ThreadGroup(c)
    comms = [group.comm(r) for r in range(c)]
    results: list[Any] = [None] * c
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, comms[rank])
        except BaseException as exc:
            errors.append(exc)
            group._barrier.abort()  # wake the peers blocked in an all-gather

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]
    return results, comms


def make_stores(
    c: int, num_blocks: int = BLOCKS_PER_RANK, config: ModelConfig = TINY
) -> list[PagedKVStore]:
    """One empty fp32 KV store of ``num_blocks`` blocks per rank, for ``config``."""
    return [PagedKVStore(config, num_blocks, BLOCK_SIZE, torch.float32, CPU) for _ in range(c)]


@dataclass
class ThreadWorker:
    """One CP worker in threads: its cache index and one KV store per rank."""

    index: WorkerCacheIndex
    stores: list[PagedKVStore]

    @classmethod
    def make(
        cls, c: int, config: ModelConfig = TINY, blocks_per_rank: int = BLOCKS_PER_RANK
    ) -> ThreadWorker:
        return cls(WorkerCacheIndex(c, blocks_per_rank), make_stores(c, blocks_per_rank, config))


@dataclass
class CPResult:
    logits: Tensor  # [computed tokens, vocab], fp32
    allocation: BlockAllocation
    cmd: PrefillCommand
    calls: list[Counter[str]]  # collectives per rank, by tag
    received: list[Counter[str]]  # elements each rank received from its peers, by tag


def cp_prefill(model: CausalLM, worker: ThreadWorker, tokens: Sequence[int]) -> CPResult:
    """Plan, run on C threads, commit: what ``PrefillClient.prefill`` does over processes."""
    c = worker.index.cp_degree
    allocation, cmd = plan_prefill(
        worker.index, tokens, BLOCK_SIZE, request_id=0, worker_ranks=tuple(range(c)), logits="all"
    )

    def body(rank: int, comm: ThreadComm) -> Tensor | None:
        return prefill_rank(model, comm, worker.stores[rank], cmd.for_rank(rank), logits="all")

    try:
        outs, comms = run_ranks(c, body)
    except BaseException:
        worker.index.abort(allocation)
        raise
    worker.index.commit(allocation)
    assert all(out is None for out in outs[1:]), "only CP rank 0 returns logits"
    assert outs[0] is not None, "CP rank 0 returned no logits"
    return CPResult(
        outs[0], allocation, cmd, [comm.calls for comm in comms], [comm.received for comm in comms]
    )
