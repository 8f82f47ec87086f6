"""The what-if controller (``policy/control/whatif.py``) through the policy stack: its rules
(hold, urgent, confirming, warm-up, reshapes in flight), the three-step decision and
its purity, the audit; and its candidates and start choice
(``policy/control/candidates.py``).

A small driver serves every placement FIFO for exactly its predicted time, so the
pool does what the replay predicts. Requests carry no blocks (no cache reuse). With

    E_1(L) = 0.01 + L / 1000 s        E_2(L) = 0.03 + L / 2000 s

short requests (under 40 tokens) are faster at degree 1: 16 tokens take 26 ms there
and 38 ms at degree 2, so a pool of degree-2 workers flooded with them gains by
splitting."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.factories import BLOCK_SIZE, make_profile
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.control.candidates import (
    Candidate,
    PoolInputs,
    best_start,
    candidates,
    ladder,
)
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.control.decision import Decision
from vertumnus.policy.control.forecast import ArrivalSample, Forecast, ForecastConfig
from vertumnus.policy.control.replay import ReplayModel
from vertumnus.policy.control.replay_types import ReplayResult
from vertumnus.policy.control.search import WhatIfPlan, burst_refuses, dwelt, evaluate
from vertumnus.policy.control.whatif import WhatIfController
from vertumnus.policy.costs import CostWeights, reuse_curves
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec
from vertumnus.policy.pool_policy import PoolPolicy

COEFFS = {1: DegreeCoeffs(d=0.01, c=1e-3), 2: DegreeCoeffs(d=0.03, c=1e-3)}
CURVES = reuse_curves(COEFFS)
E1_SHORT, E2_SHORT = CURVES[1].time_s(16, 0), CURVES[2].time_s(16, 0)


def make_policy(
    layout: tuple[int, ...] = (2, 2),
    adaptive: bool = True,
    max_tokens_per_rank: int | None = None,
    **controller: Any,
) -> PoolPolicy:
    # (on this 1-s clock no dwell: the default 300 s would price a drained move over
    # 300 spans; the dwell's own tests set it)
    settings_: dict[str, Any] = dict(
        mode="whatif", decision_s=1.0, horizon_s=1.0, min_requests=10, dwell_prior_s=0.0
    )
    settings_.update(controller)
    pool = PoolSpec(LatticeConfig(sum(layout), (1, 2)), layout, BLOCK_SIZE, 64)
    config = PolicyConfig(
        adaptive=adaptive,
        max_tokens_per_rank=max_tokens_per_rank,
        controller=ControllerConfig(**settings_),
    )
    return PoolPolicy.build(make_profile(COEFFS), pool, config)


class Driver:
    """Runs each worker's queue FIFO, each prefill for exactly its predicted time;
    reshapes begin (their sources drain) but never switch: no acknowledgements."""

    def __init__(self, policy: PoolPolicy) -> None:
        self.policy = policy
        self.ends: dict[int, float] = {}  # worker -> end of its running prefill
        self.next_id = 0

    def until(self, now: float) -> None:
        while True:
            due = [(end, w) for w, end in self.ends.items() if end <= now]
            if not due:
                return
            end, w = min(due)
            del self.ends[w]
            self.policy.finish(w, end)
            self.start(w, end)

    def start(self, worker: int, now: float) -> None:
        if worker not in self.ends:
            started = self.policy.start(worker, now)
            if started is not None:
                self.ends[worker] = now + started.exec_s

    def arrive(self, tokens: int, now: float) -> None:
        self.until(now)
        actions = self.policy.arrive(PlacementRequest(self.next_id, tokens), now)
        self.next_id += 1
        for placed in actions.placed:
            self.start(placed.worker_id, now)

    def steady(self, start_s: float, rate: float, tokens: int = 16) -> None:
        """One second of evenly spaced arrivals."""
        for k in range(round(rate)):
            self.arrive(tokens, start_s + k / rate)

    def decide(self, now: float, three_step: bool = False) -> Decision:
        self.until(now)
        policy = self.policy
        if three_step:
            plan = policy.prepare_window(now)
            outcome = policy.finish_window(plan, plan.evaluate(), now)
        else:
            outcome = policy.end_window(now)
        for placed in outcome.actions.placed:
            self.start(placed.worker_id, now)
        return outcome.decision


def run_periods(policy: PoolPolicy, rates: list[float], three_step: bool = False) -> list[str]:
    driver = Driver(policy)
    rules = []
    for k, rate in enumerate(rates):
        driver.steady(float(k), rate)
        rules.append(driver.decide(k + 1.0, three_step).rule)
    return rules


# -- the rules ------------------------------------------------------------------------------


def test_nothing_arrived_holds() -> None:
    policy = make_policy()
    decision = policy.end_window(1.0).decision
    assert (decision.rule, decision.ops) == ("hold", ())
    assert decision.inputs["forecast_requests"] == 0 and decision.inputs["gain"] == 0.0
    assert decision.inputs["chosen"] == "2CP2" and decision.inputs["urgent"] is False
    assert policy.lattice.composition() == {2: 2} and policy.controller.in_flight == []
    assert [d.rule for d in policy.controller.history] == ["hold"]


def test_an_overload_of_short_requests_splits_at_once() -> None:
    # 150 short requests a second on four degree-2 workers: 150 * 38 ms = 5.7 s of
    # work a second for 4 workers, a busy fraction of 1.425.
    policy = make_policy(layout=(2, 2, 2, 2), saturated_moves=1)
    driver = Driver(policy)
    driver.steady(0.0, 150)
    driver.until(1.0)
    loads = policy.scheduler.loads(1.0)
    decision = driver.decide(1.0)
    inputs = decision.inputs
    assert decision.rule == "split:urgent"
    assert inputs["urgent"] is True and inputs["rate_changed"] is False
    assert inputs["busy_fraction"] == pytest.approx(150 * E2_SHORT / 4, rel=1e-9)
    assert inputs["band"] == "saturated"
    assert inputs["margin"] == 0.015  # nothing audited yet
    cands = inputs["candidates"]
    # Near saturation a move is staged: one split is priced (and taken) at a time
    # (saturated_moves = 1 here).
    assert [(c["composition"], c["move"], c["level"]) for c in cands] == [
        ("4CP2", "hold", 0),
        ("2CP1/3CP2", "1 split", 2),
    ]
    hold, split = cands
    # Priced over the payback horizon (120 s of 1-s forecast spans), holding over the
    # same one; the move at its live mean times its one operation's cost.
    assert hold["horizon_cycles"] == split["horizon_cycles"] == 120
    assert split["hold_s"] == hold["live_s"] == hold["score_s"]
    assert split["score_s"] == pytest.approx(split["live_s"] * 1.005, rel=1e-12)
    # The gain is pessimistic: the move at J * (1 + the prior of its audited error in
    # the saturated band, 20 %, times the transition's share of J: the audit span of
    # horizon_s, 1 s, is the first of its 120 cycles).
    share = split["priced_share"]
    assert 1 / 120 < share < 1
    assert inputs["gain"] == pytest.approx(
        (hold["live_s"] - split["score_s"] * (1 + 0.20 * share)) / hold["live_s"], rel=1e-12
    )
    # The first span alone is slower (the transition), the horizon much faster.
    assert split["next_s"] > hold["next_s"] and inputs["gain"] > 0.9
    assert inputs["z"] >= 3.0
    # The split goes to the worker that drains first (least outstanding work).
    least = sorted(loads, key=lambda w: (loads[w], w))[:1]
    assert [op.sources for op in decision.ops] == [(w,) for w in least]
    assert all(op.kind == "split" and op.target_degree == 1 for op in decision.ops)
    assert policy.controller.in_flight == list(decision.ops)
    assert all(policy.lattice.workers[w].state is not WorkerState.ACTIVE for w in least)


def test_near_saturation_at_most_saturated_moves_operations_are_priced() -> None:
    # The same overload with the default stage of two operations: hold, one split
    # and two splits are priced; both splits gain, and the pair is taken at once.
    policy = make_policy(layout=(2, 2, 2, 2))
    assert policy.config.controller.saturated_moves == 2
    driver = Driver(policy)
    driver.steady(0.0, 150)
    driver.until(1.0)
    decision = driver.decide(1.0)
    cands = decision.inputs["candidates"]
    assert [(c["composition"], c["move"]) for c in cands] == [
        ("4CP2", "hold"),
        ("2CP1/3CP2", "1 split"),
        ("4CP1/2CP2", "2 split"),
    ]
    assert decision.rule == "split:urgent" and len(decision.ops) == 2
    assert decision.inputs["chosen"] == "4CP1/2CP2"


def test_no_merge_is_priced_while_holding_is_saturated() -> None:
    # 30 a second on four degree-1 workers, every sixth request 1,500 tokens (E_1 =
    # 1.51 s, E_2 = 0.78 s: two degree-1 workers serve 1.32 of them a second, one
    # degree-2 worker 1.28), the rest 16 tokens: holding is twice over its capacity.
    # Replayed with the backlog growing for the whole horizon, merging two workers
    # looks faster (the long requests on the degree-2 worker, out of the short
    # ones' queues: the merge urgent at once, as the controller did before), yet
    # the merged pool serves fewer tokens a second and drains last once the load
    # eases. Saturated, no merge is priced: it holds.
    policy = make_policy(layout=(1, 1, 1, 1))
    driver = Driver(policy)
    for k in range(30):
        driver.arrive(1500 if k % 6 == 0 else 16, k / 30)
    driver.until(1.0)
    prepared = policy.prepare_window(1.0)
    evaluation = prepared.evaluate()
    plan = prepared.plan  # type: ignore[attr-defined]
    assert evaluation.busy_fraction > 2.0 >= plan.overload_utilisation
    merge = next(k for k, c in enumerate(plan.candidates) if c.kind == "merge")
    assert plan.candidates[merge].name == "2CP1/1CP2"
    assert evaluation.steady[merge] is None and evaluation.scores[merge] is None
    # (what the replay says of it, saturation not counted: the merge would win)
    unguarded = evaluate(replace(plan, overload_utilisation=math.inf))
    assert unguarded.scores[merge] < 0.8 * unguarded.hold_scores[merge]
    decision = policy.finish_window(prepared, evaluation, 1.0).decision
    assert decision.rule == "hold" and decision.ops == ()
    assert [c["move"] for c in decision.inputs["candidates"]] == ["hold"]


def test_a_significant_gain_where_the_load_did_not_move_acts_on_its_second_decision() -> None:
    # z_urgent out of reach: the overload's split is not taken at once; it is the
    # best, significant (z >= z_confirm), two decisions in a row.
    policy = make_policy(layout=(2, 2, 2, 2), z_urgent=1e9)
    rules = run_periods(policy, [150, 150])
    assert rules == ["hold:confirming", "split:whatif"]
    history = policy.controller.history
    assert [len(d.ops) for d in history] == [0, 2]  # (a stage: two splits)
    assert all(d.inputs["z"] >= 2.0 and d.inputs["urgent"] is False for d in history)
    assert [d.inputs["streak"] for d in history] == [1, 2]


def test_a_gain_of_little_significance_must_win_confirm_limit_decisions() -> None:
    policy = make_policy(layout=(2, 2, 2, 2), z_urgent=1e9, z_confirm=1e9)
    rules = run_periods(policy, [150, 150, 150])
    assert rules == ["hold:confirming"] * 2 + ["split:whatif"]


def test_a_gain_under_urgent_gain_without_overload_is_confirmed() -> None:
    # 30 requests a second on two degree-2 workers: busy 0.57. A split gains about
    # 29 % (E_1 / E_2 over the horizon, less its transition, op_cost and the prior
    # pessimism), yet the load did not move and the gain is under urgent_gain (set
    # to 30 % here): it must win twice.
    policy = make_policy(urgent_gain=0.3)
    rules = run_periods(policy, [30, 30])
    assert rules == ["hold:confirming", "split:whatif"]
    first = policy.controller.history[0].inputs
    assert first["busy_fraction"] == pytest.approx(30 * E2_SHORT / 2, rel=1e-9)
    hold, split = first["candidates"]
    assert hold["live_s"] == pytest.approx(E2_SHORT, rel=1e-9)  # no queue
    # (the light band's prior error, 2 %, on the transition's share of the score: the
    # first of the horizon's 120 one-second cycles, the transition's, slower than the
    # rest)
    share = split["priced_share"]
    assert 1 / 120 < share < 0.05
    assert first["gain"] == pytest.approx(
        (E2_SHORT - split["live_s"] * 1.005 * (1 + 0.02 * share)) / E2_SHORT, rel=1e-9
    )
    assert E1_SHORT < split["live_s"] < 1.05 * E1_SHORT  # the transition, amortised
    assert first["urgent"] is False and first["band"] == "light"


@pytest.mark.parametrize(("settings_", "rules"), [
    ({}, ["split:urgent", "hold"]),  # the default, 20 %: 29 % at z >= z_urgent acts
    ({"urgent_gain": 0.0}, ["hold:confirming", "split:whatif"]),  # off: confirmed
])  # fmt: skip
def test_a_gain_over_urgent_gain_acts_at_once_at_any_load(
    settings_: dict[str, float], rules: list[str]
) -> None:
    # The pool of the test above: busy 0.57, the load steady, the split's
    # pessimistic gain 29 %, z far over z_urgent.
    policy = make_policy(**settings_)
    assert run_periods(policy, [30, 30]) == rules
    first = policy.controller.history[0].inputs
    assert first["busy_fraction"] < 0.9 and first["rate_changed"] is False
    assert 0.2 < first["gain"] < 0.3 and first["z"] >= 3.0
    assert first["urgent"] is (not settings_)


def test_urgent_gain_must_lie_in_0_1() -> None:
    with pytest.raises(ValueError, match="urgent_gain"):
        ControllerConfig(urgent_gain=1.0)


def homed(
    start: dict[int, int] | None, layout: tuple[int, ...], **controller: Any
) -> tuple[PoolPolicy, Driver]:
    """A policy and its driver; ``start``: the composition the pool is made to look
    as if it had started in (None: ``layout``)."""
    policy = make_policy(layout=layout, **controller)
    if start is not None:
        assert isinstance(policy.controller, WhatIfController)
        policy.controller.start = start
    return policy, Driver(policy)


def test_the_replay_times_are_kept_while_the_forecast_keeps_the_request() -> None:
    # 200 s of 5 requests a second, a decision every 10 s, the long window 100 s:
    # the times the replays computed follow the forecast out (no rebuild needed).
    policy, driver = homed(None, (1, 1), steady_horizon_s=100.0)
    for k in range(200):
        driver.steady(float(k), 5.0, 100)
        if k % 10 == 9:
            driver.decide(k + 1.0)
    ctl = policy.controller
    assert isinstance(ctl, WhatIfController)
    kept = set(ctl.forecast.by_id)
    assert min(kept) >= 5 * 95 and ctl.observations.times and set(ctl.observations.times) <= kept


def test_the_times_of_the_arrivals_a_decision_will_replay_are_computed_as_they_come() -> None:
    # The last decision thinned its forecast to 1 / dilation: each later arrival whose
    # draw is under that has its replay times computed when placed, the values the
    # next decision would compute (the others wait for it).
    policy, driver = homed(None, (1, 1), replay_requests=50)
    ctl = policy.controller
    assert isinstance(ctl, WhatIfController)
    seen = ctl.observations
    assert seen.keep_ahead == 0.0  # (before the first decision: none)
    for k in range(3):
        driver.steady(float(k), 150.0, 16)
        driver.decide(k + 1.0)
    assert 0.0 < seen.keep_ahead <= 0.5
    first = driver.next_id
    driver.steady(3.0, 150.0, 300)
    arrived = [ctl.forecast.by_id[r] for r in range(first, driver.next_id)]
    ahead = [s for s in arrived if s.draw < seen.keep_ahead]
    assert ahead and len(ahead) < len(arrived)
    model = ReplayModel(ctl.curves, policy.lattice.config.degrees, ctl.weights)
    for s in arrived:
        assert seen.times.get(s.request_id) == (model.times(s) if s in ahead else None)


def mix_changes(check: bool, start: dict[int, int] | None = None) -> PoolPolicy:
    """Two degree-2 workers: 20 s of 100-token requests, 20 a second, then 2 s of
    16-token ones (``start``: as in ``homed``). (``urgent_gain`` off: a split is
    taken on its second decision, priced twice.)"""
    policy, driver = homed(
        start, (2, 2), steady_check=check, steady_horizon_s=300.0, urgent_gain=0.0
    )
    for k in range(22):
        for j in range(20):
            driver.arrive(100 if k < 20 else 16, k + j / 20)
        driver.decide(k + 1.0)
    return policy


def test_a_gain_the_longer_sample_of_the_load_does_not_show_is_refused() -> None:
    # 20 s of 100-token requests, 20 a second (degree 2 the faster: E_1 = 110 ms,
    # E_2 = 80 ms; on 2CP2 none waits, on 2CP1/1CP2 every other one goes to a degree-1
    # worker), then 2 s of 16-token ones at the same rate (degree 1 the faster). The
    # last second alone says split (30 %); every arrival since the last rate change,
    # at today's rate, says hold: the split is refused. Without the check it splits
    # on its second decision.
    checked, unchecked = mix_changes(True), mix_changes(False)
    assert [d.rule for d in unchecked.controller.history[-2:]] == [
        "hold:confirming", "split:whatif",
    ]  # fmt: skip
    assert all(not d.ops for d in checked.controller.history)
    first = unchecked.controller.history[-2].inputs["candidates"][1]
    refused = checked.controller.history[-2].inputs["candidates"][1]
    assert refused["composition"] == first["composition"] == "2CP1/1CP2"
    assert refused["score_s"] == first["score_s"] and first["gain"] > 0.2  # priced alike
    assert refused["gain"] == 0.0 and first["steady_long_s"] is None
    mine, held = refused["steady_long_s"]
    assert mine > 1.15 * held > 0  # 400 requests of 100 tokens, 20 of 16: holding wins


def test_a_move_back_to_the_start_is_not_refused_by_the_longer_sample() -> None:
    # As above, in a pool that started at 2CP1/1CP2 and merged: the split back is
    # judged against holding that start (report seed 111: a merge at light load was
    # right, the ramp after it made the start better again, and the longer sample,
    # most of it from the lighter minutes, kept refusing the split back). It is
    # taken on its second decision, priced as the refused one.
    home, away = mix_changes(True, {1: 2, 2: 1}), mix_changes(True)
    assert [d.rule for d in home.controller.history[-2:]] == ["hold:confirming", "split:whatif"]
    assert all(not d.ops for d in away.controller.history)
    taken = home.controller.history[-2].inputs["candidates"][1]
    refused = away.controller.history[-2].inputs["candidates"][1]
    assert taken["composition"] == refused["composition"] == "2CP1/1CP2"
    assert taken["score_s"] == refused["score_s"] and taken["gain"] > 0.2
    assert taken["steady_long_s"] == refused["steady_long_s"]
    mine, held = taken["steady_long_s"]
    assert mine > 1.15 * held  # (what refuses it away from home)


def test_the_long_sample_is_every_arrival_since_the_last_rate_change() -> None:
    forecast = Forecast(ForecastConfig(10.0, 1, 20.0, recent_s=5.0, long_s=60.0))
    for t in range(100):
        forecast.record(ArrivalSample(t, float(t), 100))
    assert len(forecast.window(100.0).samples) == 10
    long = forecast.long_window(100.0)
    assert [s.request_id for s in long.samples] == list(range(40, 100))
    assert (long.start_s, long.span_s, long.rate_changed) == (40.0, 60.0, False)
    for t in range(100, 110):  # ten times the rate: the test fires, the past is cut
        for j in range(10):
            forecast.record(ArrivalSample(1000 + 10 * t + j, t + j / 10, 100))
    assert forecast.window(110.0).rate_changed
    assert forecast.long_window(110.0).start_s == 105.0  # (now - recent_s)
    assert ForecastConfig(10.0, 1, 20.0).long_s == 20.0  # never shorter than max_horizon_s
    # (the controller leaves out the cold start and the minute its cache fills in)
    assert forecast.long_window(110.0, not_before_s=107.5).start_s == 107.5


def test_the_warm_up_holds_a_gain_unless_the_pool_is_overloaded() -> None:
    # The forecast still holds the cold start (horizon_s 2 s, the decision at 1 s).
    # Busy 0.57: a gain of 29 %, under an urgent_gain of 30 %: the warm-up holds it.
    rules = run_periods(make_policy(horizon_s=2.0, urgent_gain=0.3), [30])
    assert rules == ["hold:warm-up"]
    # Over the default urgent_gain (20 %), at z >= z_urgent: it acts at once.
    policy = make_policy(horizon_s=2.0)
    assert run_periods(policy, [30]) == ["split:urgent"]
    inputs = policy.controller.history[0].inputs
    assert inputs["warming"] is True and inputs["busy_fraction"] < 0.9
    # Busy 1.425 (over overload_utilisation 0.9; these prompts share no prefix, so the
    # warm cache the warm-up replays with is this one): urgent, it acts at once.
    policy = make_policy(layout=(2, 2, 2, 2), horizon_s=2.0)
    assert run_periods(policy, [150]) == ["split:urgent"]
    inputs = policy.controller.history[0].inputs
    assert inputs["urgent"] is True and inputs["warming"] is True
    assert inputs["busy_fraction"] == pytest.approx(1.425, rel=1e-9)


def test_while_a_reshape_runs_only_an_urgent_move_starts_another() -> None:
    # One move at a time (max_moves_fraction 1/4 of 4 workers). The split is
    # committed but never acknowledged, so it stays in flight; the pool it heads for
    # (2CP1/3CP2) still gains by splitting another, but nothing is urgent.
    policy = make_policy(layout=(2, 2, 2, 2), max_moves_fraction=0.25, z_urgent=1e9)
    rules = run_periods(policy, [150, 150, 150])
    assert rules == ["hold:confirming", "split:whatif", "hold:reshapes-in-flight"]
    history = policy.controller.history
    assert len(policy.controller.in_flight) == 1 and history[2].ops == ()
    third = history[2].inputs
    assert third["gain"] >= 0.015 and third["urgent"] is False
    # The candidates start from the pool the reshape under way makes.
    assert [c["composition"] for c in third["candidates"]] == ["2CP1/3CP2", "4CP1/2CP2"]


def test_the_horizon_extends_until_the_backlog_of_a_transition_drains() -> None:
    # Busy 0.95 on four degree-2 workers; a payback of 2 s (two 1-s spans). The split's
    # drain and switch build a backlog its first two spans do not clear: its horizon
    # doubles to 4 spans, where its last span is back at its steady state, and
    # holding is priced over the same 4 (a split is then worse: hold).
    one = dict(saturated_moves=1)  # (one split, the subject here)
    policy = make_policy(layout=(2, 2, 2, 2), payback_s=2.0, max_payback_s=16.0, **one)
    assert run_periods(policy, [100]) == ["hold"]
    hold, split = policy.controller.history[0].inputs["candidates"]
    assert hold["horizon_cycles"] == 2 and split["horizon_cycles"] == 4
    assert split["hold_s"] == pytest.approx(E2_SHORT, rel=1e-9)  # no queue at holding
    assert split["next_s"] > split["live_s"] > split["steady_s"]
    assert split["live_s"] > split["hold_s"]
    # Overloaded (150 a second), the split's own pool keeps a backlog: the horizon
    # stops at max_payback_s, and holding, whose backlog only grows, over as long.
    policy = make_policy(layout=(2, 2, 2, 2), payback_s=2.0, max_payback_s=16.0, **one)
    assert run_periods(policy, [150]) == ["split:urgent"]
    hold, split = policy.controller.history[0].inputs["candidates"]
    assert split["horizon_cycles"] == 16 and split["hold_s"] > hold["live_s"]


def test_a_drained_move_is_priced_over_the_loads_expected_dwell() -> None:
    # The split above, whose transition its four spans do not repay, with a dwell:
    # one rate change per 100 s a priori, none seen in the 1 s served: (100 + 1) / 1
    # = 101 s, 101 spans of 1 s. Past the four replayed, each span is the last (its
    # steady state): over 101 the split repays its transition and acts (busy 0.95).
    one = dict(saturated_moves=1)
    policy = make_policy(
        layout=(2, 2, 2, 2), payback_s=2.0, max_payback_s=16.0, dwell_prior_s=100.0, **one
    )
    assert run_periods(policy, [100]) == ["split:urgent"]
    hold, split = policy.controller.history[0].inputs["candidates"]
    assert hold["horizon_cycles"] == 2 and split["horizon_cycles"] == 101
    assert split["hold_s"] == pytest.approx(E2_SHORT, rel=1e-9)  # holding's likewise
    assert split["steady_s"] < split["live_s"] < split["hold_s"] < split["next_s"]
    # dwell_max_s caps it; an overloaded candidate (150 a second) has no steady state
    # to extend: its horizon stops at max_payback_s as without a dwell.
    capped = make_policy(layout=(2, 2, 2, 2), payback_s=2.0, max_payback_s=16.0,
                         dwell_prior_s=100.0, dwell_max_s=50.0, **one)  # fmt: skip
    run_periods(capped, [100])
    assert capped.controller.history[0].inputs["candidates"][1]["horizon_cycles"] == 50
    policy = make_policy(
        layout=(2, 2, 2, 2), payback_s=2.0, max_payback_s=16.0, dwell_prior_s=100.0, **one
    )
    assert run_periods(policy, [150]) == ["split:urgent"]
    assert policy.controller.history[0].inputs["candidates"][1]["horizon_cycles"] == 16


def test_dwelt_continues_a_replay_at_its_last_span() -> None:
    # 2 spans replayed (5 requests: one of a head, two a span), means 1.0 and 0.5 s;
    # batches over both spans 1.0 and 0.6 s, in the last 0.4 and 0.6 s. Over 4 spans:
    result = ReplayResult(0.8, 5, 1.0, 1.0, (1.0, 0.5), (0.3, 0.0), (1.0, 0.6), 2, (0.4, 0.6))
    four = dwelt(result, 4)
    assert four.mean_ttft_s == pytest.approx((0.8 * 5 + 2 * 0.5 * 2) / 9, rel=1e-12)
    assert four.requests == 9 and four.cycle_ttft_s == (1.0, 0.5, 0.5, 0.5)
    assert four.backlog_s == (0.3, 0.0, 0.0, 0.0)
    assert four.batch_ttft_s == pytest.approx(((2 * 1.0 + 2 * 0.4) / 4, (2 * 0.6 + 2 * 0.6) / 4))
    assert dwelt(result, 2) is result and dwelt(result, 1) is result


def test_every_move_is_audited_and_its_error_feeds_the_pessimism() -> None:
    # A split at busy 0.57 on its second decision (t = 2 s). This driver never
    # acknowledges a switch: the split's worker drains and never comes back, so the
    # pool does worse than the move's replay (which has the two new workers serve
    # after the switch): a positive error for splits at light load. (urgent_gain
    # off: the 29 % gain is confirmed, not urgent.)
    policy = make_policy(urgent_gain=0.0)
    rules = run_periods(policy, [30] * 4)
    assert rules[:2] == ["hold:confirming", "split:whatif"]
    audits = [a for d in policy.controller.history for a in d.inputs["move_audits"]]
    (audit,) = audits
    assert (audit["at_s"], audit["span_s"], audit["move"], audit["band"]) == (
        2.0, 1.0, "1 split", "light",
    )  # fmt: skip
    assert audit["requests"] == 30 and audit["overlapped"] is False
    move = policy.controller.history[1].inputs["candidates"][1]
    assert audit["predicted_s"] == move["next_s"]  # the first span, as predicted
    assert audit["measured_s"] > audit["replayed_s"] > 0 and audit["error"] > 0
    ctl = policy.controller
    assert isinstance(ctl, WhatIfController)
    expected = (2 * 0.02 + abs(audit["error"])) / 3  # (the light band's prior: 2 %)
    assert ctl.move_audits.pessimism("split", "light") == pytest.approx(expected, rel=1e-12)
    last = policy.controller.history[-1].inputs
    assert last["pessimism"] == {"split:light": {"audits": 1, "pessimism": expected}}


def test_a_start_that_reuses_more_revises_every_replay_of_the_request() -> None:
    # A request that finds more reuse at its start than its placement saw (its
    # predecessor's prefix, computed while it waited): the forecast, the period's
    # undisturbed audit and the open move audit all replay the revised sample, and
    # its cached times are dropped (a replay of the stale sample would price it
    # without that reuse, and cache those times for the next forecast). (urgent_gain
    # off: the split on the second decision.)
    policy = make_policy(urgent_gain=0.0)
    ctl = policy.controller
    assert isinstance(ctl, WhatIfController)
    driver = Driver(policy)
    driver.steady(0.0, 30)
    driver.decide(1.0)
    driver.steady(1.0, 30)
    assert driver.decide(2.0).rule == "split:whatif"  # its audit watches [2, 3) s
    driver.steady(2.0, 30)
    rid = driver.next_id - 1
    stale = ctl.forecast.by_id[rid]
    ((audit, *_),) = [(a,) for a in ctl.move_audits._open]
    period = ctl.observations.periods.current
    assert audit.samples[rid] is stale and period is not None
    assert period.samples[rid] is stale
    ctl.observations.times[rid] = (0, (1.0, 1.0), ())  # (as a replay would have cached it)
    worker = next(iter(policy.lattice.workers))
    ctl.started(rid, worker, 8, key=77)
    revised = ctl.forecast.by_id[rid]
    assert revised.holders == ((worker, 8),) and revised.prefix_key == 77
    assert audit.samples[rid] is revised and period.samples[rid] is revised
    assert rid not in ctl.observations.times
    ctl.started(rid, worker, 8, key=77)  # no more than it holds: nothing changes
    assert ctl.forecast.by_id[rid] is revised


def test_the_next_move_waits_until_the_last_moves_span_is_seen() -> None:
    # Busy 0.48 on eight degree-2 workers, one split at a time, nothing urgent, an
    # audit span of horizon_s (2 s). (This driver never acknowledges a switch; each
    # split is taken as done once decided.) After each split its span is watched
    # for a decision, then the next split follows.
    policy = make_policy(layout=(2,) * 8, horizon_s=2.0, z_urgent=1e9, max_moves_fraction=0.125)
    driver, rules = Driver(policy), []
    for k in range(7):
        driver.steady(float(k), 100)
        rules.append(driver.decide(k + 1.0).rule)
        policy.controller.in_flight.clear()
    assert rules == ["hold:warm-up", "hold:confirming", "split:whatif", "hold:auditing",
                     "split:whatif", "hold:auditing", "split:whatif"]  # fmt: skip


def test_an_urgent_next_stage_does_not_wait_for_the_audit() -> None:
    # Overloaded (150 a second on four degree-2 workers): the next split is urgent
    # (stages of one split).
    policy = make_policy(layout=(2, 2, 2, 2), horizon_s=2.0, saturated_moves=1)
    assert run_periods(policy, [150, 150]) == ["split:urgent", "split:urgent"]
    first, second = policy.controller.history
    assert first.ops[0].sources != second.ops[0].sources


def quiet_four(start: dict[int, int] | None = None, **controller: Any) -> PoolPolicy:
    """Four degree-1 workers, 22 requests of 100 tokens a second, two decisions
    (``start``: as in ``homed``)."""
    policy, driver = homed(start, (1, 1, 1, 1), **controller)
    for k in range(2):
        for j in range(22):
            driver.arrive(100, k + j / 22)
        driver.decide(k + 1.0)
    return policy


def test_a_merge_must_keep_the_headroom_for_a_burst() -> None:
    # 22 requests of 100 tokens a second on four degree-1 workers (E_1 = 110 ms,
    # E_2 = 80 ms): merging two gains 7.7 % at this rate, but with the arrivals 1.5
    # times as fast the merged pool (2CP1/1CP2: 30.7 a second at most) is overloaded
    # where holding (36 a second) is not: refused. Without the check it merges.
    def run(headroom_rate: float) -> PoolPolicy:
        return quiet_four(headroom_rate=headroom_rate, way_back_utilisation=0.0)

    kept, moved = run(1.5), run(1.0)
    assert [d.rule for d in kept.controller.history] == ["hold", "hold"]
    assert [d.rule for d in moved.controller.history] == ["hold:confirming", "merge:whatif"]
    merge = moved.controller.history[0].inputs["candidates"][1]
    assert merge["composition"] == "2CP1/1CP2" and merge["gain"] > 0.05
    refused = kept.controller.history[0].inputs["candidates"][1]
    assert refused["composition"] == "2CP1/1CP2" and refused["gain"] == 0.0
    assert refused["score_s"] == merge["score_s"]  # priced alike, then refused
    merged, held, busy = refused["headroom_s"]
    assert merged > held and busy >= 0.9


def test_a_merge_slower_at_the_burst_rate_but_not_overloaded_keeps_its_headroom() -> None:
    # (merged mean, holding's, merged busy fraction) at the burst rate: the headroom
    # check refuses a merge that is slower there and overloaded (0.9 busy or more);
    # one slower but able to absorb the burst is left to its present gain. Refusing
    # any slowdown (``headroom_overload = false``: no busy limit) refuses it too.
    on, off = (
        cast(WhatIfPlan, SimpleNamespace(headroom_overload=flag, overload_utilisation=0.9))
        for flag in (True, False)
    )
    assert burst_refuses(on, (0.30, 0.20, 0.95))
    assert not burst_refuses(on, (0.30, 0.20, 0.80))
    assert burst_refuses(off, (0.30, 0.20, 0.80))
    assert not burst_refuses(on, (0.10, 0.20, 0.99))  # faster: never refused
    assert not burst_refuses(on, None)  # not a merge


def test_a_merge_a_rise_would_cost_more_than_it_gains_is_refused() -> None:
    # As above (holding busy 0.6, the merge gains 7.7 %), without the burst check.
    # Priced under a rise to where holding would be 0.9 busy (1.49x: 32.7 a second,
    # past the merged pool's 30.7), split back 20 s in, over the 120-s payback
    # horizon the merge loses far more than it gains (a mean of 0.358 s against
    # holding's 0.110 s): refused. A rise to 0.5 busy is no rise: it merges.
    def run(utilisation: float) -> PoolPolicy:
        return quiet_four(headroom_rate=1.0, way_back_utilisation=utilisation)

    kept, moved = run(0.9), run(0.5)
    assert [d.rule for d in kept.controller.history] == ["hold", "hold"]
    assert [d.rule for d in moved.controller.history] == ["hold:confirming", "merge:whatif"]
    refused = kept.controller.history[0].inputs["candidates"][1]
    merge = moved.controller.history[0].inputs["candidates"][1]
    assert refused["composition"] == merge["composition"] == "2CP1/1CP2"
    assert refused["gain"] == 0.0 and merge["gain"] > 0.05 and merge["way_back_s"] is None
    risen, held = refused["way_back_s"]
    assert risen - held > merge["gain"] * held and held > 0


def test_the_way_back_is_replayed_only_for_a_merge_nothing_cheaper_refused() -> None:
    # Both guards on: the headroom check (arrivals 1.5x as fast) refuses the merge,
    # so its way back, the costliest replay, is not run; the decisions are the
    # headroom check's alone. With the headroom check off, the way back runs and
    # refuses it (the test above).
    both = quiet_four(headroom_rate=1.5, way_back_utilisation=0.9)
    alone = quiet_four(headroom_rate=1.5, way_back_utilisation=0.0)
    assert [d.rule for d in both.controller.history] == ["hold", "hold"]
    for ours, theirs in zip(both.controller.history, alone.controller.history, strict=True):
        assert ours.inputs["candidates"] == theirs.inputs["candidates"]
    refused = both.controller.history[0].inputs["candidates"][1]
    merged, held, _ = refused["headroom_s"]
    assert refused["composition"] == "2CP1/1CP2" and refused["gain"] == 0.0 and merged > held
    assert refused["way_back_s"] is None
    exposed = quiet_four(headroom_rate=1.0, way_back_utilisation=0.9).controller.history[0]
    assert exposed.inputs["candidates"][1]["way_back_s"] is not None


def composed(composition: dict[int, int], kind: str = "merge") -> Candidate:
    return Candidate(kind, 2, (), composition, (), (), {}, {})


def test_a_move_towards_the_start_is_homeward() -> None:
    policy = make_policy(layout=(1, 1, 2, 2))  # started at 2CP1/2CP2
    ctl = policy.controller
    assert isinstance(ctl, WhatIfController) and ctl.start == {1: 2, 2: 2}
    now = composed({1: 6}, "hold")  # (after three splits)
    assert ctl._homeward(composed({1: 4, 2: 1}), now)  # one merge back
    assert ctl._homeward(composed({1: 2, 2: 2}), now)  # all the way
    assert not ctl._homeward(composed({2: 3}), now)  # past it: 2CP1 -> 0CP1
    assert not ctl._homeward(composed({1: 6}), now)  # not a move
    home = composed({1: 2, 2: 2}, "hold")
    assert not ctl._homeward(composed({1: 4, 2: 1}, "split"), home)  # away from it
    off = make_policy(layout=(1, 1, 2, 2), start_is_home=False).controller
    assert isinstance(off, WhatIfController)
    assert not off._homeward(composed({1: 4, 2: 1}), now)


def test_a_merge_back_to_the_start_is_not_refused_for_its_way_back() -> None:
    # quiet_four's merge (2CP1/1CP2 from 4CP1, 7.7 % at this rate) is refused for its
    # way back (the headroom check off here); a pool that started at 2CP1/1CP2 and
    # split is judged against holding that start, whose exposure to a rise is the
    # baseline: the same merge back is taken. The headroom for the next burst still
    # refuses it. (The pool is made to look as if it had started there.)
    def run(home: bool, headroom_rate: float) -> PoolPolicy:
        return quiet_four({1: 2, 2: 1} if home else None, headroom_rate=headroom_rate)

    refused, taken, tight = run(False, 1.0), run(True, 1.0), run(True, 1.5)
    assert [d.rule for d in refused.controller.history] == ["hold", "hold"]
    assert [d.rule for d in taken.controller.history] == ["hold:confirming", "merge:whatif"]
    assert [d.rule for d in tight.controller.history] == ["hold", "hold"]
    no, yes = (p.controller.history[0].inputs["candidates"][1] for p in (refused, taken))
    assert no["composition"] == yes["composition"] == "2CP1/1CP2"
    assert no["gain"] == 0.0 and yes["gain"] > 0.05 and no["score_s"] == yes["score_s"]
    risen, held = yes["way_back_s"]
    assert risen - held > yes["gain"] * held  # what refuses it away from home


def test_the_audit_error_widens_the_margin() -> None:
    for error, margin in ((0.1, 0.015 + 0.25 * 0.1), (1.0, 0.015 + 0.25 * 1.0)):
        policy = make_policy(layout=(2, 2, 2, 2))
        ctl = policy.controller
        assert isinstance(ctl, WhatIfController)
        ctl.calibration.audit(0, 1.0 + error, 1.0)
        driver = Driver(policy)
        driver.steady(0.0, 30)
        assert driver.decide(1.0).inputs["margin"] == pytest.approx(margin, rel=1e-12)


def test_a_large_forecast_is_replayed_dilated() -> None:
    policy = make_policy(layout=(2, 2, 2, 2), replay_requests=50)
    driver = Driver(policy)
    driver.steady(0.0, 150)
    decision = driver.decide(1.0)
    assert decision.inputs["forecast_requests"] == 150
    assert decision.inputs["dilation"] == 3.0
    assert decision.rule == "split:urgent"


def test_a_move_the_pool_no_longer_allows_is_stale() -> None:
    # Between prepare and finish (a server runs the replays off its loop) an operator
    # begins a reshape of the worker the controller is about to split.
    policy = make_policy(layout=(2, 2, 2, 2), max_moves_fraction=0.25)
    driver = Driver(policy)
    driver.steady(0.0, 150)
    driver.until(1.0)
    plan = policy.prepare_window(1.0)
    evaluation = plan.evaluate()
    split = plan.plan.candidates[1].ops[0]  # type: ignore[attr-defined]
    policy.begin_reshape(split, 1.0)
    decision = policy.finish_window(plan, evaluation, 1.0).decision
    assert (decision.rule, decision.ops) == ("hold:stale", ())
    assert policy.controller.in_flight == []


def test_no_split_into_workers_too_small_for_the_requests() -> None:
    # 30 tokens of KV room per rank: a degree-1 worker cannot hold a 35-token request,
    # so the scheduler sends every one to degree 2 (47.5 ms each; 100 a second is a
    # busy fraction of 1.19 on four workers). A split only takes capacity away.
    policy = make_policy(layout=(2, 2, 2, 2), max_tokens_per_rank=30)
    driver = Driver(policy)
    for k in range(100):
        driver.arrive(35, k / 100)
    decision = driver.decide(1.0)
    cands = decision.inputs["candidates"]
    assert cands[0]["composition"] == "4CP2" and cands[1]["composition"] == "2CP1/3CP2"
    assert all(c["steady_s"] > cands[0]["steady_s"] for c in cands[1:])
    assert (decision.rule, decision.ops) == ("hold", ())


# -- the three steps ------------------------------------------------------------------------


@pytest.mark.parametrize("rates", [[150, 150, 150], [30, 30, 30]], ids=["overload", "moderate"])
def test_three_steps_decide_as_one(rates: list[float]) -> None:
    one = make_policy(layout=(2, 2, 2, 2), z_urgent=1e9)
    three = make_policy(layout=(2, 2, 2, 2), z_urgent=1e9)
    rules = run_periods(one, rates)
    assert run_periods(three, rates, three_step=True) == rules
    assert one.controller.history == three.controller.history
    assert one.lattice.layout() == three.lattice.layout()
    assert one.controller.in_flight == three.controller.in_flight


def snapshot(policy: PoolPolicy, now: float) -> dict[str, Any]:
    ctl = policy.controller
    assert isinstance(ctl, WhatIfController)
    return {
        "workers": sorted(
            (w.worker_id, w.cp_degree, w.first_device, w.state)
            for w in policy.lattice.workers.values()
        ),
        "epoch": policy.lattice.epoch,
        "loads": policy.scheduler.loads(now),
        "queues": {w: policy.scheduler.queued(w) for w in policy.lattice.workers},
        "window": ctl.window,
        "in_flight": list(ctl.in_flight),
        "history": list(ctl.history),
        "forecast": sorted(ctl.forecast.by_id),
        "calibration": ctl.calibration.to_json(),
        "audit_log": list(ctl.calibration.audit_log),
    }


def test_evaluate_touches_nothing() -> None:
    policy = make_policy(layout=(2, 2, 2, 2), max_moves_fraction=0.25)
    driver = Driver(policy)
    driver.steady(0.0, 150)
    driver.decide(1.0)  # an urgent split: in flight from now on
    driver.steady(1.0, 150)
    driver.until(2.0)
    plan = policy.prepare_window(2.0)
    inner = plan.plan
    candidates_before = list(inner.candidates)  # type: ignore[attr-defined]
    forecast_before = inner.forecast  # type: ignore[attr-defined]
    before = snapshot(policy, 2.0)
    first, second = plan.evaluate(), plan.evaluate()
    assert first == second
    assert snapshot(policy, 2.0) == before
    assert list(inner.candidates) == candidates_before  # type: ignore[attr-defined]
    assert inner.forecast == forecast_before  # type: ignore[attr-defined]
    decision = policy.finish_window(plan, first, 2.0).decision
    # Still overloaded: the next stage (another split, of another worker) is urgent.
    assert decision.rule == "split:urgent"
    assert not {s for op in decision.ops for s in op.sources} & {
        s for op in policy.controller.history[0].ops for s in op.sources
    }


# -- the audit ------------------------------------------------------------------------------


def test_a_pool_served_as_predicted_is_predicted_exactly() -> None:
    # Fixed composition, Poisson arrivals of random short lengths: each undisturbed
    # period is replayed from its starting backlog once all its requests ended.
    policy = make_policy(layout=(1, 1, 2), adaptive=False)
    driver, rng, t = Driver(policy), random.Random(1), 0.0
    for k in range(6):
        while True:
            t += rng.expovariate(40.0)
            if t >= k + 1:
                break
            driver.arrive(rng.randrange(8, 64), t)
        driver.decide(k + 1.0)
    ctl = policy.controller
    assert isinstance(ctl, WhatIfController)
    log = ctl.calibration.audit_log
    # (periods 0 and 1 began within horizon_s of the first arrival: the cold start,
    # whose cache was filling, is not audited)
    assert [a["period"] for a in log] == [2, 3, 4]
    for audit in log:
        assert audit["predicted_s"] == pytest.approx(audit["measured_s"], rel=1e-9)
    assert ctl.calibration.error < 1e-9
    assert ctl.calibration.scales() == {1: pytest.approx((1.0,) * 4), 2: pytest.approx((1.0,) * 4)}


# -- the start choice ---------------------------------------------------------------------

# Dyadic curves for exact hand checks: E_1 = L / 1024, E_2 = 1/4 + L / 2048.
DYADIC = reuse_curves({1: DegreeCoeffs(c=2**-10), 2: DegreeCoeffs(d=0.25, c=2**-10)})


def start_model() -> ReplayModel:
    return ReplayModel(DYADIC, (1, 2), CostWeights())


def test_long_requests_start_on_the_larger_degree() -> None:
    # 4096 tokens every 10 s: never a queue; E_1 = 4, E_2 = 2.25.
    samples = [ArrivalSample(k, 10.0 * k, 4096) for k in range(3)]
    choice = best_start(LatticeConfig(2, (1, 2)), start_model(), samples)
    assert choice.composition == {2: 1}
    assert choice.predicted_s == {"1CP2": 2.25, "2CP1": 4.0}


def test_many_short_requests_start_on_more_small_workers() -> None:
    # Ten requests of 128 tokens at once. Two degree-1 workers (E = 1/8) take them in
    # pairs: TTFTs 1/8, 1/8, 2/8, 2/8, ... 5/8: mean 3/8. One degree-2 worker (E =
    # 5/16): 5/16 * (1 + ... + 10) / 10 = 55/32.
    samples = [ArrivalSample(k, 0.0, 128) for k in range(10)]
    choice = best_start(LatticeConfig(2, (1, 2)), start_model(), samples)
    assert choice.composition == {1: 2}
    assert choice.predicted_s == pytest.approx({"1CP2": 55 / 32, "2CP1": 3 / 8}, rel=1e-12)


def test_the_start_choice_weighs_every_composition() -> None:
    samples = [ArrivalSample(k, 0.0, 128) for k in range(10)]
    choice = best_start(LatticeConfig(4, (1, 2)), start_model(), samples)
    assert set(choice.predicted_s) == {"2CP2", "2CP1/1CP2", "4CP1"}
    assert choice.composition == {1: 4}
    bounded = LatticeConfig(4, (1, 2), max_workers={1: 2})
    assert set(best_start(bounded, start_model(), samples).predicted_s) == {"2CP2", "2CP1/1CP2"}
    with pytest.raises(ValueError):
        best_start(LatticeConfig(2, (1, 2)), start_model(), [])


def test_a_start_tie_goes_to_fewer_devices_per_worker() -> None:
    # 512 tokens take 0.5 s at either degree: the same predicted TTFT.
    samples = [ArrivalSample(0, 0.0, 512)]
    choice = best_start(LatticeConfig(2, (1, 2)), start_model(), samples)
    assert choice.predicted_s == {"1CP2": 0.5, "2CP1": 0.5}
    assert choice.composition == {1: 2}


# -- candidates -----------------------------------------------------------------------------


def test_the_ladder() -> None:
    assert [ladder(k) for k in range(5)] == [[], [1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]
    assert ladder(7) == [1, 2, 3, 4]
    assert ladder(8) == [1, 2, 3, 4, 8]
    assert ladder(31) == [1, 2, 3, 4, 8, 16]


def inputs_for(lattice: Lattice, loads: dict[int, float], **kwargs: Any) -> PoolInputs:
    return PoolInputs(
        0.0,
        loads,
        kwargs.get("running_left", {w: 0.0 for w in lattice.workers}),
        kwargs.get("queued", {w: () for w in lattice.workers}),
    )


def make_candidates(
    lattice: Lattice,
    max_moves: int,
    loads: dict[int, float] | None = None,
    in_flight: tuple[Reshape, ...] = (),
    **kwargs: Any,
) -> list[Candidate]:
    loads = loads if loads is not None else {w: 0.0 for w in lattice.workers}
    by_id = {rid: ArrivalSample(rid, 0.0, 16) for rid in range(100)}
    return candidates(
        lattice,
        inputs_for(lattice, loads, **kwargs),
        in_flight,
        max_moves,
        {c: 1.0 for c in lattice.config.degrees},
        kwargs.get("switch_s", 1.0),
        lambda op: (max(loads[s] for s in op.sources), 0.0, min(op.target_firsts)),
        by_id.get,
        lambda op: 0.25,
    )


def named(cands: list[Candidate]) -> list[tuple[str, int, str]]:
    return [(c.kind, len(c.ops), c.name) for c in cands]


def test_split_candidates_stop_at_the_bounds() -> None:
    lattice = Lattice(LatticeConfig(8, (1, 2), max_workers={1: 4}), (2, 2, 2, 2))
    loads = {0: 3.0, 1: 1.0, 2: 2.0, 3: 0.5}
    cands = make_candidates(lattice, 4, loads)
    assert named(cands) == [
        ("hold", 0, "4CP2"),
        ("split", 1, "2CP1/3CP2"),
        ("split", 2, "4CP1/2CP2"),  # a third split would make 6 degree-1 workers
    ]
    # The least loaded first.
    assert [op.sources for op in cands[2].ops] == [(3,), (1,)]
    lower = Lattice(LatticeConfig(8, (1, 2), min_workers={2: 3}), (2, 2, 2, 2))
    assert named(make_candidates(lower, 4)) == [("hold", 0, "4CP2"), ("split", 1, "2CP1/3CP2")]


def test_merge_candidates_stop_at_the_bounds_and_the_moves_allowed() -> None:
    ones = (1,) * 8
    free = Lattice(LatticeConfig(8, (1, 2)), ones)
    assert named(make_candidates(free, 8)) == [
        ("hold", 0, "8CP1"),
        ("merge", 1, "6CP1/1CP2"),
        ("merge", 2, "4CP1/2CP2"),
        ("merge", 3, "2CP1/3CP2"),
        ("merge", 4, "4CP2"),
    ]
    assert [n for _, n, _ in named(make_candidates(free, 3))] == [0, 1, 2, 3]
    capped = Lattice(LatticeConfig(8, (1, 2), max_workers={2: 2}), ones)
    assert [n for _, n, _ in named(make_candidates(capped, 8))] == [0, 1, 2]
    floored = Lattice(LatticeConfig(8, (1, 2), min_workers={1: 5}), ones)
    assert [n for _, n, _ in named(make_candidates(floored, 8))] == [0, 1]


def test_candidates_at_every_level() -> None:
    lattice = Lattice(LatticeConfig(8, (1, 2, 4)), (4, 2, 2))
    assert named(make_candidates(lattice, 4)) == [
        ("hold", 0, "2CP2/1CP4"),
        ("split", 1, "2CP1/1CP2/1CP4"),
        ("split", 2, "4CP1/1CP4"),
        ("split", 1, "4CP2"),  # level 4: the degree-4 worker in halves
        ("merge", 1, "2CP4"),  # ... or the two degree-2 buddies into one
    ]


def test_a_candidate_as_replay_input() -> None:
    lattice = Lattice(LatticeConfig(4, (1, 2)), (2, 2))
    loads = {0: 0.5, 1: 0.25}
    cands = make_candidates(
        lattice,
        2,
        loads,
        running_left={0: 0.125, 1: 0.0625},
        queued={0: (7,), 1: (8, 9)},
        switch_s=2.0,
    )
    hold, one = cands[0], cands[1]
    assert [(w.worker_id, w.cp_degree, w.free_at_s) for w in hold.next_workers] == [
        (0, 2, 0.5),
        (1, 2, 0.25),
    ]
    assert hold.remap == {} and hold.requeued == ()
    # Split worker 1 (the least loaded): it leaves now, its queued requests come back
    # at t = 0, its halves (new ids) serve after its running prefill plus the switch.
    assert [op.sources for op in one.ops] == [(1,)]
    made = tuple(w.worker_id for w in one.next_workers if w.worker_id not in (0, 1))
    assert len(made) == 2 and min(made) > 1
    assert [(w.worker_id, w.cp_degree, w.free_at_s) for w in one.next_workers] == [
        (0, 2, 0.5),
        (made[0], 1, 2.0625),
        (made[1], 1, 2.0625),
    ]
    assert [(w.worker_id, w.free_at_s) for w in one.steady_workers] == [
        (0, 0.0),
        (made[0], 0.0),
        (made[1], 0.0),
    ]
    assert one.remap == {1: made} and one.lost == {1: 0.25}
    assert [s.request_id for s in one.requeued] == [8, 9]


def test_a_reshape_in_flight_is_counted_as_done() -> None:
    lattice = Lattice(LatticeConfig(4, (1, 2)), (2, 2))
    op = lattice.split_options()[0]  # worker 0, not yet committed
    lattice.begin(op)
    cands = make_candidates(lattice, 2, {0: 0.0, 1: 0.0}, in_flight=(op,))
    hold = cands[0]
    assert hold.composition == {1: 2, 2: 1}
    assert {w.worker_id for w in hold.steady_workers} == {1, *hold.remap[0]}
    assert hold.lost == {0: 0.25}
    # Worker 0 is taken: the only option left splits worker 1.
    assert named(cands) == [("hold", 0, "2CP1/1CP2"), ("split", 1, "4CP1")]


@st.composite
def pools(draw: st.DrawFn) -> tuple[Lattice, int]:
    """A lattice state on 8 devices of degrees (1, 2, 4), bounds it satisfies, a
    number of moves."""

    def cut(size: int) -> list[int]:
        if size > 1 and draw(st.booleans()):
            return cut(size // 2) + cut(size // 2)
        return [size]

    layout = cut(4) + cut(4)
    counts = Counter(layout)
    low, high = {}, {}
    for c in (1, 2, 4):
        if draw(st.booleans()):
            low[c] = draw(st.integers(0, counts[c]))
        if draw(st.booleans()):
            high[c] = draw(st.integers(counts[c], counts[c] + 4))
    config = LatticeConfig(8, (1, 2, 4), min_workers=low, max_workers=high)
    return Lattice(config, layout), draw(st.integers(1, 8))


@settings(max_examples=150, deadline=None)
@given(pools())
def test_every_candidate_keeps_the_bounds_and_the_ladder(pool: tuple[Lattice, int]) -> None:
    lattice, max_moves = pool
    cands = make_candidates(lattice, max_moves)
    hold, rest = cands[0], cands[1:]
    assert hold.kind == "hold" and hold.ops == ()
    assert hold.composition == dict(lattice.composition())
    groups: dict[tuple[str, int], list[int]] = {}
    for cand in rest:
        assert lattice.config.within_bounds(cand.composition)
        sources = [s for op in cand.ops for s in op.sources]
        assert len(sources) == len(set(sources))  # one move per worker
        assert all(op.kind == cand.kind for op in cand.ops)
        expected = Counter(hold.composition)
        for op in cand.ops:
            expected[lattice.workers[op.sources[0]].cp_degree] -= len(op.sources)
            expected[op.target_degree] += len(op.target_firsts)
        assert {c: n for c, n in expected.items() if n} == cand.composition
        assert Counter(w.cp_degree for w in cand.steady_workers) == Counter(cand.composition)
        groups.setdefault((cand.kind, cand.level), []).append(len(cand.ops))
    for sizes in groups.values():
        assert sizes == ladder(sizes[-1]) and sizes[-1] <= max_moves


def test_a_pool_with_no_worker_serving_holds() -> None:
    # Every worker's rank failed after a second of traffic: the replay has no worker
    # to run the forecast on (it raised "a replay needs at least one worker" in the
    # decision task, found by test_interleavings): the controller holds.
    policy = make_policy(layout=(2, 2))
    driver = Driver(policy)
    driver.steady(0.0, 20)
    driver.until(1.0)
    for w in list(policy.lattice.workers):
        policy.worker_failed(w, 1.0)
    prepared = policy.prepare_window(1.0)
    evaluation = prepared.evaluate()
    assert evaluation.scores == (None,) * len(evaluation.scores)
    decision = policy.finish_window(prepared, evaluation, 1.0).decision
    assert decision.rule == "hold" and decision.ops == ()
