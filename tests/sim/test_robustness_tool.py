"""``tools/experiments/robustness.py`` on one scenario shrunk to seconds: every run,
the ratios and targets in the JSON and the markdown, and the baselines taken from the
cache on a second call (their files untouched)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from support.tools import load_tool

SEED = 101  # a system-prompt scenario with a burst: about 270 requests at this scale
SCALE = 0.01


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("experiments/robustness.py")


def without_wall(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {f: v for f, v in r.items() if f != "wall_s"} for k, r in runs.items()}


def test_seeds_parse(tool: ModuleType) -> None:
    assert tool.parse_seeds("1,4,10-12") == [1, 4, 10, 11, 12]
    assert len(tool.parse_seeds("report")) == 60 and len(tool.parse_seeds("tune")) == 16
    assert set(tool.parse_seeds("all")) == set(
        tool.parse_seeds("report") + tool.parse_seeds("tune")
    )


def test_a_pair_converges_where_every_later_arrival_is_served_near_the_best(
    tool: ModuleType,
) -> None:
    """``converged_period``: the first period from which on the requests arriving are
    served within 3 % of the best fixed run's mean TTFT for the same periods."""
    best = [[10, 1.0], [10, 1.0], [10, 1.0], [10, 1.0]]  # 0.1 s each
    slow = [[10, 5.0], [10, 2.0], [10, 1.02], [10, 1.0]]  # 0.5, 0.2, 0.102, 0.1 s
    assert tool.converged_period(slow, best) == 2
    assert tool.converged_period(best, best) == 0
    # period 2 slow: the suffix from 2 on is 0.12 s, over 1.03; from 3 on, 0.1 s
    assert tool.converged_period([[10, 5.0], [10, 2.0], [10, 1.4], [10, 1.0]], best) == 3
    # the mean over the rest of the run counts: a last period 10 % over the best, the
    # suffix from 0 on 2.5 % over it
    assert tool.converged_period([[10, 1.0], [10, 1.0], [10, 1.0], [10, 1.1]], best) == 0
    # 20 % over it: every suffix over 1.03 (0.105, 0.107, 0.110, 0.120 s): never
    assert tool.converged_period([[10, 1.0], [10, 1.0], [10, 1.0], [10, 1.2]], best) is None
    assert tool.converged_period([[10, 2.0]] * 4, best) is None
    assert tool.converged_period([], best) is None
    # the per-period rows of a run: by arrival, a request never answered left out
    Record = tool.RequestRecord
    records = [Record(0, 1.0, 10, 0, end_s=1.5), Record(1, 25.0, 10, 0, end_s=25.2),
               Record(2, 26.0, 10, 0), Record(3, 9.99, 10, 0, end_s=10.99)]  # fmt: skip
    assert tool.period_ttft(records, 10.0) == [[2, pytest.approx(1.5)], [0, 0.0],
                                               [1, pytest.approx(0.2)]]  # fmt: skip


def test_a_cached_row_names_its_preset(tool: ModuleType, tmp_path: Path) -> None:
    """A baseline kept before the row's field was named ``preset`` (``policy``) is read
    as a row of now, its fields in their order."""
    path = tmp_path / "row.json"
    path.write_text(json.dumps({"key": {}, "row": {"policy": "fixed", "mean_ttft_s": 0.5}}))
    assert list(tool.cached_row(path).items()) == [("preset", "fixed"), ("mean_ttft_s", 0.5)]
    path.write_text(json.dumps({"key": {}, "row": {"preset": "dynamo-kv", "reshapes": 0}}))
    assert tool.cached_row(path) == {"preset": "dynamo-kv", "reshapes": 0}


