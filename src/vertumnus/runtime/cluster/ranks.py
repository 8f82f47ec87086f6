"""The coordinator's handle on ranks that run on several hosts, under node agents.

Owns the ranks' side of a multi-host pool: the topology once the agents have
gathered (``runtime/cluster/hub.py``), the rank specs, starting and restarting ranks
through their agents, and one local channel per remote rank. It has ``ChildRanks``'s
interface (the ``Ranks`` protocol: ``start``, ``send``, ``channels``, ``restart``,
``kill``, ``pid``, ``close``; no local stores), so the coordinator drives both
alike: each rank's answers are written into a local pipe, framed as the rank wrote
them, and a local "sentinel" pipe closes when the rank exits or its host is lost, so
the coordinator's event loop watches file descriptors exactly as it watches local
rank processes. It decides nothing about a lost host: the coordinator's rank-failure
path does; a host whose agent is back is reported (``HostsBack``) where
``report_to`` said.

Collectives and KV copies between hosts do not pass here: the ranks rendezvous on
this process's TCP store (it listens on every interface) and then talk over
torch.distributed (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import Pipe
from typing import Any

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.runtime.cluster.channel import Kill, Spawn, ToRank
from vertumnus.runtime.cluster.hub import AgentHub
from vertumnus.runtime.intents import HostsBack
from vertumnus.runtime.kv.segments import KVSegments
from vertumnus.runtime.ranks import RanksCore, RanksError, poll_channels
from vertumnus.runtime.serve_config import ClusterConfig


@dataclass
class _Channel:
    """The coordinator's local view of one remote rank."""

    answers: Any  # read end (the coordinator's event loop watches it)
    feed: Any  # write end (the hub's I/O thread writes the rank's answers)
    sentinel: int  # read end of a pipe whose write end closes when the rank is gone
    sentinel_w: int | None
    incarnation: int
    pid: int | None = None  # on its own host

    def fire(self) -> None:
        """Make the sentinel readable: the rank is gone."""
        if self.sentinel_w is not None:
            os.close(self.sentinel_w)
            self.sentinel_w = None

    def close(self) -> None:
        self.fire()
        self.feed.close()
        self.answers.close()
        os.close(self.sentinel)


