"""Devices, workers and the buddy lattice of worker compositions (DESIGN.md §6).

G devices are cut into top-level blocks of the largest degree that fits aligned
(``top_blocks``). Inside a block, workers sit on aligned buddy sub-blocks: a
degree-C worker occupies devices [f, f + C) with f % C == 0, a degree-2C worker
splits into its two aligned halves, and two sibling halves merge back. Degrees must
be consecutive powers of two (each twice the one before), so every split and merge
stays in the degree set. A *lattice state* is a partition of the devices into such
workers; neighbouring states differ by one split or merge and keep G.

Worker lifecycle::

    ACTIVE --begin--> DRAINING --park--> SWITCHING --commit--> (gone; new workers
      ^  ^                 |                   |                  are SWITCHING)
      |  +-------------- abort (rolled back) --+
      +------------------------- activate ---------------------- SWITCHING
    any --fail--> UNAVAILABLE --restore--> ACTIVE

Only ACTIVE workers take requests. ``commit`` needs every participant parked
(SWITCHING), starts a new configuration epoch and creates the new workers, which
``activate`` makes schedulable once every rank has adopted the epoch.

Pure Python, clock-free. Not owned here: which operation to run (``control``),
requests and queues (``placement``), the driver that drains and switches.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


class LatticeError(ValueError):
    """An impossible layout or transition."""


class WorkerState(enum.StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    SWITCHING = "switching"
    UNAVAILABLE = "unavailable"


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


@dataclass
class LatticeWorker:
    worker_id: int
    cp_degree: int
    first_device: int
    state: WorkerState
    epoch: int  # the configuration epoch that created it

    @property
    def devices(self) -> range:
        return range(self.first_device, self.first_device + self.cp_degree)

    def hosts(self, config: LatticeConfig) -> range:
        return config.hosts_of(self.first_device, self.cp_degree)

    def spans_hosts(self, config: LatticeConfig) -> bool:
        """True for a worker whose collectives cross hosts (degree > devices_per_host)."""
        return len(self.hosts(config)) > 1


@dataclass(frozen=True)
class Reshape:
    """One split or merge: ``sources`` become workers of ``target_degree`` at
    ``target_firsts``."""

    kind: str  # "split" | "merge"
    sources: tuple[int, ...]
    target_degree: int
    target_firsts: tuple[int, ...]


class Lattice:
    def __init__(self, config: LatticeConfig, layout: Sequence[int] | None = None) -> None:
        """``layout``: worker degrees in device order (default: every top-level block
        one worker of its size)."""
        self.config = config
        self.blocks = top_blocks(config.num_devices, config.degrees)
        self._block_starts = [start for start, _ in self.blocks]
        self.epoch = 0
        self.workers: dict[int, LatticeWorker] = {}
        self._next_id = 0
        if layout is None:
            layout = [size for _, size in self.blocks]
        pos = 0
        for degree in layout:
            self._new_worker(degree, pos, WorkerState.ACTIVE)
            pos += degree
        if pos != config.num_devices:
            raise LatticeError(
                f"layout {list(layout)} covers {pos} of {config.num_devices} devices"
            )
        self.check()

    # -- queries ---------------------------------------------------------------------

    def composition(self, states: Iterable[WorkerState] | None = None) -> Counter[int]:
        """Workers per degree (of the given states; default all)."""
        wanted = set(states) if states is not None else set(WorkerState)
        return Counter(w.cp_degree for w in self.workers.values() if w.state in wanted)

    def active(self) -> list[LatticeWorker]:
        return [w for w in self.workers.values() if w.state is WorkerState.ACTIVE]

    def layout(self) -> list[int]:
        """Degrees in device order."""
        return [w.cp_degree for w in sorted(self.workers.values(), key=lambda w: w.first_device)]

    def _block_of(self, first: int) -> tuple[int, int]:
        k = bisect.bisect_right(self._block_starts, first) - 1
        if k >= 0:
            start, size = self.blocks[k]
            if first < start + size:
                return start, size
        raise LatticeError(f"device {first} outside the pool")

    def buddy(
        self, worker_id: int, slots: Mapping[tuple[int, int], int] | None = None
    ) -> int | None:
        """The sibling that ``worker_id`` could merge with, if it exists as one worker
        (``slots``: (first device, degree) -> worker, to look it up in a large pool)."""
        w = self.workers[worker_id]
        parent = 2 * w.cp_degree
        start, size = self._block_of(w.first_device)
        if parent > size or parent not in self.config.degrees:
            return None
        parent_first = w.first_device - (w.first_device - start) % parent
        sibling_first = (
            parent_first + w.cp_degree if w.first_device == parent_first else parent_first
        )
        if slots is not None:
            return slots.get((sibling_first, w.cp_degree))
        for other in self.workers.values():
            if other.first_device == sibling_first and other.cp_degree == w.cp_degree:
                return other.worker_id
        return None

    def split_options(self) -> list[Reshape]:
        """Every split of an ACTIVE worker that keeps the bounds."""
        counts, out = self.composition(), []
        for w in sorted(self.workers.values(), key=lambda w: w.first_device):
            half = w.cp_degree // 2
            if w.state is not WorkerState.ACTIVE or half not in self.config.degrees:
                continue
            after = counts.copy()
            after[w.cp_degree] -= 1
            after[half] += 2
            if self.config.within_bounds(after):
                firsts = (w.first_device, w.first_device + half)
                out.append(Reshape("split", (w.worker_id,), half, firsts))
        return out

    def merge_options(self) -> list[Reshape]:
        """Every merge of two ACTIVE buddies that keeps the bounds."""
        counts, out = self.composition(), []
        slots = {(w.first_device, w.cp_degree): w.worker_id for w in self.workers.values()}
        for w in sorted(self.workers.values(), key=lambda w: w.first_device):
            other = self.buddy(w.worker_id, slots)
            if other is None or w.state is not WorkerState.ACTIVE:
                continue
            b = self.workers[other]
            if b.state is not WorkerState.ACTIVE or b.first_device < w.first_device:
                continue
            after = counts.copy()
            after[w.cp_degree] -= 2
            after[2 * w.cp_degree] += 1
            if self.config.within_bounds(after):
                out.append(
                    Reshape("merge", (w.worker_id, other), 2 * w.cp_degree, (w.first_device,))
                )
        return out

    # -- transitions -----------------------------------------------------------------

    def begin(self, op: Reshape) -> None:
        """Participants leave the candidate set: ACTIVE -> DRAINING."""
        for s in op.sources:
            if self.workers[s].state is not WorkerState.ACTIVE:
                raise LatticeError(f"worker {s} is {self.workers[s].state}, not active")
        for s in op.sources:
            self.workers[s].state = WorkerState.DRAINING

    def park(self, worker_id: int) -> None:
        """The worker's in-flight prefills finished: DRAINING -> SWITCHING."""
        w = self.workers[worker_id]
        if w.state is not WorkerState.DRAINING:
            raise LatticeError(f"worker {worker_id} is {w.state}, not draining")
        w.state = WorkerState.SWITCHING

    def commit(self, op: Reshape) -> list[LatticeWorker]:
        """All participants parked: a new epoch; the sources go, the targets come (not
        yet schedulable)."""
        for s in op.sources:
            if self.workers[s].state is not WorkerState.SWITCHING:
                raise LatticeError(f"worker {s} has not parked ({self.workers[s].state})")
        self.epoch += 1
        for s in op.sources:
            del self.workers[s]
        made = [
            self._new_worker(op.target_degree, first, WorkerState.SWITCHING)
            for first in op.target_firsts
        ]
        self.check()
        return made

    def abort(self, op: Reshape) -> None:
        """A reshape given up before its commit: DRAINING or SWITCHING -> ACTIVE (a
        participant that failed meanwhile stays UNAVAILABLE)."""
        states = (WorkerState.DRAINING, WorkerState.SWITCHING, WorkerState.UNAVAILABLE)
        for s in op.sources:
            w = self.workers.get(s)
            if w is None or w.state not in states:
                raise LatticeError(f"worker {s} is not a participant of an uncommitted reshape")
        for s in op.sources:
            if self.workers[s].state is not WorkerState.UNAVAILABLE:
                self.workers[s].state = WorkerState.ACTIVE

    def activate(self, worker_id: int) -> None:
        """Every rank adopted the epoch: SWITCHING -> ACTIVE."""
        w = self.workers[worker_id]
        if w.state is not WorkerState.SWITCHING or w.epoch != self.epoch:
            raise LatticeError(f"worker {worker_id} is not a new worker of epoch {self.epoch}")
        w.state = WorkerState.ACTIVE

    def fail(self, worker_id: int) -> None:
        self.workers[worker_id].state = WorkerState.UNAVAILABLE

    def restore(self, worker_id: int) -> None:
        w = self.workers[worker_id]
        if w.state is not WorkerState.UNAVAILABLE:
            raise LatticeError(f"worker {worker_id} is {w.state}, not unavailable")
        w.state = WorkerState.ACTIVE

    def _new_worker(self, degree: int, first: int, state: WorkerState) -> LatticeWorker:
        w = LatticeWorker(self._next_id, degree, first, state, self.epoch)
        self._next_id += 1
        self.workers[w.worker_id] = w
        return w

    # -- invariants ------------------------------------------------------------------

    def check(self) -> None:
        """Raise LatticeError unless the workers tile the devices, aligned."""
        covered: list[int] = []
        for w in self.workers.values():
            if w.cp_degree not in self.config.degrees:
                raise LatticeError(f"worker {w.worker_id}: degree {w.cp_degree} not allowed")
            start, size = self._block_of(w.first_device)
            if (
                w.first_device - start
            ) % w.cp_degree or w.first_device + w.cp_degree > start + size:
                raise LatticeError(f"worker {w.worker_id} is not aligned inside its block")
            covered.extend(w.devices)
        if sorted(covered) != list(range(self.config.num_devices)):
            raise LatticeError("workers do not cover every device exactly once")


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
