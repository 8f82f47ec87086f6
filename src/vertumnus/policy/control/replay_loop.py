"""The replay's event loop (the cost rule over FIFO workers: see ``replay``), resumable.

A ``Replay`` is one forecast replayed on one set of workers. ``extend(cycles)``
replays the forecast again from the state the cycles before left (the same load
continued) and returns the result over the first ``cycles``: a horizon that doubles
while a backlog drains replays only the cycles it adds, and a result over fewer
cycles than already replayed is the same one a fresh replay would give.

Also here, being as hot: ``gather``, a forecast's samples made the replay's columns,
and ``mean_best_e``, the unit of the cost rule's backlog depth, over every request
of a prepared forecast.

Pure Python, compiled by mypyc where built (``vertumnus.native``): keep it typed.
Not owned here: the service-time model and the replay's input (``replay``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vertumnus.policy.control.forecast import ArrivalSample, unit
from vertumnus.policy.control.replay_types import (
    PreparedForecast,
    ReplayMoves,
    ReplayResult,
    ReplayWorker,
    Times,
)

if TYPE_CHECKING:
    from vertumnus.policy.control.replay import ReplayModel


class Replay:
    """``forecast`` on ``workers`` under ``model`` (arguments: ``ReplayModel.run``).
    The ``head`` is placed on creation; each ``extend`` adds cycles."""

    def __init__(
        self,
        model: ReplayModel,
        forecast: PreparedForecast,
        workers: Sequence[ReplayWorker],
        moves: ReplayMoves | None = None,
        batches: int = 0,
    ) -> None:
        """``moves``: what a candidate's reshape changes (none: nothing)."""
        moves = moves if moves is not None else ReplayMoves()
        remap, lost, head, retire = moves.remap, moves.lost, moves.head, moves.retire
        m = self.m = forecast.dilation
        self.model, self.forecast = model, forecast
        degrees = model.degrees
        self.index = index = {c: k for k, c in enumerate(degrees)}
        # Workers by slot, slots in the order of worker ids (every worker the replay
        # can have: those given and those a retirement makes), so that a tie broken
        # by slot is the scheduler's tie broken by worker id.
        ids = sorted({w.worker_id for w in workers}
                     | {r.worker_id for _, _, made in retire for r in made})  # fmt: skip
        self.slot_of = slot_of = {w: k for k, w in enumerate(ids)}
        self.free: list[float] = [math.inf] * len(ids)
        self.degree_of: list[int] = [0] * len(ids)
        self.here: list[bool] = [False] * len(ids)  # made already (a holder's worker)
        self.order: list[int] = []  # slots in the order they came (the backlog's sum)
        self.heaps: list[list[tuple[float, int]]] = [[] for _ in degrees]
        for worker in workers:
            slot, k = slot_of[worker.worker_id], index[worker.cp_degree]
            self._add(slot, k, worker.free_at_s * m)
            self.heaps[k].append((worker.free_at_s * m, slot))
        for h in self.heaps:
            heapq.heapify(h)
        self.live = [len(h) for h in self.heaps]
        if not any(self.live):
            raise ValueError("a replay needs at least one worker")
        self._present()
        self.pending = sorted(
            (at * m, w, made) for at, w, made in retire if w in slot_of and self.here[slot_of[w]]
        )
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
        self.head_n = self.served  # the head's requests served

    def _add(self, slot: int, k: int, free_at: float) -> None:
        """A worker of degree index ``k`` in ``slot``, free from ``free_at`` (dilated);
        the caller puts it in its heap."""
        if not self.here[slot]:
            self.here[slot] = True
            self.order.append(slot)
        self.free[slot] = free_at
        self.degree_of[slot] = k

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
        # the last cycle alone: the marks before it subtracted (before the first,
        # the head's requests, in no batch)
        nb = self.nb
        before = (
            self.marks[cycles - 2] if cycles > 1 else (0.0, self.head_n, (0.0,) * nb, (0,) * nb)
        )
        last_n = served - before[1]
        last_batches = tuple(
            (s - s0) / (n - n0) / m if n > n0 else 0.0
            for s, n, s0, n0 in zip(batch_sum, batch_n, before[2], before[3], strict=True)
        )
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
            last_n,
            last_batches,
        )

    def _pass(self, part: PreparedForecast, shift: float, is_cycle: bool, first: bool) -> None:
        """Place ``part``'s requests, arrivals shifted by ``shift`` (dilated)."""
        model, m = self.model, self.m
        degrees = model.degrees
        free, degree_of, heaps, index = self.free, self.degree_of, self.heaps, self.index
        slot_of, here = self.slot_of, self.here
        pending, remap, lost, restored = self.pending, self.remap, self.lost, self.restored
        scales = [model.scale[c] for c in degrees]
        overhead = model.overhead_s * m
        # The scheduler sees predicted work: q in its units is q / (mean scale).
        inv_scale = [len(model.scale[c]) / sum(model.scale[c], 0.0) for c in degrees]
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
        slot_get, remap_get, lost_get = slot_of.get, remap.get, lost.get
        present, factor = self.present, self.factor
        n_tail, nb = self.n_tail, self.nb
        batch_sum, batch_n = self.batch_sum, self.batch_n
        inf = math.inf
        part_total = busy = 0.0
        part_n = position = 0
        offsets, keys, buckets, e_pred, holders = (
            part.offsets, part.keys, part.buckets, part.e_pred, part.holders
        )  # fmt: skip
        if not len(offsets) == len(keys) == len(buckets) == len(e_pred) == len(holders):
            raise ValueError("a prepared forecast's columns differ in length")
        for i in range(len(offsets)):
            t = offsets[i] + shift
            key, b, pred, held = keys[i], buckets[i], e_pred[i], holders[i]
            if pending and t >= pending[0][0]:
                while pending and t >= pending[0][0]:
                    at, gone_id, made = pending.pop(0)
                    gone = slot_of[gone_id]
                    end = max(free[gone], at)  # its queue drains, then the switch
                    free[gone] = inf
                    self.live[degree_of[gone]] -= 1
                    for r in made:
                        k = index[r.cp_degree]
                        slot = slot_of[r.worker_id]
                        self._add(slot, k, end + r.free_at_s * m)
                        heappush(heaps[k], (free[slot], slot))
                        self.live[k] += 1
                self._present()
                present, factor = self.present, self.factor
            # Each present degree's earliest-free worker (stale entries dropped),
            # then the cost rule over them and the request's holders.
            depth = inf
            for k in present:
                h = heaps[k]
                fa, w = h[0]
                while fa != free[w]:
                    heappop(h)
                    fa, w = h[0]
                if depth_unit and pred[k] < inf:  # the scheduler's backlog depth
                    d = (fa - t) * depth_unit[k] if fa > t else 0.0
                    if d < depth:
                        depth = d
            extra = backlog_weight * (int(depth) - 1) if 2.0 <= depth < inf else 0.0
            best_cost = best_q = inf
            best_k = best_w = -1
            best_e = 0.0
            for k in present:
                fa, w = heaps[k][0]
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
                w = slot_get(holder, -1)
                if w < 0 or not here[w]:
                    continue
                held_free = free[w]
                k = degree_of[w]
                q = held_free - t if held_free > t else 0.0
                e = h_pred[k] * m
                cost = q * inv_scale[k] + (factor[k] + extra) * e
                if cost < best_cost or (cost == best_cost and (q, k, w) < (best_q, best_k, best_w)):
                    best_cost, best_q, best_k, best_w, best_e = cost, q, k, w, e
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
            backlog = sum(free[w] - edge for w in self.order if edge < free[w] < inf)
            self.backlogs.append(backlog / m)
            self.marks.append((self.total, self.served, tuple(batch_sum), tuple(batch_n)))


