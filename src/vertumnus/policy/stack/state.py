"""The state the stack's parts share, in one typed bundle (as SGLang's caches get
``CacheInitParams``).

``StackState(profile, pool, config)`` is built once by ``PoolPolicy`` and handed to
each part; it builds, in this order, what several parts read or change:

    curves      each degree's service-time curve (``costs.reuse_curves``)
    lattice     the workers and their geometry
    cache       the prefix-cache manager (the trie)
    tiers       the host tier, if any (``cache/host_tier.py``)
    scheduler   the router (the cost rule or a baseline)
    controller  when to reshape (``controllers.build_controller``)
    holds       KV kept for decode servers (``cache/holds.py``)
    indexes     one ``WorkerCacheIndex`` per worker (``add_worker`` makes one)
    ledger      the KV ledger over those indexes
    running     each worker's prefill under way (``prefills`` writes it)
    down        devices of failed workers that are coming back (``outages`` writes it)

The parts read it freely and change only what they own; the questions several
parts ask (``someone_coming``) are answered here. Pure Python, clock-free. Not owned
here: what the parts do with it, nor how they are wired (``pool_policy``).
"""

from __future__ import annotations

from vertumnus.perfmodel import Profile
from vertumnus.policy.cache.holds import Holds
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.ledger import KVLedger
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.controllers import build_controller
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.lattice import Lattice, WorkerState
from vertumnus.policy.placement.routers import ROUTERS
from vertumnus.policy.placement.scheduler import SchedulerConfig
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec, host_tiers
from vertumnus.policy.pool_results import Running


class StackState:
    def __init__(self, profile: Profile, pool: PoolSpec, config: PolicyConfig) -> None:
        pool.check_profile(profile, config)
        coeffs = {c: profile.coeffs[c] for c in pool.lattice.degrees}
        self.profile, self.pool, self.config = profile, pool, config
        self.block_tokens = pool.block_tokens
        self.blocks_per_rank = pool.blocks_per_rank
        self.curves = reuse_curves(coeffs)
        self.lattice = Lattice(pool.lattice, pool.layout)
        self.cache = PrefixCacheManager(
            coeffs, pool.block_tokens, config.cache, config.weights, config.ideal_reuse
        )
        self.tiers = host_tiers(profile, pool, config)  # the host tier, if any
        self.scheduler = ROUTERS[config.router](
            self.lattice,
            coeffs,
            SchedulerConfig(
                config.weights,
                config.max_tokens_per_rank,
                pool.blocks_per_rank,
                config.coming_reuse,
            ),
            self.cache,
        )
        if self.tiers.enabled:
            self.scheduler.tiers = self.tiers
        self.controller = build_controller(config, self.lattice, self.cache, self.curves, profile)
        self.holds = Holds()  # KV kept for decode servers (``policy/cache/holds.py``)
        self.indexes: dict[int, WorkerCacheIndex] = {}
        self.ledger = KVLedger(
            self.lattice, self.indexes, self.cache, pool.blocks_per_rank, config.retention
        )
        self.running: dict[int, Running] = {}  # worker -> its prefill under way
        self.down: set[int] = set()  # devices of failed workers that are coming back
        for w in self.lattice.workers.values():
            self.add_worker(w.worker_id)

    def add_worker(self, worker_id: int) -> None:
        """A fresh (empty) cache index for ``worker_id``, and the trie learns of it."""
        w = self.lattice.workers[worker_id]
        self.indexes[worker_id] = WorkerCacheIndex(w.cp_degree, self.blocks_per_rank, worker_id)
        if worker_id not in self.cache.trie.workers:
            self.cache.add_worker(worker_id, w.cp_degree, w.first_device)

    def someone_coming(self) -> bool:
        """A worker will become a candidate: a reshape or a restart is under way."""
        return bool(self.down) or any(
            w.state in (WorkerState.DRAINING, WorkerState.SWITCHING)
            for w in self.lattice.workers.values()
        )
