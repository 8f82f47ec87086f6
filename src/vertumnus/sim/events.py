"""The simulator's events: typed, each with its rank among events at the same time.

The event heap orders them by (time, rank, sequence number), so a run is
deterministic for a seed::

    PrefillEnd (0)    a prefill ends: its KV is committed; reshapes may switch; next
    CopyLanded (1)    a KV copy lands: its blocks become visible; the lanes pass on
    SwitchAcked (2)   every rank of a reshape's new workers adopted the epoch
    WindowDue (3)     the controller's window ends: decision, drains begin
    ScanDue (4)       the cache manager's scan (replication on)
    Arrival (5)       a request arrives: placement, statistics, maybe a fetch
    ReservationsDue (6)  slots a reshape reserved go back to their caches
    SampleDue (7)     the timeline's sample of the pool (``policy/timeline.py``), read
                      after everything else at that time; it changes nothing
    HandoffEnd (8)    a decode server has a prompt's KV: its hold ends

``PERIODIC`` are due whether or not requests wait. Not owned here: what each event
does (``simulator``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vertumnus.policy.cache.holds import Hold
from vertumnus.policy.cache.ledger import CopyJob
from vertumnus.policy.pool_results import Switch


@dataclass(frozen=True, slots=True)
class PrefillEnd:
    rank: ClassVar[int] = 0
    worker_id: int


@dataclass(frozen=True, slots=True)
class CopyLanded:
    rank: ClassVar[int] = 1
    job: CopyJob


@dataclass(frozen=True, slots=True)
class SwitchAcked:
    rank: ClassVar[int] = 2
    switch: Switch


@dataclass(frozen=True, slots=True)
class WindowDue:
    rank: ClassVar[int] = 3


@dataclass(frozen=True, slots=True)
class ScanDue:
    rank: ClassVar[int] = 4


@dataclass(frozen=True, slots=True)
class Arrival:
    rank: ClassVar[int] = 5
    request_id: int


@dataclass(frozen=True, slots=True)
class ReservationsDue:
    rank: ClassVar[int] = 6


@dataclass(frozen=True, slots=True)
class SampleDue:
    rank: ClassVar[int] = 7


@dataclass(frozen=True, slots=True)
class HandoffEnd:  # the decode server has the prompt's KV: its hold ends
    rank: ClassVar[int] = 8
    hold: Hold


Event = (
    PrefillEnd
    | CopyLanded
    | SwitchAcked
    | WindowDue
    | ScanDue
    | Arrival
    | ReservationsDue
    | SampleDue
    | HandoffEnd
)
PERIODIC = (WindowDue, ScanDue, SampleDue)  # due whether or not requests wait
