"""The event loop's watch on the ranks: their answer pipes and their sentinels.

Owns reading the ranks' answers without blocking and without a thread: the loop's
poller wakes on a pipe, the bytes are buffered and framed as
``multiprocessing.connection`` frames them (a 4-byte big-endian length, or -1 then
an 8-byte one), and each whole message is unpickled and handed to the switchboard as
``RankAnswer`` (the rank link takes it). A sentinel that becomes readable (a local
rank process ended, or Ray reported a rank actor, its process or its node gone) is
handed on once, as ``RankExited`` (recovery takes it). It does not interpret any
message.

The pipes come only from this pool's own rank processes, or from a ``RayRanks``
callback thread, which writes what the pool's own rank actors returned through Ray;
a Ray cluster admits only holders of its token (``cluster/auth.py``) unless
``[cluster] private_network`` says that no one else can reach it.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
from collections.abc import Iterable
from typing import Any

from vertumnus.runtime.intents import RankAnswer, RankExited, Routes

_CHUNK = 1 << 20


class RankWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, switchboard: Routes) -> None:
        self._loop, self._switchboard = loop, switchboard
        self._buffers: dict[int, bytearray] = {}  # rank -> bytes read, not yet a message

    def watch(self, channels: Iterable[tuple[int, Any, int]]) -> None:
        """Start watching (rank, answer connection, sentinel) triples."""
        for rank, conn, sentinel in channels:
            self._buffers[rank] = bytearray()
            self._loop.add_reader(conn.fileno(), self._readable, rank, conn)
            self._loop.add_reader(sentinel, self._exited, rank, sentinel)

    def unwatch(self, channels: Iterable[tuple[int, Any, int]]) -> None:
        for _, conn, sentinel in channels:
            self._loop.remove_reader(sentinel)
            if not conn.closed:
                self._loop.remove_reader(conn.fileno())

    def _exited(self, rank: int, sentinel: int) -> None:
        self._loop.remove_reader(sentinel)
        self._switchboard.route(RankExited(rank))

    def _readable(self, rank: int, conn: Any) -> None:
        """Read what ``rank`` wrote: the poller made the pipe non-blocking, so a large
        answer can arrive in pieces."""
        fd = conn.fileno()
        buf = self._buffers.setdefault(rank, bytearray())
        try:
            while True:
                chunk = os.read(fd, _CHUNK)
                if not chunk:  # the rank closed its end
                    self._loop.remove_reader(fd)
                    break
                buf += chunk
                if len(chunk) < _CHUNK:
                    break
        except BlockingIOError:
            pass
        except OSError:
            self._loop.remove_reader(fd)
        while len(buf) >= 4:
            (size,) = struct.unpack("!i", buf[:4])
            header = 4
            if size == -1:
                if len(buf) < 12:
                    break
                (size,) = struct.unpack("!Q", buf[4:12])
                header = 12
            if len(buf) < header + size:
                break
            payload = bytes(buf[header : header + size])
            del buf[: header + size]
            self._switchboard.route(RankAnswer(pickle.loads(payload)))
