"""The execution-time model of a model with sliding-window layers: the windowed
attention work against a brute-force count, the mix read from a model config, the mix
in a profile's JSON (and its absence in an old one), and a fit that recovers alpha
only against the model's own work."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vertumnus.__main__ import main
from vertumnus.config import ModelConfig
from vertumnus.config.model import attention_mix
from vertumnus.perfmodel import (
    FULL,
    AttentionMix,
    DegreeCoeffs,
    Profile,
    ProfileError,
    Sample,
    attention_work,
    fit_degree,
    fit_profile,
    mape,
    window_work,
)
from vertumnus.runtime.profiling import Measured, ProfileGrid, fit_measured

SHAPE: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=131_072,
)
GPT_OSS = {
    **SHAPE,
    "architectures": ["GptOssForCausalLM"],
    "sliding_window": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
MISTRAL = {**SHAPE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
HALF_128 = AttentionMix(((0.5, None), (0.5, 128)))


def brute_pairs(r: int, p: int, window: int | None) -> int:
    """Query-key pairs of the queries at positions p..p+r-1: query i sees key j when
    i - window < j <= i (every j <= i without a window)."""
    return sum(1 for i in range(p, p + r) for j in range(i + 1) if window is None or i - window < j)


@given(r=st.integers(0, 60), p=st.integers(0, 80), window=st.none() | st.integers(1, 100))
def test_window_work_counts_the_pairs(r: int, p: int, window: int | None) -> None:
    assert window_work(r, p, window) == brute_pairs(r, p, window)


@given(r=st.integers(0, 5000), p=st.integers(0, 5000), window=st.integers(1, 6000))
def test_window_work_is_the_sum_of_min_position_window(r: int, p: int, window: int) -> None:
    assert window_work(r, p, window) == sum(min(i + 1, window) for i in range(p, p + r))
    # At most the full work, equal to it while no query reaches past the window.
    assert window_work(r, p, window) <= attention_work(r, p)
    if p + r <= window:
        assert window_work(r, p, window) == attention_work(r, p)


def test_window_work_by_hand() -> None:
    # Window 4, prefix 2, 5 new tokens: positions 2..6 see 3, 4, 4, 4, 4 keys.
    assert window_work(5, 2, 4) == 3 + 4 + 4 + 4 + 4
    assert window_work(5, 10, 4) == 5 * 4  # every query past the window
    assert window_work(3, 0, None) == attention_work(3, 0) == 1 + 2 + 3
    assert window_work(0, 7, 4) == 0


@given(r=st.integers(0, 3000), p=st.integers(0, 3000))
def test_a_mix_weighs_its_groups_by_their_share(r: int, p: int) -> None:
    want = 0.5 * attention_work(r, p) + 0.5 * window_work(r, p, 128)
    assert HALF_128.work(r, p) == pytest.approx(want, rel=1e-12)
    # The default mix is exactly the old W: every full profile predicts as before.
    assert FULL.work(r, p) == attention_work(r, p)
    assert AttentionMix().full and not HALF_128.full


def test_the_mix_of_a_model_config() -> None:
    gpt_oss = ModelConfig.from_hf_dict(GPT_OSS)
    assert gpt_oss.windows[:4] == (128, None, 128, None)
    assert attention_mix(gpt_oss) == HALF_128
    assert attention_mix(ModelConfig.from_hf_dict(MISTRAL)) == AttentionMix(((1.0, 4096),))
    qwen3 = ModelConfig.from_hf_dict({**SHAPE, "architectures": ["Qwen3ForCausalLM"]})
    llama = ModelConfig.from_hf_dict({**SHAPE, "architectures": ["LlamaForCausalLM"]})
    assert attention_mix(qwen3) == attention_mix(llama) == FULL
    # Uneven shares: Qwen2 with windows from layer 1 on, 3 layers.
    qwen2 = ModelConfig.from_hf_dict(
        {
            **SHAPE,
            "num_hidden_layers": 3,
            "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": True,
            "sliding_window": 12,
            "max_window_layers": 1,
        }
    )
    mix = attention_mix(qwen2)
    assert [w for _, w in mix.groups] == [None, 12]
    assert [f for f, _ in mix.groups] == pytest.approx([1 / 3, 2 / 3])
    assert mix.work(40, 8) == pytest.approx(
        (brute_pairs(40, 8, None) + 2 * brute_pairs(40, 8, 12)) / 3
    )


def test_mixes_are_validated() -> None:
    for groups in ((), ((0.5, None),), ((1.0, 0),), ((0.0, None), (1.0, 4)), ((1.0, 1.5),)):
        with pytest.raises(ProfileError):
            AttentionMix(groups)  # type: ignore[arg-type]
    assert AttentionMix.of_windows([]) == FULL
    assert AttentionMix.of_windows([8, None, 8, 8]).groups == ((0.25, None), (0.75, 8))


def windowed_profile(mix: AttentionMix = HALF_128) -> Profile:
    coeffs = {
        c: DegreeCoeffs(d=0.01 * c, a=1e-6, b=2e-7, c=5e-5, alpha=4e-9, attention=mix)
        for c in (1, 2)
    }
    return Profile("gpt-oss-like", "h", 16, coeffs, mape={1: 0.01, 2: 0.02})


def test_a_profile_predicts_with_its_mix() -> None:
    profile = windowed_profile()
    coeffs = profile.coeffs[2]
    r, p = 3000, 1000
    want = (
        coeffs.d
        + coeffs.a * r
        + coeffs.b * p
        + (coeffs.c * r + coeffs.alpha * HALF_128.work(r, p)) / 2
    )
    assert profile.predict(2, r, p) == pytest.approx(want, rel=1e-12)
    assert profile.predict(2, r, p) < DegreeCoeffs(
        d=0.02, a=1e-6, b=2e-7, c=5e-5, alpha=4e-9
    ).predict(2, r, p)
    assert profile.attention == HALF_128


def test_profile_json_round_trip_with_and_without_a_mix(tmp_path: Path) -> None:
    windowed = windowed_profile()
    raw = windowed.to_json()
    assert raw["attention"] == {"groups": [[0.5, None], [0.5, 128]]}
    assert set(raw["degrees"]["1"]) == {"d", "a", "b", "c", "alpha"}  # the mix once
    windowed.save(tmp_path / "w.json")
    assert json.loads((tmp_path / "w.json").read_text())["attention"]["groups"][1] == [0.5, 128]
    loaded = Profile.load(tmp_path / "w.json")
    assert loaded.attention == HALF_128
    assert loaded.coeffs == windowed.coeffs
    for r, p in ((1, 0), (100, 50), (5000, 20_000)):
        assert loaded.predict(1, r, p) == windowed.predict(1, r, p)
    full = windowed_profile(FULL)
    assert "attention" not in full.to_json()  # absent: every layer full
    full.save(tmp_path / "f.json")
    assert Profile.load(tmp_path / "f.json").coeffs == full.coeffs
    assert Profile.load(tmp_path / "f.json").attention == FULL


def test_an_old_profile_without_the_field_is_full() -> None:
    for name in ("tiny-cpu", "qwen3-30b-a3b-h100"):
        profile = Profile.load(name)
        assert profile.attention == FULL
        assert all(k.attention == FULL for k in profile.coeffs.values())
        k = profile.coeffs[profile.degrees[0]]
        c = profile.degrees[0]
        want = k.d + k.a * 500 + k.b * 300 + (k.c * 500 + k.alpha * (500 * 300 + 500 * 501 / 2)) / c
        assert profile.predict(c, 500, 300) == pytest.approx(want, rel=1e-12)


def test_malformed_mixes_in_a_profile_are_refused() -> None:
    raw = windowed_profile().to_json()
    for bad in ({"groups": [[0.5, None]]}, {"groups": [[1.0, "128"]]}, {"groups": 3}, {}, []):
        with pytest.raises(ProfileError, match="attention"):
            Profile.from_json({**raw, "attention": bad}, source="p.json")
    mixed = {1: DegreeCoeffs(attention=HALF_128), 2: DegreeCoeffs()}
    with pytest.raises(ProfileError, match="different attention mixes"):
        Profile("m", "h", 16, mixed)


LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
MISTRAL_LIKE = AttentionMix(((1.0, 4096),))


def windowed_samples(
    mix: AttentionMix, alpha: float = 4e-9, noise: float = 0.0, seed: int = 0
) -> list[Sample]:
    """A grid like ``profile``'s, from known coefficients under ``mix``."""
    true = DegreeCoeffs(d=0.02, b=2e-7, c=6e-5, alpha=alpha, attention=mix)
    rng = random.Random(seed)
    samples = []
    for length in LENGTHS:
        for hit in (0.0, 0.25, 0.5, 0.75):
            p = int(length * hit) // 16 * 16
            seconds = true.predict(1, length - p, p) * (1 + rng.gauss(0, noise))
            samples.append(Sample(1, length - p, p, seconds))
    return samples


