"""What a part of the coordinator wants another part to do: typed intents, and
the protocol of the switchboard that carries them (``Routes``).

A part never calls back into its owner or into a sibling built after it. What it
observes on its own (a rank's pipe or sentinel, a timer, its own background task)
and wants done elsewhere, it hands to the switchboard as one of these; a method
the switchboard itself calls returns them instead. The switchboard (``Switchboard``
in ``switchboard.py``, built by the composition root, ``coordinator.py``)
dispatches each with ``match`` to the part that does it, synchronously: in the same
order and the same iteration of the event loop as a direct call.

    Apply(actions)            what the policy returned, carried out (``Switchboard``)
    RankAnswer(msg)           a rank's answer, read from its pipe -> ``RankLink``
    RankExited(rank)          a rank process's sentinel fired     -> ``Recovery``
    RankDown(rank, reason)    a rank failed a prefill after its attempt ended
    PoolFailed(error)         a rank failed outside anything that waits
    CopyHung(ranks)           a KV copy timed out: its workers restart
    HostsBack(ranks)          a host's Ray node is back (``RayRanks``)
    ClusterReach(error)       Ray stopped answering (error) or answers again (None)
    WorkerRejoined(worker_id) a worker's recovery ended -> its task (``WorkerLoops``)
    CompositionChanged()      a reshape finished: the composition is kept
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vertumnus.policy.pool_results import Actions


@dataclass(frozen=True)
class Apply:
    """The policy's ``Actions``, to be carried out."""

    actions: Actions


@dataclass(frozen=True)
class RankAnswer:
    """A message a rank wrote on its answer pipe."""

    msg: object


@dataclass(frozen=True)
class RankExited:
    """A rank's process exited (its sentinel became readable)."""

    rank: int


@dataclass(frozen=True)
class RankDown:
    """Rank ``rank`` is suspect (``reason``): its worker is taken down and restarted."""

    rank: int
    reason: str


@dataclass(frozen=True)
class PoolFailed:
    """A rank failed outside anything that waits: the pool stops serving."""

    error: str


@dataclass(frozen=True)
class CopyHung:
    """A KV copy among ``ranks`` timed out."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class HostsBack:
    """The host of ``ranks`` has a Ray node again: their failed workers restart now."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ClusterReach:
    """The Ray cluster does not answer (``error`` says how), or answers again (None):
    ``/ready`` says so meanwhile."""

    error: str | None


@dataclass(frozen=True)
class WorkerRejoined:
    """The recovery of ``worker_id`` ended (it serves again, or was given up)."""

    worker_id: int


@dataclass(frozen=True)
class CompositionChanged:
    """A reshape finished: the composition is kept for the next start."""


Intent = (
    Apply
    | RankAnswer
    | RankExited
    | RankDown
    | PoolFailed
    | CopyHung
    | HostsBack
    | ClusterReach
    | WorkerRejoined
    | CompositionChanged
)


class Routes(Protocol):
    """Where the parts hand their intents: each is done before ``route`` returns."""

    def route(self, intent: Intent) -> None: ...
