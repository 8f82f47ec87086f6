"""Rank failures, as the policy stack sees them: a worker out, reset, back, or given up.

A worker whose rank died or hung leaves the candidate set (its queue is placed
again); while its ranks restart, requests that find no worker wait for it rather
than being refused (``down``: the devices of failed workers that are coming back).
A reset worker's cache is gone: the trie forgets what it held, the KV ledger what
was retained on its ranks. The driver (the coordinator's ``Recovery``) decides
when each step happens. Pure Python, clock-free.
"""

from __future__ import annotations

from collections.abc import Callable

from vertumnus.policy.cache.holds import Holds
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.policy.cache.ledger import KVLedger
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.lattice import Lattice, WorkerState
from vertumnus.policy.placement.scheduler import Scheduler
from vertumnus.policy.pool_results import Actions


class Outages:
    """Given the stack's parts it changes, and the three acts of the stack it needs:
    ``place`` a request again, ``add_worker`` (a fresh cache index), and
    ``retry_waiting`` (the requests that wait for a worker)."""

    def __init__(
        self,
        lattice: Lattice,
        scheduler: Scheduler,
        cache: PrefixCacheManager,
        ledger: KVLedger,
        holds: Holds,
        indexes: dict[int, WorkerCacheIndex],
        place: Callable[[int, float], Actions],
        add_worker: Callable[[int], None],
        retry_waiting: Callable[[float], Actions],
    ) -> None:
        self.lattice, self.scheduler, self.cache = lattice, scheduler, cache
        self.ledger, self.holds, self.indexes = ledger, holds, indexes
        self.place, self.add_worker, self.retry_waiting = place, add_worker, retry_waiting
        self.down: set[int] = set()  # devices of failed workers that are coming back

    def failed(self, worker_id: int, now: float) -> Actions:
        """A rank of the worker died or hung. An active worker leaves the candidate
        set now and its queued requests are placed again; one in a reshape finishes
        the reshape first (the driver resets it after). Requests that find no worker
        wait while it is coming back."""
        w = self.lattice.workers[worker_id]
        self.down.update(w.devices)
        if w.state is not WorkerState.ACTIVE:
            return Actions()
        self.lattice.fail(worker_id)
        return self._requeue(worker_id, now)

    def reset(self, worker_id: int, now: float) -> Actions:
        """The failed worker's ranks restart: its cache is gone, its queue is placed
        again. Its running prefill, if any, still ends with ``finish``."""
        w = self.lattice.workers[worker_id]
        self.down.update(w.devices)
        if w.state is not WorkerState.UNAVAILABLE:
            self.lattice.fail(worker_id)
        actions = self._requeue(worker_id, now)
        if worker_id in self.cache.trie.workers:
            self.cache.remove_worker(worker_id)
        self.ledger.drop_ranks(w.devices)
        self.holds.drop_worker(worker_id)  # its KV is gone: the hand-offs' pulls are moved
        self.indexes.pop(worker_id, None)
        return actions

    def restored(self, worker_id: int, now: float) -> Actions:
        """The worker's ranks are back, its cache empty: it serves again."""
        w = self.lattice.workers[worker_id]
        if worker_id not in self.indexes:
            self.add_worker(worker_id)
        self.lattice.restore(worker_id)
        self.down.difference_update(w.devices)
        return self.retry_waiting(now)

    def abandoned(self, worker_id: int, now: float) -> Actions:
        """The driver gave up restarting the worker: it stays out, and requests
        waiting only for it are refused."""
        w = self.lattice.workers.get(worker_id)
        if w is not None:
            self.down.difference_update(w.devices)
        return self.retry_waiting(now)

    def _requeue(self, worker_id: int, now: float) -> Actions:
        actions = Actions()
        for request in self.scheduler.drain(worker_id):
            actions.add(self.place(request.request_id, now))
        return actions