@pytest.mark.parametrize("mix", [HALF_128, MISTRAL_LIKE])
def test_a_fit_against_the_mix_recovers_alpha(mix: AttentionMix) -> None:
    samples = windowed_samples(mix)
    fitted = fit_degree(samples, mix)
    assert fitted.attention == mix
    assert fitted.alpha == pytest.approx(4e-9, rel=1e-3)
    assert fitted.d == pytest.approx(0.02, rel=1e-3)
    assert fitted.c == pytest.approx(6e-5, rel=1e-3)
    assert mape(fitted, samples) < 1e-6
    # With noise, alpha still comes back.
    noisy = windowed_samples(mix, noise=0.02, seed=3)
    assert fit_degree(noisy, mix).alpha == pytest.approx(4e-9, rel=0.1)


def test_the_full_work_fits_a_window_of_the_requests_length_worse() -> None:
    """Mistral-like (every layer 4096): W grows as 4096 * R past the window, which the
    full W cannot follow: a worse fit on the grid, and a long request far off."""
    samples = windowed_samples(MISTRAL_LIKE)
    as_full, as_mix = fit_degree(samples), fit_degree(samples, MISTRAL_LIKE)
    assert as_full.attention == FULL
    assert mape(as_full, samples) > 0.02 > 1e-6 > mape(as_mix, samples)
    true = DegreeCoeffs(d=0.02, b=2e-7, c=6e-5, alpha=4e-9, attention=MISTRAL_LIKE)
    n = 131_072  # four times the longest sample
    assert as_full.predict(1, n, 0) > 1.15 * true.predict(1, n, 0)
    assert as_mix.predict(1, n, 0) == pytest.approx(true.predict(1, n, 0), rel=1e-3)
    noisy = windowed_samples(MISTRAL_LIKE, noise=0.02, seed=3)
    assert mape(fit_degree(noisy, MISTRAL_LIKE), noisy) < mape(fit_degree(noisy), noisy)


