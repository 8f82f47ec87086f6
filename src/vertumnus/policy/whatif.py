"""The what-if controller: predict each reachable composition's TTFT, then act
(DESIGN.md §6b; the paper's threshold rules are ``controller.Controller``).

Every ``decision_s`` seconds (10 s by default, apart from the capacity window):

  1. forecast: the recent arrivals (``forecast``), each with its length and where
     its prefix was reusable;
  2. candidates: hold, and k splits or k merges at one level within the lattice's
     bounds (``whatif_candidates``);
  3. replay the forecast over each candidate through the scheduler's own cost rule
     (``replay``), calibrated per degree and length bucket (``calibration``):
     ``next`` from today's backlog, the candidate's new workers serving only after
     drain plus switch, and ``steady`` from empty queues. Its score is

        J = w * next + (1 - w) * steady,   times (1 + op_cost * #operations)

     so a move pays its transition once and its gain counts over about 1/w
     decisions;
  4. act: the best candidate's gain over holding, (J_hold - J) / J_hold, must clear
     the margin (``margin`` plus ``audit_weight`` times the audit's error). A gain of
     ``urgent_gain`` or more acts at once; a smaller one must win
     ``confirm_decisions`` decisions in a row with the same kind of move (direction
     and level). While a reshape is under way only an urgent move starts another;
     in the cold-cache warm-up (``warmup_s`` after the first arrival) only an urgent
     move under overload (the predicted busy fraction of holding at least
     ``overload_utilisation``).

The decision is cut in three so that a server computes the replays off its event
loop: ``prepare`` (reads the pool: on the loop), ``evaluate`` (the replays: pure,
touches nothing shared, safe in a thread) and ``conclude`` (the guards and the
bookkeeping: on the loop). Every ``Decision`` lists the candidates with their
predictions, the margin and the choice.

The audit: each period the pool spent undisturbed (no reshape under way, every
worker serving) is replayed once all its requests ended, from its starting backlog,
and its measured mean TTFT compared with that prediction.

Pure Python, clock-free. Not owned here: executing reshapes (``transition``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vertumnus.policy.calibration import Calibration
from vertumnus.policy.controller import Controller, ControllerConfig, Decision, TrafficFn
from vertumnus.policy.costs import CostWeights, ReuseCurve
from vertumnus.policy.forecast import ArrivalSample, Forecast, ForecastConfig
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState
from vertumnus.policy.replay import PreparedForecast, ReplayModel, ReplayResult, ReplayWorker
from vertumnus.policy.whatif_candidates import Candidate, PoolInputs, candidates


@dataclass
class _Period:
    """One decision period, for the audit."""

    index: int
    start_s: float
    workers: tuple[ReplayWorker, ...]
    undisturbed: bool
    samples: list[ArrivalSample] = field(default_factory=list)
    ttft_s: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WhatIfPlan:
    now: float
    model: ReplayModel
    forecast: PreparedForecast
    candidates: tuple[Candidate, ...]
    audits: tuple[tuple[int, PreparedForecast, tuple[ReplayWorker, ...], float], ...]
    forecast_requests: int
    rate_changed: bool


@dataclass(frozen=True)
class Evaluation:
    next: tuple[ReplayResult, ...]
    steady: tuple[ReplayResult, ...]
    audits: tuple[tuple[int, float, float], ...]  # (period, predicted, measured)


class WhatIfController(Controller):
    def __init__(
        self,
        config: ControllerConfig,
        lattice: Lattice,
        kappa_s: Mapping[int, float],
        curves: Mapping[int, ReuseCurve],
        weights: CostWeights,
        traffic: TrafficFn | None = None,
    ) -> None:
        super().__init__(config, lattice, kappa_s, traffic)
        self.curves = curves
        self.weights = weights
        self.forecast = Forecast(
            ForecastConfig(
                config.horizon_s,
                config.min_requests,
                config.max_horizon_s,
                recent_s=min(config.decision_s, config.horizon_s),
            )
        )
        self.calibration = Calibration(lattice.config.degrees)
        self._streak: tuple[tuple[str, int], list[float]] | None = None
        self._period: _Period | None = None
        self._periods: dict[int, _Period] = {}  # closed, waiting for their requests
        self._period_of: dict[int, int] = {}  # request -> the period it arrived in

    # -- inputs ------------------------------------------------------------------------

    def sample(self, sample: ArrivalSample) -> None:
        """A request placed for the first time: its arrival, length and holders."""
        self.forecast.record(sample)
        if self._period is None:  # the first period starts with the first arrival
            workers = tuple(
                ReplayWorker(w.worker_id, w.cp_degree, 0.0) for w in self.lattice.active()
            )
            self._period = _Period(self.window, sample.arrival_s, workers, self._undisturbed())
        self._period.samples.append(sample)
        self._period_of[sample.request_id] = self._period.index

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

    def completed(self, request_id: int, ttft_s: float) -> None:
        index = self._period_of.pop(request_id, None)
        if index is None:
            return
        period = self._periods.get(index) or self._period
        if period is not None and period.index == index:
            period.ttft_s[request_id] = ttft_s

    # -- the decision ------------------------------------------------------------------

    def prepare(self, inputs: PoolInputs) -> WhatIfPlan:
        cfg, cal = self.config, self.calibration
        now = inputs.now
        scales = cal.scales()
        model = ReplayModel(self.curves, self.lattice.config.degrees, self.weights, scales,
                            cal.overhead_s)  # fmt: skip
        window = self.forecast.window(now)
        n = len(window.samples)
        dilation = max(1.0, n / cfg.replay_requests)
        forecast = model.prepare(window.samples, window.start_s, dilation, window.span_s)
        backlog_scale = {c: sum(s) / len(s) for c, s in scales.items()}
        active = [w for w in self.lattice.workers.values() if w.state is WorkerState.ACTIVE]
        max_moves = max(1, int(cfg.max_moves_fraction * len(active)))
        loads = inputs.loads
        cands = candidates(
            self.lattice,
            inputs,
            self.in_flight,
            max_moves,
            backlog_scale,
            cal.switch_s,
            lambda op: self._score(op, loads),
            self.forecast.by_id.get,
        )
        audits = []
        for index, period in sorted(self._periods.items()):
            if len(period.ttft_s) < len(period.samples):
                continue
            del self._periods[index]
            if not period.undisturbed or not period.samples:
                continue
            measured = sum(period.ttft_s.values()) / len(period.ttft_s)
            d = max(1.0, len(period.samples) / cfg.replay_requests)
            replayed = model.prepare(period.samples, period.start_s, d)
            audits.append((index, replayed, period.workers, measured))
        for index in [i for i in self._periods if i < self.window - 6]:
            del self._periods[index]  # requests never answered (abandoned): no audit
        return WhatIfPlan(now, model, forecast, tuple(cands), tuple(audits), n,
                          window.rate_changed)  # fmt: skip

    @staticmethod
    def evaluate(plan: WhatIfPlan) -> Evaluation:
        """The replays: a pure function of the plan (safe off the event loop)."""
        model, forecast = plan.model, plan.forecast
        nexts, steadies = [], []
        for cand in plan.candidates:
            head = model.prepare(
                [
                    ArrivalSample(s.request_id, 0.0, s.input_tokens, s.holders, s.prefix_key)
                    for s in cand.requeued
                ],
                0.0,
                forecast.dilation,
            )
            combined = _concat(head, forecast) if head.offsets else forecast
            if forecast.offsets or head.offsets:
                nexts.append(model.run(combined, cand.next_workers, cand.remap))
                steadies.append(model.run(forecast, cand.steady_workers, cand.remap))
            else:
                nexts.append(ReplayResult(0.0, 0, 0.0, 0.0))
                steadies.append(ReplayResult(0.0, 0, 0.0, 0.0))
        audits = tuple(
            (index, model.run(replayed, workers).mean_ttft_s, measured)
            for index, replayed, workers, measured in plan.audits
        )
        return Evaluation(tuple(nexts), tuple(steadies), audits)

    def conclude(self, plan: WhatIfPlan, evaluation: Evaluation) -> Decision:
        cfg, cal = self.config, self.calibration
        for index, predicted, measured in evaluation.audits:
            cal.audit(index, predicted, measured)
        w = cfg.next_weight
        scores = [
            (w * nx.mean_ttft_s + (1 - w) * st.mean_ttft_s) * (1 + cfg.op_cost * len(c.ops))
            for c, nx, st in zip(plan.candidates, evaluation.next, evaluation.steady, strict=True)
        ]
        hold = scores[0]
        best = min(range(len(scores)), key=lambda k: (scores[k], k))
        gain = (hold - scores[best]) / hold if hold > 0 else 0.0
        margin = min(cfg.urgent_gain, cfg.margin + cfg.audit_weight * cal.error)
        steady_hold = evaluation.steady[0]
        n_hold = len(plan.candidates[0].steady_workers)
        busy = steady_hold.busy_s / (n_hold * steady_hold.span_s) if steady_hold.span_s else 0.0
        urgent = gain >= cfg.urgent_gain
        first = self.forecast.first_arrival_s
        warming = first is None or plan.now - first < cfg.warmup_s
        chosen = plan.candidates[best]
        ops: tuple[Reshape, ...] = ()
        # The streak: consecutive decisions whose best candidate is the same kind of
        # move (direction and level), with their gains.
        key = (chosen.kind, chosen.level)
        if plan.forecast_requests == 0 or best == 0:
            self._streak = None
        elif self._streak is not None and self._streak[0] == key:
            self._streak = (key, [*self._streak[1][1 - cfg.confirm_decisions :], gain])
        else:
            self._streak = (key, [gain])
        gains = self._streak[1] if self._streak is not None else []
        confirmed = (
            len(gains) >= cfg.confirm_decisions
            and sum(gains[-cfg.confirm_decisions :]) / cfg.confirm_decisions >= margin
        )
        if plan.forecast_requests == 0 or best == 0 or (gain < margin and not confirmed):
            rule = "hold"
        elif warming and not (urgent and busy >= cfg.overload_utilisation):
            rule = "hold:warm-up"
        elif self.in_flight and not urgent:
            rule = "hold:reshapes-in-flight"
        elif not urgent and not confirmed:
            rule = "hold:confirming"
        else:
            ops = tuple(op for op in chosen.ops if self._still_possible(op))
            rule = f"{chosen.kind}:{'urgent' if urgent else 'whatif'}" if ops else "hold:stale"
            self._streak = None
        self.in_flight.extend(ops)
        inputs: dict[str, Any] = {
            "mode": "whatif",
            "forecast_requests": plan.forecast_requests,
            "dilation": plan.forecast.dilation,
            "rate_changed": plan.rate_changed,
            "margin": margin,
            "gain": gain,
            "urgent": urgent,
            "warming": warming,
            "busy_fraction": busy,
            "chosen": chosen.name if ops else plan.candidates[0].name,
            "candidates": [
                {
                    "composition": c.name,
                    "move": c.kind if not c.ops else f"{len(c.ops)} {c.kind}",
                    "level": c.level,
                    "next_s": nx.mean_ttft_s,
                    "steady_s": st.mean_ttft_s,
                    "score_s": score,
                }
                for c, nx, st, score in zip(
                    plan.candidates, evaluation.next, evaluation.steady, scores, strict=True
                )
            ],
            "calibration": cal.to_json(),
        }
        decision = self._close(rule, ops, inputs)
        self._open_period(plan.now, plan.candidates[0], bool(ops))
        return decision

    def _still_possible(self, op: Reshape) -> bool:
        """The pool may have moved while the replays ran (a server): the op's
        workers must still be active and in no other reshape."""
        busy = {s for other in self.in_flight for s in other.sources}
        return all(
            s in self.lattice.workers
            and self.lattice.workers[s].state is WorkerState.ACTIVE
            and s not in busy
            for s in op.sources
        )

    def _close(self, rule: str, ops: Sequence[Reshape], inputs: dict[str, Any]) -> Decision:
        demand, n = self._demand_s, self._requests
        long_fraction = self._long / n if n else 0.0
        inputs["requests"] = n
        decision = Decision(
            self.window, rule, tuple(ops), demand, self.capacity_s(), long_fraction, inputs
        )
        self.history.append(decision)
        self.window += 1
        self._demand_s, self._requests, self._long = 0.0, 0, 0
        return decision

    def _open_period(self, now: float, hold: Candidate, reshaping: bool) -> None:
        previous = self._period
        if previous is not None:
            previous.undisturbed = previous.undisturbed and self._undisturbed()
            self._periods[previous.index] = previous
        start_workers = tuple(w for w in hold.next_workers if w.worker_id in self.lattice.workers)
        undisturbed = not reshaping and self._undisturbed()
        self._period = _Period(self.window, now, start_workers, undisturbed)

    def _undisturbed(self) -> bool:
        return not self.in_flight and all(
            w.state is WorkerState.ACTIVE for w in self.lattice.workers.values()
        )


def _concat(head: PreparedForecast, tail: PreparedForecast) -> PreparedForecast:
    return PreparedForecast(
        head.offsets + tail.offsets,
        head.keys + tail.keys,
        head.tokens + tail.tokens,
        head.e_pred + tail.e_pred,
        head.e_act + tail.e_act,
        head.holders + tail.holders,
        tail.dilation,
        tail.span_s,
    )
