"""Randomized scenarios for the robustness suite: drawn per seed, generated as requests.

``draw(seed)`` gives a ``Scenario``: everything one seed decides (duration, the
shape of the rate, the reuse family and its knobs, the length mix, the load and
three start compositions); ``requests(scenario)`` turns it into ``SimRequest``s.
Both are deterministic for a seed. ``TUNE_SEEDS`` and ``REPORT_SEEDS`` are apart:
tune on the one, report the other.

Arrivals. Sessions (one request, a conversation or an agent's run) start as a
non-homogeneous Poisson process (thinning) of rate lambda(t) / m, lambda(t) the
shape's request rate and m the mean requests per session, from ``LEAD_S`` before
0; a session's later requests follow its own gaps; only those in [0,
``duration_s``) are kept. Shapes::

    steady   lambda = r0
    step     r0 until change_s (20-80 % in), then r1 = r0 times or over 1.5-4
    ramp     from r0 at 0 linearly to r1 at the end (r1/r0 in 1.5-4, up or down)
    burst    r0, and r1 = 2-4 x r0 from change_s for burst_s (1-3 min)

with r0, r1 set so that lambda's peak over the run is ``load`` (0.2-1.1) x the
saturation.

The reuse family and the length mix are ``sim/families.py``'s; a family's requests
come as sessions, their block ids naming whole prefixes (``sim/sessions.py``).

The load is against the saturation of the best composition for the family's
request mix (a sample of ``MIX_REQUESTS``, each with its unbounded-cache reuse):
the fluid bound of ``sim/saturation.py``, an upper bound on what the simulated pool
serves, so that past load 1 every composition overloads.

Pure Python. Not owned here: the fluid bound (``sim/saturation.py``), running the
simulations and the report (``tools/experiments/robustness.py``).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from vertumnus.perfmodel import Profile
from vertumnus.policy.geometry import LatticeConfig, composition_name, reachable_compositions
from vertumnus.sim.config import DEFAULT_POOL, DEFAULT_PROFILE
from vertumnus.sim.families import (
    FAMILIES,
    LONG_TOKENS,
    LengthMix,
    Reuse,
    draw_reuse,
    log_uniform,
)
from vertumnus.sim.saturation import saturation
from vertumnus.sim.sessions import family_sessions, mix_sample, unbounded_reuse
from vertumnus.sim.workload import SimRequest

__all__ = [
    "MIX_REQUESTS",
    "REPORT_SEEDS",
    "SHAPES",
    "TUNE_SEEDS",
    "Scenario",
    "draw",
    "measure",
    "requests",
    "scaled",
]

SHAPES = ("steady", "step", "ramp", "burst")
TUNE_SEEDS = tuple(range(16))
REPORT_SEEDS = tuple(range(100, 160))
MIX_REQUESTS = 4_000  # the sample the saturation is computed on
LEAD_S = 180.0  # sessions start this long before 0, so that the run starts in steady state


@dataclass(frozen=True)
class Scenario:
    seed: int
    duration_s: float
    shape: str
    base_rate: float  # requests/s: r0 (steady: throughout; burst: outside the burst)
    second_rate: float  # r1: step, after change_s; ramp, at the end; burst, in it
    change_s: float | None  # step: when the rate changes; burst: when it starts
    burst_s: float | None  # burst: how long
    load: float  # peak rate over the saturation
    saturation_rate: float  # requests/s, the fluid bound of the best composition
    saturation_composition: str
    session_requests: float  # mean requests per session (of the saturation's sample)
    lengths: LengthMix
    reuse: Reuse
    starts: tuple[str, str, str]  # the default start, then two others

    @property
    def family(self) -> str:
        return self.reuse.family

    @property
    def mean_rate(self) -> float:
        """Requests/s over the run, on average."""
        r0, r1, d = self.base_rate, self.second_rate, self.duration_s
        high_s = {"step": d - (self.change_s or 0.0), "ramp": d / 2, "burst": self.burst_s}
        return r0 + (r1 - r0) * (high_s.get(self.shape) or 0.0) / d

    @property
    def peak_rate(self) -> float:
        return max(self.base_rate, self.second_rate)

    def rate_at(self, t_s: float) -> float:
        r0, r1 = self.base_rate, self.second_rate
        if self.shape == "step":
            return r0 if t_s < (self.change_s or 0.0) else r1
        if self.shape == "ramp":
            return r0 + (r1 - r0) * min(1.0, max(0.0, t_s) / self.duration_s)
        if self.shape == "burst":
            start, length = self.change_s or 0.0, self.burst_s or 0.0
            return r1 if start <= t_s < start + length else r0
        return r0

    def phase_at(self, t_s: float) -> int:
        """0 before the step or burst (and for steady and ramp), 1 after the step or
        in the burst, 2 after the burst."""
        if self.change_s is None or t_s < self.change_s:
            return 0
        if self.burst_s is not None and t_s >= self.change_s + self.burst_s:
            return 2
        return 1

    def describe(self) -> dict[str, Any]:
        """Every parameter, as plain JSON values (the family's knobs under ``reuse``)."""
        return asdict(self)


def draw(
    seed: int, profile: Profile | None = None, lattice: LatticeConfig | None = None
) -> Scenario:
    """The scenario of ``seed`` on ``lattice`` (default: 40 GPUs at {4, 8}), its load
    measured against ``profile``'s saturation (default: the shipped profile)."""
    lattice = lattice or DEFAULT_POOL.lattice
    profile = profile or Profile.load(DEFAULT_PROFILE)
    rng = random.Random(f"scenario:{seed}")
    duration_s = rng.uniform(120.0, 1200.0)
    shape = rng.choice(SHAPES)
    lengths = LengthMix(
        int(log_uniform(rng, 1000, 8000)), rng.uniform(0.4, 1.0), rng.uniform(0.0, 0.25)
    )
    reuse = draw_reuse(rng.choice(FAMILIES), rng)
    load = rng.uniform(0.2, 1.1)
    default = composition_name(DEFAULT_POOL.composition)
    others = [n for c in reachable_compositions(lattice) if (n := composition_name(c)) != default]
    first, second = rng.sample(others, 2)
    ratio = rng.uniform(1.5, 4.0) if shape != "burst" else rng.uniform(2.0, 4.0)
    if shape in ("step", "ramp") and rng.random() < 0.5:
        ratio = 1 / ratio
    change_s = burst_s = None
    if shape == "step":
        change_s = rng.uniform(0.2, 0.8) * duration_s
    elif shape == "burst":
        burst_s = min(rng.uniform(60.0, 180.0), 0.5 * duration_s)
        change_s = rng.uniform(0.1 * duration_s, 0.9 * duration_s - burst_s)
    sample = list(itertools.islice(mix_sample(seed, lengths, reuse), MIX_REQUESTS))
    sessions = sum(first_of_session for first_of_session, _, _ in sample)
    mix = [(n, p) for _, n, p in sample]
    rate, best = saturation(mix, profile, lattice)
    # r0 so that lambda's peak over the run is load x saturation: from light load
    # to 1.1 times the saturation at the busiest, never beyond.
    if shape in ("step", "ramp", "burst"):
        peak_factor = max(1.0, ratio)
    else:
        peak_factor, ratio = 1.0, 1.0
    base = load * rate / peak_factor
    return Scenario(
        seed=seed,
        duration_s=duration_s,
        shape=shape,
        base_rate=base,
        second_rate=base * ratio,
        change_s=change_s,
        burst_s=burst_s,
        load=load,
        saturation_rate=rate,
        saturation_composition=composition_name(best),
        session_requests=len(sample) / sessions,
        lengths=lengths,
        reuse=reuse,
        starts=(default, first, second),
    )


def scaled(scenario: Scenario, factor: float) -> Scenario:
    """The scenario on a timeline ``factor`` times as long (rates, gaps and the
    load kept): for quick runs."""
    if not factor > 0:
        raise ValueError(f"the duration scale must be > 0, got {factor}")
    return replace(
        scenario,
        duration_s=scenario.duration_s * factor,
        change_s=None if scenario.change_s is None else scenario.change_s * factor,
        burst_s=None if scenario.burst_s is None else scenario.burst_s * factor,
    )


def requests(scenario: Scenario) -> list[SimRequest]:
    """The scenario's requests in arrival order, ids 0.., phases per ``phase_at``."""
    arrivals = random.Random(f"arrivals:{scenario.seed}")
    sessions = family_sessions(
        scenario.seed, scenario.lengths, scenario.reuse, random.Random(f"content:{scenario.seed}")
    )
    peak = scenario.peak_rate / scenario.session_requests
    found: list[tuple[float, int, tuple[int, ...]]] = []
    t_s = -LEAD_S  # sessions under way at 0 (their earlier requests are not kept)
    while True:
        t_s += arrivals.expovariate(peak)
        if t_s >= scenario.duration_s:
            break
        if arrivals.random() * scenario.peak_rate >= scenario.rate_at(t_s):
            continue  # thinned
        found += [
            (t_s + offset_s, tokens, ids)
            for offset_s, tokens, ids in next(sessions)
            if 0.0 <= t_s + offset_s < scenario.duration_s
        ]
    found.sort(key=lambda r: r[0])  # stable: a session's requests keep their order
    return [
        SimRequest(i, t, tokens, ids, scenario.phase_at(t))
        for i, (t, tokens, ids) in enumerate(found)
    ]


def measure(scenario: Scenario, reqs: Sequence[SimRequest]) -> dict[str, float]:
    """What the requests realise: their rate and load, the token reuse of an
    unbounded cache, the share of long requests, the mean input length."""
    tokens = sum(r.input_tokens for r in reqs)
    rate = len(reqs) / scenario.duration_s
    return {
        "requests": len(reqs),
        "rate": rate,
        "load": rate / scenario.saturation_rate,
        "token_reuse": sum(unbounded_reuse(reqs)) / tokens if tokens else 0.0,
        "long_share": sum(r.input_tokens > LONG_TOKENS for r in reqs) / len(reqs) if reqs else 0.0,
        "mean_input_tokens": tokens / len(reqs) if reqs else 0.0,
    }
