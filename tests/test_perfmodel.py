"""Execution-time model: formula, fitting (recovery of known coefficients), profiles,
and the ``fit`` command's sample-file validation."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from vertumnus.__main__ import main
from vertumnus.engine.messages import RankReady
from vertumnus.perfmodel import (
    DegreeCoeffs,
    Profile,
    ProfileError,
    Sample,
    attention_work,
    fit_degree,
    fit_profile,
    mape,
    read_samples_csv,
)

# Coefficients of a made-up accelerator, of the magnitudes a real profile has.
TRUE = {
    1: DegreeCoeffs(d=0.02, a=0.0, b=2e-7, c=6e-5, alpha=4e-10),
    2: DegreeCoeffs(d=0.03, a=4e-6, b=2e-7, c=6e-5, alpha=4e-10),
    4: DegreeCoeffs(d=0.05, a=8e-6, b=3e-7, c=6e-5, alpha=4e-10),
}


def make_samples(noise: float, seed: int) -> list[Sample]:
    """A grid over input length and prefix-hit ratio, with multiplicative noise."""
    rng = random.Random(seed)
    samples = []
    for degree, coeffs in TRUE.items():
        for length in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
            for hit in (0.0, 0.25, 0.5, 0.75):
                p = int(length * hit) // 16 * 16
                r = length - p
                seconds = coeffs.predict(degree, r, p) * (1 + rng.gauss(0, noise))
                samples.append(Sample(degree, r, p, seconds))
    return samples


def test_attention_work_and_prediction_by_hand():
    assert attention_work(1, 0) == 1
    assert attention_work(4, 10) == 4 * 10 + 10
    c = DegreeCoeffs(d=1.0, a=2.0, b=3.0, c=4.0, alpha=5.0)
    # 1 + 2*4 + 3*10 + (4*4 + 5*50) / 2
    assert c.predict(2, 4, 10) == 1 + 8 + 30 + (16 + 250) / 2


def test_exact_samples_give_back_the_coefficients():
    samples = make_samples(noise=0.0, seed=0)
    for degree, true in TRUE.items():
        fitted = fit_degree([s for s in samples if s.cp_degree == degree])
        assert mape(fitted, [s for s in samples if s.cp_degree == degree]) < 1e-6
        for name in ("d", "b", "alpha"):
            assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-3)
        # a*R and c*R/C are one column within a degree: the fit reports it all as c.
        assert fitted.a == 0.0
        assert fitted.c / degree == pytest.approx(true.a + true.c / degree, rel=1e-3)


def test_noisy_samples_recover_the_coefficients_that_matter():
    samples = make_samples(noise=0.03, seed=1)
    profile = fit_profile(samples, model="m", hardware="h", block_size=16)
    assert profile.degrees == [1, 2, 4]
    for degree, true in TRUE.items():
        fitted = profile.coeffs[degree]
        assert fitted.alpha == pytest.approx(true.alpha, rel=0.1)
        assert fitted.d == pytest.approx(true.d, rel=0.2)
        assert profile.mape[degree] < 0.05  # 3 % noise: the fit is as good as the data
        # Predictions stay within 10 % of the true model across the grid.
        for s in samples:
            if s.cp_degree == degree:
                want = true.predict(degree, s.uncached_tokens, s.cached_tokens)
                got = fitted.predict(degree, s.uncached_tokens, s.cached_tokens)
                assert got == pytest.approx(want, rel=0.1)


def test_predictions_are_monotone_in_length_and_speed_up_long_inputs_with_degree():
    profile = fit_profile(make_samples(noise=0.0, seed=0), "m", "h", 16)
    for degree in profile.degrees:
        times = [profile.predict(degree, r, 0) for r in range(1000, 70000, 1000)]
        assert all(t1 < t2 for t1, t2 in itertools.pairwise(times))
    long_times = [profile.predict(c, 65536, 0) for c in (1, 2, 4)]
    assert long_times[0] > long_times[1] > long_times[2]
    # For a short input the start-up cost dominates: C=4 is no faster than C=1.
    assert profile.predict(4, 64, 0) > profile.predict(1, 64, 0)


def test_coefficients_must_be_non_negative():
    with pytest.raises(ProfileError, match="coefficient alpha must be finite and >= 0"):
        DegreeCoeffs(alpha=-1e-9)


def test_profile_round_trips_through_json(tmp_path: Path):
    profile = fit_profile(make_samples(0.0, 0), "qwen", "cpu", 16, provenance={"command": "x"})
    profile.capacity[2] = {"kappa_s": 12.5, "window_s": 10.0}
    path = tmp_path / "p.json"
    profile.save(path)
    raw = json.loads(path.read_text())
    assert set(raw["degrees"]["2"]) == {"d", "a", "b", "c", "alpha"}
    back = Profile.load(path)
    assert back.coeffs == profile.coeffs
    assert back.mape == profile.mape
    assert back.capacity == {2: {"kappa_s": 12.5, "window_s": 10.0}}
    assert back.provenance == {"command": "x"}
    with pytest.raises(ProfileError, match="has no degree 8"):
        back.predict(8, 10, 0)


def write_csv(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "samples.csv"
    path.write_text(body)
    return path


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("deg,r,p,s\n1,2,3,4\n", r"samples.csv:1: expected the header"),
        (
            "degree,uncached_tokens,cached_tokens,seconds\n1,100,0,0.5\n1,100,0\n",
            r"samples.csv:3: expected 4 fields, got 3",
        ),
        (
            "degree,uncached_tokens,cached_tokens,seconds\n1,1e3,0,0.5\n",
            r"samples.csv:2: degree and token counts must be integers",
        ),
        (
            "degree,uncached_tokens,cached_tokens,seconds\n1,100,0,0.5\n0,100,0,0.5\n",
            r"samples.csv:3: need degree >= 1",
        ),
        (
            "degree,uncached_tokens,cached_tokens,seconds\n2,100,0,-1\n",
            r"samples.csv:2: seconds must be a positive number",
        ),
        (
            "degree,uncached_tokens,cached_tokens,seconds\n2,100,0,nan\n",
            r"samples.csv:2: seconds must be a positive number",
        ),
        ("degree,uncached_tokens,cached_tokens,seconds\n", r"samples.csv: no samples"),
    ],
)
def test_bad_sample_files_are_rejected_with_the_line(tmp_path: Path, body: str, message: str):
    with pytest.raises(ProfileError, match=message):
        read_samples_csv(write_csv(tmp_path, body))


def test_fit_command_writes_a_profile_and_prints_mape(tmp_path: Path, capsys):
    rows = "\n".join(
        f"{s.cp_degree},{s.uncached_tokens},{s.cached_tokens},{s.seconds!r}"
        for s in make_samples(0.02, 3)
    )
    path = write_csv(tmp_path, "degree,uncached_tokens,cached_tokens,seconds\n" + rows + "\n")
    out = tmp_path / "profile.json"
    assert main(["fit", "--samples", str(path), "--out", str(out), "--model", "m"]) == 0
    printed = capsys.readouterr().out
    assert "degree 1: 32 samples, MAPE " in printed and "degree 4: 32 samples" in printed
    profile = Profile.load(out)
    assert profile.degrees == [1, 2, 4] and profile.model == "m"
    assert profile.provenance["samples"] == str(path)


def test_fit_command_reports_a_bad_row_as_a_usage_error(tmp_path: Path, capsys):
    path = write_csv(tmp_path, "degree,uncached_tokens,cached_tokens,seconds\n1,x,0,1\n")
    assert main(["fit", "--samples", str(path), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "samples.csv:2:" in err and "Traceback" not in err


def test_profile_holds_out_a_checkerboard_of_the_grid():
    from vertumnus.runtime.profiling import checkerboard_split

    lengths, hits = (128, 256, 512), (0.0, 0.25, 0.5, 0.75)
    samples = [
        Sample(c, n - int(n * h), int(n * h), 1.0) for c in (1, 2) for n in lengths for h in hits
    ]
    fitted, held_out = checkerboard_split(samples, len(lengths), len(hits))
    assert len(fitted) == len(held_out) == 12
    assert set(fitted).isdisjoint(held_out)
    for half in (fitted, held_out):
        for c in (1, 2):
            mine = [s for s in half if s.cp_degree == c]
            # Every length and every hit ratio is in both halves, for every degree.
            assert {s.uncached_tokens + s.cached_tokens for s in mine} == set(lengths)
            assert {s.cached_tokens / (s.uncached_tokens + s.cached_tokens) for s in mine} == set(
                hits
            )
    # Neighbours in the grid fall in different halves.
    assert samples[0] in fitted and samples[1] in held_out and samples[4] in held_out


@pytest.mark.parametrize("name", ["kv_bytes_per_token", "d2h_bytes_s", "h2d_bytes_s"])
@pytest.mark.parametrize("value", [0, -5e9, float("nan")])
def test_a_non_positive_host_link_figure_is_refused(name: str, value: float):
    raw = fit_profile(make_samples(0.0, 0), "m", "h", 16).to_json()
    raw["host_link"] = {"kv_bytes_per_token": 2048, "d2h_bytes_s": 1e9, "h2d_bytes_s": 1e9}
    raw["host_link"][name] = value
    with pytest.raises(ProfileError, match=f"p.json: host_link.{name} must be a positive number"):
        Profile.from_json(raw, source="p.json")


class _FakeRanks:
    """``ChildRanks`` for the ``profile`` command without rank processes."""

    def __init__(self, *args: Any, world_size: int, **kwargs: object) -> None:
        self.degree = world_size
        layers = "eager" if args[2].compile == "off" else "compiled"  # (model, dir, engine)
        self.ready = [RankReady(0, "cpu", 0, layers)]

    def __enter__(self) -> _FakeRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _FakeClient:
    """``PrefillClient``: a fresh worker reuses the tokens it prefilled last, and takes
    the time ``TRUE[2]`` predicts."""

    def __init__(self, pool: _FakeRanks, ranks: tuple[int, ...]) -> None:
        self.degree, self.seen = len(ranks), 0

    def prefill(self, tokens: list[int]) -> object:
        cached, self.seen = self.seen, len(tokens)
        r = len(tokens) - cached
        seconds = TRUE[2].predict(self.degree, r, cached)
        fields = {"computed_tokens": r, "cached_tokens": cached, "prefill_s": seconds}
        return type("Outcome", (), fields)()


def test_the_profile_command_writes_the_measured_host_link(tmp_path: Path, monkeypatch, capsys):
    """The ``profile`` command's code path (grid, fit, host link, save) on fake ranks:
    the profile it writes carries the host link measured for the tiny model, and
    ``Profile.load`` reads the same figures back."""
    from vertumnus.runtime import host_link, prefill, ranks

    measured: list[dict] = []
    measure = host_link.measure_host_link

    def small(*args, **kwargs):  # the real measurement, on 1 MiB
        link = measure(*args, **kwargs, total_bytes=1 << 20, repeats=2)
        measured.append(link)
        return link

    monkeypatch.setattr(ranks, "ChildRanks", _FakeRanks)
    monkeypatch.setattr(prefill, "PrefillClient", _FakeClient)
    monkeypatch.setattr(host_link, "measure_host_link", small)
    out = tmp_path / "profile.json"
    args = ["profile", "--degrees", "1,2", "--lengths", "64,128,256,512", "--device", "cpu"]
    args += ["--dtype", "float32", "--compile", "off"]
    assert main([*args, "--hit-ratios", "0,0.5", "--repeats", "1", "--out", str(out)]) == 0
    assert "host link: device-to-host " in capsys.readouterr().out
    assert len(measured) == 1
    raw = json.loads(out.read_text())
    assert raw["host_link"] == measured[0]
    assert raw["host_link"]["kv_bytes_per_token"] == 2048  # tiny, fp32
    assert raw["provenance"]["dtype"] == "float32" and raw["provenance"]["layers"] == "eager"
    assert raw["host_link"]["source"].startswith("measured by `profile` on cpu-")
    back = Profile.load(out)
    assert back.host_link == measured[0]
    assert back.degrees == [1, 2]
