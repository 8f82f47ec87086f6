"""The what-if controller's forecast: the recent arrivals, as the next period's load.

Each request is sampled once, at its first placement: its arrival time, its length,
and where its prefix was reusable then (``holders``: worker -> reusable tokens, from
the trie's lookup). The forecast of the next period is the arrivals of the last
``horizon_s`` seconds, extended back until it holds ``min_requests`` (never past
``max_horizon_s``). When the rate changes significantly, the older arrivals no
longer describe what comes: a Poisson test compares the last ``recent_s`` seconds'
count n with the count e expected from the rate before, and fires when

    |n - e| > change_sigma * sqrt(e)   and   |n - e| > change_fraction * e

(4 sigma and 30 % by default); then everything before those ``recent_s`` seconds is
dropped, for this forecast and the following ones.

Pure Python, clock-free: the time is an argument. Not owned here: replaying the
forecast (``replay``), the decision (``whatif``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# A holder that stands for every worker (a representative workload whose reuse is
# known only as "cached somewhere": the start choice).
ANY_WORKER = -1


@dataclass(frozen=True, slots=True)
class ArrivalSample:
    request_id: int
    arrival_s: float
    input_tokens: int
    holders: tuple[tuple[int, int], ...]  # (worker id, reusable tokens > 0) at arrival
    # The id of the last block of its longest reusable prefix (0: none): which child
    # of a split inherits that prefix, the same in every driver.
    prefix_key: int = 0


@dataclass(frozen=True)
class ForecastConfig:
    horizon_s: float = 30.0
    min_requests: int = 400
    max_horizon_s: float = 90.0
    recent_s: float = 10.0  # the span the rate-change test looks at
    change_sigma: float = 4.0
    change_fraction: float = 0.30

    def __post_init__(self) -> None:
        if not 0 < self.recent_s <= self.horizon_s <= self.max_horizon_s:
            raise ValueError("need 0 < recent_s <= horizon_s <= max_horizon_s")
        if self.min_requests < 1 or self.change_sigma <= 0 or self.change_fraction < 0:
            raise ValueError("need min_requests >= 1, change_sigma > 0, change_fraction >= 0")


@dataclass(frozen=True)
class ForecastWindow:
    samples: tuple[ArrivalSample, ...]
    start_s: float
    end_s: float
    rate_changed: bool  # the test fired now (older arrivals were just dropped)

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def rate(self) -> float:
        return len(self.samples) / self.span_s if self.span_s > 0 else 0.0


class Forecast:
    def __init__(self, config: ForecastConfig | None = None) -> None:
        self.config = config or ForecastConfig()
        self._samples: deque[ArrivalSample] = deque()
        self._floor_s = -math.inf  # arrivals before this are out (a rate change)
        self.first_arrival_s: float | None = None
        self.by_id: dict[int, ArrivalSample] = {}

    def __len__(self) -> int:
        return len(self._samples)

    def record(self, sample: ArrivalSample) -> None:
        if self.first_arrival_s is None:
            self.first_arrival_s = sample.arrival_s
        self._samples.append(sample)
        self.by_id[sample.request_id] = sample

    def _trim(self, now: float) -> None:
        keep_from = max(now - self.config.max_horizon_s, self._floor_s)
        samples = self._samples
        while samples and samples[0].arrival_s < keep_from:
            gone = samples.popleft()
            self.by_id.pop(gone.request_id, None)

    def window(self, now: float) -> ForecastWindow:
        """The forecast at ``now`` (applies the rate-change test)."""
        cfg = self.config
        self._trim(now)
        samples = self._samples
        origin = self.first_arrival_s if self.first_arrival_s is not None else now
        changed = self._rate_changed(now, origin)
        if changed:
            self._floor_s = now - cfg.recent_s
            self._trim(now)
        start = max(now - cfg.horizon_s, self._floor_s, min(origin, now))
        n_in = sum(1 for _ in _since(samples, start))
        if n_in < cfg.min_requests and len(samples) > n_in:
            # Extend back to min_requests (the deque holds max_horizon_s at most).
            k = min(len(samples), cfg.min_requests)
            start = min(start, samples[len(samples) - k].arrival_s)
        chosen = tuple(_since(samples, start))
        return ForecastWindow(chosen, start, now, changed)

    def _rate_changed(self, now: float, origin: float) -> bool:
        cfg = self.config
        recent_from = now - cfg.recent_s
        older_from = max(self._floor_s, origin, now - cfg.max_horizon_s)
        older_span = recent_from - older_from
        if older_span < cfg.recent_s:  # too little history to compare with
            return False
        n_recent = n_older = 0
        for s in self._samples:
            if s.arrival_s >= recent_from:
                n_recent += 1
            elif s.arrival_s >= older_from:
                n_older += 1
        expected = n_older * cfg.recent_s / older_span
        gap = abs(n_recent - expected)
        return gap > cfg.change_sigma * math.sqrt(max(expected, 1.0)) and (
            gap > cfg.change_fraction * expected
        )


def _since(samples: deque[ArrivalSample], start_s: float) -> list[ArrivalSample]:
    out: list[ArrivalSample] = []
    for s in reversed(samples):
        if s.arrival_s < start_s:
            break
        out.append(s)
    out.reverse()
    return out
