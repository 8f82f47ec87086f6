"""The simulator: exact TTFTs on hand-computable scenarios, determinism,
conservation through reshapes, baseline routers, and the ``simulate`` command."""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.factories import make_profile
from vertumnus.__main__ import main
from vertumnus.config import ConfigError
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.pool_config import PRESETS, PolicyConfig, PoolSpec
from vertumnus.sim.report import percentile, summarize
from vertumnus.sim.simulator import Simulation
from vertumnus.sim.time_model import SimSettings, SimulationError
from vertumnus.sim.workload import LengthDistribution, Phase, SimRequest, phased
from vertumnus.slo import TtftSlo


def profile(d4: float = 1.0, c4: float = 0.0, d8: float = 1.2, c8: float = 0.0) -> Profile:
    """Degrees 4 and 8 with simple times; capacities for the controller."""
    coeffs = {4: DegreeCoeffs(d=d4, c=c4), 8: DegreeCoeffs(d=d8, c=c8)}
    return make_profile(coeffs, {4: 15.0, 8: 18.0}, block_size=512)


def pool(layout: list[int]) -> PoolSpec:
    """Degrees 4 and 8; 512-token blocks, 293 per rank (Qwen3-30B-A3B on 80 GB)."""
    return PoolSpec(LatticeConfig(sum(layout), (4, 8)), tuple(layout), 512, 293)


def run(
    requests: list[SimRequest],
    layout: list[int],
    prof: Profile | None = None,
    preset: str = "vertumnus",
    controller: ControllerConfig | None = None,
    **settings: object,
) -> Simulation:
    config = PolicyConfig(**PRESETS[preset])
    if controller is not None:
        config = dataclasses.replace(config, controller=controller)
    sim = Simulation(SimSettings(**settings), prof or profile(), pool(layout), config, requests)  # type: ignore[arg-type]
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_one_worker_fifo_by_hand() -> None:
    reqs = [SimRequest(0, 0.0, 100), SimRequest(1, 0.5, 100), SimRequest(2, 10.0, 100)]
    sim = run(reqs, [4], preset="fixed")
    # E = d = 1 s each: the second waits for the first (0.5 s), the third finds it idle.
    assert [r.ttft_s for r in sim.records] == [1.0, 1.5, 1.0]
    assert [r.start_s for r in sim.records] == [0.0, 1.0, 10.0]
    assert {r.worker for r in sim.records} == {0}


