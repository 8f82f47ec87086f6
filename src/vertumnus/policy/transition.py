"""One split or merge, from the controller's decision to the new workers' first request.

    begin      participants leave the candidate set (DRAINING); their queued requests
               come back for re-placement on other workers; what runs finishes under
               the old geometry
    idle       a participant's last prefill ended and no hand-off holds its KV any
               more (``policy/cache/holds.py``): it parks (SWITCHING)
    switch     every participant parked (a merge waits for all siblings): a new
               configuration epoch; the lattice swaps the workers; the prefix-cache
               manager hands their prefixes on as pending marks and returns the adopt
               plans; the driver tells the ranks to switch to the pre-created groups
    acknowledge  each rank adopts the epoch; when every rank of every new worker has,
               they become ACTIVE (schedulable) and the controller is told
    abort      (a driver's bound passed before the commit) the participants are
               ACTIVE again, as they were: the reshape is rolled back

The ``Transition`` records when each stage ended, so drain and switch times can be
exported. Pure Python, clock-free: ``now`` is an argument; the driver (coordinator or
simulator) does the waiting and the messaging.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vertumnus.policy.cache.holds import Holds
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.control.rules import ControllerBase
from vertumnus.policy.geometry import LatticeError
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Scheduler


class Phase(enum.StrEnum):
    DRAINING = "draining"
    SWITCHING = "switching"  # every participant parked, waiting for ``switch``
    ACTIVATING = "activating"  # committed, waiting for the ranks' acknowledgements
    DONE = "done"
    ROLLED_BACK = "rolled_back"  # given up before its commit: the participants serve again


@dataclass
class Transition:
    op: Reshape
    started_s: float
    phase: Phase = Phase.DRAINING
    parked_s: float | None = None  # all participants parked
    committed_s: float | None = None
    active_s: float | None = None
    new_workers: list[int] = field(default_factory=list)
    acks: dict[int, set[int]] = field(default_factory=dict)  # new worker -> ranks

    @property
    def drain_s(self) -> float | None:
        return None if self.parked_s is None else self.parked_s - self.started_s

    @property
    def switch_s(self) -> float | None:
        if self.active_s is None or self.parked_s is None:
            return None
        return self.active_s - self.parked_s


class Reconfigurer:
    def __init__(
        self,
        lattice: Lattice,
        scheduler: Scheduler,
        cache: PrefixCacheManager | None = None,
        controller: ControllerBase | None = None,
        holds: Holds | None = None,
    ) -> None:
        """With a cache manager, the scheduler's ``kv_blocks_per_rank`` (KV blocks of
        one rank) is the room each split child offers to the prefixes it inherits.
        ``holds``: the KV kept for hand-offs; a participant that holds some does not
        park."""
        blocks_per_rank = scheduler.config.kv_blocks_per_rank
        if cache is not None and blocks_per_rank is None:
            raise LatticeError("a cache manager needs kv_blocks_per_rank for splits")
        self.lattice, self.scheduler = lattice, scheduler
        self.cache, self.controller = cache, controller
        self.blocks_per_rank = blocks_per_rank
        self.holds = holds if holds is not None else Holds()

    def begin(self, op: Reshape, now: float) -> tuple[Transition, list[PlacementRequest]]:
        """Start draining; returns the queued requests to place elsewhere."""
        self.lattice.begin(op)
        transition = Transition(op, started_s=now)
        requeue: list[PlacementRequest] = []
        for s in op.sources:
            requeue += self.scheduler.drain(s)
        for s in op.sources:
            self.idle(transition, s, now)
        return transition, requeue

    def idle(self, transition: Transition, worker_id: int, now: float) -> bool:
        """``worker_id`` may have finished its last prefill: park it if so. True when
        this parked the last participant (the transition is ready to switch)."""
        if worker_id not in transition.op.sources:
            return False
        worker = self.lattice.workers[worker_id]
        if (
            worker.state is WorkerState.DRAINING
            and self.scheduler.running(worker_id) is None
            and not self.holds.holding(worker_id)
        ):
            self.lattice.park(worker_id)
        parked = all(
            self.lattice.workers[s].state is WorkerState.SWITCHING for s in transition.op.sources
        )
        if parked and transition.phase is Phase.DRAINING:
            transition.phase = Phase.SWITCHING
            transition.parked_s = now
            return True
        return False

    def switch(self, transition: Transition, now: float) -> list[CopyPlan]:
        """Commit the new epoch; returns the cache manager's adopt plans."""
        if transition.phase is not Phase.SWITCHING:
            raise LatticeError(f"cannot switch a transition that is {transition.phase}")
        op = transition.op
        sources = [self.lattice.workers[s] for s in op.sources]
        made = self.lattice.commit(op)
        for s in op.sources:
            left = self.scheduler.forget_worker(s)
            assert not left, "a parked worker had requests"
        transition.new_workers = [w.worker_id for w in made]
        transition.acks = {w.worker_id: set() for w in made}
        transition.committed_s = now
        transition.phase = Phase.ACTIVATING
        if self.cache is None:
            return []
        if op.kind == "merge":
            merged = made[0]
            return self.cache.merge(
                [w.worker_id for w in sources],
                merged.worker_id,
                merged.cp_degree,
                merged.first_device,
            )
        assert self.blocks_per_rank is not None
        return self.cache.split(
            sources[0].worker_id,
            [(w.worker_id, w.first_device) for w in made],
            op.target_degree,
            capacity_blocks=self.blocks_per_rank * op.target_degree,
        )

    def abort(self, transition: Transition) -> None:
        """Roll back a reshape that has not committed: its participants serve again as
        they were (a failed one stays out), and the controller no longer waits for it."""
        if transition.phase not in (Phase.DRAINING, Phase.SWITCHING):
            raise LatticeError(f"cannot roll back a transition that is {transition.phase}")
        self.lattice.abort(transition.op)
        transition.phase = Phase.ROLLED_BACK
        if self.controller is not None and transition.op in self.controller.in_flight:
            self.controller.reshape_done(transition.op)

    def acknowledge(self, transition: Transition, worker_id: int, rank: int, now: float) -> bool:
        """Rank ``rank`` (0..C-1) of new worker ``worker_id`` adopted the epoch. True
        when the transition is done (every new worker active)."""
        if transition.phase is not Phase.ACTIVATING or worker_id not in transition.acks:
            raise LatticeError(f"worker {worker_id} is not waiting for acknowledgements")
        degree = self.lattice.workers[worker_id].cp_degree
        if not 0 <= rank < degree:
            raise LatticeError(f"worker {worker_id} has ranks 0..{degree - 1}, not {rank}")
        transition.acks[worker_id].add(rank)
        done = all(
            len(ranks) == self.lattice.workers[w].cp_degree for w, ranks in transition.acks.items()
        )
        if done:
            for w in transition.new_workers:
                self.lattice.activate(w)
            transition.phase = Phase.DONE
            transition.active_s = now
            if self.controller is not None and transition.op in self.controller.in_flight:
                self.controller.reshape_done(transition.op)
        return done


def operator_reshape(
    lattice: Lattice,
    kind: str,
    workers: Sequence[int] | None,
    busy: set[int],
    loads: Mapping[int, float],
) -> Reshape:
    """An operator's request as a lattice operation: the ``kind`` ("split" or
    "merge") of exactly ``workers``, or, with none given, the option whose
    participants have the least outstanding work (``loads``). Workers in ``busy``
    (a reshape under way) are not options. LatticeError says what is possible."""
    if kind not in ("split", "merge"):
        raise LatticeError(f"op must be 'split' or 'merge', got {kind!r}")
    options = lattice.split_options() if kind == "split" else lattice.merge_options()
    options = [op for op in options if not busy & set(op.sources)]
    if workers:
        wanted = tuple(sorted(workers))
        chosen = [op for op in options if tuple(sorted(op.sources)) == wanted]
        if not chosen:
            raise LatticeError(
                f"cannot {kind} {list(wanted)}: the possible {kind}s now are "
                f"{[list(op.sources) for op in options]}"
            )
        return chosen[0]
    if not options:
        raise LatticeError(f"no {kind} is possible now")
    return min(options, key=lambda op: max(loads.get(s, 0.0) for s in op.sources))
