"""The execution-time model of DeepSeek-V4's compressed attention: each kind's closed
form against a brute-force count over the queries, W(L - P, P) = F(L) - F(P), the mix
of a model's layers, the mix in a profile's JSON (old profiles read and written as
before), the reuse curve built on it, and the derived DeepSeek-V4-Flash profile."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vertumnus.attention_work import CSA, HCA
from vertumnus.perfmodel import (
    FULL,
    AttentionMix,
    Compressed,
    DegreeCoeffs,
    Profile,
    ProfileError,
    window_work,
)
from vertumnus.policy.costs import ReuseCurve

SMALL = (
    Compressed(window=8, ratio=4, topk=3, index_weight=0.25),
    Compressed(window=5, ratio=3, topk=None, index_weight=0.0),
    Compressed(window=1, ratio=1, topk=1, index_weight=0.5),
    Compressed(window=16, ratio=8, topk=100, index_weight=0.125),
)
V4_MIX = AttentionMix.of_layers([HCA, HCA, *[CSA, HCA] * 20, HCA])


def brute_work(kind: Compressed, r: int, p: int) -> float:
    """Sum over the queries at positions p..p+r-1 of what each one reads: its window's
    keys, its (top-k of the) compressed entries it sees, and the indexer's scores."""
    total = 0.0
    for t in range(p, p + r):
        seen = (t + 1) // kind.ratio
        keys = sum(1 for j in range(t + 1) if t - kind.window < j)
        read = seen if kind.topk is None else min(kind.topk, seen)
        total += keys + read + (kind.index_weight * seen if kind.topk is not None else 0)
    return total


@pytest.mark.parametrize("kind", SMALL, ids=str)
def test_closed_form_matches_brute_force(kind: Compressed) -> None:
    for r in range(1, 41):
        for p in range(0, 41):
            assert kind.work(r, p) == pytest.approx(brute_work(kind, r, p), abs=1e-9), (r, p)


def test_deepseek_v4_kinds_match_brute_force_past_their_knees() -> None:
    rng = random.Random(7)  # CSA reads 512 entries once a query sees them (2,048 tokens)
    for _ in range(12):
        r, p = rng.randint(1, 600), rng.choice([0, 1, 127, 128, 2047, 2048, rng.randint(0, 5000)])
        for kind in (CSA, HCA):
            assert kind.work(r, p) == pytest.approx(brute_work(kind, r, p), rel=1e-12)


@given(
    kind=st.sampled_from([*SMALL, CSA, HCA]),
    prefix=st.integers(0, 20_000),
    first=st.integers(1, 20_000),
    second=st.integers(1, 20_000),
)
def test_work_is_a_difference_of_prefix_functions(
    kind: Compressed, prefix: int, first: int, second: int
) -> None:
    """W(L - P, P) = F(L) - F(P), so W splits at any point and W(L, 0) = F(L)."""
    whole = kind.work(first + second, prefix)
    assert whole == pytest.approx(
        kind.prefix_work(prefix + first + second) - kind.prefix_work(prefix)
    )
    assert whole == pytest.approx(kind.work(first, prefix) + kind.work(second, prefix + first))
    assert kind.work(first, 0) == kind.prefix_work(first)


