"""The window controller: when to split or merge, and which worker (the paper's rules:
docs/scheduling.md, "The lattice" and "The paper's rules").

Windows of H seconds. In window k, demand D_k = the sum over the requests first placed
in it (once each: not again when a drain or a failure places them anew) of
E_{C_w}(R, P) at the worker each was placed on, and f_k = the fraction of them longer
than ``long_tokens``. The capacity of the composition is the sum of kappa_C over its
workers, counting the outcome of reshapes already under way and nothing for an
unavailable worker. At each window end, with rho = D_k / capacity:

  1. rho > upper for ``split_after_windows`` windows (default 1: scale-out is
     urgent)                        -> split, as many as needed to bring rho under
                                       ``upper`` (up to ``max_splits_per_window``)
  2. rho < lower for ``merge_after_windows`` windows (default 3: scale-in is
     conservative)                  -> merge, admitted only if the merged
                                       composition keeps rho under the mid-point of
                                       lower and upper (so no split follows at once)
  3. the long-fraction signal, smoothed over L = ``long_after_windows`` windows: the
     mean demand of the last L windows within ``stable_demand`` of the L before, and
     their mean long fraction ``long_shift`` above the reference -> merge, only if
     the merged composition keeps rho under ``upper``; below it -> split, unless rho
     is under ``lower`` (capacity wins: it says merge). The reference is the mix the
     composition was last chosen for: it stays while the mix stays shifted, so the
     composition keeps moving, one reshape per L windows, until capacity or the
     bounds stop it; then (or after a capacity reshape) the present mix becomes the
     reference
  4. otherwise hold.

The rules come in that order, so capacity wins over the long-fraction signal. At
most ``max_concurrent_reshapes`` reshapes run at once (draining many workers at once
leaves nowhere to route). The lattice's bounds (workers per degree) limit the
options. Among the allowed options the controller picks the smallest predicted drain
time (the most outstanding work among the participants), then the least expected KV
reconciliation traffic (from the trie), then the lowest device (``options``).

Every ``Decision`` (``decision``) carries the rule that fired and its inputs, for
logs and the timeline. ``ControllerBase`` is what every controller shares (the
pool's capacity, the reshapes in flight, the hooks the stack calls); a controller's
decision is three typed steps, ``DecisionSteps[plan, evaluation]``: the rules'
are ``[PoolInputs, None]``, the what-if controller's ``[WhatIfPlan, Evaluation]``.
Pure Python, clock-free. Not owned here: executing a reshape (``transition``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from vertumnus.policy.control.candidates import PoolInputs
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.control.decision import Decision, TrafficFn
from vertumnus.policy.control.options import pick_merge, pick_splits
from vertumnus.policy.geometry import LatticeError
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Placement

__all__ = ["Controller", "ControllerBase", "DecisionSteps"]

PlanT = TypeVar("PlanT")
EvalT = TypeVar("EvalT")


class DecisionSteps(Protocol[PlanT, EvalT]):
    """A controller's decision in three steps, so that a server computes the costly
    middle one off its event loop."""

    def prepare(self, inputs: PoolInputs) -> PlanT:
        """Read the pool (on the driver's loop): the plan of this decision."""
        ...

    def evaluate(self, plan: PlanT) -> EvalT:
        """The plan's replays: pure, touches nothing shared, safe in a thread."""
        ...

    def conclude(self, plan: PlanT, evaluation: EvalT) -> Decision:
        """The decision and its bookkeeping (on the driver's loop)."""
        ...


class ControllerBase:
    """What every controller keeps: the window's demand, the reshapes in flight, the
    decisions made; and the hooks the stack calls."""

    def __init__(
        self,
        config: ControllerConfig,
        lattice: Lattice,
        kappa_s: Mapping[int, float],
        traffic: TrafficFn | None = None,
    ) -> None:
        missing = set(lattice.config.degrees) - set(kappa_s)
        if missing:
            raise LatticeError(f"no capacity kappa for degrees {sorted(missing)}")
        self.config = config
        self.lattice = lattice
        self.kappa_s = dict(kappa_s)
        self.traffic = traffic or (lambda op: 0.0)
        self.window = 0
        self.in_flight: list[Reshape] = []
        self._demand_s = 0.0
        self._requests = 0
        self._long = 0
        self.history: list[Decision] = []

    # -- inputs ----------------------------------------------------------------------

    def record(self, exec_s: float, input_tokens: int) -> None:
        """A request placed for the first time in this window (the policy stack
        calls this once per request), with E at the worker it was placed on."""
        self._demand_s += exec_s
        self._requests += 1
        self._long += input_tokens > self.config.long_tokens

    def reshape_done(self, op: Reshape) -> None:
        """The driver finished ``op`` (its new workers are active, or it was given up;
        or, in a fixed pool, only noted it: then it may not be in flight at all)."""
        if op in self.in_flight:
            self.in_flight.remove(op)

    def still_possible(self, op: Reshape) -> bool:
        """The pool may have moved since ``op`` was chosen (a server computes its
        decisions off the loop): its workers must still be active and in no other
        reshape."""
        busy = {s for other in self.in_flight for s in other.sources}
        workers = self.lattice.workers
        return all(
            s in workers and workers[s].state is WorkerState.ACTIVE and s not in busy
            for s in op.sources
        )

    def settled(self) -> bool:
        """No reshape under way and every worker serving."""
        return not self.in_flight and all(
            w.state is WorkerState.ACTIVE for w in self.lattice.workers.values()
        )

    def capacity_s(self, composition: Mapping[int, int] | None = None) -> float:
        counts = self.planned_composition() if composition is None else composition
        return sum(self.kappa_s[c] * n for c, n in counts.items())

    def planned_composition(self) -> Counter[int]:
        """Workers per degree once the reshapes under way finish (unavailable ones out)."""
        counts = self.lattice.composition(
            (WorkerState.ACTIVE, WorkerState.DRAINING, WorkerState.SWITCHING)
        )
        for op in self.in_flight:
            present = [s for s in op.sources if s in self.lattice.workers]
            if len(present) == len(op.sources):  # not yet committed
                for s in present:
                    counts[self.lattice.workers[s].cp_degree] -= 1
                counts[op.target_degree] += len(op.target_firsts)
        return counts

    # Hooks the what-if controller uses (the rules need none of them).

    def placed(self, request: PlacementRequest, placed: Placement, at_s: float, block: int) -> None:
        """A request placed for the first time, arrived at ``at_s`` (``block``: tokens
        per KV block)."""

    def started(self, request_id: int, worker_id: int, reused_tokens: int, key: int) -> None:
        """A request's prefill began at ``worker_id``, reusing ``reused_tokens``
        (``key``: the id of the last block reused)."""

    def completed(self, request_id: int, ttft_s: float) -> None:
        """A request's prefill ended, ``ttft_s`` after it arrived."""

    def prefill_done(
        self, cp_degree: int, input_tokens: int, predicted_s: float, busy_s: float,
        compute_s: float | None,
    ) -> None:  # fmt: skip
        """A prefill ended: predicted E, the worker's busy time, the ranks' compute."""

    def switch_done(self, switch_s: float) -> None:
        """A reshape's switch took ``switch_s``."""

    def _record(self, decision: Decision) -> Decision:
        """Keep ``decision`` and start the next window's demand from zero."""
        self.history.append(decision)
        self.window += 1
        self._demand_s, self._requests, self._long = 0.0, 0, 0
        return decision


class Controller(ControllerBase):
    """The paper's rules (the module docstring); ``DecisionSteps[PoolInputs, None]``."""

    def __init__(
        self,
        config: ControllerConfig,
        lattice: Lattice,
        kappa_s: Mapping[int, float],
        traffic: TrafficFn | None = None,
    ) -> None:
        super().__init__(config, lattice, kappa_s, traffic)
        self._over = self._under = 0
        self._history: list[tuple[float, float]] = []  # (demand, long fraction) per window
        self._long_reference: float | None = None
        self._since_long_action = 0

    # -- the decision: three steps (nothing to compute off the loop) -----------------

    def prepare(self, inputs: PoolInputs) -> PoolInputs:
        return inputs

    @staticmethod
    def evaluate(plan: PoolInputs) -> None:
        return None

    def conclude(self, plan: PoolInputs, evaluation: None) -> Decision:
        return self.end_window(plan.loads)

    def end_window(self, loads: Mapping[int, float]) -> Decision:
        """Close the window; ``loads`` is each worker's outstanding predicted work."""
        cfg = self.config
        demand, n = self._demand_s, self._requests
        long_fraction = self._long / n if n else 0.0
        capacity = self.capacity_s()
        rho = demand / capacity if capacity > 0 else float("inf")
        self._over = self._over + 1 if rho > cfg.upper_fraction else 0
        self._under = self._under + 1 if rho < cfg.lower_fraction else 0
        # The long-fraction signal, smoothed: the last L windows against the L before.
        length = cfg.long_after_windows
        self._since_long_action += 1
        self._history.append((demand, long_fraction))
        del self._history[: -2 * length]
        stable = rising = falling = False
        recent_long = None
        if len(self._history) == 2 * length:
            before, recent = self._history[:length], self._history[length:]
            demand_before = sum(d for d, _ in before) / length
            demand_recent = sum(d for d, _ in recent) / length
            recent_long = sum(f for _, f in recent) / length
            if self._long_reference is None:
                self._long_reference = sum(f for _, f in before) / length
            stable = abs(demand_recent - demand_before) <= cfg.stable_demand * max(
                demand_before, 1e-12
            )
            shift = recent_long - self._long_reference
            ready = self._since_long_action >= length
            rising = stable and ready and shift >= cfg.long_shift
            falling = stable and ready and shift <= -cfg.long_shift
        inputs: dict[str, Any] = {
            "requests": n,
            "rho": rho,
            "over_windows": self._over,
            "under_windows": self._under,
            "demand_stable": stable,
            "long_recent": recent_long,
            "long_reference": self._long_reference,
            "reshapes_in_flight": len(self.in_flight),
        }
        rule, ops = self._rule(demand, rho, loads, inputs, rising, falling)
        for op in ops:
            self.in_flight.append(op)
        if rule.endswith(":long-fraction"):
            # The reference stays: while the mix stays shifted, the composition keeps
            # moving (one reshape per L windows) until capacity or the bounds stop it.
            self._since_long_action = 0
        elif ops or rule in (
            "hold:merge-refused-capacity",
            "hold:no-merge-allowed",
            "hold:no-split-allowed",
        ):
            # A capacity reshape re-chose the composition, or the long signal could not
            # act: the present mix becomes the reference.
            self._long_reference = recent_long if recent_long is not None else long_fraction
        if ops and ops[0].kind == "split" and rule == "split:capacity":
            self._over = 0
        elif ops and rule == "merge:capacity":
            self._under = 0
        return self._record(
            Decision(self.window, rule, tuple(ops), demand, capacity, long_fraction, inputs)
        )

    def _rule(
        self,
        demand: float,
        rho: float,
        loads: Mapping[int, float],
        inputs: dict[str, Any],
        rising: bool,
        falling: bool,
    ) -> tuple[str, list[Reshape]]:
        cfg = self.config
        room = cfg.max_concurrent_reshapes - len(self.in_flight)
        wants_split = self._over >= cfg.split_after_windows
        wants_merge = self._under >= cfg.merge_after_windows
        long_merge = rising and rho <= cfg.upper_fraction
        long_split = falling and rho >= cfg.lower_fraction
        if not (wants_split or wants_merge or long_merge or long_split):
            return "hold", []
        if room <= 0:
            return "hold:reshapes-in-flight", []
        busy = {s for op in self.in_flight for s in op.sources}
        counts = self.planned_composition()

        def score(op: Reshape) -> tuple[float, float, int]:
            # least drain, then least reconciliation traffic, then the lowest device
            drain_s = max(loads.get(s, 0.0) for s in op.sources)
            return (drain_s, self.traffic(op), min(op.target_firsts))

        if wants_split or long_split:
            limit = min(room, cfg.max_splits_per_window) if wants_split else 1

            def fits(after: Mapping[int, int]) -> bool:
                return demand <= cfg.upper_fraction * self.capacity_s(after)

            until = fits if wants_split else None  # (capacity: as many as bring rho under upper)
            ops = pick_splits(self.lattice, busy, counts, score, limit, until, inputs)
            if not ops:
                return "hold:no-split-allowed", []
            return ("split:capacity" if wants_split else "split:long-fraction"), ops
        # A merge: by capacity it must keep rho under the mid-point; by the long
        # fraction, under the upper threshold (capacity wins).
        ceiling = (
            (cfg.lower_fraction + cfg.upper_fraction) / 2 if wants_merge else cfg.upper_fraction
        )
        op = pick_merge(self.lattice, busy, counts, score, self.capacity_s, demand, ceiling, inputs)
        if op is None:
            if inputs["merges_refused"]:
                return "hold:merge-refused-capacity", []
            return "hold:no-merge-allowed", []
        return ("merge:capacity" if wants_merge else "merge:long-fraction"), [op]
