"""The what-if controller's forecast (``policy/control/forecast.py``): which recent arrivals
stand for the next period (the horizon, extended to ``min_requests``, never past
``max_horizon_s``), and the Poisson rate-change test that drops older arrivals."""

from __future__ import annotations

import random

import pytest

from vertumnus.policy.control import forecast as forecast_module
from vertumnus.policy.control.forecast import (
    MAX_HOLDERS,
    ArrivalSample,
    Forecast,
    ForecastConfig,
    ForecastWindow,
    make_sample,
)


def sample(rid: int, arrival_s: float, n: int = 100) -> ArrivalSample:
    return ArrivalSample(rid, arrival_s, n, ())


def feed(forecast: Forecast, times: list[float], first_id: int = 0) -> None:
    for k, t in enumerate(times):
        forecast.record(sample(first_id + k, t))


def ids(window: ForecastWindow) -> list[int]:
    return [s.request_id for s in window.samples]


def one_per_second(**config: float) -> Forecast:
    """Arrivals at t = 0, 1, ..., 99 (request id = arrival second): a steady rate."""
    forecast = Forecast(ForecastConfig(**config))  # type: ignore[arg-type]
    feed(forecast, [float(t) for t in range(100)])
    return forecast


def test_the_window_is_the_horizon() -> None:
    forecast = one_per_second(horizon_s=30.0, min_requests=1, max_horizon_s=90.0, recent_s=10.0)
    window = forecast.window(100.0)
    assert ids(window) == list(range(70, 100))
    assert (window.start_s, window.end_s, window.span_s) == (70.0, 100.0, 30.0)
    assert window.rate == 1.0 and not window.rate_changed
    # Everything before now - max_horizon_s is gone, from the deque and from by_id.
    assert len(forecast) == 90 and sorted(forecast.by_id) == list(range(10, 100))


def test_the_window_extends_back_to_min_requests() -> None:
    forecast = one_per_second(horizon_s=30.0, min_requests=50, max_horizon_s=90.0, recent_s=10.0)
    window = forecast.window(100.0)
    assert ids(window) == list(range(50, 100)) and window.start_s == 50.0


def test_the_window_never_extends_past_max_horizon() -> None:
    forecast = one_per_second(horizon_s=30.0, min_requests=1000, max_horizon_s=90.0, recent_s=10.0)
    window = forecast.window(100.0)
    assert ids(window) == list(range(10, 100)) and window.start_s == 10.0


def test_the_window_starts_no_earlier_than_the_first_arrival() -> None:
    forecast = Forecast(ForecastConfig(horizon_s=30.0, min_requests=1, recent_s=10.0))
    feed(forecast, [5.0, 6.0, 7.0])
    window = forecast.window(20.0)
    assert ids(window) == [0, 1, 2]
    assert (window.start_s, window.span_s) == (5.0, 15.0)
    assert window.rate == pytest.approx(3 / 15)


def test_an_empty_forecast() -> None:
    window = Forecast().window(5.0)
    assert window.samples == () and window.span_s == 0.0 and window.rate == 0.0
    assert not window.rate_changed


def test_a_request_placed_late_keeps_its_place() -> None:
    # Request 100 arrived at 5 s but waited (a reshape under way) and was placed, so
    # sampled, after request 19: it stays in that order, inside the window.
    forecast = Forecast(ForecastConfig(horizon_s=10.0, min_requests=1, recent_s=10.0))
    feed(forecast, [float(t) for t in range(20)])
    forecast.record(sample(100, 5.0))
    window = forecast.window(20.0)
    assert ids(window) == [*range(10, 20), 100] and window.start_s == 10.0
    assert forecast.by_id[100].arrival_s == 5.0


def jump_times() -> list[float]:
    """10 req/s on [0, 60), then 40 req/s on [60, 70) (exact, evenly spaced)."""
    return [k / 10 for k in range(600)] + [60 + k / 40 for k in range(400)]


