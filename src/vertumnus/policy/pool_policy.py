"""The policy stack of a prefill pool: one object, driven the same way by the
discrete-event simulator and the asyncio coordinator (one implementation, two
drivers: docs/architecture.md, "One policy stack, two drivers").

``PoolPolicy.build(profile, pool, config)`` is the one factory. The stack owns the
lattice, the router (the cost rule or a baseline), the controller, the prefix-cache
manager (trie), one ``WorkerCacheIndex`` per worker, the KV ledger and the
hand-offs' holds, and builds the parts that act on them, each given what it uses:
the open requests (``admission``), the workers' prefills (``prefills``), the
reshapes under way (``reshapes``), rank failures (``outages``), pulls (``pulls``)
and the copy lanes (``lanes``). A driver calls it with the time:

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
refusals, the copies or the switch the copy lanes allow now (``policy/stack/lanes.py``),
workers woken. Pure Python, clock-free. Not owned here: moving bytes, timing,
processes (the drivers).
"""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.perfmodel import Profile
from vertumnus.policy.cache.copy_cost import CopyTimer
from vertumnus.policy.cache.holds import Hold, Holds
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.ledger import CopyJob, KVLedger
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.controllers import build_controller
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState, composition_name
from vertumnus.policy.placement.routers import ROUTERS
from vertumnus.policy.placement.scheduler import PlacementRequest, SchedulerConfig
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec, host_tiers
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
from vertumnus.policy.stack.lanes import CopyLanes
from vertumnus.policy.stack.outages import Outages
from vertumnus.policy.stack.prefills import Prefills
from vertumnus.policy.stack.pulls import Pulls
from vertumnus.policy.stack.reshapes import Reshapes
from vertumnus.policy.transition import Reconfigurer, Transition


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
        self.tiers = host_tiers(profile, pool, config)  # the host tier, if any
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
        if self.tiers.enabled:
            self.scheduler.tiers = self.tiers
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
            lambda transition, now: self.reshapes.commit(transition, now),  # (built below)
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
        self.reshapes = Reshapes(  # from the window's decision to the new epoch
            config,
            self.lattice,
            self.scheduler,
            self.controller,
            self.reconf,
            self.cache,
            self.ledger,
            self.holds,
            self.indexes,
            self.lanes,
            self.running,
            self.add_worker,
            self.place,
            self.retry_waiting,
        )
        self.transitions = self.reshapes.transitions  # under way
        self.prefills = Prefills(  # what the workers run
            self.lattice,
            self.scheduler,
            self.admission,
            self.pulls,
            self.cache,
            self.indexes,
            self.holds,
            self.controller,
            self.curves,
            pool.block_tokens,
            config.ideal_reuse,
            self.reshapes.parked,
            self.tiers,
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
        return self.prefills.running.get(worker_id)

    # -- requests (``policy/stack/admission.py``) ---------------------------------------------

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
            request_id,
            lambda rid: any(run.request_id == rid for run in self.prefills.running.values()),
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
        return self.prefills.finish(worker_id, now, ok, compute_s, hold)

    def release_hold(self, hold: Hold, now: float) -> Actions:
        """The decode side has the KV (or gave up, or its time is up): the pin goes."""
        return self.prefills.release_hold(hold, now)

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
        """Close the controller's period: an adaptive pool's reshapes begin."""
        return self.reshapes.finish_window(plan, evaluation, now, final)

    def begin_reshape(self, op: Reshape, now: float) -> tuple[Transition, Actions]:
        """Start draining ``op``'s workers (LatticeError if it cannot run now)."""
        return self.reshapes.begin(op, now)

    def choose_reshape(self, kind: str, workers: Sequence[int] | None, now: float) -> Reshape:
        """An operator's reshape (``transition.operator_reshape``)."""
        return self.reshapes.choose(kind, workers, now)

    def acknowledge(
        self, transition: Transition, worker_id: int, cp_rank: int, now: float
    ) -> Actions:
        """Rank ``cp_rank`` of new worker ``worker_id`` adopted the epoch."""
        return self.reshapes.acknowledge(transition, worker_id, cp_rank, now)

    def abort_reshape(self, transition: Transition, now: float) -> Actions:
        """Roll back a reshape that has not committed (the driver's bound passed)."""
        return self.reshapes.abort(transition, now)

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
