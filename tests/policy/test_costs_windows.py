"""The placement cost of a model with sliding-window layers: the reuse curve is the
profile's E_C with the model's attention mix, a block's benefit is no longer linear in
its depth (the cache manager's statistics and the eviction value follow the curve),
and the simulator runs the windowed times."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.factories import make_profile
from vertumnus.perfmodel import AttentionMix, DegreeCoeffs
from vertumnus.policy.cache.copy_cost import EvictionValue
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.costs import ReuseCurve, reuse_curves
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.pool_config import PRESETS, PolicyConfig, PoolSpec
from vertumnus.sim.simulator import Simulation, biased
from vertumnus.sim.time_model import SimSettings
from vertumnus.sim.workload import SimRequest

HALF_128 = AttentionMix(((0.5, None), (0.5, 128)))
MIXED = AttentionMix(((0.25, None), (0.5, 40), (0.25, 4096)))
COEFFS = DegreeCoeffs(d=0.03, a=7e-6, b=3e-7, c=1.6e-5, alpha=1.4e-9)


@given(
    mix=st.sampled_from([HALF_128, MIXED, AttentionMix(((1.0, 24),))]),
    degree=st.sampled_from([1, 2, 4, 8]),
    input_tokens=st.integers(1, 200_000),
    reused=st.integers(0, 200_000),
    more=st.integers(0, 5_000),
    longer=st.integers(0, 50_000),
)
def test_the_windowed_reuse_curve_is_the_execution_time_model(
    mix: AttentionMix, degree: int, input_tokens: int, reused: int, more: int, longer: int
) -> None:
    coeffs = dataclasses.replace(COEFFS, attention=mix)
    reused = min(reused, input_tokens - 1)
    further = min(reused + more, input_tokens - 1)
    curve = ReuseCurve(degree, coeffs)
    assert not curve.quadratic
    want = coeffs.predict(degree, input_tokens - reused, reused)
    assert curve.time_s(input_tokens, reused) == pytest.approx(want, rel=1e-9, abs=1e-12)
    # The benefit of reusing more is the difference of E, for any input length.
    for n in (input_tokens, input_tokens + longer):
        saved = coeffs.predict(degree, n - reused, reused) - coeffs.predict(
            degree, n - further, further
        )
        assert curve.benefit_s(reused, further) == pytest.approx(saved, rel=1e-9, abs=1e-12)
    assert curve.benefit_s(further, reused) == -curve.benefit_s(reused, further)


def test_a_full_profile_keeps_the_quadratic_curve() -> None:
    curve = ReuseCurve(4, COEFFS)
    assert curve.quadratic
    assert curve.block_benefit_s(16, 3) == curve.benefit_s(48, 64)
    windowed = ReuseCurve(4, dataclasses.replace(COEFFS, attention=HALF_128))
    # Less attention left: a windowed prefill is shorter, its cached prefix worth less.
    assert windowed.time_s(65_536, 0) < curve.time_s(65_536, 0)
    assert windowed.benefit_s(0, 32_768) < curve.benefit_s(0, 32_768)


def test_a_blocks_benefit_stops_growing_past_the_window() -> None:
    """Full layers: each block deeper saves more (linear in depth). Window w: the
    benefit grows only while the block lies within the window, then stays."""
    only = dataclasses.replace(COEFFS, attention=AttentionMix(((1.0, 64),)))
    curve = ReuseCurve(1, only)
    b = 16
    benefits = [curve.block_benefit_s(b, j) for j in range(8)]
    assert benefits[0] < benefits[1] < benefits[2] < benefits[3]  # tokens 0..63
    assert benefits[4] == pytest.approx(benefits[7], rel=1e-12)  # past 64: w pairs each
    per_token = COEFFS.a + COEFFS.c - COEFFS.b
    assert benefits[5] == pytest.approx(b * (per_token + COEFFS.alpha * 64), rel=1e-12)


def test_the_cache_managers_missed_statistics_follow_the_windowed_curve() -> None:
    b = 16
    coeffs = {
        1: DegreeCoeffs(d=0.01, c=1e-3, alpha=1e-6, b=1e-5, attention=AttentionMix(((1.0, 24),))),
        2: DegreeCoeffs(
            d=0.02, a=1e-4, c=1e-3, alpha=1e-6, b=2e-5, attention=AttentionMix(((1.0, 24),))
        ),
    }
    config = CacheManagerConfig(theta_inter_s=0.02, decay=0.5, priced=False)
    manager = PrefixCacheManager(coeffs, b, config)
    manager.add_worker(10, 1, 0)
    cache = WorkerCacheIndex(1, 64, 10)
    chain = [1, 2, 3]
    manager.on_request(chain, 49, 10)
    manager.apply_report(cache.commit(cache.begin(chain, 3)))
    manager.add_worker(20, 2, 2)
    update = manager.on_request([1, 2, 3, 4], 129, 10)
    assert (update.matched_blocks, update.reused_blocks) == (3, 3)
    assert update.preferred_degree == 2  # no degree-2 replica: each node is charged
    k = coeffs[2]
    missed = []
    for depth, bid in enumerate(chain):
        want = k.predict(2, 129 - depth * b, depth * b) - k.predict(
            2, 129 - (depth + 1) * b, (depth + 1) * b
        )
        node_missed = manager.trie.nodes[bid].missed
        assert node_missed is not None and node_missed[1] == pytest.approx(want, rel=1e-12)
        missed.append(node_missed[1])
    # Window 24 < 2 blocks: block 2 adds less than block 1 did (a full model: equal).
    assert missed[2] - missed[1] < (missed[1] - missed[0]) / 2


def test_the_eviction_value_takes_the_curves_benefit_per_block() -> None:
    value = EvictionValue()
    value.evicted_block(11, last_copy=True)
    value.evicted_block(12, last_copy=True)
    per_block = {1: 2.0, 2: 0.5}
    value.missed([7, 11, 12], 1, 3, base_s=1.0, step_s=100.0, block_s=per_block.__getitem__)
    assert value.ghost_benefit_s == pytest.approx(2.5)


def test_the_simulator_runs_the_windowed_times() -> None:
    mix = AttentionMix(((0.5, None), (0.5, 256)))
    coeffs = {4: DegreeCoeffs(d=0.5, c=1e-4, alpha=1e-7, attention=mix)}
    profile = make_profile(coeffs, {4: 15.0}, block_size=512)
    assert profile.attention == mix
    spec = PoolSpec(LatticeConfig(4, (4,)), (4,), 512, 293)
    requests = [SimRequest(0, 0.0, 8192), SimRequest(1, 100.0, 20_000)]
    sim = Simulation(SimSettings(), profile, spec, PolicyConfig(**PRESETS["fixed"]), requests)
    sim.run()
    for record in sim.records:
        n = record.input_tokens
        assert record.ttft_s == pytest.approx(profile.predict(4, n, 0), rel=1e-12)
        assert record.ttft_s < dataclasses.replace(coeffs[4], attention=AttentionMix()).predict(
            4, n, 0
        )
    # A biased profile scales the coefficients and keeps the model's mix.
    assert biased(profile, {4: 0.5}).attention == mix
    assert biased(profile, {4: 0.5}).predict(4, 1000, 0) == pytest.approx(
        0.5 * profile.predict(4, 1000, 0)
    )
    assert reuse_curves(profile.coeffs)[4].time_s(8192, 0) == pytest.approx(
        profile.predict(4, 8192, 0), rel=1e-12
    )
