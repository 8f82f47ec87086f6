"""Capacity kappa_C: the FIFO worker, the load sweep, the search, length mixes, and
the shipped profiles (the tiny CPU one meets its fit target; the derived GPU one
reproduces the paper's speed-ups)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.factories import make_profile
from vertumnus.capacity import (
    CapacityError,
    CapacitySettings,
    LengthMix,
    LoadSweep,
    fifo_ttft,
    measure_capacity,
)
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.slo import TtftSlo
from vertumnus.traces import load_trace

# A made-up accelerator with a real profile's shape: C=4 pays start-up and a
# per-token overhead, and wins on long inputs.
PROFILE = make_profile(
    {
        1: DegreeCoeffs(d=0.02, c=6e-5, alpha=4e-10, b=2e-7),
        4: DegreeCoeffs(d=0.03, a=1e-5, c=6e-5, alpha=4e-10, b=3e-7),
    }
)
MIX = LengthMix("test", ((512, 0), (2048, 1024), (8192, 0), (32768, 16384), (65536, 0)))
FAST = CapacitySettings(window_s=10.0, min_requests=1000, max_requests=5000)


def test_fifo_ttft_by_hand() -> None:
    # Arrivals 0, 1, 1.5, 10 with service 2, 1, 1, 1: the second waits 1 s, the
    # third 1.5 s, the fourth finds the worker idle.
    assert fifo_ttft([2, 1, 1, 1], [0, 1, 1.5, 10]) == [2, 2, 2.5, 1]


def test_fifo_matches_the_md1_queue() -> None:
    """Poisson arrivals, constant service: P(no wait) = 1 - rho, and the mean wait is
    rho / (2 (1 - rho)) service times (Pollaczek-Khinchine)."""
    rng = random.Random(7)
    rho, n = 0.6, 200_000
    arrivals = list(itertools.accumulate(rng.expovariate(rho) for _ in range(n)))
    waits = [t - 1.0 for t in fifo_ttft([1.0] * n, arrivals)]
    assert sum(w < 1e-12 for w in waits) / n == pytest.approx(1 - rho, abs=0.01)
    assert sum(waits) / n == pytest.approx(rho / (2 * (1 - rho)), rel=0.05)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 1.5), st.floats(0.05, 1.5))
def test_attainment_never_rises_with_load(rho_a: float, rho_b: float) -> None:
    sweep = LoadSweep(PROFILE.predict, PROFILE.degrees, 1, MIX, FAST)
    lo, hi = sorted((rho_a, rho_b))
    assert sweep.attainment(hi) <= sweep.attainment(lo) <= sweep.isolated_attainment()


@pytest.mark.parametrize("cp_degree", [1, 4])
def test_kappa_is_the_edge_of_the_target(cp_degree: int) -> None:
    result = measure_capacity(PROFILE.predict, PROFILE.degrees, cp_degree, MIX, FAST)
    sweep = LoadSweep(PROFILE.predict, PROFILE.degrees, cp_degree, MIX, FAST)
    assert not result.capped and 0 < result.utilisation < 1
    assert result.attainment >= FAST.target_attainment
    assert sweep.attainment(result.utilisation * 1.003) < FAST.target_attainment
    # kappa is demand per window: about rho * H seconds of predicted service.
    assert result.kappa_s == pytest.approx(result.utilisation * FAST.window_s, rel=0.1)
    assert result.kappa_s == sweep.demand_s(result.utilisation)
    scored_s = sweep.service_s[sweep.first :]
    mean_scored_s = sum(scored_s) / len(scored_s)
    # The rate counts the arrival intervals in the span (one fewer than requests).
    intervals = (len(scored_s) - 1) / len(scored_s)
    want_rate = result.kappa_s / FAST.window_s / mean_scored_s * intervals
    assert result.request_rate == pytest.approx(want_rate, rel=1e-9)
    # Deterministic for a seed.
    assert measure_capacity(PROFILE.predict, PROFILE.degrees, cp_degree, MIX, FAST) == result


def test_a_looser_slo_or_target_never_lowers_kappa() -> None:
    def kappa(slo: str, target: float) -> float:
        s = CapacitySettings(
            window_s=10.0, min_requests=1000, slo=TtftSlo.parse(slo), target_attainment=target
        )
        return measure_capacity(PROFILE.predict, PROFILE.degrees, 4, MIX, s).kappa_s

    assert kappa("3x", 0.9) <= kappa("5x", 0.9) <= kappa("10x", 0.9)
    assert kappa("5x", 0.99) <= kappa("5x", 0.9) <= kappa("5x", 0.5)


def test_impossible_and_unbounded_targets() -> None:
    # Half the isolated time: no request can make it, even alone.
    hopeless = CapacitySettings(min_requests=500, slo=TtftSlo(scale=0.5))
    result = measure_capacity(PROFILE.predict, PROFILE.degrees, 1, MIX, hopeless)
    assert (result.kappa_s, result.utilisation, result.isolated_attainment) == (0.0, 0.0, 0.0)
    # A target nobody can miss: the search stops at its upper end and says so.
    lax = CapacitySettings(min_requests=500, slo=TtftSlo(scale=None, fixed_s=1e9))
    result = measure_capacity(PROFILE.predict, PROFILE.degrees, 1, MIX, lax)
    assert result.capped and result.utilisation == lax.max_utilisation


def test_settings_are_validated() -> None:
    with pytest.raises(CapacityError, match="target attainment"):
        CapacitySettings(target_attainment=1.5)
    with pytest.raises(CapacityError, match="window_s"):
        CapacitySettings(window_s=0)
    with pytest.raises(CapacityError, match="burstiness"):
        CapacitySettings(burstiness=0)


def test_length_mixes(tmp_path: Path) -> None:
    builtin = LengthMix.builtin()
    assert builtin.name == "builtin:mooncake-conversation"
    assert len(builtin.requests) == 502
    lengths = sorted(n for n, _ in builtin.requests)
    assert 6000 < lengths[len(lengths) // 2] < 8000  # the trace's median input is 6,909
    small = builtin.scaled(1 / 16)
    assert all(0 <= p < n for n, p in small.requests)
    assert max(n for n, _ in small.requests) == round(lengths[-1] / 16)
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1100, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 9, "input_length": 1200, "hash_ids": [0, 1, 3]}\n'
    )
    assert LengthMix.from_trace(load_trace(trace)).requests == ((1100, 0), (1200, 1024))
    with pytest.raises(CapacityError, match="cached < input"):
        LengthMix("bad", ((10, 10),))
    with pytest.raises(CapacityError, match="empty"):
        LengthMix("bad", ())
    with pytest.raises(CapacityError, match="length scale"):
        builtin.scaled(0)


def test_shipped_cpu_profile_meets_its_fit_target() -> None:
    profile = Profile.load("tiny-cpu")
    assert profile.degrees == [1, 2]
    for degree in profile.degrees:
        assert profile.provenance["mape_held_out"][str(degree)] < 0.10
        entry = profile.capacity[degree]
        assert entry["kappa_s"] > 0 and entry["window_s"] > 0
        assert TtftSlo.parse(entry["slo"])  # recorded in a form that reads back


def test_shipped_gpu_profile_matches_the_paper() -> None:
    profile = Profile.load("qwen3-30b-a3b-h100")
    assert profile.degrees == [1, 2, 4, 8]

    def speedup(c: int, n: int) -> float:
        return profile.predict(1, n, 0) / profile.predict(c, n, 0)

    assert speedup(4, 65536) == pytest.approx(2.71, abs=0.01)
    assert speedup(8, 65536) == pytest.approx(3.91, abs=0.01)
    for c in (2, 4, 8):
        assert speedup(c, 1024) < 1.05  # little or negative for short inputs
        times = [profile.predict(c, n, 0) for n in range(1024, 131073, 4096)]
        assert all(a < b for a, b in itertools.pairwise(times))
    long_times = [profile.predict(c, 131072, 0) for c in profile.degrees]
    assert all(a > b for a, b in itertools.pairwise(long_times))
    # A cached prefix always helps: reusing half beats computing it.
    for c in profile.degrees:
        assert profile.predict(c, 32768, 32768) < profile.predict(c, 65536, 0)
    assert all(profile.capacity[c]["kappa_s"] > 0 for c in profile.degrees)
