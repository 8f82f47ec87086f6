"""Which workers the paper's rules reshape, once a rule has fired (``rules``).

The options are the lattice's splits or merges of workers in no reshape under
way; each must keep the composition the reshapes under way lead to (``counts``)
within the lattice's bounds. Splits are taken in order of ``score`` (the least
drain, then the least expected KV reconciliation traffic, then the lowest device)
up to ``limit``, or until the composition ``fits`` the demand; a merge is admitted
only if the merged composition keeps the demand under ``ceiling`` times its
capacity, and the best-scored admitted merge is taken. Both list what they
weighed in the decision's ``inputs``. Pure Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from vertumnus.policy.lattice import Lattice, Reshape

Score = Callable[[Reshape], tuple[float, float, int]]  # (drain_s, traffic, device)


def pick_splits(
    lattice: Lattice,
    busy: set[int],
    counts: Counter[int],
    score: Score,
    limit: int,
    fits: Callable[[Mapping[int, int]], bool] | None,
    inputs: dict[str, Any],
) -> list[Reshape]:
    """Up to ``limit`` splits of workers not in ``busy``, best first; with ``fits``,
    no more once the composition after them fits."""
    options = [op for op in lattice.split_options() if op.sources[0] not in busy]
    options.sort(key=score)
    inputs["split_options"] = [
        {"worker": op.sources[0], "drain_s": score(op)[0], "traffic": score(op)[1]}
        for op in options
    ]
    chosen: list[Reshape] = []
    bounds = lattice.config
    for op in options:
        if len(chosen) >= limit:
            break
        degree = lattice.workers[op.sources[0]].cp_degree
        after = counts.copy()
        after[degree] -= 1
        after[op.target_degree] += 2
        if not bounds.within_bounds(after):
            continue
        chosen.append(op)
        counts = after
        if fits is not None and fits(counts):
            break
    return chosen


def pick_merge(
    lattice: Lattice,
    busy: set[int],
    counts: Counter[int],
    score: Score,
    capacity_s: Callable[[Mapping[int, int]], float],
    demand: float,
    ceiling: float,
    inputs: dict[str, Any],
) -> Reshape | None:
    """The best merge of workers not in ``busy`` whose merged composition keeps
    ``demand`` under ``ceiling`` times its capacity; None if there is none."""
    admitted, refused = [], []
    for op in lattice.merge_options():
        if busy & set(op.sources):
            continue
        degree = lattice.workers[op.sources[0]].cp_degree
        after = counts.copy()
        after[degree] -= 2
        after[op.target_degree] += 1
        if not lattice.config.within_bounds(after):
            continue
        merged_capacity = capacity_s(after)
        if demand <= ceiling * merged_capacity:
            admitted.append(op)
        else:
            refused.append((op, merged_capacity))
    inputs["merge_ceiling"] = ceiling
    inputs["merges_refused"] = [
        {"workers": list(op.sources), "merged_capacity_s": cap} for op, cap in refused
    ]
    if not admitted:
        return None
    admitted.sort(key=score)
    inputs["merge_options"] = [
        {"workers": list(op.sources), "drain_s": score(op)[0], "traffic": score(op)[1]}
        for op in admitted
    ]
    return admitted[0]
