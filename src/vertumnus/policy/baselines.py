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

Ties: the lower worker id. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping

from vertumnus.policy.lattice import LatticeWorker
from vertumnus.policy.scheduler import Choice, PlacementRequest, Scheduler


class _LoadAware(Scheduler):
    def _q(self, worker_id: int, now: float) -> float:
        return self.outstanding_s(worker_id, now)

    def _pick(
        self,
        request: PlacementRequest,
        worker: LatticeWorker,
        reuse: Mapping[int, int],
        now: float,
    ) -> Choice:
        p = reuse.get(worker.worker_id, 0)
        e = self.curves[worker.cp_degree].time_s(request.input_tokens, p)
        q = self._q(worker.worker_id, now)
        return worker.worker_id, worker.cp_degree, p, e, q, q + e


class RoundRobinScheduler(_LoadAware):
    _last: int | None = None

    def _choose(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> Choice:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        after = [w for w in ordered if self._last is None or w.worker_id > self._last]
        chosen = (after or ordered)[0]
        self._last = chosen.worker_id
        return self._pick(request, chosen, reuse, now)


class LeastLoadScheduler(_LoadAware):
    def _choose(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> Choice:
        chosen = min(candidates, key=lambda w: (self._q(w.worker_id, now), w.worker_id))
        return self._pick(request, chosen, reuse, now)


class CacheFirstScheduler(_LoadAware):
    def _choose(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> Choice:
        chosen = min(
            candidates,
            key=lambda w: (-reuse.get(w.worker_id, 0), self._q(w.worker_id, now), w.worker_id),
        )
        return self._pick(request, chosen, reuse, now)


class LengthThresholdScheduler(_LoadAware):
    long_tokens = 32_768

    def _choose(
        self,
        request: PlacementRequest,
        candidates: list[LatticeWorker],
        reuse: Mapping[int, int],
        now: float,
    ) -> Choice:
        largest = max(w.cp_degree for w in candidates)
        is_long = request.input_tokens > self.long_tokens
        group = [w for w in candidates if (w.cp_degree == largest) == is_long] or candidates
        chosen = min(group, key=lambda w: (self._q(w.worker_id, now), w.worker_id))
        return self._pick(request, chosen, reuse, now)


ROUTERS: dict[str, type[Scheduler]] = {
    "round-robin": RoundRobinScheduler,
    "least-load": LeastLoadScheduler,
    "cache-first": CacheFirstScheduler,
    "length-threshold": LengthThresholdScheduler,
}
