"""The workers' tasks: one asyncio task per worker, running its queue one prefill
at a time while the worker exists.

A worker's task sleeps until woken (``wake``: a placement on it, a worker back from
recovery, a switch's new worker; the switchboard calls it), then takes the head of its
queue from the policy (the request path's ``start``: ``PoolPolicy.start`` and the
host-tier copies it asks for) and runs it (the request path's ``run_one``) until
the queue is empty. A bug in one step is contained (the request path's
``contain`` answers it) and the loop goes on. What a step does is
``request_path.py``'s; which request a worker runs is the policy's.
"""

from __future__ import annotations

import asyncio

from vertumnus.policy.pool_results import Started
from vertumnus.runtime.request_path import RequestPath
from vertumnus.runtime.state import Shared

BUG_PAUSE_S = 0.05  # a worker's loop waits this long after a step that failed with a bug


class WorkerLoops:
    """Given what the parts share (the policy stack: its queues and workers; the
    clock) and the request path, whose steps the tasks run."""

    def __init__(self, shared: Shared, requests: RequestPath) -> None:
        self.policy, self.clock, self.requests = shared.policy, shared.clock, requests
        self._wake: dict[int, asyncio.Event] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._idle: set[int] = set()  # workers whose task waits to be woken
        self._next: dict[int, Started] = {}  # started by ``wake``, to run next

    def add_worker(self, worker_id: int) -> None:
        self._wake[worker_id] = asyncio.Event()
        self._tasks[worker_id] = asyncio.create_task(self._worker_loop(worker_id))

    def remove_worker(self, worker_id: int) -> None:
        self._wake.pop(worker_id, None)
        # A prefill started by ``wake`` and not yet sent: the policy counts it as
        # running, and the removal (a failure) gives it back to be placed again.
        self._next.pop(worker_id, None)
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()

    def wake(self, worker_id: int) -> None:
        wake = self._wake.get(worker_id)
        if wake is None:
            return
        if worker_id in self._idle and worker_id not in self._next:
            # An idle worker starts now, as in the simulator: what a start does to the
            # caches (the evictions its slots cause, reported at once) must come before
            # the placement of a request that arrives at the same moment.
            started = self.requests.start(worker_id, self.clock())
            if started is not None:
                self._next[worker_id] = started
        wake.set()

    def cancel_all(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    async def _worker_loop(self, worker_id: int) -> None:
        """Runs the worker's queue, one prefill at a time, while the worker exists.
        A bug in one step is contained (``RequestPath.contain``): that request is answered with
        an error, the policy's record of the step is closed, and the loop goes on."""
        wake = self._wake[worker_id]
        policy = self.policy
        while True:
            self._idle.add(worker_id)
            try:
                await wake.wait()
            finally:
                self._idle.discard(worker_id)
            wake.clear()
            started = self._next.pop(worker_id, None)
            try:
                while True:
                    if started is None:
                        started = self.requests.start(worker_id, self.clock())
                        if started is None:
                            break
                    await self.requests.run_one(started)
                    started = None
            except Exception as exc:  # a bug: say so loudly, keep the worker serving
                self.requests.contain(worker_id, started, exc)
                await asyncio.sleep(BUG_PAUSE_S)  # (no tight loop if it fails again)
                wake.set()
            if worker_id not in policy.lattice.workers:
                return
