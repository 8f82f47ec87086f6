"""TTFT service-level objective: the per-request target tau_i, and attainment.

This module is the one place where Vertumnus defines its default TTFT SLO; the
capacity profiler, the simulator, the load generator and the docs all read it here.

The default target of request i (``DEFAULT_TTFT_SLO``):

    tau_i = max(min_s, scale * min over degrees C of E_C(L_i, 0))      scale = 5

i.e. five times the best prefill time the request could have on the pool's hardware,
unloaded and with nothing cached (its *isolated* time). A target that grows with the
input length is the usual choice for long-context serving (a 128K-token prompt cannot
meet a 1 s TTFT on any hardware, a 1K-token one should); it is set from the request,
not from the system's cache, so a prefix hit makes a target easier, never harder. The
reference is the best degree of the profile, so a degree-1 worker may miss the targets
of the longest requests even when idle: that is what a small-degree worker costs.
A fixed target (``2.5s``) is the other form. TTFT here is the prefill pool's part
(queueing + prefill); time outside the pool (KV hand-off, first decode step) is not
modelled.

Token-weighted attainment (docs/slo.md) = sum of L_i over requests with
TTFT_i <= tau_i, divided by the sum of all L_i. ``DEFAULT_ATTAINMENT`` (0.9) is the
target a worker must keep to count as within capacity.

Pure Python, no clock: ``PredictFn`` is any E_C(R, P), such as ``Profile.predict``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

PredictFn = Callable[[int, int, int], float]  # (cp_degree, uncached, cached) -> seconds

DEFAULT_SCALE = 5.0
DEFAULT_ATTAINMENT = 0.9


class SloError(ValueError):
    """An SLO that cannot be parsed or used; the message says why."""


@dataclass(frozen=True)
class TtftSlo:
    """Per-request TTFT target: ``scale`` x isolated time, or a fixed ``fixed_s``."""

    scale: float | None = DEFAULT_SCALE
    fixed_s: float | None = None
    min_s: float = 0.0  # floor under a scaled target

    def __post_init__(self) -> None:
        if (self.scale is None) == (self.fixed_s is None):
            raise SloError("a TTFT SLO is either scaled (5x) or fixed (2.5s), exactly one")
        for name in ("scale", "fixed_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SloError(f"TTFT SLO {name} must be a positive number, got {value!r}")
        if not (math.isfinite(self.min_s) and self.min_s >= 0):
            raise SloError(f"TTFT SLO floor must be >= 0 s, got {self.min_s!r}")

    @classmethod
    def parse(cls, text: str) -> TtftSlo:
        """``5x`` (scaled), ``5x,min=0.5s`` (scaled with a floor), ``2.5s`` / ``800ms`` /
        ``2.5`` (fixed, seconds when no unit)."""
        head, _, floor = text.strip().partition(",")
        min_s = 0.0
        if floor:
            key, _, value = floor.partition("=")
            if key.strip() != "min" or not value:
                raise SloError(f"TTFT SLO {text!r}: expected '<scale>x,min=<seconds>'")
            min_s = _seconds(value, text, allow_zero=True)
        head = head.strip()
        if head.endswith("x"):
            try:
                scale = float(head[:-1])
            except ValueError:
                raise SloError(f"TTFT SLO {text!r}: {head[:-1]!r} is not a number") from None
            return cls(scale=scale, min_s=min_s)
        if floor:
            raise SloError(f"TTFT SLO {text!r}: a floor applies to a scaled target only")
        return cls(scale=None, fixed_s=_seconds(head, text))

    def describe(self) -> str:
        """The inverse of ``parse``: a string ``parse`` reads back to this SLO."""
        if self.fixed_s is not None:
            return f"{self.fixed_s:g}s"
        floor = f",min={self.min_s:g}s" if self.min_s else ""
        return f"{self.scale:g}x{floor}"

    def tau_s(self, input_tokens: int, predict: PredictFn, degrees: Sequence[int]) -> float:
        """tau_i for a request of ``input_tokens`` on hardware described by ``predict``."""
        if self.fixed_s is not None:
            return self.fixed_s
        assert self.scale is not None
        if not degrees:
            raise SloError("a scaled TTFT SLO needs the degrees of a profile")
        isolated = min(predict(c, input_tokens, 0) for c in degrees)
        return max(self.min_s, self.scale * isolated)


DEFAULT_TTFT_SLO = TtftSlo()

_SECONDS = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?\s*$")


def _seconds(value: str, text: str, allow_zero: bool = False) -> float:
    match = _SECONDS.match(value)
    if match is None:
        raise SloError(f"TTFT SLO {text!r}: {value.strip()!r} is not a duration like 2.5s or 800ms")
    seconds = float(match.group(1)) * (1e-3 if match.group(2) == "ms" else 1.0)
    if seconds == 0 and not allow_zero:
        raise SloError(f"TTFT SLO {text!r}: the target must be positive")
    return seconds


def token_weighted_attainment(results: Iterable[tuple[int, float, float]]) -> float:
    """(input_tokens, ttft_s, tau_s) per request -> the token-weighted attainment.

    NaN when there are no tokens at all (nothing to attain)."""
    met = total = 0
    for input_tokens, ttft_s, tau_s in results:
        total += input_tokens
        if ttft_s <= tau_s:
            met += input_tokens
    return met / total if total else math.nan
