"""The undisturbed audit's periods (docs/scheduling.md, "The what-if controller"):
each decision period the pool spent undisturbed (no reshape under way, every worker
serving) is replayed once all its requests ended, from the workers it started with,
and its measured mean TTFT compared with that prediction
(``calibration.Calibration.audit``).

This module keeps the periods: the arrivals of each (their samples as revised by
the reuse they found at their start), their answers, and which periods are done.
Pure Python, clock-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay_types import ReplayWorker


@dataclass
class Period:
    """One decision period, for the audit."""

    index: int
    start_s: float
    workers: tuple[ReplayWorker, ...]
    undisturbed: bool
    samples: dict[int, ArrivalSample] = field(default_factory=dict)  # by request, as revised
    ttft_s: dict[int, float] = field(default_factory=dict)

    def measured_s(self) -> float:
        return sum(self.ttft_s.values()) / len(self.ttft_s)


class Periods:
    """The open period and the closed ones waiting for their requests' answers."""

    def __init__(self, forget_after: int = 6) -> None:
        self.current: Period | None = None
        self._closed: dict[int, Period] = {}
        self._period_of: dict[int, int] = {}  # request -> the period it arrived in
        self._forget_after = forget_after  # periods: an answer later than that is lost

    @property
    def started(self) -> bool:
        return self.current is not None

    def arrived(self, sample: ArrivalSample) -> None:
        """A request placed in the open period (``start`` opened the first)."""
        assert self.current is not None, "the first period starts with the first arrival"
        self.current.samples[sample.request_id] = sample
        self._period_of[sample.request_id] = self.current.index

    def revised(self, sample: ArrivalSample) -> None:
        """The request's sample as its start revised it (the reuse it found)."""
        period = self._of(sample.request_id)
        if period is not None and sample.request_id in period.samples:
            period.samples[sample.request_id] = sample

    def completed(self, request_id: int, ttft_s: float) -> None:
        period = self._of(request_id)
        self._period_of.pop(request_id, None)
        if period is not None:
            period.ttft_s[request_id] = ttft_s

    def open(self, period: Period, still_undisturbed: bool) -> None:
        """The next period: the open one closes (disturbed if the pool was at its
        end: ``still_undisturbed`` false) and waits for its answers."""
        previous = self.current
        if previous is not None:
            previous.undisturbed = previous.undisturbed and still_undisturbed
            self._closed[previous.index] = previous
        self.current = period

    def done(self, window: int, cold_before_s: float | None) -> Period | None:
        """The latest closed period every request of which was answered, if it was
        undisturbed and not of the cold start (before ``cold_before_s``; ``None``:
        nothing arrived yet): one audit a decision. Every other answered period is
        dropped, and so is one still waiting ``forget_after`` periods on (requests
        abandoned or refused: no audit, nothing kept)."""
        answered = [i for i, p in sorted(self._closed.items()) if len(p.ttft_s) >= len(p.samples)]
        latest = None
        for index in answered:
            period = self._closed.pop(index)
            cold = cold_before_s is None or period.start_s < cold_before_s
            if index == answered[-1] and period.undisturbed and period.samples and not cold:
                latest = period
        for index in [i for i in self._closed if i < window - self._forget_after]:
            for request_id in self._closed.pop(index).samples:
                self._period_of.pop(request_id, None)
        return latest

    def _of(self, request_id: int) -> Period | None:
        index = self._period_of.get(request_id)
        if index is None:
            return None
        period = self._closed.get(index) or self.current
        return period if period is not None and period.index == index else None
