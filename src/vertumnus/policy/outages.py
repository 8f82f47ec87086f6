"""Rank failures, as the policy stack sees them: a worker out, reset, back, or given up.

A worker whose rank died or hung leaves the candidate set (its queue is placed
again); while its ranks restart, requests that find no worker wait for it rather
than being refused (``down``: the devices of failed workers that are coming back).
A reset worker's cache is gone: the trie forgets what it held, the KV ledger what
was retained on its ranks. The driver (the coordinator's ``Recovery``) decides
when each step happens. Pure Python, clock-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_results import Actions

if TYPE_CHECKING:
    from vertumnus.policy.pool_policy import PoolPolicy


class Outages:
    def __init__(self, policy: PoolPolicy) -> None:
        self.policy = policy
        self.down: set[int] = set()  # devices of failed workers that are coming back

    def failed(self, worker_id: int, now: float) -> Actions:
        """A rank of the worker died or hung. An active worker leaves the candidate
        set now and its queued requests are placed again; one in a reshape finishes
        the reshape first (the driver resets it after). Requests that find no worker
        wait while it is coming back."""
        lattice = self.policy.lattice
        w = lattice.workers[worker_id]
        self.down.update(w.devices)
        if w.state is not WorkerState.ACTIVE:
            return Actions()
        lattice.fail(worker_id)
        return self._requeue(worker_id, now)

    def reset(self, worker_id: int, now: float) -> Actions:
        """The failed worker's ranks restart: its cache is gone, its queue is placed
        again. Its running prefill, if any, still ends with ``finish``."""
        policy = self.policy
        w = policy.lattice.workers[worker_id]
        self.down.update(w.devices)
        if w.state is not WorkerState.UNAVAILABLE:
            policy.lattice.fail(worker_id)
        actions = self._requeue(worker_id, now)
        if worker_id in policy.cache.trie.workers:
            policy.cache.remove_worker(worker_id)
        policy.ledger.drop_ranks(w.devices)
        policy.holds.drop_worker(worker_id)  # its KV is gone: the hand-offs' pulls are moved
        policy.indexes.pop(worker_id, None)
        return actions

    def restored(self, worker_id: int, now: float) -> Actions:
        """The worker's ranks are back, its cache empty: it serves again."""
        policy = self.policy
        w = policy.lattice.workers[worker_id]
        if worker_id not in policy.indexes:
            policy.add_worker(worker_id)
        policy.lattice.restore(worker_id)
        self.down.difference_update(w.devices)
        return policy.retry_waiting(now)

    def abandoned(self, worker_id: int, now: float) -> Actions:
        """The driver gave up restarting the worker: it stays out, and requests
        waiting only for it are refused."""
        w = self.policy.lattice.workers.get(worker_id)
        if w is not None:
            self.down.difference_update(w.devices)
        return self.policy.retry_waiting(now)

    def _requeue(self, worker_id: int, now: float) -> Actions:
        actions = Actions()
        for request in self.policy.scheduler.drain(worker_id):
            actions.add(self.policy.place(request.request_id, now))
        return actions
