"""The coordinator's handle on ranks that run as Ray actors across hosts.

Owns the ranks of a multi-host pool: one actor per rank (``rank_actor.py``), pinned
to its bundle of its host's placement group (``ray_hosts.py``), started, restarted
and killed here; commands sent as actor calls; their answers. It has the ``Ranks``
interface, so the coordinator drives local and Ray ranks alike: when a call
completes (on Ray's own thread), its answer, which the rank pickled as a local rank
does, is written to a local answer pipe per rank, and a rank whose pending
``alive`` call fails (the actor, its process or its node died) closes a local
"sentinel" pipe, so the coordinator's event loop watches file descriptors exactly
as it watches local rank processes. It decides nothing about a lost host: the
coordinator's rank-failure path does; a host whose node is back (``HostsBack``)
and Ray's reachability (``ClusterReach``) are reported where ``report_to`` said.

Collectives and KV copies never pass through Ray: the ranks rendezvous on this
process's TCP store (it listens on every interface) and then talk over
torch.distributed (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from multiprocessing import Pipe
from typing import Any

import structlog

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.runtime.cluster.ray_hosts import RayHosts
from vertumnus.runtime.intents import ClusterReach, HostsBack, Intent
from vertumnus.runtime.kv.segments import KVSegments
from vertumnus.runtime.ranks import RanksCore, RanksError, poll_channels
from vertumnus.runtime.serve_tables import ClusterConfig

log = structlog.get_logger("vertumnus")


@dataclass
class _Rank:
    """The coordinator's local view of one rank actor (one incarnation)."""

    actor: Any  # its Ray actor handle
    answers: Any  # read end (the coordinator's event loop watches it)
    feed: Any  # write end (Ray's callback thread writes the rank's answers)
    sentinel: int  # read end of a pipe whose write end closes when the rank is gone
    sentinel_w: int | None
    incarnation: int
    alive: Any = None  # the pending ``alive`` call
    started: Any = None  # Future of its process id: the actor's process is up
    pid: int | None = None  # on its own host
    closed: bool = False

    def fire(self) -> None:
        """Make the sentinel readable: the rank is gone. (Under ``RayRanks._lock``:
        Ray's threads, the hosts' watch and the coordinator all call it.)"""
        if self.sentinel_w is not None:
            os.close(self.sentinel_w)
            self.sentinel_w = None

    def close(self) -> None:
        self.closed = True
        self.fire()
        self.feed.close()
        self.answers.close()
        os.close(self.sentinel)


