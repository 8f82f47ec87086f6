"""Shared-memory segments that hold the KV stores of this host's CPU ranks.

A rank on the CPU keeps its paged KV store (``engine/kv_store.py``) in a segment
made here, so that the coordinator streams a hand-off's blocks straight from the
rank's own memory (``runtime/kv/handoffs.py``): no command to the rank, no gather, no
copy in this process. The coordinator writes into a store only the host tier's
loads (``host_tier.py``: into the slots a prefill's lease just took, before its
command leaves); the blocks it reads for a pull are pinned by their lease, so no
prefill or KV copy writes them meanwhile, and a reshape waits for the pulls under way
on its ranks before it switches. A pool with a host tier needs a segment for every
rank.

One segment per rank, made before the rank's first start and kept across its
restarts (a restarted worker starts with an empty index: the old contents mean
nothing); all are unlinked at ``close``. A segment is made only where the shared
memory file system has room for it: tmpfs takes pages as they are written, and a
store larger than what is left would kill its rank with SIGBUS mid-prefill. Without
one, the rank keeps its store in its own memory and a pull reads through the rank
(``KVRead``). GPU ranks never use one.
"""

from __future__ import annotations

import contextlib
import math
import os
from multiprocessing import shared_memory

import structlog
import torch

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.engine.kv_store import store_shape
from vertumnus.engine.rank import resolve_device
from vertumnus.engine.weights import resolve_dtype
from vertumnus.policy.cache.index import BlockLocation

log = structlog.get_logger("vertumnus")

SHM_DIR = "/dev/shm"
ROOM_FRACTION = 0.8  # of the free shared memory at start, at most, for the stores


def free_shared_bytes() -> int | None:
    """Bytes free on the shared memory file system (None: no such file system here,
    e.g. macOS: its shared memory is not a file system that fills up)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def kv_dtype(engine: EngineConfig) -> torch.dtype:
    """The dtype the ranks keep their KV in (CUDA asked for and absent: CUDA's)."""
    try:
        device = resolve_device(engine, 0)
    except RuntimeError:
        device = torch.device("cuda")
    return resolve_dtype(engine.dtype, device)


def served_block_bytes(model: ModelConfig, engine: EngineConfig) -> int:
    """The bytes of one KV block of one rank's store: K and V of every layer for
    ``block_size`` tokens, at the ranks' dtype (``PoolSpec.block_bytes``)."""
    return model.kv_bytes(kv_dtype(engine).itemsize) * engine.block_size


class KVSegments:
    def __init__(self, model: ModelConfig, engine: EngineConfig) -> None:
        self.engine = engine
        self.shape = store_shape(model, engine.kv_blocks_per_rank, engine.block_size)
        self.dtype = resolve_dtype(engine.dtype, torch.device("cpu"))
        self.size = 2 * math.prod(self.shape) * self.dtype.itemsize
        free = free_shared_bytes()
        self._room = None if free is None else int(free * ROOM_FRACTION)
        self._made: dict[int, shared_memory.SharedMemory] = {}
        self._views: dict[int, tuple[memoryview, memoryview]] = {}
        self._refused = False

    def names(self, ranks: range) -> tuple[str | None, ...]:
        """The segment of each rank in ``ranks`` (made now where missing and there is
        room), None for GPU ranks and those refused."""
        return tuple(self._name(rank) for rank in ranks)

    def _name(self, rank: int) -> str | None:
        shm = self._made.get(rank)
        if shm is not None:
            return shm.name
        try:
            device = resolve_device(self.engine, rank)
        except RuntimeError:  # CUDA asked for and absent: the rank says so as it starts
            return None
        if device.type != "cpu" or self._refused or self.size == 0:
            return None  # (a rank without KV blocks has no store to share)
        if self._room is not None and self.size * (len(self._made) + 1) > self._room:
            self._refused = True
            log.warning(
                "kv_store_private",
                reason="not enough shared memory for the KV stores",
                store_bytes=self.size,
                room_bytes=self._room,
                shm=SHM_DIR,
            )
            return None
        shm = shared_memory.SharedMemory(create=True, size=self.size)
        self._made[rank] = shm
        # Written once here: the pages exist (as torch.zeros made them before) and are
        # mapped in this process, so a pull does not fault on each 4 KB it sends.
        assert shm.buf is not None
        torch.frombuffer(shm.buf, dtype=torch.uint8).zero_()
        return shm.name

    def store_bytes(self, rank: int) -> tuple[memoryview, memoryview] | None:
        """The bytes of ``rank``'s K and of its V ([slots, L, B, Hkv, D] each), as
        this process maps them (None: the rank has no segment)."""
        got = self._views.get(rank)
        if got is None:
            shm = self._made.get(rank)
            if shm is None:
                return None
            assert shm.buf is not None
            half = self.size // 2
            got = self._views[rank] = (shm.buf[:half], shm.buf[half:])
        return got

    def close(self) -> None:
        """Unlink every segment (the ranks are gone, or keep their mapping until they
        exit)."""
        for views in self._views.values():
            for view in views:
                view.release()
        self._views.clear()
        for shm in self._made.values():
            with contextlib.suppress(BufferError):  # a socket still holds a view
                shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        self._made.clear()


def store_runs(
    stores: dict[int, tuple[memoryview, memoryview]],
    first_device: int,
    blocks: list[BlockLocation],
    block_bytes: int,
) -> list[memoryview]:
    """A wire chunk of whole blocks, K then V [m, L, B, Hkv, D], as runs of the
    stores (by device, their K and V bytes; a store is [slots, L, B, Hkv, D] of
    ``block_bytes`` a slot): a block is one run, and blocks in consecutive slots of
    one rank are one run together."""
    views = []
    for half in (0, 1):
        runs: list[list[int]] = []  # [device, first byte, end]
        for loc in blocks:
            device, at = first_device + loc.rank, loc.slot * block_bytes
            if runs and runs[-1][0] == device and runs[-1][2] == at:
                runs[-1][2] += block_bytes
            else:
                runs.append([device, at, at + block_bytes])
        views += [stores[device][half][a:b] for device, a, b in runs]
    return views
