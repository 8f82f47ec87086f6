"""The synthetic prefix workload shared by the trie and scheduler benchmarks.

Shaped like the conversation trace: shared prefixes of ``SHARED_BLOCKS`` blocks
(system prompts, documents), each under ``CONVERSATIONS_PER_PREFIX`` conversations of
``OWN_BLOCKS`` blocks of their own, every conversation held by one to three workers
and reported to the cache manager as a worker's cache reports would be.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vertumnus.blocks import ROOT_BLOCK_ID
from vertumnus.policy.cache.index import CacheReport
from vertumnus.policy.cache.manager import PrefixCacheManager

SHARED_BLOCKS, OWN_BLOCKS, CONVERSATIONS_PER_PREFIX = 32, 96, 10


def conversations(nodes: int, rng: random.Random) -> list[list[int]]:
    """Block-id chains making about ``nodes`` distinct blocks."""
    per_prefix = SHARED_BLOCKS + CONVERSATIONS_PER_PREFIX * OWN_BLOCKS
    out: list[list[int]] = []
    for _ in range(max(1, nodes // per_prefix)):
        shared = [rng.getrandbits(63) | 1 for _ in range(SHARED_BLOCKS)]
        for _ in range(CONVERSATIONS_PER_PREFIX):
            out.append(shared + [rng.getrandbits(63) | 1 for _ in range(OWN_BLOCKS)])
    return out


def populate(
    manager: PrefixCacheManager,
    chains: Sequence[list[int]],
    workers: Sequence[int],
    rng: random.Random,
) -> None:
    """Each chain held by one to three of ``workers``, through their reports."""
    trie = manager.trie
    for chain in chains:
        for w in rng.sample(list(workers), rng.randint(1, 3)):
            # The worker's report: the part of the chain it did not hold yet.
            held = trie.held_depth(trie.match(chain, len(chain)), trie.worker(w).slot)
            parent = chain[held - 1] if held else ROOT_BLOCK_ID
            report = CacheReport(w, inserted=tuple(chain[held:]), inserted_parent=parent)
            manager.apply_report(report)
