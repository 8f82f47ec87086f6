"""The reshapes under way in the stack, from the controller's window to the new
workers' epoch.

The controller's period closes in three steps (``prepare_window`` on the driver's
loop, the plan's ``evaluate`` anywhere, ``finish_window`` on the loop); an adaptive
pool begins its reshapes then (an operator's begin at any time). A reshape's
participants drain; each parks once idle (``parked``: no prefill runs, no hand-off
holds its KV) and a reshape whose participants have all parked queues its switch on
the copy lanes. The switch's ``commit`` moves the stack to the new workers: the KV
ledger collects what the old ones retained, the lattice and the trie swap them,
their cache indexes are replaced, and the KV left in place is adopted or reserved
(and, with ``fetch_at_switch``, fetched). When every rank of the new workers has
acknowledged the epoch they serve; a reshape past the driver's bound is rolled back
before its commit.

Pure Python, clock-free. Not owned here: one reshape's stages on the lattice, the
scheduler and the trie (``transition``), the order of switches and copies on the
ranks (``lanes``), when to reshape (``control``).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence

from vertumnus.policy.cache.holds import Holds
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.ledger import KVLedger
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.control.candidates import PoolInputs
from vertumnus.policy.control.rules import Controller
from vertumnus.policy.lattice import Lattice, Reshape
from vertumnus.policy.placement.scheduler import Scheduler
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.policy.pool_results import Actions, Running, Switch, WindowOutcome, WindowPlan
from vertumnus.policy.stack.lanes import CopyLanes
from vertumnus.policy.transition import Phase, Reconfigurer, Transition, operator_reshape


class Reshapes:
    """Given the stack's parts a reshape reads and changes, and the acts of the stack
    it needs: ``running`` (a worker's prefill), ``add_worker`` (a fresh cache index),
    ``place`` a request again and ``retry_waiting`` (the requests that wait)."""

    def __init__(
        self,
        config: PolicyConfig,
        lattice: Lattice,
        scheduler: Scheduler,
        controller: Controller,
        reconf: Reconfigurer,
        cache: PrefixCacheManager,
        ledger: KVLedger,
        holds: Holds,
        indexes: MutableMapping[int, WorkerCacheIndex],
        lanes: CopyLanes,
        running: Callable[[int], Running | None],
        add_worker: Callable[[int], None],
        place: Callable[[int, float], Actions],
        retry_waiting: Callable[[float], Actions],
    ) -> None:
        self.config, self.lattice, self.scheduler = config, lattice, scheduler
        self.controller, self.reconf, self.cache = controller, reconf, cache
        self.ledger, self.holds, self.indexes, self.lanes = ledger, holds, indexes, lanes
        self.running, self.add_worker = running, add_worker
        self.place, self.retry_waiting = place, retry_waiting
        self.transitions: list[Transition] = []  # under way

    # -- the controller's window -------------------------------------------------------

    def prepare_window(self, now: float) -> WindowPlan:
        """What the controller needs of the pool now (on the driver's loop)."""
        inputs = PoolInputs.of(self.scheduler, now)
        return WindowPlan(self.controller, self.controller.prepare(inputs))

    def finish_window(
        self, plan: WindowPlan, evaluation: object, now: float, final: bool
    ) -> WindowOutcome:
        """Close the controller's period. Adaptive: its reshapes begin (participants
        drain, their queued requests are placed again). Fixed, or ``final`` (the run
        ended inside the window): the decision is noted, nothing runs."""
        decision = self.controller.conclude(plan.plan, evaluation)
        actions = Actions()
        begun: list[Transition] = []
        if final or not self.config.adaptive:
            for op in decision.ops:
                self.controller.reshape_done(op)
        else:
            for op in decision.ops:
                transition, more = self.begin(op, now)
                begun.append(transition)
                actions.add(more)
        return WindowOutcome(decision, tuple(begun), actions)

    # -- a reshape's life --------------------------------------------------------------

    def begin(self, op: Reshape, now: float) -> tuple[Transition, Actions]:
        """Start draining ``op``'s workers (LatticeError if it cannot run now)."""
        transition, requeue = self.reconf.begin(op, now)
        self.transitions.append(transition)
        actions = Actions()
        for request in requeue:
            actions.add(self.place(request.request_id, now))
        if transition.phase is Phase.SWITCHING:  # every participant was idle
            self.lanes.queue_switch(transition)
            actions.add(self.lanes.pump(now))
        return transition, actions

    def choose(self, kind: str, workers: Sequence[int] | None, now: float) -> Reshape:
        """An operator's reshape (``transition.operator_reshape``)."""
        busy = {s for t in self.transitions for s in t.op.sources}
        return operator_reshape(self.lattice, kind, workers, busy, self.scheduler.loads(now))

    def parked(self, worker_id: int, now: float) -> Actions:
        """Park ``worker_id`` if it takes part in a reshape and is idle now; a reshape
        whose participants have all parked switches (or waits its turn)."""
        for transition in self.transitions:
            if worker_id in transition.op.sources and self.reconf.idle(transition, worker_id, now):
                self.lanes.queue_switch(transition)
        return self.lanes.pump(now)

    def commit(self, transition: Transition, now: float) -> Switch:
        """The switch, once the copy lanes give it the ranks: the stack moves to the
        new workers (the lanes' ``commit``)."""
        retained = self.ledger.collect(transition.op.sources)
        adopt = self.reconf.switch(transition, now)
        for s in transition.op.sources:
            assert self.running(s) is None, "a parked worker runs a prefill"
            assert not self.holds.holding(s), "a parked worker holds KV for a hand-off"
            del self.indexes[s]
        for w in transition.new_workers:
            self.add_worker(w)
        adopted, reserved = self.ledger.after_switch(transition.new_workers, retained, adopt, now)
        if self.config.retention.fetch_at_switch:  # (they run once the ranks are free)
            for plan in (p for w in transition.new_workers for p in self.cache.reconcile(w)):
                self.lanes.queue_copy(plan)
        workers = tuple((w, tuple(self.lattice.workers[w].devices)) for w in transition.new_workers)
        expire = now + self.config.retention.retain_s if reserved else None
        return Switch(transition, self.lattice.epoch, workers, adopted, reserved, expire)

    def acknowledge(
        self, transition: Transition, worker_id: int, cp_rank: int, now: float
    ) -> Actions:
        """Rank ``cp_rank`` of new worker ``worker_id`` adopted the epoch. When every
        rank has, the new workers serve, the copy lanes are free and waiting requests
        are placed."""
        if not self.reconf.acknowledge(transition, worker_id, cp_rank, now):
            return Actions()
        self.transitions.remove(transition)
        self.lanes.release(transition)
        if transition.switch_s is not None:
            self.controller.switch_done(transition.switch_s)
        actions = Actions(activated=[transition])
        actions.add(self.retry_waiting(now))
        return actions.add(self.lanes.pump(now))

    def abort(self, transition: Transition, now: float) -> Actions:
        """Roll back a reshape that has not committed (the driver's bound on it
        passed): its participants serve again as they were, waiting requests are
        placed (LatticeError once it has committed: finish it instead)."""
        self.reconf.abort(transition)
        self.transitions.remove(transition)
        self.lanes.unqueue_switch(transition)
        actions = Actions(woken=list(transition.op.sources))
        actions.add(self.retry_waiting(now))
        return actions.add(self.lanes.pump(now))
