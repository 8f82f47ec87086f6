"""KV reads of a hand-off: a run of a worker's blocks fetched from its ranks, in
sequence order, as the wire format wants them (``kv_wire.py``).

One ``KVRead`` per rank involved, sent at once; ranks on the coordinator's host
(those with ``local_stores``: ``ChildRanks``) write their blocks straight into a
shared-memory segment of this process (``engine/shared_rows.py``), at their rows, so
the reads of a CP worker come back already interleaved; rank actors on Ray nodes
send their rows as bytes, put back in order here. A few segments are reused
(``SEGMENTS``): a read hands its segment to the caller, who gives it back once the
bytes have left (``give_back_segment``, or ``give_back`` for a read nobody will
write). Rank answers come through the rank link (``answer``, ``fail``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from multiprocessing import shared_memory
from typing import Any

import torch
from torch import Tensor

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.engine.messages import KVData, KVRead, KVSend, RankFailed
from vertumnus.policy.cache.index import BlockLocation
from vertumnus.runtime.kv.segments import kv_dtype, served_block_bytes
from vertumnus.runtime.ranks import CurrentRanks, RanksError

CHUNK_BYTES = 8 << 20  # KV read from the ranks per chunk of the stream (at least a block)
SEGMENTS = 6  # shared-memory segments kept for reads (three per pull under way)


class KVReads:
    """Given the engine's settings, the model's shape and the ranks (``ranks.now``:
    None before they start or after they close)."""

    def __init__(self, engine: EngineConfig, model: ModelConfig, ranks: CurrentRanks) -> None:
        self.engine, self.model, self.ranks = engine, model, ranks
        self._reads: dict[tuple[int, int], asyncio.Future[KVData]] = {}  # (read, rank)
        self._ids = itertools.count(1)
        self._free: list[shared_memory.SharedMemory] = []  # segments not in use
        self._segments: list[shared_memory.SharedMemory] = []  # every one made
        self._dtype: torch.dtype | None = None

    def close(self) -> None:
        for shm in self._segments:
            with contextlib.suppress(BufferError):  # a socket holds a view: it goes at exit
                shm.close()
            shm.unlink()
        self._segments, self._free = [], []

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the ranks keep their KV in."""
        if self._dtype is None:
            self._dtype = kv_dtype(self.engine)
        return self._dtype

    def block_bytes(self) -> int:
        return served_block_bytes(self.model, self.engine)

    def give_back(self, read: asyncio.Future[tuple[int, Any, Any]]) -> None:
        """A read's segment back (a done callback of a read nobody will write)."""
        if not read.cancelled() and read.exception() is None:
            _, payload, shm = read.result()
            if shm is not None:
                self.give_back_segment(payload, shm)

    def give_back_segment(self, payload: memoryview, shm: shared_memory.SharedMemory) -> None:
        """A read's segment, once its bytes left."""
        payload.release()
        self._free.append(shm)

    def _dispatch(
        self, first_device: int, blocks: list[BlockLocation], command: Any
    ) -> tuple[int, list[tuple[int, list[BlockLocation], asyncio.Future[KVData]]]]:
        """Send ``command(read_id, cp_rank, locs)`` to each rank holding some of
        ``blocks`` (one read id for all), each answer awaited: the read id, and per
        rank in CP order its blocks and the future of its answer."""
        ranks = self.ranks.now
        if ranks is None:
            raise RanksError("the pool is stopped")
        loop = asyncio.get_running_loop()
        by_rank: dict[int, list[BlockLocation]] = {}
        for loc in blocks:
            by_rank.setdefault(loc.rank, []).append(loc)
        read_id = next(self._ids)
        sent = []
        for cp_rank, locs in sorted(by_rank.items()):
            device = first_device + cp_rank
            wait: asyncio.Future[KVData] = loop.create_future()
            self._reads[(read_id, device)] = wait
            sent.append((cp_rank, locs, wait))
            ranks.send(device, command(read_id, cp_rank, locs))
        return read_id, sent

    async def _answers(
        self, read_id: int, sent: list[tuple[int, list[BlockLocation], asyncio.Future[KVData]]]
    ) -> list[KVData]:
        """Every rank's answer to ``read_id`` (a ``RankFailed`` or the timeout raises)."""
        try:
            waits = (wait for _, _, wait in sent)
            timeout = self.engine.rank_timeout_s
            return list(await asyncio.wait_for(asyncio.gather(*waits), timeout))
        finally:
            for key in [k for k in self._reads if k[0] == read_id]:
                del self._reads[key]

    def send(
        self, first_device: int, blocks: list[BlockLocation], store: tuple[str, int], prefix: str
    ) -> tuple[list[dict[str, Any]], asyncio.Future[Any]]:
        """Have each rank holding some of ``blocks`` send them to a decode server
        point to point (``KVSend``, group ``prefix/<CP rank>``): the layout the
        decode server receives by (per rank: its group and the blocks' depths, in the
        order sent), and a future of every rank's answer."""
        timeout_s = self.engine.rank_timeout_s

        def command(read_id: int, cp_rank: int, locs: list[BlockLocation]) -> KVSend:
            slots = tuple(loc.slot for loc in locs)
            return KVSend(read_id, slots, store[0], store[1], f"{prefix}/{cp_rank}", timeout_s)

        read_id, sent = self._dispatch(first_device, blocks, command)
        layout = [
            {"group": f"{prefix}/{cp_rank}", "depths": [loc.depth for loc in locs]}
            for cp_rank, locs, _ in sent
        ]
        return layout, asyncio.ensure_future(self._answers(read_id, sent))

    def read(
        self, first_device: int, group: list[BlockLocation]
    ) -> asyncio.Future[tuple[int, Any, Any]]:
        """Read a run of consecutive blocks from their ranks (one ``KVRead`` per rank,
        sent now), in sequence order: (tokens, their bytes as the wire wants them, the
        shared memory they are in, or None: the caller gives it back)."""
        block, first = self.engine.block_size, group[0].depth
        rows = len(group) * block
        size = len(group) * self.block_bytes()
        on_this_host = self.ranks.now is not None and self.ranks.now.local_stores is not None
        shm = self._segment(size) if on_this_host else None

        def command(read_id: int, cp_rank: int, locs: list[BlockLocation]) -> KVRead:
            slots = tuple(loc.slot for loc in locs)
            if shm is None:
                return KVRead(read_id, slots)
            at = tuple((loc.depth - first) * block for loc in locs)
            return KVRead(read_id, slots, shm.name, rows, at)

        try:
            read_id, sent = self._dispatch(first_device, group, command)
        except BaseException:
            if shm is not None:
                self._free.append(shm)
            raise

        async def gather() -> tuple[int, Any, Any]:
            kept = answered = False
            try:
                answers = await self._answers(read_id, sent)
                answered = True
                if shm is not None:
                    assert shm.buf is not None
                    kept = True
                    return rows, shm.buf[:size], shm
            finally:
                if shm is not None and not kept:
                    if answered:
                        self._free.append(shm)
                    else:  # a rank may still write into it: never reused
                        self._discard(shm)
            data = [answer.data for answer in answers if answer.data is not None]
            assert len(data) == len(answers), "a rank answered a read without its data"
            if len(data) == 1:
                return rows, bytes_of(data[0]), None
            shape = (*data[0].shape[:2], rows, *data[0].shape[3:])
            out = torch.empty(shape, dtype=data[0].dtype)
            for (_, locs, _), part in zip(sent, data, strict=True):
                for i, loc in enumerate(locs):
                    at = (loc.depth - first) * block
                    out[:, :, at : at + block] = part[:, :, i * block : (i + 1) * block]
            return rows, bytes_of(out), None

        return asyncio.ensure_future(gather())

    def _segment(self, size: int) -> shared_memory.SharedMemory:
        """A free segment of at least ``size`` bytes (made when none is)."""
        for shm in self._free:
            if shm.size >= size:
                self._free.remove(shm)
                return shm
        if len(self._segments) >= SEGMENTS and self._free:
            self._discard(self._free.pop(0))  # too small for this read: room for a larger one
        shm = shared_memory.SharedMemory(create=True, size=max(size, CHUNK_BYTES))
        self._segments.append(shm)
        return shm

    def _discard(self, shm: shared_memory.SharedMemory) -> None:
        """Unmap and unlink ``shm`` here (a rank still writing keeps its own mapping)."""
        self._segments.remove(shm)
        shm.close()
        shm.unlink()

    def answer(self, msg: KVData | RankFailed) -> None:
        """A rank's answer to a ``KVRead`` (fed by the rank link)."""
        if isinstance(msg, KVData):
            wait = self._reads.get((msg.read_id, msg.rank))
            if wait is not None and not wait.done():
                wait.set_result(msg)
            return
        for (read_id, _), wait in list(self._reads.items()):
            if read_id == msg.read_id and not wait.done():
                wait.set_exception(RanksError(f"rank {msg.rank}: {msg.error}"))

    def fail(self, error: str, ranks: set[int] | None = None) -> None:
        """Fail the reads waiting on ``ranks`` (None: every read)."""
        for (_, rank), wait in list(self._reads.items()):
            if (ranks is None or rank in ranks) and not wait.done():
                wait.set_exception(RanksError(error))


def bytes_of(rows: Tensor) -> memoryview:
    """The bytes of [2, layers, t, Hkv, D] rows (K, then V), without a copy."""
    return rows.contiguous().view(torch.uint8).numpy().data.cast("B")
