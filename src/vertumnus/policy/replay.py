"""Replay a forecast through the scheduler's cost rule over FIFO workers (DESIGN.md §6b).

A candidate composition is a set of workers, each with a degree and the time it can
start new work (its backlog, or, for a worker a reshape makes, the drain of its
sources plus the switch). Each forecast request, at its arrival offset t, goes where
the scheduler would send it:

    cost(i, w) = q_w / s_C + beta_C * E_C(L - P_iw, P_iw),    q_w = max(0, free_w - t)

with P_iw the prefix reusable at w (the request's recorded holders, carried over to
the workers a reshape makes of them), s_C the calibration (measured over predicted
service time; the scheduler itself sees predicted work, hence q_w / s_C) and beta_C
the cost weights. Ties go to the lower q, then degree, then worker, as in the
scheduler. The worker then runs it for s_C * E + ``overhead_s`` (the serving path's
own time); its TTFT is the wait plus that.

Workers that hold nothing a request can reuse differ only in when they free, so
per degree the best of them is the one that frees first: one heap per degree (stale
entries skipped), plus the request's few holders checked one by one. The replay is
therefore exact for the cost rule and costs O(degrees + holders) per request.

``dilation`` m > 1 replays a random 1/m of the requests with every duration times
m: the same queueing process on a slower clock (rates and service times keep their
ratio), its TTFTs divided by m. It bounds the cost of a replay at large pools.

Pure Python. Not owned here: the forecast (``forecast``), candidates and the
decision (``whatif``).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vertumnus.policy.costs import CostWeights, ReuseCurve
from vertumnus.policy.forecast import ANY_WORKER, ArrivalSample

# Input-length buckets of the calibration: [0, 2K), [2K, 8K), [8K, 32K), [32K, inf).
BUCKET_EDGES: tuple[int, ...] = (2048, 8192, 32768)


def bucket_of(input_tokens: int) -> int:
    for k, edge in enumerate(BUCKET_EDGES):
        if input_tokens < edge:
            return k
    return len(BUCKET_EDGES)


@dataclass(frozen=True, slots=True)
class ReplayWorker:
    worker_id: int
    cp_degree: int
    free_at_s: float  # relative to the replay's t = 0, in real (undilated) seconds


@dataclass(frozen=True, slots=True)
class ReplayResult:
    mean_ttft_s: float
    requests: int
    busy_s: float  # service time of the whole forecast, in real seconds
    span_s: float  # arrival span of the replayed requests, real seconds


@dataclass(frozen=True)
class PreparedForecast:
    """Per request: offset, id, length, predicted and actual E per degree (no reuse),
    holders. Durations are already dilated."""

    offsets: tuple[float, ...]
    keys: tuple[int, ...]  # prefix keys (which split child inherits the prefix)
    tokens: tuple[int, ...]
    e_pred: tuple[tuple[float, ...], ...]  # [request][degree index]
    e_act: tuple[tuple[float, ...], ...]
    holders: tuple[tuple[tuple[int, int], ...], ...]
    dilation: float
    span_s: float


class ReplayModel:
    """The service-time model of one decision: the profile's curves, calibrated."""

    def __init__(
        self,
        curves: Mapping[int, ReuseCurve],
        degrees: Sequence[int],
        weights: CostWeights,
        scale: Mapping[int, Sequence[float]] | None = None,
        overhead_s: float = 0.0,
    ) -> None:
        self.degrees = tuple(sorted(degrees))
        self.curves = {c: curves[c] for c in self.degrees}
        nb = len(BUCKET_EDGES) + 1
        self.scale = {c: tuple((scale or {}).get(c, (1.0,) * nb)) for c in self.degrees}
        c_min = self.degrees[0]
        self.factor = {c: weights.factor(c, c_min) for c in self.degrees}
        self.overhead_s = overhead_s

    def prepare(
        self,
        samples: Sequence[ArrivalSample],
        origin_s: float,
        dilation: float = 1.0,
        span_s: float | None = None,
    ) -> PreparedForecast:
        """The samples as replay input, offsets from ``origin_s``; with ``dilation``
        m > 1 a deterministic 1/m of them."""
        if dilation > 1.0:
            keep = 1.0 / dilation
            # By length and prefix, not request id: the drivers number requests apart.
            samples = [s for s in samples if _unit(s.input_tokens, s.prefix_key) < keep]
        offsets, keys, tokens, e_pred, e_act, holders = [], [], [], [], [], []
        for s in samples:
            n, b = s.input_tokens, bucket_of(s.input_tokens)
            held = s.holders
            anywhere = 0
            if held and held[0][0] == ANY_WORKER:
                anywhere, held = held[0][1], ()
            pred = tuple(self.curves[c].time_s(n, anywhere) * dilation for c in self.degrees)
            offsets.append(s.arrival_s - origin_s)
            keys.append(s.prefix_key)
            tokens.append(n)
            e_pred.append(pred)
            e_act.append(
                tuple(
                    p * self.scale[c][b] + self.overhead_s * dilation
                    for c, p in zip(self.degrees, pred, strict=True)
                )
            )
            holders.append(held)
        span = span_s if span_s is not None else (max(offsets) if offsets else 0.0)
        return PreparedForecast(
            tuple(offsets),
            tuple(keys),
            tuple(tokens),
            tuple(e_pred),
            tuple(e_act),
            tuple(holders),
            dilation,
            span,
        )

    def run(
        self,
        forecast: PreparedForecast,
        workers: Sequence[ReplayWorker],
        remap: Mapping[int, tuple[int, ...]] | None = None,
    ) -> ReplayResult:
        """Mean TTFT of ``forecast`` on ``workers``. A holder id found in ``remap``
        stands for the workers it maps to (a reshape's targets: a request's prefix
        goes to one of them, by its prefix key); one neither there nor among
        ``workers`` holds nothing now."""
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
        present = [k for k, h in enumerate(heaps) if h]
        if not present:
            raise ValueError("a replay needs at least one worker")
        factor = [self.factor[c] for c in degrees]
        # The scheduler sees predicted work: q in its units is q / (mean scale).
        inv_scale = [len(self.scale[c]) / sum(self.scale[c]) for c in degrees]
        curves = [self.curves[c] for c in degrees]
        scales = [self.scale[c] for c in degrees]
        overhead = self.overhead_s * m
        remap = remap or {}
        heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
        total = busy = 0.0
        for t, key, n, pred, act, held in zip(
            forecast.offsets,
            forecast.keys,
            forecast.tokens,
            forecast.e_pred,
            forecast.e_act,
            forecast.holders,
            strict=True,
        ):
            best_cost = best_q = float("inf")
            best_k = best_w = -1
            best_e = 0.0
            for k in present:
                h = heaps[k]
                fa, w = h[0]
                while fa != free[w]:
                    heappop(h)
                    fa, w = h[0]
                q = fa - t if fa > t else 0.0
                cost = q * inv_scale[k] + factor[k] * pred[k]
                if cost < best_cost or (cost == best_cost and (q, k, w) < (best_q, best_k, best_w)):
                    best_cost, best_q, best_k, best_w, best_e = cost, q, k, w, act[k]
            for holder, p in held:
                targets = remap.get(holder)
                if targets is not None:
                    holder = targets[key % len(targets)] if targets else -1
                held_free = free.get(holder)
                if held_free is None:
                    continue
                k = degree_of[holder]
                e = curves[k].time_s(n, p) * m
                q = held_free - t if held_free > t else 0.0
                cost = q * inv_scale[k] + factor[k] * e
                if cost < best_cost or (
                    cost == best_cost and (q, k, holder) < (best_q, best_k, best_w)
                ):
                    best_cost, best_q, best_k, best_w = cost, q, k, holder
                    best_e = e * scales[k][bucket_of(n)] + overhead
            end = t + best_q + best_e
            free[best_w] = end
            h = heaps[best_k]
            if h[0][1] == best_w:
                heapreplace(h, (end, best_w))
            else:
                heappush(h, (end, best_w))
            total += best_q + best_e
            busy += best_e
        n_req = len(forecast.offsets)
        # busy: the thinned requests' dilated service time, which is the whole
        # forecast's service time in real seconds.
        return ReplayResult(total / n_req / m if n_req else 0.0, n_req, busy, forecast.span_s)


def _unit(input_tokens: int, prefix_key: int) -> float:
    """A fixed pseudo-random number in [0, 1) per request (for thinning)."""
    x = (input_tokens * 0x9E3779B97F4A7C15 + prefix_key) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    return x / 2.0**64
