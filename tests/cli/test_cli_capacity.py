"""``python -m vertumnus capacity``: kappa per degree written into a profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.factories import make_profile
from vertumnus.__main__ import main
from vertumnus.perfmodel import DegreeCoeffs, Profile


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "p.json"
    make_profile(
        {
            1: DegreeCoeffs(d=0.002, c=3e-5, alpha=3e-8, b=3e-6),
            2: DegreeCoeffs(d=0.009, c=4.5e-5, alpha=3e-8, b=5e-6),
        },
        provenance={"command": "profile ..."},
    ).save(path)
    return path


def test_capacity_updates_the_profile_in_place(
    profile_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["capacity", "--profile", str(profile_path), "--length-scale", "0.0625"]
    assert main([*args, "--window-s", "10", "--slo", "4x", "--target", "0.8"]) == 0
    printed = capsys.readouterr().out
    assert "window 10 s, SLO 4x, target 0.8" in printed
    raw = json.loads(profile_path.read_text())
    assert set(raw["capacity"]) == {"1", "2"}
    entry = raw["capacity"]["2"]
    assert entry["window_s"] == 10 and entry["slo"] == "4x" and entry["target_attainment"] == 0.8
    assert entry["mix"] == "builtin:mooncake-conversation*0.0625"
    assert entry["kappa_s"] > 0 and entry["attainment"] >= 0.8
    assert f"{entry['kappa_s']:.3f}" in printed
    assert raw["provenance"]["command"] == "profile ..."  # the fit's provenance stays
    assert raw["provenance"]["capacity"]["length_scale"] == 0.0625
    assert Profile.load(profile_path).coeffs[1].d == 0.002


def test_capacity_from_a_trace_into_another_file(profile_path: Path, tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:17:{s:02d}.0000000,{100 + 37 * s},5" for s in range(40)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows))
    out = tmp_path / "q.json"
    args = ["capacity", "--profile", str(profile_path), "--out", str(out), "--degrees", "1"]
    assert main([*args, "--trace", str(trace), "--slo", "0.5s"]) == 0
    entry = json.loads(out.read_text())["capacity"]["1"]
    assert entry["mix"] == str(trace) and entry["slo"] == "0.5s"
    assert json.loads(profile_path.read_text())["capacity"] == {}  # left as it was


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--degrees", "4"], "has no degree(s) [4]"),
        (["--target", "2"], "target attainment must lie in (0, 1]"),
        (["--length-scale", "-1"], "length scale must be a positive number"),
        (["--trace", "/nonexistent/t.jsonl"], "/nonexistent/t.jsonl"),
        (["--out", "/nonexistent/dir/p.json"], "no directory /nonexistent/dir"),
    ],
)
def test_bad_capacity_arguments(
    profile_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["capacity", "--profile", str(profile_path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_slo_is_a_usage_error(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["capacity", "--profile", str(profile_path), "--slo", "soon"])
    assert exit_info.value.code == 2
    assert "'soon' is not a duration" in capsys.readouterr().err


def test_missing_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--profile", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


def test_a_shipped_profile_is_read_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["capacity", "--profile", "tiny-cpu", "--degrees", "1"]) == 2
    assert "is a shipped profile: give --out FILE" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "mine.json"
    args = ["capacity", "--profile", "tiny-cpu", "--degrees", "1", "--length-scale", "0.0625"]
    assert main([*args, "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())["capacity"]) >= {"1"}
