"""``[pool] composition = "auto"``: the simulator's starting composition, from the model.

The what-if controller starts right (DESIGN.md §6b): the first ``span_s`` seconds
of the workload stand for a representative historical workload; each request's
reusable prefix is the longest run of its leading blocks that an earlier request
of that sample already had (as if cached anywhere in the pool: a cold pool knows
no more), and ``whatif_candidates.best_start`` replays them over every composition
the lattice allows and keeps the fastest. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.blocks import max_reuse_blocks
from vertumnus.perfmodel import Profile
from vertumnus.policy.composition import layout_for
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.forecast import ArrivalSample
from vertumnus.policy.lattice import LatticeConfig
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.policy.replay import ReplayModel
from vertumnus.policy.whatif_candidates import StartChoice, best_start
from vertumnus.sim.workload import SimRequest


def start_samples(
    requests: Sequence[SimRequest], span_s: float, block_tokens: int
) -> list[ArrivalSample]:
    """The first ``span_s`` seconds of ``requests`` as forecast samples."""
    if not requests:
        return []
    origin = requests[0].arrival_s
    seen: set[int] = set()
    out = []
    for r in requests:
        if r.arrival_s - origin > span_s:
            break
        limit = min(len(r.block_ids), max_reuse_blocks(r.input_tokens, block_tokens))
        reused = 0
        while reused < limit and r.block_ids[reused] in seen:
            reused += 1
        seen.update(r.block_ids)
        out.append(
            ArrivalSample(
                r.request_id, r.arrival_s, r.input_tokens, floor_tokens=reused * block_tokens
            )
        )
    return out


def choose_start(
    lattice: LatticeConfig,
    profile: Profile,
    policy: PolicyConfig,
    requests: Sequence[SimRequest],
    block_tokens: int,
    span_s: float = 60.0,
) -> tuple[list[int], StartChoice]:
    """(layout, the choice with every composition's prediction)."""
    curves = reuse_curves({c: profile.coeffs[c] for c in lattice.degrees})
    model = ReplayModel(
        curves, lattice.degrees, policy.weights, max_tokens_per_rank=policy.max_tokens_per_rank
    )
    choice = best_start(lattice, model, start_samples(requests, span_s, block_tokens))
    return layout_for(lattice, choice.composition), choice
