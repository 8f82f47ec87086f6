"""The buddy lattice's workers: one lattice state and the transitions between states
(docs/scheduling.md, "The lattice").

The devices, the aligned workers they can form and the compositions within bounds
are the lattice's geometry (``geometry``). A ``Lattice`` holds one state, a
partition of the devices into aligned workers, with each worker's state; a split
or a merge (``Reshape``) moves it to a neighbouring state. ``split_options`` and
``merge_options`` list those the bounds allow.

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
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vertumnus.policy.geometry import (
    LatticeConfig,
    LatticeError,
    top_blocks,
)

__all__ = ["Lattice", "LatticeWorker", "Reshape", "WorkerState"]


class WorkerState(enum.StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    SWITCHING = "switching"
    UNAVAILABLE = "unavailable"


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