def gather(
    samples: Sequence[ArrivalSample],
    origin_s: float,
    keep: float,
    cache: dict[int, Times] | None,
    times: Callable[[ArrivalSample], Times],
) -> tuple[
    tuple[float, ...],
    tuple[int, ...],
    tuple[int, ...],
    tuple[tuple[float, ...], ...],
    tuple[tuple[tuple[int, tuple[float, ...]], ...], ...],
]:
    """``ReplayModel.prepare``'s columns: the samples whose draw is under ``keep``,
    each with its offset from ``origin_s``, prefix key and ``times`` (read from
    ``cache`` by request id, or computed and kept there)."""
    offsets: list[float] = []
    keys: list[int] = []
    buckets: list[int] = []
    e_pred: list[tuple[float, ...]] = []
    holders: list[tuple[tuple[int, tuple[float, ...]], ...]] = []
    for s in samples:
        if not s.draw < keep:
            continue
        found = cache.get(s.request_id) if cache is not None else None
        if found is None:
            found = times(s)
            if cache is not None:
                cache[s.request_id] = found
        offsets.append(s.arrival_s - origin_s)
        keys.append(s.prefix_key)
        buckets.append(found[0])
        e_pred.append(found[1])
        holders.append(found[2])
    return tuple(offsets), tuple(keys), tuple(buckets), tuple(e_pred), tuple(holders)


def mean_best_e(
    n_degrees: int,
    e_pred: Sequence[tuple[float, ...]],
    holders: Sequence[tuple[tuple[int, tuple[float, ...]], ...]],
) -> tuple[float, ...]:
    """Per degree index, the mean over the requests that degree can hold of E at the
    request's best reuse (its floor or its best holder): the unit in which the
    replay counts a queue's requests. 0.0 where no request fits."""
    sums = [0.0] * n_degrees
    counts = [0] * n_degrees
    for pred, held in zip(e_pred, holders, strict=True):
        for k in range(n_degrees):
            e = pred[k]
            for _, h_pred in held:
                if h_pred[k] < e:
                    e = h_pred[k]
            if e < math.inf:
                sums[k] += e
                counts[k] += 1
    return tuple(s / n if n else 0.0 for s, n in zip(sums, counts, strict=True))
