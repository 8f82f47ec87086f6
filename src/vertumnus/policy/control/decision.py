"""What a controller's window or decision period ends with: the rule that fired,
the reshapes it begins, its demand and capacity, and the inputs it read (for the
logs, the timeline and the simulator's results). Every controller (``rules``,
``whatif``) returns one ``Decision`` per period.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vertumnus.policy.lattice import Reshape


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
