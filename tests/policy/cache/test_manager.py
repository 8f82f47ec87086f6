"""The prefix-cache manager: Algorithm 1 (per-request statistics), Algorithm 2 (the
scan and its plans), confirmation before visibility, and split/merge hooks. Exact
ids, orders, devices and amounts, on a pool small enough to reason about by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from support.policy import CACHE_COEFFS
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import BlockMove, CacheManagerConfig, CopyPlan

B = 16  # tokens per block
# The paper's Algorithm 2 as written (unpriced): these tests pin its mechanics; the
# price every plan must pay is tested at the end of the file.
CONFIG = CacheManagerConfig(
    theta_inter_s=0.02, theta_intra=3.0, theta_reclaim=1.0, decay=0.5, priced=False
)


class Pool:
    """Workers 10, 11 (degree 1, devices 0, 1) and 20 (degree 2, devices 2-3), each with
    a real cache index of ``blocks_per_rank`` slots per rank, and the manager."""

    def __init__(self, config: CacheManagerConfig = CONFIG, blocks_per_rank: int = 64) -> None:
        self.manager = PrefixCacheManager(CACHE_COEFFS, B, config)
        self.caches: dict[int, WorkerCacheIndex] = {}
        self.blocks_per_rank = blocks_per_rank
        for worker_id, degree, first in ((10, 1, 0), (11, 1, 1), (20, 2, 2)):
            self.add(worker_id, degree, first)

    def add(self, worker_id: int, degree: int, first: int) -> None:
        self.manager.add_worker(worker_id, degree, first)
        self.caches[worker_id] = WorkerCacheIndex(degree, self.blocks_per_rank, worker_id)

    def prefill(self, worker_id: int, chain: Sequence[int], input_tokens: int | None = None):
        """Place a request on ``worker_id``: statistics, then the prefill and its report."""
        n = len(chain) * B + 1 if input_tokens is None else input_tokens
        update = self.manager.on_request(chain, n, worker_id)
        cache = self.caches[worker_id]
        self.manager.apply_report(cache.commit(cache.begin(chain, (n - 1) // B)))
        return update

    def execute(self, plan: CopyPlan, ok: bool = True) -> None:
        cache = self.caches[plan.dest_worker]
        if ok:
            allocation = cache.begin(plan.prefix_ids, len(plan.prefix_ids))
            self.manager.apply_report(cache.commit(allocation))
        self.manager.finish_copy(plan.plan_id, ok)

    def check(self) -> None:
        self.manager.check_invariants(self.caches)
        for cache in self.caches.values():
            cache.check_invariants()


def time_s(c: int, n: int, p: int) -> float:
    return CACHE_COEFFS[c].predict(c, n - p, p)


def test_algorithm_1_access_preferred_degree_and_missed() -> None:
    pool = Pool()
    pool.prefill(10, [1, 2, 3])
    pool.check()
    trie = pool.manager.trie
    assert trie.nodes[1].access is None  # the first request reused nothing
    # 129 tokens: blocks 1, 2, 3 matched (held by 10), block 4 new.
    update = pool.prefill(10, [1, 2, 3, 4], input_tokens=129)
    assert (update.matched_blocks, update.reused_blocks) == (3, 3)
    # PreferDegree: the placement cost without load, with P* = 48.
    assert time_s(2, 129, 48) < time_s(1, 129, 48)
    assert update.preferred_degree == 2
    for bid in (1, 2, 3):
        assert trie.nodes[bid].access == [1.0, 0.0]
    # No degree-2 replica: each matched node is charged its marginal benefit at C=2.
    for depth, bid in enumerate((1, 2, 3)):
        want = time_s(2, 129, depth * B) - time_s(2, 129, (depth + 1) * B)
        assert trie.nodes[bid].missed == pytest.approx([0.0, want], rel=1e-12)
    # Placed on 11, which holds nothing: matched 4 blocks, reused none.
    update = pool.prefill(11, [1, 2, 3, 4, 5], input_tokens=81)
    assert (update.matched_blocks, update.reused_blocks) == (4, 0)
    assert trie.nodes[1].access == [1.0, 0.0]
    pool.check()


def test_reuse_is_whole_blocks_with_one_token_left() -> None:
    pool = Pool()
    pool.prefill(10, [1, 2, 3], input_tokens=48 + 5)
    # 48 tokens exactly: only 2 blocks may be reused (the last token is computed).
    assert pool.manager.reusable_tokens([1, 2, 3], 48) == {10: 32}
    assert pool.manager.reusable_tokens([1, 2, 3], 49) == {10: 48}
    assert pool.manager.reusable_tokens([9], 49) == {}


def test_inter_degree_replication_plan_and_visibility() -> None:
    pool = Pool()
    chain = [1, 2, 3]
    for _ in range(4):
        pool.prefill(10, chain, input_tokens=129)
    missed = [pool.manager.trie.nodes[b].missed[1] for b in chain]
    assert min(missed) > CONFIG.theta_inter_s
    result = pool.manager.scan(pool.caches, loads={10: 0.0, 11: 0.0, 20: 0.0})
    assert result.candidates["inter"] == 3 and result.reclaims == ()
    (plan,) = result.copies  # the deepest node, bringing its ancestors: one plan
    assert (plan.kind, plan.block_id, plan.dest_worker, plan.cp_degree) == ("inter", 3, 20, 2)
    assert plan.prefix_ids == (1, 2, 3) and plan.reshard
    assert plan.score == pytest.approx(sum(missed) / 3)
    # Block j: from device 0 (worker 10, degree 1) to device 2 + j % 2.
    assert plan.moves == (
        BlockMove(1, 0, 10, 0, 2),
        BlockMove(2, 1, 10, 0, 3),
        BlockMove(3, 2, 10, 0, 2),
    )
    # Statistics decayed after the scan.
    assert pool.manager.trie.nodes[1].missed[1] == pytest.approx(missed[0] * CONFIG.decay)
    # Not visible before the destination confirms.
    assert pool.manager.reusable_tokens(chain, 65) == {10: 48}
    pool.check()
    # While in flight, the next scan does not plan it again.
    assert pool.manager.scan(pool.caches, {}).copies == ()
    pool.execute(plan)
    assert pool.manager.reusable_tokens(chain, 65) == {10: 48, 20: 48}
    assert pool.manager.copies_in_flight == {}
    pool.check()


def test_destination_prefers_the_longer_held_path_then_room_then_load() -> None:
    pool = Pool()
    pool.add(21, 2, 4)
    pool.prefill(10, [1, 2, 3, 4])
    pool.prefill(21, [1, 2])  # 21 holds half of the path already
    for _ in range(6):
        pool.prefill(10, [1, 2, 3, 4], input_tokens=129)
    copies = pool.manager.scan(pool.caches, {20: 0.0, 21: 9.0}).copies
    (plan,) = [p for p in copies if p.kind == "inter"]
    assert plan.dest_worker == 21  # despite its load: it needs two blocks, not four
    assert [m.block_id for m in plan.moves] == [3, 4]
    assert plan.prefix_ids == (1, 2, 3, 4)


def test_intra_replication_ranks_by_access_per_replica_and_is_cut() -> None:
    config = CacheManagerConfig(
        theta_inter_s=1e9, theta_intra=2.0, theta_reclaim=0.5, max_intra_per_scan=1
    )
    pool = Pool(config)
    pool.prefill(10, [1, 2])
    pool.prefill(10, [5])
    for _ in range(5):
        pool.prefill(10, [1, 2], input_tokens=33)  # access 5 on blocks 1 and 2
    for _ in range(3):
        pool.prefill(10, [5, 6], input_tokens=17 + 16)  # access 3 on block 5
    result = pool.manager.scan(pool.caches, {})
    assert result.candidates["intra"] == 3  # 1, 2 and 5 (one replica each)
    (plan,) = result.copies  # cut to one
    # Blocks 1 and 2 tie at 5 accesses per replica, ahead of block 5 (3 accesses);
    # of the two, the smaller copy goes first: block 1 alone.
    assert (plan.kind, plan.block_id, plan.dest_worker, plan.reshard) == ("intra", 1, 11, False)
    assert plan.moves == (BlockMove(1, 0, 10, 0, 1),)
    pool.execute(plan)
    pool.check()


def test_reclamation_keeps_one_replica_and_never_touches_blocks_in_use() -> None:
    pool = Pool()
    pool.prefill(10, [1, 2])
    pool.prefill(11, [1, 2])  # two degree-1 replicas, never reused
    allocation = pool.caches[11].begin([1, 2, 3], 3)  # 11 is prefilling on top of them
    result = pool.manager.scan(pool.caches, {10: 5.0, 11: 0.0})
    assert result.candidates["reclaim"] == 2
    # Block 2 is the leaf at both, but in use at 11: reclaim it at 10 only, and never
    # block 1, which still has a child at 10.
    (plan,) = result.reclaims
    assert (plan.worker_id, plan.block_id, plan.cp_degree, plan.score) == (10, 2, 1, 0.0)
    assert pool.manager.scan(pool.caches, {}).reclaims == ()  # 11 keeps the last one
    # Still visible until the deletion is confirmed.
    assert pool.manager.reusable_tokens([1, 2], 33) == {10: 32, 11: 32}
    report = pool.caches[10].reclaim(2)
    assert report is not None and report.evicted == (2,)
    pool.manager.apply_report(report)
    assert pool.manager.finish_reclaim(plan.plan_id, ok=True)
    assert pool.manager.reusable_tokens([1, 2], 33) == {10: 16, 11: 32}
    pool.manager.apply_report(pool.caches[11].commit(allocation))
    assert pool.caches[11].reclaim(1) is None  # has a child: refused
    pool.check()


def test_merge_makes_prefixes_pending_and_adopts_those_in_place() -> None:
    pool = Pool()
    pool.prefill(10, [1, 2, 3])
    pool.prefill(11, [1, 2, 7])
    plans = pool.manager.merge([10, 11], 12, cp_degree=2, first_device=0)
    del pool.caches[10], pool.caches[11]
    pool.caches[12] = WorkerCacheIndex(2, 64, 12)
    trie = pool.manager.trie
    # Under degree 2 on devices 0-1, block j belongs on device j % 2. Worker 10 kept
    # its blocks on device 0, worker 11 on device 1: block 1 (depth 0) is in place
    # from 10, block 2 (depth 1) from 11, block 3 (depth 2) from 10; block 7 (depth
    # 2) sits on device 1 but belongs on device 0.
    assert trie.nodes[3].pending == {trie.worker(12).slot: 0}
    assert trie.nodes[7].pending == {trie.worker(12).slot: 1}
    assert [(p.kind, p.prefix_ids) for p in plans] == [("adopt", (1, 2, 3))]
    assert all(m.src_device == m.dst_device and m.src_worker is None for m in plans[0].moves)
    assert pool.manager.reusable_tokens([1, 2, 3], 49) == {}  # pending is not reusable
    pool.check()
    pool.execute(plans[0])
    assert pool.manager.reusable_tokens([1, 2, 3], 49) == {12: 48}
    # First reuse of the rest: a fetch of block 7 from the device that kept it.
    update = pool.manager.on_request([1, 2, 7], 49, 12)
    assert update.reused_blocks == 2
    assert update.fetch is not None and update.fetch.kind == "fetch"
    assert update.fetch.moves == (BlockMove(7, 2, None, 1, 0),)
    pool.execute(update.fetch)
    assert pool.manager.reusable_tokens([1, 2, 7], 49) == {12: 48}
    assert trie.worker_pending[12] == set()
    pool.check()


def test_split_assigns_prefixes_by_demand_and_room() -> None:
    pool = Pool()
    for chain, uses in (([1, 2, 3], 3), ([1, 4], 2), ([5, 6], 1)):
        for _ in range(uses):
            pool.prefill(20, chain)
    plans = pool.manager.split(20, [(21, 2), (22, 3)], child_degree=1, capacity_blocks=3)
    del pool.caches[20]
    for worker_id in (21, 22):
        pool.caches[worker_id] = WorkerCacheIndex(1, 64, worker_id)
    trie = pool.manager.trie
    pending = {w: sorted(n.block_id for n in trie.worker_pending[w]) for w in (21, 22)}
    # Most demanded first: [1, 2, 3] to 21; then [1, 4] to 22 (less demand so far);
    # [5, 6] needs two new blocks at either child, past the 3 allowed: dropped.
    assert pending == {21: [1, 2, 3], 22: [1, 4]}
    # Worker 20 kept block j on device 2 + j % 2: child 21 (device 2) has depth 0 and
    # 2 in place, child 22 (device 3) has nothing at depth 0: only 21 adopts block 1.
    assert [(p.dest_worker, p.prefix_ids) for p in plans] == [(21, (1,))]
    pool.check()
    for plan in plans:
        pool.execute(plan)
    # 22 reuses [1, 4]: both blocks fetched, block 1 from 21 (a confirmed holder of
    # the same degree) or the retained device 2 (preferred: no worker involved).
    update = pool.manager.on_request([1, 4], 33, 22)
    assert update.fetch is not None
    assert update.fetch.moves == (BlockMove(1, 0, None, 2, 3), BlockMove(4, 1, None, 3, 3))
    pool.execute(update.fetch, ok=False)  # the retained copy was gone: ordinary miss
    assert trie.worker_pending[22] == set()
    pool.check()


def test_fetch_without_any_copy_is_an_ordinary_miss() -> None:
    pool = Pool()
    pool.prefill(10, [1, 2])
    pool.manager.merge([10], 13, cp_degree=1, first_device=0)  # a re-adoption of 10
    del pool.caches[10]
    pool.caches[13] = WorkerCacheIndex(1, 64, 13)
    trie = pool.manager.trie
    trie.nodes[2].pending[trie.worker(13).slot] = None  # block 2's copy is lost
    for plan in list(pool.manager.copies_in_flight.values()):
        pool.execute(plan, ok=False)
    update = pool.manager.on_request([1, 2], 33, 13)
    assert update.fetch is None and trie.worker_pending[13] == set()
    pool.check()


def test_removing_a_worker_cancels_its_plans() -> None:
    pool = Pool()
    for _ in range(4):
        pool.prefill(10, [1, 2, 3], input_tokens=129)
    (plan,) = pool.manager.scan(pool.caches, {}).copies
    pool.manager.remove_worker(10)  # the source failed
    del pool.caches[10]
    assert pool.manager.copies_in_flight == {}
    assert pool.manager.finish_copy(plan.plan_id, ok=True) is False  # late: ignored
    assert pool.manager.trie.nodes.keys() <= {1, 2, 3}
    pool.check()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="theta_reclaim < theta_intra"):
        CacheManagerConfig(theta_intra=1.0, theta_reclaim=1.0)
    with pytest.raises(ValueError, match="decay"):
        CacheManagerConfig(decay=1.0)


def test_reclaim_candidates_go_deepest_first_and_the_search_is_bounded() -> None:
    def plans(probe: int) -> list[int]:
        config = CacheManagerConfig(max_reclaim_per_scan=1, reclaim_probe=probe, priced=False)
        pool = Pool(config)
        for worker_id in (10, 11):
            pool.prefill(worker_id, [1, 2, 3])
            pool.prefill(worker_id, [5])
            pool.caches[worker_id].begin([1, 2, 3, 4], 4)  # block 3 in use at both
        # Candidates, all cold and replicated twice: 3 (deepest), 2, 1, then 5.
        return [p.block_id for p in pool.manager.scan(pool.caches, {}).reclaims]

    assert plans(probe=1) == []  # only block 3 examined: in use everywhere
    assert plans(probe=4) == [5]


def test_intra_smaller_copy_first_when_access_is_close() -> None:
    config = CacheManagerConfig(
        theta_inter_s=1e9, theta_intra=2.0, theta_reclaim=0.5, max_intra_per_scan=1
    )
    pool = Pool(config)
    pool.prefill(10, [1, 2, 3, 4])
    pool.prefill(10, [7])
    for _ in range(4):
        pool.prefill(10, [1, 2, 3, 4], input_tokens=65)  # access 4 on the 4-block chain
        pool.prefill(10, [7, 8], input_tokens=33)  # access 4 on block 7, 3 on block 8
    (plan,) = pool.manager.scan(pool.caches, {}).copies
    # Chain [1..4] and block 7 are close (4 against 4): a one-block copy goes first,
    # the chain's root (block 1) before 7 on the id; never the 4-block chain.
    assert plan.block_id == 1 and [m.block_id for m in plan.moves] == [1]


def test_a_reclamation_pays_only_for_room_that_is_needed() -> None:
    pool = Pool(CacheManagerConfig(theta_reclaim=1.0), blocks_per_rank=2)  # priced
    for worker_id in (10, 11):
        pool.prefill(worker_id, [1, 2])  # two cold degree-1 replicas; 10 and 11 full
    result = pool.manager.scan(pool.caches, {})
    # Nothing was lost from the pool yet: a freed slot is worth nothing.
    assert result.reclaims == () and result.unpaid["reclaim"] == 1
    # Now each eviction is measured to cost 0.5 s of prefill (priced at 4 x 0.5 s):
    # the cold replica (no reuse to lose) is worth less than a slot of a full cache.
    pool.manager.eviction.evicted, pool.manager.eviction.ghost_benefit_s = 4.0, 2.0
    (plan,) = pool.manager.scan(pool.caches, {}).reclaims
    assert (plan.block_id, plan.loss_s) == (2, 0.0)
    pool.manager.finish_reclaim(plan.plan_id, ok=False)
    # With free room at every holder, reclaiming frees nothing that is needed.
    roomy = Pool(CacheManagerConfig(theta_reclaim=1.0), blocks_per_rank=8)
    for worker_id in (10, 11):
        roomy.prefill(worker_id, [1, 2])
    roomy.manager.eviction.evicted, roomy.manager.eviction.ghost_benefit_s = 4.0, 2.0
    assert roomy.manager.scan(roomy.caches, {}).reclaims == ()


def test_a_copy_pays_for_what_it_evicts() -> None:
    config = CacheManagerConfig(theta_inter_s=1e9, theta_intra=2.0, theta_reclaim=0.5)
    for ghost_benefit_s, copies in ((0.0, 2), (1e6, 0)):  # blocks 1 and (1, 2), or none
        pool = Pool(config, blocks_per_rank=3)
        pool.prefill(11, [7, 8, 9])  # 11 full: a copy there evicts
        pool.prefill(10, [1, 2])
        for _ in range(5):
            pool.prefill(10, [1, 2], input_tokens=33)  # hot at 10
        pool.manager.eviction.evicted = 1.0
        pool.manager.eviction.ghost_benefit_s = ghost_benefit_s
        result = pool.manager.scan(pool.caches, {10: 5.0})
        assert len(result.copies) == copies, ghost_benefit_s
        if copies:  # nothing lost yet: free to evict; the predicted benefit is > 0
            assert all(p.dest_worker == 11 and p.benefit_s > 0 for p in result.copies)
        else:
            assert result.unpaid["intra"] == 2
