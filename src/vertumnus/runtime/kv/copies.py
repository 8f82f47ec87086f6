"""KV copies on the live ranks: the cache manager's scans and copies, and moving a
copy job's blocks rank to rank.

``CopyRuns`` drives the policy's side: a scan (its reclamations happen at once, its
copies queue on the copy lanes), each copy job the lanes start (moved, then
``copy_done``), and who waits for a plan to end (``scan_now``, ``run_plan``).

The policy stack decides what to copy and when (one copy at a time, on the channel
it shares with reshape switches, ``policy/pool_policy.py``); its KV ledger has turned
the plan into slot moves by then. ``KVCopier`` carries them out: one ``KVTransfer``
to every rank involved in one loop (so every rank sees the multi-rank commands in
one order), the blocks travel rank to rank over torch.distributed
(``engine/kv_transfer.py``), and the copy succeeds when every rank has answered
``KVWritten``. It restarts nothing: a copy that times out is handed to the switchboard
as ``CopyHung`` with its ranks, whose pair groups may be out of step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import structlog

from vertumnus.engine.messages import KVTransfer, KVWritten, RankFailed
from vertumnus.policy.cache.ledger import CopyJob
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.pool_results import ScanOutcome
from vertumnus.runtime.intents import Apply, CopyHung
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.state import Shared

log = structlog.get_logger("vertumnus")


class KVCopier:
    """Given what the parts share: the ranks, ``rank_timeout_s``, the switchboard."""

    def __init__(self, shared: Shared) -> None:
        self.ranks, self.switchboard = shared.ranks, shared.switchboard
        self.timeout_s = shared.cfg.engine.rank_timeout_s
        self._ids = itertools.count(1)
        self._waits: dict[tuple[int, int], asyncio.Future[Any]] = {}  # (copy, rank)

    async def transfer(self, job: CopyJob) -> bool:
        """Move the job's blocks (re-sharded: block j to rank j % C of each worker);
        False if a rank failed or the copy timed out."""
        try:
            await self._transfer(job.moves)
        except (RanksError, TimeoutError) as exc:
            log.error("copy_failed", plan=job.plan.plan_id, error=repr(exc))
            if isinstance(exc, TimeoutError):
                self.switchboard.route(
                    CopyHung(tuple(sorted({r for m in job.moves for r in (m[0], m[2])})))
                )
            return False
        return True

    async def _transfer(self, moves: Sequence[tuple[int, int, int, int]]) -> None:
        """Copy KV blocks (src rank, src slot, dst rank, dst slot) rank to rank: one
        ``KVTransfer`` to every rank involved, then a ``KVWritten`` from each."""
        ranks_now = self.ranks.now
        assert ranks_now is not None
        if not moves:
            return
        loop = asyncio.get_running_loop()
        copy_id = next(self._ids)
        involved = sorted({r for src, _, dst, _ in moves for r in (src, dst)})
        cmd = KVTransfer(
            copy_id,
            tuple((s, ss, d, ds) for s, ss, d, ds in moves),
            tuple((r, ranks_now.incarnation(r)) for r in involved),
        )
        waits: list[asyncio.Future[Any]] = []
        for r in involved:
            waits.append(loop.create_future())
            self._waits[(copy_id, r)] = waits[-1]
        try:
            # One loop, no await: every rank sees the multi-rank commands (prefills,
            # copies) in one order, so their pairs cannot wait on each other.
            for r in involved:
                ranks_now.send(r, cmd)
            await asyncio.wait_for(asyncio.gather(*waits), self.timeout_s)
        finally:
            for r in involved:
                self._waits.pop((copy_id, r), None)

    def answer(self, msg: KVWritten | RankFailed) -> None:
        """A rank's answer to a copy (a ``RankFailed`` fails the whole copy)."""
        if isinstance(msg, KVWritten):
            wait = self._waits.pop((msg.copy_id, msg.rank), None)
            if wait is not None and not wait.done():
                wait.set_result(msg)
            return
        for (copy_id, _), wait in list(self._waits.items()):
            if copy_id == msg.copy_id and not wait.done():
                wait.set_exception(RanksError(msg.error))

    def fail(self, error: str, ranks: set[int] | None = None) -> None:
        """Fail the copy waiting on any of ``ranks`` (None: every copy)."""
        for (_, r), wait in list(self._waits.items()):
            if (ranks is None or r in ranks) and not wait.done():
                wait.set_exception(RanksError(error))


class CopyRuns:
    """The scans and copies of the policy's cache manager, carried out: given what
    the parts share (the stack, the metrics, the clock, the switchboard: what the stack
    returns is handed on as ``Apply``) and the copier."""

    def __init__(self, shared: Shared, copier: KVCopier) -> None:
        self.policy, self.metrics, self.clock = shared.policy, shared.metrics, shared.clock
        self.switchboard, self.copier = shared.switchboard, copier
        self._waits: dict[int, asyncio.Future[int]] = {}  # plan id -> blocks installed

    def scan(self, now: float) -> tuple[ScanOutcome, list[asyncio.Future[int]]]:
        """One scan of the cache manager: its reclamations happen at once, its copies
        queue on the lanes; returns what to wait for to see them end."""
        outcome = self.policy.scan(now)
        for _ in range(outcome.reclaimed):
            self.metrics.reclaimed()
        waits = [self._wait(plan) for plan in outcome.result.copies]
        self.switchboard.route(Apply(outcome.actions))
        if outcome.result.copies or outcome.result.reclaims:
            log.info(
                "scan",
                candidates=dict(outcome.result.candidates),
                copies_planned=len(outcome.result.copies),
                reclaims=outcome.reclaimed,
            )
        return outcome, waits

    async def scan_now(self) -> dict[str, Any]:
        """One scan now, waiting for its copies: what it did."""
        outcome, waits = self.scan(self.clock())
        installed = await asyncio.gather(*waits)
        return {
            "candidates": dict(outcome.result.candidates),
            "copies": sum(n > 0 for n in installed),
            "blocks_copied": sum(installed),
            "reclaims": outcome.reclaimed,
        }

    async def run_plan(self, plan: CopyPlan) -> int:
        """Run a copy plan made outside a scan; the blocks installed (0: it ended as
        a miss, or failed)."""
        wait = self._wait(plan)
        self.switchboard.route(Apply(self.policy.queue_copy(plan, self.clock())))
        return await wait

    def ended(self, plans: Sequence[tuple[int, int]]) -> None:
        """Plans that ended (plan id, blocks installed): their waiters learn it."""
        for plan_id, installed in plans:
            wait = self._waits.pop(plan_id, None)
            if wait is not None and not wait.done():
                wait.set_result(installed)

    def _wait(self, plan: CopyPlan) -> asyncio.Future[int]:
        wait: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waits[plan.plan_id] = wait
        return wait

    async def run(self, job: CopyJob) -> None:
        """Move a job the lanes started, then tell the policy (once, even if the
        move raised)."""
        started = self.clock()
        ok = False
        try:
            ok = await self.copier.transfer(job)
        finally:
            actions = self.policy.copy_done(job, ok, self.clock())
            installed = sum(n for plan_id, n in actions.copies_ended if plan_id == job.plan.plan_id)
            if ok:
                seconds = self.clock() - started
                self.metrics.copied(installed, seconds)
                log.info(
                    "copy",
                    kind=job.plan.kind,
                    source="retained" if job.src_worker is None else job.src_worker,
                    dest=job.plan.dest_worker,
                    blocks=installed,
                    reshard=job.plan.reshard,
                    seconds=round(seconds, 6),
                )
            self.switchboard.route(Apply(actions))
