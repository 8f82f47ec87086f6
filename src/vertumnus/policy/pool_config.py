"""What a pool's policy stack is built from: the pool it runs and one policy configuration.

``PoolSpec`` is the pool: its lattice (devices, degrees, bounds, hosts), the layout
it starts in, and the KV geometry of a worker's cache (tokens per block, blocks per
rank). ``PolicyConfig`` is every decision knob: the router, whether the composition
adapts (the window controller runs its reshapes) or stays fixed (its decisions are
only noted), whether the prefix-cache manager replicates and reclaims (its scans
run) or every worker keeps a plain LRU cache, and the settings of each part.

The simulator's old policy names are presets of the three choices (``PRESETS``):

    vertumnus        the cost rule, adaptive, replication
    fixed            the cost rule, fixed composition, replication
    no-replication   the cost rule, fixed composition, LRU only (the paper's ablation)
    ideal-replication  the cost rule, fixed composition, every worker reusing the
                     longest prefix cached anywhere in the pool, copied free and at
                     once: the bound on what replication can give (simulator only)
    <router>         a baseline router, fixed composition, LRU only

Both drivers (``sim/simulator.py``, ``runtime/coordinator.py``) build their stack
from these through ``PoolPolicy.build``; the TOML dialect that fills them is
``vertumnus/config/dialect.py``. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vertumnus.perfmodel import Profile
from vertumnus.policy.cache.host_tier import (
    DEFAULT_D2H_BYTES_S,
    DEFAULT_H2D_BYTES_S,
    HostLink,
    HostTierPolicy,
)
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.cache.retention import RetentionConfig
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.costs import CostWeights
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.placement.routers import ROUTERS


class PolicyError(ValueError):
    """A policy configuration, pool or profile the policy stack cannot run;
    ``field``: the ``PolicyConfig`` field at fault, if one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class PolicyConfig:
    router: str = "vertumnus"  # a name of ``ROUTERS``: the cost rule or a baseline
    adaptive: bool = True  # the controller's reshapes run (False: decisions only noted)
    replication: bool = True  # the cache manager's scans run (False: per-worker LRU)
    # A bound, for the simulator: every worker reuses the longest prefix cached anywhere
    # in the pool (any degree), as if copied free and at once; capacities unchanged.
    ideal_reuse: bool = False
    scan_interval_s: float = 5.0
    weights: CostWeights = field(default_factory=CostWeights)  # beta, lambda
    # KV room of one rank in tokens (a candidate must hold the request); None: no limit.
    max_tokens_per_rank: int | None = None
    # The cost rule counts the prefixes that the requests outstanding at a worker
    # bring there (``policy/placement/scheduler.py``, "Coming prefixes").
    coming_reuse: bool = True
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cache: CacheManagerConfig = field(default_factory=CacheManagerConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise PolicyError(
                f"unknown router {self.router!r}; choose one of {', '.join(sorted(ROUTERS))}",
                "router",
            )
        if not self.scan_interval_s > 0:
            raise PolicyError(
                f"scan_interval_s must be > 0, got {self.scan_interval_s} "
                "(turn the scans off with replication = false)",
                "scan_interval_s",
            )
        if self.ideal_reuse and self.replication:
            raise PolicyError(
                "ideal reuse is a bound that replaces the cache manager: turn replication off",
                "ideal_reuse",
            )
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise PolicyError("max_tokens_per_rank must be >= 1", "max_tokens_per_rank")

    @property
    def name(self) -> str:
        """The preset this configuration is, or its three choices spelled out."""
        for name, choices in PRESETS.items():
            if choices == {
                "router": self.router,
                "adaptive": self.adaptive,
                "replication": self.replication,
                "ideal_reuse": self.ideal_reuse,
            }:
                return name
        return "+".join(
            (
                self.router,
                "adaptive" if self.adaptive else "fixed",
                "ideal-replication"
                if self.ideal_reuse
                else "replication"
                if self.replication
                else "no-replication",
            )
        )


def _preset(
    router: str, adaptive: bool, replication: bool, ideal_reuse: bool = False
) -> dict[str, Any]:
    return {
        "router": router,
        "adaptive": adaptive,
        "replication": replication,
        "ideal_reuse": ideal_reuse,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "vertumnus": _preset("vertumnus", True, True),
    "fixed": _preset("vertumnus", False, True),
    "no-replication": _preset("vertumnus", False, False),
    "ideal-replication": _preset("vertumnus", False, False, True),
    **{name: _preset(name, False, False) for name in ROUTERS if name != "vertumnus"},
}


def preset(name: str) -> Mapping[str, Any]:
    """The three choices of a preset; PolicyError listing the presets if unknown."""
    try:
        return PRESETS[name]
    except KeyError:
        raise PolicyError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class PoolSpec:
    """The pool a policy stack runs: lattice, starting layout, KV geometry."""

    lattice: LatticeConfig
    layout: tuple[int, ...]  # worker degrees in device order
    block_tokens: int  # tokens per KV block (the engine's block_size)
    blocks_per_rank: int  # KV blocks one rank holds (0: nothing is cached)
    # The host tier's geometry: a block's KV bytes (0: the profile's kv_bytes_per_token
    # times block_tokens) and devices per host (0: the lattice's, else one host)
    block_bytes: int = 0
    devices_per_host: int = 0
    # A device's network bandwidth: another host's tier is read at it (0: not read)
    net_bytes_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", tuple(self.layout))
        if self.block_tokens < 1 or self.blocks_per_rank < 0:
            raise PolicyError("need block_tokens >= 1 and blocks_per_rank >= 0")
        if self.block_bytes < 0 or self.devices_per_host < 0 or self.net_bytes_s < 0:
            raise PolicyError("need block_bytes, devices_per_host and net_bytes_s >= 0")

    def check_profile(self, profile: Profile, config: PolicyConfig) -> None:
        """PolicyError unless ``profile`` has what ``config`` needs of every degree."""
        degrees = self.lattice.degrees
        missing = sorted(set(degrees) - set(profile.degrees))
        if missing:
            raise PolicyError(
                f"the profile has no degrees {missing}: profile them "
                "(`python -m vertumnus profile`) or change [pool] degrees"
            )
        no_kappa = [c for c in degrees if "kappa_s" not in profile.capacity.get(c, {})]
        if config.adaptive and config.controller.mode == "rules" and no_kappa:
            raise PolicyError(
                f"the profile has no capacity kappa for degrees {no_kappa}: run "
                "`python -m vertumnus capacity` on it, or keep the composition fixed"
            )


def host_tiers(profile: Profile, pool: PoolSpec, config: PolicyConfig) -> HostTierPolicy:
    """The host tier of ``config.cache`` (``cache/host_tier.py``) on ``pool``'s hosts,
    priced by ``profile``'s host link (its documented defaults where it has none)."""
    cache = config.cache
    wanted = cache.host_tier_bytes > 0 or cache.host_tier_bound
    link = profile.host_link
    block_bytes = pool.block_bytes or int(link.get("kv_bytes_per_token", 0)) * pool.block_tokens
    if not wanted:
        return HostTierPolicy(0, None)
    if block_bytes < 1:
        raise PolicyError(
            "the host tier needs a KV block's bytes: the profile has no "
            "host_link.kv_bytes_per_token (run `python -m vertumnus profile`)",
            "cache",
        )
    if config.ideal_reuse:
        raise PolicyError("the host tier and the ideal-reuse bound exclude each other", "cache")
    per_host = pool.devices_per_host or pool.lattice.devices_per_host or 0
    return HostTierPolicy(
        cache.host_tier_bytes,
        HostLink(
            block_bytes,
            float(link.get("d2h_bytes_s", DEFAULT_D2H_BYTES_S)),
            float(link.get("h2d_bytes_s", DEFAULT_H2D_BYTES_S)),
            per_host,
            pool.net_bytes_s,
        ),
        cache.host_tier_bound,
    )
