"""The coordinator's periodic work, on one timer: the controller's window (its
decision), the cache manager's scan and the expiry of reserved KV, in that order
when they fall together (as in the simulator).

The decision reads the pool on the event loop, runs its replays on its own thread
(off the loop; inline when ``offload`` is off, as the simulator runs them) and is
applied when they are done; a period whose decision is still being computed when
the next is due is skipped. The scan runs after the workers this tick's decision
woke have started their prefills. A bug in one piece is logged with its traceback
and counted, and the next tick is set whatever happens. With the event loop's own
(simulated) clock as ``clock``, deadlines are exact. A decision's actions go to the
switchboard (``Apply``); the reshapes it began to ``Reshaping.begun`` first.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from vertumnus.policy.pool_results import WindowPlan
from vertumnus.runtime.intents import Apply
from vertumnus.runtime.kv.copies import CopyRuns
from vertumnus.runtime.reshaping import Reshaping
from vertumnus.runtime.state import Shared

log = structlog.get_logger("vertumnus")


class Periodic:
    def __init__(
        self, shared: Shared, copies: CopyRuns, reshaping: Reshaping, offload: bool = True
    ) -> None:
        """``copies``: runs the scans; ``reshaping``: a reshape the controller began
        (``Reshaping.begun``); ``offload``: the replays run on their own thread."""
        self.cfg, self.policy, self.metrics = shared.cfg, shared.policy, shared.metrics
        self.health, self.clock, self.switchboard = shared.health, shared.clock, shared.switchboard
        self.background, self.copies, self.reshaping = shared.background, copies, reshaping
        self.offload = offload
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._next_window = self._next_scan = math.inf
        self._windows_started_s: float | None = None
        self._decider = ThreadPoolExecutor(1, thread_name_prefix="vertumnus-decide")
        self._deciding = False
        self.decision_s: list[float] = []  # wall time of recent decisions' replays
        self.decisions: deque[dict[str, Any]] = deque(maxlen=100)  # recent, as JSON

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The first tick is set: the pool serves from now on."""
        self._loop = loop
        now = self.clock()
        self._windows_started_s = now
        self._next_window = now + self.cfg.policy.controller.period_s
        if self.cfg.policy.replication:
            self._next_scan = now + self.cfg.policy.scan_interval_s
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        loop = self._loop
        assert loop is not None
        expiry = self.policy.ledger.next_deadline()
        due = min(self._next_window, self._next_scan, math.inf if expiry is None else expiry)
        if self._tick is not None:
            self._tick.cancel()
        own_clock: object = getattr(self.clock, "__self__", None)
        if own_clock is loop:  # the loop's own clock (a simulated one): exact deadlines
            self._tick = loop.call_at(due, self._on_tick)
        else:
            self._tick = loop.call_later(max(0.0, due - self.clock()), self._on_tick)

    def _on_tick(self) -> None:
        """The periodic work that is due; the next tick is set whatever happens (a
        bug in one piece is logged with its traceback and counted)."""
        self._tick = None
        now = self.clock()
        try:
            if now >= self._next_window:
                self._next_window += self.cfg.policy.controller.period_s
                self._end_window(now)
            if now >= self._next_scan:
                self._next_scan += self.cfg.policy.scan_interval_s
                # After the workers this tick's decision woke have started their
                # prefills (their tasks run first), as the simulator orders it.
                assert self._loop is not None
                self._loop.call_soon(self._scan, now)
            expiry = self.policy.ledger.next_deadline()
            if expiry is not None and now >= expiry:
                released = self.policy.expire(now)
                if released:
                    log.info("retained_released", blocks=released)
        except Exception as exc:
            self.metrics.bug("task", "tick_failed", exc)
        finally:
            if not self.health.stopping:
                self._schedule_tick()

    def _scan(self, now: float) -> None:
        try:
            self.copies.scan(now)
        except Exception as exc:
            self.metrics.bug("task", "scan_failed", exc)

    def _end_window(self, now: float) -> None:
        """The controller's decision: the pool is read now, the replays run on the
        decision thread (off the event loop) unless ``offload_decisions`` is off, and
        the decision is applied when they are done. A period whose decision is still
        being computed when the next is due is skipped."""
        if self._deciding:
            log.warning("decision_skipped", reason="the previous decision is still computing")
            return
        plan = self.policy.prepare_window(now)
        if not self.offload:
            self._conclude(plan, plan.evaluate(), now)
            return
        self._deciding = True
        self.background.spawn(self._decide(plan))

    async def _decide(self, plan: WindowPlan) -> None:
        assert self._loop is not None
        try:
            started = time.perf_counter()
            evaluation = await self._loop.run_in_executor(self._decider, plan.evaluate)
            self.decision_s.append(time.perf_counter() - started)
            del self.decision_s[:-1000]
            if not self.health.stopping:
                self._conclude(plan, evaluation, self.clock())
        finally:
            self._deciding = False

    def _conclude(self, plan: WindowPlan, evaluation: object, now: float) -> None:
        outcome = self.policy.finish_window(plan, evaluation, now)
        decision = outcome.decision
        since = now - (self._windows_started_s or now)  # seconds since the server started
        self.decisions.append({"time_s": since, **decision.to_json()})
        del self.policy.controller.history[:-1000]  # a server runs for days
        if self.cfg.policy.adaptive and (decision.ops or "candidates" in decision.inputs):
            log.info("decision", **decision.to_json())
        self.metrics.timeline.decided(now, decision.inputs)
        for transition in outcome.begun:
            self.reshaping.begun(transition, decision.to_json(), len(outcome.actions.placed))
        self.switchboard.route(Apply(outcome.actions))

    def close(self) -> None:
        """The server stops: no tick fires any more, no decision is computed."""
        if self._tick is not None:
            self._tick.cancel()
        self._decider.shutdown(wait=False, cancel_futures=True)

    def phase_s(self) -> float | None:
        """How far into its current window the controller is (None before the start)."""
        if self._windows_started_s is None:
            return None
        return (self.clock() - self._windows_started_s) % self.cfg.policy.controller.period_s
