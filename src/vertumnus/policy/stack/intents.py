"""What a part of the stack wants done by another: typed intents, routed by the root.

A part never calls into a sibling built after it, nor into ``PoolPolicy``: it does
its own work and returns a ``Step``, the actions for the driver so far and the
intents still to carry out, in order. ``PoolPolicy`` (the composition root) routes
each to the part that does it, at once, so the order of events is the order the
part states:

    Requeue(ids)     place these requests again, in this order (``admission``)
    RetryWaiting()   place again every request that waits for a worker
    ParkCheck(w)     ``w`` may have become idle: park it for its reshape
                     (``reshapes.parked``)
    Pump()           something was queued on the copy lanes: let them grant the
                     ranks (``lanes.pump``)
    Commit(t)        the lanes gave the ranks to ``t``'s switch: commit it
                     (``reshapes.commit``)
    Wipe(w, devices) a reset worker's cache is gone: forget it (``outages.wipe``)

Plain frozen dataclasses. Not owned here: what each does (the parts), nor the
routing (``pool_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vertumnus.policy.pool_results import Actions
from vertumnus.policy.transition import Transition


@dataclass(frozen=True)
class Requeue:
    request_ids: tuple[int, ...]


@dataclass(frozen=True)
class RetryWaiting:
    pass


@dataclass(frozen=True)
class ParkCheck:
    worker_id: int


@dataclass(frozen=True)
class Pump:
    pass


@dataclass(frozen=True)
class Commit:
    transition: Transition


@dataclass(frozen=True)
class Wipe:
    worker_id: int
    devices: tuple[int, ...]


Intent = Requeue | RetryWaiting | ParkCheck | Pump | Commit | Wipe


@dataclass(frozen=True)
class Step:
    """A part's answer: ``actions`` for the driver, then ``then``, in order."""

    actions: Actions = field(default_factory=Actions)
    then: tuple[Intent, ...] = ()
