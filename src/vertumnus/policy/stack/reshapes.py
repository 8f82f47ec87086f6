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

Each step returns what the root must do next (a ``Step`` of intents: the drained
requests to place again, the waiting requests to retry, the copy lanes to pump;
``pump``'s ``Commit`` comes back here). Pure Python, clock-free. Not owned here:
one reshape's stages on the lattice, the scheduler and the trie (``transition``),
the order of switches and copies on the ranks (``lanes``), when to reshape
(``control``), placing requests (``admission``, through the root).
"""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.policy.control.candidates import PoolInputs
from vertumnus.policy.control.decision import Decision
from vertumnus.policy.control.whatif import WhatIfController
from vertumnus.policy.lattice import Reshape
from vertumnus.policy.pool_results import Actions, RulesWindow, Switch, WhatIfWindow, WindowPlan
from vertumnus.policy.stack.intents import Pump, Requeue, RetryWaiting, Step
from vertumnus.policy.stack.lanes import CopyLanes
from vertumnus.policy.stack.state import StackState
from vertumnus.policy.transition import Phase, Reconfigurer, Transition, operator_reshape


class Reshapes:
    """Given the stack's state, one reshape's stages (``reconf``) and the copy lanes."""

    def __init__(self, state: StackState, reconf: Reconfigurer, lanes: CopyLanes) -> None:
        self.state, self.config = state, state.config
        self.lattice, self.scheduler = state.lattice, state.scheduler
        self.controller, self.reconf, self.cache = state.controller, reconf, state.cache
        self.ledger, self.holds, self.indexes = state.ledger, state.holds, state.indexes
        self.lanes = lanes
        self.transitions: list[Transition] = []  # under way

    # -- the controller's window -------------------------------------------------------

    def prepare_window(self, now: float) -> WindowPlan:
        """What the controller needs of the pool now (on the driver's loop)."""
        inputs = PoolInputs.of(self.scheduler, now)
        controller = self.controller
        if isinstance(controller, WhatIfController):
            return WhatIfWindow(controller, controller.prepare(inputs))
        return RulesWindow(controller, controller.prepare(inputs))

    def finish_window(
        self, plan: WindowPlan, evaluation: object, final: bool
    ) -> tuple[Decision, tuple[Reshape, ...]]:
        """Close the controller's period; returns its decision and the reshapes to
        ``begin`` now. Adaptive: its reshapes (participants drain, their queued
        requests are placed again). Fixed, or ``final`` (the run ended inside the
        window): the decision is noted, nothing runs."""
        decision = plan.conclude(evaluation)
        if final or not self.config.adaptive:
            for op in decision.ops:
                self.controller.reshape_done(op)
            return decision, ()
        return decision, decision.ops

    # -- a reshape's life --------------------------------------------------------------

    def begin(self, op: Reshape, now: float) -> tuple[Transition, Step]:
        """Start draining ``op``'s workers (LatticeError if it cannot run now); the
        step: place their queued requests again (then the root asks ``ready``)."""
        transition, requeue = self.reconf.begin(op, now)
        self.transitions.append(transition)
        return transition, Step(then=(Requeue(tuple(r.request_id for r in requeue)),))

    def ready(self, transition: Transition) -> Step:
        """A reshape just begun whose participants were all idle queues its switch."""
        if transition.phase is Phase.SWITCHING:  # every participant was idle
            self.lanes.queue_switch(transition)
            return Step(then=(Pump(),))
        return Step()

    def choose(self, kind: str, workers: Sequence[int] | None, now: float) -> Reshape:
        """An operator's reshape (``transition.operator_reshape``)."""
        busy = {s for t in self.transitions for s in t.op.sources}
        return operator_reshape(self.lattice, kind, workers, busy, self.scheduler.loads(now))

    def parked(self, worker_id: int, now: float) -> Step:
        """Park ``worker_id`` if it takes part in a reshape and is idle now; a reshape
        whose participants have all parked switches (or waits its turn)."""
        for transition in self.transitions:
            if worker_id in transition.op.sources and self.reconf.idle(transition, worker_id, now):
                self.lanes.queue_switch(transition)
        return Step(then=(Pump(),))

    def commit(self, transition: Transition, now: float) -> Switch:
        """The switch, once the copy lanes give it the ranks (their ``Commit``): the
        stack moves to the new workers."""
        retained = self.ledger.collect(transition.op.sources)
        adopt = self.reconf.switch(transition, now)
        for s in transition.op.sources:
            assert s not in self.state.running, "a parked worker runs a prefill"
            assert not self.holds.holding(s), "a parked worker holds KV for a hand-off"
            del self.indexes[s]
        for w in transition.new_workers:
            self.state.add_worker(w)
        adopted, reserved = self.ledger.after_switch(transition.new_workers, retained, adopt, now)
        if self.config.retention.fetch_at_switch:  # (they run once the ranks are free)
            for plan in (p for w in transition.new_workers for p in self.cache.reconcile(w)):
                self.lanes.queue_copy(plan)
        workers = tuple((w, tuple(self.lattice.workers[w].devices)) for w in transition.new_workers)
        expire = now + self.config.retention.retain_s if reserved else None
        return Switch(transition, self.lattice.epoch, workers, adopted, reserved, expire)

    def acknowledge(self, transition: Transition, worker_id: int, cp_rank: int, now: float) -> Step:
        """Rank ``cp_rank`` of new worker ``worker_id`` adopted the epoch. When every
        rank has, the new workers serve, the copy lanes are free and waiting requests
        are placed."""
        if not self.reconf.acknowledge(transition, worker_id, cp_rank, now):
            return Step()
        self.transitions.remove(transition)
        self.lanes.release(transition)
        if transition.switch_s is not None:
            self.controller.switch_done(transition.switch_s)
        return Step(Actions(activated=[transition]), (RetryWaiting(), Pump()))

    def abort(self, transition: Transition, now: float) -> Step:
        """Roll back a reshape that has not committed (the driver's bound on it
        passed): its participants serve again as they were, waiting requests are
        placed (LatticeError once it has committed: finish it instead)."""
        self.reconf.abort(transition)
        self.transitions.remove(transition)
        self.lanes.unqueue_switch(transition)
        return Step(Actions(woken=list(transition.op.sources)), (RetryWaiting(), Pump()))
