"""The prefix-cache manager: per-request statistics, the periodic scan, reconfiguration.

DESIGN.md §7 and the paper's Algorithms 1 and 2, over the ``PrefixTrie``.

Per request (``on_request``, after placement on worker w of degree C_w):
    MatchedPath = the request's longest prefix held anywhere (whole blocks, at least
    one token left to compute); ReusedPath = its part held at w;
    access[z, C_w] += 1 on ReusedPath;
    C_p = PreferDegree(i) (``costs.prefer_degree``, with P* = |MatchedPath|);
    for z on MatchedPath with no replica at C_p:
        missed[z, C_p] += E_Cp(L - P_parent(z), P_parent(z)) - E_Cp(L - P(z), P(z)).

Periodic scan (``scan``), r = ReplicaCount(z, C) (+ copies in flight):
    r == 0 and missed > theta_inter       -> inter, by missed per block to copy, desc
    r > 0  and access > r * theta_intra   -> intra, by access / r, desc; when close,
                                             the smaller copy first
    r > min_kept and access < r * theta_reclaim -> reclaim, by access / r, asc
    each list cut to its per-scan limit; then every statistic times ``decay``.
Destinations: degree-C workers without z, by longer held ancestor path, then enough
free room, then lower load. Sources: intra, the least loaded degree-C holder; inter,
the least loaded holder of any degree. Reclaim: a holder where z is an unused leaf,
the one with the least free room (then the most load).

Only workers in the scan's ``views`` (the active ones) take part. Plans are
requests; the trie changes only through ``apply_report`` (see ``cache_plans``).

Reconfiguration: ``merge`` and ``split`` move the old workers' prefixes to the new
workers as *pending* marks that remember which device still has each block. A
pending prefix is not reusable; ``adopt`` plans index the blocks already in place
under the new geometry, and the first request that reuses the rest gets a ``fetch``
plan for its missing blocks (from the retained copy, else any holder), or an
ordinary miss when no copy is left.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.cache_index import CacheReport
from vertumnus.policy.cache_plans import (
    BlockMove,
    CacheManagerConfig,
    CopyPlan,
    PrefixLookup,
    ReclaimPlan,
    RequestUpdate,
    ScanResult,
    WorkerCacheView,
)
from vertumnus.policy.costs import prefer_degree, reuse_curves
from vertumnus.policy.trie import Node, PrefixTrie, TrieError, WorkerInfo, bits


class PrefixCacheManager:
    def __init__(
        self,
        coeffs: Mapping[int, DegreeCoeffs],
        block_tokens: int,
        config: CacheManagerConfig | None = None,
    ) -> None:
        self.config = config or CacheManagerConfig()
        self.trie = PrefixTrie(sorted(coeffs), block_tokens)
        self.curves = reuse_curves(coeffs)
        self._next_plan_id = 0
        self._copies: dict[int, CopyPlan] = {}  # in flight
        self._reclaims: dict[int, ReclaimPlan] = {}
        self._copying: dict[tuple[int, int], int] = {}  # (block, dest worker) -> plans
        self._copying_degree: dict[tuple[int, int], int] = {}  # (block, degree) -> plans
        self._copying_mask: dict[int, int] = {}  # block -> slots of dests copying it
        self._reclaiming: set[tuple[int, int]] = set()  # (block, worker)

    # -- workers and reports ---------------------------------------------------------

    def add_worker(self, worker_id: int, cp_degree: int, first_device: int) -> None:
        self.trie.add_worker(worker_id, cp_degree, first_device)

    def remove_worker(self, worker_id: int) -> None:
        """A worker failed or left: its holder records and pending marks go, and so do
        the in-flight plans that involve it (their outcome no longer matters)."""
        self._cancel_plans_of(worker_id)
        self.trie.remove_worker(worker_id)

    def apply_report(self, report: CacheReport) -> None:
        """The physical truth of one worker: evictions first, then the inserted chain."""
        trie = self.trie
        for bid in report.evicted:
            trie.evict(report.worker_id, bid)
        if report.inserted:
            trie.insert_chain(report.worker_id, report.inserted_parent, report.inserted)
            pending = trie.worker_pending[report.worker_id]
            if pending:
                for bid in report.inserted:
                    node = trie.nodes[bid]
                    if node in pending:
                        trie.clear_pending(node, report.worker_id)

    # -- per request -----------------------------------------------------------------

    def usable_blocks(self, num_blocks: int, input_tokens: int) -> int:
        """Whole blocks a request may reuse: at least one token is always computed."""
        return min(num_blocks, (input_tokens - 1) // self.trie.block_tokens)

    def lookup(self, block_ids: Sequence[int], input_tokens: int) -> PrefixLookup:
        """MatchedPath and P_iw of every worker holding part of it (confirmed replicas
        only; a worker not in ``reusable_tokens`` reuses nothing). Pass it on to
        ``on_request`` to save a second walk."""
        usable = self.usable_blocks(len(block_ids), input_tokens)
        path, depth_of = self.trie.match_with_reuse(block_ids, usable)
        b = self.trie.block_tokens
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
    ) -> RequestUpdate:
        """Algorithm 1, for a request just placed on ``worker_id`` (``lookup``: this
        request's, made before placement with nothing applied in between)."""
        trie, b = self.trie, self.trie.block_tokens
        info = trie.worker(worker_id)
        if lookup is None or lookup.input_tokens != input_tokens:
            usable = self.usable_blocks(len(block_ids), input_tokens)
            path: Sequence[Node] = trie.match(block_ids, usable)
            reused = trie.held_depth(path, info.slot)
        else:
            usable, path = lookup.usable, lookup.path
            reused = lookup.reusable_tokens.get(worker_id, 0) // b
        k = trie.degree_index[info.cp_degree]
        add_access = trie.add_access
        for node in path[:reused]:
            access = node.access
            if access is None:
                add_access(node, k, 1.0)
            else:
                access[k] += 1.0
        present = [c for c, m in zip(trie.degrees, trie.degree_mask, strict=True) if m]
        preferred = prefer_degree(
            self.curves, present, input_tokens, len(path) * b, self.config.weights
        )
        kp = trie.degree_index[preferred]
        mask = trie.degree_mask[kp]
        # Holders shrink along a path: the nodes without a replica at the preferred
        # degree are a suffix of it.
        first = len(path)
        while first > 0 and not path[first - 1].holders & mask:
            first -= 1
        # Marginal benefit of block z at depth j (B tokens, from jB to (j+1)B reused):
        # B * (per_token + quad * (2jB + B + 1)), from ``ReuseCurve.benefit_s``.
        curve = self.curves[preferred]
        base = curve.benefit_s(0, b)
        step = curve.benefit_s(b, 2 * b) - base
        for node in path[first:]:
            benefit = base + step * node.depth
            if benefit > 0:
                missed = node.missed
                if missed is None:
                    trie.add_missed(node, kp, benefit)
                else:
                    missed[kp] += benefit
        fetch = None
        if trie.worker_pending[worker_id]:
            fetch = self._fetch_plan(block_ids, usable, reused, info)
        return RequestUpdate(len(path), reused, preferred, fetch)

    def _fetch_plan(
        self, block_ids: Sequence[int], usable: int, held: int, dest: WorkerInfo
    ) -> CopyPlan | None:
        """Missing blocks of a pending prefix at ``dest`` that this request would reuse:
        from the retained copy, else any holder; a block with no copy ends the fetch
        (the rest is an ordinary miss, and its pending marks go)."""
        trie, moves = self.trie, []
        parent = trie.nodes.get(block_ids[held - 1]) if held else None
        for depth in range(held, usable):
            node = trie.nodes.get(block_ids[depth])
            if node is None or node.parent is not parent or not node.pending:
                break
            if dest.slot not in node.pending or (node.block_id, dest.worker_id) in self._copying:
                break
            retained = node.pending[dest.slot]
            if retained is not None:
                src_worker, src_device = None, retained
            elif node.holders:
                src = min(
                    trie.holders_of(node), key=lambda h: (h.cp_degree != dest.cp_degree, h.slot)
                )
                src_worker, src_device = src.worker_id, src.device_of(depth)
            else:
                self._drop_pending_below(node, dest, block_ids[depth:usable])
                break
            moves.append(
                BlockMove(node.block_id, depth, src_worker, src_device, dest.device_of(depth))
            )
            parent = node
        if not moves:
            return None
        return self._start_copy("fetch", dest, moves, score=0.0)

    def _drop_pending_below(self, node: Node, dest: WorkerInfo, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            below = self.trie.nodes.get(bid)
            if below is None or below.pending is None or dest.slot not in below.pending:
                break
            self.trie.clear_pending(below, dest.worker_id)

    # -- the periodic scan -----------------------------------------------------------

    def scan(self, views: Mapping[int, WorkerCacheView], loads: Mapping[int, float]) -> ScanResult:
        """Algorithm 2: candidates, ranked and cut per list, as plans; then decay."""
        trie, cfg = self.trie, self.config
        active = 0
        for worker_id in views:
            active |= 1 << trie.worker(worker_id).slot
        masks = [m & active for m in trie.degree_mask]
        per_degree = [(k, m, trie.degrees[k]) for k, m in enumerate(masks) if m]
        theta_inter, theta_intra = cfg.theta_inter_s, cfg.theta_intra
        theta_reclaim, keep = cfg.theta_reclaim, cfg.min_replicas_kept
        flying_copies = self._copying_degree
        inter: list[tuple[Node, int]] = []
        intra: list[tuple[Node, int]] = []
        # (access / r, -depth, block id, degree index, node): ranks as it sorts.
        reclaim: list[tuple[float, int, int, int, Node]] = []
        for node in trie.touched:
            holders, access, missed = node.holders, node.access, node.missed
            for k, mask, c in per_degree:
                r = (holders & mask).bit_count()
                flying = flying_copies.get((node.block_id, c), 0) if flying_copies else 0
                if r == 0:
                    if missed is not None and missed[k] > theta_inter and not flying:
                        inter.append((node, k))
                    continue
                used = access[k] if access is not None else 0.0
                if used > (r + flying) * theta_intra:
                    intra.append((node, k))
                elif r > keep and used < r * theta_reclaim:
                    reclaim.append((used / r, -node.depth, node.block_id, k, node))
        if theta_reclaim > 0:
            # Replicated nodes without statistics: cold replicas, access 0.
            for node in trie.replicated:
                if node.access is None and node.missed is None:
                    holders = node.holders
                    for k, mask, _ in per_degree:
                        if (holders & mask).bit_count() > keep:
                            reclaim.append((0.0, -node.depth, node.block_id, k, node))
        copies = self._select_copies("inter", inter, views, loads, masks, cfg.max_inter_per_scan)
        copies += self._select_copies("intra", intra, views, loads, masks, cfg.max_intra_per_scan)
        reclaims = self._select_reclaims(reclaim, views, loads, masks)
        trie.decay(cfg.decay, cfg.stat_floor)
        return ScanResult(
            copies=tuple(copies),
            reclaims=tuple(reclaims),
            candidates={"inter": len(inter), "intra": len(intra), "reclaim": len(reclaim)},
        )

    def _destination(
        self,
        node: Node,
        mask: int,
        views: Mapping[int, WorkerCacheView],
        loads: Mapping[int, float],
    ) -> tuple[WorkerInfo, int] | None:
        """Best worker in ``mask`` without ``node``, and how deep it holds its path."""
        trie = self.trie
        wanting = mask & ~node.holders
        held: dict[int, int] = {}
        ancestor = node.parent
        remaining = wanting
        while remaining and ancestor is not None:
            # A block on its way to a destination counts as held there: the copy of a
            # descendant then brings only what is not already coming.
            found = (ancestor.holders | self._copying_mask.get(ancestor.block_id, 0)) & remaining
            for slot in bits(found):
                held[slot] = ancestor.depth + 1
            remaining &= ~found
            ancestor = ancestor.parent
        best: tuple[tuple[int, bool, float, int], WorkerInfo, int] | None = None
        for slot in bits(wanting):
            info = trie.by_slot[slot]
            if (node.block_id, info.worker_id) in self._copying:
                continue
            depth = held.get(slot, 0)
            room = views[info.worker_id].num_free_blocks() >= node.depth + 1 - depth
            key = (-depth, not room, loads.get(info.worker_id, 0.0), info.worker_id)
            if best is None or key < best[0]:
                best = (key, info, depth)
        return None if best is None else (best[1], best[2])

    def _select_copies(
        self,
        kind: str,
        candidates: list[tuple[Node, int]],
        views: Mapping[int, WorkerCacheView],
        loads: Mapping[int, float],
        masks: list[int],
        limit: int,
    ) -> list[CopyPlan]:
        trie, cfg = self.trie, self.config
        # Intra copies: within ``close_fraction`` the smaller copy goes first, so a hot
        # chain grows at a new holder from its root, a few blocks per scan. (Copying a
        # hot chain whole, deepest candidate first, was tried: with tight caches it
        # evicted more than it saved, +12 % mean TTFT at 30 req/s in
        # configs/sim/cache-ablation.toml, and saturated at 31 req/s.)
        ranked = []
        for node, k in candidates:
            found = self._destination(node, masks[k], views, loads)
            if found is None:
                continue
            dest, held = found
            blocks = node.depth + 1 - held
            if kind == "inter":
                # missed per copied block, over the blocks this copy brings (a copy of
                # z brings its missing ancestors too); deeper first on ties.
                score = _path_sum(node, held, k) / blocks
                key: tuple[float, ...] = (-score, -node.depth, node.block_id)
            else:
                r = trie.replica_count(node, trie.degrees[k])
                assert node.access is not None
                score = node.access[k] / r
                bucket = math.floor(math.log(score) / math.log1p(cfg.close_fraction))
                key = (-bucket, blocks, -score, node.block_id)
            ranked.append((key, node, k, score))
        ranked.sort(key=lambda item: item[0])
        plans: list[CopyPlan] = []
        for _, node, k, score in ranked:
            if len(plans) >= limit:
                break
            c = trie.degrees[k]
            if kind == "inter" and self._copying_degree.get((node.block_id, c), 0):
                continue  # covered by a deeper copy planned in this scan
            found = self._destination(node, masks[k], views, loads)
            if found is None:
                continue
            dest, held = found
            sources = [
                h
                for h in trie.holders_of(node)
                if h.worker_id in views
                and (kind == "inter" or h.cp_degree == c)
                and (node.block_id, h.worker_id) not in self._reclaiming
            ]
            if not sources:
                continue
            src = min(sources, key=lambda h: (loads.get(h.worker_id, 0.0), h.worker_id))
            moves = [
                BlockMove(
                    z.block_id,
                    z.depth,
                    src.worker_id,
                    src.device_of(z.depth),
                    dest.device_of(z.depth),
                )
                for z in node.path()[held:]
            ]
            plans.append(self._start_copy(kind, dest, moves, score))
        return plans

    def _select_reclaims(
        self,
        candidates: list[tuple[float, int, int, int, Node]],
        views: Mapping[int, WorkerCacheView],
        loads: Mapping[int, float],
        masks: list[int],
    ) -> list[ReclaimPlan]:
        """The lowest access per replica first (the deepest first on ties: leaves are
        the ones a worker can give up). Only the first ``limit * reclaim_probe`` are
        examined, so a scan's work stays bounded when many replicas are cold."""
        trie, cfg = self.trie, self.config
        plans: list[ReclaimPlan] = []
        probe = cfg.max_reclaim_per_scan * cfg.reclaim_probe
        for score, _, _, k, node in heapq.nsmallest(probe, candidates):
            if len(plans) >= cfg.max_reclaim_per_scan:
                break
            c = trie.degrees[k]
            holders = [trie.by_slot[slot] for slot in bits(node.holders & masks[k])]
            free = [h for h in holders if (node.block_id, h.worker_id) not in self._reclaiming]
            if trie.replica_count(node, c) - (len(holders) - len(free)) <= cfg.min_replicas_kept:
                continue
            choices = [h for h in free if views[h.worker_id].can_reclaim(node.block_id)]
            if not choices:
                continue
            victim = min(
                choices,
                key=lambda h: (
                    views[h.worker_id].num_free_blocks(),
                    -loads.get(h.worker_id, 0.0),
                    h.worker_id,
                ),
            )
            plan = ReclaimPlan(self._new_plan_id(), victim.worker_id, node.block_id, c, score)
            self._reclaims[plan.plan_id] = plan
            self._reclaiming.add((node.block_id, victim.worker_id))
            plans.append(plan)
        return plans

    def plan_copy(self, block_id: int, source: int, dest: int) -> CopyPlan:
        """A copy asked for by hand (an operator warming a cache, a test): the prefix
        ending at ``block_id``, from a worker that holds it to one that does not."""
        trie = self.trie
        node = trie.nodes.get(block_id)
        src, dst = trie.worker(source), trie.worker(dest)
        if node is None or not node.holders >> src.slot & 1:
            raise TrieError(f"worker {source} does not hold block {block_id:#x}")
        if node.holders >> dst.slot & 1:
            raise TrieError(f"worker {dest} already holds block {block_id:#x}")
        path = node.path()
        held = trie.held_depth(path, dst.slot)
        moves = [
            BlockMove(z.block_id, z.depth, source, src.device_of(z.depth), dst.device_of(z.depth))
            for z in path[held:]
        ]
        kind = "intra" if src.cp_degree == dst.cp_degree else "inter"
        return self._start_copy(kind, dst, moves, score=0.0)

    # -- plan bookkeeping ------------------------------------------------------------

    def _new_plan_id(self) -> int:
        self._next_plan_id += 1
        return self._next_plan_id

    def _start_copy(
        self, kind: str, dest: WorkerInfo, moves: list[BlockMove], score: float
    ) -> CopyPlan:
        reshard = any(
            m.src_worker is not None and self.trie.worker(m.src_worker).cp_degree != dest.cp_degree
            for m in moves
        )
        last = self.trie.nodes[moves[-1].block_id]
        plan = CopyPlan(
            plan_id=self._new_plan_id(),
            kind=kind,
            block_id=last.block_id,
            dest_worker=dest.worker_id,
            cp_degree=dest.cp_degree,
            prefix_ids=tuple(z.block_id for z in last.path()),
            moves=tuple(moves),
            reshard=reshard,
            score=score,
        )
        self._copies[plan.plan_id] = plan
        for m in moves:
            key = (m.block_id, dest.worker_id)
            self._copying[key] = self._copying.get(key, 0) + 1
            self._copying_mask[m.block_id] = self._copying_mask.get(m.block_id, 0) | 1 << dest.slot
            dkey = (m.block_id, dest.cp_degree)
            self._copying_degree[dkey] = self._copying_degree.get(dkey, 0) + 1
        return plan

    def finish_copy(self, plan_id: int, ok: bool) -> bool:
        """The copy ended; on success the destination's report has been (or will be)
        applied. A fetch or adopt that failed leaves an ordinary miss: the pending
        marks of its blocks go either way. False if the plan is unknown (cancelled)."""
        plan = self._end_copy(plan_id)
        if plan is None:
            return False
        if plan.kind in ("fetch", "adopt") and not ok:
            for m in reversed(plan.moves):
                node = self.trie.nodes.get(m.block_id)
                if node is not None:
                    self.trie.clear_pending(node, plan.dest_worker)
        return True

    def _end_copy(self, plan_id: int) -> CopyPlan | None:
        """Take a copy plan out of flight: release its bookkeeping."""
        plan = self._copies.pop(plan_id, None)
        if plan is None:
            return None
        dest = self.trie.worker(plan.dest_worker)  # plans of a leaving worker end first
        for m in plan.moves:
            if not self._release(self._copying, (m.block_id, plan.dest_worker)):
                mask = self._copying_mask[m.block_id] & ~(1 << dest.slot)
                if mask:
                    self._copying_mask[m.block_id] = mask
                else:
                    del self._copying_mask[m.block_id]
            self._release(self._copying_degree, (m.block_id, plan.cp_degree))
        return plan

    def finish_reclaim(self, plan_id: int, ok: bool) -> bool:
        """The deletion ended (its report, if it happened, is applied); False if unknown."""
        plan = self._reclaims.pop(plan_id, None)
        if plan is None:
            return False
        self._reclaiming.discard((plan.block_id, plan.worker_id))
        return True

    @staticmethod
    def _release(counts: dict[tuple[int, int], int], key: tuple[int, int]) -> int:
        """Count one plan off ``key``; returns how many are left."""
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
        return left

    def _cancel_plans_of(self, worker_id: int) -> None:
        """Forget the plans in flight that involve ``worker_id`` (it is leaving). Their
        pending marks stay: a reconfiguration hands them on, a removal drops them."""
        for plan in list(self._copies.values()):
            if plan.dest_worker == worker_id or any(m.src_worker == worker_id for m in plan.moves):
                self._end_copy(plan.plan_id)
        for rplan in list(self._reclaims.values()):
            if rplan.worker_id == worker_id:
                self.finish_reclaim(rplan.plan_id, ok=False)

    @property
    def copies_in_flight(self) -> Mapping[int, CopyPlan]:
        return self._copies

    @property
    def reclaims_in_flight(self) -> Mapping[int, ReclaimPlan]:
        return self._reclaims

    # -- reconfiguration -------------------------------------------------------------

    def merge(
        self, sources: Sequence[int], merged_id: int, cp_degree: int, first_device: int
    ) -> list[CopyPlan]:
        """Sibling workers ``sources`` became one worker: combine their prefixes as
        pending marks of ``merged_id`` and return the adopt plans of those whose
        blocks already sit where the merged geometry wants them."""
        trie = self.trie
        found = [self._retained(trie.worker(s)) for s in sources]
        for s in sources:
            self._cancel_plans_of(s)
        merged = trie.add_worker(merged_id, cp_degree, first_device)
        retained: dict[Node, int | None] = {}
        for pairs in found:
            for node, device in pairs:
                if retained.get(node) is None or device == merged.device_of(node.depth):
                    retained[node] = device
        for node, device in retained.items():
            trie.set_pending(node, merged_id, device)
        for s in sources:
            trie.remove_worker(s)
        return self._adopt_plans(merged)

    def split(
        self,
        parent_id: int,
        children: Sequence[tuple[int, int]],
        child_degree: int,
        capacity_blocks: int,
    ) -> list[CopyPlan]:
        """Worker ``parent_id`` became ``children`` (id, first device) of
        ``child_degree``: each retained prefix (a leaf chain of the parent's cache) goes
        to one child, by demand (most accessed first, to the child with the least
        demand so far) and room (``capacity_blocks`` per child). Returns the adopt
        plans for the blocks already in place."""
        trie = self.trie
        retained = dict(self._retained(trie.worker(parent_id)))
        self._cancel_plans_of(parent_id)
        has_child = {node.parent for node in retained if node.parent is not None}
        leaves = [node for node in retained if node not in has_child]

        def demand(node: Node) -> float:
            return sum(node.access) if node.access is not None else 0.0

        leaves.sort(key=lambda n: (-demand(n), -n.depth, n.block_id))
        infos = [trie.add_worker(cid, child_degree, first) for cid, first in children]
        assigned: list[set[Node]] = [set() for _ in infos]
        load = [0.0] * len(infos)
        for leaf in leaves:
            # The prefix as this worker retains it (an ancestor it evicted is not).
            path = [z for z in leaf.path() if z in retained]
            best = None
            for i in range(len(infos)):
                new_blocks = sum(1 for z in path if z not in assigned[i])
                if len(assigned[i]) + new_blocks > capacity_blocks:
                    continue
                key = (load[i], new_blocks, i)
                if best is None or key < best[0]:
                    best = (key, i)
            if best is None:
                continue  # fits nowhere: not retained
            i = best[1]
            assigned[i].update(path)
            load[i] += demand(leaf)
        for info, nodes in zip(infos, assigned, strict=True):
            for node in nodes:
                trie.set_pending(node, info.worker_id, retained[node])
        trie.remove_worker(parent_id)
        plans: list[CopyPlan] = []
        for info in infos:
            plans += self._adopt_plans(info)
        return plans

    def reconciliation_traffic(
        self, sources: Sequence[int], target_degree: int, target_firsts: Sequence[int]
    ) -> float:
        """Expected KV reconciliation after reshaping ``sources`` into workers of
        ``target_degree`` at ``target_firsts``: the blocks they retain that are not
        where the new geometry wants them, each weighted by 1 + its recent accesses.
        A merge has one target; a split gives each prefix to one child, so a block
        counts by the share of children for which it is out of place."""
        devices: dict[Node, set[int]] = {}
        for s in sources:
            for node, device in self._retained(self.trie.worker(s)):
                if device is not None:
                    devices.setdefault(node, set()).add(device)
        total = 0.0
        for node, held_on in devices.items():
            wrong = sum(
                first + node.depth % target_degree not in held_on for first in target_firsts
            )
            if wrong:
                weight = 1.0 + (sum(node.access) if node.access is not None else 0.0)
                total += weight * wrong / len(target_firsts)
        return total

    def _retained(self, info: WorkerInfo) -> list[tuple[Node, int | None]]:
        """The worker's prefixes with the device that has each block: its held blocks,
        and the pending ones with their retained device."""
        out: list[tuple[Node, int | None]] = [
            (node, info.device_of(node.depth)) for node in self.trie.worker_nodes[info.worker_id]
        ]
        for node in self.trie.worker_pending[info.worker_id]:
            assert node.pending is not None
            out.append((node, node.pending[info.slot]))
        return out

    def _adopt_plans(self, info: WorkerInfo) -> list[CopyPlan]:
        """One plan per maximal chain of pending blocks that are already in place."""
        pending = self.trie.worker_pending[info.worker_id]
        in_place: set[Node] = set()
        for node in sorted(pending, key=lambda n: n.depth):
            assert node.pending is not None
            device = node.pending[info.slot]
            parent_ok = node.parent is None or node.parent in in_place
            if parent_ok and device == info.device_of(node.depth):
                in_place.add(node)
        inner = {node.parent for node in in_place if node.parent is not None}
        plans = []
        for leaf in sorted(in_place - inner, key=lambda n: n.block_id):
            moves = [
                BlockMove(
                    z.block_id, z.depth, None, info.device_of(z.depth), info.device_of(z.depth)
                )
                for z in leaf.path()
            ]
            plans.append(self._start_copy("adopt", info, moves, score=0.0))
        return plans

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
        copying: dict[tuple[int, int], int] = {}
        copying_degree: dict[tuple[int, int], int] = {}
        copying_mask: dict[int, int] = {}
        for plan in self._copies.values():
            dest = trie.worker(plan.dest_worker)
            assert dest.cp_degree == plan.cp_degree
            for m in plan.moves:
                key = (m.block_id, plan.dest_worker)
                copying[key] = copying.get(key, 0) + 1
                dkey = (m.block_id, plan.cp_degree)
                copying_degree[dkey] = copying_degree.get(dkey, 0) + 1
                copying_mask[m.block_id] = copying_mask.get(m.block_id, 0) | 1 << dest.slot
        assert copying == self._copying and copying_degree == self._copying_degree
        assert copying_mask == self._copying_mask
        assert self._reclaiming == {(p.block_id, p.worker_id) for p in self._reclaims.values()}
        for rplan in self._reclaims.values():
            assert rplan.worker_id in trie.workers


def _path_sum(node: Node, held: int, k: int) -> float:
    """Sum of missed[., k] over the nodes of ``node``'s path at depth >= ``held``."""
    total = 0.0
    z: Node | None = node
    while z is not None and z.depth >= held:
        if z.missed is not None:
            total += z.missed[k]
        z = z.parent
    return total
