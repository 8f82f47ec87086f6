"""The coordinator's handle on its rank processes.

Owns process lifetime: spawning the ranks (``spawn`` context), the TCP store they
rendezvous on (bound by the coordinator to a free port chosen by the OS, so there is
no port race), waiting for every readiness acknowledgement, the command and result
channels, and an orderly shutdown that leaves no orphan. It does not plan prefills
(``runtime/worker.py``) or run them (``engine/rank.py``).

Commands go through one one-way pipe per rank, written by a sender thread of this
process (``_CommandSender``), so a send never blocks the coordinator even when the
rank is busy and the message is larger than a pipe's buffer. (Writing the pipe
directly deadlocked: the coordinator blocked writing a large KV message to a busy
rank, while that rank blocked writing its answer to the coordinator.) The pool
keeps no copy of a command pipe's read end, so once a rank is gone a pending write
fails with EPIPE and the sender ends; nothing blocks shutdown, and there is no
named semaphore for the resource tracker to report (``mp.Queue`` had one, whose
unlink raced interpreter exit). Answers come back on one one-way pipe per rank.
``recv`` waits on every answer pipe and every rank process's sentinel together, so
a rank that dies is noticed at once; the serving coordinator watches the same
pipes from its event loop.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing import connection
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.engine.rank import RankSpec, rank_main
from vertumnus.runtime.messages import RankFailed, RankReady, Shutdown


class RankPoolError(RuntimeError):
    """A rank failed to start, died, or did not answer in time."""


def worker_groups(world_size: int, degrees: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Every aligned block of ranks a worker of a degree in ``degrees`` can occupy."""
    groups = []
    for c in sorted(set(degrees)):
        if c < 1 or world_size % c:
            raise ValueError(f"degree {c} does not divide the pool of {world_size} ranks")
        if c > 1:
            groups.extend(tuple(range(k * c, (k + 1) * c)) for k in range(world_size // c))
    return tuple(groups)


class _CommandSender:
    """The write end of one rank's command pipe, fed by a daemon thread: ``put``
    never blocks; the thread ends on ``stop`` or when the rank is gone (EPIPE)."""

    _STOP = object()

    def __init__(self, conn: Any, name: str) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._feed, name=name, daemon=True)
        self._thread.start()

    def put(self, msg: object) -> None:
        self._queue.put(msg)

    def _feed(self) -> None:
        while (msg := self._queue.get()) is not self._STOP:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the rank exited, or the pipe was closed
                return

    def stop(self, timeout_s: float) -> None:
        """Call once the rank has exited: the sender drains or fails, then the pipe
        closes. Idempotent."""
        self._queue.put(self._STOP)
        self._thread.join(timeout_s)
        self._conn.close()


class RankPool:
    def __init__(
        self,
        model: ModelConfig,
        model_dir: str | None,
        engine: EngineConfig,
        world_size: int,
        degrees: Sequence[int],
    ) -> None:
        self.model, self.model_dir, self.engine = model, model_dir, engine
        self.world_size = world_size
        self.groups = worker_groups(world_size, degrees)
        self.ready: dict[int, RankReady] = {}
        self._procs: list[Any] = []  # per rank, replaced when a rank restarts
        self._commands: list[_CommandSender] = []  # per rank, coordinator -> rank
        self._results: list[Any] = []  # Connection per rank, rank -> coordinator
        self._pending: list[object] = []  # read, not yet handed out
        self._store: dist.TCPStore | None = None
        self.generations: dict[tuple[int, ...], int] = {}  # of each group; absent: 0

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        timeout = timedelta(seconds=self.engine.rank_timeout_s)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, None, is_master=True, timeout=timeout, wait_for_workers=False
        )
        self._procs = [None] * self.world_size
        self._commands = [None] * self.world_size  # type: ignore[list-item]
        self._results = [None] * self.world_size
        for rank in range(self.world_size):
            self._spawn(rank)
        try:
            while len(self.ready) < self.world_size:
                msg = self.recv(self.engine.rank_timeout_s)
                if isinstance(msg, RankFailed):
                    raise RankPoolError(
                        f"rank {msg.rank} failed to start: {msg.error}\n{msg.traceback}"
                    )
                if isinstance(msg, RankReady):
                    self.ready[msg.rank] = msg
        except BaseException:
            self.close()
            raise

    def _spawn(self, rank: int) -> None:
        assert self._store is not None
        spec = RankSpec(
            model=self.model,
            model_dir=self.model_dir,
            engine=self.engine,
            world_size=self.world_size,
            worker_groups=self.groups,
            store_host="127.0.0.1",
            store_port=self._store.port,
            group_generations=tuple(sorted(self.generations.items())),
        )
        ctx = mp.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        res_recv, res_send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=rank_main,
            args=(rank, spec, cmd_recv, res_send),
            name=f"vertumnus-rank{rank}",
            daemon=True,
        )
        proc.start()
        cmd_recv.close()  # the child's ends: only the rank holds them now
        res_send.close()
        self._commands[rank] = _CommandSender(cmd_send, f"vertumnus-send{rank}")
        self._results[rank] = res_recv
        self._procs[rank] = proc

    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        """Kill ``ranks`` (whatever state they are in) and start them again; the
        groups they share with other ranks move to the next generation. Returns those
        groups with their new generation: each live member must form them anew
        (``RebuildGroups``) while the new processes start. Their ``RankReady`` comes
        through ``channels``, which change for these ranks."""
        dead = set(ranks)
        for rank in dead:
            proc = self._procs[rank]
            if proc is not None and proc.is_alive():
                proc.kill()
            if proc is not None:
                proc.join(5.0)
            self._results[rank].close()
            self._commands[rank].stop(2.0)
            self.ready.pop(rank, None)
        rebuild = []
        for group in self.groups:
            if dead & set(group):
                self.generations[group] = self.generations.get(group, 0) + 1
                if set(group) - dead:
                    rebuild.append((group, self.generations[group]))
        self._pending = [m for m in self._pending if getattr(m, "rank", None) not in dead]
        for rank in sorted(dead):
            self._spawn(rank)
        return rebuild

    def kill(self, rank: int) -> None:
        """SIGKILL one rank process (a hung rank; tests)."""
        proc = self._procs[rank]
        if proc is not None and proc.is_alive():
            proc.kill()

    def pid(self, rank: int) -> int | None:
        proc = self._procs[rank]
        return None if proc is None else proc.pid

    def send(self, rank: int, msg: object) -> None:
        """Never blocks: the queue's feeder thread writes to the rank."""
        self._commands[rank].put(msg)

    def channels(self) -> list[tuple[int, Any, int]]:
        """(rank, result connection, process sentinel) of every rank: an event loop can
        watch them directly (``loop.add_reader``) instead of calling ``poll``."""
        return [
            (rank, conn, proc.sentinel)
            for rank, (conn, proc) in enumerate(zip(self._results, self._procs, strict=True))
        ]

    def recv(self, timeout_s: float) -> object:
        """Next message from any rank; raises RankPoolError if a rank died or time ran out."""
        msg = self.poll(timeout_s)
        if msg is None:
            raise RankPoolError(f"no answer from the ranks within {timeout_s:.0f} s")
        return msg

    def poll(self, timeout_s: float) -> object | None:
        """Next message from any rank, or None after ``timeout_s``; raises RankPoolError
        if a rank process died (after handing out what it sent before)."""
        if self._pending:
            return self._pending.pop(0)
        sentinels = {p.sentinel: p for p in self._procs}
        try:
            ready = connection.wait([*self._results, *sentinels], timeout_s)
        except (OSError, ValueError):  # closed under us: shutting down
            return None
        for conn in self._results:
            if conn in ready:
                try:
                    while conn.poll():
                        self._pending.append(conn.recv())
                except (EOFError, OSError):
                    pass  # the rank is gone; its sentinel says so below
        if self._pending:
            return self._pending.pop(0)
        dead = [sentinels[s].name for s in ready if s in sentinels]
        if dead:
            raise RankPoolError(f"rank process(es) exited unexpectedly: {', '.join(dead)}")
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to exit, wait, then terminate stragglers; idempotent."""
        procs = [p for p in self._procs if p is not None]
        for proc, commands in zip(self._procs, self._commands, strict=True):
            if proc is not None and proc.is_alive():
                commands.put(Shutdown())
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._results:
            if conn is not None:
                conn.close()
        for sender in self._commands:
            if sender is not None:
                sender.stop(2.0)  # the ranks are gone: a blocked write fails with EPIPE
        self._procs, self._commands, self._results, self._pending = [], [], [], []
        self._store = None
