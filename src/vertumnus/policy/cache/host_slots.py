"""One host's KV tier as slots (``HostSlots``): which block is in which slot, their
LRU order and when each block is loadable; the tiers' statistics, and the sweep that
gives every host's run of a request's blocks. ``HostTierPolicy`` (``host_tier.py``)
decides over every host's ``HostSlots`` and prices them; ``HostTierMemory``
(``runtime/kv/host_memory.py``) holds the bytes (docs/cache.md, "The host tier").
Pure Python, clock-free."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class TierStats:
    """Totals since the start, for ``/metrics``, the dashboard and the simulator."""

    demoted_blocks: int = 0
    loaded_blocks: int = 0
    remote_blocks: int = 0  # of loaded_blocks, read from another host's tier
    evicted_blocks: int = 0
    refused_blocks: int = 0  # not demoted: the tier had no room it could free
    d2h_busy_s: float = 0.0
    h2d_s: float = 0.0  # load-back seconds charged to workers
    peak_blocks: int = 0


@dataclass
class _Entry:
    slot: int
    ready_s: float  # loadable from then on (its write-back is done)


@dataclass
class HostSlots:
    """One host's tier: ``capacity`` slots (None: unbounded), LRU order."""

    capacity: int | None
    _entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)
    _free: list[int] = field(default_factory=list)
    _next_slot: int = 0
    lane_free_s: float = 0.0  # the device-to-host lane is busy until then

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entries

    def slot_of(self, block_id: int) -> int | None:
        entry = self._entries.get(block_id)
        return None if entry is None else entry.slot

    def ready(self, block_id: int, now: float) -> bool:
        entry = self._entries.get(block_id)
        return entry is not None and entry.ready_s <= now

    def touch(self, block_ids: Iterable[int]) -> None:
        """Most recently used, in the order given (pass a prefix deepest first, so that
        its root end is the newest and its leaves go first)."""
        entries = self._entries
        for bid in block_ids:
            if bid in entries:
                entries.move_to_end(bid)

    def insert(
        self, block_id: int, ready_s: float, stats: TierStats
    ) -> tuple[int | None, int | None]:
        """A slot for ``block_id`` (None: held already, or no room), and the block
        evicted for it (the least recently used), if one was."""
        entry = self._entries.get(block_id)
        if entry is not None:
            self._entries.move_to_end(block_id)
            return None, None
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif self.capacity is None or self._next_slot < self.capacity:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        elif self._entries:
            evicted, old = self._entries.popitem(last=False)
            slot = old.slot
            stats.evicted_blocks += 1
        else:
            return None, None
        self._entries[block_id] = _Entry(slot, ready_s)
        stats.peak_blocks = max(stats.peak_blocks, len(self._entries))
        return slot, evicted


def sweep(masks: Sequence[int], start: int, hosts: int) -> dict[int, int]:
    """Host -> its run of consecutive blocks from depth ``start``, for the hosts of the
    bit set ``hosts``, where ``masks[d]`` is the bit set of the hosts holding block d:
    one pass, ended when no host's run goes on. Placement's price: a block still being
    written back counts (it is written before a prefill placed now starts, but on an
    idle worker, whose start checks it: ``HostTierPolicy.sources``)."""
    alive, runs, d, end = hosts, {}, start, len(masks)
    while alive and d < end:
        holding = masks[d]
        gone = alive & ~holding
        while gone:
            low = gone & -gone
            runs[low.bit_length() - 1] = d - start
            gone ^= low
        alive &= holding
        d += 1
    while alive:
        low = alive & -alive
        runs[low.bit_length() - 1] = d - start
        alive ^= low
    return runs
