"""``[pool]``: the devices, the degrees a worker may have and the workers it starts as.

    degrees          = [4, 8]        consecutive powers of two (buddy split and merge)
    layout           = [8, 4, 4]     worker degrees in device order, or
    composition      = "2CP4/1CP8"   workers per degree (laid out buddy-aligned)
    ranks            = 16            optional: the number of devices (checked against
                                     the layout; alone, every device is a worker of
                                     the smallest degree)
    min_workers      = {"4" = 2}     bounds on the workers of a degree
    max_workers      = {"4" = 8}
    devices_per_host = 8             hosts in the lattice (a multi-host server learns
                                     it from its agents)

The same keys for ``serve`` and ``simulate``. The lattice checks everything a layout
must satisfy, so a pool it accepts the rank pool accepts too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vertumnus.config.engine import EngineConfig
from vertumnus.config.tables import ConfigError
from vertumnus.policy.composition import layout_for
from vertumnus.policy.lattice import Lattice, LatticeConfig, LatticeError
from vertumnus.policy.pool_config import PoolSpec

_COMPOSITION = re.compile(r"^\s*(\d+)\s*CP\s*(\d+)\s*$", re.IGNORECASE)


def parse_composition(text: str) -> dict[int, int]:
    """``4CP4/3CP8`` -> ``{4: 4, 8: 3}`` (workers per degree)."""
    counts: dict[int, int] = {}
    for part in text.split("/"):
        match = _COMPOSITION.match(part)
        if match is None:
            raise ConfigError(
                f"composition {text!r}: expected parts like 4CP4 joined by '/', got {part!r}"
            )
        n, degree = int(match.group(1)), int(match.group(2))
        if n < 1 or degree < 1:
            raise ConfigError(f"composition {text!r}: counts and degrees must be >= 1")
        counts[degree] = counts.get(degree, 0) + n
    return counts


@dataclass(frozen=True)
class PoolConfig:
    degrees: tuple[int, ...]
    layout: tuple[int, ...]  # worker degrees in device order
    min_workers: Mapping[int, int] = field(default_factory=dict)
    max_workers: Mapping[int, int] = field(default_factory=dict)
    devices_per_host: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "degrees", tuple(sorted(self.degrees)))
        object.__setattr__(self, "layout", tuple(self.layout))
        outside = sorted(set(self.layout) - set(self.degrees))
        if outside:
            raise ConfigError(
                f"[pool] layout degrees {outside} are not in [pool] degrees {list(self.degrees)}"
            )
        try:
            Lattice(self.lattice, self.layout)
        except LatticeError as exc:
            raise ConfigError(f"[pool] {exc}") from exc

    @property
    def ranks(self) -> int:
        return sum(self.layout)

    @property
    def lattice(self) -> LatticeConfig:
        return LatticeConfig(
            self.ranks, self.degrees, self.min_workers, self.max_workers, self.devices_per_host
        )

    @property
    def composition(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for c in self.layout:
            counts[c] = counts.get(c, 0) + 1
        return counts

    def spec(self, engine: EngineConfig) -> PoolSpec:
        """The pool the policy stack runs, with the engine's KV geometry."""
        return PoolSpec(self.lattice, self.layout, engine.block_size, engine.kv_blocks_per_rank)

    @classmethod
    def smallest_workers(cls, ranks: int, degrees: tuple[int, ...], **bounds: Any) -> PoolConfig:
        """Every device a worker of the smallest degree."""
        if ranks < 1:
            raise ConfigError("[pool] ranks must be >= 1")
        low = min(degrees)
        return cls(degrees, tuple(low for _ in range(ranks // low)), **bounds)

    @classmethod
    def from_table(
        cls,
        table: Mapping[str, Any],
        default: PoolConfig,
        topology: tuple[int, int] | None = None,
    ) -> PoolConfig:
        """``[pool]`` over ``default``; ``topology`` (ranks, devices per host) comes from
        a multi-host pool's agents, and then ``ranks`` may not be given."""
        values = dict(table)
        degrees = tuple(int(c) for c in values.pop("degrees", default.degrees))
        composition = values.pop("composition", None)
        layout = values.pop("layout", None)
        ranks = values.pop("ranks", None)
        bounds = {
            key: {int(c): int(n) for c, n in dict(values.pop(key, getattr(default, key))).items()}
            for key in ("min_workers", "max_workers")
        }
        hosts = values.pop("devices_per_host", default.devices_per_host)
        if values:
            raise ConfigError(
                f"[pool] unknown keys {sorted(values)}; known: composition, degrees, "
                "devices_per_host, layout, max_workers, min_workers, ranks"
            )
        if layout is not None and composition is not None:
            raise ConfigError("[pool] give layout or composition, not both")
        if topology is not None:
            if ranks is not None:
                raise ConfigError(
                    "[pool] ranks is learned from the agents in a multi-host pool: remove it"
                )
            if hosts not in (None, topology[1]):
                raise ConfigError(
                    f"[pool] devices_per_host {hosts} differs from the agents' "
                    f"{topology[1]} ranks per host"
                )
            ranks, hosts = topology
        extra: dict[str, Any] = {
            **bounds,
            "devices_per_host": None if hosts is None else int(hosts),
        }
        if composition == "auto":
            raise ConfigError(
                '[pool] composition = "auto" is the simulator\'s (it chooses from the '
                "workload's first minute); a server starts from the composition given, "
                "and its what-if controller moves from there"
            )
        if composition is not None:
            counts = parse_composition(str(composition))
            outside = sorted(set(counts) - set(degrees))
            if outside:
                raise ConfigError(
                    f"composition degrees {outside} are not in [pool] degrees {list(degrees)}"
                )
            devices = sum(c * n for c, n in counts.items())
            try:
                lattice = LatticeConfig(devices, degrees, **extra)
                layout = layout_for(lattice, counts)
            except LatticeError as exc:
                raise ConfigError(f"[pool] {exc}") from exc
        elif layout is None:
            if ranks is None and "degrees" not in table:
                return cls(degrees, default.layout, **extra)
            n = int(ranks) if ranks is not None else default.ranks
            return cls.smallest_workers(n, degrees, **extra)
        config = cls(degrees, tuple(int(c) for c in layout), **extra)
        if ranks is not None and int(ranks) != config.ranks:
            raise ConfigError(
                f"[pool] layout {list(config.layout)} covers {config.ranks} devices, "
                f"not ranks = {ranks}"
            )
        return config