class ClusterRanks(RanksCore):
    _store_bind = "0.0.0.0"  # the ranks of every host rendezvous on it

    def __init__(
        self,
        cluster: ClusterConfig,
        model: ModelConfig,
        model_dir: str | None,
        engine: EngineConfig,
    ) -> None:
        super().__init__(model, model_dir, engine)  # world size: from the agents
        self.devices_per_host = 0
        self._channels: dict[int, _Channel] = {}
        self._lock = threading.Lock()  # the channels
        self._last_sent: tuple[object, bytes] = (None, b"")  # (message, its pickle)
        self.hub = AgentHub(cluster, engine.device, self)
        self.port = self.hub.port

    # -- topology and life -------------------------------------------------------------

    def gather(self) -> tuple[int, int]:
        """Wait for the agents (``AgentHub.gather``); returns (ranks, ranks per host)."""
        self.devices_per_host = self.hub.gather()
        self.world_size = self.hub.world_size
        return self.world_size, self.devices_per_host

    def host_of(self, rank: int) -> str:
        return self.hub.host_of(rank)

    @property
    def local_stores(self) -> KVSegments | None:
        """None: the ranks' stores are on their own hosts."""
        return None

    def start(self) -> None:
        """Start every rank through its agent and wait for all to be ready."""
        if self.world_size == 0:
            raise RanksError("gather() the agents and configure() before start()")
        super().start()

    def _spawn(self, ranks: Sequence[int]) -> None:
        spec = self._rank_spec("", self.devices_per_host)  # "": the agent's way here
        by_host: dict[str, list[int]] = {}
        with self._lock:
            for rank in ranks:
                old = self._channels.pop(rank, None)
                if old is not None:
                    old.close()
                answers, feed = Pipe(duplex=False)
                sentinel, sentinel_w = os.pipe()
                incarnation = 0 if old is None else old.incarnation + 1
                self._channels[rank] = _Channel(answers, feed, sentinel, sentinel_w, incarnation)
                by_host.setdefault(self.hub.host_of(rank), []).append(rank)
            spawns = [
                (mine[0], Spawn(tuple(mine), tuple(self._channels[r].incarnation for r in mine)))
                for mine in by_host.values()
            ]
        payload = pickle.dumps(spec)
        for first, spawn in spawns:
            self.hub.post(first, spawn, payload)

    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        """As ``ChildRanks.restart``; RanksError while a host of ``ranks`` has no agent
        (its workers restart when it is back: ``HostsBack``)."""
        gone = self.hub.disconnected(ranks)
        if gone:
            raise RanksError(f"host(s) {gone} have no agent connected")
        rebuild = self._forget(set(ranks))
        self._spawn(sorted(ranks))
        return rebuild

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell every agent to stop its ranks, then close the channels; idempotent."""
        self.hub.close(timeout_s)
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels = {}
        self._store = None

    # -- ChildRanks's interface ------------------------------------------------------------

    def incarnation(self, rank: int) -> int:
        return self._channels[rank].incarnation

    def kill(self, rank: int) -> None:
        self.hub.post(rank, Kill((rank,)))

    def pid(self, rank: int) -> int | None:
        """The rank's process id on its own host."""
        ch = self._channels.get(rank)
        return None if ch is None else ch.pid

    def send(self, rank: int, msg: object) -> None:
        """Never blocks: the hub's I/O thread sends it to the rank's agent. A message
        to a host without an agent is dropped (its ranks count as exited already)."""
        if msg is not self._last_sent[0]:  # a prefill sends one command to every rank
            self._last_sent = (msg, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self.hub.post(rank, ToRank(rank), self._last_sent[1])

    def channels(self) -> list[tuple[int, Any, int]]:
        return [(r, ch.answers, ch.sentinel) for r, ch in sorted(self._channels.items())]

    def poll(self, timeout_s: float) -> object | None:
        with self._lock:
            channels = dict(self._channels)
        sentinels = {ch.sentinel: f"rank {r} on {self.host_of(r)}" for r, ch in channels.items()}
        results = [ch.answers for ch in channels.values()]
        return poll_channels(self._pending, results, sentinels, timeout_s)

    # -- HubEvents: on the hub's I/O thread -----------------------------------------------

    def _current(self, rank: int, incarnation: int) -> _Channel | None:
        with self._lock:
            ch = self._channels.get(rank)
        return ch if ch is not None and ch.incarnation == incarnation else None

    def rank_answer(self, rank: int, incarnation: int, payload: bytes) -> None:
        ch = self._current(rank, incarnation)
        if ch is not None:
            # Outside the lock: this write waits while the coordinator's pipe is full.
            with contextlib.suppress(OSError, ValueError):  # closed by a restart
                ch.feed.send_bytes(payload)

    def rank_spawned(self, rank: int, incarnation: int, pid: int) -> None:
        ch = self._current(rank, incarnation)
        if ch is not None:
            ch.pid = pid

    def rank_exited(self, rank: int, incarnation: int) -> None:
        with self._lock:
            ch = self._channels.get(rank)
            if ch is not None and ch.incarnation == incarnation:
                ch.fire()

    def host_lost(self, ranks: range) -> None:
        with self._lock:
            for rank in ranks:
                ch = self._channels.get(rank)
                if ch is not None:
                    ch.fire()

    def host_back(self, ranks: range) -> None:
        if self._reports is not None:  # (to the event loop's thread)
            loop, switchboard = self._reports
            loop.call_soon_threadsafe(switchboard.route, HostsBack(tuple(ranks)))
