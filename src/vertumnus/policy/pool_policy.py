"""The policy stack of a prefill pool: one object, driven the same way by the
discrete-event simulator and the asyncio coordinator (one implementation, two
drivers: docs/architecture.md, "One policy stack, two drivers").

``PoolPolicy.build(profile, pool, config)`` is the one factory. The stack builds
the state its parts share once (``policy/stack/state.py``: the lattice, the router,
the controller, the prefix-cache manager, one ``WorkerCacheIndex`` per worker, the
KV ledger, the hand-offs' holds, the host tier) and then the parts, each given the
state and the parts built before it: the copy lanes (``lanes``), pulls (``pulls``),
the open requests (``admission``), rank failures (``outages``), the reshapes under
way (``reshapes``) and the workers' prefills (``prefills``). No part calls into a
sibling built after it or into the stack: each returns a ``Step``, the actions so
far and typed intents (``policy/stack/intents.py``), and the stack, the
composition root, routes each intent at once to the part that does it. A driver
calls it with the time:

    arrive / replace / drop / abandon   a request placed (or waiting, or refused),
                                  placed again, answered with an error, given up
    start(worker, now)            the worker is idle: its queue's head, blocks allocated
    finish(worker, now, ok, hold) a prefill ended; ``hold``: its KV waits for a decode
    release_hold(hold, now)       server until this (``policy/cache/holds.py``)
    end_window / begin_reshape    the controller's decision; an operator's reshape
    acknowledge(t, w, rank, now)  a rank of a new worker adopted the epoch
    abort_reshape(t, now)         a reshape past the driver's bound, rolled back
    scan / copy_done / expire     the cache manager's scan, a KV copy ended, reserved
                                  slots whose time is up
    worker_failed / _reset / _restored / _abandoned   rank failures (``outages``)

and does what it returns, ``Actions`` (``policy/pool_results.py``): placements,
refusals, the copies or the switch the copy lanes allow now (``policy/stack/lanes.py``),
workers woken. Pure Python, clock-free. Not owned here: moving bytes, timing,
processes (the drivers).
"""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.perfmodel import Profile
from vertumnus.policy.cache.copy_cost import CopyTimer
from vertumnus.policy.cache.holds import Hold
from vertumnus.policy.cache.ledger import CopyJob
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.geometry import composition_name
from vertumnus.policy.lattice import Reshape, WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec
from vertumnus.policy.pool_results import (
    Actions,
    Finished,
    Running,
    ScanOutcome,
    Started,
    WindowOutcome,
    WindowPlan,
)
from vertumnus.policy.stack.admission import Admission
from vertumnus.policy.stack.intents import (
    Commit,
    Intent,
    ParkCheck,
    Pump,
    Requeue,
    RetryWaiting,
    Step,
    Wipe,
)
from vertumnus.policy.stack.lanes import CopyLanes
from vertumnus.policy.stack.outages import Outages
from vertumnus.policy.stack.prefills import Prefills
from vertumnus.policy.stack.pulls import Pulls
from vertumnus.policy.stack.reshapes import Reshapes
from vertumnus.policy.stack.state import StackState
from vertumnus.policy.transition import Reconfigurer, Transition