class RayRanks(RanksCore):
    _store_bind = "0.0.0.0"  # the ranks of every host rendezvous on it

    def __init__(
        self,
        cluster: ClusterConfig,
        model: ModelConfig,
        model_dir: str | None,
        engine: EngineConfig,
        per_host: int | None = None,
    ) -> None:
        """``per_host``: ``[pool] devices_per_host`` (None: learned from the nodes)."""
        super().__init__(model, model_dir, engine)  # world size: from the nodes
        self.cluster, self._per_host = cluster, per_host
        self.hosts = RayHosts(cluster, engine.device)
        self.devices_per_host = 0
        self._ranks: dict[int, _Rank] = {}
        self._lock = threading.Lock()  # the ranks
        self._actor_class: Any = None
        self._watch_group = ""
        self._last_sent: tuple[object, bytes] = (None, b"")  # (message, its pickle)

    # -- topology and life -------------------------------------------------------------

    def gather(self) -> tuple[int, int]:
        """Connect to Ray, wait for the hosts and reserve their slots; returns (ranks,
        ranks per host). Blocks: run it off the event loop."""
        self.hosts.connect()
        self.world_size, self.devices_per_host = self.hosts.gather(self._per_host, self)
        return self.world_size, self.devices_per_host

    def host_of(self, rank: int) -> str:
        return self.hosts.host_of_rank(rank).name

    @property
    def local_stores(self) -> KVSegments | None:
        """None: the ranks' stores are on their own hosts."""
        return None

    def start(self) -> None:
        if self.world_size == 0:
            raise RanksError("gather() the Ray nodes and configure() before start()")
        super().start()

    def _actor(self) -> Any:
        if self._actor_class is None:
            import ray

            from vertumnus.runtime.cluster.rank_actor import WATCH_GROUP, RankActor

            remote = ray.remote(concurrency_groups={WATCH_GROUP: 2})  # type: ignore[call-overload]
            self._actor_class, self._watch_group = remote(RankActor), WATCH_GROUP
        return self._actor_class

    def _spawn(self, ranks: Sequence[int]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self._rank_spec(self.hosts.store_host, ranks, self.devices_per_host)
        bundle = self.hosts.bundle()
        for index in sorted({self.hosts.host_of_rank(r).index for r in ranks}):
            self.hosts.check_placed(index)
        for rank in ranks:
            host = self.hosts.host_of_rank(rank)
            strategy = PlacementGroupSchedulingStrategy(
                host.group, placement_group_bundle_index=rank % self.devices_per_host
            )
            actor = (
                self._actor()
                .options(
                    num_cpus=bundle.get("CPU", 0.0),
                    num_gpus=bundle.get("GPU", 0.0),
                    scheduling_strategy=strategy,
                    name=None,
                    max_restarts=0,
                )
                .remote()
            )
            answers, feed = Pipe(duplex=False)
            sentinel, sentinel_w = os.pipe()
            with self._lock:
                old = self._ranks.pop(rank, None)
                if old is not None:
                    old.close()
                incarnation = 0 if old is None else old.incarnation + 1
                entry = _Rank(actor, answers, feed, sentinel, sentinel_w, incarnation)
                self._ranks[rank] = entry
            watch = {"concurrency_group": self._watch_group}
            entry.alive = actor.alive.options(**watch).remote()
            entry.alive.future().add_done_callback(lambda _, e=entry, r=rank: self._gone(r, e))
            entry.started = actor.pid.options(**watch).remote().future()
            entry.started.add_done_callback(lambda f, e=entry: self._pid(e, f))
            self._call(rank, entry, actor.start.remote(rank, spec))

    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        """As ``ChildRanks.restart``; RanksError while a host of ``ranks`` has no node
        (its workers restart when one takes its place: ``HostsBack``)."""
        vacant = self.hosts.vacant(list(ranks))
        if vacant:
            raise RanksError(f"host(s) {vacant} have no Ray node now")
        for rank in ranks:
            self.kill(rank)
        rebuild = self._forget(set(ranks))
        self._spawn(sorted(ranks))
        self._wait_started(ranks)
        return rebuild

    def _wait_started(self, ranks: Sequence[int]) -> None:
        """Wait until the new actors' processes run: a node that is dying but not yet
        reported dead takes actors it can never start, and their live peers must not
        be told to form groups with them (they would wait for them in vain)."""
        futures = {r: self._ranks[r].started for r in ranks}
        deadline = time.monotonic() + self.engine.rank_timeout_s
        done: set[Future[Any]] = set()
        while len(done) < len(futures) and time.monotonic() < deadline:
            vacant = self.hosts.vacant(list(ranks))  # (the node died meanwhile)
            if vacant:
                raise RanksError(f"host(s) {vacant} lost their Ray node while ranks started")
            done |= wait(futures.values(), timeout=self.cluster.poll_s)[0]
        for rank, future in futures.items():
            if future not in done:
                raise RanksError(f"rank {rank}'s actor did not start on {self.host_of(rank)}")
            if future.exception() is not None:
                raise RanksError(
                    f"rank {rank}'s actor did not start on {self.host_of(rank)}: "
                    f"{type(future.exception()).__name__}"
                )

    def _alive(self, rank: int) -> bool:
        entry = self._ranks.get(rank)
        return entry is not None and entry.sentinel_w is not None

    def close(self, timeout_s: float = 10.0) -> None:
        """Kill every rank actor, wait until Ray reports each gone, give the hosts'
        placement groups back and leave the cluster; idempotent."""
        with self._lock:
            entries = list(self._ranks.values())
            self._ranks = {}
        if entries:
            import ray

            for entry in entries:
                entry.closed = True  # (their end is no news: nothing logged)
                with contextlib.suppress(Exception):
                    ray.kill(entry.actor, no_restart=True)
            pending = [e.alive for e in entries if e.alive is not None]
            with contextlib.suppress(Exception):
                ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        with self._lock:  # (``fire`` may run on Ray's thread meanwhile)
            for entry in entries:
                entry.close()
        self.hosts.close()
        self._store = None

    # -- the Ranks interface -----------------------------------------------------------

    def incarnation(self, rank: int) -> int:
        return self._ranks[rank].incarnation

    def kill(self, rank: int) -> None:
        entry = self._ranks.get(rank)
        if entry is not None:
            import ray

            with contextlib.suppress(Exception):  # (dead already)
                ray.kill(entry.actor, no_restart=True)

    def pid(self, rank: int) -> int | None:
        """The rank's process id on its own host."""
        entry = self._ranks.get(rank)
        return None if entry is None else entry.pid

    def send(self, rank: int, msg: object) -> None:
        """Never blocks: an actor call; its answer reaches the rank's answer pipe. The
        message goes pickled, once for every rank of a prefill (the same command):
        Ray then passes bytes, where it would serialise the object for each call."""
        entry = self._ranks.get(rank)
        if entry is None or entry.closed:
            return
        if msg is not self._last_sent[0]:
            self._last_sent = (msg, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self._call(rank, entry, entry.actor.handle.remote(self._last_sent[1]))

    def channels(self) -> list[tuple[int, Any, int]]:
        return [(r, e.answers, e.sentinel) for r, e in sorted(self._ranks.items())]

    def poll(self, timeout_s: float) -> object | None:
        with self._lock:
            entries = dict(self._ranks)
        sentinels = {e.sentinel: f"rank {r} on {self.host_of(r)}" for r, e in entries.items()}
        results = [e.answers for e in entries.values()]
        return poll_channels(self._pending, results, sentinels, timeout_s)

    # -- on Ray's threads ----------------------------------------------------------------

    def _call(self, rank: int, entry: _Rank, ref: Any) -> None:
        ref.future().add_done_callback(lambda f: self._answer(rank, entry, f))

    def _answer(self, rank: int, entry: _Rank, done: Future[Any]) -> None:
        try:
            payload = done.result()
        except Exception as exc:  # the actor died (its ``alive`` call says so too)
            if not entry.closed:
                log.warning("rank_call_failed", rank=rank, error=type(exc).__name__)
            return
        if payload is None or entry.closed:
            return
        with contextlib.suppress(OSError, ValueError):  # (closed by a restart)
            entry.feed.send_bytes(payload)

    def _gone(self, rank: int, entry: _Rank) -> None:
        if not entry.closed:
            log.warning("rank_actor_gone", rank=rank, incarnation=entry.incarnation)
        with self._lock:
            entry.fire()

    @staticmethod
    def _pid(entry: _Rank, done: Future[Any]) -> None:
        with contextlib.suppress(Exception):
            entry.pid = int(done.result())

    # -- HostEvents: on the hosts' watch thread ------------------------------------------

    def host_lost(self, host: int) -> None:
        per = self.devices_per_host
        with self._lock:
            for rank in range(host * per, (host + 1) * per):
                entry = self._ranks.get(rank)
                if entry is not None:
                    entry.fire()

    def host_back(self, host: int) -> None:
        per = self.devices_per_host
        self._report(HostsBack(tuple(range(host * per, (host + 1) * per))))

    def reach_changed(self, error: str | None) -> None:
        self._report(ClusterReach(error))

    def _report(self, intent: Intent) -> None:
        if self._reports is not None:  # (to the event loop's thread)
            loop, switchboard = self._reports
            loop.call_soon_threadsafe(switchboard.route, intent)
