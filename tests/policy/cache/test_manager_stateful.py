"""A hypothesis state machine over the prefix-cache manager and real worker cache
indexes: random requests (some failing), scans, copies and reclamations that
succeed or fail, worker failures and restarts, splits and merges of a 4-device
lattice of degrees {1, 2}. After every step the trie must agree with every
worker's cache and with the plans in flight."""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from support.policy import CACHE_COEFFS
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CacheManagerConfig, CopyPlan, ReclaimPlan

B = 16
# Low thresholds, so that every kind of plan happens often.
CONFIG = CacheManagerConfig(
    theta_inter_s=0.005, theta_intra=1.5, theta_reclaim=1.0, decay=0.6, max_reclaim_per_scan=3
)
# Chains of a small prefix tree: a block id always has the same parent.
CHAINS = ([1, 2, 3, 4, 5, 11], [1, 2, 6, 7], [8, 9, 12], [1, 10], [13])
BLOCKS_PER_RANK = 4  # small: evictions all the time


class CacheManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = PrefixCacheManager(CACHE_COEFFS, B, CONFIG)
        self.caches: dict[int, WorkerCacheIndex] = {}
        self.geometry: dict[int, tuple[int, int]] = {}  # worker -> (degree, first device)
        self.copies: list[CopyPlan] = []
        self.reclaims: list[ReclaimPlan] = []
        self.next_id = 0
        for degree, first in ((1, 0), (1, 1), (2, 2)):
            self._add(degree, first)

    def _add(self, degree: int, first: int) -> int:
        worker_id = self.next_id
        self.next_id += 1
        self.manager.add_worker(worker_id, degree, first)
        self.caches[worker_id] = WorkerCacheIndex(degree, BLOCKS_PER_RANK, worker_id)
        self.geometry[worker_id] = (degree, first)
        return worker_id

    def _drop(self, worker_id: int) -> None:
        del self.caches[worker_id], self.geometry[worker_id]

    def _copy(self, plan: CopyPlan, ok: bool) -> None:
        if plan.plan_id not in self.manager.copies_in_flight:
            return  # cancelled when a worker involved left
        dest = self.caches[plan.dest_worker]
        sources_ok = all(
            m.src_worker is None or m.block_id in self.caches[m.src_worker] for m in plan.moves
        )
        if ok and sources_ok:
            allocation = dest.begin(plan.prefix_ids, len(plan.prefix_ids))
            self.manager.apply_report(dest.commit(allocation))
            event(f"{plan.kind} copy done")
        else:
            event(f"{plan.kind} copy failed")
        assert self.manager.finish_copy(plan.plan_id, ok and sources_ok)

    @rule(
        worker=st.integers(0, 10),
        chain=st.sampled_from(CHAINS),
        length=st.integers(1, 6),
        extra_tokens=st.integers(1, 40),
        fetch_ok=st.booleans(),
        fails=st.booleans(),
    )
    def request(
        self,
        worker: int,
        chain: list[int],
        length: int,
        extra_tokens: int,
        fetch_ok: bool,
        fails: bool,
    ) -> None:
        worker_id = sorted(self.caches)[worker % len(self.caches)]
        blocks = chain[:length]
        input_tokens = (len(blocks) - 1) * B + extra_tokens
        update = self.manager.on_request(blocks, input_tokens, worker_id)
        assert update.reused_blocks <= update.matched_blocks <= len(blocks)
        if update.fetch is not None:
            assert update.fetch.kind == "fetch" and update.fetch.dest_worker == worker_id
            self._copy(update.fetch, fetch_ok)
        cache = self.caches[worker_id]
        allocation = cache.begin(blocks, (input_tokens - 1) // B)
        report = cache.abort(allocation) if fails else cache.commit(allocation)
        self.manager.apply_report(report)

    @rule(
        worker=st.integers(0, 10),
        chain=st.sampled_from(CHAINS),
        length=st.integers(1, 6),
        times=st.integers(2, 6),
    )
    def repeated_requests(self, worker: int, chain: list[int], length: int, times: int) -> None:
        """A popular prefix: enough reuse for the scan to act on."""
        for _ in range(times):
            n = len(chain[:length]) * B + 1
            self.request(worker, chain, length, 1 + n % 7, fetch_ok=True, fails=False)

    @rule(loads=st.lists(st.floats(0, 10), min_size=8, max_size=8))
    def scan(self, loads: list[float]) -> None:
        by_worker = {w: loads[i % 8] for i, w in enumerate(sorted(self.caches))}
        result = self.manager.scan(self.caches, by_worker)
        for plan in result.copies:
            assert plan.kind in ("inter", "intra")
            assert plan.block_id not in self.caches[plan.dest_worker]
            assert plan.prefix_ids[-1] == plan.block_id
            for move in plan.moves:
                degree, first = self.geometry[plan.dest_worker]
                assert move.dst_device == first + move.depth % degree
        for rplan in result.reclaims:
            assert self.caches[rplan.worker_id].can_reclaim(rplan.block_id)
        self.copies += result.copies
        self.reclaims += result.reclaims

    @rule(index=st.integers(0, 20), ok=st.booleans())
    def finish_a_copy(self, index: int, ok: bool) -> None:
        if self.copies:
            self._copy(self.copies.pop(index % len(self.copies)), ok)

    @rule(index=st.integers(0, 20), ok=st.booleans())
    def finish_a_reclaim(self, index: int, ok: bool) -> None:
        if not self.reclaims:
            return
        plan = self.reclaims.pop(index % len(self.reclaims))
        if plan.plan_id not in self.manager.reclaims_in_flight:
            return
        report = self.caches[plan.worker_id].reclaim(plan.block_id) if ok else None
        if report is not None:
            self.manager.apply_report(report)
            event("reclaim done")
        assert self.manager.finish_reclaim(plan.plan_id, report is not None)

    @rule(worker=st.integers(0, 10))
    def fail_and_restart(self, worker: int) -> None:
        worker_id = sorted(self.caches)[worker % len(self.caches)]
        degree, first = self.geometry[worker_id]
        self.manager.remove_worker(worker_id)
        self._drop(worker_id)
        self._add(degree, first)  # back with an empty cache

    @rule(pair=st.integers(0, 1))
    def merge(self, pair: int) -> None:
        first = 2 * pair
        halves = [w for w, (c, f) in self.geometry.items() if c == 1 and f in (first, first + 1)]
        if len(halves) != 2:
            return
        halves.sort(key=lambda w: self.geometry[w][1])
        merged = self.next_id
        self.next_id += 1
        adopt = self.manager.merge(halves, merged, cp_degree=2, first_device=first)
        for w in halves:
            self._drop(w)
        self.caches[merged] = WorkerCacheIndex(2, BLOCKS_PER_RANK, merged)
        self.geometry[merged] = (2, first)
        assert all(p.kind == "adopt" and p.dest_worker == merged for p in adopt)
        self.copies += adopt

    @rule(which=st.integers(0, 1))
    def split(self, which: int) -> None:
        parents = sorted(w for w, (c, _) in self.geometry.items() if c == 2)
        if not parents:
            return
        parent = parents[which % len(parents)]
        _, first = self.geometry[parent]
        children = [(self.next_id, first), (self.next_id + 1, first + 1)]
        self.next_id += 2
        adopt = self.manager.split(parent, children, 1, capacity_blocks=BLOCKS_PER_RANK)
        self._drop(parent)
        for child, child_first in children:
            self.caches[child] = WorkerCacheIndex(1, BLOCKS_PER_RANK, child)
            self.geometry[child] = (1, child_first)
        self.copies += adopt

    @invariant()
    def trie_agrees_with_the_caches(self) -> None:
        self.manager.check_invariants(self.caches)
        for cache in self.caches.values():
            cache.check_invariants()
        devices = sorted(f + i for c, f in self.geometry.values() for i in range(c))
        assert devices == [0, 1, 2, 3]


TestCacheManagerMachine = CacheManagerMachine.TestCase
TestCacheManagerMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
