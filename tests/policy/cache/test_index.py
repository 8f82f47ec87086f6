"""One worker's cache index: exact slots, pins, eviction order and reports.

Block ids here are small readable integers (the index only needs them unique per
prefix, which ``blocks.block_ids`` guarantees in production): 11, 12, 13 is one chain,
11, 12, 23 a branch of it after two blocks, 21, 22 an unrelated chain. The random-operation
tests at the end use real chained ids of random token sequences.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from vertumnus.blocks import ROOT_BLOCK_ID, block_ids
from vertumnus.policy.cache.index import (
    BlockAllocation,
    BlockLocation,
    CacheReport,
    WorkerCacheIndex,
)

WORKER = 7
ALL = 1_000  # max_reuse_blocks that caps nothing


def make_index(cp_degree: int = 1, blocks_per_rank: int = 4) -> WorkerCacheIndex:
    return WorkerCacheIndex(cp_degree, blocks_per_rank, worker_id=WORKER)


def loc(block_id: int, depth: int, rank: int, slot: int) -> BlockLocation:
    return BlockLocation(block_id=block_id, depth=depth, rank=rank, slot=slot)


def cache(index: WorkerCacheIndex, chain: Sequence[int]) -> CacheReport:
    """One whole prefill of ``chain``: begin (reusing all it can), then commit."""
    report = index.commit(index.begin(chain, ALL))
    index.check_invariants()
    return report


def report(
    inserted: Sequence[int] = (), evicted: Sequence[int] = (), parent: int = ROOT_BLOCK_ID
) -> CacheReport:
    return CacheReport(
        WORKER, inserted=tuple(inserted), evicted=tuple(evicted), inserted_parent=parent
    )


def ids(locs: Sequence[BlockLocation]) -> list[int]:
    return [x.block_id for x in locs]


# -- match, begin, commit, abort ---------------------------------------------------


def test_match_returns_the_longest_committed_prefix() -> None:
    index = make_index(cp_degree=2, blocks_per_rank=4)
    assert cache(index, [11, 12, 13]) == report(inserted=[11, 12, 13])
    a, b, c = loc(11, 0, 0, 0), loc(12, 1, 1, 0), loc(13, 2, 0, 1)
    assert index.match([11, 12, 13, 14]) == [a, b, c]
    assert index.match([11, 12, 13]) == [a, b, c]
    assert index.match([11, 12, 23]) == [a, b]
    assert index.match([11]) == [a]
    assert index.match([99, 12, 13]) == []
    assert index.match([]) == []
    assert len(index) == 3
    assert 13 in index and 14 not in index


def test_blocks_are_matchable_only_after_commit() -> None:
    index = make_index(cp_degree=2, blocks_per_rank=4)
    allocation = index.begin([11, 12, 13], ALL)
    assert allocation.reused == []
    assert allocation.new == [loc(11, 0, 0, 0), loc(12, 1, 1, 0), loc(13, 2, 0, 1)]
    assert allocation.evicted == []
    assert index.match([11, 12, 13]) == []
    assert 11 not in index
    assert len(index) == 3  # allocated, being written
    index.check_invariants()
    assert index.commit(allocation) == report(inserted=[11, 12, 13])
    assert ids(index.match([11, 12, 13])) == [11, 12, 13]
    index.check_invariants()


def test_begin_reuses_the_matched_prefix_and_allocates_the_rest() -> None:
    index = make_index(cp_degree=2, blocks_per_rank=4)
    cache(index, [11, 12, 13])
    allocation = index.begin([11, 12, 23, 24], ALL)
    assert allocation.reused == [loc(11, 0, 0, 0), loc(12, 1, 1, 0)]
    assert allocation.num_reused_blocks == 2
    assert allocation.new == [loc(23, 2, 0, 2), loc(24, 3, 1, 1)]
    assert index.commit(allocation) == report(inserted=[23, 24], parent=12)
    assert ids(index.match([11, 12, 23, 24])) == [11, 12, 23, 24]
    assert ids(index.match([11, 12, 13])) == [11, 12, 13]
    index.check_invariants()


@pytest.mark.parametrize(("max_reuse", "reused"), [(-1, []), (0, []), (1, [11]), (2, [11, 12])])
def test_reuse_cap_stops_allocation_at_a_cached_block(max_reuse: int, reused: list[int]) -> None:
    # A capped reuse never writes a second copy of a block the worker already holds.
    index = make_index(cp_degree=1, blocks_per_rank=4)
    cache(index, [11, 12, 13])
    allocation = index.begin([11, 12, 13], max_reuse)
    assert ids(allocation.reused) == reused
    assert allocation.new == []
    assert index.num_free_slots(0) == 1
    assert index.commit(allocation) == report()


def test_abort_frees_new_blocks_and_unpins_reused() -> None:
    index = make_index(cp_degree=2, blocks_per_rank=2)
    cache(index, [11])
    allocation = index.begin([11, 12, 13], ALL)
    assert ids(allocation.reused) == [11]
    assert allocation.new == [loc(12, 1, 1, 0), loc(13, 2, 0, 1)]
    assert (index.num_free_slots(0), index.num_free_slots(1)) == (0, 1)
    assert index.abort(allocation) == report()
    index.check_invariants()
    assert (index.num_free_slots(0), index.num_free_slots(1)) == (1, 2)
    assert len(index) == 1
    assert ids(index.match([11, 12, 13])) == [11]
    # 11 is unpinned again: a new chain that needs both rank-0 slots evicts it.
    allocation = index.begin([21, 22, 23], ALL)
    assert ids(allocation.new) == [21, 22, 23]
    assert index.commit(allocation) == report(inserted=[21, 22, 23], evicted=[11])
    assert index.match([11]) == []
    index.check_invariants()


def test_abort_reports_evictions_made_by_begin() -> None:
    index = make_index(cp_degree=1, blocks_per_rank=1)
    cache(index, [11])
    allocation = index.begin([21], ALL)
    assert allocation.evicted == [11]
    # The eviction happened (its slot now holds 21's unwritten KV) even though the
    # prefill fails: the trie must learn of it.
    assert index.abort(allocation) == report(evicted=[11])
    assert len(index) == 0
    assert index.num_free_slots(0) == 1
    index.check_invariants()


# -- placement ---------------------------------------------------------------------


def test_block_at_depth_j_lives_on_rank_j_mod_c() -> None:
    index = make_index(cp_degree=3, blocks_per_rank=3)
    chain = [101, 102, 103, 104, 105, 106, 107]
    cache(index, chain)
    locs = index.match(chain)
    assert [x.rank for x in locs] == [0, 1, 2, 0, 1, 2, 0]
    assert [x.slot for x in locs] == [0, 0, 0, 1, 1, 1, 2]
    assert [x.depth for x in locs] == list(range(7))
    assert [index.num_free_slots(r) for r in range(3)] == [0, 1, 1]


def test_allocation_stops_at_the_first_block_that_cannot_be_placed() -> None:
    index = make_index(cp_degree=2, blocks_per_rank=3)
    other = index.begin([21], ALL)  # takes rank 0's slot 0 until it ends
    # Rank 0 has room for two more blocks (depths 0 and 2); depth 4 cannot be placed,
    # so the allocation ends at depth 3 although rank 1 has room: a prefix stays whole.
    allocation = index.begin([11, 12, 13, 14, 15, 16], ALL)
    assert allocation.new == [
        loc(11, 0, 0, 1),
        loc(12, 1, 1, 0),
        loc(13, 2, 0, 2),
        loc(14, 3, 1, 1),
    ]
    assert index.num_free_slots(1) == 1
    blocked = index.begin([31], ALL)
    assert blocked == BlockAllocation(reused=[], new=[])  # rank 0 full, nothing evictable
    assert index.commit(allocation) == report(inserted=[11, 12, 13, 14])
    assert index.commit(blocked) == report()
    assert index.abort(other) == report()
    assert ids(index.match([11, 12, 13, 14, 15, 16])) == [11, 12, 13, 14]
    index.check_invariants()


def test_zero_capacity_caches_nothing() -> None:
    index = make_index(cp_degree=2, blocks_per_rank=0)
    for chain in ([11, 12, 13], [11, 12, 13], [21]):
        allocation = index.begin(chain, ALL)
        assert allocation == BlockAllocation(reused=[], new=[])
        assert index.commit(allocation) == report()
        index.check_invariants()
    assert len(index) == 0
    assert index.match([11, 12, 13]) == []
    assert (index.num_free_slots(0), index.num_free_slots(1)) == (0, 0)


@pytest.mark.parametrize(("cp_degree", "blocks_per_rank"), [(0, 4), (-1, 4), (1, -1)])
def test_invalid_sizes_raise(cp_degree: int, blocks_per_rank: int) -> None:
    with pytest.raises(ValueError):
        WorkerCacheIndex(cp_degree, blocks_per_rank)


# -- running prefills: pins and blocks being written ----------------------------------


def test_blocks_being_written_are_not_allocated_twice() -> None:
    index = make_index(cp_degree=2, blocks_per_rank=4)
    first = index.begin([11, 12, 13], ALL)
    # Same prefix, longer: 11 is being written, so this prefill computes everything
    # and writes nothing (no second copy of 11..13, and 14 would lack its parent).
    second = index.begin([11, 12, 13, 14], ALL)
    assert second == BlockAllocation(reused=[], new=[])
    # An unrelated chain gets fresh slots, not the ones being written.
    third = index.begin([21, 22], ALL)
    assert third.new == [loc(21, 0, 0, 2), loc(22, 1, 1, 1)]
    index.check_invariants()
    assert index.commit(second) == report()
    assert index.commit(first) == report(inserted=[11, 12, 13])
    assert index.commit(third) == report(inserted=[21, 22])
    # Once committed, the longer prefill reuses all three.
    fourth = index.begin([11, 12, 13, 14], ALL)
    assert ids(fourth.reused) == [11, 12, 13]
    assert fourth.new == [loc(14, 3, 1, 2)]
    index.commit(fourth)
    index.check_invariants()


def test_a_branch_may_grow_beside_a_block_being_written() -> None:
    index = make_index(cp_degree=1, blocks_per_rank=4)
    cache(index, [11])
    first = index.begin([11, 12], ALL)
    second = index.begin([11, 22], ALL)
    assert (ids(first.reused), ids(first.new)) == ([11], [12])
    assert (ids(second.reused), ids(second.new)) == ([11], [22])
    assert first.new[0].slot != second.new[0].slot
    assert index.abort(first) == report()
    assert index.commit(second) == report(inserted=[22], parent=11)
    assert ids(index.match([11, 12])) == [11]
    assert ids(index.match([11, 22])) == [11, 22]
    index.check_invariants()


def test_pinned_blocks_are_never_evicted() -> None:
    index = make_index(cp_degree=1, blocks_per_rank=2)
    cache(index, [11])
    running = index.begin([11, 12], ALL)  # pins 11, writes 12: the rank is full
    blocked = index.begin([21], ALL)
    assert blocked == BlockAllocation(reused=[], new=[])  # nothing evictable
    assert index.commit(blocked) == report()
    assert index.commit(running) == report(inserted=[12], parent=11)
    # Unpinned now: 12 is the only leaf, then 11 is.
    allocation = index.begin([21, 22], ALL)
    assert ids(allocation.new) == [21, 22]
    assert allocation.evicted == [12, 11]
    index.commit(allocation)
    index.check_invariants()


def test_refcounts_count_every_running_prefill() -> None:
    index = make_index(cp_degree=1, blocks_per_rank=2)
    cache(index, [11])
    a = index.begin([11], ALL)  # reuses 11 (nothing new: the prefix is all there is)
    b = index.begin([11], ALL)
    assert ids(a.reused) == ids(b.reused) == [11]
    index.commit(a)
    # b still pins 11: a two-block chain gets one slot only (the free one).
    c = index.begin([21, 22], ALL)
    assert ids(c.new) == [21]
    assert c.evicted == []
    index.commit(b)
    index.commit(c)
    # 11 is free now, and older than 21: it goes first.
    d = index.begin([31, 32], ALL)
    assert ids(d.new) == [31, 32]
    assert d.evicted == [11, 21]
    index.check_invariants()


# -- LRU eviction of unreferenced leaves ---------------------------------------------


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    index = make_index(cp_degree=1, blocks_per_rank=3)
    for chain in ([11], [21], [31]):
        cache(index, chain)
    assert cache(index, [41]) == report(inserted=[41], evicted=[11])
    cache(index, [21])  # a hit refreshes 21
    assert cache(index, [51]) == report(inserted=[51], evicted=[31])
    assert cache(index, [61]) == report(inserted=[61], evicted=[41])
    assert cache(index, [71]) == report(inserted=[71], evicted=[21])
    assert sorted(x for x in (11, 21, 31, 41, 51, 61, 71) if x in index) == [51, 61, 71]


def test_eviction_takes_leaves_so_a_chain_goes_from_its_tail() -> None:
    index = make_index(cp_degree=1, blocks_per_rank=3)
    cache(index, [11, 12, 13])
    allocation = index.begin([21, 22], ALL)
    assert allocation.new == [loc(21, 0, 0, 2), loc(22, 1, 0, 1)]  # 13's slot, then 12's
    assert index.commit(allocation) == report(inserted=[21, 22], evicted=[13, 12])
    assert ids(index.match([11, 12, 13])) == [11]
    index.check_invariants()


def test_eviction_prefers_the_older_of_two_branches() -> None:
    index = make_index(cp_degree=1, blocks_per_rank=4)
    cache(index, [11, 12, 13])
    cache(index, [11, 12, 23])  # the branch 23 is newer than 13
    assert cache(index, [31]) == report(inserted=[31], evicted=[13])
    # Leaves now: 23, 31 (and 12 has child 23). The next two evictions: 23 then 12
    # (which became a leaf) — 31 is the newest.
    assert cache(index, [41, 42]) == report(inserted=[41, 42], evicted=[23, 12])
    assert ids(index.match([11, 12])) == [11]
    index.check_invariants()


def test_eviction_keeps_the_reused_parent_of_the_new_block() -> None:
    index = make_index(cp_degree=1, blocks_per_rank=3)
    cache(index, [11, 12, 13])
    allocation = index.begin([11, 12, 24], ALL)
    assert ids(allocation.reused) == [11, 12]
    assert allocation.new == [loc(24, 2, 0, 2)]
    assert index.commit(allocation) == report(inserted=[24], evicted=[13], parent=12)
    index.check_invariants()


def test_eviction_crosses_ranks_to_expose_a_leaf_on_the_full_rank() -> None:
    # C = 2, one slot per rank, chain 11 (rank 0) -> 12 (rank 1). A new chain needs
    # rank 0, whose only block has a child: evict 12 on rank 1, then 11.
    index = make_index(cp_degree=2, blocks_per_rank=1)
    cache(index, [11, 12])
    allocation = index.begin([21, 22], ALL)
    assert allocation.new == [loc(21, 0, 0, 0), loc(22, 1, 1, 0)]
    assert allocation.evicted == [12, 11]
    assert index.commit(allocation) == report(inserted=[21, 22], evicted=[12, 11])
    index.check_invariants()


def test_eviction_on_the_full_rank_comes_before_older_leaves_elsewhere() -> None:
    index = make_index(cp_degree=2, blocks_per_rank=2)
    cache(index, [11, 12])  # 11: rank 0, 12: rank 1 (older leaf)
    cache(index, [21])  # 21: rank 0, a newer leaf, but the only one on rank 0
    allocation = index.begin([31], ALL)
    assert allocation.evicted == [21]
    assert allocation.new == [loc(31, 0, 0, 1)]
    index.commit(allocation)
    index.check_invariants()


# -- reports under concurrent prefills -----------------------------------------------


def test_evicted_then_recached_block_is_not_reported_evicted() -> None:
    # Prefill A evicts 11; prefill B caches 11 again and commits first. A's report,
    # which comes last, must not tell the trie that 11 is gone: it is held.
    index = make_index(cp_degree=1, blocks_per_rank=2)
    cache(index, [11])
    cache(index, [12])
    a = index.begin([21], ALL)
    assert a.evicted == [11]
    b = index.begin([11], ALL)
    assert (ids(b.new), b.evicted) == ([11], [12])
    assert index.commit(b) == report(inserted=[11], evicted=[12])
    assert index.commit(a) == report(inserted=[21])
    assert 11 in index and 21 in index
    index.check_invariants()


def test_evicted_block_being_rewritten_is_reported_evicted() -> None:
    # A evicts 11; B starts writing 11 again; A commits before B: 11 is not held (its
    # KV is not written yet), so A reports it evicted and B's commit re-inserts it.
    index = make_index(cp_degree=1, blocks_per_rank=2)
    cache(index, [11])
    cache(index, [12])
    a = index.begin([21], ALL)
    b = index.begin([11], ALL)
    assert index.commit(a) == report(inserted=[21], evicted=[11])
    assert index.abort(b) == report(evicted=[12])
    assert 11 not in index
    index.check_invariants()


# -- random operations ---------------------------------------------------------------

BLOCK = 2


class CheckedIndex:
    """A ``WorkerCacheIndex`` driven by random operations, checked after every step.

    Beside ``check_invariants``, a model of the global trie's view of this worker:
    ``trie`` applies every report in the order returned. At any time, a block held
    (committed) must be known to the trie, and a block the trie knows but the worker
    does not hold must have been evicted by a prefill still running (whose report is
    yet to come); with no prefill running the trie is exact.
    """

    def __init__(self, cp_degree: int, blocks_per_rank: int) -> None:
        self.index = WorkerCacheIndex(cp_degree, blocks_per_rank, worker_id=WORKER)
        self.running: list[BlockAllocation] = []
        self.trie: set[int] = set()
        self.seen: set[int] = set()

    def held(self) -> set[int]:
        return {b for b in self.seen if b in self.index}

    def begin(self, tokens: Sequence[int], max_reuse: int) -> None:
        chain = block_ids(tokens, BLOCK)
        self.seen.update(chain)
        held_before = self.held()
        writing = {x.block_id for allocation in self.running for x in allocation.new}
        matched = self.index.match(chain)
        allocation = self.index.begin(chain, max_reuse)
        assert allocation.reused == matched[: max(0, max_reuse)]
        k, n = len(allocation.reused), len(allocation.new)
        assert ids(allocation.new) == chain[k : k + n]
        c = self.index.cp_degree
        for depth, x in enumerate(allocation.new, start=k):
            assert (x.depth, x.rank) == (depth, depth % c)
            assert x.block_id not in held_before and x.block_id not in writing
        if k + n < len(chain):  # stopped early: a held or written block, or no room
            nxt = chain[k + n]
            full = self.index.num_free_slots((k + n) % c) == 0
            assert nxt in held_before or nxt in writing or full
        assert len(set(allocation.evicted)) == len(allocation.evicted)
        for bid in allocation.evicted:
            assert bid in held_before and bid not in self.index
        self.running.append(allocation)

    def commit(self, pick: int) -> None:
        allocation = self.running.pop(pick % len(self.running))
        rep = self.index.commit(allocation)
        assert rep.worker_id == WORKER
        assert rep.inserted == tuple(ids(allocation.new))
        assert set(rep.evicted) <= set(allocation.evicted)
        assert not set(rep.inserted) & set(rep.evicted)
        self.trie -= set(rep.evicted)
        self.trie |= set(rep.inserted)
        for x in allocation.new:
            assert x.block_id in self.index

    def abort(self, pick: int) -> None:
        allocation = self.running.pop(pick % len(self.running))
        rep = self.index.abort(allocation)
        assert rep.worker_id == WORKER
        assert rep.inserted == ()
        assert set(rep.evicted) <= set(allocation.evicted)
        self.trie -= set(rep.evicted)
        for x in allocation.new:
            assert x.block_id not in self.index

    def check(self) -> None:
        index = self.index
        index.check_invariants()
        held = self.held()
        assert held <= self.trie, f"held but unknown to the trie: {held - self.trie}"
        pending = {b for allocation in self.running for b in allocation.evicted}
        assert self.trie - held <= pending, "the trie knows blocks the worker dropped"
        if not self.running:
            assert self.trie == held
        assert len(index) <= index.cp_degree * index.blocks_per_rank
        new_blocks = [x.block_id for allocation in self.running for x in allocation.new]
        assert len(new_blocks) == len(set(new_blocks)), "a block written by two prefills"
        for allocation in self.running:
            chain = ids(allocation.reused)
            assert ids(index.match(chain)) == chain, "a pinned block went missing"


@pytest.mark.parametrize("seed", range(40))
def test_cache_index_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    checked = CheckedIndex(cp_degree=rng.randint(1, 3), blocks_per_rank=rng.randint(0, 4))
    for _ in range(150):
        if not checked.running or (len(checked.running) < 4 and rng.random() < 0.5):
            # Two token values, 2-token blocks: 4 distinct blocks per depth, so
            # prefixes are shared often and small caches evict often.
            tokens = [rng.randint(0, 1) for _ in range(rng.randint(1, 9))]
            checked.begin(tokens, max_reuse=rng.randint(-1, 5))
        elif rng.random() < 0.8:
            checked.commit(rng.randrange(len(checked.running)))
        else:
            checked.abort(rng.randrange(len(checked.running)))
        checked.check()


TOKENS = st.lists(st.integers(min_value=0, max_value=1), min_size=1, max_size=9)


class CacheIndexMachine(RuleBasedStateMachine):
    """The same checks, with hypothesis choosing (and shrinking) the operations."""

    @initialize(cp_degree=st.integers(1, 3), blocks_per_rank=st.integers(0, 3))
    def setup(self, cp_degree: int, blocks_per_rank: int) -> None:
        self.checked = CheckedIndex(cp_degree, blocks_per_rank)

    @rule(tokens=TOKENS, max_reuse=st.integers(-1, 5))
    def begin(self, tokens: list[int], max_reuse: int) -> None:
        self.checked.begin(tokens, max_reuse)

    @precondition(lambda self: self.checked.running)
    @rule(pick=st.integers(0, 50))
    def commit(self, pick: int) -> None:
        self.checked.commit(pick)

    @precondition(lambda self: self.checked.running)
    @rule(pick=st.integers(0, 50))
    def abort(self, pick: int) -> None:
        self.checked.abort(pick)

    @invariant()
    def consistent(self) -> None:
        self.checked.check()


CacheIndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, derandomize=True
)
test_cache_index_stateful = CacheIndexMachine.TestCase


def test_adopt_takes_blocks_at_their_slots_and_stops_at_a_misplaced_one() -> None:
    index = WorkerCacheIndex(cp_degree=2, blocks_per_rank=4, worker_id=WORKER)
    # (block, rank, slot): depth 0 on rank 0, depth 1 on rank 1, depth 2 on rank 1 (wrong).
    report = index.adopt([(11, 0, 3), (12, 1, 2), (13, 1, 0)])
    assert report == CacheReport(WORKER, inserted=(11, 12))
    assert ids(index.match([11, 12, 13])) == [11, 12]
    assert [(loc.rank, loc.slot) for loc in index.match([11, 12])] == [(0, 3), (1, 2)]
    assert index.num_free_slots(0) == 3 and index.num_free_slots(1) == 3
    index.check_invariants()
    # Extending an adopted prefix: the held block is skipped, the next adopted under it.
    report = index.adopt([(11, 0, 3), (12, 1, 2), (14, 0, 1)])
    assert report == CacheReport(WORKER, inserted=(14,), inserted_parent=12)
    # New prefills never take an adopted slot; the LRU may evict adopted leaves.
    allocation = index.begin([11, 12, 14, 15], 4)
    assert allocation.num_reused_blocks == 3 and allocation.new[0].slot != 2
    index.commit(allocation)
    index.check_invariants()
    assert index.locations()[14].slot == 1


def test_reserved_slots_are_never_allocated_until_released() -> None:
    index = WorkerCacheIndex(cp_degree=1, blocks_per_rank=2, worker_id=WORKER)
    assert index.reserve(0, 1) and not index.reserve(0, 1)
    index.check_invariants()
    allocation = index.begin([11, 12], 2)
    assert [loc.slot for loc in allocation.new] == [0]  # the reserved slot is skipped
    index.commit(allocation)
    index.release(0, 1)
    index.release(0, 1)  # twice: no effect
    index.check_invariants()
    assert index.num_free_slots(0) == 1
