"""Placement cost terms shared by the scheduler and the prefix-cache manager.

For request i on worker w of degree C_w with reusable prefix P_iw (docs/scheduling.md,
"Placement"):

    E_iw       = E_{C_w}(L_i - P_iw, P_iw)
    cost(i, w) = q_w + beta * E_iw + lambda * (C_w / C_min - 1) * E_iw

plus, in overload, kappa * (n_min - 1) * E_iw (``scheduler``: the backlog term).
``PreferDegree(i)`` is the degree minimising the same cost without the load term
``q_w``, with the request's globally matched prefix P*_i as if it were reusable at
every degree. The cache manager charges ``missed`` to that degree.

With R = L - P, the attention work is W(R, P) = (L(L+1) - P(P+1)) / 2, so along one
request (fixed L) the predicted time is a quadratic in the reused prefix P:

    f(P) = E_C(L - P, P) = f(0) - P * (a + c/C - b) - alpha * P(P+1) / (2C)

and the benefit of extending reuse from P1 to P2 tokens, f(P1) - f(P2), does not
depend on L. ``ReuseCurve`` holds one degree's coefficients in that form, so the
per-request update costs a few multiplications per trie node. A model with
sliding-window layers (the coefficients' ``attention`` mix, ``perfmodel``) has
W(L - P, P) = F(L) - F(P) with F(n) = W(n, 0) of the mix: no longer quadratic in P,
but the benefit f(P1) - f(P2) = (P2 - P1) * (a + c/C - b) + alpha * W(P2 - P1, P1) / C
still does not depend on L. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vertumnus.perfmodel import AttentionMix, DegreeCoeffs


@dataclass(frozen=True)
class CostWeights:
    """``beta`` >= 1 weighs a request's own execution time against the queue it joins;
    ``gpu_penalty`` (lambda) >= 0 charges the extra devices of a larger degree;
    ``backlog_weight`` (kappa) >= 0 weighs it, in overload, by the requests that
    will wait behind it (the scheduler's n_min - 1; 0: the plain rule)."""

    beta: float = 1.0
    gpu_penalty: float = 0.0
    backlog_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.beta >= 1.0:
            raise ValueError(f"beta must be >= 1, got {self.beta}")
        if not self.gpu_penalty >= 0.0:
            raise ValueError(f"gpu_penalty (lambda) must be >= 0, got {self.gpu_penalty}")
        if not self.backlog_weight >= 0.0:
            raise ValueError(f"backlog_weight must be >= 0, got {self.backlog_weight}")

    def factor(self, cp_degree: int, min_degree: int) -> float:
        """beta + lambda * (C / C_min - 1): the multiplier of E_iw in the cost."""
        return self.beta + self.gpu_penalty * (cp_degree / min_degree - 1)


class ReuseCurve:
    """E_C(L - P, P) of one degree as a function of the reused prefix P."""

    __slots__ = ("_d", "_lin_l", "_mix", "_pair", "_per_token", "_quad", "cp_degree")

    def __init__(self, cp_degree: int, coeffs: DegreeCoeffs) -> None:
        c = cp_degree
        self.cp_degree = cp_degree
        self._d = coeffs.d
        self._lin_l = coeffs.a + coeffs.c / c  # per input token, nothing reused
        self._quad = coeffs.alpha / (2 * c)  # times L(L+1) or P(P+1)
        self._per_token = coeffs.a + coeffs.c / c - coeffs.b  # saved per reused token
        # Sliding-window layers: alpha/C times the mix's W instead of the quadratic.
        self._mix: AttentionMix | None = None if coeffs.attention.full else coeffs.attention
        self._pair = coeffs.alpha / c

    @property
    def quadratic(self) -> bool:
        """Every layer full: f(P) is the quadratic above, a block's benefit linear in
        its depth."""
        return self._mix is None

    def time_s(self, input_tokens: int, reused_tokens: int) -> float:
        """E_C(L - P, P)."""
        n, p = input_tokens, reused_tokens
        if self._mix is not None:
            work = self._mix.work(n - p, p)
            return self._d + self._lin_l * n - self._per_token * p + self._pair * work
        return (
            self._d
            + self._lin_l * n
            + self._quad * (n * (n + 1) - p * (p + 1))
            - (self._per_token * p)
        )

    def benefit_s(self, from_tokens: int, to_tokens: int) -> float:
        """f(from) - f(to): time saved by reusing ``to_tokens`` instead of ``from_tokens``
        (independent of the input length)."""
        p1, p2 = from_tokens, to_tokens
        if self._mix is not None:
            work = self._mix.work(abs(p2 - p1), min(p1, p2))  # the pairs between them
            return (p2 - p1) * self._per_token + self._pair * (work if p2 >= p1 else -work)
        return (p2 - p1) * (self._per_token + self._quad * (p1 + p2 + 1))

    def block_benefit_s(self, block_tokens: int, depth: int) -> float:
        """The benefit of reusing block ``depth`` (its tokens depth*B to (depth+1)*B)."""
        return self.benefit_s(depth * block_tokens, (depth + 1) * block_tokens)


def reuse_curves(coeffs: Mapping[int, DegreeCoeffs]) -> dict[int, ReuseCurve]:
    return {c: ReuseCurve(c, k) for c, k in sorted(coeffs.items())}


def prefer_degree(
    curves: Mapping[int, ReuseCurve],
    degrees: Sequence[int],
    input_tokens: int,
    matched_tokens: int,
    weights: CostWeights,
) -> int:
    """argmin over ``degrees`` of (beta + lambda (C/C_min - 1)) * E_C(L - P*, P*).
    Ties go to the smaller degree (fewer devices for the same cost)."""
    min_degree = min(degrees)
    best, best_cost = degrees[0], float("inf")
    for c in sorted(degrees):
        cost = weights.factor(c, min_degree) * curves[c].time_s(input_tokens, matched_tokens)
        if cost < best_cost:
            best, best_cost = c, cost
    return best


class Pace:
    """How fast each degree's workers run against the profile: predicted over
    measured busy seconds of the prefills that ended (decayed sums). The scheduler
    counts work in the profile's seconds; a running prefill's elapsed time and a
    pull's wait are real seconds, so it turns them into the profile's at this pace
    (with the profile 2x fast, a prefill half done would otherwise look finished and
    its worker free). A degree with under ``min_samples`` takes every degree's
    pooled pace (1 while there are too few); clamped to [1/4, 4]."""

    def __init__(self, decay: float = 0.99, min_samples: float = 10.0) -> None:
        self.decay, self.min_samples = decay, min_samples
        self._sums: dict[int, list[float]] = {}  # degree -> [count, predicted, measured]
        self.by_degree: dict[int, float] = {}
        self.pooled = 1.0

    def ended(self, cp_degree: int, predicted_s: float, measured_s: float) -> None:
        if not (predicted_s > 0 and measured_s > 0):
            return
        d = self.decay
        e = self._sums.setdefault(cp_degree, [0.0, 0.0, 0.0])
        e[0], e[1], e[2] = e[0] * d + 1.0, e[1] * d + predicted_s, e[2] * d + measured_s
        if e[0] >= self.min_samples:
            self.by_degree[cp_degree] = _pace(e[1], e[2])
        every = self._sums.values()
        if sum(s[0] for s in every) >= self.min_samples:
            self.pooled = _pace(sum(s[1] for s in every), sum(s[2] for s in every))

    def of(self, cp_degree: int) -> float:
        return self.by_degree.get(cp_degree, self.pooled)


def _pace(predicted: float, measured: float) -> float:
    ratio = predicted / measured
    # (within 1e-9 of the profile it is the profile: a simulated pool runs exactly
    # its predicted times, and rounding must not reorder exact ties)
    return 1.0 if abs(ratio - 1.0) < 1e-9 else min(4.0, max(0.25, ratio))
