"""The serve-only tables beside ``[server]``: ``[cluster]``, ``[handoff]`` and
``[decode]``, each a frozen dataclass validated on construction. Reading them from
the file and the environment is ``serve_config.py``'s."""

from __future__ import annotations

import dataclasses

from vertumnus.config import ConfigError, build_table

# Keys of the node agents' ``[cluster]`` table, which Ray replaced
_AGENT_KEYS = ("listen", "secret", "heartbeat_s", "agent_timeout_s")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: a pool whose ranks run as actors on a Ray cluster
    (``runtime/cluster/``, docs/multi-host.md). ``address``: the cluster's (``auto``:
    the one this host has joined, as ``ray.init`` finds it); ``hosts``: how many of
    its nodes run ranks, each the same number (``[pool] devices_per_host``, or
    learned from the nodes: their GPUs, or on CPU hosts their CPUs over
    ``cpus_per_rank``). Ray runs whatever anyone who reaches its ports sends it, so
    the cluster must use token authentication (``RAY_AUTH_MODE=token``) unless
    ``private_network = true`` says that no one else can reach it."""

    engine: str = "ray"
    address: str = "auto"
    hosts: int = 1
    private_network: bool = False
    cpus_per_rank: float = 1.0  # each rank's bundle on a CPU host (a GPU on GPU hosts)
    join_timeout_s: float = 600.0  # start-up: how long to wait for ``hosts`` nodes
    poll_s: float = 0.5  # how often the nodes and placement groups are checked
    reach_timeout_s: float = 5.0  # a check unanswered this long: Ray is unreachable
    namespace: str = "vertumnus"  # Ray's namespace of the pool's actors

    def __post_init__(self) -> None:
        if self.engine != "ray":
            raise ConfigError(
                f'[cluster] engine must be "ray" (got {self.engine!r}): pools across hosts '
                "run their ranks as Ray actors (docs/multi-host.md)"
            )
        if self.hosts < 1:
            raise ConfigError("[cluster] hosts must be >= 1")
        if not self.address:
            raise ConfigError('[cluster] address must be "auto" or a Ray address (HOST:PORT)')
        if not self.cpus_per_rank > 0:
            raise ConfigError("[cluster] cpus_per_rank must be > 0")
        if not (self.join_timeout_s > 0 and 0 < self.poll_s < self.reach_timeout_s):
            raise ConfigError("[cluster] need join_timeout_s > 0 and 0 < poll_s < reach_timeout_s")

    @classmethod
    def from_table(cls, table: dict[str, object]) -> ClusterConfig:
        """``[cluster]``, refusing the keys of the removed node agents by name."""
        old = sorted(k for k in table if k in _AGENT_KEYS)
        if old:
            raise ConfigError(
                f"[cluster] {', '.join(old)}: the node agents these configured were "
                'removed; pools across hosts run on Ray: [cluster] engine = "ray", '
                "address, hosts (docs/multi-host.md)"
            )
        built: ClusterConfig = build_table(cls, dict(table), "cluster")
        return built


@dataclasses.dataclass(frozen=True)
class HandoffConfig:
    """``[handoff]``: how the pool hands a prompt's KV to a decode server
    (docs/api.md, "Hand-off"). A request with ``kv_transfer_params.do_remote_decode``
    keeps its blocks pinned ``lease_s`` seconds, or until pulled or released; at most
    ``max_leases`` at once (then 503). The pull endpoint takes the API key or this
    ``secret`` (``$VERTUMNUS_HANDOFF_SECRET``; none: a random one per start, handed
    to the local decode process), never nothing.
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
