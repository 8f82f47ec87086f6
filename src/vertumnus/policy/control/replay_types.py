"""The replay's input and result: the workers a candidate offers, a forecast prepared
for replaying, what a candidate's reshape changes in a replay (``ReplayMoves``), and
what a replay measured (see ``replay`` and ``replay_loop``).

Pure Python, plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Per request, uncalibrated and undilated: (input bucket, E per degree at its floor
# reuse, ((holder, E per degree at its reuse there), ...)). inf: cannot hold it.
Times = tuple[int, tuple[float, ...], tuple[tuple[int, tuple[float, ...]], ...]]


@dataclass(frozen=True, slots=True)
class ReplayWorker:
    worker_id: int
    cp_degree: int
    free_at_s: float  # relative to the replay's t = 0, in real (undilated) seconds


@dataclass(frozen=True, slots=True)
class ReplayResult:
    mean_ttft_s: float
    requests: int
    busy_s: float  # service time of the first cycle's requests, in real seconds
    span_s: float  # arrival span of the replayed requests (one cycle), real seconds
    # per cycle: the mean TTFT of its arrivals, and the backlog left at its end
    # (the work queued past it, summed over workers, real seconds)
    cycle_ttft_s: tuple[float, ...] = ()
    backlog_s: tuple[float, ...] = ()
    # the forecast cut into ``batches`` runs of consecutive arrivals: each run's
    # mean TTFT over every cycle (the paired comparison's sample)
    batch_ttft_s: tuple[float, ...] = ()
    # the last cycle's: its requests served, and each batch's mean TTFT in it
    last_requests: int = 0
    last_batch_ttft_s: tuple[float, ...] = ()


# (from when, in undilated seconds; the worker; the workers made of it, each with
# its free_at_s counted from the end of the worker's drain)
Retirement = tuple[float, int, tuple[ReplayWorker, ...]]


@dataclass(frozen=True)
class PreparedForecast:
    """Per request: offset, prefix key, input bucket, predicted E per degree (no
    reuse beyond the floor), holders with E at their reuse. E is the profile's,
    undilated and uncalibrated: the replay applies both."""

    offsets: tuple[float, ...]
    keys: tuple[int, ...]  # prefix keys (which split child inherits the prefix)
    buckets: tuple[int, ...]
    e_pred: tuple[tuple[float, ...], ...]  # [request][degree index]
    holders: tuple[tuple[tuple[int, tuple[float, ...]], ...], ...]
    dilation: float
    span_s: float
    # per degree index: the mean predicted E of a request at its best reuse (the
    # cost rule's backlog depth is a queue's work in these units)
    mean_e: tuple[float, ...] = ()


@dataclass(frozen=True)
class ReplayMoves:
    """What a candidate's reshape changes in a replay (``ReplayModel.run``): ``remap``
    (a holder that stands for the workers it maps to), ``lost`` (per remapped holder,
    the share of its prefixes left out of place), ``head`` (requests placed once at
    t = 0, before the forecast) and ``retire`` (workers that take no work from a
    time on, and their replacements)."""

    remap: Mapping[int, tuple[int, ...]] | None = None
    lost: Mapping[int, float] | None = None
    head: PreparedForecast | None = None
    retire: Sequence[Retirement] = ()
