"""The what-if controller in the simulator: a deliberately biased profile
(``[sim] profile_bias``) and what calibration does about it. (The starting
composition, ``[pool] composition = "auto"``: ``tests/sim/test_start.py``.)"""

from __future__ import annotations

import dataclasses
import random

import pytest

from support.factories import make_profile
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.control.whatif import WhatIfController
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec
from vertumnus.sim.simulator import Simulation
from vertumnus.sim.time_model import SimSettings, SimulationError
from vertumnus.sim.workload import SimRequest

# Degree 4 pays a fixed 40 ms per prefill and is twice as fast per token: long
# requests want it, many short ones want more degree-2 workers.
COEFFS = {2: DegreeCoeffs(d=0.01, c=2e-4), 4: DegreeCoeffs(d=0.04, c=2e-4)}


def poisson(rate: float, seconds: float, tokens: int, seed: int = 1) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(SimRequest(len(out), t, tokens))


def test_a_biased_profile_mispredicts_by_its_factor_and_prefills_take_the_true_time() -> None:
    profile = make_profile(COEFFS, {2: 1.0, 4: 1.0})
    pool = PoolSpec(LatticeConfig(4, (2, 4)), (4,), 512, 64)
    settings = SimSettings(profile_bias={"4": 0.85})  # TOML keys are strings
    assert settings.profile_bias == {4: 0.85}
    sim = Simulation(
        settings, profile, pool, PolicyConfig(adaptive=False), [SimRequest(0, 0.0, 1000)]
    )
    result = sim.run()
    true_s = COEFFS[4].d + COEFFS[4].c * 1000 / 4
    assert result.records[0].ttft_s == pytest.approx(true_s)
    assert sim.policy.curves[4].time_s(1000, 0) == pytest.approx(0.85 * true_s)
    with pytest.raises(SimulationError, match="profile_bias"):
        SimSettings(profile_bias={4: 0.0})


def steady_run(calibrate: bool) -> Simulation:
    """Six minutes of steady load on 8 devices, degree 4 predicted 15 % fast."""
    profile = make_profile(COEFFS, {2: 1.0, 4: 1.0})
    pool = PoolSpec(LatticeConfig(8, (2, 4)), (2, 2, 4), 512, 64)
    controller = ControllerConfig(min_requests=100, calibrate=calibrate)
    policy = dataclasses.replace(PolicyConfig(), controller=controller)
    settings = SimSettings(seed=3, noise_cv=0.1, profile_bias={4: 0.85})
    requests = poisson(18.0, 360.0, 1200, seed=5)
    sim = Simulation(settings, profile, pool, policy, requests)
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_a_biased_profile_does_not_make_the_controller_flap() -> None:
    sim = steady_run(calibrate=True)
    controller = sim.policy.controller
    assert isinstance(controller, WhatIfController)
    # Calibration learned the bias: degree 4 measures about 1 / 0.85 of its prediction.
    scale = controller.calibration.scales()[4]
    assert scale[0] == pytest.approx(1 / 0.85, rel=0.05)
    reshapes = sim.result.reshapes  # type: ignore[attr-defined]
    assert len(reshapes) <= 1, [(r.kind, r.started_s) for r in reshapes]
    # Without calibration it believes degree 4 and keeps it; calibrated it splits
    # that worker and serves faster.
    blind = steady_run(calibrate=False)
    mean = [
        sum(r.ttft_s for r in s.result.records) / len(s.result.records)  # type: ignore[attr-defined]
        for s in (sim, blind)
    ]
    assert mean[0] < mean[1]


def uniform_bias_run(bias: float) -> Simulation:
    """Three minutes of 400-token prompts on two degree-2 workers at 0.6 of their
    capacity, the profile off by ``bias`` at every degree (a new machine). One
    degree-4 worker would take 35 against 50 ms a prompt, but it alone would be
    0.84 busy: holding is faster."""
    coeffs = {2: DegreeCoeffs(d=0.01, c=2e-4), 4: DegreeCoeffs(d=0.015, c=2e-4)}
    profile = make_profile(coeffs, {2: 1.0, 4: 1.0})
    pool = PoolSpec(LatticeConfig(4, (2, 4)), (2, 2), 512, 64)
    controller = ControllerConfig(min_requests=100)
    policy = dataclasses.replace(PolicyConfig(), controller=controller)
    settings = SimSettings(seed=3, noise_cv=0.1, profile_bias={2: bias, 4: bias})
    sim = Simulation(settings, profile, pool, policy, poisson(24.0, 180.0, 400, seed=7))
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_a_degree_not_run_yet_is_priced_at_the_measured_degrees_error() -> None:
    # The profile predicts every degree twice as fast as it runs. Degree 2 measures
    # that; degree 4, which no worker has, borrows it: kept at 1 it would look 1.7x
    # faster than degree 2 and the pool would merge, and split back once measured.
    sim = uniform_bias_run(0.5)
    controller = sim.policy.controller
    assert isinstance(controller, WhatIfController)
    scales = controller.calibration.scales()
    assert scales[2][0] == pytest.approx(2.0, rel=0.05)
    assert scales[4][0] == pytest.approx(scales[2][0], rel=1e-9)
    reshapes = sim.result.reshapes  # type: ignore[attr-defined]
    assert reshapes == [], [(r.kind, r.started_s) for r in reshapes]


def test_a_pool_serves_as_fast_with_its_profile_2x_off_as_with_it_right() -> None:
    # The scheduler counts a running prefill's elapsed seconds at the pace measured:
    # with the profile 2x fast, real seconds alone would finish each prefill halfway
    # and send the next arrivals to a worker still busy.
    profile = make_profile(COEFFS, {2: 1.0, 4: 1.0})
    pool = PoolSpec(LatticeConfig(8, (2, 4)), (2, 2, 4), 512, 64)
    policy = PolicyConfig(adaptive=False)
    means = []
    for bias in (1.0, 0.5):
        settings = SimSettings(seed=3, profile_bias={2: bias, 4: bias})
        requests = poisson(16.0, 120.0, 1200, seed=5)  # (0.6 busy)
        result = Simulation(settings, profile, pool, policy, requests).run()
        means.append(sum(r.ttft_s for r in result.records) / len(result.records))
    # (elapsed seconds alone: 0.1518 against 0.1431 s, 6 % slower)
    assert means[1] == pytest.approx(means[0], rel=0.01)
