"""The lattice's geometry: devices, the aligned workers they can form, and the
compositions within bounds (docs/scheduling.md, "The lattice").

G devices are cut into top-level blocks of the largest degree that fits aligned
(``top_blocks``). Inside a block, workers sit on aligned buddy sub-blocks: a
degree-C worker occupies devices [f, f + C) with f % C == 0, a degree-2C worker
splits into its two aligned halves, and two sibling halves merge back. Degrees must
be consecutive powers of two (each twice the one before), so every split and merge
stays in the degree set. A *lattice state* is a partition of the devices into such
workers; neighbouring states differ by one split or merge and keep G.
``LatticeConfig`` holds the devices, the degrees, the bounds on workers per degree
and the devices per host; ``worker_slots`` lists every worker that can ever form,
``reachable_compositions`` every composition (workers per degree) within the
bounds.

Pure Python. Not owned here: the workers of a state and their transitions
(``lattice``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class LatticeError(ValueError):
    """An impossible layout or transition."""


@dataclass(frozen=True)
class LatticeConfig:
    num_devices: int
    degrees: tuple[int, ...]
    # Bounds on the number of workers of each degree (absent: no bound).
    min_workers: Mapping[int, int] = field(default_factory=dict)
    max_workers: Mapping[int, int] = field(default_factory=dict)
    # Devices per host (None: one host holds them all). Every degree must divide it or
    # be a multiple of it, so an aligned worker that fits in a host stays in one.
    devices_per_host: int | None = None

    def __post_init__(self) -> None:
        degrees = tuple(sorted(self.degrees))
        object.__setattr__(self, "degrees", degrees)
        if not degrees or degrees[0] < 1:
            raise LatticeError(f"degrees must be positive, got {self.degrees}")
        if any(b != 2 * a for a, b in itertools.pairwise(degrees)):
            raise LatticeError(
                f"degrees must be consecutive powers of two (each twice the one before) "
                f"for buddy split and merge, got {list(degrees)}"
            )
        for name, bounds in (("min_workers", self.min_workers), ("max_workers", self.max_workers)):
            for c, n in bounds.items():
                if c not in degrees or n < 0:
                    raise LatticeError(f"{name}: degree {c} not in {list(degrees)} or count < 0")
        h = self.devices_per_host
        if h is not None:
            if h < 1 or self.num_devices % h:
                raise LatticeError(
                    f"devices_per_host {h} must be positive and divide the {self.num_devices} "
                    "devices"
                )
            odd = [c for c in degrees if (h % c if c <= h else c % h)]
            if odd:
                raise LatticeError(
                    f"degrees {odd} neither divide nor are multiples of devices_per_host {h}: "
                    "an aligned worker of that degree could straddle two hosts"
                )
        top_blocks(self.num_devices, degrees)  # raises if G cannot be covered

    def hosts_of(self, first_device: int, degree: int) -> range:
        """The hosts that the worker of ``degree`` on ``[first_device, +degree)`` uses."""
        h = self.devices_per_host or self.num_devices
        return range(first_device // h, (first_device + degree - 1) // h + 1)

    def within_bounds(self, counts: Mapping[int, int]) -> bool:
        return all(counts.get(c, 0) >= n for c, n in self.min_workers.items()) and all(
            counts.get(c, 0) <= n for c, n in self.max_workers.items()
        )


def top_blocks(num_devices: int, degrees: Sequence[int]) -> list[tuple[int, int]]:
    """(first device, size): greedy aligned blocks of the largest degree that fits."""
    blocks, pos = [], 0
    while pos < num_devices:
        size = next(
            (c for c in sorted(degrees, reverse=True) if pos % c == 0 and pos + c <= num_devices),
            None,
        )
        if size is None:
            raise LatticeError(
                f"{num_devices} devices cannot be cut into aligned workers of degrees "
                f"{sorted(degrees)} (stuck at device {pos})"
            )
        blocks.append((pos, size))
        pos += size
    return blocks


def worker_slots(config: LatticeConfig) -> list[tuple[int, int]]:
    """(first device, degree) of every worker the lattice can ever form, by degree
    then device: the aligned sub-blocks of each top-level block at every degree that
    fits in it. The rank pool creates the process group of each at start-up."""
    slots: list[tuple[int, int]] = []
    blocks = top_blocks(config.num_devices, config.degrees)
    for c in config.degrees:
        for start, size in blocks:
            if c <= size:
                slots.extend((start + k * c, c) for k in range(size // c))
    return slots


def composition_name(counts: Mapping[int, int]) -> str:
    """``{4: 4, 8: 3}`` -> ``4CP4/3CP8`` (workers per degree; ``-`` for none)."""
    return "/".join(f"{n}CP{c}" for c, n in sorted(counts.items()) if n) or "-"


def reachable_compositions(config: LatticeConfig) -> list[dict[int, int]]:
    """Every composition (workers per degree) of a lattice state, within the bounds."""

    def of_block(size: int) -> set[tuple[int, ...]]:
        index = {c: k for k, c in enumerate(config.degrees)}
        whole = tuple(1 if k == index[size] else 0 for k in range(len(config.degrees)))
        out = {whole}
        if size // 2 in index:
            halves = of_block(size // 2)
            out |= {tuple(a + b for a, b in zip(x, y, strict=True)) for x in halves for y in halves}
        return out

    totals: set[tuple[int, ...]] = {tuple(0 for _ in config.degrees)}
    for _, size in top_blocks(config.num_devices, config.degrees):
        totals = {
            tuple(a + b for a, b in zip(t, x, strict=True)) for t in totals for x in of_block(size)
        }
    found = [{c: n for c, n in zip(config.degrees, t, strict=True) if n} for t in sorted(totals)]
    return [f for f in found if config.within_bounds(f)]
