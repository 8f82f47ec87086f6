"""An asyncio event loop on simulated time, for driving the coordinator like the
simulator drives the policy: when nothing is ready to run, the clock jumps to the
next timer instead of sleeping, so ``loop.time()`` is exactly each timer's
deadline when it fires and a long scenario runs in a moment.

Real I/O still works (a thread's result reaching the loop wakes it), but a test on
this loop should keep everything in-process (``FakeRanks``). While a function given
to ``run_in_executor`` runs, the clock does not jump: the loop waits for it in real
time, as if it took no simulated time (so a restart's thread always lands before the
timers after it)."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        loop = self.loop
        assert loop is not None
        # Whatever is ready now (a thread's wake-up), without waiting.
        events = super().select(0)
        if events or timeout == 0:
            return events
        if loop.in_executor:  # a thread's work: wait for it, the clock still
            return super().select(None)
        due = loop.next_deadline()
        if due is None:
            return super().select(timeout)  # only real I/O can make progress
        loop.jump_to(due)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0
        # A timer is due when its deadline is under now + resolution: the clock jumps
        # to the deadline exactly, and this lets exactly that timer (and any within
        # 1e-12 s of it) run.
        self._clock_resolution = 1e-12
        self.in_executor = 0  # functions running in an executor

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        future = super().run_in_executor(executor, func, *args)
        self.in_executor += 1

        def done(_: asyncio.Future[Any]) -> None:
            self.in_executor -= 1

        future.add_done_callback(done)
        return future

    def time(self) -> float:
        return self._now

    def next_deadline(self) -> float | None:
        scheduled = [h for h in self._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
        return min((h.when() for h in scheduled), default=None)

    def jump_to(self, t: float) -> None:
        self._now = max(self._now, t)


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh ``VirtualTimeLoop``."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
