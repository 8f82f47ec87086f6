"""The pool over time, as the dashboard and a simulation's report draw it.

One sample per period (``period_s``): the composition (active workers per degree,
and how many are draining, switching or out); over the trailing ``window_s``, the
arrival rate, the TTFT percentiles and token-weighted SLO attainment of the
requests answered (with the median SLO ``tau`` they were held to) and the token
hit rate; and at the sample's time, the queues and the predicted work
outstanding, the KV copies in flight and the replications and reclamations so far.
One event per reshape begun: its kind, the rule that fired, its inputs and, from the
what-if controller, the candidates it weighed; and one per audit of a move that a
decision closed (kind ``audit``: predicted, measured and holding's counterfactual).
Samples and events sit in bounded rings (``capacity``, ``max_events``; None:
unbounded, for a simulation's whole run); ``since(t)`` answers what came after
``t``, which is what a page that polls asks for.

Pure: both drivers feed the same object in the same way, the coordinator (its
request path, its decisions, and a sampler every period) and the simulator (its
events), so the server's live page and a run's ``report.html`` show the same series.
The drivers pass their own clock; a sample's or event's ``t`` is seconds after
``origin_s`` (the server's start, or the simulation's t = 0).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vertumnus.policy.lattice import WorkerState

if TYPE_CHECKING:
    from vertumnus.policy.pool_policy import PoolPolicy

MAX_CANDIDATES = 8  # of a what-if decision, kept in its event


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data: mappings (string keys), lists, str, int, float, bool
    and None; tuples and sets become lists, dataclasses mappings, enums their value,
    numpy scalars Python numbers, anything else its ``str``."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((plain(v) for v in value), key=repr)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        return plain(item())
    return str(value)


def _quantile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (as ``stats.percentile``)."""
    if not sorted_values:
        return None
    at = q * (len(sorted_values) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (at - lo)


def _r(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def trailing_window_s(controller_period_s: float, period_s: float) -> float:
    """The window both drivers give a timeline: what the controller sees in one
    decision, and at least five samples."""
    return max(controller_period_s, 5 * period_s)


def worker_rows(policy: PoolPolicy, now: float) -> list[dict[str, Any]]:
    """Per worker, by first device: degree, state, epoch, ranks, hosts, queue,
    running request, predicted work outstanding, cached blocks."""
    scheduler, lattice = policy.scheduler, policy.lattice
    rows = []
    for w in sorted(lattice.workers.values(), key=lambda w: w.first_device):
        index = policy.indexes.get(w.worker_id)
        rows.append(
            {
                "worker": w.worker_id,
                "cp_degree": w.cp_degree,
                "ranks": list(w.devices),
                "hosts": list(w.hosts(lattice.config)),
                "state": str(w.state),
                "epoch": w.epoch,
                "queued": len(scheduler.queued(w.worker_id)),
                "running": scheduler.running(w.worker_id),
                "outstanding_s": scheduler.outstanding_s(w.worker_id, now),
                "cached_blocks": len(index) if index is not None else 0,
            }
        )
    return rows


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    t: float
    ttft_s: float
    tau_s: float
    tokens: int
    cached_tokens: int


class Timeline:
    def __init__(
        self,
        period_s: float = 1.0,
        capacity: int | None = 3600,
        max_events: int | None = 1000,
        origin_s: float = 0.0,
        window_s: float = 30.0,
    ) -> None:
        """``window_s``: the trailing window of a sample's rate, TTFT percentiles,
        attainment and hit rate (at least one period)."""
        if not period_s > 0:
            raise ValueError(f"a timeline's period must be > 0 s, not {period_s}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"a timeline keeps at least one sample, not {capacity}")
        self.period_s = period_s
        self.window_s = max(window_s, period_s)
        self.capacity = capacity
        self.samples: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.origin_s = origin_s
        self.next_s = origin_s + period_s
        self._arrivals: deque[float] = deque()  # within the window
        self._answers: deque[_Answer] = deque()  # within the window
        self._period_arrivals = self._period_answers = 0

    # -- what the drivers report ---------------------------------------------------------

    def arrived(self, now: float) -> None:
        self._arrivals.append(now)
        self._period_arrivals += 1

    def finished(
        self, now: float, ttft_s: float, tau_s: float, input_tokens: int, cached_tokens: int
    ) -> None:
        """A request's first token reached its client ``ttft_s`` after it arrived; it
        was held to ``tau_s`` (token-weighted: ``input_tokens``)."""
        self._answers.append(_Answer(now, ttft_s, tau_s, input_tokens, cached_tokens))
        self._period_answers += 1

    def reshaped(self, now: float, kind: str, decision: Mapping[str, Any]) -> None:
        """A reshape began, on ``decision`` (``Decision.to_json()``)."""
        inputs = {k: v for k, v in decision.items() if k not in ("ops", "candidates", "window")}
        event: dict[str, Any] = {
            "t": round(now - self.origin_s, 3),
            "kind": kind,
            "rule": str(decision.get("rule", "")),
            "ops": plain(decision.get("ops", [])),
            "inputs": plain(inputs),
        }
        candidates = decision.get("candidates")
        if isinstance(candidates, list | tuple):
            event["candidates"] = plain(list(candidates[:MAX_CANDIDATES]))
        self.events.append(event)

    def decided(self, now: float, inputs: Mapping[str, Any]) -> None:
        """A decision was made (``Decision.inputs``): the move audits it closed."""
        for audit in inputs.get("move_audits", ()):
            self.events.append(
                {
                    "t": round(now - self.origin_s, 3),
                    "kind": "audit",
                    "rule": f"audit of {audit.get('move', 'a move')}",
                    "ops": [],
                    "inputs": plain(audit),
                }
            )

    def sample(self, now: float, policy: PoolPolicy) -> dict[str, Any]:
        """Close the period at ``now``: its sample, read from the policy (nothing in
        the policy changes). Rate, TTFT, attainment and hit rate are over the
        trailing ``window_s``."""
        since = now - self.window_s
        while self._arrivals and self._arrivals[0] <= since:
            self._arrivals.popleft()
        while self._answers and self._answers[0].t <= since:
            self._answers.popleft()
        answers = self._answers
        ttfts = sorted(a.ttft_s for a in answers)
        taus = sorted(a.tau_s for a in answers if math.isfinite(a.tau_s))
        tokens = sum(a.tokens for a in answers)
        met = sum(a.tokens for a in answers if a.ttft_s <= a.tau_s)
        cached = sum(a.cached_tokens for a in answers)
        span = max(min(self.window_s, now - self.origin_s), 1e-9)
        scheduler = policy.scheduler
        workers = list(policy.lattice.workers.values())
        audit = policy.cache.audit
        active = [w for w in workers if w.state is WorkerState.ACTIVE]
        per_degree: dict[str, int] = {}
        for w in sorted(active, key=lambda w: w.cp_degree):
            per_degree[str(w.cp_degree)] = per_degree.get(str(w.cp_degree), 0) + 1
        sample = {
            "t": round(now - self.origin_s, 3),
            "composition": policy.composition_name((WorkerState.ACTIVE,)),
            "workers": per_degree,  # active, per degree
            "not_active": len(workers) - len(active),  # draining, switching, unavailable
            "arrivals": self._period_arrivals,  # in this period
            "finished": self._period_answers,
            "rate": round(len(self._arrivals) / span, 4),  # over the window
            "ttft_mean_s": _r(sum(ttfts) / len(ttfts)) if ttfts else None,
            "ttft_p50_s": _r(_quantile(ttfts, 0.5)),
            "ttft_p90_s": _r(_quantile(ttfts, 0.9)),
            "ttft_p99_s": _r(_quantile(ttfts, 0.99)),
            "tau_p50_s": _r(_quantile(taus, 0.5)),
            "slo_attainment": _r(met / tokens, 4) if tokens else None,
            "hit_rate": _r(cached / tokens, 4) if tokens else None,
            "queued": sum(len(scheduler.queued(w.worker_id)) for w in workers),
            "running": sum(scheduler.running(w.worker_id) is not None for w in workers),
            "outstanding_s": _r(sum(scheduler.outstanding_s(w.worker_id, now) for w in workers)),
            "copies_in_flight": len(policy.cache.in_flight.copies),
            "replications": sum(k.copies for k in audit.kinds.values()),
            "reclamations": audit.reclaimed_total,
        }
        self.samples.append(sample)
        self._period_arrivals = self._period_answers = 0
        while self.next_s <= now:
            self.next_s += self.period_s
        return sample

    # -- what a page reads -------------------------------------------------------------

    def since(self, t: float | None = None) -> dict[str, Any]:
        """Samples and events after ``t`` (None: every one kept), oldest first."""
        return {
            "period_s": self.period_s,
            "window_s": self.window_s,
            "capacity": self.capacity,
            "samples": _after(self.samples, t),
            "events": _after(self.events, t),
        }


def _after(ring: deque[dict[str, Any]], t: float | None) -> list[dict[str, Any]]:
    """The entries of ``ring`` (in time order) with ``"t"`` after ``t``: read from the
    newest back, so a poll costs what it returns."""
    if t is None:
        return list(ring)
    out = []
    for entry in reversed(ring):
        if entry["t"] <= t:
            break
        out.append(entry)
    out.reverse()
    return out
