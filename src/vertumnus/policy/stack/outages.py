"""Rank failures, as the policy stack sees them: a worker out, reset, back, or given up.

A worker whose rank died or hung leaves the candidate set (its queue is placed
again); while its ranks restart, requests that find no worker wait for it rather
than being refused (``down``: the devices of failed workers that are coming back).
A reset worker's cache is gone: the trie forgets what it held, the KV ledger what
was retained on its ranks. The driver (the coordinator's ``Recovery``) decides
when each step happens. Each step returns what the root must do next (a ``Step``:
the drained queue to place again, the waiting requests to retry); a reset's
cache is forgotten (``Wipe``) only once its queue is placed elsewhere. Pure
Python, clock-free. Not owned here: placing requests (``admission``, through the
root).
"""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.stack.intents import Requeue, RetryWaiting, Step, Wipe
from vertumnus.policy.stack.state import StackState


class Outages:
    """Given the stack's state: the failed workers' devices that are coming back
    (``down``) live there, where ``Admission`` asks whether someone is coming."""

    def __init__(self, state: StackState) -> None:
        self.state = state
        self.lattice, self.scheduler, self.cache = state.lattice, state.scheduler, state.cache
        self.ledger, self.holds = state.ledger, state.holds

    @property
    def down(self) -> set[int]:
        """Devices of failed workers that are coming back."""
        return self.state.down

    def failed(self, worker_id: int, now: float) -> Step:
        """A rank of the worker died or hung. An active worker leaves the candidate
        set now and its queued requests are placed again; one in a reshape finishes
        the reshape first (the driver resets it after). Requests that find no worker
        wait while it is coming back."""
        w = self.lattice.workers[worker_id]
        self.down.update(w.devices)
        if w.state is not WorkerState.ACTIVE:
            return Step()
        self.lattice.fail(worker_id)
        return self._requeue(worker_id)

    def reset(self, worker_id: int, now: float) -> Step:
        """The failed worker's ranks restart: its queue is placed again, then its
        cache is gone (``Wipe``). Its running prefill, if any, still ends with
        ``finish``."""
        w = self.lattice.workers[worker_id]
        self.down.update(w.devices)
        if w.state is not WorkerState.UNAVAILABLE:
            self.lattice.fail(worker_id)
        requeue = self._requeue(worker_id).then
        return Step(then=(*requeue, Wipe(worker_id, tuple(w.devices))))

    def wipe(self, worker_id: int, devices: Sequence[int]) -> None:
        """The reset worker's cache is gone: the trie, the ledger and the hand-offs
        forget it, and its cache index goes."""
        if worker_id in self.cache.trie.workers:
            self.cache.remove_worker(worker_id)
        self.ledger.drop_ranks(devices)
        self.holds.drop_worker(worker_id)  # its KV is gone: the hand-offs' pulls are moved
        self.state.indexes.pop(worker_id, None)

    def restored(self, worker_id: int, now: float) -> Step:
        """The worker's ranks are back, its cache empty: it serves again."""
        w = self.lattice.workers[worker_id]
        if worker_id not in self.state.indexes:
            self.state.add_worker(worker_id)
        self.lattice.restore(worker_id)
        self.down.difference_update(w.devices)
        return Step(then=(RetryWaiting(),))

    def abandoned(self, worker_id: int, now: float) -> Step:
        """The driver gave up restarting the worker: it stays out, and requests
        waiting only for it are refused."""
        w = self.lattice.workers.get(worker_id)
        if w is not None:
            self.down.difference_update(w.devices)
        return Step(then=(RetryWaiting(),))

    def _requeue(self, worker_id: int) -> Step:
        drained = self.scheduler.drain(worker_id)
        return Step(then=(Requeue(tuple(r.request_id for r in drained)),))
