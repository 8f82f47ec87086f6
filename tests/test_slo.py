"""The TTFT SLO: parsing, per-request targets, token-weighted attainment."""

from __future__ import annotations

import math

import pytest

from vertumnus.slo import DEFAULT_TTFT_SLO, SloError, TtftSlo, token_weighted_attainment


def predict(cp_degree: int, uncached: int, cached: int) -> float:
    """A toy E_C: 1 ms per token, halved by C, plus 10 ms start-up per extra rank."""
    return 0.01 * (cp_degree - 1) + 0.001 * (uncached + cached) / cp_degree


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("5x", TtftSlo(scale=5.0)),
        ("2.5x,min=0.5s", TtftSlo(scale=2.5, min_s=0.5)),
        ("3x, min=200ms", TtftSlo(scale=3.0, min_s=0.2)),
        ("2.5s", TtftSlo(scale=None, fixed_s=2.5)),
        ("800ms", TtftSlo(scale=None, fixed_s=0.8)),
        ("4", TtftSlo(scale=None, fixed_s=4.0)),
        ("1e-1s", TtftSlo(scale=None, fixed_s=0.1)),
    ],
)
def test_parse_and_describe_round_trip(text: str, want: TtftSlo) -> None:
    got = TtftSlo.parse(text)
    assert got == want
    assert TtftSlo.parse(got.describe()) == got


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fast", "'fast' is not a duration"),
        ("ax", "'a' is not a number"),
        ("0x", "scale must be a positive number"),
        ("-2s", "is not a duration"),
        ("0s", "the target must be positive"),
        ("2s,min=1s", "a floor applies to a scaled target only"),
        ("5x,max=1s", "expected '<scale>x,min=<seconds>'"),
        ("5x,min=soon", "'soon' is not a duration"),
    ],
)
def test_bad_slos_are_rejected_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(SloError, match=message):
        TtftSlo.parse(text)


def test_exactly_one_form() -> None:
    with pytest.raises(SloError, match="exactly one"):
        TtftSlo(scale=2.0, fixed_s=1.0)
    with pytest.raises(SloError, match="exactly one"):
        TtftSlo(scale=None)


def test_default_is_five_times_the_best_isolated_time() -> None:
    assert DEFAULT_TTFT_SLO.describe() == "5x"
    # 100 tokens: C=1 takes 0.1 s, C=2 0.06 s, C=4 0.055 s -> 5 * 0.055.
    assert DEFAULT_TTFT_SLO.tau_s(100, predict, [1, 2, 4]) == pytest.approx(0.275)
    # 4 tokens: C=1 is best (4 ms) -> 20 ms; a floor lifts it.
    assert DEFAULT_TTFT_SLO.tau_s(4, predict, [1, 2, 4]) == pytest.approx(0.02)
    assert TtftSlo(scale=5, min_s=0.1).tau_s(4, predict, [1, 2, 4]) == 0.1
    assert TtftSlo(scale=None, fixed_s=2.0).tau_s(10**6, predict, [1]) == 2.0
    with pytest.raises(SloError, match="needs the degrees"):
        DEFAULT_TTFT_SLO.tau_s(4, predict, [])


def test_token_weighted_attainment_by_hand() -> None:
    # (tokens, ttft, tau): the long request misses, so 900 of 1000 tokens miss.
    results = [(50, 0.1, 0.2), (900, 3.0, 2.0), (50, 0.2, 0.2)]
    assert token_weighted_attainment(results) == pytest.approx(0.1)
    assert math.isnan(token_weighted_attainment([]))
