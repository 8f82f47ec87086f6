"""Replay a forecast through the scheduler's cost rule over FIFO workers (docs/scheduling.md,
"The what-if controller").

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

Pure Python; the loop runs compiled where ``tools/build_native.py`` built it
(``vertumnus.native``). Not owned here: the forecast (``forecast``), candidates and the
decision (``whatif``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vertumnus import native
from vertumnus.policy.control import replay_loop
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay_types import (
    PreparedForecast,
    ReplayMoves,
    ReplayResult,
    ReplayWorker,
    Retirement,
    Times,
)
from vertumnus.policy.costs import CostWeights, ReuseCurve

# The loops compiled by mypyc where they are built from this source (``native``).
_loop = native.compiled(replay_loop)
if TYPE_CHECKING:
    from vertumnus.policy.control.replay_loop import Replay, gather, mean_best_e
else:
    Replay, gather, mean_best_e = _loop.Replay, _loop.gather, _loop.mean_best_e

__all__ = ["Calibrated", "Replay", "ReplayModel"]

# Input-length buckets of the calibration: [0, 2K), [2K, 8K), [8K, 32K), [32K, inf).
BUCKET_EDGES: tuple[int, ...] = (2048, 8192, 32768)


def bucket_of(input_tokens: int) -> int:
    return bisect.bisect_right(BUCKET_EDGES, input_tokens)


@dataclass(frozen=True)
class Calibrated:
    """What the calibration measured: per degree, per input bucket, measured over
    predicted service (none: 1); and the seconds every prefill adds."""

    scale: Mapping[int, Sequence[float]] = field(default_factory=dict)
    overhead_s: float = 0.0


class ReplayModel:
    """The service-time model of one decision: the profile's curves, calibrated."""

    def __init__(
        self,
        curves: Mapping[int, ReuseCurve],
        degrees: Sequence[int],
        weights: CostWeights,
        calibrated: Calibrated | None = None,
        max_tokens_per_rank: int | None = None,
    ) -> None:
        cal = calibrated or Calibrated()
        self.degrees = tuple(sorted(degrees))
        self.curves = {c: curves[c] for c in self.degrees}
        nb = len(BUCKET_EDGES) + 1
        self.scale = {c: tuple(cal.scale.get(c, (1.0,) * nb)) for c in self.degrees}
        self.weights = weights
        self.max_tokens_per_rank = max_tokens_per_rank
        self.overhead_s = cal.overhead_s

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
        # (thinned by length, prefix and arrival, not request id: the drivers number
        # requests apart)
        keep = 1.0 / dilation if dilation > 1.0 else math.inf
        offsets, keys, buckets, e_pred, holders = gather(
            samples, origin_s, keep, cache, lambda s: self.times(s, warm)
        )
        span = span_s if span_s is not None else (max(offsets) if offsets else 0.0)
        return PreparedForecast(
            offsets,
            keys,
            buckets,
            e_pred,
            holders,
            dilation,
            span,
            mean_best_e(len(self.degrees), e_pred, holders),
        )

    def times(self, sample: ArrivalSample, warm: bool = False) -> Times:
        """The request's E per degree at its floor and at each holder's reuse
        (``warm``: at its match anywhere, everywhere)."""
        n = sample.input_tokens
        limit = self.max_tokens_per_rank
        # (per degree: its time function, or None where its ranks cannot hold it)
        timers = [
            None if limit is not None and -(-n // c) > limit else self.curves[c].time_s
            for c in self.degrees
        ]
        if warm:
            return bucket_of(n), _per_degree_s(timers, n, sample.matched_tokens), ()
        return (
            bucket_of(n),
            _per_degree_s(timers, n, sample.floor_tokens),
            tuple([(w, _per_degree_s(timers, n, p)) for w, p in sample.holders]),
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
        replay = Replay(self, forecast, workers, ReplayMoves(remap, lost, head, retire), batches)
        return replay.extend(cycles)


def _per_degree_s(
    timers: Sequence[Callable[[int, int], float] | None], input_tokens: int, reused_tokens: int
) -> tuple[float, ...]:
    return tuple([math.inf if t is None else t(input_tokens, reused_tokens) for t in timers])
