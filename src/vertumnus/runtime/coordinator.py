"""The asyncio coordinator: the serving system's one brain.

Owns, in one process and one event loop: the lattice, the scheduler, the
prefix-cache manager (trie), the window controller and the reshape transitions
(all from ``policy/``, the same objects the simulator drives), one
``WorkerCacheIndex`` per worker, and the ``RankPool`` of rank processes.

    HTTP handler --prefill()--> place (reserve E_iw) --wake--> worker task
    worker task: head of its queue -> plan (lease slots) -> PrefillCommand to each
                 rank -> await every PrefillDone (the loop watches the ranks' answer
                 pipes and process sentinels) -> commit -> cache report into the
                 trie -> release -> answer -> next
    window task: every H seconds the controller decides; a reshape drains its
                 workers (queued requests re-placed; the running prefill finishes),
                 then switches: a new epoch, SwitchEpoch to every rank of the new
                 workers, which become schedulable when every rank acknowledges

    scan task:   every ``scan_interval_s`` the cache manager's scan; its copies run one
                 at a time (``KVCopier``: one KVTransfer to every rank of the
                 source and the destination; the blocks go rank to rank,
                 re-sharded block by block), reclamations at once

After a reshape, the blocks the old workers left where the new geometry wants them
are adopted into the new workers' indexes at their slots (no data moves); the other
retained blocks keep their slots, reserved for ``retain_s``, and a pending prefix is
fetched from them (or from a live holder) on first reuse. The bookkeeping of both,
and of every copy, is ``policy/kv_ledger.py``'s, shared with the simulator.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from vertumnus.blocks import block_ids
from vertumnus.config import ConfigError, resolve_model
from vertumnus.engine.messages import (
    EpochAck,
    GroupsReady,
    KVWritten,
    PrefillDone,
    RankFailed,
    RankReady,
    RebuildGroups,
    SwitchEpoch,
)
from vertumnus.perfmodel import Profile
from vertumnus.policy.baselines import ROUTERS
from vertumnus.policy.cache_index import PrefillLease, WorkerCacheIndex
from vertumnus.policy.cache_manager import PrefixCacheManager
from vertumnus.policy.cache_plans import CopyPlan
from vertumnus.policy.controller import Controller
from vertumnus.policy.kv_ledger import KVLedger
from vertumnus.policy.lattice import (
    Lattice,
    LatticeConfig,
    LatticeError,
    LatticeWorker,
    Reshape,
    WorkerState,
)
from vertumnus.policy.scheduler import PlacementRequest, Scheduler, SchedulerConfig
from vertumnus.policy.transition import Phase, Reconfigurer, Transition
from vertumnus.runtime.kv_copies import KVCopier
from vertumnus.runtime.metrics import Metrics
from vertumnus.runtime.pool import RankPool, RankPoolError, Ranks
from vertumnus.runtime.rank_watch import RankWatch
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.runtime.worker import plan_prefill

log = structlog.get_logger("vertumnus")


class Overloaded(RuntimeError):
    """Admission refused: too much work queued (retry later)."""


class Unavailable(RuntimeError):
    """No worker can serve the request now (retry later)."""


class WorkerLost(RuntimeError):
    """The worker running a prefill failed (a rank died or hung); the request is
    placed again."""


MAX_ATTEMPTS = 3  # placements of one request before a failure is the client's answer


@dataclass
class PrefillResult:
    request_id: int
    first_token: int
    cached_tokens: int
    computed_tokens: int
    worker: int
    cp_degree: int
    queue_s: float
    prefill_s: float
    ttft_s: float
    rank_compute_s: float  # the slowest rank's compute; the rest of ttft_s is overhead
    logits: Any = None  # fp32 [V] at the last position (not sent over the API)


@dataclass
class _Request:
    request_id: int
    tokens: list[int]
    block_ids: tuple[int, ...]
    arrival_s: float
    future: asyncio.Future[PrefillResult]
    worker: int | None = None
    start_s: float | None = None
    attempts: int = 0


@dataclass
class _InFlight:
    ranks: tuple[int, ...]
    done: dict[int, PrefillDone] = field(default_factory=dict)
    future: asyncio.Future[dict[int, PrefillDone]] | None = None


class Coordinator:
    def __init__(self, cfg: ServeConfig, pool: Ranks | None = None) -> None:
        """``pool``: the ranks, when they are not this process's children (a
        ``ClusterPool`` of node agents, already gathered); None: a ``RankPool``."""
        self.cfg = cfg
        self._given_pool = pool
        self.model_cfg, self.model_dir = resolve_model(cfg.model)
        self.profile = Profile.load(cfg.profile)
        missing = sorted(set(cfg.degrees) - set(self.profile.degrees))
        if missing:
            raise ConfigError(
                f"profile {cfg.profile} has no degrees {missing}: profile them "
                "(`python -m vertumnus profile`) or change [pool] degrees"
            )
        coeffs = {c: self.profile.coeffs[c] for c in cfg.degrees}
        assert cfg.layout is not None
        try:
            lattice_cfg = LatticeConfig(
                cfg.ranks, cfg.degrees, devices_per_host=cfg.devices_per_host
            )
            self.lattice = Lattice(lattice_cfg, cfg.layout)
        except LatticeError as exc:
            raise ConfigError(f"[pool] {exc}") from exc
        block = cfg.engine.block_size
        self.cache = PrefixCacheManager(coeffs, block, cfg.cache)
        router = ROUTERS.get(cfg.policy, Scheduler)
        self.scheduler = router(self.lattice, coeffs, SchedulerConfig(cfg.weights), self.cache)
        kappa = {c: float(self.profile.capacity.get(c, {}).get("kappa_s", 1.0)) for c in coeffs}
        self.controller = Controller(cfg.controller, self.lattice, kappa)
        self.reconf = Reconfigurer(
            self.lattice, self.scheduler, self.cache, self.controller, cfg.engine.kv_blocks_per_rank
        )
        self.metrics = Metrics()
        self.pool: Ranks | None = None  # a RankPool, or a ClusterPool of node agents
        self.indexes: dict[int, WorkerCacheIndex] = {}
        self._requests: dict[int, _Request] = {}
        self._waiting: list[_Request] = []  # no candidate while every worker reshapes
        self._inflight: dict[int, _InFlight] = {}
        self._acks: dict[tuple[int, int], asyncio.Future[None]] = {}
        self._wake: dict[int, asyncio.Event] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._transitions: dict[int, tuple[Transition, asyncio.Future[Transition]]] = {}
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._window_task: asyncio.Task[None] | None = None
        self._scan_task: asyncio.Task[None] | None = None
        self._watcher: RankWatch | None = None  # the ranks' pipes, from the event loop
        # Copy and adopt plans as slot moves; KV a reshape left behind (policy/).
        self.ledger = KVLedger(
            self.lattice, self.indexes, self.cache, cfg.engine.kv_blocks_per_rank, cfg.retention
        )
        self.copies = KVCopier(
            self.ledger, self.metrics, lambda: self.pool, cfg.engine.rank_timeout_s, self._copy_hung
        )
        self._background: set[asyncio.Task[None]] = set()
        self.ready = False
        self.started_s = time.monotonic()
        self._windows_started_s: float | None = None
        self.rank_error: str | None = None
        # Rank failures: workers being restarted, and what their recovery waits for.
        self._recovering: set[int] = set()  # workers being restarted
        self._dead_ranks: set[int] = set()  # failed ranks, until their worker rejoins
        self._recovery_lock = asyncio.Lock()
        self._ready_waits: dict[int, asyncio.Future[None]] = {}  # rank -> RankReady
        self._group_waits: dict[tuple[int, int], asyncio.Future[None]] = {}  # (rank, token)
        self._tokens = itertools.count(1)

    # -- life ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        pool: Ranks = self._given_pool or RankPool(
            self.model_cfg, self.model_dir, self.cfg.engine, self.cfg.ranks, self.cfg.degrees
        )
        await self._loop.run_in_executor(None, pool.start)
        self.pool = pool
        loop = self._loop

        def rejoin(ranks: list[int]) -> None:  # a host's agent came back (another thread)
            loop.call_soon_threadsafe(self._hosts_back, ranks)

        pool.on_rejoin = rejoin
        for w in self.lattice.workers.values():
            self._add_worker(w.worker_id)
        # The event loop itself watches the ranks' answer pipes and their process
        # sentinels: no thread between a rank's answer and the request it finishes.
        self._watcher = RankWatch(self._loop, self._on_message, self._rank_exited)
        self._watch(range(self.cfg.ranks))
        if self.cfg.controller_enabled:
            self._windows_started_s = time.monotonic()
            self._window_task = asyncio.create_task(self._windows())
        if self.cfg.scan_interval_s > 0:
            self._scan_task = asyncio.create_task(self._scans())
        self.ready = True
        log.info("ready", ranks=self.cfg.ranks, composition=self.composition_name())

    @property
    def open_requests(self) -> int:
        """Accepted and not yet answered."""
        return len(self._requests)

    def stop_admission(self) -> None:
        """New requests get a 503 (``Unavailable``); what was accepted goes on."""
        self.ready = False
        self.rank_error = self.rank_error or "the server is shutting down"

    async def drain(self, grace_s: float) -> int:
        """Wait until every accepted request is answered, or ``grace_s`` passes;
        returns how many were still open."""
        deadline = time.monotonic() + grace_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return len(self._requests)

    async def close(self) -> None:
        """Stop admission, fail what still waits (a clear 503), stop the ranks."""
        self.ready = False
        self._stopping.set()
        for periodic in (self._window_task, self._scan_task):
            if periodic is not None:
                periodic.cancel()
        for task in self._tasks.values():
            task.cancel()
        for req in self._requests.values():
            if not req.future.done():
                req.future.set_exception(Unavailable("the server is shutting down"))
        self._unwatch()
        if self.pool is not None:
            assert self._loop is not None
            await self._loop.run_in_executor(None, self.pool.close)
            self.pool = None

    def _spawn(self, coro: Any) -> None:
        """A background task, kept referenced until it ends."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _add_worker(self, worker_id: int) -> None:
        w = self.lattice.workers[worker_id]
        self.indexes[worker_id] = WorkerCacheIndex(
            w.cp_degree, self.cfg.engine.kv_blocks_per_rank, worker_id
        )
        if worker_id not in self.cache.trie.workers:
            self.cache.add_worker(worker_id, w.cp_degree, w.first_device)
        self._wake[worker_id] = asyncio.Event()
        self._tasks[worker_id] = asyncio.create_task(self._worker_loop(worker_id))

    def _watch(self, ranks: Sequence[int]) -> None:
        assert self.pool is not None and self._watcher is not None
        wanted = set(ranks)
        self._watcher.watch(c for c in self.pool.channels() if c[0] in wanted)

    def _unwatch(self, ranks: Sequence[int] | None = None) -> None:
        if self.pool is None or self._watcher is None:
            return
        channels = self.pool.channels()
        self._watcher.unwatch(c for c in channels if ranks is None or c[0] in ranks)

    def _rank_exited(self, rank: int) -> None:
        if not self._stopping.is_set():
            self.rank_down(rank, f"rank process {rank} exited unexpectedly")

    def _on_message(self, msg: object) -> None:
        match msg:
            case PrefillDone():
                inflight = self._inflight.get(msg.request_id)
                if inflight is None or inflight.future is None or msg.rank not in inflight.ranks:
                    return  # late, from a worker the request has left
                inflight.done[msg.rank] = msg
                if len(inflight.done) == len(inflight.ranks) and not inflight.future.done():
                    inflight.future.set_result(inflight.done)
            case KVWritten():
                self.copies.answer(msg)
            case RankFailed() if msg.copy_id is not None:
                self.copies.answer(msg)
            case RankFailed() if msg.request_id is None and (
                msg.rank in self._ready_waits or any(r == msg.rank for r, _ in self._group_waits)
            ):  # a restarted rank that could not start, or a peer that could not regroup
                error = RankPoolError(f"rank {msg.rank}: {msg.error}")
                for key, wait in [(k, w) for k, w in self._group_waits.items() if k[0] == msg.rank]:
                    if not wait.done():
                        wait.set_exception(error)
                    self._group_waits.pop(key, None)
                ready = self._ready_waits.pop(msg.rank, None)
                if ready is not None and not ready.done():
                    ready.set_exception(error)
            case RankFailed():
                inflight = self._inflight.get(msg.request_id) if msg.request_id else None
                if inflight is not None and inflight.future is not None:
                    if not inflight.future.done():
                        inflight.future.set_exception(RankPoolError(msg.error))
                else:
                    self._rank_pool_failed(f"rank {msg.rank}: {msg.error}")
            case RankReady():
                ready = self._ready_waits.pop(msg.rank, None)
                if ready is not None and not ready.done():
                    ready.set_result(None)
            case GroupsReady():
                grouped = self._group_waits.pop((msg.rank, msg.token), None)
                if grouped is not None and not grouped.done():
                    grouped.set_result(None)
            case EpochAck():
                ack = self._acks.pop((msg.rank, msg.epoch), None)
                if ack is not None and not ack.done():
                    ack.set_result(None)

    def _rank_pool_failed(self, error: str) -> None:
        self.rank_error = error
        self.ready = False
        log.error("rank_failure", error=error)
        for pending in (*self._inflight.values(),):
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(RankPoolError(error))
        for wait in self._acks.values():
            if not wait.done():
                wait.set_exception(RankPoolError(error))
        self.copies.fail(error)

    # -- requests --------------------------------------------------------------------

    async def prefill(self, tokens: Sequence[int]) -> PrefillResult:
        if not self.ready:
            raise Unavailable(self.rank_error or "the server is not ready")
        if len(self._requests) >= self.cfg.max_queued:
            raise Overloaded(f"{len(self._requests)} requests in the pool")
        assert self._loop is not None
        rid = next(self._ids)
        req = _Request(
            rid,
            list(tokens),
            tuple(block_ids(tokens, self.cfg.engine.block_size)),
            time.monotonic(),
            self._loop.create_future(),
        )
        self._requests[rid] = req
        try:
            self._place(req)
            return await asyncio.wait_for(asyncio.shield(req.future), self.cfg.request_timeout_s)
        finally:
            self._requests.pop(rid, None)

    def _place(self, req: _Request) -> None:
        now = time.monotonic()
        placed = self.scheduler.place(
            PlacementRequest(req.request_id, len(req.tokens), req.block_ids), now
        )
        if placed is None:
            reshaping = self._dead_ranks or any(
                w.state in (WorkerState.DRAINING, WorkerState.SWITCHING)
                for w in self.lattice.workers.values()
            )
            if not reshaping:
                raise Unavailable("no worker can take the request now")
            # Every worker is in a reshape or restarting: wait for it (bounded by the
            # request's time-out) instead of refusing.
            self._waiting.append(req)
            return
        req.worker = placed.worker_id
        req.attempts += 1
        if placed.update is not None and placed.update.fetch is not None:
            self._spawn(self.run_copy(placed.update.fetch))
        if self.cfg.controller_enabled:
            self.controller.record(placed.exec_s, len(req.tokens))
        self._wake[placed.worker_id].set()

    async def _worker_loop(self, worker_id: int) -> None:
        wake = self._wake[worker_id]
        try:
            while True:
                await wake.wait()
                wake.clear()
                while worker_id in self.lattice.workers and self.scheduler.queued(worker_id):
                    rid = self.scheduler.queued(worker_id)[0]
                    await self._run_one(worker_id, rid)
                if worker_id not in self.lattice.workers:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: say so loudly, the worker is lost
            log.exception("worker_loop_crashed", worker=worker_id, error=repr(exc))
            raise

    async def _run_one(self, worker_id: int, rid: int) -> None:
        assert self.pool is not None and self._loop is not None
        req = self._requests.get(rid)
        now = time.monotonic()
        self.scheduler.start(rid, now)
        if req is None:  # timed out and gone
            self.scheduler.complete(rid)
            self._after_prefill(worker_id)
            return
        w = self.lattice.workers[worker_id]
        ranks = tuple(w.devices)
        index = self.indexes[worker_id]
        lease: PrefillLease | None = None
        try:
            lease, cmd = plan_prefill(
                index, req.tokens, self.cfg.engine.block_size, rid, ranks, ids=req.block_ids
            )
            inflight = _InFlight(ranks, future=self._loop.create_future())
            self._inflight[rid] = inflight
            req.start_s = now
            for r in ranks:
                self.pool.send(r, cmd)
            assert inflight.future is not None
            try:
                done = await asyncio.wait_for(
                    asyncio.shield(inflight.future), self.cfg.step_timeout_s
                )
            except TimeoutError:
                # A hung rank: take the worker down (its ranks are killed and
                # restarted) and place the request again.
                self.rank_down(
                    ranks[0],
                    f"no answer within step_timeout_s = {self.cfg.step_timeout_s} s",
                    whole_worker=True,
                )
                raise WorkerLost(f"worker {worker_id} timed out") from None
        except Exception as exc:
            if lease is not None and self.indexes.get(worker_id) is index:
                self.cache.apply_report(index.abort(lease))  # (a failed worker's is gone)
            if self.scheduler.running(worker_id) == rid:
                self.scheduler.complete(rid)
            self._inflight.pop(rid, None)
            if isinstance(exc, RankPoolError):  # the worker's group is out of step now
                self.rank_down(ranks[0], f"prefill failed: {exc}", whole_worker=True)
            lost = isinstance(exc, WorkerLost | RankPoolError) or worker_id in self._recovering
            if lost and req.attempts < MAX_ATTEMPTS and not req.future.done():
                log.warning("replaced", request_id=rid, worker=worker_id, error=str(exc))
                self._replace(req)
            elif not req.future.done():
                req.future.set_exception(Unavailable(f"worker {worker_id} failed: {exc}"))
            self._after_prefill(worker_id)
            return
        self._inflight.pop(rid, None)
        end = time.monotonic()
        if self.indexes.get(worker_id) is index:
            self.cache.apply_report(index.commit(lease))
        self.scheduler.complete(rid)
        logits = done[ranks[0]].logits
        assert logits is not None
        result = PrefillResult(
            request_id=rid,
            first_token=int(logits[-1].argmax()),
            cached_tokens=cmd.prefix_len,
            computed_tokens=int(cmd.token_ids.numel()),
            worker=worker_id,
            cp_degree=len(ranks),
            queue_s=now - req.arrival_s,
            prefill_s=end - now,
            ttft_s=end - req.arrival_s,
            rank_compute_s=max(d.compute_s for d in done.values()),
            logits=logits[-1],
        )
        self.metrics.request(result)
        log.info(
            "prefill",
            request_id=rid,
            worker=worker_id,
            cp_degree=len(ranks),
            input_tokens=len(req.tokens),
            cached_tokens=result.cached_tokens,
            queue_s=round(result.queue_s, 6),
            prefill_s=round(result.prefill_s, 6),
            ttft_s=round(result.ttft_s, 6),
        )
        if not req.future.done():
            req.future.set_result(result)
        self._after_prefill(worker_id)

    def _replace(self, req: _Request) -> None:
        """Place a request again (its worker failed); a clear 503 if none can take it."""
        try:
            self._place(req)
        except Unavailable as exc:
            if not req.future.done():
                req.future.set_exception(exc)

    # -- rank failures -----------------------------------------------------------------

    def rank_down(self, rank: int, reason: str, whole_worker: bool = False) -> None:
        """Rank ``rank`` died, hung or failed a prefill (``whole_worker``: every rank of
        its worker is suspect). The rank is killed if it still runs, and everything
        that waits on it fails or, for a reshape's acknowledgement, is skipped; its
        worker leaves the candidate set and is restarted in the background (see
        ``_recover``), after any reshape it takes part in has finished."""
        if self._stopping.is_set() or self.pool is None:
            return
        worker = self._worker_of_rank(rank)
        if worker is None:
            return
        suspects = set(worker.devices) if whole_worker else {rank}
        fresh = suspects - self._dead_ranks
        if not fresh:
            return
        first_failure = not (set(worker.devices) & self._dead_ranks)
        self._mark_dead(fresh, WorkerLost(f"worker {worker.worker_id} failed: {reason}"))
        if worker.state is WorkerState.ACTIVE:
            self.lattice.fail(worker.worker_id)
        log.error("worker_failed", worker=worker.worker_id, ranks=sorted(fresh), reason=reason)
        if first_failure:
            self._spawn(self._recover(rank, reason))

    def _hosts_back(self, ranks: Sequence[int]) -> None:
        """The agent of ``ranks`` is back: restart the failed workers among them now
        (not at their next retry)."""
        back = set(ranks)
        for w in list(self.lattice.workers.values()):
            if back & set(w.devices) and (
                set(w.devices) & self._dead_ranks or w.state is WorkerState.UNAVAILABLE
            ):
                self._spawn(self._recover(w.devices[0], "its host is back"))

    def _worker_of_rank(self, rank: int) -> LatticeWorker | None:
        return next((w for w in self.lattice.workers.values() if rank in w.devices), None)

    def _mark_dead(self, ranks: set[int], lost: WorkerLost) -> None:
        """Kill ``ranks`` (a hung rank is dead from now on) and release what waits on
        them: their prefills and KV copies fail; a reshape's acknowledgement is
        skipped (the switch goes on, and the worker restarts after it)."""
        assert self.pool is not None
        self._dead_ranks |= ranks
        for r in ranks:
            self.pool.kill(r)
        for inflight in self._inflight.values():
            future = inflight.future
            if set(inflight.ranks) & ranks and future is not None and not future.done():
                future.set_exception(lost)
        self.copies.fail(str(lost), ranks)
        for (r, _), ack in list(self._acks.items()):
            if r in ranks and not ack.done():
                ack.set_result(None)

    def _in_reshape(self, rank: int) -> bool:
        for transition, _ in self._transitions.values():
            for w in (*transition.op.sources, *transition.new_workers):
                lw = self.lattice.workers.get(w)
                if lw is not None and rank in lw.devices:
                    return True
        return False

    async def _recover(self, rank: int, reason: str, attempt: int = 1) -> None:
        """Take the failed worker of ``rank`` out, hand its work on, restart its ranks
        and let it rejoin with an empty cache. Requests it held are placed again (or
        wait, when no other worker can take them, until it is back). A reshape that
        involves the rank finishes first: its drain ends when the failed prefill
        does, and the dead rank's acknowledgement is skipped.

        A restart that fails (the new processes cannot start, or their groups cannot
        form) is tried again after 2, 4, 8, ... s, up to ``[server]
        max_restart_attempts``; meanwhile the worker stays out, and the failed
        processes are not watched (no crash loop)."""
        assert self.pool is not None and self._loop is not None
        started = time.monotonic()
        worker_id: int | None = None
        ranks: tuple[int, ...] = (rank,)
        retrying = False
        try:
            async with self._recovery_lock:
                deadline = time.monotonic() + self.cfg.engine.rank_timeout_s
                while self._in_reshape(rank) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                w = self._worker_of_rank(rank)
                assert w is not None
                if not set(w.devices) & self._dead_ranks and w.state is not WorkerState.UNAVAILABLE:
                    return  # recovered already (a retry after its host came back)
                worker_id, ranks = w.worker_id, tuple(w.devices)
                self._recovering.add(worker_id)
                if w.state is not WorkerState.UNAVAILABLE:
                    self.lattice.fail(worker_id)  # (a worker a failed reshape left behind too)
                # The whole worker restarts: its other ranks too.
                self._mark_dead(set(ranks), WorkerLost(f"worker {worker_id} failed: {reason}"))
                for preq in self.scheduler.drain(worker_id):
                    req = self._requests.get(preq.request_id)
                    if req is not None and not req.future.done():
                        self._replace(req)
                # The trie forgets what it held; its cache is gone with its ranks.
                if worker_id in self.cache.trie.workers:  # (not on a retry)
                    self.cache.remove_worker(worker_id)
                self.ledger.drop_ranks(ranks)
                self.indexes.pop(worker_id, None)
                self._unwatch(ranks)
                rebuild = await self._loop.run_in_executor(None, self.pool.restart, ranks)
                token = next(self._tokens)
                waits: list[asyncio.Future[None]] = []
                for r in ranks:
                    self._ready_waits[r] = self._loop.create_future()
                    waits.append(self._ready_waits[r])
                self._watch(ranks)
                live = sorted({r for group, _ in rebuild for r in group} - set(ranks))
                for r in live:
                    mine = tuple((g, gen) for g, gen in rebuild if r in g)
                    self._group_waits[(r, token)] = self._loop.create_future()
                    waits.append(self._group_waits[(r, token)])
                    self.pool.send(r, RebuildGroups(token, mine))
                await asyncio.wait_for(asyncio.gather(*waits), self.cfg.engine.rank_timeout_s)
                self.indexes[worker_id] = WorkerCacheIndex(
                    w.cp_degree, self.cfg.engine.kv_blocks_per_rank, worker_id
                )
                self.cache.add_worker(worker_id, w.cp_degree, w.first_device)
                self.lattice.restore(worker_id)
                if self.rank_error and self.rank_error.startswith(f"worker {worker_id} could not"):
                    self.rank_error = None  # (it gave up before its host came back)
                self.metrics.restarted()
                log.info(
                    "worker_rejoined",
                    worker=worker_id,
                    ranks=list(ranks),
                    attempt=attempt,
                    seconds=round(time.monotonic() - started, 3),
                )
        except Exception as exc:
            self._unwatch(ranks)  # the processes that failed to start: no crash loop
            retrying = attempt < self.cfg.max_restart_attempts and not self._stopping.is_set()
            delay = min(30.0, 2.0**attempt)
            log.error(
                "worker_restart_failed",
                worker=worker_id,
                attempt=attempt,
                error=repr(exc),
                retry_in_s=delay if retrying else None,
            )
            if retrying:
                self._loop.call_later(
                    delay, lambda: self._spawn(self._recover(rank, reason, attempt + 1))
                )
            else:
                self.rank_error = (
                    f"worker {worker_id} could not be restarted in {attempt} attempts: {exc}"
                )
        finally:
            if worker_id is not None:
                self._recovering.discard(worker_id)
                if worker_id in self._wake:
                    self._wake[worker_id].set()
            if not retrying:  # (while a retry waits, the ranks stay down)
                self._dead_ranks -= set(ranks)
            for r in ranks:
                self._ready_waits.pop(r, None)
            self._group_waits = {k: v for k, v in self._group_waits.items() if not v.done()}
            waiting, self._waiting = self._waiting, []
            for req in waiting:
                if not req.future.done():
                    self._replace(req)

    def _after_prefill(self, worker_id: int) -> None:
        for transition, _ in list(self._transitions.values()):
            if worker_id in transition.op.sources and self.reconf.idle(
                transition, worker_id, time.monotonic()
            ):
                self._spawn(self._switch(transition))

    # -- the prefix-cache manager: scans, copies, reclamations --------------------------

    async def _scans(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.scan_interval_s)
            await self.scan_now()

    async def scan_now(self) -> dict[str, Any]:
        """One scan of the cache manager; its copies run one after the other, its
        reclamations at once (a slot freed in the index is free on the rank)."""
        active = {
            w.worker_id: self.indexes[w.worker_id]
            for w in self.lattice.workers.values()
            if w.state is WorkerState.ACTIVE and w.worker_id in self.indexes
        }
        now = time.monotonic()
        loads = {w: self.scheduler.outstanding_s(w, now) for w in active}
        result = self.cache.scan(active, loads)
        reclaimed = 0
        for rplan in result.reclaims:
            report = self.indexes[rplan.worker_id].reclaim(rplan.block_id)
            if report is not None:
                self.cache.apply_report(report)
                self.metrics.reclaimed()
                reclaimed += 1
            self.cache.finish_reclaim(rplan.plan_id, report is not None)
        copied = blocks = 0
        for plan in result.copies:
            installed = await self.run_copy(plan)
            copied += installed > 0
            blocks += installed
        summary = {
            "candidates": dict(result.candidates),
            "copies": copied,
            "blocks_copied": blocks,
            "reclaims": reclaimed,
        }
        if result.copies or result.reclaims:
            log.info("scan", **summary)
        return summary

    async def run_copy(self, plan: CopyPlan) -> int:
        """Execute a copy plan (``KVCopier.run``); the blocks installed."""
        return await self.copies.run(plan)

    def _copy_hung(self, ranks: list[int]) -> None:
        """A KV copy timed out: a rank hung, and the pair groups may be out of step;
        the copy's workers restart (their ranks get new pairs)."""
        for r in ranks:
            self.rank_down(r, "a KV copy timed out", whole_worker=True)

    # -- reconfiguration -------------------------------------------------------------

    async def _windows(self) -> None:
        h = self.cfg.controller.window_s
        while True:
            await asyncio.sleep(h)
            decision = self.controller.end_window(self.scheduler.loads(time.monotonic()))
            if decision.ops:
                log.info("decision", **decision.to_json())
            for op in decision.ops:
                self.begin_reshape(op)

    def begin_reshape(self, op: Reshape) -> asyncio.Future[Transition]:
        """Drain ``op``'s workers now; the future resolves when the new workers serve."""
        assert self._loop is not None
        transition, requeue = self.reconf.begin(op, time.monotonic())
        done: asyncio.Future[Transition] = self._loop.create_future()
        self._transitions[id(transition)] = (transition, done)
        log.info("reshape_begin", kind=op.kind, sources=list(op.sources), requeued=len(requeue))
        for placed in requeue:
            req = self._requests.get(placed.request_id)
            if req is None:
                continue
            try:
                self._place(req)
            except Unavailable as exc:
                if not req.future.done():
                    req.future.set_exception(exc)
        if transition.phase is Phase.SWITCHING:
            self._spawn(self._switch(transition))
        return done

    async def _switch(self, transition: Transition) -> None:
        assert self.pool is not None and self._loop is not None
        _, done = self._transitions[id(transition)]
        await self.copies.lock.acquire()  # no KV copy runs across a switch
        try:
            start = time.monotonic()
            retained = self.ledger.collect(transition.op.sources)
            adopt = self.reconf.switch(transition, start)
            for s in transition.op.sources:
                self.indexes.pop(s, None)
                self._wake.pop(s, None)
                task = self._tasks.pop(s, None)
                if task is not None:
                    task.cancel()
            for w in transition.new_workers:
                self._add_worker(w)
            adopted, reserved = self.ledger.after_switch(
                transition.new_workers, retained, adopt, start
            )
            if reserved:
                self._loop.call_later(self.cfg.retention.retain_s, self._expire_retained)
            epoch = self.lattice.epoch
            acks = []
            for w in transition.new_workers:
                ranks = tuple(self.lattice.workers[w].devices)
                for r in ranks:
                    fut: asyncio.Future[None] = self._loop.create_future()
                    self._acks[(r, epoch)] = fut
                    acks.append((w, r - ranks[0], fut))
                    if r in self._dead_ranks:
                        fut.set_result(None)  # restarted after this switch, all groups new
                    else:
                        self.pool.send(r, SwitchEpoch(epoch, ranks))
            for w, cp_rank, fut in acks:
                await asyncio.wait_for(fut, self.cfg.engine.rank_timeout_s)
                self.reconf.acknowledge(transition, w, cp_rank, time.monotonic())
            for key in [k for k in self._acks if k[1] == epoch]:
                self._acks.pop(key)  # (a skipped, dead rank's)
            # A new worker with a failed rank is not a candidate: its restart follows.
            for w in transition.new_workers:
                if set(self.lattice.workers[w].devices) & self._dead_ranks:
                    self.lattice.fail(w)
            waiting, self._waiting = self._waiting, []
            for req in waiting:
                if not req.future.done():
                    try:
                        self._place(req)
                    except Unavailable as exc:
                        req.future.set_exception(exc)
            self.metrics.reshape(transition)
            log.info(
                "reshape_done",
                kind=transition.op.kind,
                sources=list(transition.op.sources),
                new_workers=transition.new_workers,
                epoch=epoch,
                drain_s=transition.drain_s,
                switch_s=transition.switch_s,
                adopted_blocks=adopted,
                reserved_blocks=reserved,
                composition=self.composition_name(),
            )
            done.set_result(transition)
        except Exception as exc:  # a rank failed mid-switch
            log.error("reshape_failed", error=str(exc))
            if not done.done():
                done.set_exception(exc)
        finally:
            self.copies.lock.release()
            self._transitions.pop(id(transition), None)

    def _expire_retained(self) -> None:
        released = self.ledger.expire(time.monotonic())
        if released:
            log.info("retained_released", blocks=released)

    def reshape_for(self, op_name: str, workers: Sequence[int] | None) -> Reshape:
        """The admin endpoint's request as a lattice operation (or the controller's
        choice when ``workers`` is empty); LatticeError when it cannot be done."""
        if op_name not in ("split", "merge"):
            raise LatticeError(f"op must be 'split' or 'merge', got {op_name!r}")
        options = (
            self.lattice.split_options() if op_name == "split" else self.lattice.merge_options()
        )
        busy = {s for t, _ in self._transitions.values() for s in t.op.sources}
        options = [op for op in options if not busy & set(op.sources)]
        if workers:
            wanted = tuple(sorted(workers))
            chosen = [op for op in options if tuple(sorted(op.sources)) == wanted]
            if not chosen:
                raise LatticeError(
                    f"cannot {op_name} {list(wanted)}: the possible {op_name}s now are "
                    f"{[list(op.sources) for op in options]}"
                )
            return chosen[0]
        if not options:
            raise LatticeError(f"no {op_name} is possible now")
        loads = self.scheduler.loads(time.monotonic())
        return min(options, key=lambda op: max(loads.get(s, 0.0) for s in op.sources))

    # -- views -----------------------------------------------------------------------

    def composition_name(self) -> str:
        counts = self.lattice.composition((WorkerState.ACTIVE,))
        return "/".join(f"{n}CP{c}" for c, n in sorted(counts.items()) if n) or "-"

    def workers_view(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        out = []
        for w in sorted(self.lattice.workers.values(), key=lambda w: w.first_device):
            index = self.indexes.get(w.worker_id)
            out.append(
                {
                    "worker": w.worker_id,
                    "cp_degree": w.cp_degree,
                    "ranks": list(w.devices),
                    "hosts": list(w.hosts(self.lattice.config)),
                    "host_names": list(
                        dict.fromkeys(self.pool.host_of(r) for r in w.devices)
                        if self.pool is not None
                        else ()
                    ),
                    "state": str(w.state),
                    "epoch": w.epoch,
                    "queued": len(self.scheduler.queued(w.worker_id)),
                    "running": self.scheduler.running(w.worker_id),
                    "outstanding_s": self.scheduler.outstanding_s(w.worker_id, now),
                    "cached_blocks": len(index) if index is not None else 0,
                    "pids": [
                        self.pool.pid(r) if self.pool is not None else None for r in w.devices
                    ],
                    "restarting": w.worker_id in self._recovering,
                }
            )
        return out

    def cache_view(self) -> dict[str, Any]:
        trie = self.cache.trie
        return {
            "nodes": len(trie.nodes),
            "block_size": trie.block_tokens,
            "holders": {str(w): len(nodes) for w, nodes in trie.worker_nodes.items()},
            "token_hit_rate": self.metrics.hit_rate(),
            "replications": self.metrics.replication_count,
            "reclamations": self.metrics.reclamation_count,
        }

    def uptime_s(self) -> float:
        return time.monotonic() - self.started_s

    def window_phase_s(self) -> float | None:
        """How far into its current window the controller is (None: no controller)."""
        if self._windows_started_s is None:
            return None
        return (time.monotonic() - self._windows_started_s) % self.cfg.controller.window_s
