"""Replay a forecast through the scheduler's cost rule over FIFO workers (DESIGN.md §6b).

A candidate composition is a set of workers, each with a degree and the time it can
start new work (its backlog, or, for a worker a reshape makes, the drain of its
sources plus the switch). Each forecast request, at its arrival offset t, goes where
the scheduler would send it:

    cost(i, w) = q_w / s_C + beta_C * E_C(L - P_iw, P_iw),    q_w = max(0, free_w - t)

with P_iw the prefix reusable at w (the request's recorded holders, carried over to
the workers a reshape makes of them), s_C the calibration (measured over predicted
service time; the scheduler itself sees predicted work, hence q_w / s_C) and beta_C
the cost weights, plus the backlog term's kappa * (n_min - 1), n_min estimated as the
shortest queue's predicted work over the forecast's mean E at its best reuse (the
scheduler counts its waiting requests; exact on one degree, within a few per cent
on mixed ones). Ties go to the lower q, then degree, then worker, as in the
scheduler. The worker then runs it for s_C * E + ``overhead_s`` (the serving path's
own time); its TTFT is the wait plus that.

Workers that hold nothing a request can reuse differ only in when they free, so
per degree the best of them is the one that frees first: one heap per degree (stale
entries skipped), plus the request's few holders checked one by one. The replay is
therefore exact for the cost rule out of overload and costs O(degrees + holders)
per request.

``dilation`` m > 1 replays a random 1/m of the requests with every duration times
m: the same queueing process on a slower clock (rates and service times keep their
ratio), its TTFTs divided by m. It bounds the cost of a replay at large pools.

Pure Python. Not owned here: the forecast (``forecast``), candidates and the
decision (``whatif``).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vertumnus.policy.costs import CostWeights, ReuseCurve
from vertumnus.policy.forecast import ArrivalSample, unit

# Input-length buckets of the calibration: [0, 2K), [2K, 8K), [8K, 32K), [32K, inf).
BUCKET_EDGES: tuple[int, ...] = (2048, 8192, 32768)


def bucket_of(input_tokens: int) -> int:
    return bisect.bisect_right(BUCKET_EDGES, input_tokens)


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


# Per request, uncalibrated and undilated: (input bucket, E per degree at its floor
# reuse, ((holder, E per degree at its reuse there), ...)). inf: cannot hold it.
Times = tuple[int, tuple[float, ...], tuple[tuple[int, tuple[float, ...]], ...]]

# (from when, in undilated seconds; the worker; the workers made of it, each with
# its free_at_s counted from the end of the worker's drain)
Retirement = tuple[float, int, tuple[ReplayWorker, ...]]


@dataclass(frozen=True)
class PreparedForecast:
    """Per request: offset, prefix key, input bucket, predicted E per degree (no
    reuse beyond the floor), holders with E at their reuse. E is the profile's,
    undilated and uncalibrated: ``run`` applies both."""

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


class ReplayModel:
    """The service-time model of one decision: the profile's curves, calibrated."""

    def __init__(
        self,
        curves: Mapping[int, ReuseCurve],
        degrees: Sequence[int],
        weights: CostWeights,
        scale: Mapping[int, Sequence[float]] | None = None,
        overhead_s: float = 0.0,
        max_tokens_per_rank: int | None = None,
    ) -> None:
        self.degrees = tuple(sorted(degrees))
        self.curves = {c: curves[c] for c in self.degrees}
        nb = len(BUCKET_EDGES) + 1
        self.scale = {c: tuple((scale or {}).get(c, (1.0,) * nb)) for c in self.degrees}
        self.weights = weights
        self.max_tokens_per_rank = max_tokens_per_rank
        self.overhead_s = overhead_s

    def prepare(
        self,
        samples: Sequence[ArrivalSample],
        origin_s: float,
        dilation: float = 1.0,
        span_s: float | None = None,
        cache: dict[int, Times] | None = None,
        warm: bool = False,
    ) -> PreparedForecast:
        """The samples as replay input, offsets from ``origin_s``; with ``dilation``
        m > 1 a deterministic 1/m of them. ``cache``: each request's times by id,
        kept from one decision to the next (they depend on the profile only).
        ``warm``: every prefix reusable wherever the trie matched it (a warm cache,
        as a cold pool will have; no holders needed)."""
        if dilation > 1.0:
            keep = 1.0 / dilation
            # By length, prefix and arrival, not request id: the drivers number
            # requests apart.
            samples = [s for s in samples if s.draw < keep]
        offsets: list[float] = []
        keys: list[int] = []
        buckets: list[int] = []
        e_pred: list[tuple[float, ...]] = []
        holders: list[tuple[tuple[int, tuple[float, ...]], ...]] = []
        for s in samples:
            times = cache.get(s.request_id) if cache is not None else None
            if times is None:
                times = self.times(s, warm)
                if cache is not None:
                    cache[s.request_id] = times
            offsets.append(s.arrival_s - origin_s)
            keys.append(s.prefix_key)
            buckets.append(times[0])
            e_pred.append(times[1])
            holders.append(times[2])
        span = span_s if span_s is not None else (max(offsets) if offsets else 0.0)
        return PreparedForecast(
            tuple(offsets),
            tuple(keys),
            tuple(buckets),
            tuple(e_pred),
            tuple(holders),
            dilation,
            span,
            _mean_best_e(len(self.degrees), e_pred, holders),
        )

    def times(self, sample: ArrivalSample, warm: bool = False) -> Times:
        """The request's E per degree at its floor and at each holder's reuse
        (``warm``: at its match anywhere, everywhere)."""
        n = sample.input_tokens
        if warm:
            return bucket_of(n), self._per_degree_s(n, sample.matched_tokens), ()
        return (
            bucket_of(n),
            self._per_degree_s(n, sample.floor_tokens),
            tuple((w, self._per_degree_s(n, p)) for w, p in sample.holders),
        )

    def _per_degree_s(self, input_tokens: int, reused_tokens: int) -> tuple[float, ...]:
        limit = self.max_tokens_per_rank
        return tuple(
            math.inf  # its ranks cannot hold the request
            if limit is not None and -(-input_tokens // c) > limit
            else self.curves[c].time_s(input_tokens, reused_tokens)
            for c in self.degrees
        )

    def run(
        self,
        forecast: PreparedForecast,
        workers: Sequence[ReplayWorker],
        remap: Mapping[int, tuple[int, ...]] | None = None,
        lost: Mapping[int, float] | None = None,
        head: PreparedForecast | None = None,
        cycles: int = 1,
        batches: int = 0,
        retire: Sequence[Retirement] = (),
    ) -> ReplayResult:
        """Mean TTFT of ``forecast`` on ``workers``. A holder id found in ``remap``
        stands for the workers it maps to (a reshape's targets: a request's prefix
        goes to one of them, by its prefix key); one neither there nor among
        ``workers`` holds nothing now. ``lost``: per remapped holder, the share of
        its prefixes the reshape leaves out of place (a prefix is lost or kept by
        its key); the first request of a lost prefix misses, the ones after it hit.

        ``head``: requests placed once at t = 0, before the forecast (a reshape's
        requeued requests). ``cycles``: the forecast is replayed that many times,
        one after the other (cycle c shifted by c times its span), from the state
        the one before left: the same load continued, so a backlog a transition
        builds is priced until it drains. ``batches``: see ``ReplayResult``.
        ``retire``: workers that take no work arriving from a time on; once each
        drains, its replacements serve (a reshape back, priced as it runs)."""
        m = forecast.dilation
        degrees = self.degrees
        index = {c: k for k, c in enumerate(degrees)}
        free: dict[int, float] = {}
        degree_of: dict[int, int] = {}
        heaps: list[list[tuple[float, int]]] = [[] for _ in degrees]
        for worker in workers:
            free[worker.worker_id] = worker.free_at_s * m
            degree_of[worker.worker_id] = index[worker.cp_degree]
            heaps[index[worker.cp_degree]].append((worker.free_at_s * m, worker.worker_id))
        for h in heaps:
            heapq.heapify(h)
        live = [len(h) for h in heaps]
        present = [k for k, n in enumerate(live) if n]
        if not present:
            raise ValueError("a replay needs at least one worker")
        scales = [self.scale[c] for c in degrees]
        overhead = self.overhead_s * m
        # The scheduler's beta + lambda (C / C_min - 1), C_min among the workers here.
        c_min = degrees[present[0]]
        factor = [self.weights.factor(c, c_min) for c in degrees]
        pending = sorted((at * m, w, made) for at, w, made in retire if w in free)
        # The scheduler sees predicted work: q in its units is q / (mean scale).
        inv_scale = [len(self.scale[c]) / sum(self.scale[c]) for c in degrees]
        # In overload the scheduler weighs E by beta + backlog_weight * (depth - 1),
        # depth the fewest requests waiting at any worker: here a worker's queue
        # over the forecast's mean E at its degree (``depth_unit``: that ratio's
        # factor per degree; empty: no backlog term).
        backlog_weight = self.weights.backlog_weight
        depth_unit = (
            [
                inv_scale[k] / (e * m) if 0 < e < math.inf else 0.0
                for k, e in enumerate(forecast.mean_e)
            ]
            if backlog_weight > 0
            else []
        )
        remap = remap or {}
        lost = lost or {}
        restored: set[int] = set()
        heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
        n_tail = len(forecast.offsets)
        if not n_tail and (head is None or not head.offsets):
            return ReplayResult(0.0, 0, 0.0, forecast.span_s)
        # One cycle lasts the forecast's span (at least its last arrival), dilated.
        period = max(forecast.span_s * m, forecast.offsets[-1] if n_tail else 0.0, 1e-9)
        nb = max(0, min(batches, n_tail))
        batch_sum = [0.0] * nb
        batch_n = [0] * nb
        cycle_means: list[float] = []
        backlogs: list[float] = []
        total = busy = 0.0
        served = 0
        passes: list[tuple[PreparedForecast, float, bool]] = []
        if head is not None and head.offsets:
            passes.append((head, 0.0, False))
        first_cycle = len(passes)  # (busy counts the first cycle only)
        passes += [(forecast, c * period, True) for c in range(max(1, cycles))]
        for number, (part, shift, is_cycle) in enumerate(passes):
            part_total = 0.0
            part_n = 0
            first = number == first_cycle
            position = 0
            for t0, key, b, pred, held in zip(
                part.offsets, part.keys, part.buckets, part.e_pred, part.holders, strict=True
            ):
                t = t0 + shift
                if pending and t >= pending[0][0]:
                    while pending and t >= pending[0][0]:
                        at, gone, made = pending.pop(0)
                        end = max(free[gone], at)  # its queue drains, then the switch
                        free[gone] = math.inf
                        live[degree_of[gone]] -= 1
                        for r in made:
                            k = index[r.cp_degree]
                            free[r.worker_id] = end + r.free_at_s * m
                            degree_of[r.worker_id] = k
                            heappush(heaps[k], (free[r.worker_id], r.worker_id))
                            live[k] += 1
                    present = [k for k, n in enumerate(live) if n]
                    if not present:
                        raise ValueError("a replay retired every worker and made none")
                    c_min = degrees[present[0]]
                    factor = [self.weights.factor(c, c_min) for c in degrees]
                tops = []  # each present degree's earliest-free worker (stale dropped)
                for k in present:
                    h = heaps[k]
                    fa, w = h[0]
                    while fa != free[w]:
                        heappop(h)
                        fa, w = h[0]
                    tops.append((k, fa, w))
                weigh = factor
                if depth_unit:  # the scheduler's backlog depth, in mean requests
                    depth = math.inf
                    for k, fa, _ in tops:
                        if pred[k] < math.inf:
                            d = (fa - t) * depth_unit[k] if fa > t else 0.0
                            if d < depth:
                                depth = d
                    if 2.0 <= depth < math.inf:
                        extra = backlog_weight * (int(depth) - 1)
                        weigh = [f + extra for f in factor]
                best_cost = best_q = float("inf")
                best_k = best_w = -1
                best_e = 0.0
                for k, fa, w in tops:
                    q = fa - t if fa > t else 0.0
                    e = pred[k] * m
                    cost = q * inv_scale[k] + weigh[k] * e
                    if cost < best_cost or (
                        cost == best_cost and (q, k, w) < (best_q, best_k, best_w)
                    ):
                        best_cost, best_q, best_k, best_w, best_e = cost, q, k, w, e
                missed = False
                for holder, h_pred in held:
                    if remap:
                        targets = remap.get(holder)
                        if targets is not None:
                            share = lost.get(holder, 0.0)
                            if share > 0 and key not in restored and unit(key, holder) < share:
                                missed = True
                                continue
                            holder = targets[key % len(targets)] if targets else -1
                    held_free = free.get(holder)
                    if held_free is None:
                        continue
                    k = degree_of[holder]
                    q = held_free - t if held_free > t else 0.0
                    e = h_pred[k] * m
                    cost = q * inv_scale[k] + weigh[k] * e
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
            total += part_total
            served += part_n
            if is_cycle:
                cycle_means.append(part_total / part_n / m if part_n else 0.0)
                edge = shift + period
                backlogs.append(sum(f - edge for f in free.values() if edge < f < math.inf) / m)
        # busy: the thinned requests' dilated service time, which is the whole
        # forecast's service time in real seconds.
        return ReplayResult(
            total / served / m if served else 0.0,
            served,
            busy,
            forecast.span_s,
            tuple(cycle_means),
            tuple(backlogs),
            tuple(s / n / m if n else 0.0 for s, n in zip(batch_sum, batch_n, strict=True)),
        )


def _mean_best_e(
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
