"""The KV ledger on the policy objects: a merge adopts what is in place and reserves
the rest within budget (most accessed first); a fetch reads a reserved slot and gives
it back; reservations run out after ``retain_s``, but never under a fetch reading
them; a holder copy pins its source; cancelled plans do not run."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from support.policy import policy_stack
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.ledger import KVLedger
from vertumnus.policy.cache.retention import RetentionConfig
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.lattice import Lattice

B = 16  # tokens per block
SLOTS = 8  # per rank


class Pool:
    """Two degree-1 workers (devices 0 and 1) that can merge into one of degree 2."""

    def __init__(self, retention: RetentionConfig) -> None:
        policy = policy_stack(Lattice(LatticeConfig(2, (1, 2)), [1, 1]), blocks_per_rank=SLOTS)
        self.lattice, self.cache, self.reconf = policy.lattice, policy.cache, policy.reconfigurer
        self.indexes = {
            w.worker_id: WorkerCacheIndex(w.cp_degree, SLOTS, w.worker_id)
            for w in self.lattice.workers.values()
        }
        self.ledger = KVLedger(self.lattice, self.indexes, self.cache, SLOTS, retention)

    def hold(self, worker: int, blocks: Sequence[int], accesses: int = 0) -> None:
        index = self.indexes[worker]
        self.cache.apply_report(index.commit(index.begin(blocks, len(blocks))))
        for _ in range(accesses):
            self.cache.on_request(blocks, (len(blocks) + 1) * B, worker)

    def merge(self, now: float) -> tuple[int, int, int]:
        """Returns (merged worker, blocks adopted, slots reserved)."""
        op = self.lattice.merge_options()[0]
        transition, _ = self.reconf.begin(op, now)  # idle workers: switching at once
        retained = self.ledger.collect(op.sources)
        adopt = self.reconf.switch(transition, now)
        for s in op.sources:
            del self.indexes[s]
        (merged,) = transition.new_workers
        self.indexes[merged] = WorkerCacheIndex(2, SLOTS, merged)
        adopted, reserved = self.ledger.after_switch([merged], retained, adopt, now)
        return merged, adopted, reserved

    def request(self, worker: int, blocks: Sequence[int]):  # type: ignore[no-untyped-def]
        return self.cache.on_request(blocks, (len(blocks) + 1) * B, worker).fetch


def merged_pool(retention: RetentionConfig) -> tuple[Pool, int, int, int]:
    pool = Pool(retention)
    # Degree 2 wants block j on device j % 2. Worker 0 (device 0) has 11 12 13 14,
    # worker 1 (device 1) has 11 12 15: 11 (depth 0, device 0), 12 (depth 1,
    # device 1) and 13 (depth 2, device 0) are in place; 14 and 15 are not.
    pool.hold(0, [11, 12, 13, 14], accesses=1)
    pool.hold(1, [11, 12, 15], accesses=3)
    return pool, *pool.merge(now=0.0)


def test_merge_adopts_in_place_and_reserves_the_rest() -> None:
    pool, merged, adopted, reserved = merged_pool(RetentionConfig(retain_s=10.0))
    index = pool.indexes[merged]
    assert adopted == 3 and [loc.block_id for loc in index.match([11, 12, 13, 14])] == [11, 12, 13]
    # 14 (device 0) and 15 (device 1) are reserved; the second copies of the adopted
    # 11 and 12 are not (the merged worker holds those blocks).
    assert reserved == 2 and pool.ledger.reserved_blocks == 2
    assert index.num_free_blocks() == 2 * SLOTS - 3 - 2
    assert pool.ledger.next_deadline() == pytest.approx(10.0)


def test_a_fetch_reads_the_reserved_slot_and_gives_it_back() -> None:
    pool, merged, _, _ = merged_pool(RetentionConfig(retain_s=10.0))
    index = pool.indexes[merged]
    plan = pool.request(merged, [11, 12, 13, 14])
    assert plan is not None and plan.kind == "fetch" and plan.block_ids == (14,)
    job = pool.ledger.begin_copy(plan)
    assert job is not None and job.src_worker is None
    ((src_rank, _, dst_rank, dst_slot),) = job.moves
    assert (src_rank, dst_rank) == (0, 1)  # depth 3 belongs on device 1
    assert pool.ledger.commit_copy(job) == 1
    assert [loc.block_id for loc in index.match([11, 12, 13, 14])] == [11, 12, 13, 14]
    assert index.match([11, 12, 13, 14])[3].slot == dst_slot
    # The retained slot of 14 went back: one slot taken, one freed.
    assert pool.ledger.reserved_blocks == 1 and index.num_free_blocks() == 2 * SLOTS - 3 - 2
    assert pool.cache.reusable_tokens([11, 12, 13, 14], 5 * B) == {merged: 4 * B}
    assert plan.plan_id not in pool.cache.copies_in_flight


def test_reservations_run_out_but_not_under_a_fetch() -> None:
    pool, merged, _, _ = merged_pool(RetentionConfig(retain_s=10.0))
    index = pool.indexes[merged]
    plan = pool.request(merged, [11, 12, 15])
    assert plan is not None and plan.block_ids == (15,)
    job = pool.ledger.begin_copy(plan)
    assert job is not None
    assert pool.ledger.expire(now=9.0) == 0  # not yet
    assert pool.ledger.expire(now=10.0) == 1  # 14's slot; 15's is being read
    assert pool.ledger.reserved_blocks == 1 and pool.ledger.next_deadline() is None
    free = index.num_free_blocks()
    pool.ledger.abort_copy(job)  # the read failed: the expired slot goes back now
    assert pool.ledger.reserved_blocks == 0
    assert index.num_free_blocks() == free + 2  # the fetch's own slot and 15's
    # Nothing left to fetch from: the next request for 15 is an ordinary miss.
    later = pool.request(merged, [11, 12, 15])
    assert later is None or pool.ledger.begin_copy(later) is None


def test_the_budget_keeps_the_most_accessed_blocks() -> None:
    # One slot per rank: 2 for the merged worker, and three blocks out of place: 14
    # (1 access), 15 and 16 (3 each). 16 is on device 1, where depth 3 belongs, but
    # its parent 15 is not in place, so it cannot be adopted.
    pool = Pool(RetentionConfig(reserve_fraction=1 / SLOTS))
    pool.hold(0, [11, 12, 13, 14], accesses=1)
    pool.hold(1, [11, 12, 15, 16], accesses=3)
    merged, adopted, reserved = pool.merge(now=0.0)
    assert adopted == 3 and reserved == 2
    assert pool.request(merged, [11, 12, 13, 14]) is not None
    plan = pool.request(merged, [11, 12, 15, 16])
    assert plan is not None and plan.block_ids == (15, 16)
    job = pool.ledger.begin_copy(plan)
    assert job is not None and pool.ledger.commit_copy(job) == 2
    # 14 had no reserved slot: its fetch ends as a miss, and its pending mark goes.
    plans = list(pool.cache.copies_in_flight.values())
    assert [p.block_ids for p in plans] == [(14,)]
    assert pool.ledger.begin_copy(plans[0]) is None
    assert pool.cache.copies_in_flight == {}


def test_a_holder_copy_pins_its_source_and_needs_the_whole_prefix() -> None:
    pool = Pool(RetentionConfig())
    pool.hold(0, [21, 22, 23])
    plan = pool.cache.plan_copy(23, source=0, dest=1)
    job = pool.ledger.begin_copy(plan)
    assert job is not None and job.src_worker == 0 and job.num_blocks == 3
    assert not pool.indexes[0].can_reclaim(23)  # pinned while it is read
    assert pool.ledger.commit_copy(job) == 3
    assert pool.indexes[0].can_reclaim(23)
    assert pool.cache.reusable_tokens([21, 22, 23], 4 * B) == {0: 3 * B, 1: 3 * B}
    # A copy planned from a source that has since lost the prefix does not run.
    pool.hold(0, [31, 32])
    plan = pool.cache.plan_copy(32, source=0, dest=1)
    pool.cache.apply_report(pool.indexes[0].reclaim(32))  # type: ignore[arg-type]
    assert pool.ledger.begin_copy(plan) is None
    assert plan.plan_id not in pool.cache.copies_in_flight


def test_retention_config_is_checked() -> None:
    with pytest.raises(ValueError, match="reserve_fraction"):
        RetentionConfig(reserve_fraction=1.5)


def test_reconcile_fetches_every_pending_prefix_most_accessed_first() -> None:
    pool, merged, _, _ = merged_pool(RetentionConfig(retain_s=10.0))
    plans = pool.cache.reconcile(merged)
    # 15 (three accesses) before 14 (one); each plan brings its missing block only.
    assert [p.block_ids for p in plans] == [(15,), (14,)]
    assert all(p.kind == "fetch" for p in plans)
    for plan in plans:
        job = pool.ledger.begin_copy(plan)
        assert job is not None and pool.ledger.commit_copy(job) == 1
    index = pool.indexes[merged]
    assert len(index.match([11, 12, 13, 14])) == 4 and len(index.match([11, 12, 15])) == 3
    assert pool.ledger.reserved_blocks == 0 and pool.cache.reconcile(merged) == []
