"""The asyncio coordinator: the pool's policy stack around live rank processes.

The policy is ``PoolPolicy`` (``policy/pool_policy.py``), built by the same factory
and driven the same way as in the simulator; a parity test runs one trace through
both. The coordinator adds asyncio, the ranks and the views, in parts of one job
each:

    request_path.py   an HTTP request's life: placement, the worker tasks, answers
    rank_link.py      the rank pipes: every answer a rank owes and who waits for it
    reshaping.py      a committed switch carried out on the ranks (SwitchEpoch, acks)
    kv_copies.py      the cache manager's scans and copies; a copy job's blocks moved
                      rank to rank (KVTransfer, KVWritten)
    readiness.py      whether the pool can dispatch now, and if not, why (``/ready``)
    handoff.py        KV kept for a decode server under leases, and its pull (KVRead)
    recovery.py       a failed rank: its worker out, restarted, back
    views.py          workers, composition and cache for the REST API

and here: life (start, drain, close; the composition kept in ``[pool] state_file``),
``apply`` (doing what the policy returns: wake workers, refuse requests, run the
copies or the switch the lanes allow), and one timer for the periodic work: the
controller's window, the cache manager's scan and the expiry of reserved KV, in
that order when they fall together (as in the simulator). Time is ``clock``
(``time.monotonic`` unless given; the parity test gives the event loop's own,
simulated, clock, and then deadlines are exact).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from vertumnus.config import ConfigError, resolve_model
from vertumnus.config.start import write_state
from vertumnus.perfmodel import Profile, ProfileError
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.lattice import Lattice, LatticeError, Reshape, WorkerState
from vertumnus.policy.placement.scheduler import Scheduler
from vertumnus.policy.pool_config import PolicyError
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.pool_results import Actions, WindowPlan
from vertumnus.policy.transition import Transition
from vertumnus.runtime import readiness, views
from vertumnus.runtime.handoff import Handoffs
from vertumnus.runtime.kv_copies import CopyRuns, KVCopier
from vertumnus.runtime.metrics import Metrics
from vertumnus.runtime.rank_link import RankLink
from vertumnus.runtime.ranks import ChildRanks, Ranks
from vertumnus.runtime.recovery import Recovery
from vertumnus.runtime.request_path import Overloaded, PrefillResult, RequestPath, Unavailable
from vertumnus.runtime.reshaping import Reshaping
from vertumnus.runtime.serve_config import ServeConfig

log = structlog.get_logger("vertumnus")

__all__ = ["Coordinator", "Overloaded", "PrefillResult", "Unavailable"]


class Coordinator:
    ACTIVE = (WorkerState.ACTIVE,)

    def __init__(
        self,
        cfg: ServeConfig,
        ranks: Ranks | None = None,
        clock: Callable[[], float] = time.monotonic,
        offload_decisions: bool = True,
    ) -> None:
        """``ranks``: the ranks, when they are not this process's children (a
        ``ClusterRanks`` of node agents, already gathered; an in-process fake in
        tests); None: a ``ChildRanks``. ``offload_decisions``: the controller's
        replays run on their own thread (off: inline, as the simulator runs them)."""
        self.cfg = cfg
        self.clock = clock
        self._given_ranks = ranks
        self.model_cfg, self.model_dir = resolve_model(cfg.model)
        try:
            self.profile = Profile.load(cfg.profile)
            self.policy = PoolPolicy.build(self.profile, cfg.pool_spec, cfg.policy)
        except (PolicyError, LatticeError, ProfileError) as exc:
            raise ConfigError(f"{exc}") from exc
        period_s = cfg.policy.controller.period_s
        self.metrics = Metrics(cfg.timeline_s, cfg.timeline_samples, clock(), period_s)
        self.ranks: Ranks | None = None
        self.copier = KVCopier(lambda: self.ranks, cfg.engine.rank_timeout_s, self._copy_hung)
        self.copies = CopyRuns(self.policy, self.copier, self.metrics, clock, self.apply)
        self.handoffs = Handoffs(
            cfg, self.model_cfg, self.policy, self.metrics, clock, self.apply, lambda: self.ranks
        )
        self.link = RankLink(
            self.copier, self._rank_exited, self._rank_pool_failed, self.handoffs.reads
        )
        self.requests = RequestPath(self)
        self.recovery = Recovery(self)
        self.reshaping = Reshaping(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self._tick: asyncio.TimerHandle | None = None
        self._next_window = self._next_scan = math.inf
        self._windows_started_s: float | None = None
        self.offload_decisions = offload_decisions
        self._decider = ThreadPoolExecutor(1, thread_name_prefix="vertumnus-decide")
        self._deciding = False
        self.decision_s: list[float] = []  # wall time of recent decisions' replays
        self.decisions: deque[dict[str, Any]] = deque(maxlen=100)  # recent, as JSON
        self.ready = False
        self.started_s = time.monotonic()
        self.rank_error: str | None = None

    # -- what tests and the views read ---------------------------------------------------

    @property
    def lattice(self) -> Lattice:
        return self.policy.lattice

    @property
    def cache(self) -> PrefixCacheManager:
        return self.policy.cache

    @property
    def scheduler(self) -> Scheduler:
        return self.policy.scheduler

    @property
    def indexes(self) -> dict[int, WorkerCacheIndex]:
        return self.policy.indexes

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def open_requests(self) -> int:
        """Accepted and not yet answered."""
        return len(self.requests.open)

    # -- life ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        if self.cfg.start is not None:  # [pool] composition = "auto" (config/start.py)
            for why in self.cfg.start.warnings:
                log.warning("start_source_skipped", reason=why)
            log.info("start_chosen", **self.cfg.start.to_json())
        ranks: Ranks = self._given_ranks or ChildRanks(
            self.model_cfg, self.model_dir, self.cfg.engine, self.cfg.ranks, self.cfg.degrees
        )
        await loop.run_in_executor(None, ranks.start)
        self.ranks = ranks

        def rejoin(back: list[int]) -> None:  # a host's agent came back (another thread)
            loop.call_soon_threadsafe(self.recovery.hosts_back, back)

        ranks.on_rejoin = rejoin
        for w in self.policy.lattice.workers.values():
            self.requests.add_worker(w.worker_id)
        # The event loop itself watches the ranks' answer pipes and their process
        # sentinels: no thread between a rank's answer and the request it finishes.
        self.link.attach(loop, ranks)
        self.link.watch(range(self.cfg.ranks))
        self._start_ticks()
        self.ready = True
        log.info("ready", ranks=self.cfg.ranks, composition=self.composition_name())

    def stop_admission(self) -> None:
        """New requests get a 503 (``Unavailable``); what was accepted goes on."""
        self.ready = False
        self.rank_error = self.rank_error or "the server is shutting down"

    async def drain(self, grace_s: float) -> int:
        """Wait until every accepted request is answered, or ``grace_s`` passes;
        returns how many were still open."""
        deadline = time.monotonic() + grace_s
        while self.requests.open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return len(self.requests.open)

    async def close(self) -> None:
        """Stop admission, fail what still waits (a clear 503), stop the ranks."""
        self.ready = False
        self._stopping.set()
        if self._tick is not None:
            self._tick.cancel()
        self.requests.cancel_all()
        self.requests.fail_all(Unavailable("the server is shutting down"))
        self.handoffs.close()
        self.reshaping.close()
        self.save_composition()
        self.link.unwatch()
        self._decider.shutdown(wait=False, cancel_futures=True)
        if self.ranks is not None:
            assert self._loop is not None
            await self._loop.run_in_executor(None, self.ranks.close)
            self.ranks = None

    def save_composition(self) -> None:
        """The composition the pool has, into ``[pool] state_file`` (if one is
        configured) for the next start: on every completed reshape and at shutdown."""
        path = self.cfg.pool.start.state_file
        if path is not None:
            try:
                write_state(path, self.lattice.config, self.lattice.layout())
            except OSError as exc:
                log.warning("state_file_not_written", path=path, error=str(exc))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """A background task, kept referenced until it ends; one that fails (a bug)
        is logged with its traceback and counted, never lost in silence."""
        task = asyncio.create_task(coro, name=getattr(coro, "__qualname__", None))
        self._background.add(task)
        task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self.metrics.bug("task", "task_failed", exc, task=task.get_name())

    def unready_reason(self) -> str | None:
        """Why the pool cannot dispatch a request now (None: it can): ``/ready``."""
        return readiness.unready_reason(
            self.ready,
            self.rank_error,
            self.stopping,
            self.policy,
            self.reshaping.overdue,
            self.cfg.reshape_timeout_s,
        )

    # -- doing what the policy returns ----------------------------------------------------

    def apply(self, actions: Actions) -> None:
        if self.stopping:
            return  # (what the stack asks for now would only outlive the ranks)
        for placement in actions.placed:
            self.requests.wake(placement.worker_id)
        for worker_id in actions.woken:
            self.requests.wake(worker_id)
        for request_id in actions.refused:
            self.requests.refuse(request_id, Unavailable("no worker can take the request now"))
        self.copies.ended(actions.copies_ended)
        for transition in actions.activated:
            self.reshaping.activated(transition)
        if actions.switch is not None:
            transition = actions.switch.transition
            for s in transition.op.sources:
                self.requests.remove_worker(s)
            for w in transition.new_workers:
                self.requests.add_worker(w)
            self.spawn(self.reshaping.run_switch(actions.switch))
        for job in actions.copies:
            self.spawn(self.copies.run(job))

    # -- the periodic work ------------------------------------------------------------------

    def _start_ticks(self) -> None:
        now = self.clock()
        self._windows_started_s = now
        self._next_window = now + self.cfg.policy.controller.period_s
        if self.cfg.policy.replication:
            self._next_scan = now + self.cfg.policy.scan_interval_s
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        loop = self._loop
        assert loop is not None
        expiry = self.policy.ledger.next_deadline()
        due = min(self._next_window, self._next_scan, math.inf if expiry is None else expiry)
        if self._tick is not None:
            self._tick.cancel()
        own_clock: object = getattr(self.clock, "__self__", None)
        if own_clock is loop:  # the loop's own clock (a simulated one): exact deadlines
            self._tick = loop.call_at(due, self._on_tick)
        else:
            self._tick = loop.call_later(max(0.0, due - self.clock()), self._on_tick)

    def _on_tick(self) -> None:
        """The periodic work that is due; the next tick is set whatever happens (a
        bug in one piece is logged with its traceback and counted)."""
        self._tick = None
        now = self.clock()
        try:
            if now >= self._next_window:
                self._next_window += self.cfg.policy.controller.period_s
                self._end_window(now)
            if now >= self._next_scan:
                self._next_scan += self.cfg.policy.scan_interval_s
                # After the workers this tick's decision woke have started their
                # prefills (their tasks run first), as the simulator orders it.
                assert self._loop is not None
                self._loop.call_soon(self._scan, now)
            expiry = self.policy.ledger.next_deadline()
            if expiry is not None and now >= expiry:
                released = self.policy.expire(now)
                if released:
                    log.info("retained_released", blocks=released)
        except Exception as exc:
            self.metrics.bug("task", "tick_failed", exc)
        finally:
            if not self.stopping:
                self._schedule_tick()

    def _scan(self, now: float) -> None:
        try:
            self.copies.scan(now)
        except Exception as exc:
            self.metrics.bug("task", "scan_failed", exc)

    def _end_window(self, now: float) -> None:
        """The controller's decision: the pool is read now, the replays run on the
        decision thread (off the event loop) unless ``offload_decisions`` is off, and
        the decision is applied when they are done. A period whose decision is still
        being computed when the next is due is skipped."""
        if self._deciding:
            log.warning("decision_skipped", reason="the previous decision is still computing")
            return
        plan = self.policy.prepare_window(now)
        if not self.offload_decisions:
            self._conclude(plan, plan.evaluate(), now)
            return
        self._deciding = True
        self.spawn(self._decide(plan))

    async def _decide(self, plan: WindowPlan) -> None:
        assert self._loop is not None
        try:
            started = time.perf_counter()
            evaluation = await self._loop.run_in_executor(self._decider, plan.evaluate)
            self.decision_s.append(time.perf_counter() - started)
            del self.decision_s[:-1000]
            if not self.stopping:
                self._conclude(plan, evaluation, self.clock())
        finally:
            self._deciding = False

    def _conclude(self, plan: WindowPlan, evaluation: object, now: float) -> None:
        outcome = self.policy.finish_window(plan, evaluation, now)
        decision = outcome.decision
        since = now - (self._windows_started_s or now)  # seconds since the server started
        self.decisions.append({"time_s": since, **decision.to_json()})
        del self.policy.controller.history[:-1000]  # a server runs for days
        if self.cfg.policy.adaptive and (decision.ops or "candidates" in decision.inputs):
            log.info("decision", **decision.to_json())
        self.metrics.timeline.decided(now, decision.inputs)
        for transition in outcome.begun:
            self.reshaping.begun(transition, decision.to_json(), len(outcome.actions.placed))
        self.apply(outcome.actions)

    # -- the prefix-cache manager: scans and copies (``runtime/kv_copies.py``) ----------

    async def scan_now(self) -> dict[str, Any]:
        """One scan now, waiting for its copies: what it did."""
        return await self.copies.scan_now()

    async def run_copy(self, plan: CopyPlan) -> int:
        """Run a copy plan made outside a scan; the blocks installed."""
        return await self.copies.run_plan(plan)

    # -- ranks ------------------------------------------------------------------------

    def _copy_hung(self, ranks: list[int]) -> None:
        """A KV copy timed out: a rank hung, and the pair groups may be out of step;
        the copy's workers restart (their ranks get new pairs)."""
        for r in ranks:
            self.recovery.rank_down(r, "a KV copy timed out", whole_worker=True)

    def _rank_exited(self, rank: int) -> None:
        if not self.stopping:
            self.recovery.rank_down(rank, f"rank process {rank} exited unexpectedly")

    def _rank_pool_failed(self, error: str) -> None:
        self.rank_error = error
        self.ready = False
        log.error("rank_failure", error=error)
        self.link.fail_all(error)

    # -- the API's entry points -------------------------------------------------------

    async def prefill(self, tokens: Sequence[int], handoff: bool = False) -> PrefillResult:
        return await self.requests.prefill(tokens, handoff)

    def begin_reshape(self, op: Reshape) -> asyncio.Future[Transition]:
        return self.reshaping.begin(op)

    def reshape_for(self, op_name: str, workers: Sequence[int] | None) -> Reshape:
        return self.reshaping.choose(op_name, workers)

    def composition_name(self) -> str:
        return self.policy.composition_name(self.ACTIVE)

    def workers_view(self) -> list[dict[str, Any]]:
        return views.workers_view(self.policy, self.ranks, self.clock(), self.recovery.recovering)

    def composition_view(self) -> dict[str, Any]:
        return views.composition_view(
            self.policy, self.composition_name(), self.cfg, self.decisions
        )

    def cache_view(self) -> dict[str, Any]:
        return views.cache_view(self.policy, self.metrics)

    def uptime_s(self) -> float:
        return time.monotonic() - self.started_s

    def window_phase_s(self) -> float | None:
        """How far into its current window the controller is."""
        if self._windows_started_s is None:
            return None
        return (self.clock() - self._windows_started_s) % self.cfg.policy.controller.period_s
