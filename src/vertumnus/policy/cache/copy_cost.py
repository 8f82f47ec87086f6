"""What a pull costs: the copy time model the scheduler prices pulls with.

A pull copies the prefix a request could reuse from the worker that holds it to the
worker the request is placed on, and the request waits for it. The scheduler takes
it when that is cheaper than computing the prefix (``Scheduler._choose``):

    pull_s(n blocks) = backlog_s + latency_s + n * block_s
    cost_pull(i, w)  = q_w + max(0, pull_s - q_w) + factor_w * E_Cw(L - P*, P*)
                       + value_s * (blocks the copy must evict at w)

``backlog_s`` is the predicted time before the devices of w and of the holder the
copy reads from are free (the copies under way on them, then the copies queued
ahead of it: ``CopyLanes.ready_s``); P* the request's MatchedPath. A pull runs while the
worker works off its queue, so only the part of ``pull_s`` beyond ``q_w`` delays the
request.

``CopyTimer`` starts from ``CacheManagerConfig.copy_latency_s`` and ``copy_block_s``
and learns the seconds per block from every copy measured (an exponential average,
``weight`` per copy), in the simulator as in the server. ``EvictionValue`` learns
``value_s``, what evicting a block costs in future prefill time: a pull duplicates
a prefix, and the room it takes pushes other prefixes out of the pool. Pure
Python, clock-free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class CopyTimer:
    latency_s: float
    block_s: float
    weight: float = 0.2
    measured: int = 0  # copies observed

    def copy_s(self, num_blocks: int) -> float:
        """Predicted seconds of a copy moving ``num_blocks`` blocks."""
        return self.latency_s + num_blocks * self.block_s

    def observe(self, num_blocks: int, seconds: float) -> None:
        """A copy of ``num_blocks`` blocks took ``seconds`` (from its start on the
        copy lanes to its bytes in place)."""
        if num_blocks < 1 or not seconds >= 0:
            return
        per_block = max(0.0, seconds - self.latency_s) / num_blocks
        self.block_s += self.weight * (per_block - self.block_s)
        self.measured += 1


class EvictionValue:
    """What evicting one block costs, learned from the pool's own misses.

    A block is *lost* when its last copy in the pool is evicted. Lost blocks are
    remembered (the most recent ``max_ghosts``, as ghosts); a request whose prefix
    continues, beyond its MatchedPath, into ghosts would have reused them, and the
    prefill time they would have saved (their marginal benefit at the request's
    preferred degree) is the cost of those evictions. Over the same period (both sums
    decay with the cache manager's scan), the cost of one eviction, of any block, is

        value_s = ghost benefit / blocks evicted

    so a pull that must evict n blocks at its destination costs about n * value_s
    of future prefill time. Pure Python.
    """

    def __init__(self, max_ghosts: int = 65_536) -> None:
        self.max_ghosts = max_ghosts
        self._ghosts: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0.0  # blocks evicted (decayed)
        self.ghost_benefit_s = 0.0  # prefill seconds the lost blocks would have saved

    @property
    def value_s(self) -> float:
        return self.ghost_benefit_s / self.evicted if self.evicted >= 1.0 else 0.0

    def evicted_block(self, block_id: int, last_copy: bool) -> None:
        self.evicted += 1.0
        if last_copy:
            ghosts = self._ghosts
            ghosts[block_id] = None
            ghosts.move_to_end(block_id)
            if len(ghosts) > self.max_ghosts:
                ghosts.popitem(last=False)

    def inserted(self, block_id: int) -> None:
        self._ghosts.pop(block_id, None)

    def missed(
        self,
        block_ids: Sequence[int],
        start: int,
        stop: int,
        base_s: float,
        step_s: float,
        block_s: Callable[[int], float] | None = None,
    ) -> None:
        """A request's blocks ``start`` (its MatchedPath's end) to ``stop`` (what it
        may reuse): those that are ghosts, in a row, were lost too early; block j
        would have saved ``base_s + step_s * j`` (``block_s(j)`` where given: a model
        with sliding windows, whose benefit is not linear in j)."""
        ghosts = self._ghosts
        if not ghosts:
            return
        for depth in range(start, stop):
            if block_ids[depth] not in ghosts:
                break
            saved = base_s + step_s * depth if block_s is None else block_s(depth)
            self.ghost_benefit_s += max(0.0, saved)

    def decay(self, factor: float) -> None:
        self.evicted *= factor
        self.ghost_benefit_s *= factor