def test_the_full_work_misreads_alpha_of_a_short_window() -> None:
    """gpt-oss-like (half the layers window 128): the windowed layers' pairs grow as
    128 * R, like token-local work, so the full W predicts the grid as well, but only
    with alpha halved and those pairs in c: alpha is no longer the cost of a pair."""
    samples = windowed_samples(HALF_128)
    as_full = fit_degree(samples)
    assert mape(as_full, samples) < 1e-3
    assert as_full.alpha == pytest.approx(4e-9 / 2, rel=0.05)
    assert as_full.c == pytest.approx(6e-5 + 0.5 * 4e-9 * 128, rel=1e-3)  # 128 pairs a token


def test_fit_profile_and_fit_measured_store_the_mix(tmp_path: Path) -> None:
    samples = windowed_samples(HALF_128)
    profile = fit_profile(samples, "m", "h", 16, attention=HALF_128)
    assert profile.attention == HALF_128
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").attention == HALF_128
    # The profiling protocol writes the measured model's mix (``measure`` sets it).
    grid = ProfileGrid(degrees=[1], lengths=(128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768))
    measured = Measured(samples, "h", attention=HALF_128)
    fitted, fit_set, held_out = fit_measured(measured, grid, "m", 16, {})
    assert fitted.attention == HALF_128
    assert fitted.coeffs[1].alpha == pytest.approx(4e-9, rel=1e-3)
    assert fitted.provenance["mape_held_out"]["1"] < 1e-6
    assert len(fit_set) + len(held_out) == len(samples)


def test_the_fit_command_uses_the_model_folders_mix(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "gpt-oss-like"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GPT_OSS))
    path = tmp_path / "s.csv"
    rows = [
        f"{s.cp_degree},{s.uncached_tokens},{s.cached_tokens},{s.seconds!r}"
        for s in windowed_samples(HALF_128)
    ]
    path.write_text("degree,uncached_tokens,cached_tokens,seconds\n" + "\n".join(rows) + "\n")
    out = tmp_path / "p.json"
    assert main(["fit", "--samples", str(path), "--out", str(out), "--model", str(folder)]) == 0
    assert (
        "attention (share of layers, window): [(0.5, None), (0.5, 128)]" in capsys.readouterr().out
    )
    profile = Profile.load(out)
    assert profile.attention == HALF_128
    assert profile.mape[1] < 1e-6
    # A bare name is no model the command can read: every layer full.
    assert main(["fit", "--samples", str(path), "--out", str(out), "--model", "m"]) == 0
    assert Profile.load(out).attention == FULL
