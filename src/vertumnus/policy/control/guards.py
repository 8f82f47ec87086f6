"""The what-if controller's guards: the pessimistic gains, the streak of evidence
that confirms a move, and the rows a decision reports (docs/scheduling.md, "The
what-if controller").

    gain_k = (hold_k - J_k * (1 + pessimism(kind_k) * share_k)) / hold_k

with ``hold_k`` holding's live mean TTFT over candidate k's horizon, ``J_k`` its
score (``search``) and ``share_k`` the part of it that the audited error
prices (``priced_share``: a split's transition, a merge's whole horizon); 0 for a
merge overloaded and slower than holding at ``headroom_rate`` times the forecast's
rate (``headroom_overload = false``: any slower one); for a
candidate no faster than holding in the steady state on the longer sample of the
load, unless it is a split back towards the start; and for a merge that a rise
would cost more than it gains (its way back: ``risen - held > gain_k * held``),
unless it takes the pool back towards its start.
The streak is the run of consecutive decisions whose best is the same kind of
move (direction and level); it confirms a move at two decisions whose gain clears
the margin at a significance of at least ``z_confirm`` each, or at
``confirm_limit`` decisions whose mean gain clears it. ``hold_rule`` says why the
best candidate waits, if it does. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vertumnus.policy.control.search import (
    Evaluation,
    WhatIfPlan,
    burst_refuses,
    longer_refuses,
)


def pessimistic_gains(
    plan: WhatIfPlan, evaluation: Evaluation, pessimism: Callable[[str], float]
) -> list[float]:
    """Per candidate (0 for holding and for those not priced)."""
    gains = [0.0] * len(plan.candidates)
    for k, (cand, score, hold) in enumerate(
        zip(plan.candidates, evaluation.scores, evaluation.hold_scores, strict=False)
    ):
        if k == 0 or score is None or hold is None or not 0 < hold < math.inf:
            continue
        stressed = evaluation.headroom[k] if k < len(evaluation.headroom) else None
        if burst_refuses(plan, stressed):
            continue  # a merge without the headroom for a burst: refused
        # (a move back towards the start is judged against holding the start: a
        # merge's way back does not refuse it, its exposure to a rise being holding
        # the start's; nor does the longer sample refuse a split back, which
        # restores throughput the operator provisioned, while a merge back, which
        # lowers it, must show its gain there too)
        home = k < len(plan.homeward) and plan.homeward[k]
        steady = evaluation.steady_long[k] if k < len(evaluation.steady_long) else None
        if longer_refuses(steady) and not (home and cand.kind == "split"):
            continue  # no better on the longer sample of the load: refused
        priced = score * (1.0 + pessimism(cand.kind) * priced_share(plan, evaluation, k))
        gain = (hold - priced) / hold
        risen = evaluation.way_back[k] if k < len(evaluation.way_back) else None
        if risen is not None and risen[0] - risen[1] > gain * risen[1] and not home:
            continue  # a rise would cost more than the merge gains: refused
        gains[k] = gain
    return gains


def priced_share(plan: WhatIfPlan, evaluation: Evaluation, k: int) -> float:
    """The share of candidate k's score that its audited error prices. The error is
    the transition's (what an audit watches: the first ``audit_cycles`` of the live
    replay), so a split pays it on that share only, the rest as replayed (the
    steady check has the rest). A merge's risk lasts as long as it stands (a rise
    may come at any time): its whole score is priced."""
    cand = plan.candidates[k]
    live = evaluation.next[k] if k < len(evaluation.next) else None
    if cand.kind != "split" or live is None or not sum(live.cycle_ttft_s):
        return 1.0
    cycles = live.cycle_ttft_s
    return sum(cycles[: plan.audit_cycles]) / sum(cycles)


@dataclass
class Streak:
    z_confirm: float
    confirm_limit: int
    key: tuple[str, int] | None = None
    entries: list[tuple[float, float]] = field(default_factory=list)  # (gain, z)

    def reset(self) -> None:
        self.key, self.entries = None, []

    def add(self, key: tuple[str, int], gain: float, z: float) -> None:
        if key != self.key:
            self.key, self.entries = key, []
        self.entries = [*self.entries, (gain, z)][-self.confirm_limit :]

    def confirmed(self, margin: float) -> bool:
        e = self.entries
        last = e[-2:]
        if len(last) == 2 and all(g >= margin and z >= self.z_confirm for g, z in last):
            return True
        n = self.confirm_limit
        return len(e) >= n and sum(g for g, _ in e[-n:]) / n >= margin


def hold_rule(
    plan: WhatIfPlan, best: int, gain: float, margin: float, urgent: bool,
    overloaded: bool, in_flight: bool, watching: bool, confirmed: bool,
) -> str | None:  # fmt: skip
    """Why the best candidate (``best``, of pessimistic ``gain``) waits, or None: it
    acts. ``urgent``: its gain and significance act at once; ``overloaded``: the
    pool is, or the gain is urgent_gain or more; ``in_flight``: reshapes are under
    way; ``watching``: the last move's audit has not seen its span; ``confirmed``:
    the streak confirms it."""
    if plan.forecast_requests == 0 or best == 0 or gain < margin:
        return "hold"  # (no harm: the present pessimistic gain must clear the margin)
    if plan.warming and not (urgent and overloaded):
        # (overload as the warm cache will have it: a cold one alone looks like it)
        return "hold:warm-up"
    if in_flight and not urgent:
        return "hold:reshapes-in-flight"
    if watching and not urgent:
        return "hold:auditing"  # (the next move once the last one's span has been seen)
    if not urgent and not confirmed:
        return "hold:confirming"
    return None


def homeward(start: Mapping[int, int], now: Mapping[int, int], then: Mapping[int, int]) -> bool:
    """Composition ``then`` lies between ``now`` and ``start``, nearer ``start``: each
    degree's worker count between its count now and at the start, one of them
    nearer the start (a move towards the start, never past it)."""
    nearer = False
    for c in set(start) | set(now) | set(then):
        a, b, x = now.get(c, 0), start.get(c, 0), then.get(c, 0)
        if not min(a, b) <= x <= max(a, b):
            return False
        nearer = nearer or abs(x - b) < abs(a - b)
    return nearer


def candidate_rows(
    plan: WhatIfPlan, evaluation: Evaluation, gains: list[float]
) -> list[dict[str, Any]]:
    """The priced candidates, as a decision lists them (one not replayed, past
    where its kind stopped improving, is left out)."""
    holds = evaluation.hold_scores or (None,) * len(plan.candidates)
    rows = []
    for k, (c, live, steady, score, hold) in enumerate(
        zip(plan.candidates, evaluation.next, evaluation.steady, evaluation.scores, holds,
            strict=True)
    ):  # fmt: skip
        if steady is None:
            continue
        cycles = live.cycle_ttft_s if live is not None else ()
        rows.append(
            {
                "composition": c.name,
                "move": c.kind if not c.ops else f"{len(c.ops)} {c.kind}",
                "level": c.level,
                "next_s": cycles[0] if cycles else None,  # the first span
                "live_s": None if live is None else live.mean_ttft_s,  # the horizon
                "horizon_cycles": len(cycles) if cycles else None,
                "hold_s": hold,  # holding, over the same horizon
                "steady_s": steady.mean_ttft_s,
                "score_s": score,
                "gain": gains[k] if k else None,
                # the share of score_s its kind's audited error prices
                "priced_share": priced_share(plan, evaluation, k) if k else None,
                "z": _finite(evaluation.z[k]) if k and k < len(evaluation.z) else None,
                # a merge's and holding's steady mean at headroom_rate times the rate
                "headroom_s": evaluation.headroom[k] if k < len(evaluation.headroom) else None,
                # a merge's and holding's mean under a rise, with the way back
                "way_back_s": evaluation.way_back[k] if k < len(evaluation.way_back) else None,
                # its steady mean and holding's on the long forecast
                "steady_long_s": (
                    evaluation.steady_long[k] if k < len(evaluation.steady_long) else None
                ),
            }
        )
    return rows


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
