"""``sim/scenarios.py`` and ``sim/saturation.py``: seeded scenarios in their stated
ranges, block ids that name whole prefixes, the unbounded-cache reuse, and the
fluid bound against brute force."""

from __future__ import annotations

import itertools
import random
import statistics

import numpy as np
import pytest
from scipy.optimize import linprog

from vertumnus.perfmodel import Profile
from vertumnus.policy.geometry import composition_name, reachable_compositions
from vertumnus.sim import families, scenarios, sessions
from vertumnus.sim.config import DEFAULT_POOL, DEFAULT_PROFILE
from vertumnus.sim.saturation import fluid_rate, saturation
from vertumnus.sim.workload import SimRequest

SCALE = 0.2  # the report seeds' timelines, shortened: about 300k requests in all


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.load(DEFAULT_PROFILE)


@pytest.fixture(scope="module")
def drawn(profile: Profile) -> list[tuple[scenarios.Scenario, dict[str, float]]]:
    out = []
    for seed in scenarios.REPORT_SEEDS:
        scenario = scenarios.scaled(scenarios.draw(seed, profile), SCALE)
        out.append((scenario, scenarios.measure(scenario, scenarios.requests(scenario))))
    return out


def test_a_seed_gives_one_scenario_and_one_request_list(profile: Profile) -> None:
    for seed in (3, 117):
        a, b = scenarios.draw(seed, profile), scenarios.draw(seed, profile)
        assert a == b
        short = scenarios.scaled(a, 0.1)
        assert scenarios.requests(short) == scenarios.requests(short)
    assert scenarios.draw(3, profile) != scenarios.draw(4, profile)
    assert set(scenarios.TUNE_SEEDS).isdisjoint(scenarios.REPORT_SEEDS)
    assert len(scenarios.REPORT_SEEDS) == 60


def test_parameters_fall_in_their_ranges(
    drawn: list[tuple[scenarios.Scenario, dict[str, float]]],
) -> None:
    names = {composition_name(c) for c in reachable_compositions(DEFAULT_POOL.lattice)}
    for scenario, _ in drawn:
        assert 120 <= scenario.duration_s / SCALE <= 1200
        assert 0.2 <= scenario.load <= 1.1
        assert 0 <= scenario.lengths.long_share <= 0.25
        assert 1000 <= scenario.lengths.short_median_tokens <= 8000
        assert scenario.starts[0] == "4CP4/3CP8" and len(set(scenario.starts)) == 3
        assert set(scenario.starts) <= names and scenario.saturation_composition in names
        # The shape's peak rate is the load times the saturation; its mean is mean_rate.
        assert scenario.peak_rate == pytest.approx(scenario.load * scenario.saturation_rate)
        grid = [scenario.duration_s * (k + 0.5) / 2000 for k in range(2000)]
        mean = statistics.fmean(scenario.rate_at(t) for t in grid)
        assert mean == pytest.approx(scenario.mean_rate, rel=0.01)
        ratio = scenario.second_rate / scenario.base_rate
        if scenario.shape == "steady":
            assert ratio == 1
        elif scenario.shape == "burst":
            assert 2 <= ratio <= 4 and scenario.burst_s is not None
            length_s, whole_s = scenario.burst_s / SCALE, scenario.duration_s / SCALE
            assert min(60, whole_s / 2) <= length_s <= 180
            assert scenario.change_s is not None
            assert scenario.change_s + scenario.burst_s <= scenario.duration_s
        else:
            assert 1.5 <= max(ratio, 1 / ratio) <= 4
    assert {s.shape for s, _ in drawn} == set(scenarios.SHAPES)
    assert {s.family for s, _ in drawn} == set(families.FAMILIES)


def test_realised_reuse_long_share_and_load_span_the_targets(
    drawn: list[tuple[scenarios.Scenario, dict[str, float]]],
) -> None:
    reuse = [m["token_reuse"] for _, m in drawn]
    assert min(reuse) < 0.02 and 0.6 <= max(reuse) <= 0.85
    # Spread over the range, not two clusters.
    assert sum(0.15 <= r < 0.45 for r in reuse) >= 6 and sum(r >= 0.45 for r in reuse) >= 6
    for scenario, m in drawn:
        assert 0 <= m["long_share"] <= 0.28
        assert m["long_share"] == pytest.approx(scenario.lengths.long_share, abs=0.06)
        if scenario.session_requests < 1.2:
            # (Longer sessions lose their turns past the end of a shortened run.)
            expected = scenario.mean_rate / scenario.saturation_rate
            assert m["load"] == pytest.approx(expected, rel=0.15)
        if scenario.family == "none":
            assert m["token_reuse"] == 0
    loads = [m["load"] for _, m in drawn]
    assert min(loads) < 0.3 and max(loads) > 1.0


