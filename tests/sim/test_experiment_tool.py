"""``tools/experiments/sim_experiment.py``: the fixed sweep, the comparison against
the best fixed composition, and the decisions each run writes (a tiny generated
workload)."""

from __future__ import annotations

import csv
import json
import math
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from support.tools import load_tool
from vertumnus.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("experiments/sim_experiment.py")


CONFIG = """
[experiment]
sweep_fixed = true
variants = [
  { label = "vertumnus", preset = "vertumnus", pool = { composition = "auto", ranks = 16 } },
  { label = "fixed (start)", preset = "fixed" },
]

[pool]
composition = "4CP4"
degrees = [4, 8]
start_rate = 6.0  # what "auto" starts from: the built-in mix at the first phase's rate

[workload]
seed = 5
phases = [
  { duration_s = 40, rate = 6.0, long_fraction = 0.02 },
  { duration_s = 40, rate = 2.0, long_fraction = 0.4 },
]

[sim]
seed = 5
"""


def mean_of(row: dict[str, Any]) -> float:
    return float(row["mean_ttft_s"])


def test_sweep_and_best_fixed_and_decisions(tool: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG)
    out = tool.run_experiment(path, tmp_path / "out", echo=False)
    comparison = json.loads((out / "comparison.json").read_text())
    runs = comparison["runs"]
    # The file's fixed variant already runs 4CP4: the sweep adds the other two, in the
    # lattice's order, "/" written "-".
    assert [r["label"] for r in runs] == [
        "vertumnus",
        "fixed (start)",
        "fixed 2CP8",
        "fixed 2CP4-1CP8",
    ]
    assert [r["composition_start"] for r in runs[1:]] == ["4CP4", "2CP8", "2CP4/1CP8"]
    assert all(r["reshapes"] == r["splits"] + r["merges"] for r in runs)

    best = comparison["against_best_fixed"]
    assert [e["phase"] for e in best] == [None, 0, 1]
    fixed = [r for r in runs if r["preset"] == "fixed"]
    adaptive = runs[0]
    for e in best:
        phase = e["phase"]

        def mean(r: dict[str, Any], phase: int | None = phase) -> float:
            return float(r["mean_ttft_s"] if phase is None else r["phases"][phase]["mean_ttft_s"])

        top = min(fixed, key=mean)
        assert e["best_fixed"]["label"] == top["label"]
        assert e["best_fixed"]["mean_ttft_s"] == pytest.approx(mean(top))
        assert [v["label"] for v in e["variants"]] == ["vertumnus"]
        gap = 100 * (mean(adaptive) - mean(top)) / mean(top)
        assert e["variants"][0]["gap_pct"] == pytest.approx(gap)
        assert math.isfinite(gap)
    assert adaptive["gap_vs_best_fixed_pct"] == pytest.approx(best[0]["variants"][0]["gap_pct"])
    text = (out / "comparison.md").read_text()
    assert "## Against the best fixed composition" in text
    assert f"| whole run | {best[0]['best_fixed']['label']} |" in text

    for r in runs:
        folder = out / r["run"]
        with (folder / "timeline.csv").open() as f:
            windows = list(csv.DictReader(f))
        lines = [json.loads(x) for x in (folder / "decisions.jsonl").read_text().splitlines()]
        assert len(lines) == len(windows) > 0
        ends = [float(w["end_s"]) for w in windows]  # the timeline rounds to 1 ms
        assert [d["end_s"] for d in lines] == pytest.approx(ends, abs=1e-3)
        assert all({"rule", "ops", "window_rule"} <= d.keys() for d in lines)
        assert (folder / "ttft_composition.png").read_bytes()[:4] == b"\x89PNG"
    whatif = [
        json.loads(x) for x in (out / "vertumnus" / "decisions.jsonl").read_text().splitlines()
    ]
    assert any(d.get("candidates") for d in whatif)
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    # One page for the experiment: every run in its table; over time the adaptive run
    # and the best fixed one (each run has its own report too).
    page = (out / "report.html").read_text()
    assert page.count('"name":') >= len(runs) and "Vertumnus.compare" in page
    chosen = tool.over_time(runs)
    assert [r["run"] for r in chosen] == ["vertumnus", min(fixed, key=mean_of)["run"]]
    for r in runs:
        timeline = json.loads((out / r["run"] / "timeline.json").read_text())
        assert timeline["samples"][-1]["finished"] >= 0 and len(timeline["samples"]) > 100
        assert "Vertumnus.report" in (out / r["run"] / "report.html").read_text()


