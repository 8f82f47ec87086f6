"""The coordinator's end of the control channel: its socket, its I/O thread, and
the registry of node agents.

Owns the ROUTER socket (``runtime/cluster/channel.py``) and the one thread that touches it;
which agents have joined, under which names, with which global ranks (each an
``Agent``, ``runtime/cluster/roster.py``, which also says who may join); their
heartbeats; and their loss and return. It tells its owner (``ClusterRanks``, through
``HubEvents``) what concerns ranks: answers, spawns, exits, lost and returning
hosts. It keeps nothing about ranks' pipes, specs or groups.

A connection that drops is seen at once (the socket's monitor names its file
descriptor, which the agent's ``Hello`` arrived on); an agent silent for
``agent_timeout_s`` is lost too. Events are delivered on the I/O thread, never
while the hub's lock is held, so the owner may call back into the hub.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog
import zmq

from vertumnus.runtime.cluster import channel
from vertumnus.runtime.cluster.channel import (
    ControlError,
    FromRank,
    Heartbeat,
    Hello,
    Keys,
    RankExited,
    Refused,
    Spawned,
    Stop,
    Welcome,
)
from vertumnus.runtime.cluster.roster import Agent, refusal
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.serve_config import ClusterConfig

log = structlog.get_logger("vertumnus")


class HubEvents(Protocol):
    """What the hub reports, on its I/O thread."""

    def rank_answer(self, rank: int, incarnation: int, payload: bytes) -> None: ...
    def rank_spawned(self, rank: int, incarnation: int, pid: int) -> None: ...
    def rank_exited(self, rank: int, incarnation: int) -> None: ...
    def host_lost(self, ranks: range) -> None: ...
    def host_back(self, ranks: range) -> None: ...


class AgentHub:
    def __init__(self, cluster: ClusterConfig, engine_device: str, events: HubEvents) -> None:
        assert cluster.secret is not None
        self.cluster, self._engine_device, self._events = cluster, engine_device, events
        self._keys = Keys(cluster.secret)
        self.world_size = 0
        self._agents: dict[str, Agent] = {}
        self._by_peer: dict[bytes, Agent] = {}
        self._by_rank: dict[int, Agent] = {}  # once gathered (a returning agent keeps its)
        self._lock = threading.Lock()  # the registry and the outbox socket
        self._joined = threading.Condition(self._lock)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._router = channel.server_socket(self._ctx, self._keys, cluster.listen)
        self.port = channel.bound_port(self._router)
        outbox_addr = f"inproc://vertumnus-outbox-{id(self)}"
        inbox = self._ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.RCVHWM, 0)
        inbox.bind(outbox_addr)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)  # never blocks a sender
        self._outbox.connect(outbox_addr)
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._io, args=(inbox,), name="vertumnus-agents", daemon=True
        )
        self._thread.start()

    # -- the owner's side ----------------------------------------------------------------

    def gather(self) -> int:
        """Wait for ``[cluster] hosts`` agents (up to ``join_timeout_s``); give each its
        ranks, in the order of the agents' names. Returns the ranks per host."""
        deadline = time.monotonic() + self.cluster.join_timeout_s
        with self._joined:
            while len(self._agents) < self.cluster.hosts:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing.is_set():
                    raise RanksError(
                        f"{len(self._agents)} of {self.cluster.hosts} agents joined within "
                        f"{self.cluster.join_timeout_s:.0f} s: {sorted(self._agents)}"
                    )
                self._joined.wait(min(left, 1.0))
            agents = sorted(self._agents.values(), key=lambda a: a.name)
            per_host = agents[0].devices
            for k, agent in enumerate(agents):
                agent.first_rank = k * per_host
                self._by_rank.update(dict.fromkeys(agent.ranks(), agent))
            self.world_size = per_host * len(agents)
            for agent in agents:
                self._welcome(agent)
        log.info(
            "cluster_joined",
            hosts={a.name: list(a.ranks()) for a in agents},
            devices_per_host=per_host,
        )
        return per_host

    def host_of(self, rank: int) -> str:
        return self._agent_of(rank).name

    def disconnected(self, ranks: Any) -> list[str]:
        """The hosts of ``ranks`` with no agent connected now."""
        with self._lock:
            return sorted({a.name for r in ranks if not (a := self._agent_of(r)).connected})

    def post(self, rank: int, msg: object, payload: bytes = b"") -> None:
        """Send ``msg`` to the agent of ``rank``'s host, if it is connected (never
        blocks: the I/O thread sends it)."""
        with self._lock:
            agent = self._agent_of(rank)
            if agent.connected:
                self._post(agent, msg, payload)

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell every agent to stop (``Stop``), then close the socket; idempotent."""
        if self._closing.is_set():
            return
        with self._lock:
            for agent in self._agents.values():
                if agent.connected:
                    self._post(agent, Stop())
        time.sleep(0.2)  # let the I/O thread hand the Stops over
        self.crash_for_tests(timeout_s)

    def crash_for_tests(self, timeout_s: float = 10.0) -> None:
        """Fall silent without a ``Stop``, as a coordinator whose host died would
        (and the end of ``close``)."""
        self._closing.set()
        self._thread.join(timeout_s)
        with self._lock:
            self._outbox.close(linger=0)
        self._ctx.term()

    # -- the I/O thread ----------------------------------------------------------------

    def _agent_of(self, rank: int) -> Agent:
        return self._by_rank[rank]

    def _post(self, agent: Agent, msg: object, payload: bytes = b"") -> None:
        """Queue a message for the I/O thread (hold ``_lock``)."""
        self._outbox.send_multipart([agent.peer, *channel.encode(self._keys, msg, payload)])

    def _welcome(self, agent: Agent) -> None:
        assert agent.first_rank is not None
        c = self.cluster
        self._post(
            agent, Welcome(agent.first_rank, self.world_size, c.heartbeat_s, c.agent_timeout_s)
        )

    def _io(self, inbox: zmq.Socket[Any]) -> None:
        drops = channel.monitor(self._router)
        poller = zmq.Poller()
        for sock in (self._router, inbox, drops):
            poller.register(sock, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._closing.is_set():
                events = dict(poller.poll(min(int(self.cluster.heartbeat_s * 1000), 100)))
                for sock in (inbox, self._router, drops):
                    while sock in events:
                        try:
                            if sock is inbox:
                                self._deliver(inbox.recv_multipart(zmq.NOBLOCK))
                            elif sock is drops:
                                self._dropped(channel.disconnected_fd(drops))
                            else:
                                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                                self._receive([p.bytes for p in parts], parts[0].get(zmq.SRCFD))
                        except zmq.Again:
                            break
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.cluster.heartbeat_s
                    self._beat(now)
        finally:
            self._router.disable_monitor()
            for sock in (drops, inbox, self._router):
                sock.close(linger=0)

    def _deliver(self, frames: list[bytes]) -> None:
        try:
            self._router.send_multipart(frames)
        except zmq.ZMQError:  # the agent's connection is gone (ROUTER_MANDATORY)
            self._lose(lambda: [self._by_peer.get(frames[0])], "its connection is gone")

    def _beat(self, now: float) -> None:
        timeout_s = self.cluster.agent_timeout_s

        def silent() -> list[Agent | None]:
            return [a for a in self._agents.values() if now - a.last_seen_s > timeout_s]

        self._lose(silent, f"silent for {timeout_s:.1f} s")
        with self._lock:
            for agent in self._agents.values():
                if agent.connected:
                    self._post(agent, Heartbeat())

    def _dropped(self, fd: int | None) -> None:
        """A connection dropped: its agent (if one spoke on it) is lost at once."""
        self._lose(
            lambda: [a for a in self._agents.values() if fd is not None and a.fd == fd],
            "its connection dropped",
        )

    def _lose(self, which: Callable[[], list[Agent | None]], why: str) -> None:
        """Mark the connected agents ``which()`` names (under the lock) as lost; their
        hosts' ranks are reported gone."""
        lost = []
        with self._lock:
            for agent in which():
                if agent is not None and agent.connected:
                    lost.extend(self._mark_lost(agent, why))
        for ranks in lost:
            self._events.host_lost(ranks)

    def _mark_lost(self, agent: Agent, why: str) -> list[range]:
        """(hold ``_lock``) -> the ranks to report lost."""
        agent.connected = False
        log.error("agent_lost", agent=agent.name, reason=why)
        if agent.first_rank is None:  # still gathering: it may join again
            self._agents.pop(agent.name, None)
            self._by_peer.pop(agent.peer, None)
            return []
        return [agent.ranks()]

    def _receive(self, frames: list[bytes], fd: int) -> None:
        try:
            msg, payload = channel.decode(self._keys, frames[1:])
        except ControlError as exc:
            log.warning("control_frame_dropped", error=str(exc))
            return
        with self._lock:
            agent = self._by_peer.get(frames[0])
            if agent is not None:
                agent.last_seen_s = time.monotonic()
        match msg:
            case Hello():
                self._hello(frames[0], msg, fd)
            case FromRank() if agent is not None:
                self._events.rank_answer(msg.rank, msg.incarnation, payload)
            case Spawned() if agent is not None:
                self._events.rank_spawned(msg.rank, msg.incarnation, msg.pid)
            case RankExited() if agent is not None:
                self._events.rank_exited(msg.rank, msg.incarnation)
            case Heartbeat():
                pass
            case _:
                log.warning("control_unexpected", message=type(msg).__name__)

    def _hello(self, peer: bytes, hello: Hello, fd: int) -> None:
        """An agent joins, or comes back."""
        lost: list[range] = []
        back = None
        with self._lock:
            known = self._agents.get(hello.name)
            reason = refusal(hello, known, self._agents, self.cluster.hosts, self._engine_device)
            if reason is not None:
                log.warning("agent_refused", agent=hello.name, reason=reason)
                self._router.send_multipart([peer, *channel.encode(self._keys, Refused(reason))])
                return
            if known is None:
                agent = Agent(hello.name, peer, hello.devices, hello.device, fd)
                self._agents[hello.name] = self._by_peer[peer] = agent
                log.info("agent_joined", agent=hello.name, devices=hello.devices, pid=hello.pid)
                self._joined.notify_all()
                return
            # Back after a loss, or restarted before its loss was seen (a new
            # connection under a connected name: the old one is lost; names must be
            # unique per host, so two agents under one name keep displacing each
            # other, each time logged). Same ranks; the owner restarts its workers.
            if known.connected:
                lost = self._mark_lost(known, f"a new agent connected as {hello.name!r}")
            self._by_peer.pop(known.peer, None)
            known.peer, known.fd, known.connected = peer, fd, True
            known.last_seen_s = time.monotonic()
            self._by_peer[peer] = known
            if known.first_rank is not None:
                self._welcome(known)
                log.info("agent_back", agent=known.name, ranks=list(known.ranks()))
                back = known.ranks()
        for ranks in lost:
            self._events.host_lost(ranks)
        if back is not None:
            self._events.host_back(back)
