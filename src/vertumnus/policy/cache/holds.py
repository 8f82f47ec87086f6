"""Hand-off holds: a prompt's KV kept on its worker for a decode server to take.

A prefill whose KV is handed off ends with ``PoolPolicy.finish(hold=True)``: in
the same step that commits its new blocks, the whole blocks of its prompt but the
last token (``held_blocks``) are pinned again in the worker's cache index, so that
nothing evicts them before the decode side has them. The hold is part of the
worker's state machine, not a side table of the driver's:

  * a worker that holds KV for a hand-off does not park: a reshape's participant
    waits, DRAINING, until every hold on it is released (pulled, released, expired,
    or ended by the driver when its wait is over), and only then switches;
  * a worker that is reset (a rank failed: its KV is gone) loses its holds at once;
    the driver answers their pulls with "moved".

Invariant: every hold's pin is on its worker's current index, or the hold was
dropped with that index. Pure Python, clock-free. Not owned here: the lease, its
handle, its deadline and the bytes of the pull (the driver's ``runtime/kv/handoffs.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vertumnus.policy.cache.index import (
    BlockAllocation,
    BlockLocation,
    CacheReport,
    WorkerCacheIndex,
)


def held_blocks(allocation: BlockAllocation, prompt_tokens: int, block_tokens: int) -> int:
    """The whole blocks a hand-off of a prompt keeps pinned: those of the prompt but
    its last token (the decode side computes that one) that the prefill's allocation holds,
    reused or newly written. The other rows of the prompt come back with the prefill."""
    return min(
        allocation.num_reused_blocks + len(allocation.new), (prompt_tokens - 1) // block_tokens
    )


@dataclass(frozen=True, eq=False)
class Hold:
    """The KV of one prompt kept for a decode server: its whole blocks, pinned."""

    hold_id: int
    request_id: int
    worker_id: int
    index: WorkerCacheIndex  # the index the pin is on
    pin: BlockAllocation  # ``reused``: the held blocks, in sequence order; nothing new

    @property
    def blocks(self) -> list[BlockLocation]:
        return self.pin.reused


class Holds:
    """Every hold, by worker."""

    def __init__(self) -> None:
        self._by_worker: dict[int, dict[int, Hold]] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return sum(len(holds) for holds in self._by_worker.values())

    def holding(self, worker_id: int) -> bool:
        """True while some hand-off still holds KV on the worker."""
        return bool(self._by_worker.get(worker_id))

    def of(self, worker_id: int) -> list[Hold]:
        return list(self._by_worker.get(worker_id, {}).values())

    def take(
        self,
        request_id: int,
        worker_id: int,
        index: WorkerCacheIndex,
        block_ids: Sequence[int],
        num_blocks: int,
    ) -> Hold:
        """Pin the first ``num_blocks`` of ``block_ids``, committed on ``index`` (the
        prefill that wrote them has just been committed: they are all there)."""
        pin = index.begin(block_ids[:num_blocks], num_blocks)
        if len(pin.reused) != num_blocks or pin.new:
            index.abort(pin)
            raise AssertionError(
                f"request {request_id}: {len(pin.reused)} of its {num_blocks} blocks "
                f"are committed on worker {worker_id}"
            )
        hold = Hold(next(self._ids), request_id, worker_id, index, pin)
        self._by_worker.setdefault(worker_id, {})[hold.hold_id] = hold
        return hold

    def release(self, hold: Hold, current: WorkerCacheIndex | None) -> CacheReport | None:
        """End ``hold``: its pin goes (the report for the trie: evictions the pin had
        kept back, none usually) when its index is still ``current``; None if the hold
        had ended already or its index is gone."""
        held = self._by_worker.get(hold.worker_id)
        if held is None or held.pop(hold.hold_id, None) is None:
            return None
        if not held:
            del self._by_worker[hold.worker_id]
        if current is not hold.index:
            return None
        return hold.index.commit(hold.pin)

    def drop_worker(self, worker_id: int) -> list[Hold]:
        """The worker's index is gone (a reset): its holds end with it."""
        return list(self._by_worker.pop(worker_id, {}).values())