def test_a_rate_jump_drops_the_older_arrivals_now_and_later() -> None:
    config = ForecastConfig(horizon_s=30.0, min_requests=1, max_horizon_s=90.0, recent_s=10.0)
    forecast = Forecast(config)
    feed(forecast, jump_times())
    # Expected in the last 10 s from the 60 s before: 100; seen: 400. |400 - 100| = 300
    # is over 4 sqrt(100) = 40 and over 30 % of 100.
    assert forecast.changes == 0
    window = forecast.window(70.0)
    assert window.rate_changed and forecast.changes == 1  # (the dwell's count)
    assert ids(window) == list(range(600, 1000))
    assert (window.start_s, window.rate) == (60.0, 40.0)
    assert len(forecast) == 400 and min(forecast.by_id) == 600
    # The next window: 40 req/s against the 40 req/s since the change (no new
    # change), and the arrivals before it stay out, whatever min_requests asks.
    feed(forecast, [70 + k / 40 for k in range(400)], first_id=1000)
    later = forecast.window(80.0)
    assert not later.rate_changed and forecast.changes == 1
    assert ids(later) == list(range(600, 1400)) and later.start_s == 60.0


def test_after_a_change_min_requests_cannot_reach_behind_it() -> None:
    config = ForecastConfig(horizon_s=30.0, min_requests=5000, max_horizon_s=90.0, recent_s=10.0)
    forecast = Forecast(config)
    feed(forecast, jump_times())
    window = forecast.window(70.0)
    assert window.rate_changed and ids(window) == list(range(600, 1000))


def test_a_rate_drop_fires_too() -> None:
    forecast = Forecast(ForecastConfig(horizon_s=30.0, min_requests=1, recent_s=10.0))
    feed(forecast, [k / 40 for k in range(2400)] + [60 + k / 10 for k in range(100)])
    window = forecast.window(70.0)
    assert window.rate_changed and ids(window) == list(range(2400, 2500))


@pytest.mark.parametrize(("recent_rate", "fires"), [(1200, False), (1400, True)])
def test_a_significant_change_must_also_be_large(recent_rate: int, fires: bool) -> None:
    # 1000 req/s for 10 s, then ``recent_rate`` for the last second: expected 1000,
    # 4 sigma = 126.5, 30 % = 300. A gap of 200 is significant but small; 400 is both.
    config = ForecastConfig(horizon_s=5.0, min_requests=1, max_horizon_s=20.0, recent_s=1.0)
    forecast = Forecast(config)
    feed(
        forecast,
        [k / 1000 for k in range(10_000)] + [10 + k / recent_rate for k in range(recent_rate)],
    )
    assert forecast.window(11.0).rate_changed is fires


def test_too_little_history_is_no_change() -> None:
    # The older span (5 s) is shorter than recent_s (10 s): no test, whatever the jump.
    forecast = Forecast(ForecastConfig(horizon_s=30.0, min_requests=1, recent_s=10.0))
    feed(forecast, [k / 10 for k in range(50)] + [5 + k / 100 for k in range(1000)])
    assert not forecast.window(15.0).rate_changed


@pytest.mark.parametrize("seed", range(5))
def test_a_steady_poisson_stream_never_fires(seed: int) -> None:
    rng = random.Random(seed)
    config = ForecastConfig(horizon_s=30.0, min_requests=100, max_horizon_s=90.0, recent_s=10.0)
    forecast = Forecast(config)
    t, rid, fired = 0.0, 0, []
    for now in range(10, 301, 10):  # a decision every 10 s over 300 s at 20 req/s
        while True:
            t += rng.expovariate(20.0)
            if t >= now:
                break
            forecast.record(sample(rid, t))
            rid += 1
        fired.append(forecast.window(float(now)).rate_changed)
        forecast.record(sample(rid, t))
        rid += 1
    assert fired == [False] * 30
    # Nothing was dropped but what max_horizon_s drops.
    assert min(s.arrival_s for s in forecast.by_id.values()) >= 300 - 90


