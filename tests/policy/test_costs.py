"""Placement cost terms: the reuse curve is E_C exactly, PreferDegree by hand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.costs import CostWeights, Pace, ReuseCurve, prefer_degree, reuse_curves

COEFFS = DegreeCoeffs(d=0.03, a=7e-6, b=3e-7, c=1.6e-5, alpha=1.4e-9)


@given(
    degree=st.sampled_from([1, 2, 4, 8]),
    input_tokens=st.integers(1, 200_000),
    reused=st.integers(0, 200_000),
    more=st.integers(0, 5_000),
)
def test_reuse_curve_is_the_execution_time_model(
    degree: int, input_tokens: int, reused: int, more: int
) -> None:
    reused = min(reused, input_tokens - 1)
    further = min(reused + more, input_tokens - 1)
    curve = ReuseCurve(degree, COEFFS)
    want = COEFFS.predict(degree, input_tokens - reused, reused)
    assert curve.time_s(input_tokens, reused) == pytest.approx(want, rel=1e-9, abs=1e-12)
    saved = COEFFS.predict(degree, input_tokens - reused, reused) - COEFFS.predict(
        degree, input_tokens - further, further
    )
    assert curve.benefit_s(reused, further) == pytest.approx(saved, rel=1e-9, abs=1e-12)


def test_prefer_degree_weighs_devices_only_through_lambda() -> None:
    wide = DegreeCoeffs(d=0.035, a=8e-6, b=3e-7, c=1.6e-5, alpha=1.4e-9)  # CP overheads
    curves = reuse_curves({1: COEFFS, 8: wide})
    # 64K tokens: degree 8 is much faster, so it wins without a device penalty...
    assert prefer_degree(curves, [1, 8], 65536, 0, CostWeights()) == 8
    # ... and with one large enough: lambda * (8/1 - 1) > the time saved.
    assert prefer_degree(curves, [1, 8], 65536, 0, CostWeights(gpu_penalty=1.0)) == 1
    # Almost all of it cached: one token left, and degree 8's start-up loses.
    assert prefer_degree(curves, [1, 8], 65536, 65535, CostWeights()) == 1
    # Equal costs: the smaller degree.
    flat = reuse_curves({1: DegreeCoeffs(d=0.01), 2: DegreeCoeffs(d=0.01)})
    assert prefer_degree(flat, [2, 1], 5000, 0, CostWeights()) == 1
    # Only the degrees present count.
    assert prefer_degree(curves, [8], 100, 0, CostWeights(gpu_penalty=5.0)) == 8


def test_weights_are_validated() -> None:
    with pytest.raises(ValueError, match="beta must be >= 1"):
        CostWeights(beta=0.5)
    with pytest.raises(ValueError, match="lambda"):
        CostWeights(gpu_penalty=-1)
    with pytest.raises(ValueError, match="backlog_weight must be >= 0"):
        CostWeights(backlog_weight=-0.5)
    with pytest.raises(ValueError, match="backlog_weight must be >= 0"):
        CostWeights(backlog_weight=float("nan"))
    assert CostWeights(beta=2, gpu_penalty=0.5).factor(4, 2) == 2 + 0.5 * (4 / 2 - 1)


def test_pace_is_predicted_over_measured_busy_time_per_degree() -> None:
    pace = Pace(decay=1.0, min_samples=3.0)
    assert (pace.of(1), pace.of(2)) == (1.0, 1.0)  # nothing measured: the profile's
    for _ in range(2):
        pace.ended(1, 1.0, 2.0)  # the machine at half the profile's speed
    assert pace.of(1) == 1.0  # (under min_samples, and so is the pool)
    pace.ended(1, 1.0, 2.0)
    # Degree 2, not measured, takes the pooled pace of every degree.
    assert (pace.of(1), pace.of(2)) == (0.5, 0.5)
    for _ in range(3):
        pace.ended(2, 3.0, 1.0)
    # Pooled by seconds: (3 + 9) / (6 + 3); degree 2's own, clamped to at most 4.
    assert (pace.of(1), pace.of(2), pace.pooled) == (0.5, 3.0, pytest.approx(12 / 9))
    pace.ended(2, 100.0, 1.0)
    assert pace.of(2) == 4.0
    pace.ended(1, 0.0, 1.0)  # unusable: ignored
    pace.ended(1, 1.0, 0.0)
    assert pace.of(1) == 0.5


def test_a_pace_within_rounding_of_the_profile_is_the_profile() -> None:
    pace = Pace(decay=1.0, min_samples=1.0)
    pace.ended(1, 0.1 + 0.2, 0.3)  # (0.30000000000000004 over 0.3)
    assert pace.of(1) == 1.0