def test_one_scenario_then_the_cache(tool: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = tool.run_suite([SEED], out, jobs=1, duration_scale=SCALE, echo=False)
    # Fixed at the 6 compositions, vertumnus from three starts, then the three peers at
    # the fixed pool's two best compositions.
    assert first["runs"] == {"cached": 0, "ran": 15}
    report = json.loads((out / "robustness.json").read_text())
    (entry,) = report["scenarios"]
    assert len(entry["runs"]) == 15 and entry["scenario"]["seed"] == SEED
    assert entry["realised"]["requests"] > 50
    runs = entry["runs"]
    assert {r["preset"] for r in runs.values()} == {
        "fixed",
        "sglang-cache-aware",
        "dynamo-kv",
        "llm-d",
        "vertumnus",
    }
    for run in runs.values():
        assert run["completed"] == run["requests"] == entry["realised"]["requests"]
        assert run["mean_ttft_s"] > 0 and run["p90_ttft_s"] >= 0
        if run["preset"] != "vertumnus":
            assert run["reshapes"] == 0 and run["moves"] == []
            assert run["composition_end"] == run["composition_start"]
    pairs = report["pairs"]
    assert [p["start"] for p in pairs] == entry["scenario"]["starts"]
    fixed = [r["mean_ttft_s"] for r in runs.values() if r["preset"] == "fixed"]
    by_mean = sorted(
        (r for r in runs.values() if r["preset"] == "fixed"), key=lambda r: r["mean_ttft_s"]
    )
    best_two = [r["composition_start"] for r in by_mean[:2]]
    assert {k.split("@")[1] for k, r in runs.items() if r["preset"] in tool.PEERS} == set(best_two)
    for p in pairs:
        v, hold = runs[f"vertumnus@{p['start']}"], runs[f"fixed@{p['start']}"]
        assert p["v_hold"] == pytest.approx(v["mean_ttft_s"] / hold["mean_ttft_s"])
        assert p["v_hold_p90"] == pytest.approx(v["p90_ttft_s"] / hold["p90_ttft_s"])
        assert p["best_fixed_mean_s"] == min(fixed)
        assert p["v_best_fixed"] == pytest.approx(v["mean_ttft_s"] / min(fixed))
        assert p["best_peer"].split("@")[0] in tool.PEERS and p["v_best_peer"] > 0
        # the peers ran at the fixed pool's two best compositions
        assert p["best_peer"].split("@")[1] in best_two
        assert p["reshapes"] == v["reshapes"] == sum(len(m["kinds"]) for m in p["moves"])
        for move in p["moves"]:
            assert {"time_s", "kinds", "rule", "gain", "busy_fraction"} <= move.keys()
    for run in runs.values():  # every answered request in one period of its arrival
        counts, sums = zip(*run["period_ttft"], strict=True)
        assert sum(counts) == run["completed"]
        assert sum(sums) == pytest.approx(run["mean_ttft_s"] * run["completed"])
    assert [t["target"] for t in report["targets"]] == [
        "v/hold mean <= 1.01",
        "v/hold P90 <= 1.03",
        "v/best fixed <= 1.03",
        "v/best fixed <= 1.10, start within 1.10",
        "v <= best peer",
        "converged in <= 6 periods, steady, start over 1.10",
    ]
    near = sum(p["hold_best_fixed"] <= 1.10 for p in pairs)
    assert entry["scenario"]["shape"] == "burst"  # (not steady: no convergence counted)
    assert [t["total"] for t in report["targets"]] == [3, 3, 3, near, 3, 0]
    assert set(report["distribution"]) == {"v_hold", "v_hold_p90", "v_best_fixed", "v_best_peer"}
    text = (out / "robustness.md").read_text()
    for heading in ("## Targets", "## Ratios", "## Worst five by vertumnus / hold"):
        assert heading in text
    assert text.count(f"| {SEED} |") == 3

    cache = sorted((out / "cache").iterdir())
    assert len(cache) == 12 + 1  # the baselines, and the scenario's pilots
    stamps = {p: p.stat().st_mtime_ns for p in cache}
    second = tool.run_suite([SEED], out, jobs=1, duration_scale=SCALE, echo=False)
    assert second["runs"] == {"cached": 12, "ran": 3}
    assert {p: p.stat().st_mtime_ns for p in (out / "cache").iterdir()} == stamps
    again = second["scenarios"][0]["runs"]
    assert without_wall(again) == without_wall(runs)  # and the same vertumnus runs again
    # --only vertumnus: a scenario without cached baselines is left out, not run.
    only = tool.run_suite([SEED, SEED + 1], out, 1, SCALE, only="vertumnus", echo=False)
    assert only["left_out"] == [SEED + 1] and only["runs"] == {"cached": 12, "ran": 3}
    # --set: laid over the adaptive runs only; --tag: a report of its own beside the other.
    still = tool.parse_set(["controller.margin=0.99", "controller.decision_s=5.0"])
    assert still == {"controller": {"margin": 0.99, "decision_s": 5.0}}
    tagged = tool.run_suite([SEED], out, 1, SCALE, echo=False, overrides=still, tag="still")
    assert tagged["runs"] == {"cached": 12, "ran": 3} and tagged["overrides"] == still
    assert (out / "robustness-still.json").exists() and (out / "robustness-still.md").exists()
    held = tagged["scenarios"][0]["runs"]
    for start in tagged["scenarios"][0]["scenario"]["starts"]:
        v = held[f"vertumnus@{start}"]  # no gain clears a margin of 99 %: it holds
        assert v["reshapes"] == 0 and v["mean_ttft_s"] == held[f"fixed@{start}"]["mean_ttft_s"]
    assert {k: r for k, r in held.items() if r["preset"] != "vertumnus"} == {
        k: r for k, r in runs.items() if r["preset"] != "vertumnus"
    }
    assert json.loads((out / "robustness.json").read_text())["overrides"] == {}
    # --no-peers: the peers' stage left out, the best-peer ratio blank.
    alone = tool.run_suite([SEED], out, 1, SCALE, echo=False, tag="alone", peers=False)
    assert alone["runs"] == {"cached": 6, "ran": 3}
    assert not any(k.split("@")[0] in tool.PEERS for k in alone["scenarios"][0]["runs"])
    assert all(p["best_peer"] is None and p["v_best_peer"] is None for p in alone["pairs"])
    assert [p["v_hold"] for p in alone["pairs"]] == [p["v_hold"] for p in pairs]
    assert alone["targets"][-1]["total"] == 0
    for bad in (["margin=1"], ["controller.margin"]):
        with pytest.raises(SystemExit):
            tool.parse_set(bad)


@pytest.mark.multiproc
def test_processes_give_what_one_process_gives(tool: ModuleType, tmp_path: Path) -> None:
    serial = tool.run_suite([SEED], tmp_path / "a", jobs=1, duration_scale=SCALE, echo=False)
    parallel = tool.run_suite([SEED], tmp_path / "b", jobs=2, duration_scale=SCALE, echo=False)

    assert without_wall(parallel["scenarios"][0]["runs"]) == without_wall(
        serial["scenarios"][0]["runs"]
    )


def test_a_held_pool_runs_the_same_with_the_cheap_controller(tool: ModuleType) -> None:
    # A fixed pool and a peer only note their controller's decisions: the suite gives
    # them the rules (cheap) instead of the what-if replays, and nothing they serve
    # may change. At 0.92 of the saturation (the pilots' figure for seed 101), with
    # the what-if controller laid back over the suite's choice.
    scenario = tool.scenarios.scaled(
        tool.calibrated(tool.scenarios.draw(SEED), known=(40.07, "10CP4")), 0.2
    )
    for preset, composition in (("fixed", "4CP4/3CP8"), ("dynamo-kv", "8CP4/1CP8")):
        cfg, _ = tool.configured(scenario, preset, composition)
        assert cfg.policy.controller.mode == "rules"
        cheap = tool.simulate(scenario, preset, composition)
        whatif = tool.simulate(scenario, preset, composition, {"controller": {"mode": "whatif"}})
        assert cheap["requests"] > 500 and cheap["completed"] == cheap["requests"]
        assert {k: v for k, v in cheap.items() if k != "wall_s"} == {
            k: v for k, v in whatif.items() if k != "wall_s"
        }
    cfg, _ = tool.configured(scenario, "vertumnus", "4CP4/3CP8")
    assert cfg.policy.controller.mode == "whatif"
