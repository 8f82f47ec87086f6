"""``policy/timeline.py``: the pool over time as the dashboard and the reports draw
it. Trailing-window figures computed exactly, the bounded ring answering what came
after a time, reshape events with their inputs and a few candidates, samples read
from the policy without changing it; and in the simulator, sampling changes no
request's fate."""

from __future__ import annotations

import dataclasses
import math

import pytest

from support.factories import BLOCK_SIZE, make_profile
from support.policy import COEFFS, KAPPA_S
from vertumnus.blocks import block_ids
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec, preset
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.timeline import MAX_CANDIDATES, Timeline, plain, worker_rows
from vertumnus.sim.simulator import Simulation
from vertumnus.sim.time_model import SimSettings
from vertumnus.sim.workload import Phase, phased
from vertumnus.stats import percentile


def make_policy(layout: tuple[int, ...] = (1, 1, 2)) -> PoolPolicy:
    pool = PoolSpec(LatticeConfig(sum(layout), (1, 2)), layout, BLOCK_SIZE, 64)
    return PoolPolicy.build(make_profile(COEFFS, KAPPA_S), pool, PolicyConfig(adaptive=False))


def test_window_figures_are_exact() -> None:
    policy = make_policy()
    line = Timeline(period_s=1.0, window_s=3.0, origin_s=100.0)
    answers = [  # (t, ttft, tau, tokens, cached)
        (100.5, 0.2, 1.0, 100, 0),  # leaves the window at t = 103.5
        (101.5, 0.4, 1.0, 300, 150),
        (102.5, 2.0, 1.0, 600, 0),  # misses its SLO
        (103.2, 0.1, math.inf, 50, 50),
    ]
    for arrival in sorted(t - ttft for t, ttft, *_ in answers):  # as the drivers: in order
        line.arrived(arrival)
    for t, ttft, tau, tokens, cached in answers:
        line.finished(t, ttft, tau, tokens, cached)
    sample = line.sample(103.6, policy)
    kept = answers[1:]
    ttfts = [a[1] for a in kept]
    assert sample["t"] == pytest.approx(3.6)
    for q in (50, 90, 99):
        assert sample[f"ttft_p{q}_s"] == pytest.approx(percentile(ttfts, q), abs=1e-6)
    assert sample["ttft_mean_s"] == pytest.approx(sum(ttfts) / 3, abs=1e-6)
    assert sample["slo_attainment"] == pytest.approx((300 + 50) / 950, abs=1e-4)
    assert sample["hit_rate"] == pytest.approx(200 / 950, abs=1e-4)
    assert sample["tau_p50_s"] == 1.0  # an infinite tau is no target
    # arrivals at 100.3, 101.1, 100.5, 103.1: three within (100.6, 103.6]
    assert sample["rate"] == pytest.approx(2 / 3.0, abs=1e-4)
    assert (sample["arrivals"], sample["finished"]) == (4, 4)
    quiet = line.sample(110.0, policy)  # nothing left in the window
    assert quiet["ttft_p50_s"] is None and quiet["slo_attainment"] is None
    assert (quiet["arrivals"], quiet["finished"], quiet["rate"]) == (0, 0, 0.0)
    assert line.next_s == 111.0


def test_the_ring_answers_what_came_after() -> None:
    policy = make_policy()
    line = Timeline(period_s=0.5, capacity=4, max_events=2)
    for k in range(1, 7):
        line.sample(0.5 * k, policy)
    assert [s["t"] for s in line.since()["samples"]] == [1.5, 2.0, 2.5, 3.0]  # the latest 4
    assert [s["t"] for s in line.since(2.0)["samples"]] == [2.5, 3.0]
    assert line.since(3.0)["samples"] == [] and line.since(-1)["samples"] == list(line.samples)
    for k in range(3):
        line.reshaped(3.0 + k, "merge", {"rule": "merge:capacity", "ops": []})
    assert [e["t"] for e in line.since(3.5)["events"]] == [4.0, 5.0]
    answer = line.since()
    assert (answer["period_s"], answer["capacity"], answer["window_s"]) == (0.5, 4, 30.0)
    with pytest.raises(ValueError, match="period"):
        Timeline(period_s=0)