def test_block_ids_name_whole_prefixes(profile: Profile) -> None:
    """Equal ids at a position mean equal ids before it; a conversation's turn holds
    the whole of the previous turn's full blocks."""
    for seed in scenarios.REPORT_SEEDS[:12]:
        scenario = scenarios.scaled(scenarios.draw(seed, profile), 0.1)
        reqs = scenarios.requests(scenario)
        prefix_of: dict[int, tuple[int, ...]] = {}
        for r in reqs:
            assert len(r.block_ids) == r.input_tokens // sessions.BLOCK_TOKENS
            assert r.input_tokens <= families.MAX_TOKENS
            for j, block in enumerate(r.block_ids):
                assert prefix_of.setdefault(block, r.block_ids[:j]) == r.block_ids[:j]
        assert [r.request_id for r in reqs] == list(range(len(reqs)))
        assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
        assert all(0 <= r.arrival_s < scenario.duration_s for r in reqs)
        if scenario.family == "conversation":
            starts = {r.block_ids for r in reqs}
            grown = [
                r
                for r in reqs
                if any(r.block_ids[:k] in starts for k in range(1, len(r.block_ids)))
            ]
            assert grown


def test_unbounded_reuse_counts_leading_blocks_seen_before() -> None:
    def req(i: int, tokens: int, ids: tuple[int, ...]) -> SimRequest:
        return SimRequest(i, float(i), tokens, ids)

    reqs = [
        req(0, 1536, (1, 2, 3)),
        req(1, 2048, (1, 2, 3, 4)),  # the whole of request 0
        req(2, 1536, (1, 2, 3)),  # at most all but its last token: two blocks
        req(3, 1024, (5, 2)),  # block 2 after another prefix: not a reuse
    ]
    assert sessions.unbounded_reuse(reqs) == [0, 1536, 1024, 0]


def lp_rate(work: list[dict[int, float]], comp: dict[int, int]) -> float:
    """The fluid bound as a linear program: rates y_iC >= 0 of request i to degree C,
    sum_C y_iC = lambda / N, sum_i y_iC E_iC <= n_C; maximise lambda."""
    degrees, n = sorted(comp), len(work)
    size = n * len(degrees) + 1  # the y's, then lambda
    cost = np.zeros(size)
    cost[-1] = -1.0
    a_eq = np.zeros((n, size))
    for i in range(n):
        a_eq[i, i * len(degrees) : (i + 1) * len(degrees)] = 1.0
        a_eq[i, -1] = -1.0 / n
    a_ub = np.zeros((len(degrees), size))
    for k, c in enumerate(degrees):
        for i, w in enumerate(work):
            a_ub[k, i * len(degrees) + k] = w[c]
    bounds = [comp[c] for c in degrees]
    result = linprog(cost, A_ub=a_ub, b_ub=bounds, A_eq=a_eq, b_eq=np.zeros(n))
    assert result.status == 0
    return float(-result.fun)


def test_the_fluid_bound_by_hand_and_as_a_linear_program() -> None:
    # One degree: n / mean E.
    assert fluid_rate([{4: 0.5}, {4: 1.5}], {4: 3}) == pytest.approx(3.0)
    # A (E4 1, E8 0.6) and B (E4 4, E8 2): B goes to CP8 first (ratio 0.5), 5/6 of
    # it, the rest of B and A to CP4; both then work 5/3 s per pair: 1.2 requests/s.
    work = [{4: 1.0, 8: 0.6}, {4: 4.0, 8: 2.0}]
    assert fluid_rate(work, {4: 1, 8: 1}) == pytest.approx(1.2)
    assert lp_rate(work, {4: 1, 8: 1}) == pytest.approx(1.2)
    rng = random.Random(7)
    for _ in range(40):
        work = []
        for _ in range(rng.randint(1, 12)):
            e4 = rng.uniform(0.05, 3.0)
            work.append({4: e4, 8: e4 * rng.uniform(0.3, 1.2)})
        comp = {4: rng.randint(1, 8), 8: rng.randint(1, 4)}
        assert fluid_rate(work, comp) == pytest.approx(lp_rate(work, comp), rel=1e-6)


def test_saturation_is_the_best_composition(profile: Profile) -> None:
    mix = [(2000, 0), (8000, 4096), (64000, 0)] * 10
    rate, best = saturation(mix, profile, DEFAULT_POOL.lattice)
    scenario = scenarios.draw(100, profile)
    assert rate > 0 and best in reachable_compositions(DEFAULT_POOL.lattice)
    assert scenario.saturation_rate > 0
    assert scenario.peak_rate == pytest.approx(scenario.load * scenario.saturation_rate)
