"""The one TOML dialect of ``python -m vertumnus serve`` and ``simulate``.

The tables both commands read, with the same keys::

    [pool]        degrees, layout or composition, ranks, min_workers, max_workers,
                  devices_per_host (``config/pool.py``)
    [profile]     path                    a profile file, or a shipped profile's name
                                          ("tiny-cpu", "tiny-cpu-bf16",
                                          "qwen3-30b-a3b-h100")
    [scheduler]   router = "vertumnus"    the cost rule, or round-robin,
                                          least-load, cache-first, length-threshold,
                                          sglang-cache-aware, dynamo-kv, llm-d
                  beta, gpu_penalty, backlog_weight, max_tokens_per_rank, coming_reuse
    [controller]  enabled = true          adaptive; false: a fixed composition (the
                                          decisions are only noted)
                  mode = "whatif"         or "rules" (the paper's thresholds)
                  and the fields of ``ControllerConfig`` (decision_s, margin, ...)
    [cache]       replication = true      the cache manager's scans; false: every
                                          worker keeps a plain LRU cache
                  ideal = false           simulate only: the bound (every worker
                                          reuses the longest prefix cached anywhere)
                  scan_interval_s, reserve_fraction, retain_s, fetch_at_switch,
                  and the fields of
                  ``CacheManagerConfig`` (theta_inter_s, decay, ...)
    [engine]      block_size, kv_blocks_per_rank: the KV geometry the policy plans
                  with; the rest (device, dtype, ...) configures serve's ranks

``serve`` alone reads ``[model]``, ``[server]`` and ``[cluster]``; ``simulate`` alone
``[sim]`` and ``[workload]``. One file may hold both commands' tables: each reads its
own and the shared ones, so a served pool can be simulated from its own file (with
a workload whose prefix blocks are the pool's ``block_size``: a mismatch is refused).

``--preset NAME`` (both commands) is a preset of the three choices, applied over
the file (``policy/pool_config.py``: vertumnus, fixed, no-replication, or a
baseline router's name). Unknown tables, unknown keys and keys of earlier versions
are errors that name them and say what to write instead.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from vertumnus.config.engine import EngineConfig
from vertumnus.config.tables import ConfigError, build_table
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.cache.retention import RetentionConfig
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.costs import CostWeights
from vertumnus.policy.pool_config import PolicyConfig, PolicyError, preset

SHARED_TABLES = ("pool", "profile", "scheduler", "controller", "cache", "engine")
SERVE_TABLES = ("model", "server", "cluster", "handoff", "decode")
SIMULATE_TABLES = ("sim", "workload")
# Spellings of earlier versions -> what to write now.
MOVED = {
    "policy": (
        "[scheduler] router, [controller] enabled (adaptive or fixed) and "
        "[cache] replication; the old policy names are presets: --preset NAME"
    ),
    "sim.block_tokens": "[engine] block_size",
    "sim.blocks_per_rank": "[engine] kv_blocks_per_rank",
    "sim.scan_interval_s": "[cache] scan_interval_s",
    "sim.policy": "--preset NAME, or [scheduler] router",
    "scheduler.policy": "[scheduler] router",
    # An experiment file's variants (tools/experiments/sim_experiment.py).
    "experiment.variants.policy": "preset = NAME (a --preset name)",
}


def check_tables(raw: Mapping[str, Any], where: str) -> None:
    """Refuse unknown tables and keys of earlier versions."""
    for name, value in raw.items():
        if name == "experiment":
            raise ConfigError(
                f"{where}: [experiment] is an experiment file's table: run it with "
                f"`python -m tools.experiments.sim_experiment {where}`"
            )
        if name in MOVED:
            raise ConfigError(f"{where}: [{name}] is gone: write {MOVED[name]}")
        if name not in (*SHARED_TABLES, *SERVE_TABLES, *SIMULATE_TABLES):
            known = sorted((*SHARED_TABLES, *SERVE_TABLES, *SIMULATE_TABLES))
            raise ConfigError(f"{where}: unknown table [{name}]; known: {', '.join(known)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: [{name}] must be a table")
        check_keys(value, name, where)


def check_keys(table: Mapping[str, Any], name: str, where: str) -> None:
    """Refuse the keys of earlier versions in the table ``name`` (dotted: ``a.b``)."""
    for key in table:
        moved = MOVED.get(f"{name}.{key}")
        if moved is not None:
            raise ConfigError(f"{where}: [{name}] {key} moved: write {moved}")


def with_overrides(
    raw: Mapping[str, Any], overrides: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """A copy of ``raw`` with ``overrides`` ({table: {key: value}}) applied over it;
    None values are ignored (a flag not given)."""
    merged = copy.deepcopy(dict(raw))
    for table, values in overrides.items():
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            merged[table] = {**merged.get(table, {}), **given}
    return merged


def apply_preset(raw: dict[str, Any], name: str | None) -> dict[str, Any]:
    """``raw`` with the three choices of preset ``name`` over it (None: unchanged)."""
    if name is None:
        return raw
    try:
        choices = preset(name)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from exc
    return with_overrides(
        raw,
        {
            "scheduler": {"router": choices["router"]},
            "controller": {"enabled": choices["adaptive"]},
            "cache": {"replication": choices["replication"], "ideal": choices["ideal_reuse"]},
        },
    )


def _flag(table: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = table.pop(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"[{where}] {key} must be true or false, got {value!r}")
    return value


def read_policy(raw: Mapping[str, Any], base: PolicyConfig) -> PolicyConfig:
    """``[scheduler]``, ``[controller]`` and ``[cache]`` over ``base``."""
    scheduler = dict(raw.get("scheduler", {}))
    router = str(scheduler.pop("router", base.router))
    max_tokens = scheduler.pop("max_tokens_per_rank", base.max_tokens_per_rank)
    coming_reuse = _flag(scheduler, "coming_reuse", "scheduler", base.coming_reuse)
    weights = build_table(CostWeights, scheduler, "scheduler", base.weights)
    controller = dict(raw.get("controller", {}))
    adaptive = _flag(controller, "enabled", "controller", base.adaptive)
    cache = dict(raw.get("cache", {}))
    replication = _flag(cache, "replication", "cache", base.replication)
    ideal_reuse = _flag(cache, "ideal", "cache", base.ideal_reuse)
    scan_interval_s = cache.pop("scan_interval_s", base.scan_interval_s)
    retention = {
        k: cache.pop(k) for k in ("reserve_fraction", "retain_s", "fetch_at_switch") if k in cache
    }
    parts = {
        "weights": weights,
        "controller": build_table(ControllerConfig, controller, "controller", base.controller),
        "cache": build_table(CacheManagerConfig, cache, "cache", base.cache),
        "retention": build_table(RetentionConfig, retention, "cache", base.retention),
    }
    try:
        return PolicyConfig(
            router=router,
            adaptive=adaptive,
            replication=replication,
            ideal_reuse=ideal_reuse,
            scan_interval_s=float(scan_interval_s),
            max_tokens_per_rank=max_tokens,
            coming_reuse=coming_reuse,
            **parts,
        )
    except PolicyError as exc:
        where = {
            "router": "[scheduler] router",
            "scan_interval_s": "[cache]",
            "ideal_reuse": "[cache] ideal",
        }
        raise ConfigError(f"{where.get(exc.field or '', '[scheduler]')}: {exc}") from exc


def read_engine(raw: Mapping[str, Any], base: EngineConfig) -> EngineConfig:
    engine: EngineConfig = build_table(EngineConfig, raw.get("engine", {}), "engine", base)
    return engine


def read_profile(raw: Mapping[str, Any], default: str) -> str:
    """``[profile] path``: a profile file, or the name of a shipped profile."""
    table = dict(raw.get("profile", {}))
    path = str(table.pop("path", default))
    if table:
        raise ConfigError(f"[profile] unknown keys {sorted(table)}; known: ['path']")
    return path
