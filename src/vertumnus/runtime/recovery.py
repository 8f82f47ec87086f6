"""Rank failures: a rank that dies, hangs or fails a prefill restarts its worker.

``rank_down`` kills the suspect ranks, releases what waits on them (``RankLink``),
ends the hand-off leases of the worker, takes the worker out of the candidate set
(the policy places its queue again) and starts ``_recover`` in the background.
Recovery waits for any reshape that involves the rank to finish (its drain ends when
the failed prefill does, and a prefill is never sent to a rank known dead; the dead
rank's acknowledgement is skipped; the reshape's own bound ends it at the latest),
then resets the worker in the policy (its cache is gone), restarts its ranks, has
their live peers form the groups they share anew (``RebuildGroups``) and lets it
rejoin with an empty cache. A restart that fails is tried again after 2, 4, 8, ...
s, up to ``[server] max_restart_attempts``; meanwhile the worker stays out and the
failed processes are not watched (no crash loop).
Requests wait while a worker is coming back and are refused once nothing is.
The ranks' own reports come here too, routed by the coordinator's switchboard: a
process that exited (``rank_exited``), a KV copy that hung (``copy_hung``), a
failure that leaves the pool unusable (``pool_failed``), a host whose Ray node is
back (``hosts_back``). What recovery wants of others it hands to the switchboard: the
policy's actions (``Apply``) and a worker's recovery ended (``WorkerRejoined``:
its task looks at its queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

import structlog

from vertumnus.engine.messages import RebuildGroups
from vertumnus.policy.lattice import LatticeWorker, WorkerState
from vertumnus.runtime.intents import Apply, WorkerRejoined
from vertumnus.runtime.kv.handoffs import Handoffs
from vertumnus.runtime.rank_link import RankLink, WorkerLost
from vertumnus.runtime.ranks import Ranks, RanksError
from vertumnus.runtime.state import Shared

log = structlog.get_logger("vertumnus")


class Recovery:
    def __init__(self, shared: Shared, link: RankLink, handoffs: Handoffs) -> None:
        """``link``: releases what waits on failed ranks and watches restarted ones;
        ``handoffs``: the leases a failed worker held end."""
        self.cfg, self.policy, self.metrics = shared.cfg, shared.policy, shared.metrics
        self.health, self.ranks, self.clock = shared.health, shared.ranks, shared.clock
        self.switchboard, self.background = shared.switchboard, shared.background
        self.link, self.handoffs = link, handoffs
        self.dead_ranks: set[int] = set()  # failed ranks, until their worker rejoins
        self._recovering: set[int] = set()  # workers being restarted
        self._lock = asyncio.Lock()
        self._tokens = itertools.count(1)
        self._restarting: asyncio.Future[Any] | None = None  # ``restart``, in a thread

    def recovering(self, worker_id: int) -> bool:
        return worker_id in self._recovering

    @property
    def restarting(self) -> frozenset[int]:
        """The workers being restarted now."""
        return frozenset(self._recovering)

    def worker_of_rank(self, rank: int) -> LatticeWorker | None:
        workers = self.policy.lattice.workers.values()
        return next((w for w in workers if rank in w.devices), None)

    def rank_down(self, rank: int, reason: str, whole_worker: bool = False) -> None:
        """Rank ``rank`` died, hung or failed a prefill (``whole_worker``: every rank of
        its worker is suspect). The rank is killed if it still runs, and everything
        that waits on it fails or, for a reshape's acknowledgement, is skipped; its
        worker leaves the candidate set and is restarted in the background, after any
        reshape it takes part in has finished."""
        if self.health.stopping or self.ranks.now is None:
            return
        worker = self.worker_of_rank(rank)
        if worker is None:
            return
        suspects = set(worker.devices) if whole_worker else {rank}
        fresh = suspects - self.dead_ranks
        if not fresh:  # (a rank being restarted that died starting: its restart fails now)
            self.link.restart_failed(suspects, RanksError(f"rank {rank}: {reason}"))
            return
        first_failure = not (set(worker.devices) & self.dead_ranks)
        self._mark_dead(fresh, WorkerLost(f"worker {worker.worker_id} failed: {reason}"))
        self.switchboard.route(Apply(self.policy.worker_failed(worker.worker_id, self.clock())))
        # Its KV is going: the hand-offs it holds end (a pull answers 410, moved), and
        # a reshape it drains for no longer waits for them.
        self.handoffs.cut(worker.worker_id, "moved")
        if self.health.draining:  # the shutdown (a signal to the whole process group)
            log.warning("worker_lost_at_shutdown", worker=worker.worker_id, ranks=sorted(fresh))
            return
        log.error("worker_failed", worker=worker.worker_id, ranks=sorted(fresh), reason=reason)
        if first_failure:
            self.background.spawn(self._recover(rank, reason))

    def rank_exited(self, rank: int) -> None:
        """A rank's process exited (nothing at shutdown)."""
        self.rank_down(rank, f"rank process {rank} exited unexpectedly")

    def copy_hung(self, ranks: list[int]) -> None:
        """A KV copy timed out: a rank hung, and the pair groups may be out of step;
        the copy's workers restart (their ranks get new pairs)."""
        for r in ranks:
            self.rank_down(r, "a KV copy timed out", whole_worker=True)

    def pool_failed(self, error: str) -> None:
        """A rank failed outside anything that waits: the pool stops serving."""
        self.health.failure = error
        self.health.ready = False
        log.error("rank_failure", error=error)
        self.link.fail_all(error)

    def hosts_back(self, ranks: Sequence[int]) -> None:
        """The host of ``ranks`` has a Ray node again: restart the failed workers
        among them now (not at their next retry)."""
        back = set(ranks)
        for w in list(self.policy.lattice.workers.values()):
            if back & set(w.devices) and (
                set(w.devices) & self.dead_ranks or w.state is WorkerState.UNAVAILABLE
            ):
                self.background.spawn(self._recover(w.devices[0], "its host is back"))

    def new_workers_up(self, workers: Sequence[int]) -> None:
        """A reshape's new workers serve: one with a dead rank leaves at once, and is
        restarted (a split may have put the dead ranks of one old worker into two new
        ones; a restart already under way for it makes this one a no-op)."""
        for w in workers:
            lw = self.policy.lattice.workers.get(w)
            dead = set(lw.devices) & self.dead_ranks if lw is not None else set()
            if lw is not None and dead:
                self.switchboard.route(Apply(self.policy.worker_failed(w, self.clock())))
                why = f"worker {w} has failed ranks {sorted(dead)}"
                self.background.spawn(self._recover(min(dead), why))

    def _mark_dead(self, ranks: set[int], lost: WorkerLost) -> None:
        """Kill ``ranks`` (a hung rank is dead from now on) and release what waits on
        them."""
        current = self.ranks.now
        assert current is not None
        self.dead_ranks |= ranks
        for r in ranks:
            current.kill(r)
        self.link.mark_dead(ranks, lost)

    def _shut(self, ranks: Ranks) -> bool:
        """The shutdown began, or ``ranks`` are no longer the pool's."""
        return self.health.draining or self.ranks.now is not ranks

    async def settle(self) -> None:
        """Wait for a restart under way in a thread (the shutdown: the ranks then
        close with the processes it started, never beside it)."""
        restarting = self._restarting
        if restarting is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(restarting)

    def _in_reshape(self, rank: int) -> bool:
        lattice = self.policy.lattice
        for transition in self.policy.transitions:
            for w in (*transition.op.sources, *transition.new_workers):
                lw = lattice.workers.get(w)
                if lw is not None and rank in lw.devices:
                    return True
        return False

    async def _recover(self, rank: int, reason: str, attempt: int = 1) -> None:
        """Take the failed worker of ``rank`` out, hand its work on, restart its ranks
        and let it rejoin with an empty cache (see the module docstring); nothing
        once the shutdown has begun."""
        policy, ranks, link = self.policy, self.ranks.now, self.link
        if self.health.draining or ranks is None:
            return
        loop = asyncio.get_running_loop()
        started = self.clock()
        worker_id: int | None = None
        devices: tuple[int, ...] = (rank,)
        retrying = False
        try:
            async with self._lock:
                # A reshape it takes part in ends first: its drain ends with the failed
                # prefill, its switch skips the dead rank; and it is bounded (rolled
                # back or finished at [server] reshape_timeout_s), so this wait is too.
                # (The shutdown may begin during any wait here: nothing is restarted
                # after it, and what was read before a wait is read again after it.)
                bound_s = self.cfg.reshape_timeout_s + self.cfg.engine.rank_timeout_s
                deadline = self.clock() + bound_s
                while self._in_reshape(rank) and self.clock() < deadline:
                    if self._shut(ranks):
                        return
                    await asyncio.sleep(0.02)
                if self._shut(ranks):
                    return
                if self._in_reshape(rank):
                    log.error("recovery_past_reshape", rank=rank, waited_s=bound_s)
                w = self.worker_of_rank(rank)
                assert w is not None
                if not set(w.devices) & self.dead_ranks and w.state is not WorkerState.UNAVAILABLE:
                    return  # recovered already (a retry after its host came back)
                worker_id, devices = w.worker_id, tuple(w.devices)
                self._recovering.add(worker_id)
                # The whole worker restarts: its other ranks too; its cache is gone.
                self._mark_dead(set(devices), WorkerLost(f"worker {worker_id} failed: {reason}"))
                self.switchboard.route(Apply(policy.worker_reset(worker_id, self.clock())))
                link.unwatch(devices)
                self._restarting = loop.run_in_executor(None, ranks.restart, devices)
                try:
                    rebuild = await self._restarting
                finally:
                    self._restarting = None
                if self._shut(ranks):  # (``close`` stops the processes just started)
                    return
                token = next(self._tokens)
                waits = [link.expect_ready(r) for r in devices]
                link.watch(devices)
                peers = {r for group, _ in rebuild for r in group}
                live = sorted(peers - set(devices) - self.dead_ranks)  # (dead: restarted after)
                for r in live:
                    mine = tuple((g, gen) for g, gen in rebuild if r in g)
                    waits.append(link.expect_groups(r, token))
                    ranks.send(r, RebuildGroups(token, mine))
                await asyncio.wait_for(asyncio.gather(*waits), self.cfg.engine.rank_timeout_s)
                self.dead_ranks -= set(devices)
                self.switchboard.route(Apply(policy.worker_restored(worker_id, self.clock())))
                if self.health.failure and self.health.failure.startswith(
                    f"worker {worker_id} could not"
                ):
                    self.health.failure = None  # (it gave up before its host came back)
                self.metrics.restarted()
                log.info(
                    "worker_rejoined",
                    worker=worker_id,
                    ranks=list(devices),
                    attempt=attempt,
                    seconds=round(self.clock() - started, 3),
                )
        except Exception as exc:
            link.unwatch(devices)  # the processes that failed to start: no crash loop
            retrying = attempt < self.cfg.max_restart_attempts and not self.health.stopping
            delay = min(30.0, 2.0**attempt)
            log.error(
                "worker_restart_failed",
                worker=worker_id,
                attempt=attempt,
                error=repr(exc),
                retry_in_s=delay if retrying else None,
            )
            if retrying:
                again = attempt + 1
                loop.call_later(
                    delay, lambda: self.background.spawn(self._recover(rank, reason, again))
                )
            else:
                self.health.failure = (
                    f"worker {worker_id} could not be restarted in {attempt} attempts: {exc}"
                )
                self.dead_ranks -= set(devices)
                if worker_id is not None:
                    self.switchboard.route(Apply(policy.worker_abandoned(worker_id, self.clock())))
        finally:
            if worker_id is not None:
                self._recovering.discard(worker_id)
                self.switchboard.route(WorkerRejoined(worker_id))
            link.forget_restart(devices)
