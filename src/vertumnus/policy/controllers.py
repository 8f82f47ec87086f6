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
from typing import TYPE_CHECKING

from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.control.rules import Controller
from vertumnus.policy.control.whatif import WhatIfController

if TYPE_CHECKING:
    from vertumnus.policy.pool_policy import PoolPolicy


def build_controller(
    stack: PoolPolicy, profile: Profile, coeffs: Mapping[int, DegreeCoeffs]
) -> Controller:
    config, cache = stack.config, stack.cache
    kappa = {c: float(profile.capacity.get(c, {}).get("kappa_s", 1.0)) for c in coeffs}
    if config.controller.mode != "whatif":
        return Controller(config.controller, stack.lattice, kappa, stack.traffic)
    trie = cache.trie
    return WhatIfController(
        config.controller,
        stack.lattice,
        kappa,
        stack.curves,
        config.weights,
        stack.traffic,
        lambda op: cache.reconciliation_share(op.sources, op.target_degree, op.target_firsts),
        lambda w: len(trie.worker_nodes.get(w, ())) + len(trie.worker_pending.get(w, ())),
        config.max_tokens_per_rank,
        acting=config.adaptive,
    )
