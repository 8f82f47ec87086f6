"""The prefix-cache manager's plans in flight, and the indexes over them.

A plan is in flight from the moment the manager hands it out until the driver
reports its outcome (``finish_copy`` / ``finish_reclaim``) or a worker it involves
leaves (``cancel_plans_of``). While in flight it is counted in:

    copying[(block, dest worker)]   copy plans that bring block to dest
    copying_degree[(block, C)]      copy plans that bring block to a degree-C worker
    copying_mask[block]             slots of the destinations of those plans
    reclaiming                      (block, worker) pairs with a deletion planned

The scan reads them: a block on its way to a worker counts as held there when
choosing destinations, a copy in flight counts as a replica, a block being
reclaimed is no copy source. Invariant (``check``): each index equals the one
rebuilt from the plans in flight.

Owned here: plan ids, creating a copy plan from its moves, retiring plans. Not
owned here: which plans to make (``manager``, ``handover``); the trie,
which only a worker's report changes, except that a failed fetch or adopt drops
the pending marks of its blocks.
"""

from __future__ import annotations

from vertumnus.policy.cache.nodes import WorkerInfo
from vertumnus.policy.cache.plans import BlockMove, CopyPlan, ReclaimPlan
from vertumnus.policy.cache.trie import PrefixTrie


class PlansInFlight:
    """Copy and reclaim plans handed out and not yet finished. Only this class's
    methods change its dicts and sets; others read them."""

    def __init__(self, trie: PrefixTrie) -> None:
        self.trie = trie
        self._next_plan_id = 0
        self.copies: dict[int, CopyPlan] = {}
        self.reclaims: dict[int, ReclaimPlan] = {}
        self.copying: dict[tuple[int, int], int] = {}  # (block, dest worker) -> plans
        self.copying_degree: dict[tuple[int, int], int] = {}  # (block, degree) -> plans
        self.copying_mask: dict[int, int] = {}  # block -> slots of dests copying it
        self.reclaiming: set[tuple[int, int]] = set()  # (block, worker)

    def new_plan_id(self) -> int:
        self._next_plan_id += 1
        return self._next_plan_id

    def start_copy(
        self,
        kind: str,
        dest: WorkerInfo,
        moves: list[BlockMove],
        score: float,
        benefit_s: float = 0.0,
    ) -> CopyPlan:
        """A copy plan of the prefix ending at the last move's block, now in flight."""
        reshard = any(
            m.src_worker is not None and self.trie.worker(m.src_worker).cp_degree != dest.cp_degree
            for m in moves
        )
        last = self.trie.nodes[moves[-1].block_id]
        plan = CopyPlan(
            plan_id=self.new_plan_id(),
            kind=kind,
            block_id=last.block_id,
            dest_worker=dest.worker_id,
            cp_degree=dest.cp_degree,
            prefix_ids=tuple(z.block_id for z in last.path()),
            moves=tuple(moves),
            reshard=reshard,
            score=score,
            benefit_s=benefit_s,
        )
        self.copies[plan.plan_id] = plan
        for m in moves:
            key = (m.block_id, dest.worker_id)
            self.copying[key] = self.copying.get(key, 0) + 1
            self.copying_mask[m.block_id] = self.copying_mask.get(m.block_id, 0) | 1 << dest.slot
            dkey = (m.block_id, dest.cp_degree)
            self.copying_degree[dkey] = self.copying_degree.get(dkey, 0) + 1
        return plan

    def start_reclaim(
        self, worker_id: int, block_id: int, cp_degree: int, score: float, loss_s: float = 0.0
    ) -> ReclaimPlan:
        """A reclaim plan (``worker_id`` deletes ``block_id``), now in flight."""
        plan = ReclaimPlan(self.new_plan_id(), worker_id, block_id, cp_degree, score, loss_s)
        self.reclaims[plan.plan_id] = plan
        self.reclaiming.add((block_id, worker_id))
        return plan

    def finish_copy(self, plan_id: int, ok: bool) -> bool:
        """See ``PrefixCacheManager.finish_copy``."""
        plan = self.end_copy(plan_id)
        if plan is None:
            return False
        if plan.kind in ("fetch", "adopt") and not ok:
            for m in reversed(plan.moves):
                node = self.trie.nodes.get(m.block_id)
                if node is not None:
                    self.trie.clear_pending(node, plan.dest_worker)
        return True

    def end_copy(self, plan_id: int) -> CopyPlan | None:
        """Take a copy plan out of flight: release its bookkeeping."""
        plan = self.copies.pop(plan_id, None)
        if plan is None:
            return None
        dest = self.trie.worker(plan.dest_worker)  # plans of a leaving worker end first
        for m in plan.moves:
            if not _release(self.copying, (m.block_id, plan.dest_worker)):
                mask = self.copying_mask[m.block_id] & ~(1 << dest.slot)
                if mask:
                    self.copying_mask[m.block_id] = mask
                else:
                    del self.copying_mask[m.block_id]
            _release(self.copying_degree, (m.block_id, plan.cp_degree))
        return plan

    def finish_reclaim(self, plan_id: int) -> bool:
        """Take a reclaim plan out of flight; False if unknown."""
        plan = self.reclaims.pop(plan_id, None)
        if plan is None:
            return False
        self.reclaiming.discard((plan.block_id, plan.worker_id))
        return True

    def cancel_plans_of(self, worker_id: int) -> None:
        """Forget the plans in flight that involve ``worker_id`` (it is leaving). Their
        pending marks stay: a reconfiguration hands them on, a removal drops them."""
        for plan in list(self.copies.values()):
            if plan.dest_worker == worker_id or any(m.src_worker == worker_id for m in plan.moves):
                self.end_copy(plan.plan_id)
        for rplan in list(self.reclaims.values()):
            if rplan.worker_id == worker_id:
                self.finish_reclaim(rplan.plan_id)

    def check(self) -> None:
        """Raise AssertionError unless the indexes agree with the plans in flight and
        every plan's worker is registered (at the degree the plan says)."""
        trie = self.trie
        copying: dict[tuple[int, int], int] = {}
        copying_degree: dict[tuple[int, int], int] = {}
        copying_mask: dict[int, int] = {}
        for plan in self.copies.values():
            dest = trie.worker(plan.dest_worker)
            assert dest.cp_degree == plan.cp_degree
            for m in plan.moves:
                key = (m.block_id, plan.dest_worker)
                copying[key] = copying.get(key, 0) + 1
                dkey = (m.block_id, plan.cp_degree)
                copying_degree[dkey] = copying_degree.get(dkey, 0) + 1
                copying_mask[m.block_id] = copying_mask.get(m.block_id, 0) | 1 << dest.slot
        assert copying == self.copying and copying_degree == self.copying_degree
        assert copying_mask == self.copying_mask
        assert self.reclaiming == {(p.block_id, p.worker_id) for p in self.reclaims.values()}
        for rplan in self.reclaims.values():
            assert rplan.worker_id in trie.workers


def _release(counts: dict[tuple[int, int], int], key: tuple[int, int]) -> int:
    """Count one plan off ``key``; returns how many are left."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
    return left
