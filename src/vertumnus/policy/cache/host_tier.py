"""The second KV tier: each host's memory keeps the blocks its ranks evicted (docs/cache.md,
"The host tier").

A block a rank evicts is *demoted* to its host's tier: written back from the device
(device-to-host bandwidth, on the host's own copy lane, before the prefill that
evicted it writes its slot) into a tier slot, where it is loadable once the write is
done. The tier keeps whole blocks by id (ids are chained hashes: an id names its whole
prefix), evicts by LRU, and refreshes a block whenever a request on that host reuses
it, from either tier. A prefix run the worker lacks on its ranks but finds in the
tiers is *loaded* (host-to-device from its own host's tier, over the network from
another host's where the pool has one, ``HostLink.net_bytes_s``; block j goes to CP
rank j % C, so each rank loads its own blocks and the ranks load at once) when that
costs less than computing it. The load runs on the worker before its prefill; the
copy stays in the tier.

The bound (``bound = True``): one tier for the whole pool, of unbounded size, into
which every committed block is written as well: every prefix ever seen is reusable at
the load-back cost.

Pure Python, clock-free (``now`` is an argument). Not owned here: moving bytes (the
drivers: the simulator only times it, the coordinator copies shared memory), which
prefill loads what (``policy/stack/prefills.py``), placement's prices (``scheduler``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vertumnus.policy.cache.host_slots import HostSlots, TierStats
from vertumnus.policy.costs import ReuseCurve

# Documented defaults where a profile has no measured host link: H100 SXM on PCIe
# Gen5 x16, pinned host memory, about 50 GB/s each way per GPU (docs/gpu-profile.md).
DEFAULT_D2H_BYTES_S = 50e9
DEFAULT_H2D_BYTES_S = 50e9


@dataclass(frozen=True)
class HostLink:
    """What the tier's prices read: a block's bytes, the link's speed each way, and
    how devices group into hosts (``devices_per_host`` 0: one host)."""

    block_bytes: int
    d2h_bytes_s: float = DEFAULT_D2H_BYTES_S
    h2d_bytes_s: float = DEFAULT_H2D_BYTES_S
    devices_per_host: int = 0
    # Reading another host's tier over the network (a device's link; 0: not done)
    net_bytes_s: float = 0.0

    def __post_init__(self) -> None:
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")
        if not (self.d2h_bytes_s > 0 and self.h2d_bytes_s > 0):
            raise ValueError("the host link's bandwidths must be > 0")
        if self.devices_per_host < 0 or self.net_bytes_s < 0:
            raise ValueError("devices_per_host and net_bytes_s must be >= 0")


@dataclass(frozen=True)
class Demotion:
    """Block ``block_id`` from (``rank`` of the worker, its ``slot``) to tier ``tier_slot``
    of ``host``: the driver copies it before the slot is written again."""

    host: int
    block_id: int
    rank: int
    slot: int
    tier_slot: int


@dataclass(frozen=True)
class Load:
    """Block ``block_id`` from tier ``tier_slot`` of ``host`` to (``rank``, ``slot``)."""

    host: int
    block_id: int
    tier_slot: int
    rank: int
    slot: int


class HostTierPolicy:
    """What the host tier does, pure: every host's ``HostSlots`` (which blocks it
    holds), the link's prices, and the statistics; the bytes are
    ``runtime/kv/host_memory.py``'s ``HostTierMemory``."""

    def __init__(self, bytes_per_host: int, link: HostLink | None, bound: bool = False) -> None:
        if bytes_per_host < 0:
            raise ValueError(f"host_tier_bytes must be >= 0, got {bytes_per_host}")
        self.enabled = link is not None and (bound or bytes_per_host >= link.block_bytes)
        self.bound = bound
        self.link = link
        self.capacity_blocks: int | None = (
            None if bound or link is None else bytes_per_host // link.block_bytes
        )
        self.tiers: dict[int, HostSlots] = {}
        self.stats = TierStats()
        self._where: dict[int, int] = {}  # block id -> bit set of the hosts holding it

    # -- geometry and prices ------------------------------------------------------------

    def host_of(self, device: int) -> int:
        """The host of ``device`` (the bound: one tier for all)."""
        per = self.link.devices_per_host if self.link is not None else 0
        return 0 if self.bound or per <= 0 else device // per

    def tier(self, host: int) -> HostSlots:
        tier = self.tiers.get(host)
        if tier is None:
            tier = self.tiers[host] = HostSlots(self.capacity_blocks)
        return tier

    @property
    def remote(self) -> bool:
        """Another host's tier is read over the network (``HostLink.net_bytes_s``)."""
        return self.link is not None and self.link.net_bytes_s > 0 and not self.bound

    def load_s(self, blocks: int, cp_degree: int, remote: int = 0) -> float:
        """Seconds to load ``blocks`` consecutive blocks into a degree-C worker, of
        which ``remote`` come from other hosts' tiers over the network: its ranks
        load their own blocks at once."""
        link = self.link
        if blocks <= 0 or link is None:
            return 0.0
        local = blocks - remote
        seconds = math.ceil(local / cp_degree) * link.block_bytes / link.h2d_bytes_s
        if remote > 0:
            seconds += math.ceil(remote / cp_degree) * link.block_bytes / link.net_bytes_s
        return seconds

    def cheapest(
        self,
        curve: ReuseCurve,
        n: int,
        p: int,
        block: int,
        cp_degree: int,
        options: Iterable[tuple[int, int]],
    ) -> tuple[int, float, float]:
        """Of the runs ``options`` offers after ``p`` reused tokens, each (blocks,
        of them read from another host), the one whose prefill plus load costs least:
        (its blocks, E of the longer prefix plus the load, the load's seconds); (0, inf,
        0) when none has blocks. A run is loaded whole: the cost is concave in its
        length."""
        best = (0, math.inf, 0.0)
        for run, remote in options:
            if run > best[0]:
                load_s = self.load_s(run, cp_degree, remote)
                e = curve.time_s(n, p + run * block) + load_s
                if e < best[1]:
                    best = (run, e, load_s)
        return best

    def holding(self, block_ids: Sequence[int], usable: int) -> tuple[int, list[int]]:
        """Per block of the first ``usable``, the bit set of the hosts whose tier
        holds it, and their union (placement prices only those hosts' workers)."""
        where = self._where
        if not where:
            return 0, []
        masks = [where.get(bid, 0) for bid in block_ids[:usable]]
        hosts = 0
        for m in masks:
            hosts |= m
        return hosts, masks

    def run(
        self, first_device: int, block_ids: Sequence[int], start: int, usable: int, now: float
    ) -> int:
        """Consecutive blocks of ``block_ids`` from depth ``start`` (below ``usable``)
        that the tier of the worker on ``first_device`` holds, written back by ``now``."""
        if not self.enabled:
            return 0
        tier = self.tiers.get(self.host_of(first_device))
        if tier is None or not len(tier):
            return 0
        n = start
        while n < usable and tier.ready(block_ids[n], now):
            n += 1
        return n - start

    # -- changes --------------------------------------------------------------------------

    def demote(
        self,
        first_device: int,
        evicted: Sequence[tuple[int, int, int]],
        now: float,
    ) -> list[Demotion]:
        """Blocks (id, rank, slot) a worker on ``first_device`` evicted, leaves first:
        each gets a tier slot (none for a block the tier holds: it is refreshed). Their
        write-back queues on the host's device-to-host lane."""
        if not self.enabled or not evicted or self.link is None:
            return []
        host = self.host_of(first_device)
        tier, stats = self.tier(host), self.stats
        seconds = self.link.block_bytes / self.link.d2h_bytes_s
        done = max(now, tier.lane_free_s)
        moves: list[Demotion] = []
        for bid, rank, slot in evicted:
            if bid in tier:
                tier.touch((bid,))
                continue
            done += seconds
            tier_slot = self._insert(host, tier, bid, done)
            if tier_slot is None:
                stats.refused_blocks += 1
                continue
            moves.append(Demotion(host, bid, rank, slot, tier_slot))
        stats.demoted_blocks += len(moves)
        stats.d2h_busy_s += len(moves) * seconds
        if moves:
            tier.lane_free_s = done
        return moves

    def sources(
        self, first_device: int, block_ids: Sequence[int], start: int, usable: int, now: float
    ) -> list[int]:
        """The host to read each block from, for the blocks of ``block_ids`` from depth
        ``start`` (below ``usable``) that some tier holds, written back by ``now``: the
        worker's own host where its tier has the block, else (``remote``) the first
        other host whose tier has it; ends at the first block none has."""
        if not self.enabled:
            return []
        own = self.host_of(first_device)
        mine = self.tiers.get(own)
        where, tiers, remote = self._where, self.tiers, self.remote
        out: list[int] = []
        for d in range(start, usable):
            bid = block_ids[d]
            if mine is not None and mine.ready(bid, now):
                out.append(own)
                continue
            hosts = where.get(bid, 0) if remote else 0
            found = -1
            while hosts:
                low = hosts & -hosts
                h = low.bit_length() - 1
                if tiers[h].ready(bid, now):
                    found = h
                    break
                hosts ^= low
            if found < 0:
                break
            out.append(found)
        return out

    def load(
        self,
        first_device: int,
        targets: Sequence[tuple[int, int, int]],
        cp_degree: int,
        sources: Sequence[int],
    ) -> list[Load]:
        """Load (id, rank, slot) blocks from the tiers ``sources`` names, host by host
        (``sources``' run); refreshes them there."""
        if not targets:
            return []
        own = self.host_of(first_device)
        hosts = list(sources)
        loads = []
        for (bid, rank, slot), host in zip(targets, hosts, strict=True):
            tier_slot = self.tier(host).slot_of(bid)
            assert tier_slot is not None, "a load of a block the tier lacks"
            loads.append(Load(host, bid, tier_slot, rank, slot))
        for (bid, _, _), host in zip(reversed(targets), reversed(hosts), strict=True):
            self.tiers[host].touch((bid,))
        remote = sum(h != own for h in hosts)
        self.stats.loaded_blocks += len(loads)
        self.stats.remote_blocks += remote
        self.stats.h2d_s += self.load_s(len(loads), cp_degree, remote)
        return loads

    def reused(self, first_device: int, block_ids: Sequence[int]) -> None:
        """A request on the host reused these blocks from the ranks: refresh the tier's
        copies (the trie's statistics in the tier's order)."""
        if self.enabled and block_ids:
            tier = self.tiers.get(self.host_of(first_device))
            if tier is not None and len(tier):
                tier.touch(reversed(block_ids))

    def seen(self, block_ids: Sequence[int], now: float) -> None:
        """The bound: a committed block is written to the tier as well."""
        if self.bound and self.enabled:
            tier = self.tier(0)
            for bid in block_ids:
                self._insert(0, tier, bid, now)

    def _insert(self, host: int, tier: HostSlots, block_id: int, ready_s: float) -> int | None:
        slot, evicted = tier.insert(block_id, ready_s, self.stats)
        bit, where = 1 << host, self._where
        if evicted is not None:
            left = where.get(evicted, 0) & ~bit
            if left:
                where[evicted] = left
            else:
                where.pop(evicted, None)
        if slot is not None:
            where[block_id] = where.get(block_id, 0) | bit
        return slot

    # -- views ------------------------------------------------------------------------

    def used_blocks(self) -> int:
        return sum(len(t) for t in self.tiers.values())

    def summary(self) -> dict[str, float | int | None]:
        """The tier's figures (bytes from the link's block size)."""
        block = self.link.block_bytes if self.link is not None else 0
        s = self.stats
        return {
            "enabled": int(self.enabled),
            "hosts": len(self.tiers),
            "capacity_blocks_per_host": self.capacity_blocks,
            "used_blocks": self.used_blocks(),
            "used_bytes": self.used_blocks() * block,
            "peak_bytes": s.peak_blocks * block,
            "demoted_blocks": s.demoted_blocks,
            "demoted_bytes": s.demoted_blocks * block,
            "loaded_blocks": s.loaded_blocks,
            "loaded_bytes": s.loaded_blocks * block,
            "remote_blocks": s.remote_blocks,
            "remote_bytes": s.remote_blocks * block,
            "evicted_blocks": s.evicted_blocks,
            "refused_blocks": s.refused_blocks,
            "d2h_busy_s": s.d2h_busy_s,
            "h2d_s": s.h2d_s,
        }
