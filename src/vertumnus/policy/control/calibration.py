"""Online calibration of the what-if controller's service-time model, and its audit.

Per degree C and input-length bucket b (``replay.BUCKET_EDGES``), the scale

    s[C, b] = sum of measured service / sum of predicted E_C      (both decayed)

from the prefills that ended: measured from the ranks' own compute time where the
driver has it, else the time the worker was busy. Below ``min_samples`` a bucket
borrows its degree's pooled scale. A degree's first few samples (under
``min_samples``) weigh as many parts in ``min_samples`` against every degree's
pooled. A degree with none yet is no faster, against its profile, than the smaller
degrees measured (their samples pooled; never under 1), or stays at 1 where none
is. A profile is off on a new machine by much the same factor at every degree: a
larger degree nobody ran yet, left at 1 beside measured ones at 2, would look twice
as fast as it is, and a merge would go to it for that alone (and split back once
measured). A smaller one keeps its profile: a split is the remedy to overload, and
where the profile is off at the larger degree alone (its communication), borrowing
would leave the pool stuck in too large a start. Scales are clamped to [1/4, 4].
``overhead_s`` is the serving path's own time per prefill
(busy time minus the ranks' compute), a decayed mean. ``switch_s`` is the measured
time of a reshape's switch (commit to every rank's acknowledgement), with a prior.

The audit compares each undisturbed period's measured mean TTFT with a replay of
its own arrivals; ``error`` is the mean relative error of the last ``audits`` of
them, by which the decision margins widen; ``bias`` is their signed mean (measured
over predicted, minus one), which the audit of a move takes out of its error.

Pure Python. Not owned here: the replay (``replay``), the decision (``whatif``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from vertumnus.policy.control.replay import BUCKET_EDGES, bucket_of


class Calibration:
    def __init__(
        self,
        degrees: Sequence[int],
        decay: float = 0.995,
        min_samples: float = 20.0,
        switch_prior_s: float = 1.0,
        audits: int = 6,
    ) -> None:
        nb = len(BUCKET_EDGES) + 1
        self.degrees = tuple(sorted(degrees))
        self.decay = decay
        self.min_samples = min_samples
        # per degree and bucket: [decayed count, measured sum, predicted sum]
        self._sums = {c: [[0.0, 0.0, 0.0] for _ in range(nb)] for c in self.degrees}
        self._overhead = [0.0, 0.0]  # decayed count, sum
        self.switch_s = switch_prior_s
        self._switches = 0
        self._errors: deque[float] = deque(maxlen=audits)
        self._signed: deque[float] = deque(maxlen=audits)  # measured / predicted - 1
        self.audit_log: list[dict[str, float]] = []

    # -- inputs ----------------------------------------------------------------------

    def prefill(
        self, cp_degree: int, input_tokens: int, predicted_s: float, measured_s: float
    ) -> None:
        """One prefill: its predicted E and its measured compute time."""
        if cp_degree not in self._sums or predicted_s <= 0 or measured_s <= 0:
            return
        entry = self._sums[cp_degree][bucket_of(input_tokens)]
        d = self.decay
        entry[0] = entry[0] * d + 1.0
        entry[1] = entry[1] * d + measured_s
        entry[2] = entry[2] * d + predicted_s

    def path_overhead(self, seconds: float) -> None:
        """The serving path's own time around one prefill's compute."""
        d = self.decay
        self._overhead[0] = self._overhead[0] * d + 1.0
        # (under a nanosecond is clock arithmetic, not time spent)
        self._overhead[1] = self._overhead[1] * d + (seconds if seconds > 1e-9 else 0.0)

    def switch(self, seconds: float) -> None:
        """A reshape's switch took ``seconds``: a running mean over the first few, then
        a decayed one."""
        self._switches += 1
        weight = max(1.0 / self._switches, 0.2)
        self.switch_s += weight * (seconds - self.switch_s)

    def audit(self, period: int, predicted_s: float, measured_s: float) -> None:
        if measured_s <= 0:
            return
        error = abs(predicted_s - measured_s) / measured_s
        self._errors.append(error)
        if predicted_s > 0:
            self._signed.append(measured_s / predicted_s - 1.0)
        self.audit_log.append(
            {"period": period, "predicted_s": predicted_s, "measured_s": measured_s}
        )
        del self.audit_log[:-100]

    # -- outputs ---------------------------------------------------------------------

    @property
    def error(self) -> float:
        return sum(self._errors) / len(self._errors) if self._errors else 0.0

    @property
    def bias(self) -> float:
        """The model's signed error on undisturbed periods (> 0: slower than predicted)."""
        return sum(self._signed) / len(self._signed) if self._signed else 0.0

    @property
    def overhead_s(self) -> float:
        n, total = self._overhead
        return total / n if n > 0 else 0.0

    def scales(self) -> dict[int, tuple[float, ...]]:
        out: dict[int, tuple[float, ...]] = {}
        every = [e for buckets in self._sums.values() for e in buckets]
        pool = 1.0
        if sum(e[0] for e in every) >= self.min_samples:
            pool = _ratio(sum(e[1] for e in every), sum(e[2] for e in every))
        for c, buckets in self._sums.items():
            n = sum(e[0] for e in buckets)
            pooled = _ratio(sum(e[1] for e in buckets), sum(e[2] for e in buckets))
            if n <= 0:
                pooled = self._unmeasured(c)
            elif n < self.min_samples:  # (its first few, weighed against the pool's)
                pooled = pool + n / self.min_samples * (pooled - pool)
            out[c] = tuple(
                _ratio(e[1], e[2]) if e[0] >= self.min_samples else pooled for e in buckets
            )
        return out

    def _unmeasured(self, degree: int) -> float:
        """The scale of a degree with no samples yet: no faster, against its
        profile, than the smaller degrees measured (their samples pooled), and
        never faster than the profile; 1 where no smaller degree is measured."""
        smaller = [e for c, buckets in self._sums.items() if c < degree for e in buckets]
        if sum(e[0] for e in smaller) < self.min_samples:
            return 1.0
        return max(1.0, _ratio(sum(e[1] for e in smaller), sum(e[2] for e in smaller)))

    def to_json(self) -> Mapping[str, object]:
        return {
            "scale": {str(c): [round(x, 4) for x in s] for c, s in self.scales().items()},
            "overhead_s": self.overhead_s,
            "switch_s": self.switch_s,
            "audit_error": self.error,
            "audit_bias": self.bias,
        }


def _ratio(measured: float, predicted: float) -> float:
    if predicted <= 0:
        return 1.0
    return min(4.0, max(0.25, measured / predicted))
