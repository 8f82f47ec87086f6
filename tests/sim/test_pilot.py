"""A scenario's load against the saturation its pilots measure (``sim/pilot.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from vertumnus.sim import scenarios
from vertumnus.sim.pilot import calibrated, realised_reuse, rescaled


def conversation_seed() -> int:
    return next(s for s in scenarios.REPORT_SEEDS if scenarios.draw(s).family == "conversation")


def test_the_pilots_lower_the_saturation_to_the_reuse_a_pool_realises() -> None:
    drawn = scenarios.draw(conversation_seed())
    share = realised_reuse(drawn, 0.5 * drawn.saturation_rate, pilot_s=30.0)
    assert 0.0 < share < 1.0  # bounded caches and queued turns reuse less
    found = calibrated(drawn, pilot_s=30.0)
    assert found.saturation_rate < drawn.saturation_rate
    # the load is kept: the rates scale with the saturation
    assert found.load == drawn.load
    assert found.peak_rate == pytest.approx(found.load * found.saturation_rate, rel=1e-9)
    assert found.base_rate / drawn.base_rate == pytest.approx(
        found.saturation_rate / drawn.saturation_rate, rel=1e-9
    )
    # deterministic, and what was found once can be given back without the pilots
    assert calibrated(drawn, pilot_s=30.0) == found
    known = (found.saturation_rate, found.saturation_composition)
    assert calibrated(drawn, known=known) == found


def test_without_reuse_nothing_changes() -> None:
    seed = next(s for s in scenarios.REPORT_SEEDS if scenarios.draw(s).family == "none")
    drawn = scenarios.draw(seed)
    assert realised_reuse(drawn, drawn.saturation_rate, pilot_s=10.0) == 1.0
    assert calibrated(drawn, pilot_s=10.0) == drawn


def test_rescaled_keeps_the_shape() -> None:
    drawn = scenarios.draw(100)
    half = rescaled(drawn, drawn.saturation_rate / 2, "10CP4")
    assert half == dataclasses.replace(
        drawn,
        base_rate=drawn.base_rate / 2,
        second_rate=drawn.second_rate / 2,
        saturation_rate=drawn.saturation_rate / 2,
        saturation_composition="10CP4",
    )
