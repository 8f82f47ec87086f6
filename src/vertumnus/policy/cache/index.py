"""One worker's KV-cache index: which blocks it holds, where, and what may be evicted.

Owns slot allocation on the worker's ranks, reference counts of blocks in use by
running prefills, and LRU eviction of unreferenced leaves. It does not own the KV
tensors (``engine/kv_store.py`` on each rank writes and reads the slots it is told)
nor the global view (the trie learns of insertions and evictions only through the
``CacheReport``s returned here). Pure Python and clock-free: recency is a counter.

Layout of a worker's cache (degree C, ``blocks_per_rank`` slots on every rank)::

    prefix blocks  b0   b1   b2   b3   b4 ...      block at depth j lives on
    rank           0    1    2    0    1  ...      rank j % C, in any free slot

Invariants (checked by ``check_invariants``):
  * a cached block's parent is cached: a worker always holds whole prefixes;
  * a block in use (refcount > 0) or with children is never evicted;
  * a block becomes matchable only after its prefill committed (its KV is written);
  * no rank holds more than ``blocks_per_rank`` blocks; slots are unique per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sortedcontainers import SortedList  # type: ignore[import-untyped]

from vertumnus.blocks import ROOT_BLOCK_ID


@dataclass(frozen=True)
class BlockLocation:
    block_id: int
    depth: int  # index of the block in its sequence (block j covers tokens [j*B, (j+1)*B))
    rank: int  # rank within the worker
    slot: int  # slot in that rank's KV store


@dataclass(frozen=True)
class CacheReport:
    """Cache-state change of one worker, for the global trie, to apply in the order
    reports are returned. ``inserted``: one chain, parents before children, under
    ``inserted_parent`` (a block the worker already holds, or the root); ``evicted``:
    in eviction order (leaves first), only blocks not held when the report is made."""

    worker_id: int
    inserted: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()
    inserted_parent: int = ROOT_BLOCK_ID


@dataclass
class BlockAllocation:
    """Blocks held by one running prefill: the reused prefix and the new blocks it writes."""

    reused: list[BlockLocation]
    new: list[BlockLocation]
    evicted: list[int] = field(default_factory=list)
    # (block id, rank, slot) of every block ``begin`` evicted, for the host tier
    evicted_at: list[tuple[int, int, int]] = field(default_factory=list)
    # The first ``loaded`` blocks of ``new`` are loaded back from the host tier, not
    # computed: the prefill reuses them with ``reused``.
    loaded: int = 0

    @property
    def num_reused_blocks(self) -> int:
        return len(self.reused)

    @property
    def prefix_blocks(self) -> int:
        """Blocks the prefill does not compute: reused on the ranks or loaded back."""
        return len(self.reused) + self.loaded


@dataclass
class _Entry:
    loc: BlockLocation
    parent_id: int
    refcount: int = 0
    num_children: int = 0
    last_used: int = 0
    ready: bool = False  # KV written and committed: matchable
    evict_key: tuple[int, int] | None = None  # key in _evictable[rank] while evictable


class WorkerCacheIndex:
    def __init__(self, cp_degree: int, blocks_per_rank: int, worker_id: int = 0) -> None:
        if cp_degree <= 0:
            raise ValueError(f"cp_degree must be positive, got {cp_degree}")
        if blocks_per_rank < 0:
            raise ValueError(f"blocks_per_rank must be >= 0, got {blocks_per_rank}")
        self.cp_degree = cp_degree
        self.blocks_per_rank = blocks_per_rank
        self.worker_id = worker_id
        self._entries: dict[int, _Entry] = {}
        self._free: list[list[int]] = [
            list(range(blocks_per_rank - 1, -1, -1)) for _ in range(cp_degree)
        ]
        self._evictable: list[SortedList] = [SortedList() for _ in range(cp_degree)]
        self._reserved: set[tuple[int, int]] = set()  # (rank, slot) kept for a fetch
        self._tick = 0

    # -- queries ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_id: int) -> bool:
        entry = self._entries.get(block_id)
        return entry is not None and entry.ready

    def num_free_slots(self, rank: int) -> int:
        return len(self._free[rank])

    def match(self, block_ids: Sequence[int]) -> list[BlockLocation]:
        """Locations of the longest committed prefix of ``block_ids`` held here."""
        out: list[BlockLocation] = []
        for bid in block_ids:
            entry = self._entries.get(bid)
            if entry is None or not entry.ready:
                break
            out.append(entry.loc)
        return out

    # -- a prefill's life: begin -> commit | abort -------------------------------------

    def begin(self, block_ids: Sequence[int], max_reuse_blocks: int) -> BlockAllocation:
        """Pin the reusable prefix and allocate slots for the blocks to be written.

        Reuses at most ``max_reuse_blocks`` matched blocks. New blocks are allocated in
        order, evicting LRU unreferenced leaves when a rank is full, and stop at the
        first block that cannot be placed or that another running prefill is already
        writing (so a prefix is never held twice and always whole).
        """
        reused = self.match(block_ids)[: max(0, max_reuse_blocks)]
        allocation = BlockAllocation(reused=reused, new=[])
        for loc in reused:
            self._acquire(self._entries[loc.block_id])
        parent_id = reused[-1].block_id if reused else ROOT_BLOCK_ID
        for depth in range(len(reused), len(block_ids)):
            bid = block_ids[depth]
            if bid in self._entries:  # being written by another prefill (or reuse capped)
                break
            rank = depth % self.cp_degree
            slot = self._allocate_slot(rank, allocation.evicted, allocation.evicted_at)
            if slot is None:
                break
            loc = BlockLocation(block_id=bid, depth=depth, rank=rank, slot=slot)
            self._entries[bid] = _Entry(loc=loc, parent_id=parent_id, refcount=1)
            if parent_id != ROOT_BLOCK_ID:
                self._entries[parent_id].num_children += 1
            allocation.new.append(loc)
            parent_id = bid
        return allocation

    def evictions(self, allocation: BlockAllocation) -> CacheReport:
        """The blocks ``begin`` evicted for ``allocation``, reported now rather than when
        the allocation ends, so that the global view stops offering them at once (their
        slots are the allocation's). They leave the allocation: its end reports only later
        ones."""
        evicted, allocation.evicted = tuple(allocation.evicted), []
        return CacheReport(self.worker_id, evicted=evicted)

    def commit(self, allocation: BlockAllocation) -> CacheReport:
        """The prefill wrote its new blocks: make them matchable and unpin everything."""
        for loc in allocation.new:
            self._entries[loc.block_id].ready = True
        for loc in (*allocation.reused, *allocation.new):
            self._release(self._entries[loc.block_id])
        return CacheReport(
            self.worker_id,
            inserted=tuple(loc.block_id for loc in allocation.new),
            evicted=self._still_evicted(allocation),
            inserted_parent=(
                allocation.reused[-1].block_id
                if allocation.reused and allocation.new
                else ROOT_BLOCK_ID
            ),
        )

    def abort(self, allocation: BlockAllocation) -> CacheReport:
        """The prefill failed: free its new blocks (children first) and unpin the rest."""
        for loc in reversed(allocation.new):
            self._remove(self._entries[loc.block_id])
        for loc in allocation.reused:
            self._release(self._entries[loc.block_id])
        return CacheReport(self.worker_id, evicted=self._still_evicted(allocation))

    # -- adoption (after a split or merge) --------------------------------------------

    def adopt(self, chain: Sequence[tuple[int, int, int]]) -> CacheReport:
        """Take over blocks already written on this worker's ranks by the worker that
        had them before a split or merge: ``chain`` = (block id, rank, slot) of a
        prefix from its first block, each at rank depth % C. Blocks held already are
        skipped; adoption stops at the first block whose place is wrong or whose slot
        is taken. The report lists the blocks adopted (now matchable)."""
        adopted: list[int] = []
        parent_id = ROOT_BLOCK_ID
        first_parent = ROOT_BLOCK_ID
        for depth, (bid, rank, slot) in enumerate(chain):
            entry = self._entries.get(bid)
            if entry is not None:
                if not entry.ready or adopted:
                    break
                parent_id = first_parent = bid
                continue
            if rank != depth % self.cp_degree or slot not in self._free[rank]:
                break
            self._free[rank].remove(slot)
            self._tick += 1
            new = _Entry(
                loc=BlockLocation(bid, depth, rank, slot),
                parent_id=parent_id,
                last_used=self._tick,
                ready=True,
            )
            self._entries[bid] = new
            if parent_id != ROOT_BLOCK_ID:
                parent = self._entries[parent_id]
                parent.num_children += 1
                self._refresh(parent)
            self._refresh(new)
            adopted.append(bid)
            parent_id = bid
        return CacheReport(
            self.worker_id,
            inserted=tuple(adopted),
            inserted_parent=first_parent if adopted else ROOT_BLOCK_ID,
        )

    def reserve(self, rank: int, slot: int) -> bool:
        """Keep a free slot out of allocation (it holds KV another worker may fetch,
        retained from before a split or merge). False if the slot is not free."""
        if slot not in self._free[rank]:
            return False
        self._free[rank].remove(slot)
        self._reserved.add((rank, slot))
        return True

    def release(self, rank: int, slot: int) -> None:
        """Give a reserved slot back to allocation."""
        if (rank, slot) in self._reserved:
            self._reserved.remove((rank, slot))
            self._free[rank].append(slot)

    def locations(self) -> dict[int, BlockLocation]:
        """Where every committed block lives (rank within the worker, slot)."""
        return {bid: e.loc for bid, e in self._entries.items() if e.ready}

    # -- reclamation (the cache manager's plans) --------------------------------------

    def can_reclaim(self, block_id: int) -> bool:
        """True if ``block_id`` is held, not in use, and has no cached child here."""
        entry = self._entries.get(block_id)
        return entry is not None and entry.evict_key is not None

    def reclaim(self, block_id: int) -> CacheReport | None:
        """Delete ``block_id`` if ``can_reclaim``; the report confirms the deletion."""
        if not self.can_reclaim(block_id):
            return None
        self._remove(self._entries[block_id])
        return CacheReport(self.worker_id, evicted=(block_id,))

    def num_free_blocks(self) -> int:
        """Free slots over all ranks (evictable blocks not counted)."""
        return sum(map(len, self._free))

    def held_blocks(self) -> set[int]:
        """Every committed block: what the trie's holder bits must say of this worker."""
        return {bid for bid, e in self._entries.items() if e.ready}

    # -- internals -------------------------------------------------------------------

    def _still_evicted(self, allocation: BlockAllocation) -> tuple[int, ...]:
        """The blocks ``allocation`` evicted that are not held now. Its report comes when it
        ends; a block it evicted may have been cached again, and reported inserted, by
        a prefill that ended first: reporting that block evicted after the insertion
        would make the trie forget a block this worker holds."""
        return tuple(bid for bid in allocation.evicted if bid not in self)

    def _acquire(self, entry: _Entry) -> None:
        entry.refcount += 1
        self._refresh(entry)

    def _release(self, entry: _Entry) -> None:
        entry.refcount -= 1
        self._tick += 1
        entry.last_used = self._tick
        self._refresh(entry)

    def _refresh(self, entry: _Entry) -> None:
        """Keep ``entry`` in its rank's evictable list iff it is an unused, ready leaf."""
        rank = entry.loc.rank
        if entry.evict_key is not None:
            self._evictable[rank].remove(entry.evict_key)
            entry.evict_key = None
        if entry.ready and entry.refcount == 0 and entry.num_children == 0:
            entry.evict_key = (entry.last_used, entry.loc.block_id)
            self._evictable[rank].add(entry.evict_key)

    def _remove(self, entry: _Entry) -> None:
        if entry.evict_key is not None:
            self._evictable[entry.loc.rank].remove(entry.evict_key)
        del self._entries[entry.loc.block_id]
        self._free[entry.loc.rank].append(entry.loc.slot)
        parent = self._entries.get(entry.parent_id)
        if parent is not None:
            parent.num_children -= 1
            self._refresh(parent)

    def _allocate_slot(
        self, rank: int, evicted: list[int], where: list[tuple[int, int, int]] | None = None
    ) -> int | None:
        """A free slot on ``rank``, evicting LRU leaves (this rank's first) if needed."""
        while not self._free[rank]:
            victims = self._evictable[rank]
            if not victims:
                # Evict the oldest leaf on any rank: that exposes its parent as a leaf,
                # and the chain leads back to this rank within C evictions.
                heads = [lst[0] for lst in self._evictable if lst]
                if not heads:
                    return None
                _, bid = min(heads)
            else:
                _, bid = victims[0]
            loc = self._entries[bid].loc
            self._remove(self._entries[bid])
            evicted.append(bid)
            if where is not None:
                where.append((bid, loc.rank, loc.slot))
        return self._free[rank].pop()

    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant in the module docstring is broken."""
        used: list[set[int]] = [set() for _ in range(self.cp_degree)]
        children: dict[int, int] = {}
        for bid, e in self._entries.items():
            assert e.loc.block_id == bid
            assert e.loc.rank == e.loc.depth % self.cp_degree, "block on the wrong rank"
            assert e.loc.slot not in used[e.loc.rank], "slot used twice"
            used[e.loc.rank].add(e.loc.slot)
            if e.parent_id != ROOT_BLOCK_ID:
                parent = self._entries.get(e.parent_id)
                assert parent is not None, "block held without its parent"
                assert parent.loc.depth == e.loc.depth - 1
                children[e.parent_id] = children.get(e.parent_id, 0) + 1
            else:
                assert e.loc.depth == 0
            assert e.refcount >= 0
            if not e.ready:
                assert e.refcount > 0, "an unwritten block must belong to a running prefill"
        for bid, e in self._entries.items():
            assert e.num_children == children.get(bid, 0), "child count out of date"
            evictable = e.ready and e.refcount == 0 and e.num_children == 0
            assert (e.evict_key is not None) == evictable, "evictable list out of date"
        for rank in range(self.cp_degree):
            reserved = {slot for r, slot in self._reserved if r == rank}
            assert len(used[rank]) + len(self._free[rank]) + len(reserved) == self.blocks_per_rank
            assert not used[rank] & set(self._free[rank]), "slot both used and free"
            assert not reserved & (used[rank] | set(self._free[rank])), "reserved slot in use"
