"""The KV ledger: the cache manager's copy and adopt plans turned into slot moves.

The cache manager plans in blocks and workers; the workers' indexes know slots. The
ledger joins the two, for the coordinator (which then moves the bytes between rank
processes) and the simulator (which times the moves), so both run the same rules:

* **Copies** (``begin_copy`` -> move the bytes -> ``commit_copy`` or ``abort_copy``).
  A copy from a holder pins the source's prefix for its duration and needs the
  source to hold the whole prefix still; a fetch reads the slots a reshape retained,
  up to the first block with no retained slot left (the rest is an ordinary miss). A
  copy whose blocks are all held at the destination by then installs nothing.
* **Reshapes** (``collect`` before the switch, ``after_switch`` after it): what the
  old workers left in place is adopted, the rest reserved for fetches within a
  budget until ``retain_s`` after the switch (``expire``); that bookkeeping is
  ``retention``'s.

Pure bookkeeping: no torch, no asyncio; time is an argument. A global rank is a
device index of the lattice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vertumnus.policy.cache.index import BlockAllocation, WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CopyPlan, ReclaimPlan
from vertumnus.policy.cache.retention import Retained, Retention, RetentionConfig, SlotMove
from vertumnus.policy.lattice import Lattice

__all__ = ["CopyJob", "KVLedger"]


@dataclass
class CopyJob:
    """A copy under way: its slot moves, and the allocations that hold its slots."""

    plan: CopyPlan
    moves: list[SlotMove]
    dst_allocation: BlockAllocation
    src_worker: int | None = None
    src_allocation: BlockAllocation | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.moves)


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
        # what reshapes leave behind, adopted or reserved for fetches (``retention``)
        self.retention = Retention(lattice, indexes, cache, blocks_per_rank, self.config)

    # -- copies ----------------------------------------------------------------------

    def begin_copy(self, plan: CopyPlan) -> CopyJob | None:
        """Allocate the destination's slots and pin the source's; None (and the plan
        ends as a miss) when it cannot run, or was cancelled while it waited."""
        if plan.plan_id not in self.cache.copies_in_flight:
            return None  # cancelled: a worker it involved left
        job = self._begin(plan)
        if job is not None and not job.moves:  # the destination holds it all by now
            self._release_allocations(job)
            job = None
        if job is None:
            self.cache.finish_copy(plan.plan_id, ok=False)
        return job

    def commit_copy(self, job: CopyJob) -> int:
        """The bytes are in place: the copies become visible. Returns the blocks
        installed."""
        dst = self.indexes[job.plan.dest_worker]
        self.cache.apply_report(dst.commit(job.dst_allocation))
        self.cache.audit.installed(job.plan, (loc.block_id for loc in job.dst_allocation.new))
        if job.src_allocation is not None and job.src_worker is not None:
            self.cache.apply_report(self.indexes[job.src_worker].commit(job.src_allocation))
        if job.src_worker is None:
            # A fetch: the copies live at the destination now; the retained slots go back.
            self.retention.end_fetch(job.moves, fetched=True)
        installed = len(job.dst_allocation.new)
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
        self._release_allocations(job)
        self.cache.finish_copy(job.plan.plan_id, ok=False)

    def _release_allocations(self, job: CopyJob) -> None:
        dst = self.indexes.get(job.plan.dest_worker)
        if dst is not None:
            self.cache.apply_report(dst.abort(job.dst_allocation))
        if job.src_allocation is not None and job.src_worker is not None:
            src = self.indexes.get(job.src_worker)
            if src is not None:
                self.cache.apply_report(src.commit(job.src_allocation))
        if job.src_worker is None:
            self.retention.end_fetch(job.moves, fetched=False)

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
        src_allocation = src_index.begin(prefix, len(prefix))  # pins the source's blocks
        if src_allocation.new or src_allocation.num_reused_blocks < len(prefix):
            self.cache.apply_report(src_index.abort(src_allocation))
            return None
        dst_allocation = self._begin_dest(dst_index, prefix)
        moves = []
        for loc in dst_allocation.new:
            src = src_allocation.reused[loc.depth]
            moves.append(
                (src_w.first_device + src.rank, src.slot, dst_w.first_device + loc.rank, loc.slot)
            )
        return CopyJob(plan, moves, dst_allocation, src_id, src_allocation)

    def _begin_dest(self, index: WorkerCacheIndex, prefix: list[int]) -> BlockAllocation:
        """The destination's slots for ``prefix``; what they evicted is reported now."""
        allocation = index.begin(prefix, len(prefix))
        self.cache.apply_report(index.evictions(allocation))
        return allocation

    def _begin_fetch(self, plan: CopyPlan) -> CopyJob | None:
        """A pending prefix's missing blocks, from the slots that kept them after a
        split or merge (reserved until now) into slots the destination allocates."""
        dst_index = self.indexes.get(plan.dest_worker)
        dst_w = self.lattice.workers.get(plan.dest_worker)
        if dst_index is None or dst_w is None:
            return None
        source = {
            m.block_id: (m.src_device, self.retention.slot_of(m.block_id, m.src_device))
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
        dst_allocation = self._begin_dest(dst_index, prefix)
        moves = []
        for loc in dst_allocation.new:
            grank, slot = source.get(loc.block_id, (None, None))
            if grank is None or slot is None:  # not a fetched block: cannot fill it
                self.cache.apply_report(dst_index.abort(dst_allocation))
                return None
            moves.append((grank, slot, dst_w.first_device + loc.rank, loc.slot))
        self.retention.reading(moves)  # no expiry frees a slot while it is read
        return CopyJob(plan, moves, dst_allocation)

    # -- reshapes (``retention``) ------------------------------------------------------

    def collect(self, sources: Iterable[int]) -> Retained:
        """Before a switch: where the outgoing workers' blocks are."""
        return self.retention.collect(sources)

    def after_switch(
        self, new_workers: Sequence[int], retained: Retained, adopt: Sequence[CopyPlan], now: float
    ) -> tuple[int, int]:
        """Adopt what is in place, reserve the rest: (adopted, reserved)."""
        return self.retention.after_switch(new_workers, retained, adopt, now)

    def next_deadline(self) -> float | None:
        """When the oldest reservation ends (None: none left)."""
        return self.retention.next_deadline()

    def expire(self, now: float) -> int:
        """Give back the slots of reservations whose time is up; returns how many."""
        return self.retention.expire(now)

    def drop_ranks(self, ranks: Iterable[int]) -> None:
        """Nothing retained on these ranks is fetchable any more (``Retention``)."""
        self.retention.drop_ranks(ranks)

    @property
    def reserved_blocks(self) -> int:
        """Retained copies still reserved for a fetch."""
        return self.retention.reserved_blocks
