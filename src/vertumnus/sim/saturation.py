"""The saturation rate of a composition for a request mix: the fluid bound.

For a composition with n_C workers of degree C and a request mix i = 1..N, with
E_C,i = E_C(L_i - P_i, P_i) from the profile (``policy/costs.py``, P_i the tokens
request i reuses), the largest arrival rate that some split of the mix over the
degrees serves with each degree's workers busy at most all of the time:

    max lambda  s.t.  lambda / N * sum_i x_iC E_C,i <= n_C,  sum_C x_iC = 1,  x >= 0

With one degree, lambda = n / mean E. With two, the optimum gives the larger degree
the requests of least ratio E_big,i / E_small,i (the long ones) until both degrees
carry equal work per worker, one request split between them (an exchange argument:
moving work of a higher ratio to the larger degree frees less small-degree time).
It ignores queueing, cache locality (each request's whole reuse on any worker) and
reshapes: an upper bound on what the simulated pool serves. Pure Python. Not owned
here: where the mix comes from (``sim/scenarios.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vertumnus.perfmodel import Profile
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.geometry import LatticeConfig, reachable_compositions


def fluid_rate(work_s: Sequence[Mapping[int, float]], composition: Mapping[int, int]) -> float:
    """The fluid bound (module docstring) of ``composition`` for a request mix,
    ``work_s[i][C]`` = E_C of request i: requests/s. At most two degrees."""
    present = sorted(c for c, n in composition.items() if n > 0)
    if not work_s or not present:
        return 0.0
    if len(present) == 1:
        (c,) = present
        return composition[c] * len(work_s) / sum(w[c] for w in work_s)
    if len(present) > 2:
        raise ValueError("the fluid bound here takes at most two degrees")
    small, big = present
    n_small, n_big = composition[small], composition[big]
    # The big degree takes the requests it is relatively best at, in this order,
    # until both degrees carry the same work per worker.
    order = sorted(work_s, key=lambda w: w[big] / w[small])
    rest_s = sum(w[small] for w in order)  # small-degree work of requests k..N
    done_s = 0.0  # big-degree work of requests 0..k-1
    for w in order:
        if (done_s + w[big]) / n_big >= (rest_s - w[small]) / n_small:
            # Request k splits: a share theta of it to the big degree.
            theta = (n_big * rest_s - n_small * done_s) / (n_small * w[big] + n_big * w[small])
            return n_big * len(work_s) / (done_s + theta * w[big])
        done_s += w[big]
        rest_s -= w[small]
    return n_big * len(work_s) / done_s


def saturation(
    mix: Sequence[tuple[int, int]], profile: Profile, lattice: LatticeConfig
) -> tuple[float, dict[int, int]]:
    """(the largest fluid bound over the lattice's compositions, that composition)
    for a mix of (input tokens, reused tokens)."""
    curves = reuse_curves({c: profile.coeffs[c] for c in lattice.degrees})
    work_s = [{c: k.time_s(n, p) for c, k in curves.items()} for n, p in mix]
    rated = [(fluid_rate(work_s, comp), comp) for comp in reachable_compositions(lattice)]
    return max(rated, key=lambda x: x[0])
