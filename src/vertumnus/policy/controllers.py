"""Which composition controller a policy stack runs, built from its parts.

``[controller] mode = "whatif"`` (the default) builds the what-if controller
(``control/whatif.py``), which reads the trie for each reshape's reconciliation share and
each worker's retained prefixes; ``"rules"`` the paper's window rules
(``control/rules.py``). Without a capacity in the profile (a fixed composition may lack
one), the decisions, only noted, price every worker at one second per window. Pure
Python.
"""

from __future__ import annotations

from collections.abc import Mapping

from vertumnus.perfmodel import Profile
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.control.replay import ReplayModel
from vertumnus.policy.control.rules import Controller
from vertumnus.policy.control.whatif import WhatIfController
from vertumnus.policy.costs import ReuseCurve
from vertumnus.policy.lattice import Lattice, Reshape
from vertumnus.policy.pool_config import PolicyConfig

# The controller a stack runs: the paper's rules or the what-if controller.
StackController = Controller | WhatIfController


def build_controller(
    config: PolicyConfig,
    lattice: Lattice,
    cache: PrefixCacheManager,
    curves: Mapping[int, ReuseCurve],
    profile: Profile,
) -> StackController:
    """The controller of ``config``, over ``lattice``; ``curves``: each degree's
    service-time curve (``costs.reuse_curves``)."""
    kappa = {c: float(profile.capacity.get(c, {}).get("kappa_s", 1.0)) for c in curves}

    def traffic(op: Reshape) -> float:  # the trie's expected reconciliation traffic
        return cache.reconciliation_traffic(op.sources, op.target_degree, op.target_firsts)

    if config.controller.mode != "whatif":
        return Controller(config.controller, lattice, kappa, traffic)
    model = ReplayModel(
        curves, lattice.config.degrees, config.weights, None, config.max_tokens_per_rank
    )
    controller = WhatIfController(config.controller, lattice, kappa, model, cache)
    controller.acting = config.adaptive
    return controller
