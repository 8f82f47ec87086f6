"""The initial worker composition, from a representative historical workload.

Among the lattice's compositions (within the bounds), the ones whose profiled
capacity covers the expected demand are suitable; of those, the one with the most
large-degree workers wins (the most workers of the largest degree, then of the
next, ...). If none is suitable, the one with the largest capacity.

The expected demand of a composition is ``requests_per_window`` times the mean, over
the historical length mix, of E_C(L - P, P) at the degree each request would prefer
in that composition (``costs.prefer_degree``: the placement cost without the load
term). It covers the demand when demand <= ``headroom`` * capacity, with the
controller's upper fraction as the natural headroom.

``layout_for`` turns a composition into a concrete lattice layout (largest degrees
first, buddy-aligned). Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.costs import CostWeights, prefer_degree, reuse_curves
from vertumnus.policy.geometry import (
    LatticeConfig,
    LatticeError,
    reachable_compositions,
    top_blocks,
)


@dataclass(frozen=True)
class CompositionChoice:
    composition: dict[int, int]  # workers per degree
    layout: list[int]  # degrees in device order
    demand_s: float  # expected per window
    capacity_s: float
    suitable: bool  # capacity covers the demand


def expected_demand_s(
    composition: Mapping[int, int],
    coeffs: Mapping[int, DegreeCoeffs],
    mix: Sequence[tuple[int, int]],
    requests_per_window: float,
    weights: CostWeights,
) -> float:
    curves = reuse_curves({c: coeffs[c] for c in composition})
    degrees = sorted(c for c, n in composition.items() if n)
    total = 0.0
    for n_in, cached in mix:
        c = prefer_degree(curves, degrees, n_in, cached, weights)
        total += curves[c].time_s(n_in, cached)
    return requests_per_window * total / len(mix)


def initial_composition(
    config: LatticeConfig,
    kappa_s: Mapping[int, float],
    coeffs: Mapping[int, DegreeCoeffs],
    mix: Sequence[tuple[int, int]],
    requests_per_window: float,
    headroom: float = 0.85,
    weights: CostWeights | None = None,
) -> CompositionChoice:
    if not mix:
        raise LatticeError("the historical length mix is empty")
    weights = weights or CostWeights()
    choices = []
    for comp in reachable_compositions(config):
        demand = expected_demand_s(comp, coeffs, mix, requests_per_window, weights)
        capacity = sum(kappa_s[c] * n for c, n in comp.items())
        choices.append((comp, demand, capacity, demand <= headroom * capacity))
    if not choices:
        raise LatticeError("no composition satisfies the worker bounds")
    suitable = [ch for ch in choices if ch[3]]
    if suitable:
        big_first = sorted(config.degrees, reverse=True)
        best = max(suitable, key=lambda ch: tuple(ch[0].get(c, 0) for c in big_first))
    else:
        best = max(choices, key=lambda ch: ch[2])
    comp, demand, capacity, ok = best
    return CompositionChoice(dict(comp), layout_for(config, comp), demand, capacity, ok)


def layout_for(config: LatticeConfig, composition: Mapping[int, int]) -> list[int]:
    """A buddy-aligned layout (degrees in device order) with these worker counts."""
    free = [(first, size) for first, size in top_blocks(config.num_devices, config.degrees)]
    placed: list[tuple[int, int]] = []
    for degree in sorted(composition, reverse=True):
        for _ in range(composition[degree]):
            # The smallest free block that fits, split down to the degree (buddy).
            fits = sorted((size, first) for first, size in free if size >= degree)
            if not fits:
                raise LatticeError(f"composition {dict(composition)} does not fit the lattice")
            size, first = fits[0]
            free.remove((first, size))
            while size > degree:
                size //= 2
                free.append((first + size, size))
            placed.append((first, degree))
    if free:
        raise LatticeError(f"composition {dict(composition)} leaves devices unused")
    return [degree for _, degree in sorted(placed)]
