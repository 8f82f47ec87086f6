"""The what-if controller's search: the replays of one decision, off the event loop.

``WhatIfPlan`` is everything a decision needs, read from the pool on the driver's
loop (``WhatIfController.prepare``); ``evaluate`` replays it and touches nothing
else, so a server runs it on its decision thread; the controller then concludes
(``WhatIfController.conclude``). Pure Python.

A candidate is priced from the live state to the end of its consequences:

    live    from the pool as it is (backlogs, the running prefills' drain, the
            holders), the candidate's reshapes started now, and the forecast
            replayed ``cycles`` times over: the same load continued for the
            payback horizon. Where the candidate's last cycle is still slower than
            its steady state (the backlog its transition built has not drained),
            the horizon doubles, up to ``max_cycles``. Once drained, it is priced
            over the load's expected dwell (``dwell_cycles``): each span past
            those replayed as the last one, holding's likewise.
    steady  the candidate's workers from empty queues, one cycle (its steady state,
            and the search's bound: a candidate whose steady TTFT is no better
            than holding's live one cannot beat it).

Holding is replayed over the same horizon as each candidate, so every gain is
against holding still over the same arrivals: ``gain = (hold - J) / hold`` with
``J`` the candidate's live mean TTFT times ``1 + op_cost * operations``. Its
significance is a paired comparison: the forecast cut into ``batches`` runs of
consecutive arrivals, each run's mean TTFT under holding minus under the
candidate, ``z = mean / (sd / sqrt(batches))``.

Scale-in keeps headroom: a merge is also replayed, with holding, on the forecast's
arrivals ``headroom_rate`` times as fast (two spans from empty queues); the
guards refuse one that is slower than holding there (the next burst must fit).
And a merge is priced under a rise, with its way back (``WayBack``): the
arrivals as fast as holding's workers would be ``utilisation`` busy, the merge's
workers split back ``react_s`` into the rise (each new worker serves once its
source has drained, after the switch), for the payback horizon, against holding
at that rate; the guards refuse a merge whose loss there exceeds its gain (the costliest
replay, at up to ``rate_max`` times the arrivals: run last, only for a merge that
neither the headroom nor the longer sample below refuses).

A candidate that beats holding is checked against the longer sample of the load
(``long_forecast``: every arrival since the last rate change, at most the
controller's ``steady_horizon_s``, its offsets scaled to the forecast's rate):
its steady state there (from empty queues, times its operations' cost) against
holding's; the guards refuse one that does not beat holding there.

Near saturation (holding's predicted busy fraction at least
``overload_utilisation``) a move is staged: only candidates of at most
``saturated_moves`` operations are priced, and the next stage is a decision of
its own, priced from the state the first one left. There no merge is priced:
one worker of degree 2C serves fewer tokens a second than the two of degree C it
replaces (context parallelism's efficiency is below one), so a merge lowers the
throughput the pool lacks. Under a backlog that grows without end in the replay
its mean TTFT can still look better (the long prompts kept out of the short
ones' queues), but that is a difference between two overloads within the
model's error, and once the load eases the merged pool drains last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vertumnus.policy.control.candidates import Candidate
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay import Replay, ReplayModel
from vertumnus.policy.control.replay_types import (
    PreparedForecast,
    ReplayMoves,
    ReplayResult,
    ReplayWorker,
)

# (audit id, the actual arrivals in the move's world, the same in holding's world)
MoveAuditInput = tuple[int, PreparedForecast, PreparedForecast, Candidate, Candidate]


@dataclass(frozen=True)
class WayBack:
    """A merge priced under a rise: the arrivals as fast as holding's workers
    would be ``utilisation`` busy (at most ``rate_max`` times the forecast's), the
    merge's workers split back ``react_s`` into it (each after its drain and
    ``switch_s``), against holding at that rate."""

    utilisation: float
    rate_max: float
    react_s: float
    switch_s: float


@dataclass(frozen=True)
class WhatIfPlan:
    now: float
    model: ReplayModel
    forecast: PreparedForecast
    candidates: tuple[Candidate, ...]
    audits: tuple[tuple[int, PreparedForecast, tuple[ReplayWorker, ...], float], ...]
    forecast_requests: int
    rate_changed: bool
    op_cost: float
    warming: bool = False  # the cold-cache warm-up: replayed with a warm cache
    cycles: int = 4  # the payback horizon, in forecast spans
    max_cycles: int = 16  # ... extended to at most this while a backlog drains
    batches: int = 8
    overload_utilisation: float = 0.9
    saturated_moves: int = 2
    move_audits: tuple[MoveAuditInput, ...] = field(default=())
    headroom_rate: float = 2.0
    # the headroom check refuses only a merge overloaded at the burst rate (else any
    # merge slower than holding there)
    headroom_overload: bool = True
    way_back: WayBack | None = None
    # the arrivals since the last rate change (at most steady_horizon_s), at the
    # forecast's rate: the steady check's load (None: no check)
    long_forecast: PreparedForecast | None = None
    # the first cycles of a live replay that a move's audit watches (its transition)
    audit_cycles: int = 1
    # per candidate: it moves the pool towards the composition it started in
    homeward: tuple[bool, ...] = ()
    # the load's expected dwell, in forecast spans: a candidate whose backlog has
    # drained is priced, with holding, over this many (0: the replayed ones only)
    dwell_cycles: int = 0


@dataclass(frozen=True)
class Evaluation:
    # per candidate; None where the search did not need that replay
    next: tuple[ReplayResult | None, ...]  # live, over the candidate's horizon
    steady: tuple[ReplayResult | None, ...]
    scores: tuple[float | None, ...]  # J, times the operations' cost
    audits: tuple[tuple[int, float, float], ...]  # (period, predicted, measured)
    # per candidate: holding's live mean TTFT over the same horizon, and the gain's z
    hold_scores: tuple[float | None, ...] = ()
    z: tuple[float | None, ...] = ()
    busy_fraction: float = 0.0  # holding's, predicted
    # (audit id, the move replayed on the actual arrivals, holding replayed on them)
    move_audits: tuple[tuple[int, float, float], ...] = ()
    # per merge candidate: its steady mean TTFT, holding's, and its busy fraction, at
    # headroom_rate times the rate (None: not a merge, or not priced)
    headroom: tuple[tuple[float, float, float] | None, ...] = ()
    # per merge candidate: its mean TTFT under the rise with the way back, holding's
    # (None: not a merge, or one already refused by the headroom or the longer sample)
    way_back: tuple[tuple[float, float] | None, ...] = ()
    # per candidate that beats holding: its steady mean TTFT on the long forecast,
    # and holding's (None: no long forecast, or not priced)
    steady_long: tuple[tuple[float, float] | None, ...] = ()


def evaluate(plan: WhatIfPlan) -> Evaluation:
    """The replays: a pure function of the plan (safe off the event loop).

    Holding first. Then each kind of move (direction and level) by growing k:
    ``steady`` first, and ``live`` only for a candidate that could still win; the
    search along a kind stops once its steady score stops improving with k, or at
    ``saturated_moves`` operations near saturation."""
    model, forecast = plan.model, plan.forecast
    n = len(plan.candidates)
    lives: list[ReplayResult | None] = [None] * n
    steadies: list[ReplayResult | None] = [None] * n
    scores: list[float | None] = [None] * n
    holds: list[float | None] = [None] * n
    zs: list[float | None] = [None] * n
    move_audits = tuple(_move_audit(plan, entry) for entry in plan.move_audits)
    if not forecast.offsets or not plan.candidates[0].steady_workers:
        # Nothing to replay: no arrivals, or no worker serves (every one failed or
        # draining): the decision holds.
        return Evaluation(tuple(lives), tuple(steadies), tuple(scores), (), tuple(holds),
                          tuple(zs), 0.0, move_audits)  # fmt: skip
    op_cost = plan.op_cost
    heads = [_head(model, cand.requeued, forecast.dilation) for cand in plan.candidates]

    replays: dict[int, Replay] = {}

    def live(k: int, cycles: int) -> ReplayResult:
        """Candidate k's live replay over ``cycles``: a longer horizon replays only
        the cycles it adds."""
        if k not in replays:
            cand = plan.candidates[k]
            moves = ReplayMoves(cand.remap, cand.lost, heads[k])
            replays[k] = Replay(model, forecast, cand.next_workers, moves, plan.batches)
        return replays[k].extend(cycles)

    holding = plan.candidates[0]
    steady_hold = model.run(forecast, holding.steady_workers, holding.remap)
    hold_by_cycles = {plan.cycles: live(0, plan.cycles)}
    lives[0], steadies[0] = hold_by_cycles[plan.cycles], steady_hold
    hold = hold_by_cycles[plan.cycles].mean_ttft_s
    scores[0] = holds[0] = hold
    busy = _busy(steady_hold, holding.steady_workers, 0.0)
    saturated = busy >= plan.overload_utilisation
    most_ops = plan.saturated_moves if saturated else None
    groups: dict[tuple[str, int], list[int]] = {}
    for k, cand in enumerate(plan.candidates[1:], start=1):
        groups.setdefault((cand.kind, cand.level), []).append(k)
    for members in groups.values():
        previous = math.inf
        for k in members:
            cand = plan.candidates[k]
            if most_ops is not None and len(cand.ops) > most_ops:
                break  # staged: the next operations are later decisions
            if saturated and cand.kind == "merge":
                break  # no throughput to spare: a merge only lowers it (see above)
            steady = model.run(forecast, cand.steady_workers, cand.remap)
            steadies[k] = steady
            factor = 1 + op_cost * len(cand.ops)
            bound = steady.mean_ttft_s * factor
            if bound > previous:
                break  # more of this move only gets worse
            previous = bound
            if bound >= hold:
                continue  # cannot beat holding
            cycles = plan.cycles
            result = live(k, cycles)
            # Until the backlog the transition built has drained: the last cycle
            # back within 5 % of the candidate's steady state.
            while cycles < plan.max_cycles and result.cycle_ttft_s[-1] > 1.05 * steady.mean_ttft_s:
                cycles = min(plan.max_cycles, 2 * cycles)
                result = live(k, cycles)
            if cycles not in hold_by_cycles:
                hold_by_cycles[cycles] = live(0, cycles)
            against = hold_by_cycles[cycles]
            if (
                plan.dwell_cycles > cycles
                and _busy(steady, cand.steady_workers, math.inf) < plan.overload_utilisation
                and result.cycle_ttft_s[-1] <= 1.05 * steady.mean_ttft_s
            ):
                # drained, to a steady state it keeps (not overloaded): over the
                # load's expected dwell, each cycle past the replayed ones as the
                # last (holding's too: a backlog it still builds is counted no
                # further, in holding's favour)
                result, against = (
                    dwelt(result, plan.dwell_cycles),
                    dwelt(against, plan.dwell_cycles),
                )
            lives[k] = result
            scores[k] = result.mean_ttft_s * factor
            holds[k] = against.mean_ttft_s
            zs[k] = _z(against.batch_ttft_s, result.batch_ttft_s, factor)
    audits = tuple(
        (index, model.run(replayed, workers).mean_ttft_s, measured)
        for index, replayed, workers, measured in plan.audits
    )
    headroom: list[tuple[float, float, float] | None] = [None] * n
    # (only a merge faster than holding can be chosen: the others need no stress test)
    merges = [
        k
        for k, (c, score, held) in enumerate(zip(plan.candidates, scores, holds, strict=True))
        if c.kind == "merge" and score and held is not None and score < held
    ]
    if merges and plan.headroom_rate > 1:
        # The forecast's arrivals headroom_rate times as fast, two spans from empty.
        quick = faster(forecast, plan.headroom_rate)
        held = model.run(quick, holding.steady_workers, holding.remap, cycles=2).mean_ttft_s
        for k in merges:
            cand = plan.candidates[k]
            stressed = model.run(quick, cand.steady_workers, cand.remap, cycles=2)
            headroom[k] = (stressed.mean_ttft_s, held, _busy(stressed, cand.steady_workers))
    steady_long: list[tuple[float, float] | None] = [None] * n
    winners = [
        k
        for k, (score, held) in enumerate(zip(scores, holds, strict=True))
        if k and score is not None and held is not None and score < held
    ]
    if plan.long_forecast is not None and winners:
        long = plan.long_forecast
        held = model.run(long, holding.steady_workers, holding.remap).mean_ttft_s
        for k in winners:
            cand = plan.candidates[k]
            mine = model.run(long, cand.steady_workers, cand.remap).mean_ttft_s
            steady_long[k] = (mine * (1 + op_cost * len(cand.ops)), held)
    # The way back only for a merge nothing cheaper refused (the headroom, the
    # longer sample): the guards would not read it.
    exposed = [
        k
        for k in merges
        if not burst_refuses(plan, headroom[k]) and not longer_refuses(steady_long[k])
    ]
    backs = _way_back(plan, exposed, busy)
    return Evaluation(tuple(lives), tuple(steadies), tuple(scores), audits, tuple(holds),
                      tuple(zs), busy, move_audits, tuple(headroom), backs,
                      tuple(steady_long))  # fmt: skip


def _busy(result: ReplayResult, workers: Sequence[ReplayWorker], empty: float = math.inf) -> float:
    """The busy fraction of ``workers`` in a replay's first cycle (``empty`` where
    they or the cycle are none)."""
    width = len(workers) * result.span_s
    return result.busy_s / width if width else empty


def dwelt(result: ReplayResult, cycles: int) -> ReplayResult:
    """``result`` over ``cycles`` forecast spans, each one past those replayed as
    the last one replayed (its mean TTFT, its requests, each batch's mean)."""
    replayed = len(result.cycle_ttft_s)
    extra = cycles - replayed
    if extra <= 0 or not result.last_requests:
        return result
    last, n = result.cycle_ttft_s[-1], result.last_requests
    requests = result.requests + extra * n
    batches = tuple(
        (b * replayed + extra * lb) / cycles
        for b, lb in zip(result.batch_ttft_s, result.last_batch_ttft_s, strict=True)
    )
    return replace(
        result,
        mean_ttft_s=(result.mean_ttft_s * result.requests + extra * last * n) / requests,
        requests=requests,
        cycle_ttft_s=result.cycle_ttft_s + (last,) * extra,
        backlog_s=result.backlog_s + result.backlog_s[-1:] * extra,
        batch_ttft_s=batches,
    )


def burst_refuses(plan: WhatIfPlan, stressed: tuple[float, float, float] | None) -> bool:
    """A merge slower than holding with the arrivals ``headroom_rate`` times as fast
    (``Evaluation.headroom``) and, with ``headroom_overload``, overloaded there (busy
    ``overload_utilisation`` or more): no headroom for a burst. A merge slower there
    but able to absorb it keeps its headroom; its present gain decides."""
    if stressed is None or stressed[0] <= stressed[1]:
        return False
    return not plan.headroom_overload or stressed[2] >= plan.overload_utilisation


def longer_refuses(steady: tuple[float, float] | None) -> bool:
    """A candidate no faster than holding in the steady state on the longer sample
    of the load (``Evaluation.steady_long``)."""
    return steady is not None and steady[0] >= steady[1]


def _way_back(
    plan: WhatIfPlan, merges: Sequence[int], busy: float
) -> tuple[tuple[float, float] | None, ...]:
    """Each merge under a rise, with the reshape back (``WayBack``)."""
    out: list[tuple[float, float] | None] = [None] * len(plan.candidates)
    back = plan.way_back
    if back is None or not merges or busy <= 0:
        return tuple(out)
    rate = min(back.rate_max, back.utilisation / busy)
    if rate <= 1:
        return tuple(out)
    model, forecast, holding = plan.model, plan.forecast, plan.candidates[0]
    quick = faster(forecast, rate)
    cycles = max(2, math.ceil(plan.cycles * rate))  # the payback horizon
    held = model.run(quick, holding.steady_workers, holding.remap, cycles=cycles).mean_ttft_s
    degree = {w.worker_id: w.cp_degree for w in holding.steady_workers}
    for k in merges:
        cand = plan.candidates[k]
        retire = [
            (back.react_s, made[0],
             tuple(ReplayWorker(s, degree[s], back.switch_s) for s in op.sources))
            for op, made in zip(cand.ops, cand.made, strict=True)
            if len(made) == 1 and all(s in degree for s in op.sources)
        ]  # fmt: skip
        run = model.run(quick, cand.steady_workers, cand.remap, cycles=cycles, retire=retire)
        out[k] = (run.mean_ttft_s, held)
    return tuple(out)


def faster(forecast: PreparedForecast, rate: float) -> PreparedForecast:
    """The forecast's arrivals ``rate`` times as fast (the same requests)."""
    f = 1.0 / rate
    return replace(forecast, offsets=tuple(o * f for o in forecast.offsets),
                   span_s=forecast.span_s * f)  # fmt: skip


def _head(
    model: ReplayModel, requeued: Sequence[ArrivalSample], dilation: float
) -> PreparedForecast | None:
    """A reshape's requeued requests, placed again at t = 0."""
    if not requeued:
        return None
    at_zero = [
        ArrivalSample(s.request_id, 0.0, s.input_tokens, s.holders, s.prefix_key, s.floor_tokens)
        for s in requeued
    ]
    return model.prepare(at_zero, 0.0, dilation)


def _z(hold: Sequence[float], cand: Sequence[float], factor: float) -> float:
    """The paired gain's significance over the batches (inf: every batch gains alike)."""
    diffs = [h - c * factor for h, c in zip(hold, cand, strict=True)]
    b = len(diffs)
    if b < 2:
        return 0.0
    mean = sum(diffs) / b
    var = sum((d - mean) ** 2 for d in diffs) / (b - 1)
    if var <= 0:
        return math.inf if mean > 0 else (0.0 if mean == 0 else -math.inf)
    return mean / math.sqrt(var / b)


def _move_audit(plan: WhatIfPlan, entry: MoveAuditInput) -> tuple[int, float, float]:
    """A move replayed on the arrivals that came, and holding (the counterfactual)
    replayed on them from the same state."""
    audit_id, moved, held, chosen, holding = entry
    model = plan.model
    head = _head(model, chosen.requeued, moved.dilation)
    move_s = model.run(moved, chosen.next_workers, chosen.remap, chosen.lost, head).mean_ttft_s
    hold_s = model.run(held, holding.next_workers, holding.remap, holding.lost).mean_ttft_s
    return audit_id, move_s, hold_s