@pytest.mark.parametrize("enabled", [True, False])
def test_a_run_pauses_the_collector_and_leaves_it_as_it_was(
    enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    arrive = Simulation._try_start

    def watched(self: Simulation, worker_id: int, now: float) -> None:
        seen.append(gc.isenabled())
        arrive(self, worker_id, now)

    monkeypatch.setattr(Simulation, "_try_start", watched)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        reqs = [SimRequest(0, 0.0, 100), SimRequest(1, 0.5, 100)]
        sim = run(reqs, [4], preset="fixed")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert [r.ttft_s for r in sim.records] == [1.0, 1.5]
    assert seen and not any(seen)


def test_dispatch_time_keeps_the_worker_busy() -> None:
    reqs = [SimRequest(0, 0.0, 100), SimRequest(1, 0.5, 100)]
    sim = run(reqs, [4], preset="fixed", dispatch_s=0.25)
    # E = d = 1 s, plus 0.25 s of the serving path each; the second waits 0.75 s.
    assert [r.ttft_s for r in sim.records] == [1.25, 2.0]
    with pytest.raises(SimulationError, match="dispatch_s >= 0"):
        SimSettings(dispatch_s=-1.0)


def test_prefix_reuse_shortens_the_prefill_exactly() -> None:
    # E_4(R, P) = 0.5 + 1e-3 * R / 4: the second request reuses 2 blocks (1024 tokens).
    prof = profile(d4=0.5, c4=1e-3)
    chain = (11, 12, 13)
    reqs = [SimRequest(0, 0.0, 1536, chain), SimRequest(1, 5.0, 1536, chain)]
    sim = run(reqs, [4], prof, preset="fixed")
    first, second = sim.records
    assert first.ttft_s == pytest.approx(0.5 + 1e-3 * 1536 / 4)
    assert second.cached_tokens == 1024  # whole blocks, one token left to compute
    assert second.ttft_s == pytest.approx(0.5 + 1e-3 * 512 / 4)


def test_same_seed_same_summary_and_every_request_once() -> None:
    reqs = phased(
        [Phase(120, 2.0, 0.1), Phase(120, 6.0, 0.0), Phase(120, 1.0, 0.3)],
        seed=3,
        long_tokens=32_768,
    )
    prof = profile(d4=0.05, c4=2e-5, d8=0.06, c8=2e-5)
    common = {"preset": "vertumnus", "noise_cv": 0.2, "seed": 5}
    one = run(reqs, [4, 4, 8], prof, **common)
    two = run(reqs, [4, 4, 8], prof, **common)
    keys = [(r.request_id, r.worker, r.start_s, r.end_s, r.cached_tokens) for r in one.records]
    assert keys == [
        (r.request_id, r.worker, r.start_s, r.end_s, r.cached_tokens) for r in two.records
    ]
    assert all(r.end_s is not None and r.end_s >= r.arrival_s for r in one.records)
    assert len({r.request_id for r in one.records}) == len(reqs)
    other = run(reqs, [4, 4, 8], prof, **{**common, "seed": 6})
    assert [r.end_s for r in other.records] != [r.end_s for r in one.records]


def test_reshapes_keep_every_device_and_answer_everyone() -> None:
    # A burst far over capacity, then quiet: splits, then merges.
    reqs = phased([Phase(300, 40.0, 0.0), Phase(900, 0.2, 0.5)], seed=1, long_tokens=32_768)
    prof = profile(d4=0.2, c4=1e-5, d8=0.25, c8=1e-5)
    rules = ControllerConfig(mode="rules")  # (two splits in one window)
    sim = run(reqs, [8, 8], prof, preset="vertumnus", controller=rules, switch_s=0.5)
    result = sim.result  # type: ignore[attr-defined]
    kinds = [r.kind for r in result.reshapes]
    assert "split" in kinds and "merge" in kinds
    for w in result.windows:
        assert (
            sum(int(n) * int(c) for n, c in (p.split("CP") for p in w.composition.split("/"))) == 16
        )
    assert all(r.end_s is not None for r in result.records)
    # A switch takes switch_s; two in one window take turns on the channel (as on the
    # server's ranks), so the second also waits for the first.
    assert all(r.drain_s is not None and r.switch_s >= 0.5 for r in result.reshapes)
    first, second = result.reshapes[:2]
    assert first.started_s == second.started_s and first.switch_s == 0.5
    second_parked = second.started_s + second.drain_s
    first_active = first.started_s + first.drain_s + first.switch_s
    assert second.switch_s == pytest.approx(first_active + 0.5 - second_parked)
    assert sum(w.arrivals for w in result.windows) == len(reqs)


@pytest.mark.parametrize("lanes", ["device", "serial"])
def test_copies_share_no_device_and_switches_wait_for_them(lanes: str) -> None:
    # Shared prefixes, a burst then quiet (splits, merges, fetches, scan copies), and
    # slow copies. Copies on disjoint devices run at once ("device"; one at a time
    # when "serial"), never two on one device, and no switch while any runs.
    lengths = LengthDistribution(prefix_groups=4, prefix_tokens=8_192, prefix_zipf=1.0)
    reqs = phased(
        [Phase(300, 40.0, 0.0), Phase(900, 0.5, 0.5)], seed=1, long_tokens=32_768, lengths=lengths
    )
    prof = profile(d4=0.2, c4=1e-5, d8=0.25, c8=1e-5)
    config = PolicyConfig(cache=CacheManagerConfig(lanes=lanes))
    sim = Simulation(SimSettings(transfer_latency_s=2.0), prof, pool([8, 8]), config, reqs)
    devices: dict[int, set[int]] = {}  # plan -> devices of a copy under way
    most, shared, switches_mid_copy = [0], [0], [0]
    ledger, reconf = sim.policy.ledger, sim.policy.reconf
    begin, commit, abort, switch = (
        ledger.begin_copy,
        ledger.commit_copy,
        ledger.abort_copy,
        reconf.switch,
    )

    def counting_begin(plan):  # type: ignore[no-untyped-def]
        job = begin(plan)
        if job is not None:
            mine = {d for m in job.moves for d in (m[0], m[2])}
            shared[0] += sum(len(mine & other) for other in devices.values())
            devices[plan.plan_id] = mine
            most[0] = max(most[0], len(devices))
        return job

    def counting_commit(job):  # type: ignore[no-untyped-def]
        devices.pop(job.plan.plan_id)
        return commit(job)

    def counting_abort(job):  # type: ignore[no-untyped-def]
        devices.pop(job.plan.plan_id, None)
        return abort(job)

    def watched_switch(transition, now):  # type: ignore[no-untyped-def]
        switches_mid_copy[0] += len(devices)
        return switch(transition, now)

    ledger.begin_copy = counting_begin  # type: ignore[method-assign]
    ledger.commit_copy = counting_commit  # type: ignore[method-assign]
    ledger.abort_copy = counting_abort  # type: ignore[method-assign]
    reconf.switch = watched_switch  # type: ignore[method-assign]
    result = sim.run()
    assert result.copies >= 5 and {r.kind for r in result.reshapes} >= {"split", "merge"}
    assert shared[0] == 0 and not devices and switches_mid_copy[0] == 0
    assert most[0] == 1 if lanes == "serial" else most[0] > 1
    assert all(r.end_s is not None for r in result.records)


def test_baseline_routers_route_as_documented() -> None:
    reqs = [SimRequest(i, 0.0, 100) for i in range(6)]
    sim = run(reqs, [4, 4, 8], preset="round-robin")
    assert [r.worker for r in sim.records] == [0, 1, 2, 0, 1, 2]
    long_and_short = [SimRequest(0, 0.0, 40_000), SimRequest(1, 0.0, 1_000)]
    sim = run(long_and_short, [4, 4, 8], preset="length-threshold")
    assert [r.cp_degree for r in sim.records] == [8, 4]
    chain = (21, 22, 23)
    reqs = [SimRequest(0, 0.0, 1600, chain), SimRequest(1, 3.0, 1600, chain)]
    sim = run(reqs, [4, 4, 8], preset="cache-first")
    assert sim.records[1].worker == sim.records[0].worker and sim.records[1].cached_tokens == 1536


def test_percentile_interpolates() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([0, 10], 90) == 9.0


def test_simulate_command_writes_its_outputs(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = []
    for i in range(60):
        n = 600 + 97 * i
        ids = [0, *range(1000 * i + 1, 1000 * i + (n + 511) // 512)]
        lines.append(json.dumps({"timestamp": 500 * i, "input_length": n, "hash_ids": ids}))
    trace.write_text("\n".join(lines) + "\n")
    prof = profile(d4=0.05, c4=1e-5, d8=0.06, c8=1e-5)
    prof_path = tmp_path / "p.json"
    prof.save(prof_path)
    out = tmp_path / "out"
    args = ["simulate", "--trace", str(trace), "--profile", str(prof_path), "--out", str(out)]
    assert main([*args, "--composition", "2CP4/1CP8", "--seed", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "requests",
        "completed",
        "mean_ttft_s",
        "p50_ttft_s",
        "p90_ttft_s",
        "p99_ttft_s",
        "token_slo_attainment",
        "token_hit_rate",
        "splits",
        "merges",
    ):
        assert key in summary
    assert summary["requests"] == summary["completed"] == 60 and summary["devices"] == 16
    assert summary["token_hit_rate"] > 0  # block 0 is shared
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 60 and {
        "id",
        "arrival_s",
        "input_tokens",
        "cached_tokens",
        "worker",
        "cp_degree",
        "ttft_s",
    } <= set(rows[0])
    with (out / "timeline.csv").open() as f:
        timeline = list(csv.DictReader(f))
    assert timeline and {
        "rate",
        "demand_s",
        "capacity_s",
        "composition",
        "long_fraction",
        "mean_ttft_s",
        "decision",
    } <= set(timeline[0])
    assert (out / "ttft_composition.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "config.json").read_text())["pool"]["composition"] == "2CP4/1CP8"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--composition", "4XP4"], "expected parts like 4CP4"),
        (["--composition", "1CP3"], "not in [pool] degrees"),
        (["--rate-scale", "0"], "rate_scale and time_scale must be positive"),
    ],
)
def test_simulate_rejects_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,10,1\n")
    args = ["simulate", "--trace", str(trace), "--out", str(tmp_path / "o"), *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_simulate_names_the_bad_line_of_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10}\n{"timestamp": 1, "input_len\n')
    assert main(["simulate", "--trace", str(trace), "--out", str(tmp_path / "o")]) == 2
    assert "t.jsonl:2: not a Mooncake record" in capsys.readouterr().err


def test_slo_of_the_summary_is_token_weighted() -> None:
    reqs = [SimRequest(0, 0.0, 100), SimRequest(1, 0.0, 300)]
    sim = run(reqs, [4], preset="fixed", slo=TtftSlo(scale=None, fixed_s=1.5))
    result = sim.result  # type: ignore[attr-defined]

    cfg = SimpleNamespace(
        settings=sim.s, policy=sim.config, composition={4: 1}, phase_bounds=[], start=None
    )
    summary = summarize(result, cfg)  # type: ignore[arg-type]
    # TTFTs 1 s and 2 s against 1.5 s: 100 of 400 tokens met.
    assert summary["token_slo_attainment"] == pytest.approx(0.25)


def test_pool_hosts_reach_the_lattice_and_the_copy_model(tmp_path: Path) -> None:
    from vertumnus.sim import config as sim_config

    raw = {
        "pool": {"composition": "2CP16/4CP4", "degrees": [4, 8, 16], "devices_per_host": 8},
        "workload": {"phases": [{"duration_s": 10, "rate": 5.0}]},
    }
    cfg = sim_config.load(None, {}, raw=raw)
    assert cfg.lattice.devices_per_host == 8 and cfg.settings.devices_per_host == 8
    spans = sorted((c, list(cfg.lattice.hosts_of(first, c))) for first, c in [(0, 16), (32, 4)])
    assert spans == [(4, [4]), (16, [0, 1])]
    bad = {**raw, "sim": {"devices_per_host": 4}}
    with pytest.raises(ConfigError, match="devices_per_host 8 and \\[sim\\] devices_per_host 4"):
        sim_config.load(None, {}, raw=bad)
    odd = {**raw, "pool": {**raw["pool"], "devices_per_host": 6}}
    with pytest.raises(ConfigError, match="straddle"):
        sim_config.load(None, {}, raw=odd)


def test_t_ext_adds_the_hand_off_and_first_step_to_every_ttft() -> None:
    """With ``handoff_bytes_s`` and ``ext_latency_s``, each request's TTFT grows by its
    KV hand-off (its input but the last token, at that bandwidth) and the fixed part;
    the pool's own decisions do not change."""
    reqs = phased([Phase(60, 2.0, 0.1)], seed=3, long_tokens=16_384)
    prof = profile(d4=0.2, c4=1e-5, d8=0.25, c8=1e-5)
    base = SimSettings()
    ext = dataclasses.replace(base, handoff_bytes_s=10e9, ext_latency_s=0.02)
    runs = [
        Simulation(s, prof, pool([8, 8]), PolicyConfig(**PRESETS["fixed"]), reqs).run()
        for s in (base, ext)
    ]
    for plain, handed in zip(runs[0].records, runs[1].records, strict=True):
        assert handed.worker == plain.worker and handed.start_s == plain.start_s
        moved = (plain.input_tokens - 1) * base.kv_bytes_per_token / 10e9
        assert handed.ttft_s == pytest.approx(plain.ttft_s + 0.02 + moved)


def test_a_hand_off_holds_its_worker_in_a_drain_until_pulled() -> None:
    """With hand-offs modelled, a prefill's KV stays held on its worker for the pull
    (``policy/cache/holds.py``), as on the server: a merge that begins while the prefill
    runs parks that worker only when the pull ends (here 2 s after the prefill)."""
    reqs = [SimRequest(0, 0.2, 1001), SimRequest(1, 10.0, 1001)]  # (the run goes on)
    merge_soon = ControllerConfig(mode="rules", window_s=1.0, merge_after_windows=1)
    kv = SimSettings().kv_bytes_per_token
    drains = []
    for handoff_bytes_s in (0.0, 1000 * kv / 2.0):  # 1,000 tokens pulled in 2 s
        sim = run(
            reqs, [4, 4], preset="vertumnus", controller=merge_soon, handoff_bytes_s=handoff_bytes_s
        )
        result = sim.result  # type: ignore[attr-defined]
        (merge,) = result.reshapes
        assert merge.kind == "merge" and merge.started_s == 1.0
        drains.append(merge.drain_s)
    # The prefill runs 0.2 s to 1.2 s (E = d = 1 s): without a hand-off the merge
    # parks then; with one, when the pull ends at 3.2 s.
    assert drains == [pytest.approx(0.2), pytest.approx(2.2)]


@pytest.mark.parametrize("coming_reuse", [True, False])
def test_an_agent_step_follows_its_predecessor_while_it_waits(coming_reuse: bool) -> None:
    """A step (its predecessor's 8 blocks and one more) arrives while the
    predecessor runs: its worker will have written those blocks when the step
    starts (FIFO), so the step queues there and reuses them; without coming reuse it
    sees no reuse anywhere and recomputes them on the idle worker."""
    prof = profile(d4=0.1, c4=4e-4)  # E_4 = 0.1 s + 0.1 ms per uncached token
    path = tuple(range(1, 9))
    reqs = [SimRequest(0, 0.0, 4096, path), SimRequest(1, 0.2, 4608, (*path, 9))]
    config = dataclasses.replace(PolicyConfig(**PRESETS["fixed"]), coming_reuse=coming_reuse)
    sim = Simulation(SimSettings(), prof, pool([4, 4]), config, reqs)
    sim.run()
    first, step = sim.records
    assert first.ttft_s == pytest.approx(0.5096)
    if coming_reuse:  # waits 0.3096 s for the predecessor, then 0.1 + 512 x 0.1 ms
        assert (step.worker, step.cached_tokens) == (first.worker, 4096)
        assert step.ttft_s == pytest.approx(0.3096 + 0.1512)
    else:  # 0.1 + 4,608 x 0.1 ms on the other worker
        assert step.worker != first.worker and step.cached_tokens == 0
        assert step.ttft_s == pytest.approx(0.5608)
