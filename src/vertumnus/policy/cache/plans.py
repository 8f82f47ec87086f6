"""What the prefix-cache manager asks of the workers, and its settings.

Every plan is a request, not a fact: the trie changes only when a worker's
``CacheReport`` confirms what happened (a replica is visible to placement only
after the destination reports it installed; a reclaimed replica leaves the holder
set only after the worker reports it deleted). The driver (coordinator or
simulator) executes a plan, applies the resulting reports, then calls the
manager's ``finish_copy`` / ``finish_reclaim`` with the outcome.

A ``CopyPlan`` makes ``dest_worker`` hold the whole prefix ending at ``block_id``.
Its ``moves`` say where each missing block's KV comes from and goes to, by device
(block j of a degree-C worker on devices [f, f + C) lives on device f + j % C);
a block the destination already holds when the plan runs is skipped. Kinds:

    inter   first replica of a prefix at a degree (re-shard when degrees differ)
    intra   another replica at a degree that has one
    fetch   a pending prefix (after a split or merge) on its first reuse
    pull    a prefix held elsewhere, to the worker a request was just placed on,
            because copying it costs less than computing it (the request waits)
    adopt   a pending prefix whose blocks already sit where the new geometry
            wants them: no data moves, the destination only indexes them
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vertumnus.policy.cache.nodes import Node


@dataclass(frozen=True)
class CacheManagerConfig:
    """Thresholds of the periodic scan (docs/cache.md). ``access`` counts reuses and
    ``missed`` seconds of predicted prefill time, both decayed by ``decay`` after
    every scan, so a threshold reads "per scan interval, in steady state, times
    1 / (1 - decay)"."""

    theta_inter_s: float = 0.5  # missed seconds that justify a first replica at a degree
    theta_intra: float = 8.0  # reuses per replica that justify one more
    theta_reclaim: float = 1.0  # below this many reuses per replica, reclaim one
    decay: float = 0.5
    max_inter_per_scan: int = 4
    max_intra_per_scan: int = 4
    max_reclaim_per_scan: int = 8
    # A scan examines at most this many times max_reclaim_per_scan reclaim
    # candidates (most are cold non-leaves when caches are full): bounded work.
    reclaim_probe: int = 8
    # Reclamation never takes a degree below this many replicas of a prefix: the last
    # copy at a degree is left to the worker's LRU, which drops it only when the room
    # is needed, instead of deleting it ahead of need.
    min_replicas_kept: int = 1
    # Intra candidates whose access per replica differ by less than this fraction are
    # "close": the smaller copy goes first.
    close_fraction: float = 0.1
    stat_floor: float = 1e-3  # statistics decayed below this are dropped
    # Pulls: a request placed where its prefix is not held may have the prefix copied
    # there from a holder, when the copy (its wait on the copy lanes included) costs less
    # than computing the prefix. The copy time starts from these and is then learned
    # from the copies measured (``copy_cost.CopyTimer``).
    # Every scan plan must pay for itself by the model's estimate (``scan``);
    # false: the paper's Algorithm 2 as written (every candidate within the limits).
    priced: bool = True
    pull: bool = True
    copy_latency_s: float = 1e-3  # a copy's fixed cost
    copy_block_s: float = 1e-3  # seconds per block moved
    # The price of one eviction is ``eviction_weight`` times the future prefill time it
    # is measured to cost (``copy_cost.EvictionValue``): that work lands on a loaded
    # pool, behind and ahead of others. Swept over 0.5 / 1 / 2 / 4 / 8 on the agent-like
    # workload at x2.75 and x3 (4 best), and checked on the conversation trace.
    eviction_weight: float = 4.0
    # Copies on disjoint devices run at once ("device"); "serial": one at a time in
    # the whole pool (``policy/stack/lanes.py``).
    lanes: str = "device"
    # The host tier (``cache/host_tier.py``): bytes of host memory per host for the
    # KV blocks its ranks evict (0: none); ``host_tier_bound``: the simulator's bound,
    # one unbounded tier holding every block ever committed.
    host_tier_bytes: int = 0
    host_tier_bound: bool = False

    def __post_init__(self) -> None:
        size: object = self.host_tier_bytes
        if isinstance(size, float) and size.is_integer():  # (TOML: 1e12)
            object.__setattr__(self, "host_tier_bytes", int(size))
        if not isinstance(self.host_tier_bytes, int) or self.host_tier_bytes < 0:
            raise ValueError(
                f"host_tier_bytes must be whole bytes >= 0, got {self.host_tier_bytes!r}"
            )
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must lie in (0, 1), got {self.decay}")
        if not 0 <= self.theta_reclaim < self.theta_intra:
            raise ValueError("need 0 <= theta_reclaim < theta_intra")
        if self.theta_inter_s < 0:
            raise ValueError("theta_inter_s must be >= 0")
        limits = (self.max_inter_per_scan, self.max_intra_per_scan, self.max_reclaim_per_scan)
        if min(limits) < 0:
            raise ValueError("per-scan limits must be >= 0")
        if self.reclaim_probe < 1:
            raise ValueError("reclaim_probe must be >= 1")
        if self.min_replicas_kept < 1:
            raise ValueError("min_replicas_kept must be >= 1")
        if not (self.copy_latency_s >= 0 and self.copy_block_s >= 0 and self.eviction_weight >= 0):
            raise ValueError("copy_latency_s, copy_block_s and eviction_weight must be >= 0")
        if self.lanes not in ("device", "serial"):
            raise ValueError(f"lanes must be 'device' or 'serial', got {self.lanes!r}")
        if not (self.stat_floor > 0 and math.isfinite(self.stat_floor)):
            raise ValueError("stat_floor must be > 0")


