"""The audit of every move the what-if controller makes (docs/scheduling.md, "The
what-if controller").

When a decision starts reshapes, an audit opens with what was predicted for the
next forecast span: the move's mean TTFT and holding's, both from the same live
state. Every request arriving in that span is followed to its first token. Once
all are answered (or, a minute after the span, most of them), the audit closes:

    measured     the arrivals' mean TTFT, as served (transition included)
    replayed     the move replayed on those very arrivals from the saved state:
                 the model's error for this kind of move, with the forecast's
                 error taken out
    counterfact  holding replayed on them from the same state

The span is the forecast's (at least ``decision_s``): the transition and the
periods after it, as the live replay's first cycle predicted them.

and the relative error ``x = measured / replayed - 1 - bias`` (``bias``: the
model's signed error on undisturbed periods, which holding shares) is kept per
kind of move and load band. ``pessimism(kind, band)`` is the mean of ``|x|`` over
the last ``keep`` audits of that key, with the band's ``prior`` counted
``prior_weight`` times: the controller prices a candidate at ``J * (1 + pessimism)``, so where the
model's moves were mispredicted (either way: the counterfactual is a replay too,
so an error is an error of the gain as well) a move must predict a larger gain
the next time (no audit yet: the prior). Holders recorded after the
move name the new workers; they are translated back into the replay's ids of
each world (the move's made workers; holding's sources).

Pure Python. Not owned here: the replays (``search``), the decision
(``whatif``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vertumnus.policy.control.candidates import Candidate
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.lattice import LatticeWorker

# Load bands of the audit, by holding's predicted busy fraction.
BANDS: tuple[tuple[float, str], ...] = ((0.6, "light"), (0.9, "loaded"))


def band_of(busy_fraction: float, overload: float) -> str:
    if busy_fraction >= overload:
        return "saturated"
    for edge, name in BANDS:
        if busy_fraction < min(edge, overload):
            return name
    return "loaded"


@dataclass
class OpenAudit:
    audit_id: int
    window: int  # the decision's
    start_s: float
    end_s: float  # arrivals up to here are audited
    kind: str
    level: int
    band: str
    chosen: Candidate
    holding: Candidate
    predicted_s: float  # the move's, over the next span, at the decision
    predicted_hold_s: float
    predicted_gain: float  # over the whole horizon, pessimism included
    sources: Mapping[int, range]  # source worker -> its devices
    samples: dict[int, ArrivalSample] = field(default_factory=dict)  # by request, as revised
    ttft_s: dict[int, float] = field(default_factory=dict)
    overlapped: bool = False  # another move began inside its span


class MoveAudits:
    def __init__(
        self, prior: float | Mapping[str, float], prior_weight: float, keep: int = 8
    ) -> None:
        """``prior``: the error before any audit, one for every band or per band."""
        self.prior: Mapping[str, float] = (
            dict.fromkeys(("light", "loaded", "saturated"), prior)
            if isinstance(prior, int | float)
            else prior
        )
        self.prior_weight = prior_weight
        self.keep = keep
        self._open: list[OpenAudit] = []
        self._errors: dict[tuple[str, str], deque[float]] = {}
        self.log: list[dict[str, Any]] = []
        self._next_id = 0

    # -- inputs ----------------------------------------------------------------------

    def open(
        self, window: int, now: float, span_s: float, chosen: Candidate, holding: Candidate,
        band: str, predicted_s: float, predicted_hold_s: float, gain: float,
        sources: Mapping[int, range],
    ) -> None:  # fmt: skip
        for audit in self._open:
            if audit.end_s > now:
                audit.overlapped = True
        audit = OpenAudit(self._next_id, window, now, now + span_s, chosen.kind,
                          chosen.level, band, chosen, holding, predicted_s, predicted_hold_s,
                          gain, dict(sources))  # fmt: skip
        self._open.append(audit)
        self._next_id += 1

    def arrived(self, sample: ArrivalSample) -> None:
        for audit in self._open:
            if audit.start_s <= sample.arrival_s < audit.end_s:
                audit.samples[sample.request_id] = sample

    def revised(self, sample: ArrivalSample) -> None:
        """A sample revised at its start (``Forecast.revise``): the audit replays the
        reuse it found, as the forecast does."""
        for audit in self._open:
            if sample.request_id in audit.samples:
                audit.samples[sample.request_id] = sample

    def completed(self, request_id: int, ttft_s: float) -> None:
        for audit in self._open:
            if request_id in audit.samples:
                audit.ttft_s[request_id] = ttft_s

    # -- closing -----------------------------------------------------------------------

    def due(
        self, now: float, workers: Mapping[int, LatticeWorker]
    ) -> list[tuple[OpenAudit, list[ArrivalSample], list[ArrivalSample]]]:
        """The audits whose span has closed and whose arrivals are answered (a minute
        after the span: 90 % of them), each with its arrivals in the move's world and
        in holding's. An audit with no answer a minute on is dropped."""
        out = []
        keep = []
        for audit in self._open:
            answered = len(audit.ttft_s)
            total = len(audit.samples)
            if now < audit.end_s or (answered < total and now < audit.end_s + 60.0):
                keep.append(audit)
                continue
            if total == 0 or answered < 0.9 * total:
                continue  # (nothing came, or too many never answered: no audit)
            moved, held = self._worlds(audit, workers)
            samples = [s for r, s in audit.samples.items() if r in audit.ttft_s]
            out.append(
                (
                    audit,
                    [_translate(s, moved) for s in samples],
                    [_translate(s, held) for s in samples],
                )
            )
        self._open = keep
        return out

    def record(
        self, audit: OpenAudit, replayed_s: float, replayed_hold_s: float, bias: float
    ) -> dict[str, Any]:
        measured = sum(audit.ttft_s.values()) / len(audit.ttft_s)
        x = (measured / replayed_s - 1.0 - bias) if replayed_s > 0 else 0.0
        if not audit.overlapped:
            errors = self._errors.setdefault((audit.kind, audit.band), deque(maxlen=self.keep))
            errors.append(x)
        entry = {
            "audit": audit.audit_id,
            "window": audit.window,
            "at_s": audit.start_s,
            "span_s": audit.end_s - audit.start_s,
            "move": f"{len(audit.chosen.ops)} {audit.kind}",
            "level": audit.level,
            "band": audit.band,
            "composition": audit.chosen.name,
            "requests": len(audit.ttft_s),
            "predicted_s": audit.predicted_s,
            "predicted_hold_s": audit.predicted_hold_s,
            "predicted_gain": audit.predicted_gain,
            "measured_s": measured,
            "replayed_s": replayed_s,
            "replayed_hold_s": replayed_hold_s,
            # the move against holding on the same arrivals (holding's model bias
            # taken out), as measured and as predicted: > 0, the span cost more
            "vs_hold": measured / (replayed_hold_s * (1.0 + bias)) - 1.0
            if replayed_hold_s > 0
            else 0.0,
            "predicted_vs_hold": audit.predicted_s / audit.predicted_hold_s - 1.0
            if audit.predicted_hold_s > 0
            else 0.0,
            "error": x,
            "overlapped": audit.overlapped,
        }
        self.log.append(entry)
        del self.log[:-100]
        return entry

    # -- outputs -----------------------------------------------------------------------

    def watching(self, now: float) -> bool:
        """A move's span is still being watched (its audit has not seen its arrivals)."""
        return any(now < audit.end_s for audit in self._open)

    def pessimism(self, kind: str, band: str) -> float:
        errors = self._errors.get((kind, band), ())
        w = self.prior_weight
        return (w * self.prior[band] + sum(abs(x) for x in errors)) / (w + len(errors))

    def to_json(self) -> dict[str, Any]:
        return {
            f"{kind}:{band}": {"audits": len(errors), "pessimism": self.pessimism(kind, band)}
            for (kind, band), errors in sorted(self._errors.items())
        }

    # -- the worlds --------------------------------------------------------------------

    def _worlds(
        self, audit: OpenAudit, workers: Mapping[int, LatticeWorker]
    ) -> tuple[dict[int, int], dict[int, int]]:
        """Real worker id -> its id in the move's replay, and in holding's."""
        moved: dict[int, int] = {}
        held: dict[int, int] = {}
        for op, made in zip(audit.chosen.ops, audit.chosen.made, strict=True):
            for w in workers.values():
                if w.cp_degree == op.target_degree and w.first_device in op.target_firsts:
                    moved[w.worker_id] = made[op.target_firsts.index(w.first_device)]
                    source = next(
                        (s for s in op.sources if w.first_device in audit.sources.get(s, ())),
                        op.sources[0],
                    )
                    held[w.worker_id] = source
        return moved, held


def _translate(sample: ArrivalSample, ids: Mapping[int, int]) -> ArrivalSample:
    if not ids or not any(w in ids for w, _ in sample.holders):
        return sample
    return replace(sample, holders=tuple((ids.get(w, w), p) for w, p in sample.holders))
