"""A lease's KV as the stream of ``kv_wire.py``: its header, its chunks of blocks,
its length, and its bytes written to a ``Sink`` (the route's socket).

CPU ranks on this host keep their stores in shared memory that this process maps
(``runtime/kv/segments.py``): their blocks leave straight from there, as whole
blocks, one ``writev`` run per run of slots, with no command to the ranks and no
copy. Other ranks (GPUs, rank actors on Ray nodes) are read a chunk ahead of the one
written (``runtime/kv/reads.py``, ``KVRead``). The lease's end, and the pulls under
way, are ``runtime/kv/handoffs.py``'s.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from vertumnus.config import ModelConfig
from vertumnus.kv_wire import CHUNK_BLOCKS, CHUNK_STATE, END, KVHeader, chunk_header
from vertumnus.policy.cache.index import BlockLocation, WorkerCacheIndex
from vertumnus.runtime.kv.leases import Lease, Sink, check_current
from vertumnus.runtime.kv.reads import CHUNK_BYTES, KVReads, bytes_of
from vertumnus.runtime.kv.segments import store_runs
from vertumnus.runtime.ranks import CurrentRanks
from vertumnus.runtime.serve_config import ServeConfig

READ_AHEAD = 2  # chunks read from the ranks ahead of the one written


class KVStream:
    """Given the serving configuration, the model's shape, the KV reads and the ranks
    (``ranks.now``: None before they start or after they close)."""

    def __init__(
        self,
        serve: ServeConfig,
        model: ModelConfig,
        reads: KVReads,
        ranks: CurrentRanks,
        indexes: Mapping[int, WorkerCacheIndex],
    ) -> None:
        self.serve, self.model, self.reads, self.ranks = serve, model, reads, ranks
        self.indexes = indexes  # the policy's, read to see a pull's worker still there

    def header(self, lease: Lease, dtype: torch.dtype) -> KVHeader:
        cfg, engine = self.model, self.serve.engine
        return KVHeader(
            handle=lease.handle,
            num_tokens=lease.num_tokens,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=str(dtype).removeprefix("torch."),
            block_size=engine.block_size,
            model=self.serve.model,
            state_bytes=0 if lease.state is None else int(lease.state.numel()),
        )

    def layout(self, lease: Lease) -> tuple[KVHeader, list[list[BlockLocation]]]:
        """The stream's header and its chunks of blocks."""
        blocks, per = lease.blocks, max(1, CHUNK_BYTES // self.reads.block_bytes())
        groups = [blocks[i : i + per] for i in range(0, len(blocks), per)]
        dtype = self.reads.kv_dtype if groups or lease.rows is None else lease.rows.dtype
        return self.header(lease, dtype), groups

    def length(self, lease: Lease) -> int:
        """The length of the lease's stream (a pull's Content-Length)."""
        header, groups = self.layout(lease)
        rows = 0 if lease.rows is None else int(lease.rows.shape[2])
        chunks = len(groups) + (1 if rows else 0) + (0 if lease.state is None else 1)
        return len(header.encode()) + 8 * (chunks + 1) + header.total_bytes

    async def write(self, lease: Lease, sink: Sink, devices: set[int]) -> int:
        """Write the lease's KV, from the stores of ``devices``, to ``sink``; the bytes
        written, every one of them out of this process. The pull stops
        (``leases.check_current``) when its lease ended or its worker's index went,
        checked before each chunk and before the last flush."""
        sent = 0
        ahead: deque[asyncio.Future[tuple[int, Any, Any]]] = deque()
        try:
            header, groups = self.layout(lease)
            stores = self._stores(devices)
            head = header.encode()
            await sink.start(head)
            sent += len(head)
            if stores is None:
                for group in groups[:READ_AHEAD]:
                    ahead.append(self.reads.read(lease.first_device, group))
            for n, group in enumerate(groups):
                check_current(lease, self.indexes)
                if stores is not None:
                    size = self.reads.block_bytes() // 2
                    views = store_runs(stores, lease.first_device, group, size)
                    tokens = len(group) * self.serve.engine.block_size
                    sink.writev([chunk_header(tokens, CHUNK_BLOCKS), *views])
                    sent += 8 + sum(len(v) for v in views)
                    await sink.drain()
                    continue
                tokens, payload, shm = await ahead.popleft()
                if n + READ_AHEAD < len(groups):
                    ahead.append(self.reads.read(lease.first_device, groups[n + READ_AHEAD]))
                sent += len(payload) + 8
                try:
                    sink.writev([chunk_header(tokens), payload])
                    await sink.flush()  # the segment is reused next
                finally:
                    if shm is not None:
                        self.reads.give_back_segment(payload, shm)
            if lease.state is not None:  # DeepSeek-V4's, whole
                payload = bytes_of(lease.state)
                sink.writev([chunk_header(lease.num_tokens, CHUNK_STATE), payload])
                sent += len(payload) + 8
            elif lease.rows is not None and lease.rows.shape[2]:
                payload = bytes_of(lease.rows)
                sink.writev([chunk_header(int(lease.rows.shape[2])), payload])
                sent += len(payload) + 8
            sink.writev([END])
            sent += len(END)
            check_current(lease, self.indexes)
            await sink.flush()  # nothing of the store left in a buffer: the pin may go
        finally:
            for read in ahead:  # cut short: the reads ahead give their memory back
                read.add_done_callback(self.reads.give_back)
        return sent

    def _stores(self, devices: set[int]) -> dict[int, tuple[memoryview, memoryview]] | None:
        """The K and V bytes of the store of each of ``devices``, mapped here; None if
        one is not (GPU ranks, rank actors on Ray nodes)."""
        ranks = self.ranks.now
        local = None if ranks is None else ranks.local_stores
        if local is None:
            return None
        stores = {}
        for device in devices:
            store = local.store_bytes(device)
            if store is None:
                return None
            stores[device] = store
        return stores