class WorkerCacheView(Protocol):
    """What the manager reads of a worker's physical cache (``WorkerCacheIndex``)."""

    def can_reclaim(self, block_id: int) -> bool: ...

    def num_free_blocks(self) -> int: ...

    def held_blocks(self) -> set[int]: ...


@dataclass(frozen=True)
class BlockMove:
    block_id: int
    depth: int
    src_worker: int | None  # None: KV retained on src_device from an old geometry
    src_device: int
    dst_device: int


@dataclass(frozen=True)
class CopyPlan:
    plan_id: int
    kind: str  # "inter" | "intra" | "fetch" | "adopt"
    block_id: int  # the prefix ends here
    dest_worker: int
    cp_degree: int  # the destination's
    prefix_ids: tuple[int, ...]  # the whole prefix, root first (ends with block_id)
    moves: tuple[BlockMove, ...]
    reshard: bool  # some block moves between workers of different degrees
    score: float  # the ranking value that selected it (0 for fetch and adopt)
    # The scan's predicted benefit, seconds of prefill (or of pull waits) saved per
    # statistics window; 0 for fetch, adopt, pull and copies asked for by hand.
    benefit_s: float = 0.0

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The blocks to move (the destination held the rest when it was planned)."""
        return tuple(m.block_id for m in self.moves)


@dataclass(frozen=True)
class ReclaimPlan:
    plan_id: int
    worker_id: int
    block_id: int
    cp_degree: int
    score: float  # access per replica
    loss_s: float = 0.0  # the scan's predicted cost of losing the replica, per window


@dataclass(frozen=True)
class ScanResult:
    copies: tuple[CopyPlan, ...]
    reclaims: tuple[ReclaimPlan, ...]
    candidates: Mapping[str, int]  # list sizes before the per-scan cut
    # Candidates that would not pay for themselves (``scan``), per list.
    unpaid: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefixLookup:
    """One request's walk of the trie, before placement."""

    block_ids: tuple[int, ...]
    input_tokens: int
    usable: int  # blocks it may reuse: whole blocks, one token left to compute
    path: Sequence[Node]  # MatchedPath
    reusable_tokens: Mapping[int, int]  # P_iw, confirmed replicas only


@dataclass(frozen=True)
class RequestUpdate:
    matched_blocks: int  # MatchedPath: held anywhere
    reused_blocks: int  # ReusedPath at the chosen worker (confirmed only)
    preferred_degree: int
    fetch: CopyPlan | None  # a pull, or pending blocks of the chosen worker worth fetching
    awaits: int | None = None  # the pull (plan id) the request must wait for