def test_a_rate_change_frees_what_it_drops_a_step_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The jump of the test above: the 600 samples before the floor at 60 s leave
    # ``by_id`` and every window at once, as there; their memory is freed 250 a
    # window at most and two a record, each id passed to ``forget`` once, in order.
    monkeypatch.setattr(forecast_module, "FREE_STEP", 250)
    forgotten: list[int] = []
    config = ForecastConfig(horizon_s=30.0, min_requests=1, max_horizon_s=90.0, recent_s=10.0)
    forecast = Forecast(config, forget=forgotten.append)
    feed(forecast, jump_times())
    assert forecast.window(70.0).rate_changed
    assert len(forecast) == 400 and min(forecast.by_id) == 600
    assert forgotten == list(range(250))
    t, rid = 70.0, 1000
    for _ in range(3):
        assert ids(forecast.long_window(t)) == list(range(600, rid))
        feed(forecast, [t + k / 40 for k in range(40)], first_id=rid)
        t, rid = t + 1.0, rid + 40
        window = forecast.window(t)
        assert not window.rate_changed and ids(window)[0] == 600
        assert sorted(forecast.by_id) == list(range(600, rid)) and len(forecast) == rid - 600
    assert forgotten == list(range(600))


def test_by_id_holds_exactly_the_kept_samples() -> None:
    forecast = Forecast(ForecastConfig(horizon_s=10.0, min_requests=1, max_horizon_s=20.0))
    feed(forecast, [float(t) for t in range(50)])
    forecast.window(50.0)
    assert sorted(forecast.by_id) == list(range(30, 50))
    assert forecast.by_id[30] == sample(30, 30.0) and 29 not in forecast.by_id


