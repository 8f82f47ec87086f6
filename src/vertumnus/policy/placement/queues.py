"""The workers' queues of placed requests, and the reservations placement makes.

Workers run their queue FIFO, one prefill at a time (as the engine does). A
placement reserves its predicted E on the worker at once (``_enqueue``), so the
next arrival sees it, and the reservation is released when the prefill completes
or is cancelled. q_w, a worker's outstanding predicted work at ``now``, is its
queue plus what is left of the prefill it runs, its elapsed seconds counted at the
pace measured (``costs.Pace``: the profile's seconds, as the queue's). When a
worker starts draining, ``drain`` hands back its queued (not started) requests for
re-placement; what it runs finishes where it is. Beside each outstanding request
the queues index the prefix blocks it brings to its worker (``coming``).

Pure Python, clock-free: ``now`` is an argument. Not owned here: where a request
goes (``scheduler``, the routers).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vertumnus.policy.cache.coming import ComingBlocks
from vertumnus.policy.costs import Pace
from vertumnus.policy.lattice import Lattice


class SchedulerError(ValueError):
    """A call that contradicts the scheduler's state (a driver bug)."""


@dataclass(frozen=True)
class PlacementRequest:
    request_id: int
    input_tokens: int
    block_ids: tuple[int, ...] = ()  # chained block ids of its whole blocks


@dataclass
class _Running:
    request_id: int
    start_s: float
    exec_s: float


class WorkerQueues:
    """The queues of ``lattice``'s workers (every router's: ``Scheduler`` extends it)."""

    def __init__(self, lattice: Lattice) -> None:
        self.lattice = lattice
        # (real seconds into the profile's: a running prefill's; the policy stack
        # measures it from every prefill that ends well, against the E it ran)
        self.pace = Pace()
        self._queue: dict[int, OrderedDict[int, float]] = {}  # worker -> request -> E
        self._queued_s: dict[int, float] = {}
        self._running: dict[int, _Running] = {}
        self._where: dict[int, int] = {}  # request -> worker
        self._requests: dict[int, PlacementRequest] = {}
        self.coming = ComingBlocks()  # the prefixes outstanding requests bring

    # -- load ------------------------------------------------------------------------

    def outstanding_s(self, worker_id: int, now: float) -> float:
        """q_w: predicted seconds of work queued or left running at ``now``."""
        run = self._running.get(worker_id)
        if run is None:
            return self._queued_s.get(worker_id, 0.0)
        done = (now - run.start_s) * self.pace.of(self.lattice.workers[worker_id].cp_degree)
        return self._queued_s.get(worker_id, 0.0) + max(0.0, run.exec_s - done)

    def queued_s(self, worker_id: int) -> float:
        """Predicted seconds of the worker's queued (not started) requests."""
        return self._queued_s.get(worker_id, 0.0)

    def loads(self, now: float) -> dict[int, float]:
        return {w: self.outstanding_s(w, now) for w in self.lattice.workers}

    def queued(self, worker_id: int) -> list[int]:
        return list(self._queue.get(worker_id, ()))

    def is_queued(self, request_id: int) -> bool:
        """Placed and not yet started."""
        worker_id = self._where.get(request_id)
        return worker_id is not None and request_id in self._queue.get(worker_id, ())

    def head(self, worker_id: int) -> int | None:
        """The request the worker runs next (FIFO), if any."""
        return next(iter(self._queue.get(worker_id, ())), None)

    def running(self, worker_id: int) -> int | None:
        run = self._running.get(worker_id)
        return None if run is None else run.request_id

    def _enqueue(
        self, request: PlacementRequest, worker_id: int, exec_s: float, first_block: int | None
    ) -> None:
        """Reserve ``exec_s`` for the request at the end of the worker's queue; with
        ``first_block``, its blocks from there on count as coming to the worker."""
        self._queue.setdefault(worker_id, OrderedDict())[request.request_id] = exec_s
        self._queued_s[worker_id] = self._queued_s.get(worker_id, 0.0) + exec_s
        self._where[request.request_id] = worker_id
        self._requests[request.request_id] = request
        if first_block is not None:
            self.coming.add(request.request_id, worker_id, request.block_ids, first_block)

    # -- a placed request's life -----------------------------------------------------

    def start(self, request_id: int, now: float) -> None:
        """The worker begins the head of its queue."""
        worker_id = self._worker_of(request_id)
        queue = self._queue[worker_id]
        head = next(iter(queue))
        if head != request_id:
            raise SchedulerError(f"worker {worker_id} runs FIFO: {head} is first, not {request_id}")
        if worker_id in self._running:
            raise SchedulerError(f"worker {worker_id} already runs a prefill")
        exec_s = queue.pop(request_id)
        self._queued_s[worker_id] -= exec_s
        self._running[worker_id] = _Running(request_id, now, exec_s)

    def complete(self, request_id: int) -> None:
        """The prefill finished (or failed): release its reservation."""
        worker_id = self._worker_of(request_id)
        run = self._running.get(worker_id)
        if run is None or run.request_id != request_id:
            raise SchedulerError(f"request {request_id} is not running on worker {worker_id}")
        del self._running[worker_id]
        self._forget(request_id)

    def cancel(self, request_id: int) -> PlacementRequest:
        """Take a request back, queued or running (its worker failed, say)."""
        worker_id = self._worker_of(request_id)
        run = self._running.get(worker_id)
        if run is not None and run.request_id == request_id:
            del self._running[worker_id]
        else:
            self._queued_s[worker_id] -= self._queue[worker_id].pop(request_id)
        return self._forget(request_id)

    def drain(self, worker_id: int) -> list[PlacementRequest]:
        """Hand back the worker's queued requests (in queue order) for re-placement;
        the one it runs stays."""
        queue = self._queue.pop(worker_id, OrderedDict())
        self._queued_s[worker_id] = 0.0
        return [self._forget(rid) for rid in queue]

    def forget_worker(self, worker_id: int) -> list[PlacementRequest]:
        """The worker is gone (failed or reshaped): everything it had, running first."""
        out = []
        run = self._running.pop(worker_id, None)
        if run is not None:
            out.append(self._forget(run.request_id))
        out += self.drain(worker_id)
        self._queued_s.pop(worker_id, None)
        return out

    def _forget(self, request_id: int) -> PlacementRequest:
        del self._where[request_id]
        request = self._requests.pop(request_id)
        self.coming.remove(request_id, request.block_ids)
        return request

    def _worker_of(self, request_id: int) -> int:
        try:
            return self._where[request_id]
        except KeyError:
            raise SchedulerError(f"request {request_id} is not placed") from None

    def check(self, now: float) -> None:
        """Raise AssertionError if the reservations disagree with the queues."""
        placed: dict[int, int] = {}
        for worker_id, queue in self._queue.items():
            assert abs(self._queued_s.get(worker_id, 0.0) - sum(queue.values())) < 1e-9
            for rid in queue:
                placed[rid] = worker_id
        for worker_id, run in self._running.items():
            placed[run.request_id] = worker_id
        assert placed == self._where and set(self._requests) == set(placed)
        self.coming.check({r: (w, self._requests[r].block_ids) for r, w in placed.items()})
        for worker_id in placed.values():
            assert self.outstanding_s(worker_id, now) >= 0
