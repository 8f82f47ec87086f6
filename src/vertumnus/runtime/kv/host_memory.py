"""The host tier's bytes on this host: one shared-memory segment of KV blocks, and
the copies between it and the CPU ranks' stores.

The policy decides what the tier holds (``policy/cache/host_tier.py``): when a
prefill's lease evicts blocks from its worker's ranks, ``PoolPolicy.start`` returns
them as ``Demotion``s (rank slot -> tier slot), and the run of blocks it loads back as
``Load``s (tier slot -> rank slot). Both are done here, by the coordinator, as soon as
the policy returns them: the demotions first (a load may go to a slot a demotion
empties), then the loads, all before the prefill command leaves (it writes the
evicted slots), so no rank is asked and nothing is in flight while the bytes move.
Each is a memcpy between torch views of shared memory that this process maps: the
ranks' stores (``runtime/kv/segments.py``, [slots, L, B, Hkv, D] of K, then of V)
and the tier, whose slot holds one block of one rank's store, K then V::

    tier segment: [hosts, slots per host, 2 (K, V), L * B * Hkv * D * itemsize bytes]

The tier belongs to the host, not to a worker: a split, a merge or a rank's restart
leaves it as it is (a block demoted by one worker loads into any worker of the host,
on whichever CP rank its depth now belongs to), and it is unlinked at shutdown only.
It needs the ranks' stores in this host's shared memory: ``check`` refuses the rest
(GPU ranks, rank actors on Ray nodes, the simulator's bound), and ``open`` refuses a
pool whose stores or tier the shared memory file system has no room for.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing import shared_memory

import structlog
import torch
from torch import Tensor

from vertumnus.config import ConfigError, EngineConfig
from vertumnus.engine.rank import resolve_device
from vertumnus.policy.cache.host_tier import Demotion, HostTierPolicy, Load
from vertumnus.runtime.kv import segments
from vertumnus.runtime.ranks import Ranks

log = structlog.get_logger("vertumnus")

KEY = "[cache] host_tier_bytes"


def check(
    tiers: HostTierPolicy,
    host_tier_bytes: int,
    engine: EngineConfig,
    num_devices: int,
    ranks: Ranks | None,
) -> None:
    """ConfigError unless the served pool can keep a host tier: its ``num_devices``
    ranks keep their stores on this host (``local_stores``; ``ranks`` None: a
    ``ChildRanks`` to come), on the CPU, with KV blocks; nothing to check when the
    tier is off."""
    if host_tier_bytes <= 0 and not tiers.bound:
        return
    if tiers.bound:
        raise ConfigError(
            "[cache] host_tier_bound is a bound the simulator computes: a server must "
            f"copy its KV; use {KEY}"
        )
    if not tiers.enabled or tiers.link is None:
        block = "" if tiers.link is None else f" of {tiers.link.block_bytes} bytes"
        raise ConfigError(f"{KEY} = {host_tier_bytes} holds no KV block{block}")
    needs = "needs CPU ranks that keep their KV store in this host's shared memory"
    if ranks is not None and ranks.local_stores is None:
        raise ConfigError(f"{KEY} {needs}: these ranks run elsewhere (on Ray nodes)")
    try:
        devices = {resolve_device(engine, rank).type for rank in range(num_devices)}
    except RuntimeError:
        devices = {"cuda"}
    if devices != {"cpu"}:
        raise ConfigError(
            f"{KEY} {needs}: [engine] device = {engine.device!r} puts them on the GPU "
            "(set host_tier_bytes = 0)"
        )
    if engine.kv_blocks_per_rank < 1:
        raise ConfigError(f"{KEY} {needs}: [engine] kv_blocks_per_rank = 0 keeps none")


class HostTierMemory:
    """The host tier's bytes (what ``HostTierPolicy`` decides they hold): the tier of
    every host of the pool as the policy numbers them (``hosts``: one, unless ``[pool]
    devices_per_host`` cuts this host's ranks into several), made by ``open`` once the
    ranks' stores exist, closed (unlinked) by ``close``."""

    def __init__(self, tiers: HostTierPolicy, num_devices: int) -> None:
        assert tiers.link is not None and tiers.capacity_blocks is not None
        self.block_bytes = tiers.link.block_bytes
        self.slots = tiers.capacity_blocks
        self.num_devices = num_devices
        self.hosts = 1 + max(tiers.host_of(d) for d in range(num_devices))
        self.capacity_bytes = self.hosts * self.slots * self.block_bytes
        self._shm: shared_memory.SharedMemory | None = None
        self._tier: Tensor | None = None  # [hosts, slots, 2, half a block's bytes]
        self._stores: dict[int, tuple[Tensor, Tensor]] = {}  # device -> K, V [slots, bytes]
        self.demoted = self.loaded = 0  # blocks copied, each way
        self.copy_s = 0.0  # the copies' time

    def open(self, kv: segments.KVSegments) -> None:
        """Map the ranks' stores ``kv`` (their segments made now if they are not yet)
        and make the tier; ConfigError where shared memory lacks room for either (the
        tier is then not made; closing the ranks unlinks the stores)."""
        names = kv.names(range(self.num_devices))
        missing = [rank for rank, name in enumerate(names) if name is None]
        if missing:
            raise ConfigError(
                f"{KEY} needs the ranks' KV stores in shared memory, and {segments.SHM_DIR} "
                f"has no room for those of ranks {missing} ({kv.size} bytes each): "
                f"enlarge {segments.SHM_DIR}, lower [engine] kv_blocks_per_rank, or set "
                "host_tier_bytes = 0"
            )
        store_block = kv.size // kv.shape[0]
        if store_block != self.block_bytes:
            raise RuntimeError(
                f"the policy's KV block is {self.block_bytes} bytes, the stores' {store_block}"
            )
        free = segments.free_shared_bytes()
        room = None if free is None else int(free * segments.ROOM_FRACTION)
        if room is not None and self.capacity_bytes > room:
            raise ConfigError(
                f"{KEY}: the host tier ({self.hosts} x {self.slots} blocks of "
                f"{self.block_bytes} bytes, {self.capacity_bytes} bytes) does not fit in "
                f"{segments.SHM_DIR} ({room} bytes of room): lower it or enlarge "
                f"{segments.SHM_DIR}"
            )
        self._shm = shm = shared_memory.SharedMemory(create=True, size=self.capacity_bytes)
        try:
            assert shm.buf is not None
            tier = torch.frombuffer(shm.buf[:], dtype=torch.uint8)
            tier.zero_()  # the pages exist now: no fault (nor SIGBUS) at the first copy
            self._tier = tier.view(self.hosts, self.slots, 2, self.block_bytes // 2)
            for device in range(self.num_devices):
                k, v = kv.store_bytes(device) or (None, None)
                assert k is not None and v is not None
                self._stores[device] = (_blocks(k, kv.shape[0]), _blocks(v, kv.shape[0]))
        except BaseException:
            self.close()
            raise
        log.info(
            "host_tier",
            hosts=self.hosts,
            blocks_per_host=self.slots,
            block_bytes=self.block_bytes,
            bytes=self.capacity_bytes,
        )

    def move(
        self, first_device: int, demotions: tuple[Demotion, ...], loads: tuple[Load, ...]
    ) -> float:
        """A prefill's copies on the worker whose CP rank 0 is ``first_device``: the
        demotions, then the loads. Returns their seconds."""
        tier = self._tier
        assert tier is not None, "the host tier is not open"
        began = time.perf_counter()
        for d in demotions:
            k, v = self._stores[first_device + d.rank]
            slot = tier[d.host, d.tier_slot]
            slot[0].copy_(k[d.slot])
            slot[1].copy_(v[d.slot])
        for load in loads:
            k, v = self._stores[first_device + load.rank]
            slot = tier[load.host, load.tier_slot]
            k[load.slot].copy_(slot[0])
            v[load.slot].copy_(slot[1])
        seconds = time.perf_counter() - began
        self.demoted += len(demotions)
        self.loaded += len(loads)
        self.copy_s += seconds
        return seconds

    def close(self) -> None:
        """Drop the views and unlink the tier (idempotent)."""
        self._stores.clear()
        self._tier = None
        shm, self._shm = self._shm, None
        if shm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: it goes at exit
                shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


def _blocks(half: memoryview, slots: int) -> Tensor:
    """A store's K (or V) bytes as [slots, bytes of one slot], over a slice of the view:
    the store's own view can still be released when the ranks close."""
    return torch.frombuffer(half[:], dtype=torch.uint8).view(slots, -1)
