"""The undisturbed audit's periods: which one is audited, and what is forgotten."""

from __future__ import annotations

from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.periods import Period, Periods
from vertumnus.policy.control.replay_types import ReplayWorker

WORKERS = (ReplayWorker(0, 1, 0.0),)


def period(index: int, start_s: float, undisturbed: bool = True) -> Period:
    return Period(index, start_s, WORKERS, undisturbed)


def arrive(periods: Periods, request_id: int, at_s: float) -> ArrivalSample:
    sample = ArrivalSample(request_id, at_s, 1000)
    periods.arrived(sample)
    return sample


def test_the_latest_answered_undisturbed_period_is_audited_once() -> None:
    periods = Periods()
    periods.open(period(0, 0.0), True)
    arrive(periods, 1, 1.0)
    periods.open(period(1, 10.0), True)
    arrive(periods, 2, 11.0)
    arrive(periods, 3, 12.0)
    periods.open(period(2, 20.0), True)
    assert periods.done(2, 0.0) is None  # nothing answered yet
    periods.completed(1, 0.5)
    periods.completed(2, 0.25)
    assert periods.done(2, 0.0) is not None  # period 0: the only one answered
    periods.completed(3, 0.75)
    latest = periods.done(2, 0.0)
    assert latest is not None and latest.index == 1 and latest.measured_s() == 0.5
    assert periods.done(2, 0.0) is None  # once


def test_a_disturbed_or_cold_period_is_not_audited() -> None:
    periods = Periods()
    periods.open(period(0, 0.0), True)
    arrive(periods, 1, 1.0)
    periods.open(period(1, 10.0, undisturbed=False), False)  # reshaping as 0 closed
    periods.completed(1, 0.5)
    assert periods.done(1, 0.0) is None
    arrive(periods, 2, 11.0)
    periods.open(period(2, 20.0), True)
    periods.completed(2, 0.5)
    assert periods.done(2, 0.0) is None  # period 1 opened reshaping
    arrive(periods, 3, 21.0)
    periods.open(period(3, 30.0), True)
    periods.completed(3, 0.5)
    assert periods.done(3, 25.0) is None  # period 2 began in the cold start
    assert periods.done(3, None) is None  # nothing has arrived: all is cold


def test_a_revised_sample_replaces_the_placed_one() -> None:
    periods = Periods()
    periods.open(period(0, 0.0), True)
    arrive(periods, 1, 1.0)
    revised = ArrivalSample(1, 1.0, 1000, ((0, 512),), 7)
    periods.revised(revised)
    periods.revised(ArrivalSample(9, 1.0, 1000))  # not one of its requests: ignored
    periods.open(period(1, 10.0), True)
    periods.completed(1, 0.5)
    latest = periods.done(1, 0.0)
    assert latest is not None and latest.samples == {1: revised}


def test_a_period_never_answered_is_forgotten() -> None:
    periods = Periods(forget_after=2)
    periods.open(period(0, 0.0), True)
    arrive(periods, 1, 1.0)  # abandoned: never answered
    for index in range(1, 4):
        periods.open(period(index, 10.0 * index), True)
    assert periods.done(3, 0.0) is None
    periods.completed(1, 0.5)  # too late: period 0 is gone
    periods.open(period(4, 40.0), True)
    assert periods.done(4, 0.0) is None
