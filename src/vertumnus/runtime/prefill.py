"""A prefill planned for one CP worker's ranks, and the blocking client that runs one.

Owns the translation from a request (token ids) to a ``PrefillCommand``: block ids,
the reusable prefix (whole blocks, at least one token always computed), which rank
holds which prefix block and which slots the new full blocks go to. Keeps the
worker's ``WorkerCacheIndex`` true: commit on success, abort on failure.
``PrefillClient`` is the blocking client of ``prefill --check``, the benchmarks and
tests: one prefill at a time on a fixed set of ranks. The asyncio coordinator
drives the same planning code (``plan_prefill``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vertumnus.blocks import block_ids, max_reuse_blocks
from vertumnus.engine.messages import PrefillCommand, PrefillDone, RankFailed
from vertumnus.policy.cache.index import BlockAllocation, CacheReport, WorkerCacheIndex
from vertumnus.runtime.ranks import ChildRanks, RanksError


def plan_prefill(
    index: WorkerCacheIndex,
    tokens: Sequence[int],
    block_size: int,
    request_id: int,
    worker_ranks: tuple[int, ...],
    logits: str = "last",
    ids: Sequence[int] | None = None,
    prefix_ids: bool = False,
) -> tuple[BlockAllocation, PrefillCommand]:
    """Pin the reusable prefix, allocate the new blocks, and build the command
    (``ids``: the tokens' block ids, when the caller has them already;
    ``prefix_ids``: ``prefill_command``'s)."""
    if not tokens:
        raise ValueError("a prefill needs at least one token")
    if logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    if len(worker_ranks) != index.cp_degree:
        raise ValueError(
            f"worker of {len(worker_ranks)} ranks but cache index of degree {index.cp_degree}"
        )
    if ids is None:
        ids = block_ids(tokens, block_size)
    allocation = index.begin(ids, max_reuse_blocks(len(tokens), block_size))
    return allocation, prefill_command(
        allocation, tokens, block_size, request_id, worker_ranks, logits, prefix_ids=prefix_ids
    )


def prefill_command(
    allocation: BlockAllocation,
    tokens: Sequence[int],
    block_size: int,
    request_id: int,
    worker_ranks: tuple[int, ...],
    logits: str = "last",
    export: tuple[int, int] | None = None,
    prompt_logprobs: int | None = None,
    prefix_ids: bool = False,
) -> PrefillCommand:
    """The command every rank of the worker gets for a prefill whose block allocation is
    ``allocation``: the uncached suffix, which rank holds which prefix block (block j on
    CP rank j % C) and where each new full block goes (``export``: suffix rows whose
    K and V come back, for a hand-off; ``prompt_logprobs``: the top k of the suffix's
    log-probabilities come back, ``engine/logprobs.py``; ``prefix_ids``: the cached
    prefix's token ids go too, for DeepSeek-V4, ``engine/dsv4/blocks.py``)."""
    if logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    c = len(worker_ranks)
    prefix_len = allocation.prefix_blocks * block_size
    # Blocks loaded back from the host tier are part of the prefix (already written).
    prefix = (*allocation.reused, *allocation.new[: allocation.loaded])
    written = allocation.new[allocation.loaded :]
    return PrefillCommand(
        request_id=request_id,
        worker_ranks=worker_ranks,
        token_ids=torch.tensor(tokens[prefix_len:], dtype=torch.long),
        prefix_len=prefix_len,
        prefix_slots=tuple(tuple(loc.slot for loc in prefix if loc.rank == r) for r in range(c)),
        write=tuple(
            tuple((loc.depth, loc.slot) for loc in written if loc.rank == r) for r in range(c)
        ),
        block_size=block_size,
        logits=logits,
        export=export,
        prefix_ids=torch.tensor(tokens[:prefix_len], dtype=torch.long) if prefix_ids else None,
        prompt_logprobs=prompt_logprobs,
    )


@dataclass(frozen=True)
class PrefillOutcome:
    request_id: int
    cached_tokens: int  # tokens reused from the worker's cache
    computed_tokens: int  # tokens computed by this prefill
    logits: Tensor  # fp32 [1, V] (last position) or [computed_tokens, V]
    prefill_s: float  # wall time from dispatch to the last rank's answer
    rank_compute_s: tuple[float, ...]
    collectives: dict[str, int]  # per rank (all equal): collectives issued, by tag
    report: CacheReport
    # MoE: (token, expert) assignments per expert, summed over the ranks, by sparse layer
    expert_tokens: dict[int, list[int]] | None = None

    @property
    def first_token(self) -> int:
        return int(self.logits[-1].argmax())


class PrefillClient:
    """Prefills on ``devices``, ranks of ``ranks``, one at a time and blocking, with
    their own cache index (not a worker of the pool's lattice)."""

    def __init__(self, ranks: ChildRanks, devices: tuple[int, ...], worker_id: int = 0) -> None:
        self.ranks, self.devices = ranks, devices
        self.block_size = ranks.engine.block_size
        self.index = WorkerCacheIndex(len(devices), ranks.engine.kv_blocks_per_rank, worker_id)
        self._next_id = 0

    def prefill(self, tokens: Sequence[int], logits: str = "last") -> PrefillOutcome:
        request_id = self._next_id
        self._next_id += 1
        ids = None if self.ranks.model.caches_prefixes(self.block_size) else ()
        allocation, cmd = plan_prefill(
            self.index, tokens, self.block_size, request_id, self.devices, logits, ids,
            prefix_ids=self.ranks.model.dsv4 is not None,
        )  # fmt: skip
        start = time.perf_counter()
        for r in self.devices:
            self.ranks.send(r, cmd)
        # Wait for every rank's answer, failures included, so that none is left in the
        # queue to be mistaken for an answer to a later prefill.
        done: dict[int, PrefillDone] = {}
        failed: dict[int, RankFailed] = {}
        try:
            while len(done) + len(failed) < len(self.devices):
                msg = self.ranks.recv(self.ranks.engine.rank_timeout_s)
                match msg:
                    case RankFailed(request_id=None):
                        raise RanksError(f"rank {msg.rank} failed: {msg.error}\n{msg.traceback}")
                    case RankFailed() if msg.request_id == request_id and msg.rank in self.devices:
                        failed[msg.rank] = msg
                    case PrefillDone() if msg.request_id == request_id and msg.rank in self.devices:
                        done[msg.rank] = msg
            if failed:
                first = failed[min(failed)]
                raise RanksError(
                    f"prefill {request_id} failed on rank {first.rank}: "
                    f"{first.error}\n{first.traceback}"
                )
        except BaseException:
            self.index.abort(allocation)
            raise
        elapsed = time.perf_counter() - start
        report = self.index.commit(allocation)
        lead = done[self.devices[0]]
        assert lead.logits is not None, "CP rank 0 returns the logits"
        return PrefillOutcome(
            request_id=request_id,
            cached_tokens=cmd.prefix_len,
            computed_tokens=int(cmd.token_ids.numel()),
            logits=lead.logits,
            prefill_s=elapsed,
            rank_compute_s=tuple(done[r].compute_s for r in self.devices),
            collectives=lead.collectives,
            report=report,
            expert_tokens=_sum_expert_tokens([done[r].expert_tokens for r in self.devices]),
        )


def _sum_expert_tokens(
    per_rank: Sequence[dict[int, list[int]] | None],
) -> dict[int, list[int]] | None:
    known = [counts for counts in per_rank if counts is not None]
    if not known:
        return None
    return {
        layer: [sum(c[layer][e] for c in known) for e in range(len(known[0][layer]))]
        for layer in known[0]
    }
