"""Baseline routers, for comparison with the cost-based scheduler.

Each is a ``Scheduler`` with another choice rule, so everything else stays equal:
the same candidates (ACTIVE workers that can hold the request), the same FIFO
queues, the same reservation of E_iw at the chosen worker (with its reusable
prefix), the same per-request cache statistics.

    round-robin       the next candidate in worker order after the last one chosen
    least-load        the least outstanding predicted work q_w
    cache-first       the longest reusable prefix, then the least q_w (like the
                      usual cache-aware routers)
    length-threshold  inputs over ``long_tokens`` to the largest degree present,
                      the others to the smaller degrees; least q_w within the group

Ties: the lower worker id. Pure Python. ``policy/placement/routers.py`` names every router;
the routers of SGLang, Dynamo and llm-d are in ``policy/placement/peers.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vertumnus.policy.cache.nodes import Node
from vertumnus.policy.lattice import LatticeWorker
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Choice, Scheduler


class _Baseline(Scheduler):  # (placement/peers.py builds on it too)
    """The shared part: reserve E_iw at the worker ``_pick`` names."""

    reads_coming = False

    def _choose(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
        matched: Sequence[Node] = (),
    ) -> Choice:
        worker = self._pick(request, candidates, reuse, now)
        p = reuse.get(worker.worker_id, 0)
        e = self.curves[worker.cp_degree].time_s(request.input_tokens, p)
        q = self.outstanding_s(worker.worker_id, now)
        return worker.worker_id, worker.cp_degree, p, e, q, q + e, p

    def _pick(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> LatticeWorker:
        raise NotImplementedError

    def _least_loaded(self, workers: list[LatticeWorker], now: float) -> LatticeWorker:
        return min(workers, key=lambda w: (self.outstanding_s(w.worker_id, now), w.worker_id))


class RoundRobinScheduler(_Baseline):
    _last: int | None = None

    def _pick(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> LatticeWorker:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        after = [w for w in ordered if self._last is None or w.worker_id > self._last]
        chosen = (after or ordered)[0]
        self._last = chosen.worker_id
        return chosen


class LeastLoadScheduler(_Baseline):
    def _pick(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> LatticeWorker:
        return self._least_loaded(candidates, now)


class CacheFirstScheduler(_Baseline):
    def _pick(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> LatticeWorker:
        longest = max(reuse.get(w.worker_id, 0) for w in candidates)
        return self._least_loaded(
            [w for w in candidates if reuse.get(w.worker_id, 0) == longest], now
        )


class LengthThresholdScheduler(_Baseline):
    long_tokens = 32_768

    def _pick(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> LatticeWorker:
        largest = max(w.cp_degree for w in candidates)
        is_long = request.input_tokens > self.long_tokens
        group = [w for w in candidates if (w.cp_degree == largest) == is_long] or candidates
        return self._least_loaded(group, now)


BASELINES: dict[str, type[Scheduler]] = {
    "round-robin": RoundRobinScheduler,
    "least-load": LeastLoadScheduler,
    "cache-first": CacheFirstScheduler,
    "length-threshold": LengthThresholdScheduler,
}