def test_deepseek_v4_work_per_query() -> None:
    """Far past the knees: the window's 128 keys, CSA's 512 entries and its indexer's
    (t+1)/4 scores at a quarter of a pair, HCA's (t+1)/128 entries."""
    t = 1_000_000
    assert CSA.work(1, t) == 128 + 512 + 0.25 * ((t + 1) // 4)
    assert HCA.work(1, t) == 128 + (t + 1) // 128
    assert V4_MIX.groups == ((20 / 43, CSA), (23 / 43, HCA))
    full = FULL.work(65_536, 0)
    assert V4_MIX.work(65_536, 0) < full / 20  # about 95M against 2.1G pairs per layer


def test_old_kinds_are_unchanged() -> None:
    mix = AttentionMix(((0.5, None), (0.5, 128)))
    assert mix.work(1000, 300) == 0.5 * (1000 * 300 + 1000 * 1001 / 2) + 0.5 * window_work(
        1000, 300, 128
    )
    assert AttentionMix.of_windows([None, 128, None, 64]) == AttentionMix(
        ((0.5, None), (0.25, 64), (0.25, 128))
    )
    assert AttentionMix.of_layers([HCA, 128, None, CSA]).groups == (
        (0.25, None),
        (0.25, 128),
        (0.25, CSA),
        (0.25, HCA),
    )


def test_invalid_kinds_are_refused() -> None:
    with pytest.raises(ProfileError, match="needs a topk"):
        Compressed(ratio=128, topk=None)  # the default index_weight: an indexer
    for bad in (dict(window=0), dict(ratio=0), dict(topk=0), dict(index_weight=-1.0)):
        with pytest.raises(ProfileError):
            Compressed(**bad)  # type: ignore[arg-type]
    with pytest.raises(ProfileError):
        AttentionMix(((1.0, "csa"),))  # type: ignore[arg-type]


def profile_with(mix: AttentionMix) -> Profile:
    coeffs = {
        c: DegreeCoeffs(d=0.01 * c, a=1e-6, b=1e-8, c=1e-5, alpha=1e-9, attention=mix)
        for c in (1, 4, 8)
    }
    return Profile("m", "h", 512, coeffs)


def test_json_round_trip() -> None:
    raw = json.loads(json.dumps(profile_with(V4_MIX).to_json()))
    assert raw["attention"]["groups"] == [
        [20 / 43, {"window": 128, "ratio": 4, "topk": 512, "index_weight": 0.25}],
        [23 / 43, {"window": 128, "ratio": 128, "topk": None, "index_weight": 0.0}],
    ]
    back = Profile.from_json(raw)
    assert back.attention == V4_MIX
    assert back.predict(4, 30_000, 2_000) == profile_with(V4_MIX).predict(4, 30_000, 2_000)
    with pytest.raises(ProfileError, match="attention"):
        Profile.from_json({**raw, "attention": {"groups": [[1.0, {"ratio": 4, "k": 5}]]}})


def test_old_profiles_read_and_write_as_before() -> None:
    windows = {"groups": [[0.5, None], [0.5, 128]]}
    raw = profile_with(FULL).to_json()
    assert "attention" not in raw
    assert Profile.from_json(raw).attention == FULL
    windowed = Profile.from_json({**raw, "attention": windows})
    assert windowed.to_json()["attention"] == windows
    shipped = Profile.load("qwen3-30b-a3b-h100")
    assert shipped.attention == FULL
    assert shipped.predict(4, 65_536, 0) == pytest.approx(shipped.predict(1, 65_536, 0) / 2.71)


def test_reuse_benefit_does_not_depend_on_the_input_length() -> None:
    coeffs = profile_with(V4_MIX).coeffs[4]
    curve = ReuseCurve(4, coeffs)
    for p1, p2 in ((0, 512), (1_536, 2_560), (10_240, 70_144)):
        saved = [curve.time_s(n, p1) - curve.time_s(n, p2) for n in (p2, p2 + 999, p2 + 60_000)]
        assert saved == pytest.approx([curve.benefit_s(p1, p2)] * 3)
        assert curve.time_s(p2 + 7, p1) == pytest.approx(coeffs.predict(4, p2 + 7 - p1, p1))


def test_the_derived_profile_carries_the_model_mix() -> None:
    profile = Profile.load("deepseek-v4-flash-h100")
    assert profile.attention == V4_MIX
    assert profile.block_size == 512
    assert all(k in profile.capacity for k in (4, 8))
    speedup = {c: profile.predict(1, 65_536, 0) / profile.predict(c, 65_536, 0) for c in (4, 8)}
    assert 1.5 < speedup[4] < speedup[8] < 8


def test_deepseek_v4_flash_config_counts_the_shipped_profile_s_work() -> None:
    """The served model's mix (``config.model.attention_mix`` of V4-Flash's config, as
    transformers defaults it) is the shipped profile's: the coordinator then predicts
    with the work the profile was derived for."""
    import transformers

    from vertumnus.config import ModelConfig
    from vertumnus.config.model import attention_mix
    from vertumnus.perfmodel import Profile

    raw = {**transformers.DeepseekV4Config().to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}
    assert (
        attention_mix(ModelConfig.from_hf_dict(raw))
        == Profile.load("deepseek-v4-flash-h100").attention
    )
