"""This host's rank processes, by global rank: each a fork of a ``forkserver`` that
imported the engine once (never of the coordinator: a restart imports no torch),
with a command pipe written by a sender thread and an answer pipe; kill, and an
orderly close that leaves no orphan.

Commands go through one one-way pipe per rank, written by a sender thread of this
process (``_CommandSender``), so a send never blocks the caller even when the rank
is busy and the message is larger than a pipe's buffer. (Writing the pipe directly
deadlocked: the coordinator blocked writing a large KV message to a busy rank,
while that rank blocked writing its answer to the coordinator.) This process keeps
no copy of a command pipe's read end, so once a rank is gone a pending write fails
with EPIPE and the sender ends; nothing blocks shutdown. The coordinator's
``ChildRanks`` (``ranks.py``) holds one ``LocalRanks``.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch.multiprocessing as mp

from vertumnus.engine.messages import Shutdown
from vertumnus.engine.rank import RankSpec, rank_main


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


def _context() -> Any:
    """``forkserver``, the engine preloaded (each rank a fork of it: no imports)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vertumnus.engine.rank"])
    return ctx


class LocalRanks:
    """The rank processes of this host, by global rank: start (``forkserver`` context, a
    command pipe written by a ``_CommandSender`` and an answer pipe each), kill, and
    an orderly close. The coordinator's ``ChildRanks`` holds one."""

    def __init__(self) -> None:
        self.procs: dict[int, Any] = {}
        self.results: dict[int, Any] = {}  # Connection per rank, rank -> here
        self._commands: dict[int, _CommandSender] = {}

    def spawn(self, rank: int, spec: RankSpec) -> None:
        ctx = _context()
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        res_recv, res_send = ctx.Pipe(duplex=False)
        args = (rank, spec, cmd_recv, res_send)
        proc = ctx.Process(target=rank_main, args=args, name=f"vertumnus-rank{rank}", daemon=True)
        proc.start()
        cmd_recv.close()  # the child's ends: only the rank holds them now
        res_send.close()
        self._commands[rank] = _CommandSender(cmd_send, f"vertumnus-send{rank}")
        self.results[rank] = res_recv
        self.procs[rank] = proc

    def send(self, rank: int, msg: object) -> None:
        """Never blocks: the rank's sender thread writes it."""
        self._commands[rank].put(msg)

    def kill(self, rank: int) -> None:
        proc = self.procs.get(rank)
        if proc is not None and proc.is_alive():
            proc.kill()

    def stop(self, rank: int) -> None:
        """Kill ``rank`` (whatever state it is in) and forget its pipes."""
        proc = self.procs.pop(rank, None)
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        conn = self.results.pop(rank, None)
        if conn is not None:
            conn.close()
        sender = self._commands.pop(rank, None)
        if sender is not None:
            sender.stop(2.0)

    def close(self, timeout_s: float) -> None:
        """Ask every rank to exit, wait, then terminate stragglers; idempotent."""
        for rank, proc in self.procs.items():
            if proc.is_alive():
                self._commands[rank].put(Shutdown())
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.results.values():
            conn.close()
        for sender in self._commands.values():
            sender.stop(2.0)  # the ranks are gone: a blocked write fails with EPIPE
        self.procs, self.results, self._commands = {}, {}, {}
