"""What the policy stack's calls return to its driver (``policy/pool_policy.py``).

    Started        a prefill to run now, with the allocation on the worker's cache
    Switch         a committed reshape: the epoch its new workers' ranks must adopt
    Actions        what to do after a call: wake workers, answer refusals, run the
                   copies or the switch the channel allows, note what ended
    Finished       a prefill's end, the actions it causes, its hand-off's hold
    WindowOutcome  the controller's decision, the reshapes it began, their actions
    ScanOutcome    the cache manager's scan, what it reclaimed, its actions
    WindowPlan     a decision in the making (its replays may run off the loop): the
                   rules' (``RulesWindow``) or the what-if controller's (``WhatIfWindow``)
    Running        the stack's record of a prefill under way

Plain dataclasses: the simulator reads them with its clock, the coordinator with
its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from vertumnus.policy.cache.audit import ScanRecord
from vertumnus.policy.cache.holds import Hold
from vertumnus.policy.cache.host_tier import Demotion, Load
from vertumnus.policy.cache.index import BlockAllocation, WorkerCacheIndex
from vertumnus.policy.cache.ledger import CopyJob
from vertumnus.policy.cache.plans import ScanResult
from vertumnus.policy.control.candidates import PoolInputs
from vertumnus.policy.control.decision import Decision
from vertumnus.policy.control.rules import DecisionSteps
from vertumnus.policy.control.search import Evaluation, WhatIfPlan
from vertumnus.policy.placement.scheduler import Placement
from vertumnus.policy.transition import Transition


@dataclass(frozen=True)
class Started:
    """A prefill to run now: the worker's head request and the allocation on its cache."""

    request_id: int
    worker_id: int
    cp_degree: int
    first_device: int
    allocation: BlockAllocation
    cached_tokens: int  # P: whole blocks the worker holds now or loads from its host tier
    exec_s: float  # E_C(L - P, P) from the profile, plus the load-back's seconds
    # The host tier (``cache/host_tier.py``): the blocks to write back before the
    # prefill's slots are written, the blocks to load back before it runs, its seconds
    demotions: tuple[Demotion, ...] = ()
    loads: tuple[Load, ...] = ()
    load_s: float = 0.0

    @property
    def loaded_tokens(self) -> int:
        """Tokens of ``cached_tokens`` loaded back from the host tier."""
        return self.allocation.loaded * (
            self.cached_tokens // max(1, self.allocation.prefix_blocks)
        )

    @property
    def devices(self) -> range:
        return range(self.first_device, self.first_device + self.cp_degree)


@dataclass(frozen=True)
class Switch:
    """A reshape committed: the ranks of its new workers must adopt ``epoch``; the
    channel is held until each has (``acknowledge``)."""

    transition: Transition
    epoch: int
    workers: tuple[tuple[int, tuple[int, ...]], ...]  # new worker -> its devices, CP order
    adopted_blocks: int  # KV left in place under the new geometry, indexed again
    reserved_blocks: int  # KV kept in reserved slots for fetches
    expire_at_s: float | None  # when those reservations end (None: none made)


@dataclass
class Actions:
    """What a driver must do after a call."""

    placed: list[Placement] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)  # request ids: answer them "unavailable"
    copies: list[CopyJob] = field(default_factory=list)  # move now, then ``copy_done`` each
    switch: Switch | None = None  # tell the new workers' ranks, then ``acknowledge``
    copies_ended: list[tuple[int, int]] = field(default_factory=list)  # (plan, installed)
    activated: list[Transition] = field(default_factory=list)  # reshapes now serving
    # Workers whose head request waited for a pull (a copy of its prefix) that ended:
    # they may start now.
    woken: list[int] = field(default_factory=list)

    def add(self, other: Actions) -> Actions:
        self.placed += other.placed
        self.refused += other.refused
        self.copies_ended += other.copies_ended
        self.activated += other.activated
        self.woken += other.woken
        self.copies += other.copies
        if other.switch is not None:
            assert self.switch is None, "one switch at a time"
            self.switch = other.switch
        return self


@dataclass(frozen=True)
class Finished:
    request_id: int
    actions: Actions
    ok: bool = True  # False: it failed (or its KV went with a reset): place it again or drop it
    hold: Hold | None = None  # the hand-off's pinned KV, when ``finish`` was asked to hold


@dataclass(frozen=True)
class WindowOutcome:
    decision: Decision
    begun: tuple[Transition, ...]  # reshapes that started draining
    actions: Actions


@dataclass(frozen=True)
class ScanOutcome:
    result: ScanResult
    reclaimed: int  # replicas deleted
    actions: Actions
    record: ScanRecord  # the audit's record of this scan (``cache.audit``)


@dataclass
class Running:
    """A worker's prefill under way (the stack's own record)."""

    request_id: int
    allocation: BlockAllocation
    index: WorkerCacheIndex  # the index the allocation is on (a reset worker gets a new one)
    started_s: float
    exec_s: float  # predicted
    cp_degree: int
    input_tokens: int


PlanT = TypeVar("PlanT")
EvalT = TypeVar("EvalT")


@dataclass(frozen=True)
class _Window(Generic[PlanT, EvalT]):
    """A decision in the making: ``evaluate`` (the controller's replays; pure, safe
    off the event loop), then ``PoolPolicy.finish_window``, which ``conclude``s."""

    controller: DecisionSteps[PlanT, EvalT]
    plan: PlanT

    def evaluate(self) -> EvalT:
        return self.controller.evaluate(self.plan)


@dataclass(frozen=True)
class RulesWindow(_Window[PoolInputs, None]):
    def conclude(self, evaluation: object) -> Decision:
        """``evaluation``: what ``evaluate`` returned (the driver passes it on)."""
        if evaluation is not None:
            raise TypeError(f"the rules evaluate nothing, got {type(evaluation).__name__}")
        return self.controller.conclude(self.plan, None)


@dataclass(frozen=True)
class WhatIfWindow(_Window[WhatIfPlan, Evaluation]):
    def conclude(self, evaluation: object) -> Decision:
        """``evaluation``: what ``evaluate`` returned (the driver passes it on)."""
        if not isinstance(evaluation, Evaluation):
            raise TypeError(f"not a what-if evaluation: {type(evaluation).__name__}")
        return self.controller.conclude(self.plan, evaluation)


WindowPlan = RulesWindow | WhatIfWindow
WindowEvaluation = Evaluation | None  # what a ``WindowPlan``'s ``evaluate`` returns
