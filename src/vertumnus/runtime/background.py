"""The coordinator's background tasks (a switch carried out, a copy job, a recovery,
a decision's replay): each kept referenced until it ends, and one that fails (a bug)
logged with its traceback and counted, never lost in silence. What a task does is
its part's; nothing here cancels or waits for one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from vertumnus.runtime.metrics import Metrics


class Background:
    """Given the metrics, where a task that failed is counted."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task of the running loop, kept until it ends."""
        task = asyncio.create_task(coro, name=getattr(coro, "__qualname__", None))
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self.metrics.bug("task", "task_failed", exc, task=task.get_name())
