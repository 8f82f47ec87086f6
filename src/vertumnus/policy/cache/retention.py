"""What a reshape's old workers leave behind in their KV slots, and for how long.

Before a switch ``collect`` notes where the outgoing workers' blocks are (two
sources of a merge may both hold a block, each on its own rank). After it
(``after_switch``), blocks the old workers left where the new geometry wants them
are adopted at their slots: no data moves. The slots of other retained blocks are
reserved in the new workers' indexes, at most ``reserve_fraction`` of a worker's
slots, the most accessed blocks first (not the copies of a block the worker
adopted), so that a pending prefix can be fetched from them; holding every
retained block would starve the new workers' caches. Reservations end when their
block is fetched (``end_fetch``), or ``retain_s`` after the switch (``expire``),
but never under a fetch reading them (``reading``).

Pure bookkeeping, time an argument; a global rank is a device index of the
lattice. Not owned here: the copies themselves (``ledger``), which prefixes the new
workers inherit (``handover``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.lattice import Lattice

# (source global rank, source slot, destination global rank, destination slot)
SlotMove = tuple[int, int, int, int]
# block id -> {global rank: slot} of every copy a reshape left behind
Retained = dict[int, dict[int, int]]


@dataclass(frozen=True)
class RetentionConfig:
    reserve_fraction: float = 0.5  # of a new worker's KV slots, at most
    retain_s: float = 60.0
    # The new workers fetch their pending prefixes right after the switch (false:
    # a prefix is fetched on its first reuse only, which placement cannot see).
    fetch_at_switch: bool = True

    def __post_init__(self) -> None:
        if not (0.0 <= self.reserve_fraction <= 1.0) or self.retain_s < 0:
            raise ValueError("need 0 <= reserve_fraction <= 1 and retain_s >= 0")


@dataclass
class _Reservation:
    deadline_s: float
    slots: list[tuple[int, int, int]] = field(default_factory=list)  # (worker, rank, slot)


class Retention:
    def __init__(
        self,
        lattice: Lattice,
        indexes: Mapping[int, WorkerCacheIndex],
        cache: PrefixCacheManager,
        blocks_per_rank: int,
        config: RetentionConfig,
    ) -> None:
        """``indexes``: the stack's live map of worker id -> index."""
        self.lattice, self.indexes, self.cache = lattice, indexes, cache
        self.blocks_per_rank, self.config = blocks_per_rank, config
        self._retained_at: Retained = {}  # reserved, not yet fetched
        self._reservations: list[_Reservation] = []
        self._fetching: dict[tuple[int, int], int] = {}  # (global rank, slot) being read
        self._expired_in_flight: set[tuple[int, int]] = set()

    # -- fetches ---------------------------------------------------------------------

    def slot_of(self, block_id: int, grank: int) -> int | None:
        """The reserved slot of ``grank`` that keeps ``block_id`` (None: none)."""
        return self._retained_at.get(block_id, {}).get(grank)

    def reading(self, moves: Sequence[SlotMove]) -> None:
        """A fetch reads these moves' source slots: no expiry frees them meanwhile."""
        for grank, slot, _, _ in moves:
            self._fetching[(grank, slot)] = self._fetching.get((grank, slot), 0) + 1

    def end_fetch(self, moves: Sequence[SlotMove], fetched: bool) -> None:
        """A fetch's source slots (its ``moves``' sources): released if fetched (the
        copy lives on) or if their reservation ran out while the fetch read them; else
        still reserved."""
        for grank, slot, _, _ in moves:
            key = (grank, slot)
            self._fetching[key] -= 1
            if self._fetching[key]:
                continue
            del self._fetching[key]
            if fetched or key in self._expired_in_flight:
                self._expired_in_flight.discard(key)
                self._release_slot(grank, slot)
                self._forget_copy(grank, slot)

    # -- reshapes --------------------------------------------------------------------

    def collect(self, sources: Iterable[int]) -> Retained:
        """Before a switch: where the outgoing workers' blocks are (two sources of a
        merge may both hold a block, each on its own rank)."""
        retained: Retained = {}
        for s in sources:
            first = self.lattice.workers[s].first_device
            for bid, loc in self.indexes[s].locations().items():
                retained.setdefault(bid, {})[first + loc.rank] = loc.slot
        return retained

    def after_switch(
        self,
        new_workers: Sequence[int],
        retained: Retained,
        adopt: Sequence[CopyPlan],
        now: float,
    ) -> tuple[int, int]:
        """The new workers' indexes exist (empty): adopt what is in place, reserve the
        rest within budget until ``now + retain_s``. Returns (adopted, reserved)."""
        # Reservations an earlier reshape made on these ranks died with the old
        # indexes: forget them (what is still retained is re-reserved below).
        self.drop_ranks(r for w in new_workers for r in self.lattice.workers[w].devices)
        adopted = self._adopt(adopt, retained)
        reserved = self._reserve(new_workers, retained, now)
        return adopted, reserved

    def _adopt(self, plans: Sequence[CopyPlan], retained: Retained) -> int:
        adopted = 0
        for plan in plans:
            w = self.lattice.workers[plan.dest_worker]
            index = self.indexes[plan.dest_worker]
            chain = []
            for depth, bid in enumerate(plan.prefix_ids):
                rank = depth % w.cp_degree  # where the new geometry wants block `depth`
                slot = retained.get(bid, {}).get(w.first_device + rank)
                if slot is None:
                    break
                chain.append((bid, rank, slot))
            report = index.adopt(chain)
            self.cache.apply_report(report)
            adopted += len(report.inserted)
            self.cache.finish_copy(plan.plan_id, ok=plan.block_id in index)
        return adopted

    def _reserve(self, new_workers: Sequence[int], retained: Retained, now: float) -> int:
        owner = {r: w for w in new_workers for r in self.lattice.workers[w].devices}
        budget = {
            w: int(self.config.reserve_fraction * self.blocks_per_rank)
            * self.lattice.workers[w].cp_degree
            for w in new_workers
        }
        nodes = self.cache.trie.nodes

        def demand(bid: int) -> float:
            node = nodes.get(bid)
            return sum(node.access) if node is not None and node.access is not None else 0.0

        reservation = _Reservation(now + self.config.retain_s)
        for bid in sorted(retained, key=lambda b: (-demand(b), b)):
            for grank, slot in sorted(retained[bid].items()):
                w = owner.get(grank)
                if w is None or budget[w] <= 0 or bid in self.indexes[w]:
                    continue  # a block the new worker adopted needs no fetch there
                rank = grank - self.lattice.workers[w].first_device
                if self.indexes[w].reserve(rank, slot):
                    budget[w] -= 1
                    self._retained_at.setdefault(bid, {})[grank] = slot
                    reservation.slots.append((w, rank, slot))
        if reservation.slots:
            self._reservations.append(reservation)
        return len(reservation.slots)

    def next_deadline(self) -> float | None:
        """When the oldest reservation ends (None: none left)."""
        return min((r.deadline_s for r in self._reservations), default=None)

    def expire(self, now: float) -> int:
        """Give back the slots of reservations whose time is up; returns how many."""
        due = [r for r in self._reservations if r.deadline_s <= now]
        self._reservations = [r for r in self._reservations if r.deadline_s > now]
        released = 0
        for reservation in due:
            for w, rank, slot in reservation.slots:
                index = self.indexes.get(w)
                lw = self.lattice.workers.get(w)
                if index is None or lw is None:
                    continue  # the worker left: its index, and the reservation, are gone
                grank = lw.first_device + rank
                if (grank, slot) in self._fetching:
                    self._expired_in_flight.add((grank, slot))  # released when read
                    continue
                index.release(rank, slot)
                released += self._forget_copy(grank, slot)
        return released

    def _forget_copy(self, grank: int, slot: int) -> int:
        """The retained copy in ``slot`` of ``grank`` is gone; returns how many
        blocks it was (0 or 1)."""
        for bid, by_rank in list(self._retained_at.items()):
            if by_rank.get(grank) == slot:
                del by_rank[grank]
                if not by_rank:
                    del self._retained_at[bid]
                return 1
        return 0

    def drop_ranks(self, ranks: Iterable[int]) -> None:
        """Nothing retained on these ranks is fetchable any more: they restarted, or a
        new geometry's index owns their slots now (it reserves again what it keeps)."""
        gone = set(ranks)
        for by_rank in self._retained_at.values():
            for r in gone & set(by_rank):
                by_rank.pop(r)
        self._retained_at = {b: r for b, r in self._retained_at.items() if r}

    def _release_slot(self, grank: int, slot: int) -> None:
        for w in self.lattice.workers.values():
            index = self.indexes.get(w.worker_id)
            if grank in w.devices and index is not None:
                index.release(grank - w.first_device, slot)

    @property
    def reserved_blocks(self) -> int:
        """Retained copies still reserved for a fetch."""
        return sum(len(r) for r in self._retained_at.values())
