"""The prefix-cache manager's periodic scan (the paper's Algorithm 2, docs/cache.md).

Over the statistics that ``PrefixCacheManager.on_request`` gathers, with
r = ReplicaCount(z, C) (+ copies in flight):
    r == 0 and missed > theta_inter       -> inter, by missed per block to copy, desc
    r > 0  and access > r * theta_intra   -> intra, by access / r, desc; when close,
                                             the smaller copy first
    r > min_kept and access < r * theta_reclaim -> reclaim, by access / r, asc
    each list cut to its per-scan limit; then every statistic times ``decay``.
Destinations: degree-C workers without z, by longer held ancestor path, then enough
free room, then lower load. Sources: intra, the least loaded degree-C holder; inter,
the least loaded holder of any degree. Reclaim: a holder where z is an unused leaf,
the one with the least free room (then the most load).

Every plan must pay for itself (``ScanPricing``), by the model's own estimate per
statistics window (unless ``priced`` is off: the paper's algorithm as written):

    copy     benefit = uses * saving  >  evictions at the destination * value_s
                                         + its time on the channel (pulls on)
             uses: inter, missed seconds over what one request saves from the
             blocks; intra, access / (r + 1); with pulls on, only the destination's
             share (requests go where the load is least and pull what they lack)
             saving: the blocks' compute; with pulls on, only the part of a pull's
             wait that the destination's queue would not hide; and uses times the
             share of that kind's copied blocks the audit saw reused before their
             eviction (``CopyAudit.hit_share``: the estimate corrected by its record)
    reclaim  value_s (a slot of a full cache; nothing when it has room)  >
             access / r * saving of its one block at the victim

with ``value_s`` the price of an eviction (``copy_cost.EvictionValue``). A
candidate that does not pay is counted in ``unpaid``.

Only workers in the scan's ``views`` (the active ones) take part. Owned here: the
candidates, their ranking and the plans chosen. Not owned here: the statistics'
updates per request (``manager``), the plans once handed out
(``inflight``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from vertumnus.policy.cache.inflight import PlansInFlight
from vertumnus.policy.cache.nodes import Node, WorkerInfo, bits
from vertumnus.policy.cache.plans import (
    BlockMove,
    CacheManagerConfig,
    CopyPlan,
    ReclaimPlan,
    ScanResult,
    WorkerCacheView,
)
from vertumnus.policy.cache.trie import PrefixTrie
from vertumnus.policy.costs import ReuseCurve


@dataclass(frozen=True)
class ScanPricing:
    """What the scan's plans are priced with (the module docstring)."""

    value_s: float  # future prefill seconds one eviction costs
    curves: Mapping[int, ReuseCurve]
    block_tokens: int
    copy_s: Callable[[int], float] | None = None  # a pull's seconds per blocks; None: no pulls
    # Per kind of copy, the share of copied blocks the audit saw reused before their
    # eviction (``CopyAudit.hit_share``): the model's uses, calibrated by its record.
    hit_share: Mapping[str, float] = field(default_factory=dict)

    def saving_s(self, cp_degree: int, held: int, upto: int, queue_s: float) -> float:
        """What one request that reuses blocks ``held`` to ``upto`` at a degree-C
        worker with ``queue_s`` of work ahead of it saves by finding them there: their
        compute, or with pulls on, the part of a pull's wait its queue does not hide."""
        b = self.block_tokens
        compute = self.curves[cp_degree].benefit_s(held * b, upto * b)
        if self.copy_s is None:
            return compute
        return min(compute, max(0.0, self.copy_s(upto - held) - queue_s))


