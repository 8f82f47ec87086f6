"""The starting composition: a representative workload replayed over the lattice, and
the record of the composition a pool had (what ``[pool] state_file`` holds).

A representative workload is a list of ``ArrivalSample`` whose ``floor_tokens`` is
the prefix reusable at every worker: what an earlier request of the same sample
had cached (as if anywhere in the pool: a cold pool knows no more).
``control.candidates.best_start`` replays it from empty queues over every composition
the lattice allows and keeps the fastest. Two ways to make one live here:
``mix_samples`` (Poisson arrivals with lengths drawn from a length mix) and
``trace_samples`` (the leading span of a trace's requests). Which workload a pool
starts from, the files it comes from and the state file on disk are
``config/start.py``'s. Pure Python.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vertumnus.perfmodel import Profile
from vertumnus.policy.control.candidates import StartChoice, best_start
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay import ReplayModel
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.geometry import LatticeConfig, LatticeError, composition_name
from vertumnus.policy.lattice import Lattice
from vertumnus.policy.pool_config import PolicyConfig


def mix_samples(
    mix: Sequence[tuple[int, int]], rate_per_s: float, span_s: float, seed: int
) -> list[ArrivalSample]:
    """Poisson arrivals at ``rate_per_s`` over ``span_s`` seconds, each request drawn
    from ``mix`` ((input tokens, cached tokens) pairs; the cached tokens its floor)."""
    if not (rate_per_s > 0 and span_s > 0):
        raise ValueError("mix samples need a rate and a span > 0")
    rng = random.Random(seed)
    out: list[ArrivalSample] = []
    t = rng.expovariate(rate_per_s)
    while t <= span_s:
        n_in, n_cached = mix[rng.randrange(len(mix))]
        out.append(ArrivalSample(len(out), t, n_in, floor_tokens=n_cached))
        t += rng.expovariate(rate_per_s)
    return out


def trace_samples(
    requests: Iterable[tuple[float, int, int]], rate_scale: float, span_s: float
) -> list[ArrivalSample]:
    """The requests (arrival in seconds from the first, input tokens, cached tokens
    when it arrives) whose arrival, divided by ``rate_scale``, falls in the first
    ``span_s`` seconds."""
    out: list[ArrivalSample] = []
    origin: float | None = None
    for arrival_s, n_in, n_cached in requests:
        origin = arrival_s if origin is None else origin
        t = (arrival_s - origin) / rate_scale
        if t > span_s:
            break
        out.append(ArrivalSample(len(out), t, n_in, floor_tokens=n_cached))
    return out


def replay_start(
    lattice: LatticeConfig,
    profile: Profile,
    policy: PolicyConfig,
    samples: Sequence[ArrivalSample],
) -> StartChoice:
    """``best_start`` on ``samples`` with the profile's curves and the policy's
    weights: the composition of least predicted mean TTFT, and every composition's."""
    curves = reuse_curves({c: profile.coeffs[c] for c in lattice.degrees})
    model = ReplayModel(
        curves, lattice.degrees, policy.weights, max_tokens_per_rank=policy.max_tokens_per_rank
    )
    return best_start(lattice, model, samples)


@dataclass(frozen=True)
class PoolState:
    """The composition a pool had: what ``[pool] state_file`` holds, as JSON."""

    composition: str  # "4CP4/3CP8"
    layout: tuple[int, ...]  # worker degrees in device order
    degrees: tuple[int, ...]
    ranks: int
    written_at: str  # ISO 8601, UTC

    @classmethod
    def of(cls, config: LatticeConfig, layout: Sequence[int], written_at: str) -> PoolState:
        counts: dict[int, int] = {}
        for c in layout:
            counts[c] = counts.get(c, 0) + 1
        return cls(
            composition_name(counts),
            tuple(layout),
            tuple(config.degrees),
            config.num_devices,
            written_at,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "composition": self.composition,
            "layout": list(self.layout),
            "degrees": list(self.degrees),
            "ranks": self.ranks,
            "written_at": self.written_at,
        }

    @classmethod
    def from_json(cls, data: object) -> PoolState:
        """ValueError when ``data`` is not a state record."""
        if not isinstance(data, Mapping):
            raise ValueError("not a JSON object")
        try:
            layout = tuple(_ints(data["layout"]))
            degrees = tuple(_ints(data["degrees"]))
            ranks = data["ranks"]
            composition, written_at = str(data["composition"]), str(data["written_at"])
        except KeyError as exc:
            raise ValueError(f"no {exc.args[0]!r}") from None
        if not isinstance(ranks, int) or isinstance(ranks, bool):
            raise ValueError(f"ranks must be an integer, got {ranks!r}")
        return cls(composition, layout, degrees, ranks, written_at)

    def mismatch(self, config: LatticeConfig) -> str | None:
        """Why this state cannot start a pool of ``config`` (None: it can)."""
        if self.ranks != config.num_devices or self.degrees != tuple(config.degrees):
            return (
                f"it is of {self.ranks} ranks at degrees {list(self.degrees)}, the pool of "
                f"{config.num_devices} at {list(config.degrees)}"
            )
        try:
            Lattice(config, list(self.layout))
        except LatticeError as exc:
            return f"its layout {list(self.layout)} does not fit the lattice: {exc}"
        if not config.within_bounds(Counter(self.layout)):
            return f"its composition {self.composition} is outside [pool] min/max_workers"
        return None


def _ints(value: object) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"expected a list of integers, got {value!r}")
    return value
