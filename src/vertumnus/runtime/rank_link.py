"""The coordinator's end of the rank pipes: every answer a rank owes, and who waits.

Owns the futures that wait on the ranks: a prefill's ``PrefillDone`` from every rank
of its worker, a rank's ``EpochAck`` of a switch, a restarted rank's ``RankReady``,
a live peer's ``GroupsReady``. ``on_message`` (a ``RankAnswer`` that ``RankWatch``
read from the event loop, or an in-process fake of the ranks directly) routes each
answer to its waiter; KV copy answers go to the ``KVCopier``, KV reads' to the
hand-offs' ``KVReads``. A failure that no waiter takes is handed to the switchboard:
``RankDown`` (a prefill whose attempt had ended failed on one rank) or
``PoolFailed``. ``mark_dead`` releases what waits on ranks that died or hung: their
prefills fail, their acknowledgements are skipped (the switch goes on; the worker
restarts after it), their copies fail. It does not decide anything about requests
or workers: the request path and recovery do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from vertumnus.engine.messages import (
    EpochAck,
    GroupsReady,
    KVData,
    KVWritten,
    PrefillDone,
    RankFailed,
    RankReady,
)
from vertumnus.runtime.intents import PoolFailed, RankDown
from vertumnus.runtime.kv.copies import KVCopier
from vertumnus.runtime.kv.reads import KVReads
from vertumnus.runtime.rank_watch import RankWatch
from vertumnus.runtime.ranks import Ranks, RanksError
from vertumnus.runtime.state import Shared

log = structlog.get_logger("vertumnus")


class WorkerLost(RuntimeError):
    """The worker running a prefill failed (a rank died or hung); the request is
    placed again."""


@dataclass
class _InFlight:
    ranks: tuple[int, ...]
    future: asyncio.Future[dict[int, PrefillDone]]
    done: dict[int, PrefillDone] = field(default_factory=dict)


class RankLink:
    def __init__(self, shared: Shared, copier: KVCopier, reads: KVReads | None = None) -> None:
        """``shared.switchboard`` takes the failures no waiter takes: ``PoolFailed`` (a rank
        failed outside anything that waits: the pool is unusable), ``RankDown`` (a
        rank failed a prefill after its attempt had ended: the live peer of a rank
        that died mid-prefill reports its broken collective after the request left,
        so only that rank is suspect). ``copier``: where KV copies' answers go;
        ``reads``: where the answers to KV reads of hand-offs go."""
        self.copier = copier
        self.reads = reads
        self.switchboard = shared.switchboard
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ranks: Ranks | None = None
        self._watcher: RankWatch | None = None
        self._inflight: dict[int, _InFlight] = {}  # request id -> its prefill
        self._acks: dict[tuple[int, int], asyncio.Future[None]] = {}  # (rank, epoch)
        self._ready: dict[int, asyncio.Future[None]] = {}  # rank -> its RankReady
        self._groups: dict[tuple[int, int], asyncio.Future[None]] = {}  # (rank, token)

    def attach(self, loop: asyncio.AbstractEventLoop, ranks: Ranks) -> None:
        """Watch ``ranks``'s pipes from ``loop``: what they read goes to the switchboard."""
        self._loop, self._ranks = loop, ranks
        self._watcher = RankWatch(loop, self.switchboard)

    def watch(self, ranks: Iterable[int]) -> None:
        assert self._ranks is not None and self._watcher is not None
        wanted = set(ranks)
        self._watcher.watch(c for c in self._ranks.channels() if c[0] in wanted)

    def unwatch(self, ranks: Sequence[int] | None = None) -> None:
        if self._ranks is None or self._watcher is None:
            return
        channels = self._ranks.channels()
        self._watcher.unwatch(c for c in channels if ranks is None or c[0] in ranks)

    # -- waiting -----------------------------------------------------------------------

    def _future(self) -> asyncio.Future[None]:
        assert self._loop is not None
        return self._loop.create_future()

    def expect_prefill(
        self, request_id: int, ranks: tuple[int, ...]
    ) -> asyncio.Future[dict[int, PrefillDone]]:
        """A future of every rank's ``PrefillDone`` for this request."""
        assert self._loop is not None
        inflight = _InFlight(ranks, self._loop.create_future())
        self._inflight[request_id] = inflight
        return inflight.future

    def forget_prefill(self, request_id: int) -> None:
        self._inflight.pop(request_id, None)

    def expect_ack(self, rank: int, epoch: int) -> asyncio.Future[None]:
        future = self._acks[(rank, epoch)] = self._future()
        return future

    def forget_acks(self, epoch: int) -> None:
        for key in [k for k in self._acks if k[1] == epoch]:
            self._acks.pop(key)

    def expect_ready(self, rank: int) -> asyncio.Future[None]:
        future = self._ready[rank] = self._future()
        return future

    def expect_groups(self, rank: int, token: int) -> asyncio.Future[None]:
        future = self._groups[(rank, token)] = self._future()
        return future

    def forget_restart(self, ranks: Iterable[int]) -> None:
        for r in ranks:
            self._ready.pop(r, None)
        self._groups = {k: v for k, v in self._groups.items() if not v.done()}

    # -- answers -----------------------------------------------------------------------

    def on_message(self, msg: object) -> None:
        match msg:
            case PrefillDone():
                inflight = self._inflight.get(msg.request_id)
                if inflight is None or msg.rank not in inflight.ranks:
                    return  # late, from a worker the request has left
                inflight.done[msg.rank] = msg
                if len(inflight.done) == len(inflight.ranks) and not inflight.future.done():
                    inflight.future.set_result(inflight.done)
            case KVWritten():
                self.copier.answer(msg)
            case RankFailed() if msg.copy_id is not None:
                self.copier.answer(msg)
            case KVData() if self.reads is not None:
                self.reads.answer(msg)
            case RankFailed() if msg.read_id is not None and self.reads is not None:
                self.reads.answer(msg)
            case RankFailed() if msg.request_id is None and (
                msg.rank in self._ready or any(r == msg.rank for r, _ in self._groups)
            ):  # a restarted rank that could not start, or a peer that could not regroup
                error = RanksError(f"rank {msg.rank}: {msg.error}")
                for key, wait in [(k, w) for k, w in self._groups.items() if k[0] == msg.rank]:
                    if not wait.done():
                        wait.set_exception(error)
                    self._groups.pop(key, None)
                ready = self._ready.pop(msg.rank, None)
                if ready is not None and not ready.done():
                    ready.set_exception(error)
            case RankFailed() if msg.request_id is not None:
                inflight = self._inflight.get(msg.request_id)
                if inflight is not None and msg.rank in inflight.ranks:
                    if not inflight.future.done():
                        inflight.future.set_exception(RanksError(msg.error))
                else:  # late: its attempt ended (a peer died; the request may run elsewhere)
                    log.warning("rank_failed_late", rank=msg.rank, request_id=msg.request_id)
                    why = f"a prefill that had ended failed: {msg.error}"
                    self.switchboard.route(RankDown(msg.rank, why))
            case RankFailed():
                self.switchboard.route(PoolFailed(f"rank {msg.rank}: {msg.error}"))
            case RankReady():
                # a restarted rank
                log.info("rank_back", rank=msg.rank, layers=msg.layers, attention=msg.attention)
                if msg.eager_because is not None:
                    log.warning("rank_layers_eager", rank=msg.rank, because=msg.eager_because)
                ready = self._ready.pop(msg.rank, None)
                if ready is not None and not ready.done():
                    ready.set_result(None)
            case GroupsReady():
                grouped = self._groups.pop((msg.rank, msg.token), None)
                if grouped is not None and not grouped.done():
                    grouped.set_result(None)
            case EpochAck():
                ack = self._acks.pop((msg.rank, msg.epoch), None)
                if ack is not None and not ack.done():
                    ack.set_result(None)

    # -- failures ----------------------------------------------------------------------

    def mark_dead(self, ranks: set[int], lost: WorkerLost) -> None:
        """Release what waits on ``ranks`` (dead or hung, killed by the caller): their
        prefills and copies fail; a switch's acknowledgement is skipped; a restart's
        wait for them (a peer regrouping) fails."""
        for inflight in self._inflight.values():
            if set(inflight.ranks) & ranks and not inflight.future.done():
                inflight.future.set_exception(lost)
        self.copier.fail(str(lost), ranks)
        if self.reads is not None:
            self.reads.fail(str(lost), ranks)
        for (r, _), ack in list(self._acks.items()):
            if r in ranks and not ack.done():
                ack.set_result(None)
        self.restart_failed(ranks, RanksError(str(lost)))

    def restart_failed(self, ranks: Iterable[int], error: Exception) -> None:
        """``ranks`` died while being restarted, or while regrouping with a restarted
        peer: the restart's waits for them fail now (not at their time-out)."""
        dead = set(ranks)
        for key in [k for k in self._groups if k[0] in dead]:
            wait = self._groups.pop(key)
            if not wait.done():
                wait.set_exception(error)
        for r in dead:
            ready = self._ready.pop(r, None)
            if ready is not None and not ready.done():
                ready.set_exception(error)

    def fail_all(self, error: str) -> None:
        """The pool failed: every prefill, acknowledgement and copy fails."""
        for inflight in self._inflight.values():
            if not inflight.future.done():
                inflight.future.set_exception(RanksError(error))
        for wait in self._acks.values():
            if not wait.done():
                wait.set_exception(RanksError(error))
        self.copier.fail(error)
        if self.reads is not None:
            self.reads.fail(error)
