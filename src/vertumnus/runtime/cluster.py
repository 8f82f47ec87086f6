"""The coordinator's handle on ranks that run on several hosts, under node agents.

Owns the coordinator's end of the control channel (``runtime/control.py``): it
gathers the agents at start-up (the topology: hosts, ranks per host, in the order
of their names), gives each its global ranks, starts and restarts ranks through
them, forwards commands and answers, and notices a lost agent (its connection
drops, or it falls silent for ``agent_timeout_s``). It has ``RankPool``'s interface
(``start``, ``send``, ``channels``, ``restart``, ``kill``, ``pid``, ``close``), so
the coordinator drives both alike: an I/O thread writes each rank's answers into a
local pipe, framed as the rank wrote them, and closes a local "sentinel" pipe when
the rank exits or its host is lost, so the coordinator's event loop watches file
descriptors exactly as it watches local rank processes. It does not decide
anything about a lost host: the coordinator's rank-failure path does.

Collectives and KV copies between hosts do not pass here: the ranks rendezvous on
this process's TCP store (it listens on every interface) and then talk over
torch.distributed (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import Pipe
from typing import Any

import structlog
import torch.distributed as dist
import zmq

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.engine.rank import RankSpec
from vertumnus.runtime import control
from vertumnus.runtime.control import (
    ControlError,
    FromRank,
    Heartbeat,
    Hello,
    Keys,
    Kill,
    RankExited,
    Refused,
    Spawn,
    Spawned,
    Stop,
    ToRank,
    Welcome,
)
from vertumnus.runtime.messages import RankReady
from vertumnus.runtime.pool import (
    RankPoolError,
    next_generations,
    poll_channels,
    wait_ready,
    worker_groups,
)
from vertumnus.runtime.serve_config import ClusterConfig

log = structlog.get_logger("vertumnus")


@dataclass
class _Agent:
    name: str
    peer: bytes  # its ZeroMQ routing id; a new one when it reconnects
    devices: int
    device: str
    fd: int | None = None  # its connection's file descriptor (monitor events name it)
    first_rank: int | None = None  # given when every host has joined
    connected: bool = True
    last_seen_s: float = field(default_factory=time.monotonic)

    def ranks(self) -> range:
        assert self.first_rank is not None
        return range(self.first_rank, self.first_rank + self.devices)


@dataclass
class _Channel:
    """The coordinator's local view of one remote rank."""

    answers: Any  # read end (the coordinator's event loop watches it)
    feed: Any  # write end (the I/O thread writes the rank's answers)
    sentinel: int  # read end of a pipe whose write end closes when the rank is gone
    sentinel_w: int | None
    incarnation: int


