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
dropped, for this forecast and the following ones. The long window is every arrival
since then, at most ``long_s`` old: the longest sample of the load as it is, against
which a move's steady gain is checked (a few minutes hold a mix's rare long prompts
in their proportion; the last ``horizon_s`` may hold a burst of them or none).

Pure Python, clock-free: the time is an argument. Not owned here: replaying the
forecast (``replay``), the decision (``whatif``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

# Strata of the samples by their draw (stratum j: draw < 2^-(j+1)): down to 1/4096.
STRATA = 12


def _levels(draw: float) -> int:
    """How many strata a sample of this draw is in."""
    j = 0
    while j < STRATA and draw < 0.5 ** (j + 1):
        j += 1
    return j


# Dropped samples freed per window at most (``record`` frees two a record, and
# keeps up): a 1,024-GPU pool's long window holds about 270,000 samples, and
# freeing them at once, as a rate change drops them, held a server's event loop
# 0.1-0.2 s.
FREE_STEP = 256

# The holders a sample keeps (the longest reuse first): a prefix cached on many
# workers is reusable nearly anywhere, and the replay's cost grows with holders.
MAX_HOLDERS = 4


@dataclass(frozen=True, slots=True)
class ArrivalSample:
    request_id: int
    arrival_s: float
    input_tokens: int
    # (worker id, reusable tokens > floor_tokens) at arrival, longest first
    holders: tuple[tuple[int, int], ...] = ()
    # The id of the last block of its longest reusable prefix (0: none): which child
    # of a split inherits that prefix, the same in every driver.
    prefix_key: int = 0
    floor_tokens: int = 0  # reusable at every worker (a prefix every worker holds)
    matched_tokens: int = 0  # its prefix cached anywhere in the pool (the trie's match)
    # A fixed pseudo-random draw in [0, 1) (the replay thins by it)
    draw: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        # From what both drivers see alike: length, prefix and the arrival millisecond.
        mix = self.prefix_key ^ round(self.arrival_s * 1000.0)
        object.__setattr__(self, "draw", unit(self.input_tokens, mix))


def make_sample(
    request_id: int,
    arrival_s: float,
    input_tokens: int,
    reusable: Sequence[tuple[int, int]],
    num_workers: int,
    prefix_key: int,
    matched_tokens: int = 0,
) -> ArrivalSample:
    """A sample from the trie's lookup: ``reusable`` (worker, tokens > 0) over the
    ``num_workers`` serving workers. What all of them hold becomes the floor; the
    ``MAX_HOLDERS`` longest of the rest are kept."""
    floor = min(p for _, p in reusable) if reusable and len(reusable) >= num_workers else 0
    above = sorted(((w, p) for w, p in reusable if p > floor), key=lambda h: (-h[1], h[0]))
    return ArrivalSample(
        request_id,
        arrival_s,
        input_tokens,
        tuple(above[:MAX_HOLDERS]),
        prefix_key,
        floor,
        max(floor, matched_tokens),
    )


def unit(a: int, b: int) -> float:
    """A fixed pseudo-random number in [0, 1) per pair of integers (splitmix64)."""
    x = (a * 0x9E3779B97F4A7C15 + b) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    return x / 2.0**64


# What a forgotten sample's place holds until the head is compacted.
_GONE = ArrivalSample(-1, 0.0, 0)


@dataclass(frozen=True)
class ForecastConfig:
    horizon_s: float = 30.0
    min_requests: int = 400
    max_horizon_s: float = 90.0
    recent_s: float = 10.0  # the span the rate-change test looks at
    change_sigma: float = 4.0
    change_fraction: float = 0.30
    long_s: float = 0.0  # ``long_window``'s span (at least max_horizon_s)

    def __post_init__(self) -> None:
        if not 0 < self.recent_s <= self.horizon_s <= self.max_horizon_s:
            raise ValueError("need 0 < recent_s <= horizon_s <= max_horizon_s")
        object.__setattr__(self, "long_s", max(self.long_s, self.max_horizon_s))
        if self.min_requests < 1 or self.change_sigma <= 0 or self.change_fraction < 0:
            raise ValueError("need min_requests >= 1, change_sigma > 0, change_fraction >= 0")


@dataclass(frozen=True)
class ForecastWindow:
    """The arrivals from ``start_s`` on: a view of the forecast (read it before the
    forecast records or trims again)."""

    start_s: float
    end_s: float
    rate_changed: bool  # the test fired now (older arrivals were just dropped)
    count: int
    forecast: Forecast | None = field(default=None, repr=False, compare=False)
    first: int = 0  # the forecast's sequence number of the first sample

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def rate(self) -> float:
        return self.count / self.span_s if self.span_s > 0 else 0.0

    @property
    def samples(self) -> tuple[ArrivalSample, ...]:
        return tuple(self.thinned(1.0))

    def thinned(self, keep: float) -> list[ArrivalSample]:
        """The samples whose ``draw`` is under ``keep`` (all of them at 1), in order:
        what a replay thinned by a dilation of 1 / keep takes, read from the
        forecast's strata at about twice its size, whatever the window's."""
        return self.forecast.thinned(self.first, keep) if self.forecast is not None else []


class Forecast:
    """The samples in arrival order, indexed by a running maximum of their arrival
    times (a request placed late, after waiting, keeps its place in that order), so
    the window and the rate test are two binary searches.

    Each sample has a sequence number (its place among all ever recorded); stratum
    j lists those of the samples whose draw is under 2^-(j+1), so that a thinned
    window (a replay of 1,500 of the 270,000 arrivals of five minutes at 1,024
    GPUs) reads a stratum at most twice its size instead of every sample."""

    def __init__(
        self, config: ForecastConfig | None = None, forget: Callable[[int], object] | None = None
    ) -> None:
        """``forget``: called with each request id the forecast forgets (a cache
        keyed by request id follows it)."""
        self.config = config or ForecastConfig()
        self._forget = forget
        self._samples: list[ArrivalSample] = []
        self._keys: list[float] = []  # running maximum of the arrival times
        self._head = 0  # samples before it are trimmed
        self._base = 0  # the sequence number of _samples[0]
        self._strata: list[list[int]] = [[] for _ in range(STRATA)]
        self._floor_s = -math.inf  # arrivals before this are out (a rate change)
        self._hidden = 0  # the sequence number of the first sample kept (in by_id)
        self.first_arrival_s: float | None = None
        self.changes = 0  # the rate changes the test has seen
        # the samples kept, by request id (read it through the forecast: a trim that
        # drops most of them replaces it)
        self.by_id: dict[int, ArrivalSample] = {}

    def __len__(self) -> int:
        return len(self._samples) + self._base - self._hidden

    def record(self, sample: ArrivalSample) -> None:
        if self.first_arrival_s is None:
            self.first_arrival_s = sample.arrival_s
        key = max(sample.arrival_s, self._keys[-1]) if self._keys else sample.arrival_s
        seq = self._base + len(self._samples)
        self._samples.append(sample)
        self._keys.append(key)
        self.by_id[sample.request_id] = sample
        for stratum in self._strata[: _levels(sample.draw)]:
            stratum.append(seq)
        # Free as it records, two at most a record, what the windows dropped: no
        # decision pays for a window's worth at once (at 1,024 GPUs 9,000 samples
        # every 10 s, 1-2 us each, and 270,000 when the rate changes).
        self._free(2)

    def revise(self, request_id: int, worker_id: int, reused_tokens: int, key: int) -> bool:
        """A request started reusing more at its worker than its sample holds (a
        prefix computed while it waited: its predecessor's): the sample takes that
        reuse there, as the replay of what comes next should. False: unchanged."""
        old = self.by_id.get(request_id)
        held = dict(old.holders) if old is not None else {}
        if old is None or reused_tokens <= max(old.floor_tokens, held.get(worker_id, 0)):
            return False
        held[worker_id] = reused_tokens
        above = sorted(held.items(), key=lambda h: (-h[1], h[0]))[:MAX_HOLDERS]
        new = replace(old, holders=tuple(above), prefix_key=key,
                      matched_tokens=max(old.matched_tokens, reused_tokens))  # fmt: skip
        at = bisect.bisect_left(self._keys, old.arrival_s, lo=self._head)
        for k in range(at, min(at + 256, len(self._samples))):
            if self._samples[k] is old:
                self._samples[k] = new
                self.by_id[request_id] = new
                # (its draw follows its prefix key: it may change strata)
                seq, was, now = self._base + k, _levels(old.draw), _levels(new.draw)
                for stratum in self._strata[now:was]:
                    del stratum[bisect.bisect_left(stratum, seq)]
                for stratum in self._strata[was:now]:
                    bisect.insort(stratum, seq)
                return True
        return False

    def thinned(self, first: int, keep: float) -> list[ArrivalSample]:
        """The samples from sequence number ``first`` on whose draw is under ``keep``."""
        samples, base = self._samples, self._base
        first = max(first, base + self._head)
        if keep >= 1.0:
            return samples[first - base :]
        j = 0  # the sparsest stratum that holds every draw under keep
        while j < STRATA and keep <= 0.5 ** (j + 1):
            j += 1
        if j == 0:
            return [s for s in samples[first - base :] if s.draw < keep]
        stratum = self._strata[j - 1]
        at = bisect.bisect_left(stratum, first)
        return [x for q in stratum[at:] if (x := samples[q - base]).draw < keep]

    def _index(self, t: float) -> int:
        return bisect.bisect_left(self._keys, t, lo=self._head)

    def _trim(self, now: float) -> None:
        """Drop what no window reads: the samples older than the long window, and
        those before a rate change's floor. They leave ``by_id`` at once; their
        memory is freed later, two a ``record`` and ``FREE_STEP`` here
        at most (every window starts after them meanwhile). Compacting the head
        moves references only."""
        hide = self._index(max(now - self.config.long_s, self._floor_s))
        hidden = self._hidden - self._base
        if hide > hidden:
            samples = self._samples
            if hide - hidden > len(samples) - hide:
                # (most of it goes, as at a rate change: the rest is the new index,
                # where popping 270,000 took 20-30 ms)
                self.by_id = {s.request_id: s for s in samples[hide:]}
            else:
                by_id = self.by_id
                for gone in samples[hidden:hide]:
                    by_id.pop(gone.request_id, None)
            self._hidden = self._base + hide
        self._free(FREE_STEP)
        if self._head > 4096 and self._head * 2 > len(self._samples):
            del self._samples[: self._head], self._keys[: self._head]
            self._base += self._head
            self._head = 0
            for stratum in self._strata:
                del stratum[: bisect.bisect_left(stratum, self._base)]

    def _free(self, most: int) -> None:
        """Free up to ``most`` of the dropped samples, oldest first (their places
        hold ``_GONE``, their keys the last one's, until compaction; ``forget`` is
        told)."""
        head, forget = self._head, self._forget
        cut = min(self._hidden - self._base, head + most)
        if cut <= head:
            return
        samples, keys = self._samples, self._keys
        last = keys[cut - 1]
        for k in range(head, cut):
            if forget is not None:
                forget(samples[k].request_id)
            samples[k] = _GONE
            keys[k] = last
        self._head = cut

    def window(self, now: float) -> ForecastWindow:
        """The forecast at ``now`` (applies the rate-change test)."""
        cfg = self.config
        self._trim(now)
        origin = self.first_arrival_s if self.first_arrival_s is not None else now
        changed = self._rate_changed(now, origin)
        if changed:
            self.changes += 1
            self._floor_s = now - cfg.recent_s
            self._trim(now)
        start = max(now - cfg.horizon_s, self._floor_s, min(origin, now))
        first = self._index(start)
        if len(self._samples) - first < cfg.min_requests:
            # Extend back to min_requests, never past max_horizon_s.
            oldest = self._index(max(now - cfg.max_horizon_s, self._floor_s))
            first = max(oldest, len(self._samples) - cfg.min_requests)
            if first < len(self._samples):
                start = min(start, self._keys[first])
        return self._view(first, start, now, changed)

    def long_window(self, now: float, not_before_s: float = -math.inf) -> ForecastWindow:
        """Every arrival since the last rate change and ``not_before_s``, at most
        ``long_s`` old: the longest sample of the load as it is (call after
        ``window``, which applies the rate-change test)."""
        origin = self.first_arrival_s if self.first_arrival_s is not None else now
        start = max(now - self.config.long_s, self._floor_s, min(origin, now), not_before_s)
        first = self._index(start)
        return self._view(first, start, now, False)

    def _view(self, first: int, start: float, now: float, changed: bool) -> ForecastWindow:
        count = len(self._samples) - first
        return ForecastWindow(start, now, changed, count, self, self._base + first)

    def _rate_changed(self, now: float, origin: float) -> bool:
        cfg = self.config
        recent_from = now - cfg.recent_s
        older_from = max(self._floor_s, origin, now - cfg.max_horizon_s)
        older_span = recent_from - older_from
        if older_span < cfg.recent_s:  # too little history to compare with
            return False
        recent = self._index(recent_from)
        n_recent = len(self._samples) - recent
        n_older = recent - self._index(older_from)
        expected = n_older * cfg.recent_s / older_span
        gap = abs(n_recent - expected)
        return gap > cfg.change_sigma * math.sqrt(max(expected, 1.0)) and (
            gap > cfg.change_fraction * expected
        )
