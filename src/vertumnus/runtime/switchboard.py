"""The switchboard: every route between the coordinator's parts, in one place.

A part hands what it wants another part to do to the switchboard as a typed intent
(``intents.py``), or returns one to the switchboard that called it; ``Switchboard.route``
dispatches each with one ``match`` to the part that does it, before it returns:
the same order, and the same iteration of the event loop, as a direct call. The
coordinator builds the switchboard before the parts (they are given it in ``Shared``)
and connects them once built (``connect``); nothing is routed before that.

``Apply`` is the policy's ``Actions`` carried out: workers woken, requests refused,
copies ended told to their waiters, the new workers of a finished reshape serving,
and the switch and the copies the lanes allow started as background tasks. Nothing
new begins once the server stops. It decides nothing: the policy and the parts do.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from vertumnus.config.start import write_state
from vertumnus.policy.lattice import Lattice
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.pool_results import Actions
from vertumnus.runtime.background import Background
from vertumnus.runtime.health import Health
from vertumnus.runtime.intents import (
    Apply,
    ClusterReach,
    CompositionChanged,
    CopyHung,
    HostsBack,
    Intent,
    PoolFailed,
    RankAnswer,
    RankDown,
    RankExited,
    WorkerRejoined,
)
from vertumnus.runtime.kv.copies import CopyRuns
from vertumnus.runtime.rank_link import RankLink
from vertumnus.runtime.recovery import Recovery
from vertumnus.runtime.request_path import RequestPath, Unavailable
from vertumnus.runtime.reshaping import Reshaping
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.runtime.worker_loops import WorkerLoops

log = structlog.get_logger("vertumnus")


def save_composition(cfg: ServeConfig, lattice: Lattice) -> None:
    """The composition the pool has, into ``[pool] state_file`` (if one is configured)
    for the next start: on every completed reshape and at shutdown."""
    path = cfg.pool.start.state_file
    if path is not None:
        try:
            write_state(path, lattice.config, lattice.layout())
        except OSError as exc:
            log.warning("state_file_not_written", path=path, error=str(exc))


@dataclass(frozen=True)
class Parts:
    """The parts the switchboard routes to."""

    link: RankLink
    recovery: Recovery
    requests: RequestPath
    loops: WorkerLoops
    reshaping: Reshaping
    copies: CopyRuns


class Switchboard:
    """Every route between the coordinator's parts: each intent a part hands on (or
    returns to it) goes to the part that does it, before ``route`` returns. Given the
    serving configuration, the policy stack, the pool's health (nothing new begins
    once the server stops) and the background tasks; the parts once built
    (``connect``)."""

    def __init__(
        self, cfg: ServeConfig, policy: PoolPolicy, health: Health, background: Background
    ) -> None:
        self.cfg, self.policy, self.health, self.background = cfg, policy, health, background
        self._parts: Parts | None = None

    def connect(self, parts: Parts) -> None:
        self._parts = parts

    def route(self, intent: Intent) -> None:
        parts = self._parts
        assert parts is not None, "an intent before the coordinator built its parts"
        match intent:
            case Apply(actions):
                self._apply(parts, actions)
            case RankAnswer(msg):
                parts.link.on_message(msg)
            case RankExited(rank):
                parts.recovery.rank_exited(rank)
            case RankDown(rank, reason):
                parts.recovery.rank_down(rank, reason)
            case PoolFailed(error):
                parts.recovery.pool_failed(error)
            case CopyHung(ranks):
                parts.recovery.copy_hung(list(ranks))
            case HostsBack(ranks):
                parts.recovery.hosts_back(ranks)
            case ClusterReach(error):
                self.health.cluster_error = error
            case WorkerRejoined(worker_id):
                parts.loops.wake(worker_id)
            case CompositionChanged():
                save_composition(self.cfg, self.policy.lattice)

    def _apply(self, parts: Parts, actions: Actions) -> None:
        """What the policy returned, done: workers woken, requests refused, the copies
        that ended told to their waiters, the new workers of a finished reshape
        serving, and the switch and the copies the lanes allow started."""
        if self.health.stopping:
            return  # (what the stack asks for now would only outlive the ranks)
        loops = parts.loops
        for placement in actions.placed:
            loops.wake(placement.worker_id)
        for worker_id in actions.woken:
            loops.wake(worker_id)
        for request_id in actions.refused:
            parts.requests.refuse(request_id, Unavailable("no worker can take the request now"))
        parts.copies.ended(actions.copies_ended)
        for transition in actions.activated:
            self.route(parts.reshaping.activated(transition))
        if actions.switch is not None:
            transition = actions.switch.transition
            for s in transition.op.sources:
                loops.remove_worker(s)
            for w in transition.new_workers:
                loops.add_worker(w)
            self.background.spawn(parts.reshaping.run_switch(actions.switch))
        for job in actions.copies:
            self.background.spawn(parts.copies.run(job))
