"""The what-if controller's search: the replays of one decision, off the event loop.

``WhatIfPlan`` is everything a decision needs, read from the pool on the driver's
loop (``WhatIfController.prepare``); ``evaluate`` replays it and touches nothing
else, so a server runs it on its decision thread; the controller then concludes
(``WhatIfController.conclude``). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from vertumnus.policy.forecast import ArrivalSample
from vertumnus.policy.replay import PreparedForecast, ReplayModel, ReplayResult, ReplayWorker
from vertumnus.policy.whatif_candidates import Candidate


@dataclass(frozen=True)
class WhatIfPlan:
    now: float
    model: ReplayModel
    forecast: PreparedForecast
    candidates: tuple[Candidate, ...]
    audits: tuple[tuple[int, PreparedForecast, tuple[ReplayWorker, ...], float], ...]
    forecast_requests: int
    rate_changed: bool
    next_weight: float
    op_cost: float
    warming: bool = False  # the cold-cache warm-up: replayed with a warm cache


@dataclass(frozen=True)
class Evaluation:
    # per candidate; None where the search did not need that replay
    next: tuple[ReplayResult | None, ...]
    steady: tuple[ReplayResult | None, ...]
    scores: tuple[float | None, ...]  # J, times the operations' cost
    audits: tuple[tuple[int, float, float], ...]  # (period, predicted, measured)


def evaluate(plan: WhatIfPlan) -> Evaluation:
    """The replays: a pure function of the plan (safe off the event loop).

    Holding first. Then each kind of move (direction and level) by growing k:
    ``steady`` first, and ``next`` only for a candidate that could still win
    (``next`` is rarely below ``steady``, so a candidate whose steady score is
    no better than holding's J cannot beat it); the search along a kind stops
    once its steady score stops improving with k."""
    model, forecast = plan.model, plan.forecast
    n = len(plan.candidates)
    nexts: list[ReplayResult | None] = [None] * n
    steadies: list[ReplayResult | None] = [None] * n
    scores: list[float | None] = [None] * n
    if not forecast.offsets:
        return Evaluation(tuple(nexts), tuple(steadies), tuple(scores), ())
    w, op_cost = plan.next_weight, plan.op_cost

    def replay_next(k: int) -> ReplayResult:
        cand = plan.candidates[k]
        head = model.prepare(
            [
                ArrivalSample(
                    s.request_id, 0.0, s.input_tokens, s.holders, s.prefix_key, s.floor_tokens
                )
                for s in cand.requeued
            ],
            0.0,
            forecast.dilation,
        )
        combined = _concat(head, forecast) if head.offsets else forecast
        return model.run(combined, cand.next_workers, cand.remap, cand.lost)

    holding = plan.candidates[0]
    steady_hold = model.run(forecast, holding.steady_workers, holding.remap)
    next_hold = replay_next(0)
    steadies[0], nexts[0] = steady_hold, next_hold
    hold = w * next_hold.mean_ttft_s + (1 - w) * steady_hold.mean_ttft_s
    scores[0] = hold
    groups: dict[tuple[str, int], list[int]] = {}
    for k, cand in enumerate(plan.candidates[1:], start=1):
        groups.setdefault((cand.kind, cand.level), []).append(k)
    for members in groups.values():
        previous = float("inf")
        for k in members:
            cand = plan.candidates[k]
            steady = model.run(forecast, cand.steady_workers, cand.remap)
            steadies[k] = steady
            factor = 1 + op_cost * len(cand.ops)
            bound = steady.mean_ttft_s * factor
            if bound > previous:
                break  # more of this move only gets worse
            previous = bound
            if bound >= hold:
                continue  # cannot beat holding
            nxt = replay_next(k)
            nexts[k] = nxt
            scores[k] = (w * nxt.mean_ttft_s + (1 - w) * steady.mean_ttft_s) * factor
    audits = tuple(
        (index, model.run(replayed, workers).mean_ttft_s, measured)
        for index, replayed, workers, measured in plan.audits
    )
    return Evaluation(tuple(nexts), tuple(steadies), tuple(scores), audits)


def _concat(head: PreparedForecast, tail: PreparedForecast) -> PreparedForecast:
    return PreparedForecast(
        head.offsets + tail.offsets,
        head.keys + tail.keys,
        head.buckets + tail.buckets,
        head.e_pred + tail.e_pred,
        head.holders + tail.holders,
        tail.dilation,
        tail.span_s,
    )
