"""Simulator configuration: the shared TOML dialect plus ``[sim]`` and ``[workload]``.

The pool, profile, scheduler, controller, cache and engine tables are the ones
``serve`` reads, with the same keys (``vertumnus/config/dialect.py``). Of its own,
``simulate`` reads::

    [sim]         seed, switch_s, dispatch_s, noise_cv, slo = "5x", window_phase_s,
                  kv_bytes_per_token, devices_per_host (the copy model's host size,
                  unless [pool] devices_per_host gives the lattice one),
                  intra_host_bytes_s, inter_host_bytes_s, transfer_latency_s,
                  handoff_bytes_s and ext_latency_s (T_ext: the KV hand-off to a
                  decode server and its first step; 0: none) (``sim/time_model.py``)
    [workload]    trace (a Mooncake JSONL or Azure CSV file; required unless phases
                  are given), rate_scale, time_scale, max_requests, seed, long_tokens
                  [[workload.phases]] duration_s, rate, long_fraction, burstiness
                  [workload.lengths] the fields of ``LengthDistribution``

Its embedded default (no file): 40 GPUs at degrees {4, 8} starting as 4CP4/3CP8,
the shipped Qwen3-30B-A3B / H100 profile, KV blocks of 512 tokens (the traces'
block) and 293 of them per rank (about 150K tokens of that model's KV on an 80 GB
GPU), and the preset ``vertumnus``. A workload's prefix blocks must be
``[engine] block_size`` tokens (Mooncake's are 512), or every reuse would be
mispriced: a mismatch is an error. Paths are relative to the working directory.
``[pool] composition = "auto"`` is resolved as ``serve`` resolves it
(``config/start.py``), never from this workload; a ``[pool] state_file`` is read
then, and written at the end of the run (``cli/simulate.py``). With phases, the
trace (if any) is the pool the phases draw from; without, the trace is replayed as
it is.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vertumnus.config.dialect import (
    apply_preset,
    check_tables,
    read_engine,
    read_policy,
    read_profile,
    with_overrides,
)
from vertumnus.config.engine import EngineConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.config.start import StartDecision, resolve_start
from vertumnus.config.tables import ConfigError, build_table, read_toml
from vertumnus.perfmodel import Profile
from vertumnus.policy.control.composition import layout_for
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec
from vertumnus.sim.time_model import SimSettings
from vertumnus.sim.workload import (
    LengthDistribution,
    Phase,
    SimRequest,
    from_trace,
    phased,
    transform,
)
from vertumnus.slo import TtftSlo
from vertumnus.traces import load_trace

DEFAULT_POOL = PoolConfig((4, 8), tuple(layout_for(LatticeConfig(40, (4, 8)), {4: 4, 8: 3})))
DEFAULT_PROFILE = "qwen3-30b-a3b-h100"
DEFAULT_ENGINE = EngineConfig(block_size=512, kv_blocks_per_rank=293)
DEFAULT_POLICY = PolicyConfig()


@dataclasses.dataclass(frozen=True)
class SimConfig:
    settings: SimSettings
    policy: PolicyConfig
    pool: PoolConfig
    engine: EngineConfig
    profile: Profile
    profile_path: str
    requests: list[SimRequest]
    phase_bounds: list[tuple[float, float]]  # (start, end) of each phase, seconds
    raw: dict[str, Any]  # the merged configuration, as run
    start: StartDecision | None = None  # how "auto" chose the start (None: it was given)

    @property
    def spec(self) -> PoolSpec:
        return self.pool.spec(self.engine)

    @property
    def lattice(self) -> LatticeConfig:
        return self.pool.lattice

    @property
    def layout(self) -> list[int]:
        return list(self.pool.layout)

    @property
    def composition(self) -> dict[int, int]:
        return self.pool.composition


def load(
    path: Path | None,
    overrides: Mapping[str, Mapping[str, Any]],
    raw: Mapping[str, Any] | None = None,
    preset: str | None = None,
    choices: Mapping[str, Mapping[str, Any]] | None = None,
) -> SimConfig:
    """Read ``path`` (or take ``raw``, or nothing), apply ``overrides`` ({table: {key:
    value}}, None values ignored), then the ``preset``'s three choices, then the
    ``choices`` given one by one (CLI flags), and build."""
    where = str(path) if path is not None else "config"
    source = dict(raw) if raw is not None else (read_toml(path) if path is not None else {})
    check_tables(source, where)
    merged = apply_preset(with_overrides(source, overrides), preset)
    merged = with_overrides(merged, choices or {})
    pool = PoolConfig.from_table(merged.get("pool", {}), DEFAULT_POOL)
    engine = read_engine(merged, DEFAULT_ENGINE)
    policy = read_policy(merged, DEFAULT_POLICY)
    profile_path = read_profile(merged, DEFAULT_PROFILE)
    profile = Profile.load(profile_path)
    # "auto": from what a server has (config/start.py), never from the workload below.
    pool, start = resolve_start(pool, profile, policy)
    sim = dict(merged.get("sim", {}))
    # One host size for the lattice and the copy model.
    hosts = pool.devices_per_host
    if hosts is not None and sim.setdefault("devices_per_host", hosts) != hosts:
        raise ConfigError(
            f"[pool] devices_per_host {hosts} and [sim] devices_per_host "
            f"{sim['devices_per_host']} differ"
        )
    if "slo" in sim:
        sim["slo"] = TtftSlo.parse(str(sim["slo"]))
    settings: SimSettings = build_table(SimSettings, sim, "sim")
    workload = dict(merged.get("workload", {}))
    requests, bounds, block_tokens = _workload(
        workload, settings.seed, policy.controller.long_tokens, engine.block_size
    )
    if block_tokens is not None and block_tokens != engine.block_size:
        raise ConfigError(
            f"the workload's prefix blocks are {block_tokens} tokens but [engine] block_size "
            f"is {engine.block_size}: the policy would misprice every reuse; set "
            f"[engine] block_size = {block_tokens}"
        )
    return SimConfig(
        settings, policy, pool, engine, profile, profile_path, requests, bounds, merged, start
    )


def _workload(
    table: dict[str, Any], default_seed: int, default_long_tokens: int, block_size: int
) -> tuple[list[SimRequest], list[tuple[float, float]], int | None]:
    """(requests, phase bounds, tokens per prefix block of the requests; None: they
    carry no prefix blocks). Generated lengths come in ``block_size`` blocks unless
    ``[workload.lengths] block_tokens`` says otherwise."""
    trace_path = table.pop("trace", None)
    rate_scale = float(table.pop("rate_scale", 1.0))
    time_scale = float(table.pop("time_scale", 1.0))
    max_requests = table.pop("max_requests", None)
    seed = int(table.pop("seed", default_seed))
    long_tokens = int(table.pop("long_tokens", default_long_tokens))
    phases = [build_table(Phase, p, "workload.phases") for p in table.pop("phases", [])]
    lengths = table.pop("lengths", None)
    if table:
        raise ConfigError(f"[workload] unknown keys {sorted(table)}")
    pool = None
    block_tokens: int | None = None
    if trace_path is not None:
        trace = load_trace(Path(trace_path))
        pool = from_trace(trace)
        block_tokens = trace.block_tokens
    if phases:
        # Generated phases keep their durations (times time_scale); rate_scale
        # multiplies each phase's rate.
        phases = [
            dataclasses.replace(p, rate=p.rate * rate_scale, duration_s=p.duration_s * time_scale)
            for p in phases
        ]
        dist = build_table(
            LengthDistribution, {"block_tokens": block_size, **(lengths or {})}, "workload.lengths"
        )
        requests = transform(phased(phases, seed, long_tokens, pool, dist), 1.0, 1.0, max_requests)
        if pool is None:
            block_tokens = dist.block_tokens
        starts = [sum(p.duration_s for p in phases[:i]) for i in range(len(phases) + 1)]
        bounds = list(itertools.pairwise(starts))
    elif pool is not None:
        # A trace keeps its requests: rate_scale compresses its timeline.
        requests, bounds = transform(pool, rate_scale, time_scale, max_requests), []
    else:
        raise ConfigError("no workload: give --trace, or [workload] trace or phases")
    if not requests:
        raise ConfigError("the workload has no requests")
    if not any(r.block_ids for r in requests):
        block_tokens = None
    return requests, bounds, block_tokens
