"""Requests for the simulator: from traces, transformed, or generated in phases.

A ``SimRequest`` is an arrival time, an input length and the block ids of its whole
prefix (what the trie and the worker caches see). From a Mooncake trace the block
ids are its ``hash_ids`` shifted by one, since 0 is the trie's root, in 512-token
blocks. From an Azure trace there are none, so nothing is reused.

Transforms of a trace: ``rate_scale`` X multiplies the arrival rate (divides every
arrival time by X); ``time_scale`` S stretches the timeline (multiplies every
arrival time by S); ``max_requests`` keeps the first N. (For generated phases the
configuration scales each phase's rate and duration instead, so the phases keep
their length.)

Generators, all seeded:
  * ``phased``: a sequence of phases, each with a duration, an arrival rate (Poisson,
    or gamma with shape ``burstiness``) and a share of long requests. Requests come
    from a trace's pools of short and long requests, in trace order within each
    pool (conversations keep their turns in order), or from a log-normal length
    distribution when there is no trace.
  * shared-prefix groups (``prefix_groups`` > 0, generated lengths only): every
    request starts with the prefix of one of the groups, chosen with Zipf popularity
    (``prefix_zipf``; 0 is uniform), like the tool and system prompts of an agent
    workload.

Pure Python.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from vertumnus.traces import Trace


class WorkloadError(ValueError):
    """Workload settings that cannot be used."""


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    arrival_s: float
    input_tokens: int
    block_ids: tuple[int, ...] = ()
    phase: int = 0


def from_trace(trace: Trace) -> list[SimRequest]:
    out = []
    for i, r in enumerate(trace.requests):
        blocks = () if r.block_hashes is None else tuple(h + 1 for h in r.block_hashes)
        out.append(SimRequest(i, r.arrival_s, r.input_tokens, blocks))
    return out


def transform(
    requests: Sequence[SimRequest],
    rate_scale: float = 1.0,
    time_scale: float = 1.0,
    max_requests: int | None = None,
) -> list[SimRequest]:
    if not (rate_scale > 0 and time_scale > 0 and math.isfinite(rate_scale * time_scale)):
        raise WorkloadError("rate_scale and time_scale must be positive numbers")
    if max_requests is not None and max_requests < 1:
        raise WorkloadError("max_requests must be >= 1")
    factor = time_scale / rate_scale
    chosen = requests[:max_requests] if max_requests else requests
    return [replace(r, request_id=i, arrival_s=r.arrival_s * factor) for i, r in enumerate(chosen)]


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate: float  # requests per second
    long_fraction: float = 0.0  # share of requests from the long pool
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and self.rate > 0 and self.burstiness > 0):
            raise WorkloadError("a phase needs duration_s, rate and burstiness > 0")
        if not 0 <= self.long_fraction <= 1:
            raise WorkloadError("long_fraction must lie in [0, 1]")


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal input lengths for generated requests (no trace)."""

    short_median_tokens: int = 2_000
    long_median_tokens: int = 64_000
    sigma: float = 0.8
    max_tokens: int = 131_072
    block_tokens: int = 512
    prefix_groups: int = 0  # shared-prefix groups (0: none)
    prefix_tokens: int = 4_096  # length of each group's prefix
    prefix_zipf: float = 0.0  # popularity of group k ~ 1 / (k + 1) ** prefix_zipf


def phased(
    phases: Sequence[Phase],
    seed: int,
    long_tokens: int,
    pool: Sequence[SimRequest] | None = None,
    lengths: LengthDistribution | None = None,
) -> list[SimRequest]:
    """Arrivals phase by phase; requests from ``pool`` (a trace) or ``lengths``."""
    if not phases:
        raise WorkloadError("no phases")
    rng = random.Random(seed)
    short = [r for r in pool or () if r.input_tokens <= long_tokens]
    long = [r for r in pool or () if r.input_tokens > long_tokens]
    if pool is not None and (not short or not long):
        raise WorkloadError(f"the trace needs requests both under and over {long_tokens} tokens")
    dist = lengths or LengthDistribution()
    groups = [
        tuple(rng.getrandbits(62) | 1 << 62 for _ in range(dist.prefix_tokens // dist.block_tokens))
        for _ in range(dist.prefix_groups)
    ]
    popularity = list(
        itertools.accumulate(1.0 / (k + 1) ** dist.prefix_zipf for k in range(len(groups)))
    )
    next_short = next_long = 0
    out: list[SimRequest] = []
    start = 0.0
    for index, phase in enumerate(phases):
        t = start
        while True:
            t += rng.gammavariate(phase.burstiness, 1.0 / (phase.burstiness * phase.rate))
            if t >= start + phase.duration_s:
                break
            is_long = rng.random() < phase.long_fraction
            if pool is not None:
                if is_long:
                    src, passes = long[next_long % len(long)], next_long // len(long)
                    next_long += 1
                else:
                    src, passes = short[next_short % len(short)], next_short // len(short)
                    next_short += 1
                # A pool drawn again gets fresh block ids: a replay is not a reuse.
                ids = tuple(b + (passes << 40) for b in src.block_ids) if passes else src.block_ids
                out.append(SimRequest(len(out), t, src.input_tokens, ids, index))
                continue
            median = dist.long_median_tokens if is_long else dist.short_median_tokens
            n = int(min(dist.max_tokens, max(1, rng.lognormvariate(math.log(median), dist.sigma))))
            blocks: tuple[int, ...] = ()
            if groups:
                group = groups[rng.choices(range(len(groups)), cum_weights=popularity)[0]]
                blocks = group[: n // dist.block_tokens]
            own = n // dist.block_tokens - len(blocks)
            blocks += tuple(rng.getrandbits(62) | 1 << 62 for _ in range(max(0, own)))
            out.append(SimRequest(len(out), t, n, blocks, index))
        start += phase.duration_s
    return out
