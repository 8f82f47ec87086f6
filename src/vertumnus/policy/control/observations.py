"""What the what-if controller has observed of the pool, and how its replays fared.

Fed by the stack's hooks: each request placed becomes a sample of the forecast
(its arrival, length and where its prefix was reusable), revised when its prefill
starts with the reuse it found there; each prefill ended, switch timed and audit
closed calibrates the replay model (``calibration``). Two audits compare the
replays with what was measured once the requests they cover are answered: each
decision period the pool spent undisturbed (``periods``), and each move with its
counterfactual, holding (``audit``); ``audits_due`` hands the due ones to the next
decision's replays and ``audited`` closes them with their results. Each request's
replay times are kept while the forecast keeps it.

Pure Python, clock-free. Not owned here: the decision (``whatif``), the replays
(``search``, ``replay``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vertumnus.blocks import max_reuse_blocks
from vertumnus.policy.control.audit import MoveAudits, OpenAudit
from vertumnus.policy.control.calibration import Calibration
from vertumnus.policy.control.candidates import Candidate
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.control.forecast import (
    ArrivalSample,
    Forecast,
    ForecastConfig,
    make_sample,
)
from vertumnus.policy.control.periods import Period, Periods
from vertumnus.policy.control.replay import ReplayModel
from vertumnus.policy.control.replay_types import PreparedForecast, ReplayWorker, Times
from vertumnus.policy.control.search import Evaluation, MoveAuditInput, WhatIfPlan
from vertumnus.policy.lattice import Lattice
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Placement

PeriodAudit = tuple[int, PreparedForecast, tuple[ReplayWorker, ...], float]


class Observations:
    """Over ``lattice``, given ``settled()``: no reshape under way and every worker
    serving (the controller's view)."""

    def __init__(
        self,
        config: ControllerConfig,
        lattice: Lattice,
        settled: Callable[[], bool],
        times: Callable[[ArrivalSample], Times] | None = None,
    ) -> None:
        """``times``: a request's replay times (``ReplayModel.times``): those of the
        arrivals the next decision will likely replay (a draw under ``keep_ahead``,
        the last decision's thinning) are computed as they arrive, not all at once in
        the decision (the same values: a revision drops them)."""
        self.config, self.lattice, self.settled = config, lattice, settled
        self.times_of = times
        self.keep_ahead = 0.0
        self.forecast = Forecast(
            ForecastConfig(
                config.horizon_s,
                config.min_requests,
                config.max_horizon_s,
                recent_s=min(config.decision_s, config.horizon_s),
                long_s=config.steady_horizon_s,
            ),
            # (each request's replay times are kept while the forecast keeps it)
            forget=lambda request_id: self.times.pop(request_id, None),
        )
        self.calibration = Calibration(lattice.config.degrees)
        self.move_audits = MoveAudits(config.move_error_priors, config.move_error_weight)
        self.periods = Periods()  # the undisturbed audit's (``periods``)
        self.times: dict[int, Times] = {}  # request -> its E per degree (the replay's)
        self._due: dict[int, OpenAudit] = {}  # move audits being replayed, by id

    # -- the stack's hooks -------------------------------------------------------------

    def placed(
        self, request: PlacementRequest, placed: Placement, at_s: float, block: int, window: int
    ) -> None:
        """A request placed for the first time (in ``window``): its arrival, length and
        holders."""
        deepest = max((p for _, p in placed.holders), default=0) // block
        update = placed.update
        matched = 0
        if update is not None:
            usable = max_reuse_blocks(request.input_tokens, block)
            matched = min(update.matched_blocks, usable) * block
        sample = make_sample(
            request.request_id,
            at_s,
            request.input_tokens,
            placed.holders,
            placed.num_candidates,
            request.block_ids[deepest - 1] if deepest else 0,
            matched,
        )
        self.forecast.record(sample)
        if sample.draw < self.keep_ahead and self.times_of is not None:
            self.times[sample.request_id] = self.times_of(sample)
        if not self.periods.started:  # the first period starts with the first arrival
            workers = tuple(
                ReplayWorker(w.worker_id, w.cp_degree, 0.0) for w in self.lattice.active()
            )
            first = Period(window, sample.arrival_s, workers, self.settled())
            self.periods.open(first, True)
        self.periods.arrived(sample)
        self.move_audits.arrived(sample)

    def prefill_done(
        self, cp_degree: int, input_tokens: int, predicted_s: float, busy_s: float,
        compute_s: float | None,
    ) -> None:  # fmt: skip
        cal = self.calibration
        cal.prefill(
            cp_degree, input_tokens, predicted_s, busy_s if compute_s is None else compute_s
        )
        if compute_s is not None:
            cal.path_overhead(busy_s - compute_s)

    def started(self, request_id: int, worker_id: int, reused_tokens: int, key: int) -> None:
        if not self.forecast.revise(request_id, worker_id, reused_tokens, key):
            return
        # Every replay of this request takes the reuse it found: the forecast's, the
        # period's and the move audits' (its times are computed again).
        self.times.pop(request_id, None)
        revised = self.forecast.by_id[request_id]
        self.move_audits.revised(revised)
        self.periods.revised(revised)

    def completed(self, request_id: int, ttft_s: float) -> None:
        self.move_audits.completed(request_id, ttft_s)
        self.periods.completed(request_id, ttft_s)

    # -- the audits --------------------------------------------------------------------

    def trim_times(self) -> None:
        """Forget the replay times of requests the forecast no longer keeps (those an
        audit added late), once they are many."""
        if len(self.times) > 2 * len(self.forecast) + 1000:
            self.times = {r: t for r, t in self.times.items() if r in self.forecast.by_id}

    def audits_due(
        self, model: ReplayModel, now: float, window: int, cold_end_s: float | None
    ) -> tuple[list[PeriodAudit], list[MoveAuditInput]]:
        """The audits the next decision replays: the latest period answered (one a
        decision: it is a replay of its own; none of the cold start, before
        ``cold_end_s``: its cache was filling, so the model's error there says nothing
        of the next decisions'), and every move whose span has been answered."""
        replay_requests = self.config.replay_requests
        audits = []
        period = self.periods.done(window, cold_end_s)
        if period is not None:
            d = max(1.0, 3 * len(period.samples) / replay_requests)  # (a third as many)
            samples = list(period.samples.values())
            replayed = model.prepare(samples, period.start_s, d, cache=self.times)
            audits.append((period.index, replayed, period.workers, period.measured_s()))
        moves: list[MoveAuditInput] = []
        self._due = {}
        for audit, moved, held in self.move_audits.due(now, self.lattice.workers):
            d = max(1.0, len(moved) / replay_requests)
            start = audit.start_s
            moves.append((audit.audit_id, model.prepare(moved, start, d),
                          model.prepare(held, start, d), audit.chosen, audit.holding))  # fmt: skip
            self._due[audit.audit_id] = audit
        return audits, moves

    def audited(self, evaluation: Evaluation) -> list[dict[str, Any]]:
        """The due audits closed with their replays: the period's calibrates the
        model, each move's prices its kind's error; the moves', as a decision lists
        them."""
        cal = self.calibration
        for index, predicted, measured in evaluation.audits:
            cal.audit(index, predicted, measured)
        return [
            self.move_audits.record(self._due.pop(audit_id), move_s, hold_s, cal.bias)
            for audit_id, move_s, hold_s in evaluation.move_audits
            if audit_id in self._due
        ]

    def audit_span(self, forecast_span_s: float) -> float:
        """What a move's audit watches: the next ``horizon_s`` (at least a decision
        period), or the forecast's span if longer."""
        return max(forecast_span_s, self.config.horizon_s, self.config.decision_s)

    def open_move_audit(
        self,
        window: int,
        plan: WhatIfPlan,
        evaluation: Evaluation,
        best: int,
        band: str,
        gain: float,
    ) -> None:
        """The move's audit: the arrivals of the next ``horizon_s`` (or the forecast's
        span, if longer), as predicted now (the live replays' first cycles over it)."""
        live, hold = evaluation.next[best], evaluation.next[0]
        if live is None or hold is None or not live.cycle_ttft_s or not hold.cycle_ttft_s:
            return
        chosen = plan.candidates[best]
        sources = {
            s: self.lattice.workers[s].devices
            for op in chosen.ops
            for s in op.sources
            if s in self.lattice.workers
        }
        span = self.audit_span(plan.forecast.span_s)
        k = plan.audit_cycles
        first, first_hold = live.cycle_ttft_s[:k], hold.cycle_ttft_s[:k]
        predicted, predicted_hold = sum(first) / len(first), sum(first_hold) / len(first_hold)
        self.move_audits.open(window, plan.now, span, chosen, plan.candidates[0], band,
                              predicted, predicted_hold, gain, sources)  # fmt: skip

    def open_period(self, window: int, now: float, hold: Candidate, reshaping: bool) -> None:
        """The next period of the undisturbed audit, from the workers holding keeps."""
        start_workers = tuple(w for w in hold.next_workers if w.worker_id in self.lattice.workers)
        settled = self.settled()
        self.periods.open(Period(window, now, start_workers, settled and not reshaping), settled)
