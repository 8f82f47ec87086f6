"""The window controller: when to split or merge, and which worker (DESIGN.md §6).

Windows of H seconds. In window k, demand D_k = the sum over arriving requests of
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
  3. demand stable (|D_k - D_k-1| <= ``stable_demand`` * D_k-1) and f_k above its
     reference by ``long_shift`` for ``long_after_windows`` windows -> merge, only if
     the merged composition keeps rho under ``upper``; below it -> split, unless rho
     is under ``lower`` (capacity wins: it says merge)
  4. otherwise hold.

The rules come in that order, so capacity wins over the long-fraction signal. At
most ``max_concurrent_reshapes`` reshapes run at once (draining many workers at once
leaves nowhere to route). The lattice's bounds (workers per degree) limit the
options. Among the allowed options the controller picks the smallest predicted drain
time (the most outstanding work among the participants), then the least expected KV
reconciliation traffic (from the trie), then the lowest device.

Every ``Decision`` carries the rule that fired and its inputs, for logs and the
timeline. Pure Python, clock-free. Not owned here: executing a reshape
(``transition``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vertumnus.policy.lattice import Lattice, LatticeError, Reshape, WorkerState


@dataclass(frozen=True)
class ControllerConfig:
    window_s: float = 30.0
    upper_fraction: float = 0.85
    lower_fraction: float = 0.45
    split_after_windows: int = 1
    merge_after_windows: int = 3
    long_tokens: int = 32_768
    long_shift: float = 0.10
    stable_demand: float = 0.15
    long_after_windows: int = 3
    max_splits_per_window: int = 4
    max_concurrent_reshapes: int = 2

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise LatticeError("window_s must be > 0")
        if not 0 < self.lower_fraction < self.upper_fraction:
            raise LatticeError("need 0 < lower_fraction < upper_fraction")
        windows = (self.split_after_windows, self.merge_after_windows, self.long_after_windows)
        if min(windows) < 1:
            raise LatticeError("persistence must be at least one window")
        if self.max_splits_per_window < 1 or self.max_concurrent_reshapes < 1:
            raise LatticeError("max_splits_per_window and max_concurrent_reshapes must be >= 1")
        if not (self.long_shift > 0 and self.stable_demand >= 0 and self.long_tokens >= 1):
            raise LatticeError("long_shift must be > 0, stable_demand >= 0, long_tokens >= 1")


@dataclass(frozen=True)
class Decision:
    window: int
    rule: str  # "split:capacity", "merge:capacity", "merge:long-fraction", ... "hold"
    ops: tuple[Reshape, ...]
    demand_s: float
    capacity_s: float
    long_fraction: float
    inputs: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "rule": self.rule,
            "ops": [
                {"kind": op.kind, "sources": list(op.sources), "degree": op.target_degree}
                for op in self.ops
            ],
            "demand_s": self.demand_s,
            "capacity_s": self.capacity_s,
            "long_fraction": self.long_fraction,
            **dict(self.inputs),
        }


TrafficFn = Callable[[Reshape], float]  # expected KV reconciliation traffic of a reshape


class Controller:
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
        self._prev_demand_s: float | None = None
        self._over = self._under = self._rising = self._falling = 0
        self._long_reference: float | None = None
        self.history: list[Decision] = []

    # -- inputs ----------------------------------------------------------------------

    def record(self, exec_s: float, input_tokens: int) -> None:
        """One arrival of this window, with E at the worker it was placed on."""
        self._demand_s += exec_s
        self._requests += 1
        self._long += input_tokens > self.config.long_tokens

    def reshape_done(self, op: Reshape) -> None:
        """The driver finished ``op`` (its new workers are active, or it was given up)."""
        self.in_flight.remove(op)

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

    # -- the decision ----------------------------------------------------------------

    def end_window(self, loads: Mapping[int, float]) -> Decision:
        """Close the window; ``loads`` is each worker's outstanding predicted work."""
        cfg = self.config
        demand, n = self._demand_s, self._requests
        long_fraction = self._long / n if n else 0.0
        capacity = self.capacity_s()
        rho = demand / capacity if capacity > 0 else float("inf")
        self._over = self._over + 1 if rho > cfg.upper_fraction else 0
        self._under = self._under + 1 if rho < cfg.lower_fraction else 0
        prev = self._prev_demand_s
        stable = prev is not None and abs(demand - prev) <= cfg.stable_demand * max(prev, 1e-12)
        if not stable or n == 0 or self._long_reference is None:
            self._long_reference = long_fraction
            self._rising = self._falling = 0
        else:
            shift = long_fraction - self._long_reference
            self._rising = self._rising + 1 if shift >= cfg.long_shift else 0
            self._falling = self._falling + 1 if shift <= -cfg.long_shift else 0
        inputs: dict[str, Any] = {
            "requests": n,
            "rho": rho,
            "over_windows": self._over,
            "under_windows": self._under,
            "demand_stable": stable,
            "long_reference": self._long_reference,
            "rising_windows": self._rising,
            "falling_windows": self._falling,
            "reshapes_in_flight": len(self.in_flight),
        }
        rule, ops = self._rule(demand, rho, loads, inputs)
        for op in ops:
            self.in_flight.append(op)
        if ops:
            self._long_reference = long_fraction
            self._rising = self._falling = 0
            if ops[0].kind == "split":
                self._over = 0
            else:
                self._under = 0
        decision = Decision(self.window, rule, tuple(ops), demand, capacity, long_fraction, inputs)
        self.history.append(decision)
        self.window += 1
        self._prev_demand_s = demand
        self._demand_s, self._requests, self._long = 0.0, 0, 0
        return decision

    def _rule(
        self, demand: float, rho: float, loads: Mapping[int, float], inputs: dict[str, Any]
    ) -> tuple[str, list[Reshape]]:
        cfg = self.config
        room = cfg.max_concurrent_reshapes - len(self.in_flight)
        wants_split = self._over >= cfg.split_after_windows
        wants_merge = self._under >= cfg.merge_after_windows
        long_merge = self._rising >= cfg.long_after_windows and rho <= cfg.upper_fraction
        long_split = self._falling >= cfg.long_after_windows and rho >= cfg.lower_fraction
        if not (wants_split or wants_merge or long_merge or long_split):
            return "hold", []
        if room <= 0:
            return "hold:reshapes-in-flight", []
        if wants_split or long_split:
            limit = min(room, cfg.max_splits_per_window) if wants_split else 1
            ops = self._pick_splits(demand, limit, loads, until_fits=wants_split, inputs=inputs)
            if not ops:
                return "hold:no-split-allowed", []
            return ("split:capacity" if wants_split else "split:long-fraction"), ops
        # A merge: by capacity it must keep rho under the mid-point; by the long
        # fraction, under the upper threshold (capacity wins).
        ceiling = (
            (cfg.lower_fraction + cfg.upper_fraction) / 2 if wants_merge else cfg.upper_fraction
        )
        op = self._pick_merge(demand, ceiling, loads, inputs)
        if op is None:
            if inputs["merges_refused"]:
                return "hold:merge-refused-capacity", []
            return "hold:no-merge-allowed", []
        return ("merge:capacity" if wants_merge else "merge:long-fraction"), [op]

    def _score(self, op: Reshape, loads: Mapping[int, float]) -> tuple[float, float, int]:
        drain_s = max(loads.get(s, 0.0) for s in op.sources)
        return (drain_s, self.traffic(op), min(op.target_firsts))

    def _pick_splits(
        self,
        demand: float,
        limit: int,
        loads: Mapping[int, float],
        until_fits: bool,
        inputs: dict[str, Any],
    ) -> list[Reshape]:
        busy = {s for op in self.in_flight for s in op.sources}
        options = [op for op in self.lattice.split_options() if op.sources[0] not in busy]
        options.sort(key=lambda op: self._score(op, loads))
        inputs["split_options"] = [
            {
                "worker": op.sources[0],
                "drain_s": self._score(op, loads)[0],
                "traffic": self._score(op, loads)[1],
            }
            for op in options
        ]
        counts = self.planned_composition()
        chosen: list[Reshape] = []
        bounds = self.lattice.config
        for op in options:
            if len(chosen) >= limit:
                break
            degree = self.lattice.workers[op.sources[0]].cp_degree
            after = counts.copy()
            after[degree] -= 1
            after[op.target_degree] += 2
            if not bounds.within_bounds(after):
                continue
            chosen.append(op)
            counts = after
            if until_fits and demand <= self.config.upper_fraction * self.capacity_s(counts):
                break
        return chosen

    def _pick_merge(
        self, demand: float, ceiling: float, loads: Mapping[int, float], inputs: dict[str, Any]
    ) -> Reshape | None:
        busy = {s for op in self.in_flight for s in op.sources}
        counts = self.planned_composition()
        admitted, refused = [], []
        for op in self.lattice.merge_options():
            if busy & set(op.sources):
                continue
            degree = self.lattice.workers[op.sources[0]].cp_degree
            after = counts.copy()
            after[degree] -= 2
            after[op.target_degree] += 1
            if not self.lattice.config.within_bounds(after):
                continue
            merged_capacity = self.capacity_s(after)
            if demand <= ceiling * merged_capacity:
                admitted.append(op)
            else:
                refused.append((op, merged_capacity))
        inputs["merge_ceiling"] = ceiling
        inputs["merges_refused"] = [
            {"workers": list(op.sources), "merged_capacity_s": cap} for op, cap in refused
        ]
        if not admitted:
            return None
        admitted.sort(key=lambda op: self._score(op, loads))
        inputs["merge_options"] = [
            {
                "workers": list(op.sources),
                "drain_s": self._score(op, loads)[0],
                "traffic": self._score(op, loads)[1],
            }
            for op in admitted
        ]
        return admitted[0]
