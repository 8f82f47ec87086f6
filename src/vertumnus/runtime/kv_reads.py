"""KV reads of a hand-off: a run of a worker's blocks fetched from its ranks, in
sequence order, as the wire format wants them (``handoff/wire.py``).

One ``KVRead`` per rank involved, sent at once; ranks on the coordinator's host
(``RankPool``) write their blocks straight into a shared-memory segment of this
process (``engine/shared_rows.py``), at their rows, so the reads of a CP worker
come back already interleaved; ranks under a node agent send their rows as bytes,
put back in order here. A few segments are reused (``SEGMENTS``): a read made
``in_place`` hands its segment to the caller, who gives it back once the bytes
have left (``give_back``); otherwise the bytes are copied out and the segment is
free at once. Rank answers come through the rank link (``answer``, ``fail``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from vertumnus.engine.messages import KVData, KVRead, KVSend, RankFailed
from vertumnus.engine.rank import resolve_device
from vertumnus.engine.weights import resolve_dtype
from vertumnus.policy.cache_index import BlockLocation
from vertumnus.runtime.pool import RankPool, RankPoolError

if TYPE_CHECKING:
    from vertumnus.runtime.coordinator import Coordinator

CHUNK_BYTES = 8 << 20  # KV read from the ranks per chunk of the stream (at least a block)
SEGMENTS = 6  # shared-memory segments kept for reads (three per pull under way)


class KVReads:
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
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
            engine = self.coord.cfg.engine
            self._dtype = resolve_dtype(engine.dtype, resolve_device(engine, 0))
        return self._dtype

    def block_bytes(self) -> int:
        cfg, block = self.coord.model_cfg, self.coord.cfg.engine.block_size
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        return per_token * block * self.kv_dtype.itemsize

    def give_back(self, read: asyncio.Future[tuple[int, Any, Any]]) -> None:
        """A read's segment back (a done callback of a read nobody will write)."""
        if not read.cancelled() and read.exception() is None:
            _, payload, shm = read.result()
            if shm is not None:
                self.give_back_segment(payload, shm)

    def give_back_segment(self, payload: memoryview, shm: shared_memory.SharedMemory) -> None:
        """An ``in_place`` read's segment, once its bytes left."""
        payload.release()
        self._free.append(shm)

    def send(
        self,
        first_device: int,
        blocks: list[BlockLocation],
        store: tuple[str, int],
        prefix: str,
        timeout_s: float,
    ) -> tuple[list[dict[str, Any]], asyncio.Future[Any]]:
        """Have each rank holding some of ``blocks`` send them to a decode server
        point to point (``KVSend``, group ``prefix/<CP rank>``): the layout the
        decode server receives by (per rank: its group and the blocks' depths, in the
        order sent), and a future of every rank's answer."""
        pool = self.coord.pool
        if pool is None:
            raise RankPoolError("the pool is stopped")
        loop = asyncio.get_running_loop()
        by_rank: dict[int, list[BlockLocation]] = {}
        for loc in blocks:
            by_rank.setdefault(loc.rank, []).append(loc)
        read_id = next(self._ids)
        layout, waits = [], []
        for cp_rank, locs in sorted(by_rank.items()):
            device = first_device + cp_rank
            wait: asyncio.Future[KVData] = loop.create_future()
            self._reads[(read_id, device)] = wait
            waits.append(wait)
            name = f"{prefix}/{cp_rank}"
            slots = tuple(loc.slot for loc in locs)
            pool.send(device, KVSend(read_id, slots, store[0], store[1], name, timeout_s))
            layout.append({"group": name, "depths": [loc.depth for loc in locs]})

        async def done() -> None:
            try:
                await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
            finally:
                for key in [k for k in self._reads if k[0] == read_id]:
                    del self._reads[key]

        return layout, asyncio.ensure_future(done())

    def read(
        self, first_device: int, group: list[BlockLocation], in_place: bool = False
    ) -> asyncio.Future[tuple[int, Any, Any]]:
        """Read a run of consecutive blocks from their ranks (one ``KVRead`` per rank,
        sent now), in sequence order: (tokens, their bytes as the wire wants them, the
        shared memory they are in when ``in_place``: the caller gives it back)."""
        pool = self.coord.pool
        if pool is None:
            raise RankPoolError("the pool is stopped")
        loop = asyncio.get_running_loop()
        block, first = self.coord.cfg.engine.block_size, group[0].depth
        size = len(group) * self.block_bytes()
        shm = self._segment(size) if isinstance(pool, RankPool) else None
        by_rank: dict[int, list[BlockLocation]] = {}
        for loc in group:
            by_rank.setdefault(loc.rank, []).append(loc)
        read_id = next(self._ids)
        waits = []
        for cp_rank, locs in sorted(by_rank.items()):
            device = first_device + cp_rank
            wait: asyncio.Future[KVData] = loop.create_future()
            self._reads[(read_id, device)] = wait
            waits.append((locs, wait))
            slots = tuple(loc.slot for loc in locs)
            if shm is None:
                pool.send(device, KVRead(read_id, slots))
            else:
                at = tuple((loc.depth - first) * block for loc in locs)
                pool.send(device, KVRead(read_id, slots, shm.name, len(group) * block, at))

        async def gather() -> tuple[int, Any, Any]:
            kept = False
            try:
                timeout = self.coord.cfg.engine.rank_timeout_s
                answers = await asyncio.wait_for(asyncio.gather(*(w for _, w in waits)), timeout)
                if shm is not None:
                    assert shm.buf is not None
                    if not in_place:
                        return len(group) * block, bytes(shm.buf[:size]), None
                    kept = True
                    return len(group) * block, shm.buf[:size], shm
            finally:
                for key in [k for k in self._reads if k[0] == read_id]:
                    del self._reads[key]
                if shm is not None and not kept:
                    self._free.append(shm)
            rows = [answer.data for answer in answers if answer.data is not None]
            assert len(rows) == len(answers), "a rank answered a read without its data"
            if len(rows) == 1:
                return len(group) * block, bytes_of(rows[0]), None
            out = torch.empty((*rows[0].shape[:2], len(group) * block, *rows[0].shape[3:]))
            out = out.to(rows[0].dtype)
            for (locs, _), data in zip(waits, rows, strict=True):
                for i, loc in enumerate(locs):
                    at = (loc.depth - first) * block
                    out[:, :, at : at + block] = data[:, :, i * block : (i + 1) * block]
            return len(group) * block, bytes_of(out), None

        return asyncio.ensure_future(gather())

    def _segment(self, size: int) -> shared_memory.SharedMemory:
        """A free segment of at least ``size`` bytes (made when none is)."""
        for shm in self._free:
            if shm.size >= size:
                self._free.remove(shm)
                return shm
        if len(self._segments) >= SEGMENTS and self._free:
            old = self._free.pop(0)  # too small for this read: make room for a larger one
            self._segments.remove(old)
            old.close()
            old.unlink()
        shm = shared_memory.SharedMemory(create=True, size=max(size, CHUNK_BYTES))
        self._segments.append(shm)
        return shm

    def answer(self, msg: KVData | RankFailed) -> None:
        """A rank's answer to a ``KVRead`` (fed by the rank link)."""
        if isinstance(msg, KVData):
            wait = self._reads.get((msg.read_id, msg.rank))
            if wait is not None and not wait.done():
                wait.set_result(msg)
            return
        for (read_id, _), wait in list(self._reads.items()):
            if read_id == msg.read_id and not wait.done():
                wait.set_exception(RankPoolError(f"rank {msg.rank}: {msg.error}"))

    def fail(self, error: str, ranks: set[int] | None = None) -> None:
        """Fail the reads waiting on ``ranks`` (None: every read)."""
        for (_, rank), wait in list(self._reads.items()):
            if (ranks is None or rank in ranks) and not wait.done():
                wait.set_exception(RankPoolError(error))


def bytes_of(rows: Tensor) -> memoryview:
    """The bytes of [2, layers, t, Hkv, D] rows (K, then V), without a copy."""
    return rows.contiguous().view(torch.uint8).numpy().data.cast("B")
