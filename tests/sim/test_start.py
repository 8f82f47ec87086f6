"""``[pool] composition = "auto"``: the start chosen from what a server has (a start
workload, the state file, the built-in mix), never from the workload it serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support.factories import make_profile
from vertumnus.blocks import max_reuse_blocks
from vertumnus.capacity import LengthMix
from vertumnus.config.pool import PoolConfig
from vertumnus.config.start import (
    START_SEED,
    read_state,
    resolve_start,
    workload_samples,
    write_state,
)
from vertumnus.config.tables import ConfigError
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.control.candidates import best_start
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay import ReplayModel
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.policy.start import mix_samples, replay_start
from vertumnus.sim import config as sim_config

# Degree 4 pays a fixed 40 ms per prefill and is twice as fast per token: long
# requests want it, many short ones want more degree-2 workers.
COEFFS = {2: DegreeCoeffs(d=0.01, c=2e-4), 4: DegreeCoeffs(d=0.04, c=2e-4)}
LATTICE = LatticeConfig(8, (2, 4))
PROFILE = make_profile(COEFFS)


def write_trace(path: Path, n: int = 150, gap_ms: int = 500) -> Path:
    """A Mooncake JSONL trace: a request every ``gap_ms``, five groups sharing a
    prefix of three blocks, the rest of each request its own."""
    lines = []
    for i in range(n):
        tokens = 700 + 311 * (i % 17)
        blocks = -(-tokens // 512)
        ids = [1000 * (i % 5) + j for j in range(min(3, blocks))]
        ids += [100_000 + 100 * i + j for j in range(blocks - len(ids))]
        lines.append(json.dumps({"timestamp": gap_ms * i, "input_length": tokens, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def by_hand(path: Path, span_s: float, rate_scale: float = 1.0) -> list[ArrivalSample]:
    """The trace's samples, as the start should see them: each floor the leading
    blocks earlier requests had, whole blocks with a token left to compute."""
    seen: set[int] = set()
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        t = rec["timestamp"] / 1000 / rate_scale
        if t > span_s:
            break
        ids, tokens = rec["hash_ids"], rec["input_length"]
        hits = 0
        while hits < len(ids) and ids[hits] in seen:
            hits += 1
        seen.update(ids)
        floor = min(hits, max_reuse_blocks(tokens, 512)) * 512
        out.append(ArrivalSample(len(out), t, tokens, floor_tokens=floor))
    return out


def auto_pool(**start: Any) -> PoolConfig:
    table = {"composition": "auto", "ranks": 8, "degrees": [2, 4], **start}
    return PoolConfig.from_table(table, PoolConfig((2, 4), (4, 4)))


def sim_raw(tmp_path: Path, pool: dict[str, Any], phases: list[dict[str, Any]]) -> dict[str, Any]:
    profile = tmp_path / "profile.json"
    PROFILE.save(profile)
    return {
        "pool": {"composition": "auto", "ranks": 8, "degrees": [2, 4], **pool},
        "profile": {"path": str(profile)},
        "engine": {"block_size": 512},
        "workload": {"seed": 3, "phases": phases},
    }


def test_replay_start_picks_the_composition_the_workload_wants() -> None:
    policy = PolicyConfig()
    long_requests = mix_samples([(4000, 0)], 2.0, 60.0, seed=1)
    assert replay_start(LATTICE, PROFILE, policy, long_requests).composition == {4: 2}
    short_busy = mix_samples([(100, 0)], 80.0, 60.0, seed=1)
    choice = replay_start(LATTICE, PROFILE, policy, short_busy)
    assert choice.composition == {2: 4}
    assert set(choice.predicted_s) == {"2CP4", "2CP2/1CP4", "4CP2"}
    assert choice.predicted_s["4CP2"] < choice.predicted_s["2CP2/1CP4"]


def test_mix_samples_are_poisson_at_the_rate_seeded_and_floored_by_the_mix() -> None:
    mix = [(1000, 512), (3000, 0)]
    samples = mix_samples(mix, 20.0, 60.0, seed=4)
    assert samples == mix_samples(mix, 20.0, 60.0, seed=4)
    assert 1000 < len(samples) < 1400 and samples[-1].arrival_s <= 60.0
    assert {(s.input_tokens, s.floor_tokens) for s in samples} == set(mix)


def test_a_start_workload_file_starts_where_best_start_on_its_samples_does(
    tmp_path: Path,
) -> None:
    trace = write_trace(tmp_path / "yesterday.jsonl")
    expected = by_hand(trace, 60.0)
    assert len(expected) == 121 and sum(s.floor_tokens for s in expected) > 0
    got = workload_samples(str(trace), 1.0, 60.0)
    fields = [(s.arrival_s, s.input_tokens, s.floor_tokens) for s in got]
    assert fields == [(s.arrival_s, s.input_tokens, s.floor_tokens) for s in expected]
    # start_rate_scale = 2: twice the rate, so the minute holds twice the trace
    assert len(workload_samples(str(trace), 2.0, 60.0)) == len(by_hand(trace, 60.0, 2.0)) == 150

    model = ReplayModel(reuse_curves(COEFFS), LATTICE.degrees, PolicyConfig().weights)
    choice = best_start(LATTICE, model, expected)
    pool, decision = resolve_start(auto_pool(start_workload=str(trace)), PROFILE, PolicyConfig())
    assert decision is not None and decision.source == "start_workload"
    assert decision.origin == str(trace) and decision.warnings == ()
    assert decision.predicted_s == choice.predicted_s
    assert pool.composition == choice.composition and pool.layout == decision.layout


def test_the_state_file_round_trip_and_what_falls_through(tmp_path: Path) -> None:
    path = tmp_path / "state" / "pool.json"  # (its folder is made)
    written = write_state(str(path), LATTICE, [4, 2, 2])
    on_disk = json.loads(path.read_text())
    assert on_disk == written.to_json()
    assert {k: on_disk[k] for k in ("composition", "layout", "degrees", "ranks")} == {
        "composition": "2CP2/1CP4",
        "layout": [4, 2, 2],
        "degrees": [2, 4],
        "ranks": 8,
    }
    assert [p.name for p in path.parent.iterdir()] == ["pool.json"]  # no temporary left
    state, why = read_state(str(path), LATTICE)
    assert state == written and why is None

    pool, decision = resolve_start(auto_pool(state_file=str(path)), PROFILE, PolicyConfig())
    assert decision is not None and decision.source == "state_file"
    assert pool.layout == (4, 2, 2) and decision.predicted_s == {}

    # A state of another lattice, one the bounds refuse, a file that is no state:
    # each is passed over with its reason, to the built-in mix.
    other = tmp_path / "other.json"
    write_state(str(other), LatticeConfig(4, (2, 4)), [4])
    bounded = auto_pool(state_file=str(path), start_rate=5.0, max_workers={"2": 1})
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    misaligned = tmp_path / "misaligned.json"
    misaligned.write_text(json.dumps({**on_disk, "layout": [2, 4, 2]}))
    for pool, reason in [
        (auto_pool(state_file=str(other), start_rate=5.0), "of 4 ranks at degrees [2, 4]"),
        (bounded, "outside [pool] min/max_workers"),
        (auto_pool(state_file=str(misaligned), start_rate=5.0), "does not fit the lattice"),
        (auto_pool(state_file=str(garbage), start_rate=5.0), "is not a pool state"),
    ]:
        _, decision = resolve_start(pool, PROFILE, PolicyConfig())
        assert decision is not None and decision.source == "builtin_mix"
        assert len(decision.warnings) == 1 and reason in decision.warnings[0]
    # The first run: no file yet, and nothing else to fall back on.
    missing = str(tmp_path / "none.json")
    assert read_state(missing, LATTICE) == (None, None)
    with pytest.raises(ConfigError, match=r"none\.json does not exist yet"):
        resolve_start(auto_pool(state_file=missing), PROFILE, PolicyConfig())
    # A start workload goes before the state file.
    trace = write_trace(tmp_path / "t.jsonl")
    _, decision = resolve_start(
        auto_pool(state_file=str(path), start_workload=str(trace)), PROFILE, PolicyConfig()
    )
    assert decision is not None and decision.source == "start_workload"


def test_the_builtin_mix_at_the_start_rate_is_the_last_resort() -> None:
    pool, decision = resolve_start(auto_pool(start_rate=3.0), PROFILE, PolicyConfig())
    mix = LengthMix.builtin()
    samples = mix_samples(mix.requests, 3.0, 60.0, START_SEED)
    choice = replay_start(LATTICE, PROFILE, PolicyConfig(), samples)
    assert decision is not None and decision.source == "builtin_mix"
    assert decision.origin == "builtin:mooncake-conversation at 3 requests/s"
    assert decision.predicted_s == choice.predicted_s
    assert pool.composition == choice.composition
    assert set(decision.to_json()) == {"source", "origin", "composition", "predicted_s"}


def test_auto_needs_ranks_and_a_source(tmp_path: Path) -> None:
    phases = [{"duration_s": 30, "rate": 2.0, "long_fraction": 0.0}]
    raw = sim_raw(tmp_path, {}, phases)
    with pytest.raises(ConfigError, match=r"start_workload.*state_file.*start_rate"):
        sim_config.load(None, {}, raw=raw)
    del raw["pool"]["ranks"]
    with pytest.raises(ConfigError, match="needs \\[pool\\] ranks"):
        sim_config.load(None, {"pool": {"start_rate": 2.0}}, raw=raw)
    with pytest.raises(ConfigError, match="start_rate must be a number > 0"):
        auto_pool(start_rate=0)
    with pytest.raises(ConfigError, match=r"start_workload: .*missing\.jsonl"):
        resolve_start(auto_pool(start_workload="missing.jsonl"), PROFILE, PolicyConfig())
    # The start keys are read with "auto" alone; the state file is kept either way.
    given = PoolConfig.from_table(
        {"composition": "2CP4", "degrees": [2, 4], "start_rate": 3.0, "state_file": "s.json"},
        PoolConfig((2, 4), (4, 4)),
    )
    assert not given.start.auto and given.start.state_file == "s.json"
    assert resolve_start(given, PROFILE, PolicyConfig()) == (given, None)


def test_the_simulators_start_does_not_depend_on_the_workload_it_serves(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "yesterday.jsonl")
    long_few = [{"duration_s": 60, "rate": 1.0, "long_fraction": 1.0}]
    short_many = [{"duration_s": 60, "rate": 60.0, "long_fraction": 0.0}]
    for start in ({"start_workload": str(trace)}, {"start_rate": 4.0}):
        runs = [
            sim_config.load(None, {}, raw=sim_raw(tmp_path, start, p))
            for p in (long_few, short_many)
        ]
        assert runs[0].requests != runs[1].requests
        assert runs[0].start is not None and runs[1].start is not None
        assert runs[0].layout == runs[1].layout
        assert runs[0].start.predicted_s == runs[1].start.predicted_s


def test_simulate_keeps_the_composition_it_ends_with(tmp_path: Path) -> None:
    from vertumnus.cli import main

    state = tmp_path / "pool.json"
    record = write_state(str(state), LATTICE, [2, 2, 4]).to_json()
    state.write_text(json.dumps({**record, "written_at": "2000-01-01T00:00:00+00:00"}))
    profile = tmp_path / "profile.json"
    PROFILE.save(profile)
    config = tmp_path / "sim.toml"
    config.write_text(
        f"""
[pool]
composition = "auto"
ranks = 8
degrees = [2, 4]
state_file = "{state}"

[profile]
path = "{profile}"

[controller]
enabled = false

[workload]
phases = [{{ duration_s = 5, rate = 2.0 }}]
"""
    )
    assert main(["simulate", "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["composition_start"] == "2CP2/1CP4" and summary["start_source"] == "state_file"
    after = json.loads(state.read_text())
    assert after["layout"] == [2, 2, 4] and after["written_at"] > "2000-01-01T00:00:00+00:00"
