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
                                     it from its Ray nodes)
    composition      = "auto"        the start chosen from what a server has
                                     (``config/start.py``), from the first of:
    start_workload   = "FILE"        a representative trace (Mooncake JSONL or Azure
                                     CSV), its rate times start_rate_scale (1.0)
    state_file       = "PATH"        the composition the previous run left there
                                     (written on every reshape and at shutdown,
                                     with or without "auto")
    start_rate       = 12.0          the built-in length mix, Poisson at this rate
                                     (requests/s)
    start_span_s     = 60.0          how much of the workload is replayed

The same keys for ``serve`` and ``simulate``. The lattice checks everything a layout
must satisfy, so a pool it accepts the rank pool accepts too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vertumnus.config.engine import EngineConfig
from vertumnus.config.tables import ConfigError
from vertumnus.policy.control.composition import layout_for
from vertumnus.policy.geometry import LatticeConfig, LatticeError
from vertumnus.policy.lattice import Lattice
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


START_KEYS = ("start_workload", "start_rate_scale", "start_span_s", "start_rate", "state_file")


@dataclass(frozen=True)
class StartConfig:
    """Where the first composition comes from (``auto``: ``composition = "auto"``;
    otherwise the start keys are not read), and the file that keeps the composition
    for the next start. The fields are the ``[pool]`` keys of the same names."""

    auto: bool = False
    start_workload: str | None = None  # a trace file: the operator's representative workload
    start_rate_scale: float = 1.0  # its arrival rate times this
    start_span_s: float = 60.0  # seconds of the workload replayed
    start_rate: float | None = None  # requests/s of the built-in mix (the last resort)
    state_file: str | None = None  # None: the composition is not kept

    def __post_init__(self) -> None:
        for name in ("start_rate_scale", "start_span_s", "start_rate"):
            value = getattr(self, name)
            if value is None and name == "start_rate":
                continue
            if not (_is_number(value) and math.isfinite(value) and value > 0):
                raise ConfigError(f"[pool] {name} must be a number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("start_workload", "state_file"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ConfigError(f"[pool] {name} must be a path, got {value!r}")
        sources = (self.start_workload, self.start_rate, self.state_file)
        if self.auto and all(source is None for source in sources):
            raise ConfigError(NO_START_SOURCE)

    @classmethod
    def from_table(cls, values: dict[str, Any], auto: bool) -> StartConfig:
        """Pops the start keys of ``values`` (a ``[pool]`` table)."""
        given = {k: values.pop(k) for k in START_KEYS if k in values}
        return cls(auto, **given)


NO_START_SOURCE = (
    '[pool] composition = "auto" needs what a server knows to choose from: '
    'start_workload = "FILE" (a representative trace), a state_file holding the '
    "composition of a previous run of this pool, or start_rate = REQUESTS_PER_S "
    "(the built-in length mix at that rate)"
)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class PoolConfig:
    """``layout`` is the start. With ``start.auto`` it stands in (every device a
    worker of the smallest degree) until the loaders replace it with the layout
    ``config.start.resolve_start`` chooses."""

    degrees: tuple[int, ...]
    layout: tuple[int, ...]  # worker degrees in device order
    min_workers: Mapping[int, int] = field(default_factory=dict)
    max_workers: Mapping[int, int] = field(default_factory=dict)
    devices_per_host: int | None = None
    start: StartConfig = field(default_factory=StartConfig)

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

    def spec(self, engine: EngineConfig, block_bytes: int = 0) -> PoolSpec:
        """The pool the policy stack runs, with the engine's KV geometry (``block_bytes``:
        a served model's KV block; 0: the profile's, as ``simulate`` has it)."""
        return PoolSpec(
            self.lattice,
            self.layout,
            engine.block_size,
            engine.kv_blocks_per_rank,
            block_bytes=block_bytes,
        )

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
        a multi-host pool's Ray nodes, and then ``ranks`` may not be given."""
        values = dict(table)
        auto = values.get("composition") == "auto"
        if auto:
            del values["composition"]
            if values.get("layout") is not None:
                raise ConfigError('[pool] composition = "auto" chooses the layout: remove layout')
            if values.get("ranks") is None and topology is None:
                raise ConfigError(
                    '[pool] composition = "auto" needs [pool] ranks (how many devices to compose)'
                )
        start = StartConfig.from_table(values, auto)
        config = cls._layout_from_table(values, table, default, topology)
        return config if start == StartConfig() else dataclasses.replace(config, start=start)

    @classmethod
    def _layout_from_table(
        cls,
        values: dict[str, Any],
        table: Mapping[str, Any],
        default: PoolConfig,
        topology: tuple[int, int] | None,
    ) -> PoolConfig:
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
                "devices_per_host, layout, max_workers, min_workers, ranks, "
                + ", ".join(sorted(START_KEYS))
            )
        if layout is not None and composition is not None:
            raise ConfigError("[pool] give layout or composition, not both")
        if topology is not None:
            if ranks is not None:
                raise ConfigError(
                    "[pool] ranks is learned from the Ray nodes in a multi-host pool: remove it"
                )
            if hosts not in (None, topology[1]):
                raise ConfigError(
                    f"[pool] devices_per_host {hosts} differs from the Ray nodes' "
                    f"{topology[1]} ranks per host"
                )
            ranks, hosts = topology
        extra: dict[str, Any] = {
            **bounds,
            "devices_per_host": None if hosts is None else int(hosts),
        }
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
