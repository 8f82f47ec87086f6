"""The policy stack of a prefill pool: one object, driven the same way by the
discrete-event simulator and the asyncio coordinator (DESIGN.md §2: one
implementation, two drivers).

``PoolPolicy.build(profile, pool, config)`` is the one factory. The stack owns the
lattice, the router (the cost rule or a baseline), the controller, the reshape
transitions, the prefix-cache manager (trie), one ``WorkerCacheIndex`` per worker,
the KV ledger and the hand-offs' holds. A driver calls it with the time:

    arrive / replace / drop / abandon   a request placed (or waiting, or refused),
                                  placed again, answered with an error, given up
    start(worker, now)            the worker is idle: the head of its queue, leased
    finish(worker, now, ok, hold) a prefill ended; ``hold``: its KV waits for a decode
    release_hold(hold, now)       server until this (``policy/cache/holds.py``)
    end_window / begin_reshape    the controller's decision; an operator's reshape
    acknowledge(t, w, rank, now)  a rank of a new worker adopted the epoch
    abort_reshape(t, now)         a reshape past the driver's bound, rolled back
    scan / copy_done / expire     the cache manager's scan, a KV copy ended, reserved
                                  slots whose time is up
    outages.failed / reset / restored / abandoned   rank failures (``outages``)

and does what it returns, ``Actions`` (``policy/pool_results.py``): placements,
refusals, the copies or the switch the copy lanes allow now (``policy/lanes.py``),
workers woken. Pure Python, clock-free. Not owned here: moving bytes, timing,
processes (the drivers).
"""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.blocks import max_reuse_blocks
from vertumnus.perfmodel import Profile
from vertumnus.policy.admission import Admission
from vertumnus.policy.cache.copy_cost import CopyTimer
from vertumnus.policy.cache.holds import Hold, Holds, held_blocks
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.ledger import CopyJob, KVLedger
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.control.candidates import PoolInputs
from vertumnus.policy.controllers import build_controller
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.lanes import CopyLanes
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState, composition_name
from vertumnus.policy.outages import Outages
from vertumnus.policy.placement.routers import ROUTERS
from vertumnus.policy.placement.scheduler import PlacementRequest, SchedulerConfig
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec
from vertumnus.policy.pool_results import (
    Actions,
    Finished,
    Running,
    ScanOutcome,
    Started,
    Switch,
    WindowOutcome,
    WindowPlan,
)
from vertumnus.policy.pulls import Pulls
from vertumnus.policy.transition import Phase, Reconfigurer, Transition, operator_reshape