class PeriodicScan:
    """The manager's scan, over its trie, settings and plans in flight."""

    def __init__(
        self, trie: PrefixTrie, config: CacheManagerConfig, in_flight: PlansInFlight
    ) -> None:
        self.trie = trie
        self.config = config
        self.in_flight = in_flight

    def run(
        self,
        views: Mapping[int, WorkerCacheView],
        loads: Mapping[int, float],
        pricing: ScanPricing,
    ) -> ScanResult:
        """Algorithm 2: candidates, ranked and cut per list, as plans that pay for
        themselves; then decay."""
        trie, cfg = self.trie, self.config
        self.pricing = pricing
        self.unpaid = {"inter": 0, "intra": 0, "reclaim": 0}
        active = 0
        for worker_id in views:
            active |= 1 << trie.worker(worker_id).slot
        masks = [m & active for m in trie.degree_mask]
        per_degree = [(k, m, trie.degrees[k]) for k, m in enumerate(masks) if m]
        theta_inter, theta_intra = cfg.theta_inter_s, cfg.theta_intra
        theta_reclaim, keep = cfg.theta_reclaim, cfg.min_replicas_kept
        flying_copies = self.in_flight.copying_degree
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
            unpaid=dict(self.unpaid),
        )

    def _destination(
        self,
        node: Node,
        mask: int,
        views: Mapping[int, WorkerCacheView],
        loads: Mapping[int, float],
    ) -> tuple[WorkerInfo, int] | None:
        """Best worker in ``mask`` without ``node``, and how deep it holds its path."""
        trie, in_flight = self.trie, self.in_flight
        wanting = mask & ~node.holders
        held: dict[int, int] = {}
        ancestor = node.parent
        remaining = wanting
        while remaining and ancestor is not None:
            # A block on its way to a destination counts as held there: the copy of a
            # descendant then brings only what is not already coming.
            found = (
                ancestor.holders | in_flight.copying_mask.get(ancestor.block_id, 0)
            ) & remaining
            for slot in bits(found):
                held[slot] = ancestor.depth + 1
            remaining &= ~found
            ancestor = ancestor.parent
        best: tuple[tuple[int, bool, float, int], WorkerInfo, int] | None = None
        for slot in bits(wanting):
            info = trie.by_slot[slot]
            if (node.block_id, info.worker_id) in in_flight.copying:
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
        trie, cfg, in_flight = self.trie, self.config, self.in_flight
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
            if kind == "inter" and in_flight.copying_degree.get((node.block_id, c), 0):
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
                and (node.block_id, h.worker_id) not in in_flight.reclaiming
            ]
            if not sources:
                continue
            queue_s = loads.get(dest.worker_id, 0.0)
            benefit_s = self._benefit_s(kind, node, k, held, masks[k].bit_count(), queue_s)
            evicts = max(0, node.depth + 1 - held - views[dest.worker_id].num_free_blocks())
            channel_s = self.pricing.copy_s(node.depth + 1 - held) if self.pricing.copy_s else 0.0
            if self.config.priced and benefit_s <= evicts * self.pricing.value_s + channel_s:
                self.unpaid[kind] += 1
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
            plans.append(in_flight.start_copy(kind, dest, moves, score, benefit_s))
        return plans

    def _benefit_s(
        self, kind: str, node: Node, k: int, held: int, workers: int, queue_s: float
    ) -> float:
        """A copy's predicted benefit per statistics window (the module docstring);
        ``workers``: the active workers of the destination's degree; ``queue_s``: the
        destination's outstanding work."""
        pricing, c = self.pricing, self.trie.degrees[k]
        upto, b = node.depth + 1, pricing.block_tokens
        r = self.trie.replica_count(node, c)
        if kind == "inter":
            compute = pricing.curves[c].benefit_s(held * b, upto * b)
            uses = _path_sum(node, held, k) / compute if compute > 0 else 0.0
        else:
            assert node.access is not None
            uses = node.access[k] / (r + 1)
        if pricing.copy_s is not None:
            # With pulls, requests go where the load is least and bring their prefix
            # along: the copy serves this destination's share of the uses only.
            uses *= (r + 1) / max(workers, r + 1)
        uses *= pricing.hit_share.get(kind, 1.0)
        return uses * pricing.saving_s(c, held, upto, queue_s)

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
        trie, cfg, in_flight = self.trie, self.config, self.in_flight
        plans: list[ReclaimPlan] = []
        probe = cfg.max_reclaim_per_scan * cfg.reclaim_probe
        for score, _, _, k, node in heapq.nsmallest(probe, candidates):
            if len(plans) >= cfg.max_reclaim_per_scan:
                break
            c = trie.degrees[k]
            holders = [trie.by_slot[slot] for slot in bits(node.holders & masks[k])]
            free = [h for h in holders if (node.block_id, h.worker_id) not in in_flight.reclaiming]
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
            # Its one block: what a later use there saves, against a slot of a full cache.
            queue_s = loads.get(victim.worker_id, 0.0)
            loss_s = score * self.pricing.saving_s(c, node.depth, node.depth + 1, queue_s)
            gain_s = self.pricing.value_s if not views[victim.worker_id].num_free_blocks() else 0.0
            if self.config.priced and gain_s <= loss_s:
                self.unpaid["reclaim"] += 1
                continue
            plans.append(in_flight.start_reclaim(victim.worker_id, node.block_id, c, score, loss_s))
        return plans


def _path_sum(node: Node, held: int, k: int) -> float:
    """Sum of missed[., k] over the nodes of ``node``'s path at depth >= ``held``."""
    total = 0.0
    z: Node | None = node
    while z is not None and z.depth >= held:
        if z.missed is not None:
            total += z.missed[k]
        z = z.parent
    return total
