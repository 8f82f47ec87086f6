"""KV copies on the live ranks: moving a copy job's blocks rank to rank.

The policy stack decides what to copy and when (one copy at a time, on the channel
it shares with reshape switches, ``policy/pool_policy.py``); its KV ledger has turned
the plan into slot moves by then. ``KVCopier`` carries them out: one ``KVTransfer``
to every rank involved in one loop (so every rank sees the multi-rank commands in
one order), the blocks travel rank to rank over torch.distributed
(``engine/kv_transfer.py``), and the copy succeeds when every rank has answered
``KVWritten``. It restarts nothing: a copy that times out is reported to
``on_hung`` with its ranks, whose pair groups may be out of step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from vertumnus.engine.messages import KVTransfer, KVWritten, RankFailed
from vertumnus.policy.kv_ledger import CopyJob
from vertumnus.runtime.pool import RankPoolError, Ranks

log = structlog.get_logger("vertumnus")


class KVCopier:
    def __init__(
        self,
        ranks: Callable[[], Ranks | None],
        timeout_s: float,
        on_hung: Callable[[list[int]], None],
    ) -> None:
        self._ranks, self.timeout_s, self._on_hung = ranks, timeout_s, on_hung
        self._ids = itertools.count(1)
        self._waits: dict[tuple[int, int], asyncio.Future[Any]] = {}  # (copy, rank)

    async def transfer(self, job: CopyJob) -> bool:
        """Move the job's blocks (re-sharded: block j to rank j % C of each worker);
        False if a rank failed or the copy timed out."""
        try:
            await self._transfer(job.moves)
        except (RankPoolError, TimeoutError) as exc:
            log.error("copy_failed", plan=job.plan.plan_id, error=repr(exc))
            if isinstance(exc, TimeoutError):
                self._on_hung(sorted({r for m in job.moves for r in (m[0], m[2])}))
            return False
        return True

    async def _transfer(self, moves: Sequence[tuple[int, int, int, int]]) -> None:
        """Copy KV blocks (src rank, src slot, dst rank, dst slot) rank to rank: one
        ``KVTransfer`` to every rank involved, then a ``KVWritten`` from each."""
        pool = self._ranks()
        assert pool is not None
        if not moves:
            return
        loop = asyncio.get_running_loop()
        copy_id = next(self._ids)
        ranks = sorted({r for src, _, dst, _ in moves for r in (src, dst)})
        cmd = KVTransfer(
            copy_id,
            tuple((s, ss, d, ds) for s, ss, d, ds in moves),
            tuple((r, pool.incarnation(r)) for r in ranks),
        )
        waits: list[asyncio.Future[Any]] = []
        for r in ranks:
            waits.append(loop.create_future())
            self._waits[(copy_id, r)] = waits[-1]
        try:
            # One loop, no await: every rank sees the multi-rank commands (prefills,
            # copies) in one order, so their pairs cannot wait on each other.
            for r in ranks:
                pool.send(r, cmd)
            await asyncio.wait_for(asyncio.gather(*waits), self.timeout_s)
        finally:
            for r in ranks:
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
                wait.set_exception(RankPoolError(msg.error))

    def fail(self, error: str, ranks: set[int] | None = None) -> None:
        """Fail the copy waiting on any of ``ranks`` (None: every copy)."""
        for (_, r), wait in list(self._waits.items()):
            if (ranks is None or r in ranks) and not wait.done():
                wait.set_exception(RankPoolError(error))
