"""The what-if controller's online calibration (``policy/control/calibration.py``): measured
over predicted service per degree and length bucket, the serving path's overhead,
the switch time, and the audit's error. ``decay=1.0`` makes every sum plain."""

from __future__ import annotations

import pytest

from vertumnus.policy.control.calibration import Calibration


def calibration(**kwargs: float) -> Calibration:
    kwargs.setdefault("decay", 1.0)
    kwargs.setdefault("min_samples", 3.0)
    return Calibration((1, 2), **kwargs)  # type: ignore[arg-type]


def test_nothing_measured_is_a_scale_of_one() -> None:
    cal = calibration()
    assert cal.scales() == {1: (1.0,) * 4, 2: (1.0,) * 4}
    assert (cal.overhead_s, cal.error, cal.switch_s) == (0.0, 0.0, 1.0)


def test_a_bucket_with_enough_samples_has_its_own_scale() -> None:
    cal = calibration()
    for _ in range(3):
        cal.prefill(1, 1000, 1.0, 2.0)  # bucket 0, twice the prediction
    # The other buckets of degree 1 borrow its pooled scale; degree 2, with none,
    # degree 1's (the profile is off on this machine at every degree alike).
    assert cal.scales() == {1: (2.0, 2.0, 2.0, 2.0), 2: (2.0,) * 4}


def test_a_thin_bucket_borrows_the_pooled_scale_of_its_degree() -> None:
    cal = calibration()
    for _ in range(3):
        cal.prefill(1, 1000, 1.0, 2.0)  # bucket 0: 3 samples at 2
    for _ in range(2):
        cal.prefill(1, 4096, 1.0, 3.0)  # bucket 1: 2 samples at 3 (under min_samples)
    pooled = (3 * 2.0 + 2 * 3.0) / 5  # 2.4
    assert cal.scales()[1] == pytest.approx((2.0, pooled, pooled, pooled), rel=1e-12)
    # The pooled scale weighs predicted seconds, not samples.
    cal.prefill(1, 40_000, 6.0, 6.0)  # bucket 3: 1 sample at 1, 6 predicted seconds
    pooled = (6.0 + 6.0 + 6.0) / (3.0 + 2.0 + 6.0)
    assert cal.scales()[1] == pytest.approx((2.0, pooled, pooled, pooled), rel=1e-12)


def test_a_degree_with_too_few_samples_stays_at_one_without_a_smaller_measured() -> None:
    cal = calibration()
    cal.prefill(2, 1000, 1.0, 3.0)
    cal.prefill(2, 1000, 1.0, 3.0)  # 2 samples in all, under min_samples:
    # two parts in three of its own against the pool's (1, with too few)
    assert cal.scales() == {1: (1.0,) * 4, 2: pytest.approx((1 + 2 / 3 * 2,) * 4)}
    cal.prefill(2, 1000, 1.0, 3.0)
    # Degree 1, smaller than any measured, keeps its profile: a split is the remedy
    # to overload, and a profile off at the larger degree alone (its
    # communication) would leave the pool stuck in a start too large.
    assert cal.scales() == {1: (1.0,) * 4, 2: (3.0,) * 4}


def test_a_larger_degree_with_too_few_samples_is_no_faster_than_the_smaller_ones() -> None:
    cal = Calibration((1, 2, 4), decay=1.0, min_samples=3.0)
    for _ in range(3):
        cal.prefill(1, 1000, 1.0, 2.0)
    # Degree 2, not run yet, takes degree 1's (a profile is off on a new machine
    # at every degree alike: left at 1 beside a measured 2 it would look twice as
    # fast as it is).
    assert cal.scales()[2] == (2.0,) * 4
    for _ in range(2):
        cal.prefill(2, 1000, 1.0, 4.0)  # under min_samples
    # Degree 2's first two weigh two parts in three against every degree's pooled
    # by predicted seconds, (6 + 8) / 5; degree 4 takes the smaller degrees' pooled.
    assert cal.scales() == {
        1: (2.0,) * 4,
        2: pytest.approx((2.8 + 2 / 3 * (4.0 - 2.8),) * 4, rel=1e-12),
        4: pytest.approx((2.8,) * 4, rel=1e-12),
    }
    cal.prefill(2, 1000, 1.0, 4.0)  # now its own
    assert cal.scales()[2] == (4.0,) * 4


def test_an_unmeasured_larger_degree_is_never_faster_than_its_profile() -> None:
    cal = calibration()
    for _ in range(3):
        cal.prefill(1, 1000, 1.0, 0.5)  # this machine beats the profile
    assert cal.scales() == {1: (0.5,) * 4, 2: (1.0,) * 4}


def test_scales_are_clamped() -> None:
    cal = calibration()
    for _ in range(3):
        cal.prefill(1, 100, 1.0, 10.0)
        cal.prefill(2, 100, 1.0, 0.1)
    assert cal.scales() == {1: (4.0,) * 4, 2: (0.25,) * 4}


