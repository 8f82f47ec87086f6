"""The prefix-cache manager, the policy stack's one entry: per-request statistics
(the paper's Algorithm 1, over the ``PrefixTrie``; docs/cache.md).

Per request (``on_request``, after placement on worker w of degree C_w):
    MatchedPath = the request's longest prefix held anywhere (whole blocks, at least
    one token left to compute); ReusedPath = its part held at w;
    access[z, C_w] += 1 on ReusedPath;
    C_p = PreferDegree(i) (``costs.prefer_degree``, with P* = |MatchedPath|);
    for z on MatchedPath with no replica at C_p:
        missed[z, C_p] += E_Cp(L - P_parent(z), P_parent(z)) - E_Cp(L - P(z), P(z)).

The periodic scan (Algorithm 2) is ``scan``'s. Plans are requests; the trie
changes only through ``apply_report`` (see ``plans``).

A request placed where placement counted on more than the worker holds gets a
``pull`` plan; a worker that inherited a *pending* prefix through a split or merge
fetches its missing blocks on the first request that reuses it (a ``fetch`` plan,
or an ordinary miss when no copy is left).

Owned here: the statistics and their meaning, when a request pulls or fetches,
the invariants against the workers' caches. Not owned here: the choice of copies
and reclamations (``scan``), the pull, fetch and by-hand plans (``fetches``), the
plans in flight and their indexes (``inflight``), which prefixes new workers
inherit at a split or merge (``handover``), the trie's structure (``trie``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

from vertumnus.blocks import max_reuse_blocks
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.cache import fetches, handover
from vertumnus.policy.cache.audit import CopyAudit
from vertumnus.policy.cache.copy_cost import EvictionValue
from vertumnus.policy.cache.index import CacheReport
from vertumnus.policy.cache.inflight import PlansInFlight
from vertumnus.policy.cache.nodes import Node, WorkerInfo
from vertumnus.policy.cache.plans import (
    CacheManagerConfig,
    CopyPlan,
    PrefixLookup,
    ReclaimPlan,
    RequestUpdate,
    ScanResult,
    WorkerCacheView,
)
from vertumnus.policy.cache.scan import PeriodicScan, ScanPricing
from vertumnus.policy.cache.trie import PrefixTrie
from vertumnus.policy.costs import CostWeights, prefer_degree, reuse_curves


class PrefixCacheManager:
    def __init__(
        self,
        coeffs: Mapping[int, DegreeCoeffs],
        block_tokens: int,
        config: CacheManagerConfig | None = None,
        weights: CostWeights | None = None,
        ideal: bool = False,
    ) -> None:
        """``weights``: the placement cost's beta and lambda, which PreferDegree uses
        too (the scheduler's own, so both price a request alike). ``ideal``: the
        bound of ideal replication, every worker offered the whole MatchedPath."""
        self.config = config or CacheManagerConfig()
        self.ideal = ideal
        self.weights = weights or CostWeights()
        self.trie = PrefixTrie(sorted(coeffs), block_tokens)
        self.curves = reuse_curves(coeffs)
        self.in_flight = PlansInFlight(self.trie)
        self.eviction = EvictionValue()
        self.audit = CopyAudit()
        # A pull's seconds for a number of blocks, when the stack pulls (None: no pulls).
        self.pull_copy_s: Callable[[int], float] | None = None
        # (holder, now) -> predicted seconds until the holder's devices are free for a
        # copy (the channel's lanes): a pull's source is the first free (None: any).
        self.pull_source_s: Callable[[WorkerInfo, float], float] | None = None
        self._scan = PeriodicScan(self.trie, self.config, self.in_flight)

    # -- workers and reports ---------------------------------------------------------

    def add_worker(self, worker_id: int, cp_degree: int, first_device: int) -> None:
        self.trie.add_worker(worker_id, cp_degree, first_device)

    def remove_worker(self, worker_id: int) -> None:
        """A worker failed or left: its holder records and pending marks go, and so do
        the in-flight plans that involve it (their outcome no longer matters)."""
        self.in_flight.cancel_plans_of(worker_id)
        self.trie.remove_worker(worker_id)
        self.audit.forget_worker(worker_id)

    def apply_report(self, report: CacheReport) -> None:
        """The physical truth of one worker: evictions first, then the inserted chain."""
        trie, eviction = self.trie, self.eviction
        for bid in report.evicted:
            trie.evict(report.worker_id, bid)
            self.audit.evicted(report.worker_id, bid)
            node = trie.nodes.get(bid)
            eviction.evicted_block(bid, node is None or not node.holders)
        if report.inserted:
            trie.insert_chain(report.worker_id, report.inserted_parent, report.inserted)
            for bid in report.inserted:
                eviction.inserted(bid)
            pending = trie.worker_pending[report.worker_id]
            if pending:
                for bid in report.inserted:
                    node = trie.nodes[bid]
                    if node in pending:
                        trie.clear_pending(node, report.worker_id)

    # -- per request -----------------------------------------------------------------

    def usable_blocks(self, num_blocks: int, input_tokens: int) -> int:
        """Whole blocks a request may reuse (``blocks.max_reuse_blocks``)."""
        return min(num_blocks, max_reuse_blocks(input_tokens, self.trie.block_tokens))

    def lookup(self, block_ids: Sequence[int], input_tokens: int) -> PrefixLookup:
        """MatchedPath and P_iw of every worker holding part of it (confirmed replicas
        only; a worker not in ``reusable_tokens`` reuses nothing). Pass it on to
        ``on_request`` to save a second walk."""
        usable = self.usable_blocks(len(block_ids), input_tokens)
        path, depth_of = self.trie.match_with_reuse(block_ids, usable)
        b = self.trie.block_tokens
        if self.ideal and path:
            # The bound: whatever is cached anywhere is reusable everywhere.
            depth_of = dict.fromkeys(self.trie.workers, len(path))
        reuse = {w: n * b for w, n in depth_of.items()}
        return PrefixLookup(tuple(block_ids), input_tokens, usable, path, reuse)

    def reusable_tokens(self, block_ids: Sequence[int], input_tokens: int) -> Mapping[int, int]:
        """P_iw for every worker holding part of the request (see ``lookup``)."""
        return self.lookup(block_ids, input_tokens).reusable_tokens

    def on_request(
        self,
        block_ids: Sequence[int],
        input_tokens: int,
        worker_id: int,
        lookup: PrefixLookup | None = None,
        reused_tokens: int | None = None,
        now: float = 0.0,
    ) -> RequestUpdate:
        """Algorithm 1, for a request just placed on ``worker_id`` (``lookup``: this
        request's, made before placement with nothing applied in between;
        ``reused_tokens``: what placement counted on, more than the worker holds when
        a pull brings the rest; ``now`` chooses its source)."""
        trie, b = self.trie, self.trie.block_tokens
        info = trie.worker(worker_id)
        if lookup is None or lookup.input_tokens != input_tokens:
            usable = self.usable_blocks(len(block_ids), input_tokens)
            path: Sequence[Node] = trie.match(block_ids, usable)
            held = trie.held_depth(path, info.slot)
        else:
            usable, path = lookup.usable, lookup.path
            held = lookup.reusable_tokens.get(worker_id, 0) // b
            if self.ideal:
                held = trie.held_depth(path, info.slot)
        reused = held
        if reused_tokens is not None and not self.ideal:
            reused = min(len(path), max(held, reused_tokens // b))
        k = trie.degree_index[info.cp_degree]
        add_access = trie.add_access
        for node in path[:reused]:
            access = node.access
            if access is None:
                add_access(node, k, 1.0)
            else:
                access[k] += 1.0
        present = [c for c, m in zip(trie.degrees, trie.degree_mask, strict=True) if m]
        preferred = prefer_degree(self.curves, present, input_tokens, len(path) * b, self.weights)
        kp = trie.degree_index[preferred]
        mask = trie.degree_mask[kp]
        # Holders shrink along a path: the nodes without a replica at the preferred
        # degree are a suffix of it.
        first = len(path)
        while first > 0 and not path[first - 1].holders & mask:
            first -= 1
        # Marginal benefit of block z at depth j (B tokens, from jB to (j+1)B reused):
        # B * (per_token + quad * (2jB + B + 1)), from ``ReuseCurve.benefit_s``; with
        # sliding-window layers not linear in j, so the curve's own per block.
        curve = self.curves[preferred]
        base = curve.benefit_s(0, b)
        step = curve.benefit_s(b, 2 * b) - base
        block_s = None if curve.quadratic else partial(curve.block_benefit_s, b)
        self.eviction.missed(block_ids, len(path), usable, base, step, block_s)
        for node in path[first:]:
            benefit = base + step * node.depth if block_s is None else block_s(node.depth)
            if benefit > 0:
                missed = node.missed
                if missed is None:
                    trie.add_missed(node, kp, benefit)
                else:
                    missed[kp] += benefit
        fetch, awaits = None, None
        if reused > held:
            fetch, awaits = fetches.pull(
                trie, self.in_flight, path, held, reused, info, self.pull_source_s, now
            )
        elif trie.worker_pending[worker_id]:
            fetch = fetches.fetch(trie, self.in_flight, block_ids, usable, reused, info)
        return RequestUpdate(len(path), reused, preferred, fetch, awaits)

    # -- the periodic scan (``scan``) -----------------------------------------

    def scan(self, views: Mapping[int, WorkerCacheView], loads: Mapping[int, float]) -> ScanResult:
        """Algorithm 2: candidates, ranked and cut per list, as plans; then decay."""
        pricing = ScanPricing(
            self.eviction_price_s,
            self.curves,
            self.trie.block_tokens,
            self.pull_copy_s,
            self.audit.hit_share(),
        )
        self.eviction.decay(self.config.decay)
        return self._scan.run(views, loads, pricing)

    @property
    def eviction_price_s(self) -> float:
        """What one eviction is priced at, in future prefill seconds (``copy_cost``)."""
        return self.config.eviction_weight * self.eviction.value_s

    def plan_copy(self, block_id: int, source: int, dest: int) -> CopyPlan:
        """A copy asked for by hand (an operator warming a cache, a test): the prefix
        ending at ``block_id``, from a worker that holds it to one that does not."""
        return fetches.by_hand(self.trie, self.in_flight, block_id, source, dest)

    # -- plans in flight (``inflight``) ----------------------------------------

    def finish_copy(self, plan_id: int, ok: bool) -> bool:
        """The copy ended; on success the destination's report has been (or will be)
        applied. A fetch or adopt that failed leaves an ordinary miss: the pending
        marks of its blocks go either way. False if the plan is unknown (cancelled)."""
        self.audit.finished(plan_id)
        return self.in_flight.finish_copy(plan_id, ok)

    def finish_reclaim(self, plan_id: int, ok: bool) -> bool:
        """The deletion ended (its report, if it happened, is applied); False if unknown."""
        return self.in_flight.finish_reclaim(plan_id)

    @property
    def copies_in_flight(self) -> Mapping[int, CopyPlan]:
        return self.in_flight.copies

    @property
    def reclaims_in_flight(self) -> Mapping[int, ReclaimPlan]:
        return self.in_flight.reclaims

    # -- reconfiguration (``handover``) ----------------------------------------

    def merge(
        self, sources: Sequence[int], merged_id: int, cp_degree: int, first_device: int
    ) -> list[CopyPlan]:
        """Sibling workers ``sources`` became one worker: combine their prefixes as
        pending marks of ``merged_id`` and return the adopt plans of those whose
        blocks already sit where the merged geometry wants them."""
        return handover.merge(
            self.trie, self.in_flight, sources, merged_id, cp_degree, first_device
        )

    def split(
        self,
        parent_id: int,
        children: Sequence[tuple[int, int]],
        child_degree: int,
        capacity_blocks: int,
    ) -> list[CopyPlan]:
        """Worker ``parent_id`` became ``children`` (id, first device) of
        ``child_degree``: its retained prefixes go to the children by demand and room
        (``capacity_blocks`` per child). Returns the adopt plans for the blocks
        already in place."""
        return handover.split(
            self.trie, self.in_flight, parent_id, children, child_degree, capacity_blocks
        )

    def reconcile(self, worker_id: int) -> list[CopyPlan]:
        """Fetch plans for every pending prefix of a new worker, right after its switch
        (``fetches.reconcile``)."""
        return fetches.reconcile(self.trie, self.in_flight, worker_id)

    def reconciliation_traffic(
        self, sources: Sequence[int], target_degree: int, target_firsts: Sequence[int]
    ) -> float:
        """Expected KV reconciliation after reshaping ``sources`` into workers of
        ``target_degree`` at ``target_firsts``: the retained blocks out of place,
        weighted by 1 + their recent accesses (``handover``)."""
        return handover.reconciliation_traffic(self.trie, sources, target_degree, target_firsts)

    def reconciliation_share(
        self, sources: Sequence[int], target_degree: int, target_firsts: Sequence[int]
    ) -> float:
        """The share (0 to 1) of the sources' retained prefix weight that a reshape
        leaves out of place: reuse its new workers lack until fetched or recomputed."""
        traffic, whole = handover.reconciliation(self.trie, sources, target_degree, target_firsts)
        return traffic / whole if whole > 0 else 0.0

    # -- invariants ------------------------------------------------------------------

    def check_invariants(self, views: Mapping[int, WorkerCacheView]) -> None:
        """Raise AssertionError unless the trie agrees with the workers' caches (every
        report applied) and the plan bookkeeping agrees with the plans in flight."""
        trie = self.trie
        trie.check()
        assert set(views) == set(trie.workers), "views must cover the registered workers"
        for worker_id, view in views.items():
            held = {node.block_id for node in trie.worker_nodes[worker_id]}
            assert held == view.held_blocks(), f"worker {worker_id}: holders != its cache"
            for node in trie.worker_pending[worker_id]:
                assert node.block_id not in held, "a held block still marked pending"
        self.in_flight.check()
