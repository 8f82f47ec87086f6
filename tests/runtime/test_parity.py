"""One policy stack: the same trace slice through the simulator and through the live
coordinator (in-process fake ranks on simulated time, service times from the
profile) gives identical placements and identical controller decisions.

The slice is a conversation trace in Mooncake's format, written here: 40 sessions
that share a system prompt and grow turn after turn (prefix reuse), a burst that
makes the controller split, then a quiet spell that makes it merge. Both sides read
one serve configuration, so both build ``PoolPolicy`` from the same profile, pool
and policy; the simulator times work with its time model, and the fake ranks
answer after the very same times. Arrivals sit 0.3 ms off the window and scan
boundaries (multiples of 2.5 s), so no two events tie."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import pytest

from support.fake_ranks import FakeRanks
from support.traces import write_trace
from support.virtual_time import run_virtual
from vertumnus import loadgen
from vertumnus.blocks import block_ids
from vertumnus.config import EngineConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.control.decision import Decision
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.policy.timeline import Timeline
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.request_path import PrefillResult
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.sim.simulator import Simulation
from vertumnus.sim.time_model import SimSettings, TimeModel
from vertumnus.sim.workload import SimRequest
from vertumnus.traces import load_trace

BLOCK = 16
LENGTH_SCALE = 0.5  # a 512-token trace block is 256 tokens, 16 engine blocks
OFFSET_S = 3e-4


# The what-if controller, on this short slice: decisions as often as the rules'
# windows, a forecast of the last 5 s (the warm-up: its first 5 s).
WHATIF = ControllerConfig(decision_s=2.5, horizon_s=5.0, min_requests=40)
RULES = ControllerConfig(mode="rules", window_s=2.5)


# The paper's Algorithm 2 unpriced and without pulls (the slice's caches are not
# full: priced reclamations would not run), so that both drivers run copies and
# reclamations alike; and the default manager, whose pulls they must run alike.
PAPER_CACHE = CacheManagerConfig(
    theta_intra=3.0, theta_reclaim=0.5, theta_inter_s=0.05, priced=False, pull=False
)
PULLS = CacheManagerConfig(theta_intra=3.0, theta_reclaim=0.5, theta_inter_s=0.05)
# The default manager with a host tier, on caches small enough that prefills evict:
# the tier's demotions and loads must run alike (its copies take no time here: the
# fake ranks model no bytes, so the profile's host link is infinitely fast).
TIER = dataclasses.replace(PULLS, host_tier_bytes=256 * BLOCK * 2048)
TIER_BLOCKS_PER_RANK = 48


def serve_config(
    tmp_path: Path, controller: ControllerConfig, cache: CacheManagerConfig
) -> ServeConfig:
    profile = Profile(
        "tiny",
        "fake",
        BLOCK,
        {
            1: DegreeCoeffs(d=0.004, a=1e-6, c=2.0e-5, alpha=2e-10),
            2: DegreeCoeffs(d=0.007, a=2e-6, c=2.2e-5, alpha=2e-10),
        },
    )
    profile.capacity = {1: {"kappa_s": 0.6}, 2: {"kappa_s": 0.8}}
    profile.host_link = {"kv_bytes_per_token": 2048, "d2h_bytes_s": 1e300, "h2d_bytes_s": 1e300}
    path = tmp_path / "profile.json"
    profile.save(path)
    return ServeConfig(
        pool=PoolConfig(degrees=(1, 2), layout=(2, 2)),
        # Room for every conversation's chain and its replicas: with 256 blocks a
        # replica is evicted before the quiet spell would reclaim it, and reclamation
        # ran only where placement had scattered a conversation over two workers.
        engine=EngineConfig(
            compile="off",
            block_size=BLOCK,
            kv_blocks_per_rank=TIER_BLOCKS_PER_RANK if cache.host_tier_bytes else 1024,
            dtype="float32",  # the KV bytes per block the profile's host link was given
        ),
        profile=str(path),
        policy=PolicyConfig(
            controller=controller,
            scan_interval_s=1.25,
            cache=cache,
        ),
        request_timeout_s=1e6,
    )


SETTINGS = SimSettings(switch_s=0.02, transfer_latency_s=0.002, kv_bytes_per_token=2048)


def run_simulator(cfg: ServeConfig, requests: list[loadgen.LoadRequest]) -> Simulation:
    sim_requests = [
        SimRequest(r.index, r.arrival_s, r.input_tokens, tuple(block_ids(r.token_ids, BLOCK)))
        for r in requests
    ]
    sim = Simulation(SETTINGS, Profile.load(cfg.profile), cfg.pool_spec, cfg.policy, sim_requests)
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def run_coordinator(
    cfg: ServeConfig, requests: list[loadgen.LoadRequest]
) -> tuple[dict[int, PrefillResult], list[Decision], Coordinator]:
    async def main() -> tuple[dict[int, PrefillResult], list[Decision], Coordinator]:
        loop = asyncio.get_running_loop()
        curves = reuse_curves(Profile.load(cfg.profile).coeffs)
        fake = FakeRanks(cfg.ranks, curves, TimeModel(SETTINGS, BLOCK))
        coord = Coordinator(cfg, ranks=fake, clock=loop.time, offload_decisions=False)
        fake.deliver = coord.link.on_message
        await coord.start()
        assert loop.time() == 0.0, "the windows start where the simulator's do"
        results: dict[int, PrefillResult] = {}
        tasks: list[asyncio.Task[None]] = []

        async def one(r: loadgen.LoadRequest) -> None:
            results[r.index] = await coord.prefill(r.token_ids)

        # Arrive in trace order, at the trace's times (several may share one).
        for r in requests:
            if r.arrival_s > loop.time():
                await asyncio.sleep(r.arrival_s - loop.time())
            tasks.append(asyncio.ensure_future(one(r)))
        await asyncio.gather(*tasks)
        decisions = list(coord.policy.controller.history)
        await coord.close()
        return results, decisions, coord

    return run_virtual(main())


def decisions_of(history: list[Decision]) -> list[tuple[object, ...]]:
    return [
        (
            d.window,
            d.rule,
            tuple((op.kind, op.sources, op.target_degree) for op in d.ops),
            d.demand_s,
            d.capacity_s,
            d.long_fraction,
            # the what-if controller's candidates and predictions (within 1e-9 of
            # each other, ``alike``: the two clocks subtract their times in different
            # orders)
            rounded(d.inputs),
        )
        for d in history
    ]


def alike(a: object, b: object) -> bool:
    """Equal, floats within a relative 1e-9 (not rounded: two values either side of a
    rounding boundary would differ in their last digit)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def rounded(value: object) -> object:
    """``value`` with its dicts as sorted tuples, for ``alike``."""
    if isinstance(value, float):
        return value
    if isinstance(value, dict):
        return tuple(sorted((k, rounded(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(rounded(v) for v in value)
    return value


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("controller", "burst_rate", "cache"),
    [
        (WHATIF, 120.0, PAPER_CACHE),
        (RULES, 40.0, PAPER_CACHE),
        (WHATIF, 120.0, PULLS),
        (WHATIF, 120.0, TIER),
    ],
    ids=["whatif", "rules", "whatif-pulls", "whatif-tier"],
)
def test_simulator_and_coordinator_place_and_decide_alike(
    tmp_path: Path, controller: ControllerConfig, burst_rate: float, cache: CacheManagerConfig
) -> None:
    trace_path = tmp_path / "slice.jsonl"
    write_trace(trace_path, burst_rate=burst_rate)
    requests = loadgen.from_trace(load_trace(trace_path), LENGTH_SCALE, vocab=256)
    requests = [loadgen.LoadRequest(r.index, r.arrival_s + OFFSET_S, r.token_ids) for r in requests]
    assert 300 <= len(requests) <= 1500
    cfg = serve_config(tmp_path, controller, cache)

    sim = run_simulator(cfg, requests)
    results, coord_history, coord = run_coordinator(cfg, requests)

    simulated = [(r.worker, r.cp_degree, r.cached_tokens) for r in sim.records]
    served = [
        (results[i].worker, results[i].cp_degree, results[i].cached_tokens)
        for i in range(len(requests))
    ]
    assert served == simulated
    # The simulator's last row is the window the run ended in (decided nothing).
    sim_history = sim.result.decisions[:-1]  # type: ignore[attr-defined]
    coord_decisions, sim_decisions = decisions_of(coord_history), decisions_of(sim_history)
    assert [d[:-1] for d in coord_decisions] == [d[:-1] for d in sim_decisions]
    inputs = [(c[-1], s[-1]) for c, s in zip(coord_decisions, sim_decisions, strict=True)]
    assert all(alike(c, s) for c, s in inputs), inputs
    # The slice exercised what it was written for.
    kinds = [op.kind for d in sim_history for op in d.ops]
    assert "split" in kinds and "merge" in kinds, kinds
    assert sum(c for _, _, c in simulated) > 0  # prefix reuse
    audit = sim.policy.cache.audit.kinds
    if cache.host_tier_bytes:  # the tier demoted and loaded back, alike
        tiers = sim.policy.tiers.stats
        assert tiers.demoted_blocks > 0 and tiers.loaded_blocks > 0, tiers
        assert coord.policy.tiers.stats == tiers
        assert coord.tier is None  # (the fake ranks hold no KV: nothing to copy)
    elif cache.pull:  # pulls ran, and every one served its request
        assert audit["pull"].copies > 0 and audit["pull"].wasted_blocks == 0
    else:  # the scan copied and reclaimed
        assert sim.copies > 0 and sim.reclaims > 0 and "pull" not in audit
    assert coord.metrics.replication_count == sim.copies
    assert coord.metrics.reclamation_count == sim.reclaims

    # The dashboard's timeline: each reshape begun, at the same time, on the same rule,
    # and each move's audit with the same figures.
    def events(line: Timeline) -> list[tuple[object, ...]]:
        # (an audit's measured figures are each driver's own: its identity is shared)
        same = ("audit", "window", "at_s", "move", "band", "composition", "requests")
        return [
            (e["t"], e["kind"], e["rule"], str(e["ops"]), [e["inputs"].get(k) for k in same])
            if e["kind"] == "audit"
            else (e["t"], e["kind"], e["rule"], str(e["ops"]))
            for e in line.events
        ]

    assert events(coord.metrics.timeline) == events(sim.result.timeline)  # type: ignore[attr-defined]
    kinds_seen = [e["kind"] for e in coord.metrics.timeline.events]
    assert len([k for k in kinds_seen if k != "audit"]) == len(sim.reshapes) > 0
    if controller.mode == "whatif":
        assert "audit" in kinds_seen  # every move is audited, alike in both drivers
