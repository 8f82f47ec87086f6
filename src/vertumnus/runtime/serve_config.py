"""Serving configuration: ``configs/serve/*.toml`` plus CLI flags.

    [model]       name = "tiny"                 # preset or Hugging Face folder
    [pool]        ranks = 2, degrees = [1, 2], layout = [1, 1]   # degrees by device
    [engine]      block_size, kv_blocks_per_rank, threads_per_rank, device, dtype,
                  seed, rank_timeout_s
    [profile]     path = "configs/profiles/tiny-cpu.json"   # E_C(R, P) and kappa_C
    [scheduler]   policy = "vertumnus" (the cost rule) or a baseline router
                  (round-robin, least-load, cache-first, length-threshold), beta,
                  gpu_penalty
    [controller]  enabled = true, and the fields of ``ControllerConfig``
    [cache]       scan_interval_s = 5 (0: no scans), reserve_fraction = 0.25 and
                  retain_s = 60 (KV a reshape leaves behind: ``RetentionConfig``),
                  and the fields of ``CacheManagerConfig`` (theta_inter_s, ...)
    [server]      max_queued = 1024, request_timeout_s = 120, shutdown_grace_s = 30,
                  step_timeout_s = 60 (a prefill unanswered this long: its worker's
                  ranks are killed and restarted), max_restart_attempts = 5,
                  admin_token (or $VERTUMNUS_ADMIN_TOKEN; none: admin calls
                  refused), api_key (or $VERTUMNUS_API_KEY; none: /v1 is open)
    [cluster]     listen = "0.0.0.0:7700", hosts = 2: a multi-host pool; the ranks
                  run under node agents (``python -m vertumnus agent``), and
                  [pool] ranks is learned from them (see ``ClusterConfig``)

The embedded default (no file) is the ``tiny`` model on two CPU ranks, starting as
two degree-1 workers that may merge into one degree-2 worker: the shipped CPU
profile covers degrees 1 and 2, and this development machine has two cores. On
CUDA, give ``ranks`` = the number of GPUs (one rank per GPU) and a profile of them.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from vertumnus.config import ConfigError, EngineConfig, build_table
from vertumnus.policy.cache_plans import CacheManagerConfig
from vertumnus.policy.controller import ControllerConfig
from vertumnus.policy.costs import CostWeights
from vertumnus.policy.kv_ledger import RetentionConfig

DEFAULT_PROFILE = "tiny-cpu"


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: the coordinator waits for ``hosts`` node agents on ``listen``
    (``HOST:PORT``; port 0: a free one), each running the ranks of one host. Every
    host must run the same number of ranks (``devices_per_host``, learned from the
    agents). The secret (``$VERTUMNUS_CLUSTER_SECRET`` or ``secret``, at least 16
    characters) signs and encrypts the control channel (``runtime/control.py``)."""

    listen: str = "0.0.0.0:7700"
    hosts: int = 1
    secret: str | None = dataclasses.field(default=None, repr=False)
    heartbeat_s: float = 1.0  # each side's heartbeat period
    agent_timeout_s: float = 5.0  # an agent silent this long is gone (a dropped
    # connection is seen at once)
    join_timeout_s: float = 600.0  # start-up: how long to wait for every agent

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise ConfigError("[cluster] hosts must be >= 1")
        if not 0 < self.heartbeat_s < self.agent_timeout_s:
            raise ConfigError("[cluster] need 0 < heartbeat_s < agent_timeout_s")
        if self.join_timeout_s <= 0:
            raise ConfigError("[cluster] join_timeout_s must be > 0")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"[cluster] listen must be HOST:PORT, got {self.listen!r}")
        if self.secret is None or len(self.secret) < 16:
            raise ConfigError(
                "[cluster] needs a secret of at least 16 characters: set "
                "$VERTUMNUS_CLUSTER_SECRET (or [cluster] secret), the same on every host"
            )


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str = "tiny"
    ranks: int = 2
    degrees: tuple[int, ...] = (1, 2)
    layout: tuple[int, ...] | None = None  # default: every rank a degree-1 worker
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    profile: str = DEFAULT_PROFILE  # a profile file, or the name of a shipped one
    weights: CostWeights = dataclasses.field(default_factory=CostWeights)
    policy: str = "vertumnus"  # placement: the cost rule, or a baseline router
    controller_enabled: bool = True
    controller: ControllerConfig = dataclasses.field(
        default_factory=lambda: ControllerConfig(window_s=10.0)
    )
    cache: CacheManagerConfig = dataclasses.field(default_factory=CacheManagerConfig)
    scan_interval_s: float = 5.0  # the cache manager's scans; 0 turns them off
    retention: RetentionConfig = dataclasses.field(default_factory=RetentionConfig)
    max_queued: int = 1024  # requests placed but not finished, over all workers
    request_timeout_s: float = 120.0
    shutdown_grace_s: float = 30.0  # SIGTERM: how long in-flight work may finish
    step_timeout_s: float = 60.0  # a prefill unanswered this long: its worker is restarted
    max_restart_attempts: int = 5  # a failed worker's restarts, 2, 4, 8, ... s apart
    # Bearer tokens. The environment (VERTUMNUS_ADMIN_TOKEN, VERTUMNUS_API_KEY)
    # overrides the file. No admin token: every /v1/admin call is refused.
    admin_token: str | None = dataclasses.field(default=None, repr=False)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    devices_per_host: int | None = None  # None: one host
    cluster: ClusterConfig | None = None  # None: the ranks are this process's children

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ConfigError("[pool] ranks must be >= 1")
        layout = self.layout or tuple(
            min(self.degrees) for _ in range(self.ranks // min(self.degrees))
        )
        object.__setattr__(self, "layout", tuple(layout))
        if sum(layout) != self.ranks:
            raise ConfigError(f"[pool] layout {list(layout)} does not cover {self.ranks} ranks")
        from vertumnus.policy.baselines import ROUTERS

        if self.policy != "vertumnus" and self.policy not in ROUTERS:
            raise ConfigError(
                f"[scheduler] policy {self.policy!r}: choose vertumnus or one of {sorted(ROUTERS)}"
            )
        if (
            self.max_queued < 1
            or self.request_timeout_s <= 0
            or self.shutdown_grace_s < 0
            or self.step_timeout_s <= 0
            or self.max_restart_attempts < 1
        ):
            raise ConfigError(
                "[server] need max_queued >= 1, request_timeout_s > 0, shutdown_grace_s >= 0, "
                "step_timeout_s > 0, max_restart_attempts >= 1"
            )
        for name in ("admin_token", "api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) < 16):
                raise ConfigError(f"[server] {name} must be a string of at least 16 characters")


def _read(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def load_cluster(path: Path | None) -> ClusterConfig | None:
    """The ``[cluster]`` table alone (None: a single-host pool): the coordinator
    needs it to gather its agents before it knows how many ranks the pool has."""
    raw = _read(path).get("cluster")
    if raw is None:
        return None
    values = dict(raw)
    if os.environ.get("VERTUMNUS_CLUSTER_SECRET"):
        values["secret"] = os.environ["VERTUMNUS_CLUSTER_SECRET"]
    cluster: ClusterConfig = build_table(ClusterConfig, values, "cluster")
    return cluster


def load_rank_setup(path: Path | None, model: str | None = None) -> tuple[str, EngineConfig]:
    """The model and the engine settings alone: what a multi-host pool's ranks need
    before the agents' topology completes the configuration."""
    raw = _read(path)
    name = model or raw.get("model", {}).get("name", "tiny")
    engine: EngineConfig = build_table(EngineConfig, raw.get("engine", {}), "engine")
    return name, engine


def load(
    path: Path | None, model: str | None = None, topology: tuple[int, int] | None = None
) -> ServeConfig:
    """The serving configuration. A multi-host pool (``[cluster]``) needs its
    ``topology`` (ranks, devices per host), learned from its agents."""
    raw = _read(path)
    known = {
        "model",
        "pool",
        "engine",
        "profile",
        "scheduler",
        "controller",
        "cache",
        "server",
        "cluster",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown tables {unknown}; known: {sorted(known)}")
    pool = dict(raw.get("pool", {}))
    controller = dict(raw.get("controller", {}))
    enabled = bool(controller.pop("enabled", True))
    controller.setdefault("window_s", 10.0)
    server = dict(raw.get("server", {}))
    scheduler = dict(raw.get("scheduler", {}))
    policy = str(scheduler.pop("policy", "vertumnus"))
    cache = dict(raw.get("cache", {}))
    scan_interval_s = float(cache.pop("scan_interval_s", 5.0))
    if scan_interval_s < 0:
        raise ConfigError("[cache] scan_interval_s must be >= 0")
    retention: dict[str, Any] = {
        k: cache.pop(k) for k in ("reserve_fraction", "retain_s") if k in cache
    }
    kwargs: dict[str, Any] = {
        "model": model or raw.get("model", {}).get("name", "tiny"),
        "engine": build_table(EngineConfig, raw.get("engine", {}), "engine"),
        "weights": build_table(CostWeights, scheduler, "scheduler"),
        "policy": policy,
        "controller_enabled": enabled,
        "controller": build_table(ControllerConfig, controller, "controller"),
        "cache": build_table(CacheManagerConfig, cache, "cache"),
        "scan_interval_s": scan_interval_s,
        "retention": build_table(RetentionConfig, retention, "cache"),
    }
    cluster = load_cluster(path)
    if cluster is not None:
        if topology is None:
            raise ConfigError(
                f"{path} describes a multi-host pool ([cluster]): its ranks come from its "
                "agents (load it with their topology)"
            )
        if "ranks" in pool:
            raise ConfigError(
                "[pool] ranks is learned from the agents in a multi-host pool: remove it"
            )
        kwargs["cluster"] = cluster
        kwargs["ranks"], kwargs["devices_per_host"] = topology
    if "ranks" in pool:
        kwargs["ranks"] = int(pool.pop("ranks"))
    if "degrees" in pool:
        kwargs["degrees"] = tuple(int(c) for c in pool.pop("degrees"))
    if "layout" in pool:
        kwargs["layout"] = tuple(int(c) for c in pool.pop("layout"))
    if pool:
        raise ConfigError(f"[pool] unknown keys {sorted(pool)}")
    if "path" in raw.get("profile", {}):
        kwargs["profile"] = str(raw["profile"]["path"])
    for key in (
        "max_queued",
        "request_timeout_s",
        "shutdown_grace_s",
        "step_timeout_s",
        "max_restart_attempts",
        "admin_token",
        "api_key",
    ):
        if key in server:
            kwargs[key] = server.pop(key)
    if server:
        raise ConfigError(f"[server] unknown keys {sorted(server)}")
    for key, env in (("admin_token", "VERTUMNUS_ADMIN_TOKEN"), ("api_key", "VERTUMNUS_API_KEY")):
        if os.environ.get(env):
            kwargs[key] = os.environ[env]
    return ServeConfig(**kwargs)
