"""Simulator configuration: a TOML file (``configs/sim/*.toml``) plus CLI overrides.

Tables and keys (every key optional; the defaults are the dataclasses' fields)::

    [pool]        composition = "4CP4/3CP8"   degrees = [4, 8]   devices_per_host = 8
                  (optional: hosts in the lattice, and the copy model's host size)
                  min_workers = {"8" = 1}      max_workers = {"4" = 8}
    [profile]     path = "configs/profiles/qwen3-30b-a3b-h100.json"
    [policy]      name = "vertumnus"   beta = 1.0   gpu_penalty = 0.0
    [sim]         seed, switch_s, noise_cv, slo = "5x", scan_interval_s, block_tokens,
                  blocks_per_rank, kv_bytes_per_token, devices_per_host,
                  intra_host_bytes_s, inter_host_bytes_s, transfer_latency_s
    [controller]  the fields of ``ControllerConfig`` (window_s, upper_fraction, ...)
    [cache]       the fields of ``CacheManagerConfig`` (theta_inter_s, decay, ...),
                  and reserve_fraction, retain_s (``RetentionConfig``, as the server)
    [workload]    trace = "../shared/traces/conversation_trace.jsonl",
                  rate_scale, time_scale, max_requests, seed, long_tokens
                  [[workload.phases]] duration_s, rate, long_fraction, burstiness
                  [workload.lengths] the fields of ``LengthDistribution``

Paths are relative to the working directory. With phases, the trace (if any) is
the pool the phases draw from; without, the trace is replayed as it is. Unknown
tables or keys are errors that name them.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vertumnus.config import ConfigError, build_table
from vertumnus.perfmodel import Profile
from vertumnus.policy.cache_plans import CacheManagerConfig
from vertumnus.policy.composition import layout_for
from vertumnus.policy.controller import ControllerConfig
from vertumnus.policy.costs import CostWeights
from vertumnus.policy.kv_ledger import RetentionConfig
from vertumnus.policy.lattice import LatticeConfig, LatticeError
from vertumnus.sim.simulator import SimSettings, SimulationError
from vertumnus.sim.traces import load_trace
from vertumnus.sim.workload import (
    LengthDistribution,
    Phase,
    SimRequest,
    from_trace,
    phased,
    transform,
)
from vertumnus.slo import TtftSlo

DEFAULT_PROFILE = "qwen3-30b-a3b-h100"
DEFAULT_TRACE = Path("../shared/traces/conversation_trace.jsonl")
TABLES = ("pool", "profile", "policy", "sim", "controller", "cache", "workload")
_COMPOSITION = re.compile(r"^\s*(\d+)\s*CP\s*(\d+)\s*$", re.IGNORECASE)


def parse_composition(text: str) -> dict[int, int]:
    """``4CP4/3CP8`` -> ``{4: 4, 8: 3}`` (workers per degree)."""
    counts: dict[int, int] = {}
    for part in text.split("/"):
        match = _COMPOSITION.match(part)
        if match is None:
            raise SimulationError(
                f"composition {text!r}: expected parts like 4CP4 joined by '/', got {part!r}"
            )
        n, degree = int(match.group(1)), int(match.group(2))
        if n < 1 or degree < 1:
            raise SimulationError(f"composition {text!r}: counts and degrees must be >= 1")
        counts[degree] = counts.get(degree, 0) + n
    return counts


@dataclasses.dataclass(frozen=True)
class SimConfig:
    settings: SimSettings
    lattice: LatticeConfig
    layout: list[int]
    composition: dict[int, int]
    profile: Profile
    profile_path: Path
    requests: list[SimRequest]
    phase_bounds: list[tuple[float, float]]  # (start, end) of each phase, seconds
    raw: dict[str, Any]  # the merged configuration, as run


def _table(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise SimulationError(f"[{name}] must be a table")
    return dict(value)


def _build(cls: type[Any], values: Mapping[str, Any], where: str) -> Any:
    try:
        return build_table(cls, values, where)
    except ConfigError as exc:
        raise SimulationError(str(exc)) from exc


def read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SimulationError(f"{path}: {exc}") from exc


def load(
    path: Path | None,
    overrides: Mapping[str, Mapping[str, Any]],
    raw: Mapping[str, Any] | None = None,
) -> SimConfig:
    """Read ``path`` (or take ``raw``, or nothing), apply ``overrides`` ({table: {key:
    value}}, None values ignored), build."""
    raw = dict(raw) if raw is not None else (read(path) if path is not None else {})
    unknown = sorted(set(raw) - set(TABLES))
    if unknown:
        raise SimulationError(
            f"{path or 'config'}: unknown tables {unknown}; known: {list(TABLES)}"
        )
    for table, values in overrides.items():
        merged = _table(raw, table)
        merged.update({k: v for k, v in values.items() if v is not None})
        raw[table] = merged

    pool = _table(raw, "pool")
    composition = parse_composition(str(pool.pop("composition", "4CP4/3CP8")))
    degrees = tuple(int(c) for c in pool.pop("degrees", [4, 8]))
    bounds = {
        key: {int(c): int(n) for c, n in dict(pool.pop(key, {})).items()}
        for key in ("min_workers", "max_workers")
    }
    hosts = pool.pop("devices_per_host", None)
    if pool:
        raise SimulationError(f"[pool] unknown keys {sorted(pool)}")
    outside = sorted(set(composition) - set(degrees))
    if outside:
        raise SimulationError(
            f"composition degrees {outside} are not in [pool] degrees {list(degrees)}"
        )
    devices = sum(c * n for c, n in composition.items())
    try:
        lattice = LatticeConfig(
            devices,
            degrees,
            bounds["min_workers"],
            bounds["max_workers"],
            None if hosts is None else int(hosts),
        )
        layout = layout_for(lattice, composition)
    except LatticeError as exc:
        raise SimulationError(str(exc)) from exc

    profile_table = _table(raw, "profile")
    profile_path = Path(profile_table.pop("path", DEFAULT_PROFILE))
    if profile_table:
        raise SimulationError(f"[profile] unknown keys {sorted(profile_table)}")
    profile = Profile.load(profile_path)

    policy = _table(raw, "policy")
    name = str(policy.pop("name", "vertumnus"))
    weights = _build(CostWeights, policy, "policy")
    cache = _table(raw, "cache")
    retention: dict[str, Any] = {
        k: cache.pop(k) for k in ("reserve_fraction", "retain_s") if k in cache
    }
    sim = _table(raw, "sim")
    # One host size for the lattice and the copy model.
    if hosts is not None and sim.setdefault("devices_per_host", int(hosts)) != int(hosts):
        raise SimulationError(
            f"[pool] devices_per_host {hosts} and [sim] devices_per_host "
            f"{sim['devices_per_host']} differ"
        )
    if "slo" in sim:
        sim["slo"] = TtftSlo.parse(str(sim["slo"]))
    settings = _build(
        SimSettings,
        {
            **sim,
            "policy": name,
            "weights": weights,
            "controller": _build(ControllerConfig, _table(raw, "controller"), "controller"),
            "cache": _build(CacheManagerConfig, cache, "cache"),
            "retention": _build(RetentionConfig, retention, "cache"),
        },
        "sim",
    )
    requests, bounds_s = _workload(_table(raw, "workload"), settings)
    return SimConfig(
        settings, lattice, layout, composition, profile, profile_path, requests, bounds_s, raw
    )


def _workload(
    table: dict[str, Any], settings: SimSettings
) -> tuple[list[SimRequest], list[tuple[float, float]]]:
    trace_path = table.pop("trace", None)
    rate_scale = float(table.pop("rate_scale", 1.0))
    time_scale = float(table.pop("time_scale", 1.0))
    max_requests = table.pop("max_requests", None)
    seed = int(table.pop("seed", settings.seed))
    long_tokens = int(table.pop("long_tokens", settings.controller.long_tokens))
    phases = [_build(Phase, p, "workload.phases") for p in table.pop("phases", [])]
    lengths = table.pop("lengths", None)
    if table:
        raise SimulationError(f"[workload] unknown keys {sorted(table)}")
    pool = None
    if trace_path is not None:
        pool = from_trace(load_trace(Path(trace_path)))
    if phases:
        # Generated phases keep their durations (times time_scale); rate_scale
        # multiplies each phase's rate.
        phases = [
            dataclasses.replace(p, rate=p.rate * rate_scale, duration_s=p.duration_s * time_scale)
            for p in phases
        ]
        dist = _build(LengthDistribution, lengths, "workload.lengths") if lengths else None
        requests = transform(phased(phases, seed, long_tokens, pool, dist), 1.0, 1.0, max_requests)
        starts = [sum(p.duration_s for p in phases[:i]) for i in range(len(phases) + 1)]
        bounds = list(itertools.pairwise(starts))
    elif pool is not None:
        # A trace keeps its requests: rate_scale compresses its timeline.
        requests, bounds = transform(pool, rate_scale, time_scale, max_requests), []
    else:
        raise SimulationError("no workload: give --trace, or [workload] trace or phases")
    if not requests:
        raise SimulationError("the workload has no requests")
    return requests, bounds