class PoolPolicy:
    def __init__(self, profile: Profile, pool: PoolSpec, config: PolicyConfig) -> None:
        self.state = state = StackState(profile, pool, config)  # what the parts share
        self.profile, self.pool, self.config = profile, pool, config
        self.block_tokens, self.curves = state.block_tokens, state.curves
        self.lattice, self.cache, self.tiers = state.lattice, state.cache, state.tiers
        self.scheduler, self.controller = state.scheduler, state.controller
        self.holds, self.indexes, self.ledger = state.holds, state.indexes, state.ledger
        self.reconf = Reconfigurer(
            state.lattice, state.scheduler, state.cache, state.controller, state.holds
        )
        timer = CopyTimer(config.cache.copy_latency_s, config.cache.copy_block_s)
        self.lanes = CopyLanes(state.ledger, timer, config.cache.lanes)
        self.pulls = Pulls(state, self.lanes)
        if config.replication and config.cache.pull and config.router == "vertumnus":
            self.pulls.attach(state.scheduler)
        self.admission = Admission(state, self.pulls, self.lanes)
        self.outages = Outages(state)  # rank failures: workers out, reset, back
        self.reshapes = Reshapes(state, self.reconf, self.lanes)  # decision to new epoch
        self.transitions = self.reshapes.transitions  # under way
        self.prefills = Prefills(state, self.admission, self.pulls)  # what workers run

    @classmethod
    def build(cls, profile: Profile, pool: PoolSpec, config: PolicyConfig) -> PoolPolicy:
        """The one factory of the stack (the simulator's and the coordinator's)."""
        return cls(profile, pool, config)

    # -- routing the parts' intents (``policy/stack/intents.py``) ----------------------

    def carry_out(self, step: Step, now: float) -> Actions:
        """Carry out a part's ``step``: its intents, in order, each at once."""
        actions = step.actions
        for intent in step.then:
            actions.add(self._route(intent, now))
        return actions

    def _route(self, intent: Intent, now: float) -> Actions:
        match intent:
            case Requeue(request_ids):
                actions = Actions()
                for request_id in request_ids:
                    actions.add(self.place(request_id, now))
                return actions
            case RetryWaiting():
                return self.retry_waiting(now)
            case ParkCheck(worker_id):
                return self.carry_out(self.reshapes.parked(worker_id, now), now)
            case Pump():
                return self.carry_out(self.lanes.pump(now), now)
            case Commit(transition):
                return Actions(switch=self.reshapes.commit(transition, now))
            case Wipe(worker_id, devices):
                self.outages.wipe(worker_id, devices)
                return Actions()

    # -- rank failures (``policy/stack/outages.py``; the coordinator's ``Recovery``) ----

    def worker_failed(self, worker_id: int, now: float) -> Actions:
        """A rank of the worker died or hung: its queued requests are placed again."""
        return self.carry_out(self.outages.failed(worker_id, now), now)

    def worker_reset(self, worker_id: int, now: float) -> Actions:
        """The failed worker's ranks restart: its queue is placed again, then its
        cache is gone."""
        return self.carry_out(self.outages.reset(worker_id, now), now)

    def worker_restored(self, worker_id: int, now: float) -> Actions:
        """The worker's ranks are back: it serves again; waiting requests are placed."""
        return self.carry_out(self.outages.restored(worker_id, now), now)

    def worker_abandoned(self, worker_id: int, now: float) -> Actions:
        """The worker's restart was given up: requests waiting only for it are refused."""
        return self.carry_out(self.outages.abandoned(worker_id, now), now)

    # -- views -----------------------------------------------------------------------

    def composition_name(self, states: Sequence[WorkerState] | None = None) -> str:
        return composition_name(self.lattice.composition(states))

    @property
    def open_requests(self) -> int:
        return len(self.admission.requests)

    @property
    def waiting(self) -> int:
        return len(self.admission.waiting)

    def running(self, worker_id: int) -> Running | None:
        """The worker's prefill under way, if any."""
        return self.state.running.get(worker_id)

    # -- requests (``policy/stack/admission.py``) ---------------------------------------------

    def arrive(self, request: PlacementRequest, now: float) -> Actions:
        """A new request: placed on a worker, or waiting for one (while a reshape or a
        restart is under way), or refused (no worker can take it, none is coming)."""
        return self.carry_out(self.admission.arrive(request, now), now)

    def replace(self, request_id: int, now: float) -> Actions:
        """Place an open request again (its prefill failed); its demand was counted."""
        return self.place(request_id, now)

    def drop(self, request_id: int) -> None:
        """The driver answered an open request (with an error): forget it."""
        self.admission.drop(request_id)

    def abandon(self, request_id: int, now: float) -> None:
        """The client gave up (``Admission.abandon``)."""
        self.admission.abandon(request_id)

    def place(self, request_id: int, now: float) -> Actions:
        return self.carry_out(self.admission.place(request_id, now), now)

    def retry_waiting(self, now: float) -> Actions:
        """Place again every request that waits (a worker came, or will not)."""
        return self.carry_out(Step(then=(Requeue(self.admission.take_waiting()),)), now)

    # -- a worker's prefills (``policy/stack/prefills.py``) ------------------------------------

    def start(self, worker_id: int, now: float) -> Started | None:
        """The next prefill of an idle, active worker (None: nothing to run)."""
        return self.prefills.start(worker_id, now)

    def finish(
        self,
        worker_id: int,
        now: float,
        ok: bool = True,
        compute_s: float | None = None,
        hold: bool = False,
    ) -> Finished:
        """The worker's prefill ended: ``ok`` (its blocks are written), ``compute_s``
        (the ranks' own time), ``hold`` (its KV waits for ``release_hold``)."""
        finished, park = self.prefills.finish(worker_id, now, ok, compute_s, hold)
        finished.actions.add(self._route(park, now))
        return finished

    def release_hold(self, hold: Hold, now: float) -> Actions:
        """The decode side has the KV (or gave up, or its time is up): the pin goes."""
        return self._route(self.prefills.release_hold(hold, now), now)

    # -- the controller and reshapes (``policy/stack/reshapes.py``) ------------------------------

    def end_window(self, now: float, final: bool = False) -> WindowOutcome:
        """The controller's decision, at once (``prepare_window``, its ``evaluate``,
        ``finish_window``)."""
        plan = self.prepare_window(now)
        return self.finish_window(plan, plan.evaluate(), now, final)

    def prepare_window(self, now: float) -> WindowPlan:
        """What the controller needs of the pool now (on the driver's loop)."""
        return self.reshapes.prepare_window(now)

    def finish_window(
        self, plan: WindowPlan, evaluation: object, now: float, final: bool = False
    ) -> WindowOutcome:
        """Close the controller's period: an adaptive pool's reshapes begin.
        ``evaluation``: what ``plan.evaluate()`` returned (a ``WindowEvaluation``;
        checked against the plan)."""
        decision, ops = self.reshapes.finish_window(plan, evaluation, final)
        actions = Actions()
        begun: list[Transition] = []
        for op in ops:
            transition, more = self.begin_reshape(op, now)
            begun.append(transition)
            actions.add(more)
        return WindowOutcome(decision, tuple(begun), actions)

    def begin_reshape(self, op: Reshape, now: float) -> tuple[Transition, Actions]:
        """Start draining ``op``'s workers (LatticeError if it cannot run now): their
        queued requests are placed again; a reshape whose participants were all idle
        queues its switch."""
        transition, step = self.reshapes.begin(op, now)
        actions = self.carry_out(step, now)
        return transition, actions.add(self.carry_out(self.reshapes.ready(transition), now))

    def choose_reshape(self, kind: str, workers: Sequence[int] | None, now: float) -> Reshape:
        """An operator's reshape (``transition.operator_reshape``)."""
        return self.reshapes.choose(kind, workers, now)

    def acknowledge(
        self, transition: Transition, worker_id: int, cp_rank: int, now: float
    ) -> Actions:
        """Rank ``cp_rank`` of new worker ``worker_id`` adopted the epoch."""
        return self.carry_out(self.reshapes.acknowledge(transition, worker_id, cp_rank, now), now)

    def abort_reshape(self, transition: Transition, now: float) -> Actions:
        """Roll back a reshape that has not committed (the driver's bound passed)."""
        return self.carry_out(self.reshapes.abort(transition, now), now)

    # -- the cache manager ---------------------------------------------------------------

    def scan(self, now: float) -> ScanOutcome:
        """The cache manager's scan over the active workers: its copies queue on the
        copy lanes (the first may start now), its reclamations happen at once (a slot
        freed in the index is free on the rank)."""
        active = {
            w.worker_id: self.indexes[w.worker_id]
            for w in self.lattice.workers.values()
            if w.state is WorkerState.ACTIVE and w.worker_id in self.indexes
        }
        loads = {w: self.scheduler.outstanding_s(w, now) for w in active}
        result = self.cache.scan(active, loads)
        for copy in result.copies:
            self.lanes.queue_copy(copy)
        actions = self._route(Pump(), now)
        reclaimed = self.ledger.reclaim(result.reclaims)
        return ScanOutcome(
            result, reclaimed, actions, self.cache.audit.scanned(now, result, reclaimed)
        )

    def queue_copy(self, plan: CopyPlan, now: float) -> Actions:
        """Run a copy plan made outside the scan (an operator's, a test's)."""
        self.lanes.queue_copy(plan)
        return self._route(Pump(), now)

    def copy_done(self, job: CopyJob, ok: bool, now: float) -> Actions:
        """The copy's bytes are in place (``ok``) or the move failed. A pull's blocks
        are pinned for the requests waiting on them before the next copy starts: its
        allocation would otherwise evict them first where the rest is pinned."""
        actions = self.lanes.copy_done(job, ok, job.plan.dest_worker in self.indexes, now)
        self.pulls.ended(job.plan, self.admission.requests)
        return actions.add(self._route(Pump(), now))

    def expire(self, now: float) -> int:
        """Give back the reserved slots whose time is up; returns how many."""
        return self.ledger.expire(now)
