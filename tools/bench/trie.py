"""Benchmark of the global prefix trie and cache manager at cluster scale.

    .venv/bin/python -m tools.bench.trie [--nodes 1000000] [--requests 2000]

A trie of about ``--nodes`` blocks held across 40 workers (20 of degree 4, 20 of
degree 8; 240 devices), built from cache reports as the coordinator would get them.
Its shape follows the conversation trace: 1,000 shared prefixes of 32 blocks (system
prompts, documents), each under ten conversations of 96 blocks of their own, every
conversation held by one to three workers. Then:

  * per-request match + update (``on_request``) of 128-block requests on random
    conversations, and the scheduler's query (``reusable_tokens``), median and p99;
  * one full scan, after the statistics of ``--warm-requests`` requests;
  * memory per node (tracemalloc, over the whole manager).

Targets: match + update under 100 us median, one scan under 1 s, under
1 KB per node. Each figure is printed with its ratio to the target; ``--json PATH``
writes them with the machine and source they were measured on (``harness.py``).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

from tools.bench import harness, trie_workload
from vertumnus.perfmodel import Profile
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.stats import percentile

PROFILE = "qwen3-30b-a3b-h100"  # shipped with the package
BLOCK_TOKENS = 512


class FreeView:
    """A worker cache with room and nothing reclaimable (what the scan reads)."""

    def can_reclaim(self, block_id: int) -> bool:
        return False

    def num_free_blocks(self) -> int:
        return 1_000

    def held_blocks(self) -> set[int]:
        return set()


def build(nodes: int, seed: int) -> tuple[PrefixCacheManager, list[list[int]]]:
    rng = random.Random(seed)
    profile = Profile.load(PROFILE)
    manager = PrefixCacheManager(
        {c: profile.coeffs[c] for c in (4, 8)}, BLOCK_TOKENS, CacheManagerConfig()
    )
    for w in range(40):
        degree = 4 if w < 20 else 8
        manager.add_worker(w, degree, 80 + 8 * (w - 20) if degree == 8 else 4 * w)
    chains = trie_workload.conversations(nodes, rng)
    trie_workload.populate(manager, chains, range(40), rng)
    return manager, chains


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--warm-requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    harness.add_arguments(parser)
    args = parser.parse_args()
    session = harness.Session("trie", args)

    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    manager, conversations = build(args.nodes, args.seed)
    build_s = time.perf_counter() - t0
    gc.collect()
    traced_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    n_nodes = len(manager.trie.nodes)
    # The conversation lists are the benchmark's, not the manager's.
    list_bytes = sum(56 + 8 * len(c) for c in conversations) + 36 * sum(map(len, conversations))
    per_node = (traced_bytes - list_bytes) / n_nodes
    print(f"trie: {n_nodes:,} nodes, 40 workers, built in {build_s:.1f} s (tracemalloc on)")

    rng = random.Random(args.seed + 1)
    tokens = (trie_workload.SHARED_BLOCKS + trie_workload.OWN_BLOCKS) * BLOCK_TOKENS + 1

    def request() -> tuple[list[int], int]:
        return rng.choice(conversations), rng.randrange(40)

    for _ in range(args.warm_requests):
        chain, w = request()
        manager.on_request(chain, tokens, w)
    update_us, query_us = [], []
    for _ in range(args.requests):
        chain, w = request()
        t = time.perf_counter()
        manager.on_request(chain, tokens, w)
        update_us.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        manager.reusable_tokens(chain, tokens)
        query_us.append((time.perf_counter() - t) * 1e6)
    touched = len(manager.trie.touched)
    replicated = len(manager.trie.replicated)
    views = {w: FreeView() for w in range(40)}
    loads = {w: rng.random() for w in range(40)}
    t = time.perf_counter()
    result = manager.scan(views, loads)
    scan_s = time.perf_counter() - t

    med = statistics.median(update_us)
    print(
        f"on_request (match + update), 128 blocks: median {med:.1f} us, "
        f"p99 {percentile(update_us, 99):.1f} us  -> {med / 100:.2f}x of the 100 us target"
    )
    print(
        f"reusable_tokens (scheduler query):        median {statistics.median(query_us):.1f} us, "
        f"p99 {percentile(query_us, 99):.1f} us"
    )
    print(
        f"scan: {scan_s:.3f} s over {touched:,} nodes with statistics and {replicated:,} "
        f"replicated ({result.candidates}); {len(result.copies)} copies planned "
        f"-> {scan_s:.2f}x of the 1 s target"
    )
    print(f"memory: {per_node:.0f} bytes per node -> {per_node / 1024:.2f}x of the 1 KB target")
    session.finish(
        args.json,
        {
            "nodes": n_nodes,
            "workers": 40,
            "block_tokens": BLOCK_TOKENS,
            "args": vars(args),
            "build_s": build_s,
            "on_request_us": harness.summary(update_us),
            "reusable_tokens_us": harness.summary(query_us),
            "scan_s": scan_s,
            "scan_nodes_with_statistics": touched,
            "scan_nodes_replicated": replicated,
            "scan_copies_planned": len(result.copies),
            "bytes_per_node": per_node,
            "targets": {
                "on_request_median_us": 100.0,
                "scan_s": 1.0,
                "bytes_per_node": 1024.0,
            },
        },
    )


if __name__ == "__main__":
    main()
