"""The what-if controller: predict each reachable composition's TTFT, then act,
and never do harm (docs/scheduling.md, "The what-if controller"; the paper's
threshold rules are ``rules.Controller``).

Every ``decision_s`` seconds (10 s by default, apart from the capacity window):

  1. forecast: the recent arrivals (``forecast``), each with its length and where
     its prefix was reusable;
  2. candidates: hold, and k splits or k merges at one level within the lattice's
     bounds (``candidates``);
  3. replay each candidate from the live state to the end of its consequences
     (``search``): backlogs, drains, switches, the cache it disturbs, and
     the forecast continued for ``payback_s``, longer while the backlog its
     transition built drains, and once drained (to a steady state that is not
     overloaded) over the load's expected dwell, ``(dwell_prior_s + the time
     served) / (1 + the rate changes seen)``; holding over the same horizon.
     Near saturation moves are staged (``saturated_moves`` operations at a time)
     and no merge is priced (it lowers the throughput the pool lacks). A candidate
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

Every move is audited, and every period the pool spent undisturbed
(``observations``); the errors feed the next decisions' pessimism and margin.

The decision is cut in three so that a server computes the replays off its event
loop: ``prepare`` (reads the pool: on the loop), ``evaluate`` (the replays: pure,
touches nothing shared, safe in a thread) and ``conclude`` (the guards and the
bookkeeping: on the loop). Every ``Decision`` lists the candidates with their
predictions, the margin and the choice.

Pure Python, clock-free. Not owned here: executing reshapes (``transition``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.control.audit import band_of
from vertumnus.policy.control.candidates import Candidate, DisturbedShares, PoolInputs, candidates
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.control.decision import Decision, TrafficFn
from vertumnus.policy.control.guards import (
    Streak,
    candidate_rows,
    hold_rule,
    homeward,
    pessimistic_gains,
)
from vertumnus.policy.control.observations import Observations
from vertumnus.policy.control.replay import Calibrated, ReplayModel
from vertumnus.policy.control.rules import ControllerBase
from vertumnus.policy.control.search import Evaluation, WayBack, WhatIfPlan, evaluate, faster
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Placement


class WhatIfController(ControllerBase):
    """``DecisionSteps[WhatIfPlan, Evaluation]`` (``rules``)."""

    # The pool carries out its moves (false: a fixed pool, whose decisions are only
    # noted: no move is audited and every period stays undisturbed).
    acting = True

    def __init__(
        self,
        config: ControllerConfig,
        lattice: Lattice,
        kappa_s: Mapping[int, float],
        model: ReplayModel,
        cache: PrefixCacheManager | None = None,
    ) -> None:
        """``model``: the profile's curves, the cost weights and the scheduler's KV
        limit (each decision calibrates it). ``cache``: the trie, for a reshape's
        reconciliation traffic, the share of its cache it leaves out of place
        (``cache.manager.reconciliation_share``) and the blocks a worker caches (the
        cheap stand-in for the traffic when ordering many options); None: none."""
        super().__init__(config, lattice, kappa_s, _traffic(cache))
        self.start = dict(lattice.composition())  # the composition it started in
        self.cache = cache
        self.max_tokens_per_rank = model.max_tokens_per_rank  # the scheduler's KV limit
        self.curves = model.curves
        self.weights = model.weights
        # what it has seen of the pool, and how its replays fared (``observations``)
        # (each decision's model has these degrees, curves and KV limit: the same times)
        times = ReplayModel(self.curves, lattice.config.degrees, self.weights, None,
                            self.max_tokens_per_rank).times  # fmt: skip
        self.observations = Observations(config, lattice, self.settled, times)
        self.forecast = self.observations.forecast
        self.calibration = self.observations.calibration
        self.move_audits = self.observations.move_audits
        # consecutive decisions whose best is the same kind of move
        self._streak = Streak(config.z_confirm, config.confirm_limit)
        self._shares = DisturbedShares(_disturbed(cache))

    def held_blocks(self, worker_id: int) -> int:
        """The blocks the worker caches (0 without a cache manager)."""
        if self.cache is None:
            return 0
        trie = self.cache.trie
        return len(trie.worker_nodes.get(worker_id, ())) + len(
            trie.worker_pending.get(worker_id, ())
        )

    # -- inputs (``observations``) ----------------------------------------------------

    def placed(self, request: PlacementRequest, placed: Placement, at_s: float, block: int) -> None:
        """A request placed for the first time: its arrival, length and holders."""
        self.observations.placed(request, placed, at_s, block, self.window)

    def prefill_done(
        self, cp_degree: int, input_tokens: int, predicted_s: float, busy_s: float,
        compute_s: float | None,
    ) -> None:  # fmt: skip
        self.observations.prefill_done(cp_degree, input_tokens, predicted_s, busy_s, compute_s)

    def switch_done(self, switch_s: float) -> None:
        self.calibration.switch(switch_s)

    def started(self, request_id: int, worker_id: int, reused_tokens: int, key: int) -> None:
        self.observations.started(request_id, worker_id, reused_tokens, key)

    def completed(self, request_id: int, ttft_s: float) -> None:
        self.observations.completed(request_id, ttft_s)

    # -- the decision ------------------------------------------------------------------

    def prepare(self, inputs: PoolInputs) -> WhatIfPlan:
        cfg, cal = self.config, self.calibration
        now = inputs.now
        scales = cal.scales() if cfg.calibrate else {}
        model = ReplayModel(
            self.curves,
            self.lattice.config.degrees,
            self.weights,
            Calibrated(scales, cal.overhead_s),
            self.max_tokens_per_rank,
        )
        seen = self.observations
        window = self.forecast.window(now)
        seen.trim_times()
        n = window.count
        dilation = max(1.0, n / cfg.replay_requests)
        seen.keep_ahead = 1.0 / dilation  # (the next arrivals' times, computed as they come)
        # In the cold-cache warm-up, the replay sees the cache as it will be: each
        # prefix reusable wherever the trie matched it (as the start choice does).
        first = self.forecast.first_arrival_s
        warming = first is None or now - first < cfg.horizon_s
        forecast = model.prepare(
            window.thinned(1.0 / dilation),
            window.start_s,
            dilation,
            window.span_s,
            None if warming else seen.times,
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
        audits, moves = seen.audits_due(
            model, now, self.window, None if first is None else first + cfg.horizon_s
        )
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
                                         seen.times)  # fmt: skip
                long_forecast = faster(prepared, window.rate / long.rate)
        span = max(window.span_s, cfg.decision_s)
        cycle_s = max(window.span_s, 1e-9)
        audit_cycles = max(1, math.ceil(seen.audit_span(cycle_s) / cycle_s - 1e-9))
        dwell_cycles = 0
        if cfg.dwell_prior_s > 0 and first is not None:
            # the load's expected dwell: one rate change per dwell_prior_s a priori,
            # and those seen over the time served
            dwell_s = (cfg.dwell_prior_s + now - first) / (1 + self.forecast.changes)
            dwell_cycles = math.ceil(min(dwell_s, cfg.dwell_max_s) / span)
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
                          cfg.headroom_overload, way_back, long_forecast, audit_cycles,
                          tuple(self._homeward(c, cands[0]) for c in cands),
                          dwell_cycles)  # fmt: skip

    @staticmethod
    def evaluate(plan: WhatIfPlan) -> Evaluation:
        """The replays (``search.evaluate``): pure, safe off the event loop."""
        return evaluate(plan)

    def conclude(self, plan: WhatIfPlan, evaluation: Evaluation) -> Decision:
        cfg, cal, audits, streak = self.config, self.calibration, self.move_audits, self._streak
        audited = self.observations.audited(evaluation)
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
        watching = audits.watching(plan.now)
        rule = hold_rule(plan, best, gain, margin, urgent, overloaded or large,
                         bool(self.in_flight), watching, confirmed)  # fmt: skip
        if rule is None:
            ops = tuple(op for op in chosen.ops if self.still_possible(op))
            rule = f"{chosen.kind}:{'urgent' if urgent else 'whatif'}" if ops else "hold:stale"
            streak.reset()
        if self.acting:
            self.in_flight.extend(ops)
            if ops:
                self.observations.open_move_audit(self.window, plan, evaluation, best, band, gain)
        inputs: dict[str, Any] = {
            "mode": "whatif",
            "forecast_requests": plan.forecast_requests,
            "dilation": plan.forecast.dilation,
            "dwell_cycles": plan.dwell_cycles,  # the horizon a drained move is priced over
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
        self.observations.open_period(
            self.window, plan.now, plan.candidates[0], bool(ops) and self.acting
        )
        return decision

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


def _traffic(cache: PrefixCacheManager | None) -> TrafficFn | None:
    """The trie's expected reconciliation traffic of a reshape."""
    if cache is None:
        return None
    return lambda op: cache.reconciliation_traffic(op.sources, op.target_degree, op.target_firsts)


def _disturbed(cache: PrefixCacheManager | None) -> TrafficFn:
    """The share of a reshape's cache it leaves out of place."""
    if cache is None:
        return lambda op: 0.0
    return lambda op: cache.reconciliation_share(op.sources, op.target_degree, op.target_firsts)