def test_a_variant_of_an_earlier_version_is_refused(tool: ModuleType, tmp_path: Path) -> None:
    """A variant that names its preset ``policy`` (the key's earlier name) is refused,
    naming the key to write, before anything runs (in one line from the command)."""
    path = tmp_path / "old.toml"
    path.write_text(CONFIG.replace('preset = "fixed"', 'policy = "fixed"'))
    moved = r"variant 'fixed \(start\)': \[experiment\.variants\] policy moved: write preset = NAME"
    with pytest.raises(ConfigError, match=moved):
        tool.run_experiment(path, tmp_path / "out", echo=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit, match=r"^error: .*policy moved: write preset = NAME"):
        tool.main([str(path), "--out", str(tmp_path / "out")])


def test_a_variant_with_an_unknown_key_is_refused(tool: ModuleType, tmp_path: Path) -> None:
    """A misspelt key would otherwise run the default preset under the variant's label."""
    path = tmp_path / "typo.toml"
    path.write_text(CONFIG.replace('preset = "fixed"', 'presets = "fixed"'))
    with pytest.raises(ConfigError, match=r"variant 'fixed \(start\)': unknown keys \['presets'\]"):
        tool.run_experiment(path, tmp_path / "out", echo=False)
    assert not (tmp_path / "out").exists()


def test_overrides_merge_and_the_sweep_keeps_the_bounds(tool: ModuleType) -> None:
    variant = {"label": "v", "preset": "fixed", "composition": "6CP4/2CP8", "pool": {"ranks": 40}}
    assert tool.variant_overrides(variant, 2.0) == {
        "pool": {"ranks": 40, "composition": "6CP4/2CP8"},
        "workload": {"rate_scale": 2.0},
    }
    raw = {
        "pool": {
            "degrees": [4, 8],
            "min_workers": {"4": 2, "8": 1},
            "max_workers": {"4": 8, "8": 4},
        }
    }
    variants = [
        {"label": "vertumnus", "preset": "vertumnus", "pool": {"composition": "auto", "ranks": 40}},
        {"label": "fixed 4/3", "preset": "fixed", "composition": "4CP4/3CP8"},
        # Not a plain fixed composition: it does not stand for 6CP4/2CP8.
        {"label": "no scans", "preset": "fixed", "composition": "6CP4/2CP8", "cache": {}},
    ]
    added = tool.sweep_variants(raw, variants)
    assert added == [
        {"label": f"fixed {name}", "preset": "fixed", "composition": name.replace("-", "/")}
        for name in ("2CP4-4CP8", "6CP4-2CP8", "8CP4-1CP8")
    ]


def test_the_start_rate_scales_with_the_run(tool: ModuleType) -> None:
    auto = {"label": "v", "preset": "vertumnus", "pool": {"composition": "auto", "ranks": 40}}
    raw = {"pool": {"start_rate": 3.4}}
    assert tool.variant_overrides(auto, 2.0, raw) == {
        "pool": {"composition": "auto", "ranks": 40, "start_rate": 6.8},
        "workload": {"rate_scale": 2.0},
    }
    given = {**auto, "pool": {**auto["pool"], "start_workload": "w.jsonl", "start_rate": 3.0}}
    assert tool.variant_overrides(given, 4.0)["pool"]["start_rate_scale"] == 4.0
    assert "start_rate" not in tool.variant_overrides(auto, None, raw).get("pool", {})


