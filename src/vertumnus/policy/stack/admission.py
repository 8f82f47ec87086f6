"""A pool's open requests, from arrival to answer: placed, waiting, or refused.

A request that arrives is placed by the router on a candidate worker; its demand is
counted by the controller once, at its first placement (not again when a drain or a
failure places it anew). With no candidate it waits while a worker is coming (a
reshape or a restart under way) and is refused otherwise. Its placement may start a
pull of its prefix (``policy/stack/pulls.py``) on the copy lanes. A request leaves when
its prefill commits, when the driver answers it with an error (``drop``), or when its
client gives up (``abandon``: a queued or waiting one at once; a running one when it
ends). A placement that queues a copy asks for the copy lanes to run (the ``Pump``
intent of its ``Step``); ``take_waiting`` hands the root the waiting requests to
place again. Pure Python, clock-free. Not owned here: what runs on the workers
(``prefills``), running the copy lanes (the root routes ``Pump``).
"""

from __future__ import annotations

from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyError
from vertumnus.policy.pool_results import Actions
from vertumnus.policy.stack.intents import Pump, Step
from vertumnus.policy.stack.lanes import CopyLanes
from vertumnus.policy.stack.pulls import Pulls
from vertumnus.policy.stack.state import StackState


class Admission:
    def __init__(self, state: StackState, pulls: Pulls, lanes: CopyLanes) -> None:
        """A request with no candidate waits while ``state.someone_coming()`` (a
        reshape or a restart is under way)."""
        self.state = state
        self.scheduler, self.controller = state.scheduler, state.controller
        self.pulls, self.lanes = pulls, lanes
        self.block_tokens, self.replication = state.block_tokens, state.config.replication
        self.requests: dict[int, PlacementRequest] = {}  # open: arrived, not answered
        self.arrived_s: dict[int, float] = {}  # open requests' arrival times
        self.waiting: list[int] = []  # no candidate when placed
        self._recorded: set[int] = set()  # requests whose demand the controller counted

    def arrive(self, request: PlacementRequest, now: float) -> Step:
        if request.request_id in self.requests:
            raise PolicyError(f"request {request.request_id} arrived twice")
        self.requests[request.request_id] = request
        self.arrived_s[request.request_id] = now
        return self.place(request.request_id, now)

    def drop(self, request_id: int) -> None:
        """The request is answered (its prefill committed, or an error): forget it."""
        self.requests.pop(request_id, None)
        self.pulls.forget(request_id)
        self._recorded.discard(request_id)
        self.arrived_s.pop(request_id, None)

    def abandon(self, request_id: int) -> None:
        """The client gave up: a waiting or queued request leaves (its reservation is
        released); a running one finishes and is forgotten then."""
        if request_id not in self.requests:
            return
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        elif self.scheduler.is_queued(request_id):
            self.scheduler.cancel(request_id)
        elif any(run.request_id == request_id for run in self.state.running.values()):
            return  # ``finish`` forgets it
        self.drop(request_id)

    def place(self, request_id: int, now: float) -> Step:
        """Place an open request (again); a copy it queues asks for ``Pump``."""
        request = self.requests[request_id]
        placed = self.scheduler.place(request, now)
        if placed is None:
            if self.state.someone_coming():
                self.waiting.append(request_id)
                return Step()
            self.drop(request_id)
            return Step(Actions(refused=[request_id]))
        if request_id not in self._recorded:
            self._recorded.add(request_id)
            self.controller.record(placed.exec_s, request.input_tokens)
            arrived = self.arrived_s.get(request_id, now)
            self.controller.placed(request, placed, arrived, self.block_tokens)
        actions = Actions(placed=[placed])
        update = placed.update
        self.pulls.placed(
            request,
            placed.worker_id,
            update.awaits if update is not None else None,
            placed.reused_tokens if self.replication else 0,
        )
        if update is not None and update.fetch is not None:
            if update.fetch.kind == "pull":
                self.pulls.queued(update.fetch)
            self.lanes.queue_copy(update.fetch)
            return Step(actions, (Pump(),))
        return Step(actions)

    def take_waiting(self) -> tuple[int, ...]:
        """The requests that wait, to place again (a worker came): none waits now."""
        waiting, self.waiting = self.waiting, []
        return tuple(waiting)