def test_unusable_prefills_are_ignored() -> None:
    cal = calibration(min_samples=1.0)
    cal.prefill(8, 100, 1.0, 2.0)  # not a degree of the lattice
    cal.prefill(1, 100, 0.0, 2.0)
    cal.prefill(1, 100, 1.0, 0.0)
    cal.prefill(1, 100, -1.0, 2.0)
    assert cal.scales() == {1: (1.0,) * 4, 2: (1.0,) * 4}


def test_old_prefills_decay() -> None:
    cal = calibration(decay=0.5, min_samples=1.0)
    cal.prefill(1, 100, 1.0, 1.0)
    cal.prefill(1, 100, 1.0, 3.0)
    # measured 0.5 * 1 + 3, predicted 0.5 * 1 + 1
    assert cal.scales()[1][0] == pytest.approx(3.5 / 1.5, rel=1e-12)
    cal.prefill(1, 100, 1.0, 3.0)
    assert cal.scales()[1][0] == pytest.approx((0.5 * 3.5 + 3) / (0.5 * 1.5 + 1), rel=1e-12)


def test_a_decayed_count_below_min_samples_counts_in_part() -> None:
    # With decay 1/2 the count tends to 2 (after 10 samples: 2 - 2**-9), under
    # min_samples: its ratio weighs that many parts in two against the pool's (1).
    cal = calibration(decay=0.5, min_samples=2.0)
    for _ in range(10):
        cal.prefill(1, 100, 1.0, 2.0)
    n = 2 - 2**-9
    assert cal.scales()[1] == pytest.approx((1 + n / 2,) * 4, rel=1e-12)


def test_the_path_overhead_is_a_mean_that_ignores_clock_noise() -> None:
    cal = calibration()
    cal.path_overhead(0.01)
    cal.path_overhead(1e-10)  # under a nanosecond: clock arithmetic, counted as 0
    cal.path_overhead(-1e-12)
    cal.path_overhead(0.03)
    assert cal.overhead_s == pytest.approx(0.04 / 4, rel=1e-12)
    decayed = calibration(decay=0.5)
    decayed.path_overhead(0.01)
    decayed.path_overhead(0.03)
    assert decayed.overhead_s == pytest.approx((0.5 * 0.01 + 0.03) / 1.5, rel=1e-12)


def test_the_switch_time_is_a_running_mean_then_a_decayed_one() -> None:
    cal = calibration(switch_prior_s=1.0)
    expected = [3.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # weights 1, 1/2, 1/3, 1/4, then 1/5 on
    seen = []
    for seconds in (3.0, 1.0, 5.0, 7.0, 9.0, 10.0):
        cal.switch(seconds)
        seen.append(cal.switch_s)
    assert seen == pytest.approx(expected, rel=1e-12)


def test_the_audit_error_is_the_mean_relative_error_of_the_last_few() -> None:
    cal = calibration(audits=3)
    cal.audit(0, 1.1, 1.0)  # 0.1
    cal.audit(1, 0.5, 1.0)  # 0.5
    cal.audit(2, 1.0, 1.0)  # 0
    assert cal.error == pytest.approx(0.2, rel=1e-12)
    cal.audit(3, 2.0, 1.0)  # 1.0: the first one leaves
    assert cal.error == pytest.approx(0.5, rel=1e-12)
    cal.audit(4, 3.0, 0.0)  # nothing measured: no audit
    assert cal.error == pytest.approx(0.5, rel=1e-12)
    assert [a["period"] for a in cal.audit_log] == [0, 1, 2, 3]
    assert cal.audit_log[3] == {"period": 3, "predicted_s": 2.0, "measured_s": 1.0}


def test_the_bias_is_the_signed_mean_of_measured_over_predicted() -> None:
    cal = calibration()
    assert cal.bias == 0.0
    cal.audit(0, 2.0, 1.0)  # twice as slow predicted: -50 %
    cal.audit(1, 1.0, 1.5)  # faster predicted: +50 %
    cal.audit(2, 1.0, 1.25)
    assert cal.bias == pytest.approx((-0.5 + 0.5 + 0.25) / 3, rel=1e-12)


def test_the_audit_log_keeps_the_last_hundred() -> None:
    cal = calibration()
    for k in range(150):
        cal.audit(k, 1.0, 1.0)
    assert [a["period"] for a in cal.audit_log] == list(range(50, 150))


def test_to_json() -> None:
    cal = calibration()
    for _ in range(3):
        cal.prefill(2, 10_000, 3.0, 1.0)  # bucket 2, a third of the prediction
    cal.path_overhead(0.002)
    cal.switch(2.5)
    cal.audit(0, 1.2, 1.0)
    assert cal.to_json() == {
        "scale": {"1": [1.0] * 4, "2": [0.3333] * 4},
        "overhead_s": 0.002,
        "switch_s": 2.5,
        "audit_error": pytest.approx(0.2, rel=1e-12),
        "audit_bias": pytest.approx(1.0 / 1.2 - 1.0, rel=1e-12),  # measured / predicted - 1
    }