EXPERIMENTS = sorted((ROOT / "configs" / "sim").glob("*.toml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_the_experiments_start_from_what_a_server_has(tool: ModuleType, path: Path) -> None:
    """Every variant at "auto" names a start source that is not the workload it
    serves, and only a variant labelled as an oracle could start from that."""
    from vertumnus.config.pool import PoolConfig
    from vertumnus.sim import config as sim_config

    raw = tomllib.loads(path.read_text())
    served = raw.get("workload", {}).get("trace")
    for variant in raw["experiment"]["variants"]:
        table = tool._pool_table(raw, variant)
        if table.get("composition") != "auto":
            continue
        start = PoolConfig.from_table(table, sim_config.DEFAULT_POOL).start
        assert start.auto  # (and a source: the configuration says which, or refuses)
        if "oracle" not in variant["label"]:
            assert start.start_workload is None or start.start_workload != served


def test_the_time_varying_experiment_starts_from_the_builtin_mix(tool: ModuleType) -> None:
    from vertumnus.sim import config as sim_config

    path = ROOT / "configs" / "sim" / "time-varying.toml"
    raw = tomllib.loads(path.read_text())
    variant = raw.pop("experiment")["variants"][0]
    assert variant["label"] == "vertumnus"
    # The served workload (the shared trace, absent on a bare clone) does not enter
    # the start: a short generated one stands in for it.
    raw["workload"] = {"phases": [{"duration_s": 5.0, "rate": 10.0}]}
    cfg = sim_config.load(None, tool.variant_overrides(variant, None, raw), raw=raw)
    assert cfg.start is not None and cfg.start.source == "builtin_mix"
    assert cfg.start.origin == "builtin:mooncake-conversation at 15 requests/s"
    assert sum(cfg.layout) == 40 and set(cfg.start.predicted_s) == {
        "2CP4/4CP8",
        "4CP4/3CP8",
        "6CP4/2CP8",
        "8CP4/1CP8",
    }


def test_the_cache_table_measures_the_manager_against_its_bound(tmp_path: Path) -> None:
    table = load_tool("experiments/cache_table.py")

    def run(preset: str, rate: float, mean: float, p90: float, **audit: Any) -> dict[str, Any]:
        return {
            "preset": preset,
            "rate_scale": rate,
            "composition_start": "4CP4/3CP8",
            "run": f"{preset}@{rate}",
            "mean_ttft_s": mean,
            "p90_ttft_s": p90,
            "cache_audit": audit,
        }

    pulls = {"waste_fraction": 0.01, "wasted_blocks": 1, "used_blocks": 99}
    runs = [
        run("no-replication", 1.0, 0.30, 0.60),
        run("fixed", 1.0, 0.25, 0.61, all=pulls, pull=pulls),
        run("ideal-replication", 1.0, 0.20, 0.50),
        run("no-replication", 2.0, 50.0, 90.0),  # overloaded
        run("fixed", 2.0, 0.5, 1.0),
        run("ideal-replication", 2.0, 0.4, 0.9),
        run("vertumnus", 1.0, 0.1, 0.2),  # not one of the three: ignored
    ]
    (tmp_path / "comparison.json").write_text(json.dumps({"runs": runs}))
    first, second = table.rows(tmp_path, overload_s=10.0)
    assert first["headroom"] == pytest.approx(1 / 3) and first["captured"] == pytest.approx(0.5)
    assert not first["never_worse"]  # P90 0.61 > 1.01 * 0.60
    assert first["waste"] == 0.01 and first["blocks"]["pull"] == "1 / 100"
    assert second["overloaded"] and second["blocks"]["pull"] == "–"
    # A comparison written before the field was named "preset" reads the same.
    old = [{("policy" if k == "preset" else k): v for k, v in r.items()} for r in runs]
    (tmp_path / "comparison.json").write_text(json.dumps({"runs": old}))
    assert table.rows(tmp_path, overload_s=10.0) == [first, second]
