"""Serving configuration: a TOML file in the shared dialect, plus CLI flags.

The pool, profile, scheduler, controller, cache and engine tables are the ones
``simulate`` reads, with the same keys (``vertumnus/config/dialect.py``); a served
pool can be simulated from its own file. Of its own, ``serve`` reads::

    [model]       name = "tiny"                 # preset or Hugging Face folder
    [server]      max_queued = 1024, request_timeout_s = 120, shutdown_grace_s = 30,
                  step_timeout_s = 60 (a prefill unanswered this long: its worker's
                  ranks are killed and restarted), reshape_timeout_s = 180 (a
                  reshape not done by then is rolled back, or finished by
                  restarting the ranks that did not switch), max_restart_attempts = 5,
                  admin_token (or $VERTUMNUS_ADMIN_TOKEN; none: admin calls
                  refused), api_key (or $VERTUMNUS_API_KEY; none: /v1 is open),
                  timeline_s = 1 and timeline_samples = 3600 (the dashboard's
                  samples: one per timeline_s, the latest timeline_samples kept),
                  slo = "5x" (the TTFT target they measure attainment against,
                  as [sim] slo: ``slo.py``)
    [cluster]     engine = "ray", address = "auto", hosts = 2: a multi-host pool;
                  the ranks run as actors on a Ray cluster, and [pool] ranks is
                  learned from its nodes (``serve_tables.py``, docs/multi-host.md)
    [handoff]     lease_s = 30, max_leases = 1024, reshape_wait_s = 5, secret (or
                  $VERTUMNUS_HANDOFF_SECRET), advertise_host: the KV hand-off to
                  a decode pool (``serve_tables.py``)
    [decode]      url = "http://host:port" (a separate decode server; api_key or
                  $VERTUMNUS_DECODE_API_KEY: its bearer), or local = true (the
                  default: one decode process beside the pool), or local = false
                  and no url (prefill only: max_tokens = 1)

The embedded default (no file) is the ``tiny`` model on two CPU ranks, starting as
two degree-1 workers that may merge into one degree-2 worker (the shipped
``tiny-cpu`` profile, or ``tiny-cpu-bf16`` where the ranks compute in bf16, covers
degrees 1 and 2, and this development machine has two cores), with 10 s controller
windows. On CUDA, give ``[pool] ranks`` = the number of
GPUs (one rank per GPU) and a profile of them. ``[pool] composition = "auto"`` is
chosen here, on loading (``config/start.py``: a start workload, the state file or the
built-in mix); the coordinator logs the choice and keeps ``[pool] state_file``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from vertumnus.config import ConfigError, EngineConfig, build_table, read_toml
from vertumnus.config.dialect import (
    apply_preset,
    check_tables,
    read_engine,
    read_policy,
    read_profile,
)
from vertumnus.config.pool import PoolConfig
from vertumnus.config.start import StartDecision, resolve_start
from vertumnus.perfmodel import Profile, ProfileError
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec

# The tables are ServeConfig's fields, and importable from here with it.
from vertumnus.runtime.serve_tables import ClusterConfig as ClusterConfig
from vertumnus.runtime.serve_tables import DecodeConfig as DecodeConfig
from vertumnus.runtime.serve_tables import HandoffConfig as HandoffConfig
from vertumnus.slo import DEFAULT_TTFT_SLO, SloError, TtftSlo

DEFAULT_MODEL = "tiny"
DEFAULT_POOL = PoolConfig(degrees=(1, 2), layout=(1, 1))
DEFAULT_PROFILE = "tiny-cpu"  # fp32 CPU ranks; "tiny-cpu-bf16" where they compute in bf16
DEFAULT_POLICY = PolicyConfig(controller=ControllerConfig(window_s=10.0))


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str = DEFAULT_MODEL
    pool: PoolConfig = DEFAULT_POOL
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    profile: str = DEFAULT_PROFILE  # a profile file, or the name of a shipped one
    policy: PolicyConfig = DEFAULT_POLICY
    max_queued: int = 1024  # requests placed but not finished, over all workers
    request_timeout_s: float = 120.0
    shutdown_grace_s: float = 30.0  # SIGTERM: how long in-flight work may finish
    step_timeout_s: float = 60.0  # a prefill unanswered this long: its worker is restarted
    # A reshape not done this long after it began is rolled back (before its commit)
    # or finished by restarting the ranks that did not switch (after it)
    reshape_timeout_s: float = 180.0
    max_restart_attempts: int = 5  # a failed worker's restarts, 2, 4, 8, ... s apart
    timeline_s: float = 1.0  # the dashboard's sample period (``policy/timeline.py``)
    timeline_samples: int = 3600  # samples kept (an hour at one a second)
    slo: TtftSlo = DEFAULT_TTFT_SLO  # the TTFT target the dashboard measures against
    # Bearer tokens. The environment (VERTUMNUS_ADMIN_TOKEN, VERTUMNUS_API_KEY)
    # overrides the file. No admin token: every /v1/admin call is refused.
    admin_token: str | None = dataclasses.field(default=None, repr=False)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    cluster: ClusterConfig | None = None  # None: the ranks are this process's children
    handoff: HandoffConfig = dataclasses.field(default_factory=HandoffConfig)
    decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
    # How [pool] composition = "auto" chose the start (None: the composition was given)
    start: StartDecision | None = None

    def __post_init__(self) -> None:
        if (
            self.max_queued < 1
            or self.request_timeout_s <= 0
            or self.shutdown_grace_s < 0
            or self.step_timeout_s <= 0
            or self.reshape_timeout_s <= self.step_timeout_s
            or self.max_restart_attempts < 1
            or not self.timeline_s > 0
            or self.timeline_samples < 1
        ):
            raise ConfigError(
                "[server] need max_queued >= 1, request_timeout_s > 0, shutdown_grace_s >= 0, "
                "step_timeout_s > 0, reshape_timeout_s > step_timeout_s, "
                "max_restart_attempts >= 1, timeline_s > 0, timeline_samples >= 1"
            )
        for name in ("admin_token", "api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) < 16):
                raise ConfigError(f"[server] {name} must be a string of at least 16 characters")

    @property
    def ranks(self) -> int:
        return self.pool.ranks

    @property
    def degrees(self) -> tuple[int, ...]:
        return self.pool.degrees

    @property
    def layout(self) -> tuple[int, ...]:
        return self.pool.layout

    @property
    def devices_per_host(self) -> int | None:
        return self.pool.devices_per_host

    @property
    def pool_spec(self) -> PoolSpec:
        """The pool the policy stack runs (with the engine's KV geometry)."""
        return self.pool.spec(self.engine)


SERVER_KEYS = (
    "max_queued",
    "request_timeout_s",
    "shutdown_grace_s",
    "step_timeout_s",
    "reshape_timeout_s",
    "max_restart_attempts",
    "timeline_s",
    "timeline_samples",
    "slo",
    "admin_token",
    "api_key",
)


def _read(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    raw = read_toml(path)
    check_tables(raw, str(path))
    return raw


def load_cluster(path: Path | None) -> ClusterConfig | None:
    """The ``[cluster]`` table alone (None: a single-host pool): the coordinator
    needs it to find its Ray nodes before it knows how many ranks the pool has."""
    raw = _read(path).get("cluster")
    if raw is None:
        return None
    return ClusterConfig.from_table(dict(raw))


def default_profile(engine: EngineConfig) -> str:
    """The shipped profile of the embedded default's ranks, measured in the dtype they
    compute in: bf16 prefills 2-2.5x faster than fp32 on a CPU that has it."""
    from vertumnus.engine.rank import resolve_device
    from vertumnus.engine.weights import resolve_dtype

    try:
        device = resolve_device(engine, 0)
    except RuntimeError:  # CUDA asked for and absent: serve says so when it starts ranks
        return DEFAULT_PROFILE
    cpu_bf16 = device.type == "cpu" and str(resolve_dtype(engine.dtype, device)) == "torch.bfloat16"
    return "tiny-cpu-bf16" if cpu_bf16 else DEFAULT_PROFILE


def load_rank_setup(
    path: Path | None, model: str | None = None
) -> tuple[str, EngineConfig, int | None]:
    """The model, the engine settings and ``[pool] devices_per_host`` (None: learned
    from the nodes) alone: what a multi-host pool's ranks need before the Ray
    nodes' topology completes the configuration."""
    raw = _read(path)
    name = model or raw.get("model", {}).get("name", DEFAULT_MODEL)
    per_host = raw.get("pool", {}).get("devices_per_host")
    if per_host is not None and (not isinstance(per_host, int) or per_host < 1):
        raise ConfigError(f"[pool] devices_per_host must be an integer >= 1, got {per_host!r}")
    return name, read_engine(raw, EngineConfig()), per_host


def load(
    path: Path | None,
    model: str | None = None,
    topology: tuple[int, int] | None = None,
    preset: str | None = None,
) -> ServeConfig:
    """The serving configuration (``preset``: ``--preset``, over the file). A
    multi-host pool (``[cluster]``) needs its ``topology`` (ranks, ranks per host),
    learned from its Ray nodes."""
    raw = apply_preset(_read(path), preset)
    model_table = dict(raw.get("model", {}))
    name = model or str(model_table.pop("name", DEFAULT_MODEL))
    if model_table and not model:
        raise ConfigError(f"[model] unknown keys {sorted(model_table)}; known: ['name']")
    cluster = load_cluster(path)
    if cluster is not None and topology is None:
        raise ConfigError(
            f"{path} describes a multi-host pool ([cluster]): its ranks come from its "
            "Ray nodes (load it with their topology)"
        )
    server = dict(raw.get("server", {}))
    kwargs: dict[str, Any] = {key: server.pop(key) for key in SERVER_KEYS if key in server}
    if server:
        raise ConfigError(f"[server] unknown keys {sorted(server)}; known: {list(SERVER_KEYS)}")
    if "slo" in kwargs:
        try:
            kwargs["slo"] = TtftSlo.parse(str(kwargs["slo"]))
        except SloError as exc:
            raise ConfigError(f"[server] slo: {exc}") from exc
    for key, env in (("admin_token", "VERTUMNUS_ADMIN_TOKEN"), ("api_key", "VERTUMNUS_API_KEY")):
        if os.environ.get(env):
            kwargs[key] = os.environ[env]
    policy = read_policy(raw, DEFAULT_POLICY)
    if policy.ideal_reuse:
        raise ConfigError(
            "[cache] ideal (the ideal-replication policy) is a bound the simulator computes: "
            "a server must copy its KV; use replication = true"
        )
    if policy.cache.host_tier_bound:
        raise ConfigError(
            "[cache] host_tier_bound is a bound the simulator computes: a server must copy "
            "its KV; use host_tier_bytes"
        )
    if cluster is not None and policy.cache.host_tier_bytes > 0:
        raise ConfigError(
            "[cache] host_tier_bytes needs CPU ranks that keep their KV store in this "
            "host's shared memory: a multi-host pool's ranks run on Ray nodes"
        )
    handoff = dict(raw.get("handoff", {}))
    if os.environ.get("VERTUMNUS_HANDOFF_SECRET"):
        handoff["secret"] = os.environ["VERTUMNUS_HANDOFF_SECRET"]
    decode = dict(raw.get("decode", {}))
    if os.environ.get("VERTUMNUS_DECODE_API_KEY") and decode.get("url"):
        decode["api_key"] = os.environ["VERTUMNUS_DECODE_API_KEY"]
    pool = PoolConfig.from_table(raw.get("pool", {}), DEFAULT_POOL, topology)
    engine = read_engine(raw, EngineConfig())
    profile = read_profile(raw, default_profile(engine))
    start = None
    if pool.start.auto:  # chosen now: a configuration's mistakes show before anything starts
        try:
            pool, start = resolve_start(pool, Profile.load(profile), policy)
        except ProfileError as exc:
            raise ConfigError(f"{exc}") from exc
    return ServeConfig(
        model=name,
        handoff=build_table(HandoffConfig, handoff, "handoff"),
        decode=build_table(DecodeConfig, decode, "decode"),
        pool=pool,
        engine=engine,
        profile=profile,
        policy=policy,
        cluster=cluster,
        start=start,
        **kwargs,
    )