def test_a_reshape_event_keeps_its_rule_inputs_and_a_few_candidates() -> None:
    line = Timeline()
    decision = {
        "window": 7,
        "rule": "whatif",
        "ops": [{"kind": "split", "sources": (3,), "degree": 1}],
        "demand_s": 12.5,
        "capacity_s": 10.0,
        "candidates": [{"ops": [k], "mean_ttft_s": 0.1 * k} for k in range(20)],
        "margin": 0.05,
    }
    line.reshaped(42.0, "split", decision)
    (event,) = line.events
    assert (event["t"], event["kind"], event["rule"]) == (42.0, "split", "whatif")
    assert event["ops"] == [{"kind": "split", "sources": [3], "degree": 1}]
    assert event["inputs"] == {
        "rule": "whatif",
        "demand_s": 12.5,
        "capacity_s": 10.0,
        "margin": 0.05,
    }
    assert len(event["candidates"]) == MAX_CANDIDATES
    assert event["candidates"][1] == {"ops": [1], "mean_ttft_s": 0.1}


def test_each_move_audit_a_decision_closed_is_an_event() -> None:
    line = Timeline(origin_s=10.0)
    audit = {"move": "1 split", "predicted_s": 0.2, "measured_s": 0.25, "vs_hold": 0.1}
    line.decided(12.5, {"move_audits": [audit, {**audit, "move": "2 merge"}]})
    line.decided(13.0, {"gain": 0.0})  # (none closed: no event; a rules decision too)
    assert [(e["t"], e["kind"], e["rule"], e["ops"]) for e in line.events] == [
        (2.5, "audit", "audit of 1 split", []),
        (2.5, "audit", "audit of 2 merge", []),
    ]
    assert line.events[0]["inputs"] == audit


def test_a_sample_reads_the_policy_and_changes_nothing() -> None:
    policy = make_policy((1, 1, 2))
    tokens = list(range(200))
    policy.arrive(PlacementRequest(1, 200, tuple(block_ids(tokens, BLOCK_SIZE))), 0.0)
    policy.arrive(PlacementRequest(2, 200, tuple(block_ids(tokens, BLOCK_SIZE))), 0.0)
    before = (dict(policy.scheduler.loads(0.5)), policy.composition_name())
    sample = Timeline().sample(0.5, policy)
    assert (dict(policy.scheduler.loads(0.5)), policy.composition_name()) == before
    assert sample["workers"] == {"1": 2, "2": 1} and sample["not_active"] == 0
    assert sample["composition"] == policy.composition_name() == "2CP1/1CP2"
    assert sample["queued"] == 2 and sample["running"] == 0
    assert sample["outstanding_s"] == pytest.approx(sum(before[0].values()), abs=1e-6)
    rows = worker_rows(policy, 0.5)
    assert [r["cp_degree"] for r in rows] == [1, 1, 2] and sum(r["queued"] for r in rows) == 2


def test_plain_makes_json_ready_data() -> None:
    @dataclasses.dataclass
    class Point:
        x: int
        tags: frozenset[str]

    assert plain({1: (Point(2, frozenset({"b", "a"})),)}) == {"1": [{"x": 2, "tags": ["a", "b"]}]}


def test_sampling_changes_no_request_in_the_simulator() -> None:
    requests = phased([Phase(60, 4.0, 0.1), Phase(60, 1.0, 0.5)], seed=3, long_tokens=32_768)
    profile = make_profile(COEFFS, KAPPA_S, block_size=512)
    pool = PoolSpec(LatticeConfig(4, (1, 2)), (1, 1, 2), 512, 293)
    config = PolicyConfig(**preset("vertumnus"))  # type: ignore[arg-type]
    fine = Simulation(SimSettings(sample_s=0.05), profile, pool, config, requests).run()
    coarse = Simulation(SimSettings(sample_s=50.0), profile, pool, config, requests).run()
    assert [(r.worker, r.end_s) for r in fine.records] == [
        (r.worker, r.end_s) for r in coarse.records
    ]
    assert len(fine.timeline.samples) > 2000 > len(coarse.timeline.samples)
    # every request is counted once, and every reshape begun is an event
    assert sum(s["arrivals"] for s in fine.timeline.samples) == len(requests)
    assert sum(s["finished"] for s in fine.timeline.samples) == len(requests)
    assert len(fine.timeline.events) == len(fine.reshapes)
