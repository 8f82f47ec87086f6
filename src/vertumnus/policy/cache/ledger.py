"""The KV ledger: the cache manager's copy and adopt plans turned into slot moves.

The cache manager plans in blocks and workers; the workers' indexes know slots. The
ledger joins the two, for the coordinator (which then moves the bytes between rank
processes) and the simulator (which times the moves), so both run the same rules:

* **Copies** (``begin_copy`` -> move the bytes -> ``commit_copy`` or ``abort_copy``).
  A copy from a holder pins the source's prefix for its duration and needs the
  source to hold the whole prefix still; a fetch reads the slots a reshape retained,
  up to the first block with no retained slot left (the rest is an ordinary miss). A
  copy whose blocks are all held at the destination by then installs nothing.
* **Reshapes** (``collect`` before the switch, ``after_switch`` after it). Blocks the
  old workers left where the new geometry wants them are adopted at their slots: no
  data moves. The slots of other retained blocks are reserved in the new workers'
  indexes, at most ``reserve_fraction`` of a worker's slots, the most accessed
  blocks first (not the copies of a block the worker adopted), so that a pending
  prefix can be fetched from them; holding every retained block would starve the
  new workers' caches. Reservations end when their block is fetched, or
  ``retain_s`` after the switch (``expire``).

Pure bookkeeping: no torch, no asyncio; time is an argument. A global rank is a
device index of the lattice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vertumnus.policy.cache.index import PrefillLease, WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan, ReclaimPlan
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
class CopyJob:
    """A copy under way: its slot moves, and the leases that hold its slots."""

    plan: CopyPlan
    moves: list[SlotMove]
    dst_lease: PrefillLease
    src_worker: int | None = None
    src_lease: PrefillLease | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.moves)


@dataclass
class _Reservation:
    deadline_s: float
    slots: list[tuple[int, int, int]] = field(default_factory=list)  # (worker, rank, slot)


class KVLedger:
    def __init__(
        self,
        lattice: Lattice,
        indexes: Mapping[int, WorkerCacheIndex],
        cache: PrefixCacheManager,
        blocks_per_rank: int,
        config: RetentionConfig | None = None,
    ) -> None:
        """``indexes``: the caller's live map of worker id -> index (it adds and
        removes workers; the ledger reads it)."""
        self.lattice, self.indexes, self.cache = lattice, indexes, cache
        self.blocks_per_rank = blocks_per_rank
        self.config = config or RetentionConfig()
        self._retained_at: Retained = {}  # reserved, not yet fetched
        self._reservations: list[_Reservation] = []
        self._fetching: dict[tuple[int, int], int] = {}  # (global rank, slot) being read
        self._expired_in_flight: set[tuple[int, int]] = set()

    # -- copies ----------------------------------------------------------------------

    def begin_copy(self, plan: CopyPlan) -> CopyJob | None:
        """Allocate the destination's slots and pin the source's; None (and the plan
        ends as a miss) when it cannot run, or was cancelled while it waited."""
        if plan.plan_id not in self.cache.copies_in_flight:
            return None  # cancelled: a worker it involved left
        job = self._begin(plan)
        if job is not None and not job.moves:  # the destination holds it all by now
            self._release_leases(job)
            job = None
        if job is None:
            self.cache.finish_copy(plan.plan_id, ok=False)
        return job

    def commit_copy(self, job: CopyJob) -> int:
        """The bytes are in place: the copies become visible. Returns the blocks
        installed."""
        dst = self.indexes[job.plan.dest_worker]
        self.cache.apply_report(dst.commit(job.dst_lease))
        self.cache.audit.installed(job.plan, (loc.block_id for loc in job.dst_lease.new))
        if job.src_lease is not None and job.src_worker is not None:
            self.cache.apply_report(self.indexes[job.src_worker].commit(job.src_lease))
        if job.src_worker is None:
            # A fetch: the copies live at the destination now; the retained slots go back.
            self._end_fetch(job, fetched=True)
        installed = len(job.dst_lease.new)
        self.cache.finish_copy(job.plan.plan_id, ok=installed > 0)
        return installed

    def reclaim(self, plans: Iterable[ReclaimPlan]) -> int:
        """Delete the replicas the scan chose, at once (a slot freed in the index is
        free on the rank); returns how many were deleted."""
        deleted = 0
        for plan in plans:
            report = self.indexes[plan.worker_id].reclaim(plan.block_id)
            if report is not None:
                self.cache.apply_report(report)
                deleted += 1
            self.cache.finish_reclaim(plan.plan_id, report is not None)
        return deleted

    def abort_copy(self, job: CopyJob) -> None:
        """The move failed, or a worker involved left: nothing becomes visible."""
        self._release_leases(job)
        self.cache.finish_copy(job.plan.plan_id, ok=False)

    def _release_leases(self, job: CopyJob) -> None:
        dst = self.indexes.get(job.plan.dest_worker)
        if dst is not None:
            self.cache.apply_report(dst.abort(job.dst_lease))
        if job.src_lease is not None and job.src_worker is not None:
            src = self.indexes.get(job.src_worker)
            if src is not None:
                self.cache.apply_report(src.commit(job.src_lease))
        if job.src_worker is None:
            self._end_fetch(job, fetched=False)

    def _end_fetch(self, job: CopyJob, fetched: bool) -> None:
        """A fetch's source slots: released if fetched (the copy lives on) or if their
        reservation ran out while the fetch read them; else still reserved."""
        for grank, slot, _, _ in job.moves:
            key = (grank, slot)
            self._fetching[key] -= 1
            if self._fetching[key]:
                continue
            del self._fetching[key]
            if fetched or key in self._expired_in_flight:
                self._expired_in_flight.discard(key)
                self._release_slot(grank, slot)
                self._forget_copy(grank, slot)

    def _begin(self, plan: CopyPlan) -> CopyJob | None:
        sources = {m.src_worker for m in plan.moves}
        if sources == {None}:
            return self._begin_fetch(plan)
        if None in sources or len(sources) != 1:
            return None  # mixed sources: an ordinary miss
        src_id = sources.pop()
        assert src_id is not None
        src_index, dst_index = self.indexes.get(src_id), self.indexes.get(plan.dest_worker)
        src_w, dst_w = self.lattice.workers.get(src_id), self.lattice.workers.get(plan.dest_worker)
        if src_index is None or dst_index is None or src_w is None or dst_w is None:
            return None
        prefix = list(plan.prefix_ids)
        if len(src_index.match(prefix)) < len(prefix):
            return None  # the source no longer holds the whole prefix
        src_lease = src_index.begin(prefix, len(prefix))  # pins the source's blocks
        if src_lease.new or src_lease.num_reused_blocks < len(prefix):
            self.cache.apply_report(src_index.abort(src_lease))
            return None
        dst_lease = self._begin_dest(dst_index, prefix)
        moves = []
        for loc in dst_lease.new:
            src = src_lease.reused[loc.depth]
            moves.append(
                (src_w.first_device + src.rank, src.slot, dst_w.first_device + loc.rank, loc.slot)
            )
        return CopyJob(plan, moves, dst_lease, src_id, src_lease)

    def _begin_dest(self, index: WorkerCacheIndex, prefix: list[int]) -> PrefillLease:
        """The destination's slots for ``prefix``; what they evicted is reported now."""
        lease = index.begin(prefix, len(prefix))
        self.cache.apply_report(index.evictions(lease))
        return lease

    def _begin_fetch(self, plan: CopyPlan) -> CopyJob | None:
        """A pending prefix's missing blocks, from the slots that kept them after a
        split or merge (reserved until now) into slots the destination allocates."""
        dst_index = self.indexes.get(plan.dest_worker)
        dst_w = self.lattice.workers.get(plan.dest_worker)
        if dst_index is None or dst_w is None:
            return None
        source = {
            m.block_id: (m.src_device, self._retained_at.get(m.block_id, {}).get(m.src_device))
            for m in plan.moves
        }
        # The prefix up to the first block with no copy left (the rest is a miss).
        prefix = list(plan.prefix_ids)
        for n, bid in enumerate(prefix):
            if bid in source and source[bid][1] is None:
                prefix = prefix[:n]
                break
        if not prefix:
            return None
        dst_lease = self._begin_dest(dst_index, prefix)
        moves = []
        for loc in dst_lease.new:
            grank, slot = source.get(loc.block_id, (None, None))
            if grank is None or slot is None:  # not a fetched block: cannot fill it
                self.cache.apply_report(dst_index.abort(dst_lease))
                return None
            moves.append((grank, slot, dst_w.first_device + loc.rank, loc.slot))
        for grank, slot, _, _ in moves:  # no expiry frees a slot while it is read
            self._fetching[(grank, slot)] = self._fetching.get((grank, slot), 0) + 1
        return CopyJob(plan, moves, dst_lease)

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