class ClusterPool:
    def __init__(
        self,
        cluster: ClusterConfig,
        model: ModelConfig,
        model_dir: str | None,
        engine: EngineConfig,
    ) -> None:
        assert cluster.secret is not None
        self.cluster, self.model, self.model_dir, self.engine = cluster, model, model_dir, engine
        self._keys = Keys(cluster.secret)
        self.world_size = 0
        self.devices_per_host = 0
        self.groups: tuple[tuple[int, ...], ...] = ()
        self.generations: dict[tuple[int, ...], int] = {}
        self.ready: dict[int, RankReady] = {}
        self.on_rejoin: Callable[[list[int]], None] | None = None  # called from the I/O thread
        self._agents: dict[str, _Agent] = {}
        self._by_peer: dict[bytes, _Agent] = {}
        self._channels: dict[int, _Channel] = {}
        self._pids: dict[int, int] = {}
        self._pending: list[object] = []
        self._last_sent: tuple[object, bytes] = (None, b"")  # (message, its pickle)
        self._store: dist.TCPStore | None = None
        self._lock = threading.Lock()  # the agents, channels and the outbox socket
        self._joined = threading.Condition(self._lock)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._router = control.server_socket(self._ctx, self._keys, cluster.listen)
        self.port = control.bound_port(self._router)
        self._outbox_addr = f"inproc://vertumnus-outbox-{id(self)}"
        inbox = self._ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.RCVHWM, 0)
        inbox.bind(self._outbox_addr)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)  # never blocks a sender
        self._outbox.connect(self._outbox_addr)
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._io, args=(inbox,), name="vertumnus-cluster", daemon=True
        )
        self._thread.start()

    # -- topology ----------------------------------------------------------------------

    def gather(self) -> tuple[int, int]:
        """Wait for ``[cluster] hosts`` agents (up to ``join_timeout_s``) and give each
        its ranks, in the order of the agents' names; returns (ranks, ranks per host)."""
        deadline = time.monotonic() + self.cluster.join_timeout_s
        with self._joined:
            while len(self._agents) < self.cluster.hosts:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing.is_set():
                    raise RankPoolError(
                        f"{len(self._agents)} of {self.cluster.hosts} agents joined within "
                        f"{self.cluster.join_timeout_s:.0f} s: {sorted(self._agents)}"
                    )
                self._joined.wait(min(left, 1.0))
            agents = sorted(self._agents.values(), key=lambda a: a.name)
            self.devices_per_host = agents[0].devices
            for k, agent in enumerate(agents):
                agent.first_rank = k * self.devices_per_host
            self.world_size = self.devices_per_host * len(agents)
            for agent in agents:
                self._welcome(agent)
        log.info(
            "cluster_joined",
            hosts={a.name: list(a.ranks()) for a in agents},
            devices_per_host=self.devices_per_host,
        )
        return self.world_size, self.devices_per_host

    def host_of(self, rank: int) -> str:
        return next(a.name for a in self._agents.values() if rank in a.ranks())

    def _agent_of(self, rank: int) -> _Agent:
        return next(a for a in self._agents.values() if rank in a.ranks())

    # -- life ------------------------------------------------------------------------

    def start(self) -> None:
        """Start every rank through its agent and wait for all to be ready."""
        if self.world_size == 0:
            raise RankPoolError("gather() the agents and configure() before start()")
        timeout = timedelta(seconds=self.engine.rank_timeout_s)
        self._store = dist.TCPStore(
            "0.0.0.0", 0, None, is_master=True, timeout=timeout, wait_for_workers=False
        )
        try:
            self._spawn(range(self.world_size))
            wait_ready(self, range(self.world_size), self.engine.rank_timeout_s)
        except BaseException:
            self.close()
            raise

    def configure(self, degrees: Sequence[int]) -> None:
        """The worker groups the lattice can form (before ``start``)."""
        self.groups = worker_groups(self.world_size, degrees)

    def _spawn(self, ranks: Sequence[int]) -> None:
        assert self._store is not None
        spec = RankSpec(
            model=self.model,
            model_dir=self.model_dir,
            engine=self.engine,
            world_size=self.world_size,
            worker_groups=self.groups,
            store_host="",  # the agent's way to this host
            store_port=self._store.port,
            group_generations=tuple(sorted(self.generations.items())),
            local_ranks=self.devices_per_host,
        )
        payload = pickle.dumps(spec)
        by_agent: dict[str, list[int]] = {}
        with self._lock:
            for rank in ranks:
                old = self._channels.pop(rank, None)
                if old is not None:
                    _close_channel(old)
                incarnation = 0 if old is None else old.incarnation + 1
                answers, feed = Pipe(duplex=False)
                sentinel, sentinel_w = os.pipe()
                self._channels[rank] = _Channel(answers, feed, sentinel, sentinel_w, incarnation)
                self._pids.pop(rank, None)
                by_agent.setdefault(self._agent_of(rank).name, []).append(rank)
            for name, mine in by_agent.items():
                agent = self._agents[name]
                spawn = Spawn(tuple(mine), tuple(self._channels[r].incarnation for r in mine))
                self._post(agent, spawn, payload)

    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        """As ``RankPool.restart``; RankPoolError while a host of ``ranks`` has no agent
        (its workers restart when it is back: ``on_rejoin``)."""
        dead = set(ranks)
        with self._lock:
            gone = sorted({a.name for r in dead if not (a := self._agent_of(r)).connected})
        if gone:
            raise RankPoolError(f"host(s) {gone} have no agent connected")
        for rank in dead:
            self.ready.pop(rank, None)
        rebuild = next_generations(self.groups, self.generations, dead)
        self._pending = [m for m in self._pending if getattr(m, "rank", None) not in dead]
        self._spawn(sorted(dead))
        return rebuild

    def incarnation(self, rank: int) -> int:
        return self._channels[rank].incarnation

    def kill(self, rank: int) -> None:
        with self._lock:
            agent = self._agent_of(rank)
            if agent.connected:
                self._post(agent, Kill((rank,)))

    def pid(self, rank: int) -> int | None:
        """The rank's process id on its own host."""
        return self._pids.get(rank)

    def send(self, rank: int, msg: object) -> None:
        """Never blocks: the I/O thread sends it to the rank's agent. A message to a
        host without an agent is dropped (its ranks count as exited already)."""
        if msg is not self._last_sent[0]:  # a prefill sends one command to every rank
            self._last_sent = (msg, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        payload = self._last_sent[1]
        with self._lock:
            agent = self._agent_of(rank)
            if agent.connected:
                self._post(agent, ToRank(rank), payload)

    def channels(self) -> list[tuple[int, Any, int]]:
        return [(r, ch.answers, ch.sentinel) for r, ch in sorted(self._channels.items())]

    def recv(self, timeout_s: float) -> object:
        msg = self.poll(timeout_s)
        if msg is None:
            raise RankPoolError(f"no answer from the ranks within {timeout_s:.0f} s")
        return msg

    def poll(self, timeout_s: float) -> object | None:
        with self._lock:
            channels = dict(self._channels)
        sentinels = {ch.sentinel: f"rank {r} on {self.host_of(r)}" for r, ch in channels.items()}
        results = [ch.answers for ch in channels.values()]
        return poll_channels(self._pending, results, sentinels, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell every agent to stop its ranks, then close the channel; idempotent."""
        if self._closing.is_set():
            return
        with self._lock:
            for agent in self._agents.values():
                if agent.connected:
                    self._post(agent, Stop())
        time.sleep(0.2)  # let the I/O thread hand the Stops over
        self._closing.set()
        self._thread.join(timeout_s)
        with self._lock:
            for ch in self._channels.values():
                _close_channel(ch)
            self._channels = {}
            self._outbox.close(linger=0)
        self._ctx.term()
        self._store = None

    def crash_for_tests(self) -> None:
        """Fall silent without a ``Stop``, as a coordinator whose host died would
        (tests of the agents' reconnection)."""
        self._closing.set()
        self._thread.join(10.0)
        with self._lock:
            self._outbox.close(linger=0)
        self._ctx.term()

    # -- the I/O thread ----------------------------------------------------------------

    def _post(self, agent: _Agent, msg: object, payload: bytes = b"") -> None:
        """Queue a message for the I/O thread (hold ``_lock``)."""
        self._outbox.send_multipart([agent.peer, *control.encode(self._keys, msg, payload)])

    def _welcome(self, agent: _Agent) -> None:
        assert agent.first_rank is not None
        welcome = Welcome(
            agent.first_rank,
            self.world_size,
            self.cluster.heartbeat_s,
            self.cluster.agent_timeout_s,
        )
        self._post(agent, welcome)

    def _io(self, inbox: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(inbox, zmq.POLLIN)
        events_in = control.monitor(self._router)
        poller.register(events_in, zmq.POLLIN)
        period_ms = int(self.cluster.heartbeat_s * 1000)
        next_beat = time.monotonic()
        try:
            while not self._closing.is_set():
                events = dict(poller.poll(min(period_ms, 100)))
                if inbox in events:
                    while True:
                        try:
                            frames = inbox.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._deliver(frames)
                if self._router in events:
                    while True:
                        try:
                            parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._receive([p.bytes for p in parts], parts[0].get(zmq.SRCFD))
                if events_in in events:
                    while True:
                        try:
                            fd = control.disconnected_fd(events_in)
                        except zmq.Again:
                            break
                        self._dropped(fd)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.cluster.heartbeat_s
                    self._beat(now)
        finally:
            self._router.disable_monitor()
            events_in.close(linger=0)
            inbox.close(linger=0)
            self._router.close(linger=0)

    def _deliver(self, frames: list[bytes]) -> None:
        try:
            self._router.send_multipart(frames)
        except zmq.ZMQError:  # the agent's connection is gone (ROUTER_MANDATORY)
            with self._lock:
                agent = self._by_peer.get(frames[0])
                if agent is not None:
                    self._lost(agent, "its connection is gone")

    def _beat(self, now: float) -> None:
        with self._lock:
            for agent in list(self._agents.values()):
                if not agent.connected:
                    continue
                if now - agent.last_seen_s > self.cluster.agent_timeout_s:
                    self._lost(agent, f"silent for {self.cluster.agent_timeout_s:.1f} s")
                else:
                    self._post(agent, Heartbeat())

    def _dropped(self, fd: int | None) -> None:
        """A connection dropped: its agent (if one spoke on it) is lost at once."""
        with self._lock:
            for agent in self._agents.values():
                if agent.connected and fd is not None and agent.fd == fd:
                    self._lost(agent, "its connection dropped")

    def _receive(self, frames: list[bytes], fd: int) -> None:
        peer = frames[0]
        try:
            msg, payload = control.decode(self._keys, frames[1:])
        except ControlError as exc:
            log.warning("control_frame_dropped", error=str(exc))
            return
        feed = None
        with self._lock:
            agent = self._by_peer.get(peer)
            if agent is not None:
                agent.last_seen_s = time.monotonic()
            match msg:
                case Hello():
                    self._hello(peer, msg, fd)
                case FromRank() if agent is not None:
                    ch = self._channels.get(msg.rank)
                    if ch is not None and ch.incarnation == msg.incarnation:
                        feed = ch.feed
                case Spawned() if agent is not None:
                    ch = self._channels.get(msg.rank)
                    if ch is not None and ch.incarnation == msg.incarnation:
                        self._pids[msg.rank] = msg.pid
                case RankExited() if agent is not None:
                    ch = self._channels.get(msg.rank)
                    if ch is not None and ch.incarnation == msg.incarnation:
                        _fire(ch)
                case Heartbeat():
                    pass
                case _:
                    log.warning("control_unexpected", message=type(msg).__name__)
        if feed is not None:
            # Outside the lock: this write waits while the coordinator's pipe is full,
            # and the coordinator takes the lock to send.
            with contextlib.suppress(OSError, ValueError):  # closed by a restart
                feed.send_bytes(payload)

    def _hello(self, peer: bytes, hello: Hello, fd: int) -> None:
        """An agent joins, or comes back (hold ``_lock``)."""
        known = self._agents.get(hello.name)
        reason = None
        if hello.protocol != control.PROTOCOL:
            reason = f"protocol {hello.protocol}; this coordinator speaks {control.PROTOCOL}"
        elif hello.devices < 1:
            reason = "an agent must run at least one rank"
        elif known is None and len(self._agents) >= self.cluster.hosts:
            reason = f"the pool has its {self.cluster.hosts} hosts: {sorted(self._agents)}"
        elif known is None and self._agents:
            first = next(iter(self._agents.values()))
            if hello.devices != first.devices:
                reason = f"{hello.devices} ranks; every host of this pool runs {first.devices}"
        elif known is not None and hello.devices != known.devices:
            reason = f"{hello.devices} ranks; this host ran {known.devices}"
        if reason is None and self.engine.device == "cuda" and hello.device != "cuda":
            reason = "[engine] device is cuda, and this host has no GPU"
        if reason is not None:
            log.warning("agent_refused", agent=hello.name, reason=reason)
            self._router.send_multipart([peer, *control.encode(self._keys, Refused(reason))])
            return
        if known is None:
            agent = _Agent(hello.name, peer, hello.devices, hello.device, fd)
            self._agents[hello.name] = agent
            self._by_peer[peer] = agent
            log.info("agent_joined", agent=hello.name, devices=hello.devices, pid=hello.pid)
            self._joined.notify_all()
            return
        # Back after a loss, or restarted before its loss was seen (a new connection
        # under a name that is connected: the old one is lost; names must be unique
        # per host, so two agents under one name would keep taking over, each time
        # logged): same ranks; the coordinator restarts its workers.
        if known.connected:
            self._lost(known, f"a new agent connected as {hello.name!r}")
        self._by_peer.pop(known.peer, None)
        known.peer, known.connected, known.last_seen_s = peer, True, time.monotonic()
        known.fd = fd
        self._by_peer[peer] = known
        if known.first_rank is not None:
            self._welcome(known)
            log.info("agent_back", agent=known.name, ranks=list(known.ranks()))
            if self.on_rejoin is not None:
                self.on_rejoin(list(known.ranks()))

    def _lost(self, agent: _Agent, why: str) -> None:
        """Every rank of ``agent`` counts as exited (hold ``_lock``)."""
        agent.connected = False
        log.error("agent_lost", agent=agent.name, reason=why)
        if agent.first_rank is None:  # still gathering: it may join again
            self._agents.pop(agent.name, None)
            self._by_peer.pop(agent.peer, None)
            return
        for rank in agent.ranks():
            ch = self._channels.get(rank)
            if ch is not None:
                _fire(ch)


def _fire(ch: _Channel) -> None:
    """Make the channel's sentinel readable: its rank is gone."""
    if ch.sentinel_w is not None:
        os.close(ch.sentinel_w)
        ch.sentinel_w = None


def _close_channel(ch: _Channel) -> None:
    _fire(ch)
    ch.feed.close()
    ch.answers.close()
    os.close(ch.sentinel)
