"""The node agent of one host of a multi-host pool (``python -m vertumnus agent``).

Owns that host's rank processes: it connects to the coordinator
(``runtime/cluster/channel.py``), says what the host has (``Hello``), and then starts,
restarts and kills its ranks when told, forwards the coordinator's commands to them
and their answers back, and reports a rank that exits. The ranks' command and answer
pipes stay on this host; their collectives and KV copies go straight to other ranks
over torch.distributed, rendezvousing on the coordinator's TCP store. It decides
nothing about serving.

    coordinator --ToRank--> agent --pipe--> rank      rank --pipe--> agent --FromRank--> coordinator

If the coordinator falls silent (``timeout_s`` of its ``Welcome``), the agent kills
its ranks and connects again, so a restarted coordinator finds it; ``Stop`` (the
coordinator shuts down), SIGTERM or SIGINT stop the ranks and end the agent. A rank
that loses its agent exits by itself (its parent changed).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import threading
import time
from typing import Any

import structlog
import zmq

from vertumnus.engine.rank import RankSpec
from vertumnus.runtime.cluster import channel
from vertumnus.runtime.cluster.channel import (
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
from vertumnus.runtime.processes import LocalRanks

log = structlog.get_logger("vertumnus")


class Agent:
    def __init__(self, keys: Keys, address: str, name: str, devices: int, cuda: bool) -> None:
        self.keys, self.address, self.name, self.devices = keys, address, name, devices
        self.device = "cuda" if cuda else "cpu"
        self.store_host = channel.split_address(address)[0]
        self.stop = threading.Event()
        self._ctx: zmq.Context[Any] = zmq.Context()

    def run(self) -> int:
        """Sessions with the coordinator until ``Stop`` or a signal; 1 if refused."""
        try:
            while not self.stop.is_set():
                outcome = self._session()
                if outcome == "stop":
                    return 0
                if outcome == "refused":
                    return 1
                time.sleep(1.0)  # lost: connect again
            return 0
        finally:
            self._ctx.term()

    def _session(self) -> str:
        ranks = LocalRanks()
        ranks.warm()  # before joining: a first rank start would block the heartbeat
        sock = channel.client_socket(self._ctx, self.keys, self.address)
        incarnations: dict[int, int] = {}
        try:
            hello = Hello(self.name, self.devices, self.device, os.getpid())
            sock.send_multipart(channel.encode(self.keys, hello))
            log.info("agent_connecting", coordinator=self.address, name=self.name)
            welcome: Welcome | None = None
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            last_seen = time.monotonic()
            next_beat = 0.0
            watched: dict[int, int] = {}  # fd -> rank (answer pipes and sentinels)
            while not self.stop.is_set():
                timeout_ms = 200 if welcome is None else int(welcome.heartbeat_s * 500)
                events = dict(poller.poll(timeout_ms))
                now = time.monotonic()
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            msg, payload = channel.decode(self.keys, frames)
                        except ControlError as exc:
                            log.warning("control_frame_dropped", error=str(exc))
                            continue
                        last_seen = now
                        match msg:
                            case Welcome():
                                welcome = msg
                                log.info(
                                    "agent_welcomed",
                                    first_rank=msg.first_rank,
                                    world_size=msg.world_size,
                                )
                            case Refused():
                                log.error("agent_refused", reason=msg.reason)
                                print(f"vertumnus agent: refused: {msg.reason}", file=sys.stderr)
                                return "refused"
                            case Spawn():
                                spec: RankSpec = pickle.loads(payload)  # signed: see control
                                spec = dataclasses.replace(spec, store_host=self.store_host)
                                for rank, inc in zip(msg.ranks, msg.incarnations, strict=True):
                                    self._unwatch(poller, watched, ranks, rank)
                                    ranks.stop(rank)
                                    ranks.spawn(rank, spec)
                                    incarnations[rank] = inc
                                    self._watch(poller, watched, ranks, rank)
                                    pid = ranks.procs[rank].pid
                                    self._send(sock, Spawned(rank, inc, pid))
                            case ToRank() if msg.rank in ranks.procs:
                                ranks.send(msg.rank, payload)
                            case Kill():
                                for rank in msg.ranks:
                                    ranks.kill(rank)
                            case Stop():
                                log.info("agent_stopping", reason="the coordinator closes")
                                return "stop"
                            case Heartbeat() | ToRank():
                                pass
                for fd in [fd for fd in events if isinstance(fd, int) and fd in watched]:
                    rank = watched[fd]
                    conn = ranks.results.get(rank)
                    proc = ranks.procs.get(rank)
                    if conn is not None and fd == conn.fileno():
                        try:
                            while conn.poll():
                                answer = conn.recv_bytes()
                                self._send(sock, FromRank(rank, incarnations[rank]), answer)
                        except (EOFError, OSError):
                            poller.unregister(fd)
                            watched.pop(fd, None)
                    elif proc is not None and fd == proc.sentinel:
                        proc.join(1.0)
                        poller.unregister(fd)
                        watched.pop(fd, None)
                        exited = RankExited(rank, incarnations[rank], proc.exitcode)
                        self._send(sock, exited)
                        log.warning("rank_exited", rank=rank, exitcode=proc.exitcode)
                if welcome is not None:
                    if now - last_seen > welcome.timeout_s:
                        log.error("coordinator_lost", silent_s=round(now - last_seen, 1))
                        return "lost"
                    if now >= next_beat:
                        next_beat = now + welcome.heartbeat_s
                        self._send(sock, Heartbeat())
            return "stop"
        finally:
            ranks.close(10.0)
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket[Any], msg: object, payload: bytes = b"") -> None:
        sock.send_multipart(channel.encode(self.keys, msg, payload))

    @staticmethod
    def _watch(poller: zmq.Poller, watched: dict[int, int], ranks: LocalRanks, rank: int) -> None:
        for fd in (ranks.results[rank].fileno(), ranks.procs[rank].sentinel):
            poller.register(fd, zmq.POLLIN)
            watched[fd] = rank

    @staticmethod
    def _unwatch(poller: zmq.Poller, watched: dict[int, int], ranks: LocalRanks, rank: int) -> None:
        for fd in [fd for fd, r in watched.items() if r == rank]:
            poller.unregister(fd)
            watched.pop(fd)