@pytest.mark.parametrize(
    "bad",
    [
        dict(recent_s=0.0),
        dict(recent_s=31.0),  # longer than horizon_s
        dict(horizon_s=100.0),  # longer than max_horizon_s
        dict(min_requests=0),
        dict(change_sigma=0.0),
        dict(change_fraction=-0.1),
    ],
)
def test_bad_configs(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ForecastConfig(**bad)  # type: ignore[arg-type]


def test_edge_configs_are_accepted() -> None:
    config = ForecastConfig(horizon_s=5.0, max_horizon_s=5.0, recent_s=5.0, change_fraction=0)
    assert (config.recent_s, config.horizon_s, config.max_horizon_s) == (5.0, 5.0, 5.0)


# -- samples --------------------------------------------------------------------------------


def test_a_prefix_every_worker_holds_becomes_the_floor() -> None:
    sampled = make_sample(7, 1.5, 100, [(0, 32), (1, 64), (2, 48)], 3, 99)
    assert (sampled.request_id, sampled.arrival_s, sampled.input_tokens) == (7, 1.5, 100)
    assert sampled.floor_tokens == 32 and sampled.prefix_key == 99
    assert sampled.holders == ((1, 64), (2, 48))  # above the floor, longest first
    # A fourth worker holds nothing: no floor, every holder kept.
    partial = make_sample(7, 1.5, 100, [(0, 32), (1, 64), (2, 48)], 4, 99)
    assert partial.floor_tokens == 0 and partial.holders == ((1, 64), (2, 48), (0, 32))
    assert make_sample(7, 1.5, 100, [], 4, 0).holders == ()


def test_only_the_longest_holders_are_kept() -> None:
    assert MAX_HOLDERS == 4
    reusable = [(5, 16), (3, 64), (4, 32), (1, 64), (2, 48), (0, 16)]
    sampled = make_sample(1, 0.0, 100, reusable, 8, 1)
    # longest first, ties to the lower worker
    assert sampled.holders == ((1, 64), (3, 64), (2, 48), (4, 32))


def test_the_draw_depends_on_length_prefix_and_arrival_not_on_the_id() -> None:
    # The drivers number requests apart but see the same arrival millisecond.
    a, b = ArrivalSample(1, 0.0, 100, (), 5), ArrivalSample(2, 1e-9, 100, (), 5)
    assert a.draw == b.draw and 0.0 <= a.draw < 1.0
    assert ArrivalSample(1, 9.0, 100, (), 5).draw != a.draw  # identical requests apart
    assert ArrivalSample(1, 0.0, 101, (), 5).draw != a.draw
    assert ArrivalSample(1, 0.0, 100, (), 6).draw != a.draw
    draws = [ArrivalSample(k, 0.0, 100 + k, (), k).draw for k in range(2000)]
    assert 0.45 < sum(draws) / len(draws) < 0.55


def test_a_start_that_reuses_more_revises_the_sample_in_place() -> None:
    forecast = Forecast()
    forecast.record(make_sample(1, 0.0, 1000, [(2, 256)], 4, 11, matched_tokens=256))
    forecast.record(make_sample(2, 0.5, 1000, [], 4, 0))
    forecast.record(make_sample(3, 1.0, 1000, [], 4, 0))
    # r2 waited behind the prefill that computed its prefix at worker 3: it reused 512.
    assert forecast.revise(2, 3, 512, 21)
    revised = forecast.by_id[2]
    assert (revised.holders, revised.prefix_key, revised.matched_tokens) == (((3, 512),), 21, 512)
    assert ids(forecast.window(2.0)) == [1, 2, 3]
    assert forecast.window(2.0).samples[1] is revised
    # r1 reused more at worker 0 than its sample held anywhere: both holders kept.
    assert forecast.revise(1, 0, 384, 12)
    assert forecast.by_id[1].holders == ((0, 384), (2, 256))
    # No more than its sample holds there, or an unknown request: unchanged.
    before = forecast.by_id[1]
    assert not forecast.revise(1, 2, 256, 11) and not forecast.revise(1, 0, 128, 11)
    assert not forecast.revise(9, 0, 512, 1)
    assert forecast.by_id[1] is before


def test_reuse_at_the_floor_is_no_revision() -> None:
    forecast = Forecast()
    forecast.record(make_sample(1, 0.0, 1000, [(0, 128), (1, 128)], 2, 5))
    assert forecast.by_id[1].floor_tokens == 128
    assert not forecast.revise(1, 0, 128, 5)


def test_a_thinned_window_is_the_window_filtered_by_draw() -> None:
    """Through records, revisions (which move a sample's draw with its prefix key),
    trims and the compaction of the trimmed head, the strata give exactly the samples
    of the window whose draw is under ``keep``, in order, at every keep."""
    rng = random.Random(7)
    forecast = Forecast(ForecastConfig(horizon_s=30.0, min_requests=50, max_horizon_s=60.0))
    rid, t, checked, revised = 0, 0.0, 0, 0
    for step in range(60):
        for _ in range(rng.randint(100, 400)):
            t += rng.expovariate(40.0)
            late = max(0.0, t - rng.uniform(0, 2))  # placed after waiting: out of order
            forecast.record(ArrivalSample(rid, late, rng.randint(10, 9000), (), rng.randint(0, 99)))
            rid += 1
        for _ in range(20):
            victim = rng.randrange(max(0, rid - 500), rid)
            revised += forecast.revise(victim, rng.randint(0, 7), 10_000, rng.randint(1, 10**9))
        now = t + 0.5
        window = forecast.window(now) if step % 2 else forecast.long_window(now)
        every = window.samples
        assert len(every) == window.count
        for keep in (1.0, 0.9, 0.5, 0.3, 0.1, 0.01, 0.002, 1e-5):
            assert window.thinned(keep) == [s for s in every if s.draw < keep]
            checked += 1
    assert forecast._base > 0  # the head was compacted at least once
    assert checked == 480 and revised > 500
