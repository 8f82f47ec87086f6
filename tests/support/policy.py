"""Policy objects built by hand: per-degree coefficients whose decisions can be
worked out on paper, a cache manager that knows every worker of a lattice, and the
objects of a reshape wired together (lattice, scheduler, cache manager, controller,
reconfigurer). Pure, as the policy is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from support.factories import BLOCK_SIZE, make_profile
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.control.rules import Controller
from vertumnus.policy.lattice import Lattice
from vertumnus.policy.placement.scheduler import Scheduler
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.transition import Reconfigurer

# E_1(L, P) = 0.01 s + 1 ms per uncached token; E_2 = 0.02 s + 0.5 ms per uncached
# token (c is divided by C): short inputs prefer degree 1, long ones degree 2.
COEFFS = {1: DegreeCoeffs(d=0.01, c=1e-3), 2: DegreeCoeffs(d=0.02, c=1e-3)}
# For the cache manager, cached tokens and attention cost something too. Degree 2
# halves the per-token work and pays more start-up: long inputs prefer it.
CACHE_COEFFS = {
    1: DegreeCoeffs(d=0.01, c=1e-3, alpha=1e-6, b=1e-5),
    2: DegreeCoeffs(d=0.02, a=1e-4, c=1e-3, alpha=1e-6, b=2e-5),
}
# Seconds of demand per window each degree serves (the controller's capacities).
KAPPA_S = {1: 1.0, 2: 1.5}


def cache_manager_for(
    lattice: Lattice,
    coeffs: Mapping[int, DegreeCoeffs] = COEFFS,
    block_size: int = BLOCK_SIZE,
    config: CacheManagerConfig | None = None,
) -> PrefixCacheManager:
    """A cache manager that knows every worker of ``lattice``, in worker order."""
    cache = PrefixCacheManager(coeffs, block_size, config)
    for w in lattice.workers.values():
        cache.add_worker(w.worker_id, w.cp_degree, w.first_device)
    return cache


@dataclass
class PolicyStack:
    """The objects of a reshape, wired as the coordinator wires them."""

    lattice: Lattice
    scheduler: Scheduler
    cache: PrefixCacheManager
    controller: Controller
    reconfigurer: Reconfigurer


def policy_stack(lattice: Lattice, blocks_per_rank: int) -> PolicyStack:
    """The parts of the one policy stack (``PoolPolicy.build``, as the simulator and
    the coordinator build it) on ``lattice``'s configuration and layout, with
    ``COEFFS`` and ``KAPPA_S`` and the default policy settings."""
    pool = PoolSpec(lattice.config, tuple(lattice.layout()), BLOCK_SIZE, blocks_per_rank)
    policy = PoolPolicy.build(make_profile(COEFFS, KAPPA_S), pool, PolicyConfig())
    return PolicyStack(
        policy.lattice, policy.scheduler, policy.cache, policy.controller, policy.reconf
    )
