"""The replay's event loop (the cost rule over FIFO workers: see ``replay``), resumable.

A ``Replay`` is one forecast replayed on one set of workers. ``extend(cycles)``
replays the forecast again from the state the cycles before left (the same load
continued) and returns the result over the first ``cycles``: a horizon that doubles
while a backlog drains replays only the cycles it adds, and a result over fewer
cycles than already replayed is the same one a fresh replay would give.

Pure Python. Not owned here: the service-time model and the replay's input
(``replay``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vertumnus.policy.forecast import unit

if TYPE_CHECKING:
    from vertumnus.policy.replay import ReplayModel


@dataclass(frozen=True, slots=True)
class ReplayWorker:
    worker_id: int
    cp_degree: int
    free_at_s: float  # relative to the replay's t = 0, in real (undilated) seconds


@dataclass(frozen=True, slots=True)
class ReplayResult:
    mean_ttft_s: float
    requests: int
    busy_s: float  # service time of the first cycle's requests, in real seconds
    span_s: float  # arrival span of the replayed requests (one cycle), real seconds
    # per cycle: the mean TTFT of its arrivals, and the backlog left at its end
    # (the work queued past it, summed over workers, real seconds)
    cycle_ttft_s: tuple[float, ...] = ()
    backlog_s: tuple[float, ...] = ()
    # the forecast cut into ``batches`` runs of consecutive arrivals: each run's
    # mean TTFT over every cycle (the paired comparison's sample)
    batch_ttft_s: tuple[float, ...] = ()


# (from when, in undilated seconds; the worker; the workers made of it, each with
# its free_at_s counted from the end of the worker's drain)
Retirement = tuple[float, int, tuple[ReplayWorker, ...]]


@dataclass(frozen=True)
class PreparedForecast:
    """Per request: offset, prefix key, input bucket, predicted E per degree (no
    reuse beyond the floor), holders with E at their reuse. E is the profile's,
    undilated and uncalibrated: the replay applies both."""

    offsets: tuple[float, ...]
    keys: tuple[int, ...]  # prefix keys (which split child inherits the prefix)
    buckets: tuple[int, ...]
    e_pred: tuple[tuple[float, ...], ...]  # [request][degree index]
    holders: tuple[tuple[tuple[int, tuple[float, ...]], ...], ...]
    dilation: float
    span_s: float
    # per degree index: the mean predicted E of a request at its best reuse (the
    # cost rule's backlog depth is a queue's work in these units)
    mean_e: tuple[float, ...] = ()


class Replay:
    """``forecast`` on ``workers`` under ``model`` (arguments: ``ReplayModel.run``).
    The ``head`` is placed on creation; each ``extend`` adds cycles."""

    def __init__(
        self,
        model: ReplayModel,
        forecast: PreparedForecast,
        workers: Sequence[ReplayWorker],
        remap: Mapping[int, tuple[int, ...]] | None = None,
        lost: Mapping[int, float] | None = None,
        head: PreparedForecast | None = None,
        batches: int = 0,
        retire: Sequence[Retirement] = (),
    ) -> None:
        m = self.m = forecast.dilation
        self.model, self.forecast = model, forecast
        degrees = model.degrees
        self.index = index = {c: k for k, c in enumerate(degrees)}
        self.free: dict[int, float] = {}
        self.degree_of: dict[int, int] = {}
        self.heaps: list[list[tuple[float, int]]] = [[] for _ in degrees]
        for worker in workers:
            self.free[worker.worker_id] = worker.free_at_s * m
            self.degree_of[worker.worker_id] = index[worker.cp_degree]
            self.heaps[index[worker.cp_degree]].append((worker.free_at_s * m, worker.worker_id))
        for h in self.heaps:
            heapq.heapify(h)
        self.live = [len(h) for h in self.heaps]
        if not any(self.live):
            raise ValueError("a replay needs at least one worker")
        self._present()
        self.pending = sorted((at * m, w, made) for at, w, made in retire if w in self.free)
        self.remap = remap or {}
        self.lost = lost or {}
        self.restored: set[int] = set()
        self.n_tail = n_tail = len(forecast.offsets)
        self.empty = not n_tail and (head is None or not head.offsets)
        # One cycle lasts the forecast's span (at least its last arrival), dilated.
        self.period = max(forecast.span_s * m, forecast.offsets[-1] if n_tail else 0.0, 1e-9)
        self.nb = nb = max(0, min(batches, n_tail))
        self.batch_sum = [0.0] * nb
        self.batch_n = [0] * nb
        self.cycle_means: list[float] = []
        self.backlogs: list[float] = []
        self.total = self.busy = 0.0
        self.served = 0
        # per cycle replayed: (total, served, batch sums, batch counts) at its end
        self.marks: list[tuple[float, int, tuple[float, ...], tuple[int, ...]]] = []
        if not self.empty and head is not None and head.offsets:
            self._pass(head, 0.0, False, False)

    def _present(self) -> None:
        """The degrees with workers, and the scheduler's beta + lambda (C / C_min - 1),
        C_min among them."""
        degrees = self.model.degrees
        self.present = [k for k, n in enumerate(self.live) if n]
        if not self.present:
            raise ValueError("a replay retired every worker and made none")
        c_min = degrees[self.present[0]]
        self.factor = [self.model.weights.factor(c, c_min) for c in degrees]

    def extend(self, cycles: int) -> ReplayResult:
        """The result over the first ``cycles`` (at least one) of the forecast,
        replaying those not replayed yet."""
        cycles = max(1, cycles)
        if self.empty:
            return ReplayResult(0.0, 0, 0.0, self.forecast.span_s)
        while len(self.marks) < cycles:
            c = len(self.marks)
            self._pass(self.forecast, c * self.period, True, c == 0)
        total, served, batch_sum, batch_n = self.marks[cycles - 1]
        m = self.m
        # busy: the thinned requests' dilated service time, which is the whole
        # forecast's service time in real seconds.
        return ReplayResult(
            total / served / m if served else 0.0,
            served,
            self.busy,
            self.forecast.span_s,
            tuple(self.cycle_means[:cycles]),
            tuple(self.backlogs[:cycles]),
            tuple(s / n / m if n else 0.0 for s, n in zip(batch_sum, batch_n, strict=True)),
        )

    def _pass(self, part: PreparedForecast, shift: float, is_cycle: bool, first: bool) -> None:
        """Place ``part``'s requests, arrivals shifted by ``shift`` (dilated)."""
        model, m = self.model, self.m
        degrees = model.degrees
        free, degree_of, heaps, index = self.free, self.degree_of, self.heaps, self.index
        pending, remap, lost, restored = self.pending, self.remap, self.lost, self.restored
        scales = [model.scale[c] for c in degrees]
        overhead = model.overhead_s * m
        # The scheduler sees predicted work: q in its units is q / (mean scale).
        inv_scale = [len(model.scale[c]) / sum(model.scale[c]) for c in degrees]
        # In overload the scheduler weighs E by beta + backlog_weight * (depth - 1),
        # depth the fewest requests waiting at any worker: here a worker's queue
        # over the forecast's mean E at its degree (``depth_unit``: that ratio's
        # factor per degree; empty: no backlog term).
        backlog_weight = model.weights.backlog_weight
        depth_unit = (
            [
                inv_scale[k] / (e * m) if 0 < e < math.inf else 0.0
                for k, e in enumerate(self.forecast.mean_e)
            ]
            if backlog_weight > 0
            else []
        )
        heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
        free_get, remap_get, lost_get = free.get, remap.get, lost.get
        present, factor = self.present, self.factor
        n_tail, nb = self.n_tail, self.nb
        batch_sum, batch_n = self.batch_sum, self.batch_n
        inf = math.inf
        part_total = busy = 0.0
        part_n = position = 0
        for t0, key, b, pred, held in zip(
            part.offsets, part.keys, part.buckets, part.e_pred, part.holders, strict=True
        ):
            t = t0 + shift
            if pending and t >= pending[0][0]:
                while pending and t >= pending[0][0]:
                    at, gone, made = pending.pop(0)
                    end = max(free[gone], at)  # its queue drains, then the switch
                    free[gone] = inf
                    self.live[degree_of[gone]] -= 1
                    for r in made:
                        k = index[r.cp_degree]
                        free[r.worker_id] = end + r.free_at_s * m
                        degree_of[r.worker_id] = k
                        heappush(heaps[k], (free[r.worker_id], r.worker_id))
                        self.live[k] += 1
                self._present()
                present, factor = self.present, self.factor
            # Each present degree's earliest-free worker (stale entries dropped),
            # then the cost rule over them and the request's holders.
            tops = []
            for k in present:
                h = heaps[k]
                fa, w = h[0]
                while fa != free[w]:
                    heappop(h)
                    fa, w = h[0]
                tops.append((k, fa, w))
            extra = 0.0
            if depth_unit:  # the scheduler's backlog depth, in mean requests
                depth = inf
                for k, fa, _ in tops:
                    if pred[k] < inf:
                        d = (fa - t) * depth_unit[k] if fa > t else 0.0
                        if d < depth:
                            depth = d
                if 2.0 <= depth < inf:
                    extra = backlog_weight * (int(depth) - 1)
            best_cost = best_q = inf
            best_k = best_w = -1
            best_e = 0.0
            for k, fa, w in tops:
                q = fa - t if fa > t else 0.0
                e = pred[k] * m
                cost = q * inv_scale[k] + (factor[k] + extra) * e
                if cost < best_cost or (cost == best_cost and (q, k, w) < (best_q, best_k, best_w)):
                    best_cost, best_q, best_k, best_w, best_e = cost, q, k, w, e
            missed = False
            for holder, h_pred in held:
                if remap:
                    targets = remap_get(holder)
                    if targets is not None:
                        share = lost_get(holder, 0.0)
                        if share > 0 and key not in restored and unit(key, holder) < share:
                            missed = True
                            continue
                        holder = targets[key % len(targets)] if targets else -1
                held_free = free_get(holder)
                if held_free is None:
                    continue
                k = degree_of[holder]
                q = held_free - t if held_free > t else 0.0
                e = h_pred[k] * m
                cost = q * inv_scale[k] + (factor[k] + extra) * e
                if cost < best_cost or (
                    cost == best_cost and (q, k, holder) < (best_q, best_k, best_w)
                ):
                    best_cost, best_q, best_k, best_w, best_e = cost, q, k, holder, e
            if best_w < 0:
                position += 1
                continue  # no worker here can hold it (the scheduler refuses it)
            if missed:
                restored.add(key)  # computed (or fetched) now: the next one hits
            best_e = best_e * scales[best_k][b] + overhead  # what it really takes
            end = t + best_q + best_e
            free[best_w] = end
            h = heaps[best_k]
            if h[0][1] == best_w:
                heapreplace(h, (end, best_w))
            else:
                heappush(h, (end, best_w))
            ttft = best_q + best_e
            part_total += ttft
            part_n += 1
            if first:
                busy += best_e
            if is_cycle and nb:
                j = position * nb // n_tail
                batch_sum[j] += ttft
                batch_n[j] += 1
            position += 1
        self.total += part_total
        self.served += part_n
        self.busy += busy
        if is_cycle:
            self.cycle_means.append(part_total / part_n / m if part_n else 0.0)
            edge = shift + self.period
            self.backlogs.append(sum(f - edge for f in free.values() if edge < f < inf) / m)
            self.marks.append((self.total, self.served, tuple(batch_sum), tuple(batch_n)))
