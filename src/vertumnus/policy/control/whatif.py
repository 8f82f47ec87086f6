"""The what-if controller: predict each reachable composition's TTFT, then act,
and never do harm (DESIGN.md §6b, §6c; the paper's threshold rules are
``rules.Controller``).

Every ``decision_s`` seconds (10 s by default, apart from the capacity window):

  1. forecast: the recent arrivals (``forecast``), each with its length and where
     its prefix was reusable;
  2. candidates: hold, and k splits or k merges at one level within the lattice's
     bounds (``candidates``);
  3. replay each candidate from the live state to the end of its consequences
     (``search``): backlogs, drains, switches, the cache it disturbs, and
     the forecast continued for ``payback_s``, longer while the backlog its
     transition built drains; holding over the same horizon. Near saturation
     moves are staged (``saturated_moves`` operations at a time) and no merge is
     priced (it lowers the throughput the pool lacks). A candidate
     that beats holding is also replayed in its steady state on every arrival
     since the last rate change (at most ``steady_horizon_s``, at the forecast's
     rate): where it does not beat holding there, it is refused (unless it
     is a split back towards the start);
  4. act, pessimistically: a candidate's score ``J`` is priced at
     ``J * (1 + pessimism * share)``, the audited error of its kind of move and
     load band (``audit``) on the part of ``J`` it is about (a split's
     transition, a merge's whole horizon: ``guards.priced_share``), and
     its gain over holding, ``(hold - J') / hold``, must
     clear the margin (``margin`` plus ``audit_weight`` times the undisturbed
     audit's error). Then the evidence decides when: a gain whose significance
     ``z`` (a paired comparison over batches of the forecast) is at least
     ``z_urgent`` acts at once where the load moved (the pool overloaded, or the
     forecast just saw the rate change), or at any load where the gain is
     ``urgent_gain`` or more; one at ``z_confirm`` or more must be the
     best, with the same kind of move, two decisions in a row; a weaker one
     ``confirm_limit`` in a row, their mean gain above the margin. While a reshape
     is under way only an urgent move starts another. While the forecast still
     holds the cold start (the first ``horizon_s`` after the first arrival) the
     replays see the cache as it will be warm (each prefix reusable wherever the
     trie matched it: a cold cache alone looks like overload) and only an urgent
     move under overload, or of at least ``urgent_gain``, is made.

Every move is audited (``audit``): once the arrivals of the span after it are
answered, their measured mean TTFT is compared with the move replayed on them and
with holding replayed on them from the same state; the error feeds the next
decisions' pessimism, and every audit is listed in the decision that closed it.

The decision is cut in three so that a server computes the replays off its event
loop: ``prepare`` (reads the pool: on the loop), ``evaluate`` (the replays: pure,
touches nothing shared, safe in a thread) and ``conclude`` (the guards and the
bookkeeping: on the loop). Every ``Decision`` lists the candidates with their
predictions, the margin and the choice.

The undisturbed audit: each period the pool spent undisturbed is replayed once all
its requests ended and its measured mean TTFT compared with that (``periods``).

Pure Python, clock-free. Not owned here: executing reshapes (``transition``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vertumnus.blocks import max_reuse_blocks
from vertumnus.policy.control.audit import MoveAudits, OpenAudit, band_of
from vertumnus.policy.control.calibration import Calibration
from vertumnus.policy.control.candidates import Candidate, DisturbedShares, PoolInputs, candidates
from vertumnus.policy.control.forecast import Forecast, ForecastConfig, make_sample
from vertumnus.policy.control.guards import Streak, candidate_rows, homeward, pessimistic_gains
from vertumnus.policy.control.periods import Period, Periods
from vertumnus.policy.control.replay import ReplayModel, ReplayWorker, Times
from vertumnus.policy.control.rules import Controller, ControllerConfig, Decision, TrafficFn
from vertumnus.policy.control.search import (
    Evaluation,
    MoveAuditInput,
    WayBack,
    WhatIfPlan,
    evaluate,
    faster,
)
from vertumnus.policy.costs import CostWeights, ReuseCurve
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState
from vertumnus.policy.placement.scheduler import Placement, PlacementRequest


class WhatIfController(Controller):
    def __init__(
        self,
        config: ControllerConfig,
        lattice: Lattice,
        kappa_s: Mapping[int, float],
        curves: Mapping[int, ReuseCurve],
        weights: CostWeights,
        traffic: TrafficFn | None = None,
        disturbed: TrafficFn | None = None,
        held_blocks: Callable[[int], int] | None = None,
        max_tokens_per_rank: int | None = None,
        acting: bool = True,
    ) -> None:
        """``disturbed``: the share of a reshape's cache it leaves out of place (the
        trie's reconciliation, ``cache.manager.reconciliation_share``);
        ``held_blocks``: the blocks a worker caches (the cheap stand-in for the
        reconciliation traffic when ordering many options); ``acting``: the pool
        carries out its moves (false: a fixed pool, whose decisions are only noted:
        no move is audited and every period stays undisturbed)."""
        super().__init__(config, lattice, kappa_s, traffic)
        self.acting = acting
        self.start = dict(lattice.composition())  # the composition it started in
        self.held_blocks = held_blocks or (lambda worker_id: 0)
        self.max_tokens_per_rank = max_tokens_per_rank  # the scheduler's KV limit
        self.curves = curves
        self.weights = weights
        self.forecast = Forecast(
            ForecastConfig(
                config.horizon_s,
                config.min_requests,
                config.max_horizon_s,
                recent_s=min(config.decision_s, config.horizon_s),
                long_s=config.steady_horizon_s,
            ),
            # (each request's replay times are kept while the forecast keeps it)
            forget=lambda request_id: self._times.pop(request_id, None),
        )
        self.calibration = Calibration(lattice.config.degrees)
        # consecutive decisions whose best is the same kind of move
        self._streak = Streak(config.z_confirm, config.confirm_limit)
        self.move_audits = MoveAudits(config.move_error_priors, config.move_error_weight)
        self._audited: list[dict[str, Any]] = []  # closed since the last decision
        self._periods = Periods()  # the undisturbed audit's (``periods``)
        self._shares = DisturbedShares(disturbed or (lambda op: 0.0))
        self._times: dict[int, Times] = {}  # request -> its E per degree (the replay's)
        self._due: dict[int, OpenAudit] = {}  # move audits being replayed, by id

    # -- inputs ------------------------------------------------------------------------

    def placed(self, request: PlacementRequest, placed: Placement, at_s: float, block: int) -> None:
        """A request placed for the first time: its arrival, length and holders."""
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
        if not self._periods.started:  # the first period starts with the first arrival
            workers = tuple(
                ReplayWorker(w.worker_id, w.cp_degree, 0.0) for w in self.lattice.active()
            )
            first = Period(self.window, sample.arrival_s, workers, self.settled())
            self._periods.open(first, True)
        self._periods.arrived(sample)
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

    def switch_done(self, switch_s: float) -> None:
        self.calibration.switch(switch_s)

    def started(self, request_id: int, worker_id: int, reused_tokens: int, key: int) -> None:
        if not self.forecast.revise(request_id, worker_id, reused_tokens, key):
            return
        # Every replay of this request takes the reuse it found: the forecast's, the
        # period's and the move audits' (its times are computed again).
        self._times.pop(request_id, None)
        revised = self.forecast.by_id[request_id]
        self.move_audits.revised(revised)
        self._periods.revised(revised)

    def completed(self, request_id: int, ttft_s: float) -> None:
        self.move_audits.completed(request_id, ttft_s)
        self._periods.completed(request_id, ttft_s)

    # -- the decision ------------------------------------------------------------------

    def prepare(self, inputs: PoolInputs) -> WhatIfPlan:
        cfg, cal = self.config, self.calibration
        now = inputs.now
        scales = cal.scales() if cfg.calibrate else {}
        model = ReplayModel(
            self.curves,
            self.lattice.config.degrees,
            self.weights,
            scales,
            cal.overhead_s,
            self.max_tokens_per_rank,
        )
        window = self.forecast.window(now)
        if len(self._times) > 2 * len(self.forecast) + 1000:  # (those an audit added late)
            self._times = {r: t for r, t in self._times.items() if r in self.forecast.by_id}
        n = window.count
        dilation = max(1.0, n / cfg.replay_requests)
        # In the cold-cache warm-up, the replay sees the cache as it will be: each
        # prefix reusable wherever the trie matched it (as the start choice does).
        first = self.forecast.first_arrival_s
        warming = first is None or now - first < cfg.horizon_s
        forecast = model.prepare(
            window.thinned(1.0 / dilation),
            window.start_s,
            dilation,
            window.span_s,
            None if warming else self._times,
            warm=warming,
        )
        backlog_scale = {c: sum(s) / len(s) for c, s in scales.items()} if scales else {}
        for c in self.lattice.config.degrees:
            backlog_scale.setdefault(c, 1.0)
        active = [w for w in self.lattice.workers.values() if w.state is WorkerState.ACTIVE]
        max_moves = max(1, int(cfg.max_moves_fraction * len(active)))
        loads = inputs.loads

        def order(op: Reshape) -> tuple[float, float, int]:
            # least drain, then least cached KV to reconcile, then device
            drain = max(loads.get(s, 0.0) for s in op.sources)
            return (drain, float(sum(map(self.held_blocks, op.sources))), min(op.target_firsts))

        cands = candidates(
            self.lattice,
            inputs,
            self.in_flight,
            max_moves,
            backlog_scale,
            cal.switch_s,
            order,
            self.forecast.by_id.get,
            self._shares.decision(now),
        )
        audits = []
        # One audit a decision (the latest period answered): it is a replay of its
        # own. A period of the cold start is not one (its cache was filling: the
        # model's error there says nothing of the next decisions').
        period = self._periods.done(self.window, None if first is None else first + cfg.horizon_s)
        if period is not None:
            d = max(1.0, 3 * len(period.samples) / cfg.replay_requests)  # (a third as many)
            samples = list(period.samples.values())
            replayed = model.prepare(samples, period.start_s, d, cache=self._times)
            audits.append((period.index, replayed, period.workers, period.measured_s()))
        moves: list[MoveAuditInput] = []
        self._due = {}
        for audit, moved, held in self.move_audits.due(now, self.lattice.workers):
            d = max(1.0, len(moved) / cfg.replay_requests)
            start = audit.start_s
            moves.append((audit.audit_id, model.prepare(moved, start, d),
                          model.prepare(held, start, d), audit.chosen, audit.holding))  # fmt: skip
            self._due[audit.audit_id] = audit
        # The load's mix over the longest stable span, at today's rate: a move must
        # also win there (a gain the last horizon_s alone shows is noise in its mix).
        long_forecast = None
        if not warming and not window.rate_changed and cfg.steady_check:
            # (not the cold start, nor the minute its cache fills in: their samples
            # reuse less than the load will)
            assert first is not None
            long = self.forecast.long_window(now, first + 2 * cfg.horizon_s)
            if long.span_s >= 1.5 * window.span_s and window.rate > 0 and long.rate > 0:
                d = max(1.0, long.count / cfg.replay_requests)
                prepared = model.prepare(long.thinned(1.0 / d), long.start_s, d, long.span_s,
                                         self._times)  # fmt: skip
                long_forecast = faster(prepared, window.rate / long.rate)
        span = max(window.span_s, cfg.decision_s)
        cycle_s = max(window.span_s, 1e-9)
        audit_cycles = max(1, math.ceil(self._audit_span(cycle_s) / cycle_s - 1e-9))
        way_back = None
        if cfg.way_back_utilisation > 0:
            way_back = WayBack(cfg.way_back_utilisation, cfg.way_back_rate_max,
                               cfg.way_back_react_s, cal.switch_s)  # fmt: skip
        return WhatIfPlan(now, model, forecast, tuple(cands), tuple(audits), n,
                          window.rate_changed, cfg.op_cost, warming,
                          max(1, math.ceil(cfg.payback_s / span)),
                          max(1, math.ceil(cfg.max_payback_s / span)),
                          cfg.significance_batches, cfg.overload_utilisation,
                          cfg.saturated_moves, tuple(moves), cfg.headroom_rate,
                          way_back, long_forecast, audit_cycles,
                          tuple(self._homeward(c, cands[0]) for c in cands))  # fmt: skip

    @staticmethod
    def evaluate(plan: WhatIfPlan) -> Evaluation:
        """The replays (``search.evaluate``): pure, safe off the event loop."""
        return evaluate(plan)

    def conclude(self, plan: WhatIfPlan, evaluation: Evaluation) -> Decision:
        cfg, cal, audits, streak = self.config, self.calibration, self.move_audits, self._streak
        for index, predicted, measured in evaluation.audits:
            cal.audit(index, predicted, measured)
        audited = [
            audits.record(self._due.pop(audit_id), move_s, hold_s, cal.bias)
            for audit_id, move_s, hold_s in evaluation.move_audits
            if audit_id in self._due
        ]
        busy = evaluation.busy_fraction
        band = band_of(busy, cfg.overload_utilisation)
        # Pessimistic: each candidate at J * (1 + its kind's audited error), against
        # holding over the same horizon.
        gains = pessimistic_gains(plan, evaluation, lambda kind: audits.pessimism(kind, band))
        best = max(range(len(gains)), key=lambda k: (gains[k], -k))
        gain = gains[best]
        z = (evaluation.z[best] if best < len(evaluation.z) else None) or 0.0
        margin = cfg.margin + cfg.audit_weight * cal.error
        overloaded = busy >= cfg.overload_utilisation
        large = 0 < cfg.urgent_gain <= gain
        urgent = gain >= margin and z >= cfg.z_urgent and (overloaded or plan.rate_changed or large)
        chosen = plan.candidates[best]
        ops: tuple[Reshape, ...] = ()
        key = (chosen.kind, chosen.level)
        if plan.forecast_requests == 0 or best == 0 or plan.warming:
            # (the warm-up's replays assume a warm cache: they confirm nothing later)
            streak.reset()
        else:
            streak.add(key, gain, z)
        confirmed = streak.confirmed(margin)
        streak_n = len(streak.entries)
        if plan.forecast_requests == 0 or best == 0 or gain < margin:
            rule = "hold"  # (no harm: the present pessimistic gain must clear the margin)
        elif plan.warming and not (urgent and (overloaded or large)):
            # (overload as the warm cache will have it: a cold one alone looks like it)
            rule = "hold:warm-up"
        elif self.in_flight and not urgent:
            rule = "hold:reshapes-in-flight"
        elif audits.watching(plan.now) and not urgent:
            # (the next move once the last one's span has been seen)
            rule = "hold:auditing"
        elif not urgent and not confirmed:
            rule = "hold:confirming"
        else:
            ops = tuple(op for op in chosen.ops if self.still_possible(op))
            rule = f"{chosen.kind}:{'urgent' if urgent else 'whatif'}" if ops else "hold:stale"
            streak.reset()
        if self.acting:
            self.in_flight.extend(ops)
            if ops:
                self._open_audit(plan, evaluation, best, band, gain)
        inputs: dict[str, Any] = {
            "mode": "whatif",
            "forecast_requests": plan.forecast_requests,
            "dilation": plan.forecast.dilation,
            "rate_changed": plan.rate_changed,
            "margin": margin,
            "gain": gain,
            "z": z if math.isfinite(z) else None,
            "streak": streak_n,
            "urgent": urgent,
            "warming": plan.warming,
            "busy_fraction": busy,
            "band": band,
            "chosen": chosen.name if ops else plan.candidates[0].name,
            "candidates": candidate_rows(plan, evaluation, gains),
            "calibration": cal.to_json(),
            "pessimism": self.move_audits.to_json(),
            "move_audits": audited,
        }
        decision = self._close(rule, ops, inputs)
        self._open_period(plan.now, plan.candidates[0], bool(ops) and self.acting)
        return decision

    def _open_audit(
        self, plan: WhatIfPlan, evaluation: Evaluation, best: int, band: str, gain: float
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
        span = self._audit_span(plan.forecast.span_s)
        k = plan.audit_cycles
        first, first_hold = live.cycle_ttft_s[:k], hold.cycle_ttft_s[:k]
        predicted, predicted_hold = sum(first) / len(first), sum(first_hold) / len(first_hold)
        self.move_audits.open(self.window, plan.now, span, chosen, plan.candidates[0], band,
                              predicted, predicted_hold, gain, sources)  # fmt: skip

    def _audit_span(self, forecast_span_s: float) -> float:
        """What a move's audit watches: the next ``horizon_s`` (at least a decision
        period), or the forecast's span if longer."""
        return max(forecast_span_s, self.config.horizon_s, self.config.decision_s)

    def _homeward(self, cand: Candidate, hold: Candidate) -> bool:
        """``cand`` takes the pool towards the composition it started in, never past
        it (``guards.homeward``; ``start_is_home``: then its way back does
        not refuse it)."""
        on = self.config.start_is_home and cand is not hold
        return on and homeward(self.start, hold.composition, cand.composition)

    def _close(self, rule: str, ops: Sequence[Reshape], inputs: dict[str, Any]) -> Decision:
        demand, n = self._demand_s, self._requests
        long_fraction = self._long / n if n else 0.0
        inputs["requests"] = n
        return self._record(
            Decision(
                self.window, rule, tuple(ops), demand, self.capacity_s(), long_fraction, inputs
            )
        )

    def _open_period(self, now: float, hold: Candidate, reshaping: bool) -> None:
        start_workers = tuple(w for w in hold.next_workers if w.worker_id in self.lattice.workers)
        settled = self.settled()
        self._periods.open(
            Period(self.window, now, start_workers, settled and not reshaping), settled
        )