class PoolPolicy:
    def __init__(self, profile: Profile, pool: PoolSpec, config: PolicyConfig) -> None:
        degrees = pool.lattice.degrees
        pool.check_profile(profile, config)
        coeffs = {c: profile.coeffs[c] for c in degrees}
        self.profile, self.pool, self.config = profile, pool, config
        self.block_tokens = pool.block_tokens
        self.curves = reuse_curves(coeffs)
        self.lattice = Lattice(pool.lattice, pool.layout)
        self.cache = PrefixCacheManager(
            coeffs, pool.block_tokens, config.cache, config.weights, config.ideal_reuse
        )
        self.scheduler = ROUTERS[config.router](
            self.lattice,
            coeffs,
            SchedulerConfig(
                config.weights,
                config.max_tokens_per_rank,
                pool.blocks_per_rank,
                config.coming_reuse,
            ),
            self.cache,
        )
        self.controller = build_controller(config, self.lattice, self.cache, self.curves, profile)
        self.holds = Holds()  # KV kept for decode servers (``policy/cache/holds.py``)
        self.reconf = Reconfigurer(
            self.lattice,
            self.scheduler,
            self.cache,
            self.controller,
            pool.blocks_per_rank,
            self.holds,
        )
        self.indexes: dict[int, WorkerCacheIndex] = {}
        self.ledger = KVLedger(
            self.lattice, self.indexes, self.cache, pool.blocks_per_rank, config.retention
        )
        for w in self.lattice.workers.values():
            self.add_worker(w.worker_id)
        self._running: dict[int, Running] = {}  # worker -> its prefill
        self.transitions: list[Transition] = []  # under way
        self.outages = Outages(  # rank failures: workers out, reset, back
            self.lattice,
            self.scheduler,
            self.cache,
            self.ledger,
            self.holds,
            self.indexes,
            self.place,
            self.add_worker,
            self.retry_waiting,
        )
        self.lanes = CopyLanes(
            self.ledger,
            self._commit,
            CopyTimer(config.cache.copy_latency_s, config.cache.copy_block_s),
            config.cache.lanes,
        )
        self.pulls = Pulls(self.cache, self.indexes, pool.block_tokens, self.lanes)
        if config.replication and config.cache.pull and config.router == "vertumnus":
            self.pulls.attach(self.scheduler)
        self.admission = Admission(
            self.scheduler,
            self.controller,
            self.pulls,
            self.lanes,
            self._someone_coming,
            pool.block_tokens,
            config.replication,
        )

    @classmethod
    def build(cls, profile: Profile, pool: PoolSpec, config: PolicyConfig) -> PoolPolicy:
        """The one factory of the stack (the simulator's and the coordinator's)."""
        return cls(profile, pool, config)

    def add_worker(self, worker_id: int) -> None:
        w = self.lattice.workers[worker_id]
        self.indexes[worker_id] = WorkerCacheIndex(
            w.cp_degree, self.pool.blocks_per_rank, worker_id
        )
        if worker_id not in self.cache.trie.workers:
            self.cache.add_worker(worker_id, w.cp_degree, w.first_device)

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
        return self._running.get(worker_id)

    # -- requests (``policy/admission.py``) ---------------------------------------------

    def arrive(self, request: PlacementRequest, now: float) -> Actions:
        """A new request: placed on a worker, or waiting for one (while a reshape or a
        restart is under way), or refused (no worker can take it, none is coming)."""
        return self.admission.arrive(request, now)

    def replace(self, request_id: int, now: float) -> Actions:
        """Place an open request again (its prefill failed); its demand was counted."""
        return self.admission.place(request_id, now)

    def drop(self, request_id: int) -> None:
        """The driver answered an open request (with an error): forget it."""
        self.admission.drop(request_id)

    def abandon(self, request_id: int, now: float) -> None:
        """The client gave up (``Admission.abandon``)."""
        self.admission.abandon(
            request_id, lambda rid: any(run.request_id == rid for run in self._running.values())
        )

    def place(self, request_id: int, now: float) -> Actions:
        return self.admission.place(request_id, now)

    def _someone_coming(self) -> bool:
        """A worker will become a candidate: a reshape or a restart is under way."""
        return bool(self.outages.down) or any(
            w.state in (WorkerState.DRAINING, WorkerState.SWITCHING)
            for w in self.lattice.workers.values()
        )

    def retry_waiting(self, now: float) -> Actions:
        return self.admission.retry_waiting(now)

    # -- a worker's prefills ---------------------------------------------------------

    def start(self, worker_id: int, now: float) -> Started | None:
        """The next prefill of an idle, active worker (None: nothing to run). The lease
        pins the prefix the worker holds now (at most ``max_reuse_blocks``) and
        allocates the slots the new blocks go to."""
        w = self.lattice.workers.get(worker_id)
        if w is None or w.state is not WorkerState.ACTIVE or worker_id in self._running:
            return None
        request_id = self.scheduler.head(worker_id)
        if request_id is None:
            return None
        if self.pulls.must_wait(request_id):
            return None  # its prefix is on its way: ``Actions.woken`` says when
        self.scheduler.start(request_id, now)
        request = self.admission.requests[request_id]
        index = self.indexes[worker_id]
        usable = max_reuse_blocks(request.input_tokens, self.block_tokens)
        lease = index.begin(request.block_ids, usable)
        self.cache.apply_report(index.evictions(lease))
        self.pulls.started(request_id, worker_id, lease)
        cached = lease.num_reused_blocks * self.block_tokens
        if self.config.ideal_reuse:
            # The bound: the longest prefix cached anywhere now arrives free and at
            # once (the lease writes the blocks the worker lacks, as a copy would).
            anywhere = len(self.cache.trie.match(request.block_ids, usable))
            cached = max(cached, anywhere * self.block_tokens)
        exec_s = self.curves[w.cp_degree].time_s(request.input_tokens, cached)
        key = request.block_ids[cached // self.block_tokens - 1] if cached else 0
        self.controller.started(request_id, worker_id, cached, key)
        self._running[worker_id] = Running(
            request_id, lease, index, now, exec_s, w.cp_degree, request.input_tokens
        )
        return Started(request_id, worker_id, w.cp_degree, w.first_device, lease, cached, exec_s)

    def finish(
        self,
        worker_id: int,
        now: float,
        ok: bool = True,
        compute_s: float | None = None,
        hold: bool = False,
    ) -> Finished:
        """The worker's prefill ended. ``ok``: its new blocks are written (they become
        visible); else they are given back, and the request stays open for
        ``replace`` or ``drop``. ``compute_s``: the ranks' own time for it, where the
        driver has it (it calibrates the controller's model; else the time since
        ``start`` does). ``hold``: its KV is handed off, and the prompt's whole blocks
        stay pinned under ``Finished.hold`` until ``release_hold`` (``policy/cache/holds.py``);
        on a worker reset meanwhile (its KV is gone) the prefill counts as failed
        (``Finished.ok`` is False). A participant of a reshape that runs and holds
        nothing parks now, and a reshape whose participants have all parked switches
        (or waits its turn)."""
        run = self._running.pop(worker_id)
        current = self.indexes.get(worker_id) is run.index  # (a reset worker's is gone)
        ok = ok and (current or not hold)
        if ok:
            self.scheduler.pace.ended(run.cp_degree, run.exec_s, now - run.started_s)
            self.controller.prefill_done(
                run.cp_degree, run.input_tokens, run.exec_s, now - run.started_s, compute_s
            )
            arrived = self.admission.arrived_s.get(run.request_id)
            if arrived is not None:
                self.controller.completed(run.request_id, now - arrived)
        if current:
            report = run.index.commit(run.lease) if ok else run.index.abort(run.lease)
            self.cache.apply_report(report)
        kept = None
        if ok and hold:
            blocks = held_blocks(run.lease, run.input_tokens, self.block_tokens)
            ids = self.admission.requests[run.request_id].block_ids
            kept = self.holds.take(run.request_id, worker_id, run.index, ids, blocks)
        self.scheduler.complete(run.request_id)
        if ok:
            self.drop(run.request_id)
        return Finished(run.request_id, self._parked(worker_id, now), ok, kept)

    def release_hold(self, hold: Hold, now: float) -> Actions:
        """The decode side has the KV (or gave up, or its time is up): the pin goes, and
        a draining worker that held nothing else parks (its reshape may switch)."""
        report = self.holds.release(hold, self.indexes.get(hold.worker_id))
        if report is not None:
            self.cache.apply_report(report)
        return self._parked(hold.worker_id, now)

    def _parked(self, worker_id: int, now: float) -> Actions:
        """Park ``worker_id`` if it takes part in a reshape and is idle now."""
        for transition in self.transitions:
            if worker_id in transition.op.sources and self.reconf.idle(transition, worker_id, now):
                self.lanes.queue_switch(transition)
        return self.lanes.pump(now)

    # -- the controller and reshapes -------------------------------------------------

    def end_window(self, now: float, final: bool = False) -> WindowOutcome:
        """The controller's decision, at once (``prepare_window``, its ``evaluate``,
        ``finish_window``)."""
        plan = self.prepare_window(now)
        return self.finish_window(plan, plan.evaluate(), now, final)

    def prepare_window(self, now: float) -> WindowPlan:
        """What the controller needs of the pool now (on the driver's loop)."""
        inputs = PoolInputs.of(self.scheduler, now)
        return WindowPlan(self.controller, self.controller.prepare(inputs))

    def finish_window(
        self, plan: WindowPlan, evaluation: object, now: float, final: bool = False
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
                transition, more = self.begin_reshape(op, now)
                begun.append(transition)
                actions.add(more)
        return WindowOutcome(decision, tuple(begun), actions)

    def begin_reshape(self, op: Reshape, now: float) -> tuple[Transition, Actions]:
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

    def choose_reshape(self, kind: str, workers: Sequence[int] | None, now: float) -> Reshape:
        """An operator's reshape (``transition.operator_reshape``)."""
        busy = {s for t in self.transitions for s in t.op.sources}
        return operator_reshape(self.lattice, kind, workers, busy, self.scheduler.loads(now))

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

    def abort_reshape(self, transition: Transition, now: float) -> Actions:
        """Roll back a reshape that has not committed (the driver's bound on it
        passed): its participants serve again as they were, waiting requests are
        placed (LatticeError once it has committed: finish it instead)."""
        self.reconf.abort(transition)
        self.transitions.remove(transition)
        self.lanes.unqueue_switch(transition)
        actions = Actions(woken=list(transition.op.sources))
        actions.add(self.retry_waiting(now))
        return actions.add(self.lanes.pump(now))

    def _commit(self, transition: Transition, now: float) -> Switch:
        retained = self.ledger.collect(transition.op.sources)
        adopt = self.reconf.switch(transition, now)
        for s in transition.op.sources:
            assert s not in self._running, "a parked worker runs a prefill"
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
        actions = self.lanes.pump(now)
        reclaimed = self.ledger.reclaim(result.reclaims)
        return ScanOutcome(
            result, reclaimed, actions, self.cache.audit.scanned(now, result, reclaimed)
        )

    def queue_copy(self, plan: CopyPlan, now: float) -> Actions:
        """Run a copy plan made outside the scan (an operator's, a test's)."""
        self.lanes.queue_copy(plan)
        return self.lanes.pump(now)

    def copy_done(self, job: CopyJob, ok: bool, now: float) -> Actions:
        """The copy's bytes are in place (``ok``) or the move failed. A pull's blocks
        are pinned for the requests waiting on them before the next copy starts: its
        allocation would otherwise evict them first where the rest is pinned."""
        actions = self.lanes.copy_done(job, ok, job.plan.dest_worker in self.indexes, now)
        self.pulls.ended(job.plan, self.admission.requests)
        return actions.add(self.lanes.pump(now))

    def expire(self, now: float) -> int:
        """Give back the reserved slots whose time is up; returns how many."""
        return self.ledger.expire(now)
