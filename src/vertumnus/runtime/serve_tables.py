"""The serve-only tables beside ``[server]``: ``[cluster]``, ``[handoff]`` and
``[decode]``, each a frozen dataclass validated on construction. Reading them from
the file and the environment is ``serve_config.py``'s."""

from __future__ import annotations

import dataclasses

from vertumnus.config import ConfigError


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: the coordinator waits for ``hosts`` node agents on ``listen``
    (``HOST:PORT``; port 0: a free one), each running the ranks of one host. Every
    host must run the same number of ranks (``devices_per_host``, learned from the
    agents). The secret (``$VERTUMNUS_CLUSTER_SECRET`` or ``secret``, at least 16
    characters) signs and encrypts the control channel (``runtime/cluster/channel.py``)."""

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
class HandoffConfig:
    """``[handoff]``: how the pool hands a prompt's KV to a decode server
    (docs/api.md, "Hand-off"). A request with ``kv_transfer_params.do_remote_decode``
    keeps its blocks pinned ``lease_s`` seconds, or until pulled or released; at most
    ``max_leases`` at once (then 503). The pull endpoint takes the API key, the
    cluster secret or this ``secret`` (``$VERTUMNUS_HANDOFF_SECRET``; none: a random
    one per start, handed to the local decode process), never nothing.
    ``advertise_host``: the host a decode server should pull from (None: the address
    the server listens on). ``reshape_wait_s``: how long a reshape waits for the
    leases on its workers to be pulled (and a switch for the pulls under way); then
    they end (moved, 410) and the reshape goes on."""

    lease_s: float = 30.0
    max_leases: int = 1024
    reshape_wait_s: float = 5.0
    secret: str | None = dataclasses.field(default=None, repr=False)
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        if not (self.lease_s > 0 and self.max_leases >= 1 and self.reshape_wait_s > 0):
            raise ConfigError("[handoff] need lease_s > 0, max_leases >= 1 and reshape_wait_s > 0")
        if self.secret is not None and len(self.secret) < 16:
            raise ConfigError("[handoff] secret must be at least 16 characters")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """``[decode]``: who generates the tokens after the first. ``url``: a separate
    decode server (``python -m vertumnus decode``, possibly on another host); else
    ``local`` (the default) starts one decode process beside the pool, restarted if
    it dies; ``local = false`` without a url serves prefills only (max_tokens = 1)."""

    url: str | None = None
    local: bool = True
    restart_s: float = 1.0  # wait before restarting a local decode process that died
    restart_max_s: float = 30.0  # the wait doubles while it keeps failing, up to this
    # How long a completion whose prompts are prefilled waits for a decode server that
    # went away (the local process restarting; a url refusing connections) before a
    # 503 naming why; never past its KV leases (a margin is left for the pull)
    restart_wait_s: float = 20.0
    # How the local decode process takes the KV: "http" (the pull) or "dist" (the
    # ranks send it over torch.distributed: gloo on CPU, NCCL between GPUs)
    transport: str = "http"
    # The bearer for ``url``'s API (its --api-key; or $VERTUMNUS_DECODE_API_KEY)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # What serves ``url``: "vertumnus" (``python -m vertumnus decode``) or "vllm" (a
    # ``vllm serve`` with Vertumnus's KV connector: one prompt per request, its
    # ``kv_transfer_params`` one object)
    engine: str = "vertumnus"

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"[decode] url must start with http:// or https://, got {self.url!r}")
        if not 0 <= self.restart_s <= self.restart_max_s:
            raise ConfigError("[decode] need 0 <= restart_s <= restart_max_s")
        if not self.restart_wait_s >= 0:
            raise ConfigError("[decode] need restart_wait_s >= 0")
        if self.transport not in ("http", "dist"):
            raise ConfigError(f"[decode] transport must be http or dist, got {self.transport!r}")
        if self.engine not in ("vertumnus", "vllm"):
            raise ConfigError(f"[decode] engine must be vertumnus or vllm, got {self.engine!r}")
        if self.engine == "vllm" and self.url is None:
            raise ConfigError('[decode] engine = "vllm" needs the url of a vllm serve')

    @property
    def enabled(self) -> bool:
        return self.url is not None or self.local
