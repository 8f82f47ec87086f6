"""Benchmark of one placement over 64 workers, trie lookups included.

    .venv/bin/python -m tools.bench.scheduler [--nodes 200000] [--requests 3000]

A pool of 384 devices as 32 degree-4 and 32 degree-8 workers, the derived H100
profile, and a prefix trie of about ``--nodes`` blocks built from cache reports
(shared 32-block prefixes under 96-block conversations, each held by one to three
workers), after the statistics of ``--warm-requests`` untimed placements. Every
worker has a few requests queued, conversations of the same trie, whose blocks are
coming there (``SchedulerConfig.coming_reuse``); the fewest waiting at a worker is
printed (at most 1: the backlog term, ``CostWeights.backlog_weight``, sleeps, its
scan stopping at the first such worker). Each timed ``Scheduler.place``
walks the trie for a 128-block request (``lookup``: P_iw of every worker), prices
all 64 candidates, reserves E_iw and runs the cache manager's per-request update
(Algorithm 1). The request is then cancelled, so the load stays the same. Printed:
the median and p99, with the ratio to the 100 us target, the same placement with
coming prefixes not counted, without the backlog term, and without a cache
manager (costs and reservation only), and with a full host tier on every host, for
reference. ``--json PATH`` writes the
figures with the machine and source they were measured on (``harness.py``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from tools.bench import harness, trie_workload
from vertumnus.perfmodel import Profile
from vertumnus.policy.cache.host_tier import HostLink, HostTierPolicy
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.costs import CostWeights
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.lattice import Lattice
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Scheduler, SchedulerConfig
from vertumnus.stats import percentile

PROFILE = "qwen3-30b-a3b-h100"  # shipped with the package
BLOCK_TOKENS = 512
KV_BYTES_PER_TOKEN = 98_304
TIER_CHAINS = 160  # conversations demoted into each host's tier (20,480 blocks: full)


def setup(
    nodes: int,
    seed: int,
    with_cache: bool,
    coming: bool = True,
    backlog_weight: float = 1.0,
    tier: bool = False,
) -> tuple[Scheduler, list[list[int]]]:
    rng = random.Random(seed)
    profile = Profile.load(PROFILE)
    coeffs = {c: profile.coeffs[c] for c in (4, 8)}
    lattice = Lattice(LatticeConfig(384, (4, 8)), [4] * 32 + [8] * 32)
    cache = PrefixCacheManager(coeffs, BLOCK_TOKENS) if with_cache else None
    if cache is not None:
        for w in lattice.workers.values():
            cache.add_worker(w.worker_id, w.cp_degree, w.first_device)
    chains = trie_workload.conversations(nodes, rng)
    if cache is not None:
        trie_workload.populate(cache, chains, range(64), rng)
    weights = CostWeights(backlog_weight=backlog_weight)
    sched = Scheduler(lattice, coeffs, SchedulerConfig(weights, coming_reuse=coming), cache)
    if tier:  # 1 TB a host of 8 devices, each holding TIER_CHAINS conversations
        tiers = HostTierPolicy(
            10**12, HostLink(BLOCK_TOKENS * KV_BYTES_PER_TOKEN, devices_per_host=8)
        )
        for host in range(384 // 8):
            for chain in rng.sample(chains, TIER_CHAINS):
                evicted = [(bid, 0, 0) for bid in reversed(chain)]
                tiers.demote(host * 8, evicted, now=-1e6)  # (written back long ago)
        sched.tiers = tiers
    tokens = (trie_workload.SHARED_BLOCKS + trie_workload.OWN_BLOCKS) * BLOCK_TOKENS + 1
    for rid in range(-1, -200, -1):  # a few requests queued everywhere
        chain = tuple(rng.choice(chains)) if rng.random() < 0.5 else ()
        sched.place(PlacementRequest(rid, rng.randint(1_000, tokens), chain), now=0.0)
    return sched, chains


def measure(
    sched: Scheduler, conversations: list[list[int]], n: int, seed: int
) -> tuple[list[float], list[float]]:
    """Per placement: the whole ``place`` (us), and the part spent in the cache
    manager's per-request update (us; zeros without a cache manager)."""
    rng = random.Random(seed)
    tokens = (trie_workload.SHARED_BLOCKS + trie_workload.OWN_BLOCKS) * BLOCK_TOKENS + 1
    times, updates = [], []
    cache = sched.cache
    update_s = [0.0]
    if cache is not None:
        inner = cache.on_request

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            update_s[0] = time.perf_counter() - t
            return out

        cache.on_request = timed  # type: ignore[method-assign]
    for rid in range(n):
        chain = tuple(rng.choice(conversations))
        t = time.perf_counter()
        placed = sched.place(PlacementRequest(rid, tokens, chain), now=0.0)
        times.append((time.perf_counter() - t) * 1e6)
        updates.append(update_s[0] * 1e6)
        assert placed is not None and placed.num_candidates == 64
        sched.cancel(rid)
    if cache is not None:
        cache.on_request = inner  # type: ignore[method-assign]
    return times, updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--nodes", type=int, default=200_000)
    parser.add_argument("--requests", type=int, default=3_000)
    parser.add_argument("--warm-requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    harness.add_arguments(parser)
    args = parser.parse_args()
    session = harness.Session("scheduler", args)
    full, conversations = setup(args.nodes, args.seed, with_cache=True)
    held, _ = setup(args.nodes, args.seed, with_cache=True, coming=False)
    flat, _ = setup(args.nodes, args.seed, with_cache=True, backlog_weight=0.0)
    waiting = min(len(full.queued(w)) for w in full.lattice.workers)
    bare, _ = setup(args.nodes, args.seed, with_cache=False)
    tiered, _ = setup(args.nodes, args.seed, with_cache=True, tier=True)
    n_nodes = len(full.cache.trie.nodes) if full.cache is not None else 0
    # Untimed first: the statistics of recent requests exist, as in steady state.
    measure(full, conversations, args.warm_requests, args.seed + 2)
    with_trie, updates = measure(full, conversations, args.requests, args.seed + 1)
    measure(held, conversations, args.warm_requests, args.seed + 2)
    held_only, _ = measure(held, conversations, args.requests, args.seed + 1)
    measure(flat, conversations, args.warm_requests, args.seed + 2)
    no_backlog, _ = measure(flat, conversations, args.requests, args.seed + 1)
    costs_only, _ = measure(bare, conversations, args.requests, args.seed + 1)
    measure(tiered, conversations, args.warm_requests, args.seed + 2)
    with_tier, _ = measure(tiered, conversations, args.requests, args.seed + 1)
    placing = [t - u for t, u in zip(with_trie, updates, strict=True)]

    med = statistics.median(with_trie)
    print(f"64 workers (32 x CP4, 32 x CP8), trie of {n_nodes:,} nodes, 128-block requests")
    print(
        f"place(), all of it (trie lookup, 64 costs, reservation, Algorithm 1 update): "
        f"median {med:.1f} us, p99 {percentile(with_trie, 99):.1f} us "
        f"-> {med / 100:.2f}x of the 100 us target"
    )
    print(
        f"  of which the placement (lookup, costs, reservation): median "
        f"{statistics.median(placing):.1f} us; the statistics update: median "
        f"{statistics.median(updates):.1f} us"
    )
    print(
        f"place() counting only held prefixes (coming_reuse off): median "
        f"{statistics.median(held_only):.1f} us, p99 {percentile(held_only, 99):.1f} us -> coming "
        f"prefixes cost {med / statistics.median(held_only):.2f}x"
    )
    print(
        f"place() without the backlog term (backlog_weight 0; the fewest waiting at a "
        f"worker: {waiting}): median {statistics.median(no_backlog):.1f} us, p99 "
        f"{percentile(no_backlog, 99):.1f} us "
        f"-> the term costs {med / statistics.median(no_backlog):.2f}x"
    )
    print(
        f"place() without a cache manager (costs + reservation): median "
        f"{statistics.median(costs_only):.1f} us, p99 {percentile(costs_only, 99):.1f} us"
    )
    print(
        f"place() with a host tier (1 TB on each of 48 hosts, full of conversations): "
        f"median {statistics.median(with_tier):.1f} us, p99 {percentile(with_tier, 99):.1f} us "
        f"-> the tier costs {statistics.median(with_tier) / med:.2f}x"
    )
    session.finish(
        args.json,
        {
            "workers": 64,
            "nodes": n_nodes,
            "args": vars(args),
            "place_us": harness.summary(with_trie),
            "placement_us": harness.summary(placing),
            "statistics_update_us": harness.summary(updates),
            "place_held_only_us": harness.summary(held_only),
            "place_with_tier_us": harness.summary(with_tier),
            "place_no_backlog_us": harness.summary(no_backlog),
            "fewest_waiting": waiting,
            "place_no_cache_manager_us": harness.summary(costs_only),
            "target_median_us": 100.0,
        },
    )


if __name__ == "__main__":
    main()
