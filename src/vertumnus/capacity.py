"""Capacity kappa_C of one worker: the largest window demand it serves within the SLO.

``kappa_C`` (docs/slo.md, "Capacity") is the largest window-level demand (the sum of
predicted service times E_C(R, P) of the requests arriving in a window of H seconds)
at which one degree-C worker still meets the target token-weighted TTFT SLO
attainment. The controller compares the pool's demand with the sum of ``kappa`` of
its workers.

How it is measured here: one simulated worker, FIFO, one prefill at a time (as the
engine runs them), service times from the profile. A fixed seeded sequence of
requests drawn from a length mix, and a fixed sequence of unit-mean inter-arrival
gaps (Poisson, or gamma with shape ``burstiness``). Load is set by stretching the
gaps: at utilisation rho the gaps are ``u_i * mean(E) / rho``. With the requests and
``u_i`` fixed, every waiting time grows with rho (Lindley's recursion
``wait_{i+1} = max(0, wait_i + E_i - gap_i)``), so attainment falls monotonically
with load and a bisection finds the largest rho that meets the target exactly, with
no noise between load levels. The first ``warmup_fraction`` of the requests (served
from an empty queue) are not scored. ``kappa`` is the measured demand per window at
that rho: H * (sum of E_i) / (span of their arrivals), about rho * H.

The run is long enough to span ``num_windows`` windows at full load, and at least
``min_requests`` requests. If the worker misses the target even unloaded (a
degree-1 worker facing long requests under a scaled SLO), ``kappa`` is 0.

Pure Python and clock-free: ``PredictFn`` is any E_C(R, P), such as
``Profile.predict``. Not owned here: the length mixes' sources (``traces.py``) and
writing the result into a profile (``cli/capacity.py``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from vertumnus.slo import DEFAULT_ATTAINMENT, DEFAULT_TTFT_SLO, PredictFn, TtftSlo
from vertumnus.traces import Trace

BUILTIN_MIX = "mooncake-conversation"


class CapacityError(ValueError):
    """Capacity settings or a length mix that cannot be used."""


@dataclass(frozen=True)
class LengthMix:
    """Requests to draw from, each ``(input_tokens, cached_tokens)``, cached < input."""

    name: str
    requests: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.requests:
            raise CapacityError(f"length mix {self.name!r} is empty")
        for n_in, n_cached in self.requests:
            if not (n_in >= 1 and 0 <= n_cached < n_in):
                raise CapacityError(
                    f"length mix {self.name!r}: need input >= 1 and 0 <= cached < input, "
                    f"got ({n_in}, {n_cached})"
                )

    @classmethod
    def from_trace(cls, trace: Trace) -> LengthMix:
        """Every request of ``trace``, with the prefix an unbounded cache would hold."""
        cached = trace.cached_tokens_unbounded()
        pairs = tuple((r.input_tokens, p) for r, p in zip(trace.requests, cached, strict=True))
        return cls(trace.source, pairs)

    @classmethod
    def builtin(cls) -> LengthMix:
        """A systematic sample (every 24th request) of the Mooncake conversation trace,
        with its unbounded-cache prefix reuse; made by ``tools/gen/make_builtin_mix.py``."""
        text = (resources.files("vertumnus") / "data" / f"mix-{BUILTIN_MIX}.csv").read_text()
        rows = [line.split(",") for line in text.splitlines()[1:] if line.strip()]
        return cls(f"builtin:{BUILTIN_MIX}", tuple((int(a), int(b)) for a, b in rows))

    def scaled(self, factor: float) -> LengthMix:
        """Lengths (and prefixes) times ``factor``, for hardware that serves shorter
        inputs than the mix was recorded on; at least one token left to compute."""
        if not (math.isfinite(factor) and factor > 0):
            raise CapacityError(f"length scale must be a positive number, got {factor!r}")
        if factor == 1:
            return self
        pairs = []
        for n_in, n_cached in self.requests:
            scaled_in = max(1, round(n_in * factor))
            pairs.append((scaled_in, min(round(n_cached * factor), scaled_in - 1)))
        return LengthMix(f"{self.name}*{factor:g}", tuple(pairs))


@dataclass(frozen=True)
class CapacitySettings:
    window_s: float = 30.0  # H
    slo: TtftSlo = field(default_factory=lambda: DEFAULT_TTFT_SLO)
    target_attainment: float = DEFAULT_ATTAINMENT
    num_windows: int = 20  # run length at full load, in windows
    min_requests: int = 2_000
    max_requests: int = 100_000
    warmup_fraction: float = 0.1
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps; 1 = Poisson
    max_utilisation: float = 2.0  # upper end of the search
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (
            (self.window_s > 0, "window_s must be > 0"),
            (0 < self.target_attainment <= 1, "target attainment must lie in (0, 1]"),
            (self.num_windows >= 1, "num_windows must be >= 1"),
            (10 <= self.min_requests <= self.max_requests, "need 10 <= min_requests <= max"),
            (0 <= self.warmup_fraction < 1, "warmup_fraction must lie in [0, 1)"),
            (self.burstiness > 0, "burstiness (gamma shape) must be > 0"),
            (self.max_utilisation > 0, "max_utilisation must be > 0"),
        )
        for ok, message in checks:
            if not ok:
                raise CapacityError(message)


@dataclass(frozen=True)
class CapacityResult:
    cp_degree: int
    kappa_s: float  # window demand, seconds of predicted service per window
    utilisation: float  # rho at kappa
    attainment: float  # token-weighted, at kappa
    isolated_attainment: float  # unloaded: the best this worker can do on this mix
    request_rate: float  # requests per second at kappa
    requests: int
    capped: bool  # the target was still met at max_utilisation

    def to_json(self, settings: CapacitySettings, mix: LengthMix) -> dict[str, Any]:
        """The entry under ``capacity`` of a profile: kappa with what it was measured at."""
        return {
            "kappa_s": self.kappa_s,
            "window_s": settings.window_s,
            "slo": settings.slo.describe(),
            "target_attainment": settings.target_attainment,
            "utilisation": self.utilisation,
            "attainment": self.attainment,
            "isolated_attainment": self.isolated_attainment,
            "request_rate": self.request_rate,
            "mix": mix.name,
            "burstiness": settings.burstiness,
            "requests": self.requests,
            "capped": self.capped,
            "seed": settings.seed,
        }


def fifo_ttft(service_s: Sequence[float], arrival_s: Sequence[float]) -> list[float]:
    """TTFT of each request at one FIFO worker that serves one request at a time."""
    ttft, free_at = [], -math.inf
    for arrival, service in zip(arrival_s, service_s, strict=True):
        finish = max(arrival, free_at) + service
        ttft.append(finish - arrival)
        free_at = finish
    return ttft


class LoadSweep:
    """One worker, one fixed request sequence, driven at any utilisation rho.

    Built once per (degree, mix, settings); ``attainment(rho)`` is monotone
    non-increasing in rho (same requests, same unit gaps, stretched)."""

    def __init__(
        self,
        predict: PredictFn,
        degrees: Sequence[int],
        cp_degree: int,
        mix: LengthMix,
        settings: CapacitySettings,
    ) -> None:
        rng = random.Random(settings.seed)
        service_of = {
            pair: predict(cp_degree, pair[0] - pair[1], pair[1]) for pair in set(mix.requests)
        }
        self.mean_s = sum(service_of[pair] for pair in mix.requests) / len(mix.requests)
        if not (math.isfinite(self.mean_s) and self.mean_s > 0):
            raise CapacityError(f"degree {cp_degree}: predicted service times must be > 0")
        wanted = math.ceil(settings.num_windows * settings.window_s / self.mean_s)
        n = min(settings.max_requests, max(settings.min_requests, wanted))
        drawn = [mix.requests[rng.randrange(len(mix.requests))] for _ in range(n)]
        shape = settings.burstiness
        self.unit_gaps = [rng.gammavariate(shape, 1.0 / shape) for _ in range(n)]
        self.service_s = [service_of[pair] for pair in drawn]
        tau_of = {
            n_in: settings.slo.tau_s(n_in, predict, degrees) for n_in in {p[0] for p in drawn}
        }
        self.tau_s = [tau_of[pair[0]] for pair in drawn]
        self.tokens = [pair[0] for pair in drawn]
        self.first = int(n * settings.warmup_fraction)  # scored from here on
        self.window_s = settings.window_s
        self._scored_tokens = sum(self.tokens[self.first :])

    @property
    def requests(self) -> int:
        return len(self.service_s)

    def arrivals(self, rho: float) -> list[float]:
        out, t = [], 0.0
        for gap in self.unit_gaps:
            out.append(t)
            t += gap * self.mean_s / rho
        return out

    def _score(self, ttft: Sequence[float]) -> float:
        f = self.first
        scored = zip(self.tokens[f:], ttft[f:], self.tau_s[f:], strict=True)
        return sum(n for n, t, limit in scored if t <= limit) / self._scored_tokens

    def isolated_attainment(self) -> float:
        """Every request served at once on arrival (rho -> 0)."""
        return self._score(self.service_s)

    def attainment(self, rho: float) -> float:
        return self._score(fifo_ttft(self.service_s, self.arrivals(rho)))

    def demand_s(self, rho: float) -> float:
        """Window demand at rho: H * (scored service seconds) / (their arrival span)."""
        at = self.arrivals(rho)
        return sum(self.service_s[self.first :]) * self.window_s / (at[-1] - at[self.first])

    def request_rate(self, rho: float) -> float:
        at = self.arrivals(rho)
        return (self.requests - 1 - self.first) / (at[-1] - at[self.first])


def measure_capacity(
    predict: PredictFn,
    degrees: Sequence[int],
    cp_degree: int,
    mix: LengthMix,
    settings: CapacitySettings,
) -> CapacityResult:
    """kappa_C of one degree-``cp_degree`` worker; ``degrees`` set the scaled SLO."""
    sweep = LoadSweep(predict, degrees, cp_degree, mix, settings)
    target = settings.target_attainment
    isolated = sweep.isolated_attainment()
    lo, hi = 0.0, settings.max_utilisation
    capped = isolated >= target and sweep.attainment(hi) >= target
    if capped:
        lo = hi
    elif isolated >= target:
        # Invariant: attainment(lo) >= target > attainment(hi); stop at 0.1% of rho.
        while hi - lo > 1e-3 * hi:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sweep.attainment(mid) >= target else (lo, mid)
    if lo == 0.0:
        # Misses the target unloaded, or at every load the bisection resolves.
        return CapacityResult(cp_degree, 0.0, 0.0, isolated, isolated, 0.0, sweep.requests, False)
    return CapacityResult(
        cp_degree=cp_degree,
        kappa_s=sweep.demand_s(lo),
        utilisation=lo,
        attainment=sweep.attainment(lo),
        isolated_attainment=isolated,
        request_rate=sweep.request_rate(lo),
        requests=sweep.requests,
        capped=capped,
    )
