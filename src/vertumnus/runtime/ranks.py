"""The coordinator's handle on its rank processes (``Ranks``: ``ChildRanks`` here,
``RayRanks`` as Ray actors across hosts).

Owns process lifetime: starting the ranks (forks of a ``forkserver`` that imported
the engine once, never of the coordinator: a restart imports no torch), the TCP
store they rendezvous on (on a free port chosen by the OS: no port race), waiting
for every readiness acknowledgement, the command and result channels, and an
orderly shutdown that leaves no orphan (the fork server exits about a second after
its parent). It does not plan prefills (``runtime/prefill.py``) or run them
(``engine/rank.py``).

Commands go through this host's rank processes (``processes.py``: a sender thread
per rank, so a send never blocks). Answers come back on one one-way pipe per rank.
``recv`` waits on every answer pipe and every rank process's sentinel together, so
a rank that dies is noticed at once; the serving coordinator watches the same
pipes from its event loop. What the coordinator may ask of any ranks is the
``Ranks`` protocol, typed: no caller looks at which class it has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from multiprocessing import connection
from typing import Any, Protocol

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.engine.messages import RankFailed, RankReady
from vertumnus.engine.rank import RankSpec, settle_cpu_attention
from vertumnus.policy.geometry import LatticeConfig, worker_slots
from vertumnus.runtime.intents import Routes
from vertumnus.runtime.kv.segments import KVSegments
from vertumnus.runtime.processes import LocalRanks


class RanksError(RuntimeError):
    """A rank failed to start, died, or did not answer in time."""


def worker_groups(world_size: int, degrees: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The ranks of every worker of more than one rank that the lattice of
    ``world_size`` devices at ``degrees`` can form (``policy.lattice.worker_slots``:
    the lattice itself says, so the pool and the lattice cannot disagree); a pool the
    lattice refuses raises ``LatticeError`` with its reason."""
    config = LatticeConfig(world_size, tuple(sorted(set(degrees))))
    return tuple(tuple(range(f, f + c)) for f, c in worker_slots(config) if c > 1)


class Ranks(Protocol):
    """What the coordinator needs of its ranks, wherever they run: ``ChildRanks``
    (children of this process) and ``RayRanks`` (Ray actors across hosts) provide it.

    ``send`` never blocks; answers arrive on ``channels`` (an answer connection and
    a sentinel that becomes readable when the rank is gone, per rank), which change
    for the ranks that ``restart`` starts again. ``restart`` returns the groups the
    live members must form anew (``RebuildGroups``); ``incarnation`` counts a rank's
    restarts (pair groups of KV copies are named by it).

    What the ranks are, for those who need to know: ``holds_kv`` (False: ranks that
    keep no KV bytes, the parity test's fakes; a host tier then runs its policy and
    moves nothing), ``ready`` (each rank's ``RankReady``, once started),
    ``attention_ms`` (what ``cpu_attention = "auto"`` timed, if it did) and
    ``local_stores`` (the KV stores of ranks on this host, in shared memory this
    process maps: a pull streams from them, KV reads are written into this
    process's memory, the host tier copies to and from them; None: the ranks run
    elsewhere). ``report_to`` names where their own reports go: a host whose Ray
    node is back (``HostsBack``), whether Ray answers (``ClusterReach``), from
    whatever thread noticed it."""

    @property
    def holds_kv(self) -> bool: ...
    @property
    def ready(self) -> Mapping[int, RankReady]: ...
    @property
    def attention_ms(self) -> Mapping[str, Mapping[str, float]]: ...
    @property
    def local_stores(self) -> KVSegments | None: ...

    def report_to(self, loop: asyncio.AbstractEventLoop, switchboard: Routes) -> None: ...
    def start(self) -> None: ...
    def send(self, rank: int, msg: object) -> None: ...
    def channels(self) -> list[tuple[int, Any, int]]: ...
    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]: ...
    def incarnation(self, rank: int) -> int: ...
    def kill(self, rank: int) -> None: ...
    def pid(self, rank: int) -> int | None: ...
    def host_of(self, rank: int) -> str: ...
    def close(self, timeout_s: float = 10.0) -> None: ...


class CurrentRanks:
    """The pool's ranks as they are now: ``now`` is None before the coordinator has
    started them and after it closed them (a part reads it at the time it acts)."""

    def __init__(self, ranks: Ranks | None = None) -> None:
        self.now = ranks


def poll_channels(
    pending: list[object], results: Sequence[Any], sentinels: dict[Any, str], timeout_s: float
) -> object | None:
    """Next message from ``pending`` or from any answer connection in ``results``, or
    None after ``timeout_s``; raises RanksError if a sentinel (waitable -> name of
    its rank) fired, after handing out what the ranks sent before."""
    if pending:
        return pending.pop(0)
    try:
        ready = connection.wait([*results, *sentinels], timeout_s)
    except (OSError, ValueError):  # closed under us: shutting down
        return None
    for conn in results:
        if conn in ready:
            try:
                while conn.poll():
                    pending.append(conn.recv())
            except (EOFError, OSError):
                pass  # the rank is gone; its sentinel says so below
    if pending:
        return pending.pop(0)
    dead = [sentinels[s] for s in ready if s in sentinels]
    if dead:
        raise RanksError(f"rank process(es) exited unexpectedly: {', '.join(dead)}")
    return None


def wait_ready(ranks: RanksCore, members: Sequence[int], timeout_s: float) -> None:
    """Collect a ``RankReady`` from each of ``members`` into ``ranks.ready``; a
    ``RankFailed`` raises RanksError naming the rank."""
    while not set(members) <= set(ranks.ready):
        msg = ranks.recv(timeout_s)
        if isinstance(msg, RankFailed):
            raise RanksError(f"rank {msg.rank} failed to start: {msg.error}\n{msg.traceback}")
        if isinstance(msg, RankReady):
            ranks.ready[msg.rank] = msg


class RanksCore:
    """What ``ChildRanks`` and ``RayRanks`` share: the model and engine, the worker
    groups and their generations, readiness, the TCP store the ranks rendezvous on,
    answers read but not handed out, and the start and restart sequences around each
    pool's own ``_spawn`` (start these ranks) and ``poll``."""

    _store_bind = "127.0.0.1"  # where the TCP store listens
    holds_kv = True

    def __init__(
        self,
        model: ModelConfig,
        model_dir: str | None,
        engine: EngineConfig,
        world_size: int = 0,
        degrees: Sequence[int] = (),
    ) -> None:
        self.model, self.model_dir, self.engine = model, model_dir, engine
        self.world_size = world_size
        self.groups = worker_groups(world_size, degrees) if world_size else ()
        self.generations: dict[tuple[int, ...], int] = {}  # of each group; absent: 0
        self.ready: dict[int, RankReady] = {}
        # What ``settle_cpu_attention`` timed, in ms by length and kernel (the ready log)
        self.attention_ms: dict[str, dict[str, float]] = {}
        self._reports: tuple[asyncio.AbstractEventLoop, Routes] | None = None
        self._pending: list[object] = []  # read, not yet handed out
        self._store: TCPStore | None = None

    def report_to(self, loop: asyncio.AbstractEventLoop, switchboard: Routes) -> None:
        """The ranks' own reports go to ``switchboard`` on ``loop`` from now on."""
        self._reports = (loop, switchboard)

    def configure(self, degrees: Sequence[int]) -> None:
        """The worker groups the lattice can form (before ``start``)."""
        self.groups = worker_groups(self.world_size, degrees)

    def _spawn(self, ranks: Sequence[int]) -> None:
        raise NotImplementedError

    def poll(self, timeout_s: float) -> object | None:
        raise NotImplementedError

    def close(self, timeout_s: float = 10.0) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Start every rank and wait for each ``RankReady``; on failure, close."""
        timeout = timedelta(seconds=self.engine.rank_timeout_s)
        self._store = TCPStore(
            self._store_bind, 0, None, is_master=True, timeout=timeout, wait_for_workers=False
        )
        try:
            self._spawn(range(self.world_size))
            wait_ready(self, range(self.world_size), self.engine.rank_timeout_s)
        except BaseException:
            self.close()
            raise

    def _alive(self, rank: int) -> bool:
        """``rank`` runs now (its process or actor has not ended)."""
        raise NotImplementedError

    def _rank_spec(
        self, store_host: str, starting: Collection[int], local_ranks: int | None = None
    ) -> RankSpec:
        """The spec of the ranks ``starting`` now. Their groups are those whose every
        other member runs: a group with a member that is down (its host lost, its
        worker not restarted yet) is formed when that member restarts, by its live
        members (``RebuildGroups``), never waited for here."""
        assert self._store is not None
        starting = set(starting)
        groups = tuple(g for g in self.groups if all(r in starting or self._alive(r) for r in g))
        return RankSpec(
            model=self.model,
            model_dir=self.model_dir,
            engine=self.engine,
            world_size=self.world_size,
            worker_groups=groups,
            store_host=store_host,
            store_port=self._store.port,
            group_generations=tuple(sorted(self.generations.items())),
            local_ranks=local_ranks,
        )

    def _forget(self, dead: set[int]) -> list[tuple[tuple[int, ...], int]]:
        """Before ``dead`` start again: drop their readiness and unread answers, and
        move their groups to the next generation (returned: those with live members)."""
        for rank in dead:
            self.ready.pop(rank, None)
        self._pending = [m for m in self._pending if getattr(m, "rank", None) not in dead]
        return next_generations(self.groups, self.generations, dead)

    def recv(self, timeout_s: float) -> object:
        """Next message from any rank; raises RanksError if a rank died or time ran out."""
        msg = self.poll(timeout_s)
        if msg is None:
            raise RanksError(f"no answer from the ranks within {timeout_s:.0f} s")
        return msg


class ChildRanks(RanksCore):
    """The ranks of a pool on this host, started by the coordinator itself."""

    def __init__(
        self,
        model: ModelConfig,
        model_dir: str | None,
        engine: EngineConfig,
        world_size: int,
        degrees: Sequence[int],
    ) -> None:
        super().__init__(model, model_dir, engine, world_size, degrees)
        self._ranks = LocalRanks()
        self._incarnations: dict[int, int] = {}  # restarts of each rank; absent: 0
        self.kv_segments = KVSegments(model, engine)  # the CPU ranks' KV stores

    @property
    def local_stores(self) -> KVSegments:
        """This host's ranks: their stores are here (in shared memory where made)."""
        return self.kv_segments

    def __enter__(self) -> ChildRanks:
        self.start()
        return self

    def start(self) -> None:
        """As ``RanksCore.start``, after deciding ``cpu_attention = "auto"`` once for
        every rank of this host (``settle_cpu_attention``), restarts included."""
        self.engine, timed = settle_cpu_attention(self.model, self.engine, self.world_size)
        self.attention_ms = {
            str(n): {k: round(t * 1e3, 2) for k, t in ts.items()} for n, ts in timed.items()
        }
        super().start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, ranks: Sequence[int]) -> None:
        segments = self.kv_segments.names(range(self.world_size))
        spec = dataclasses.replace(self._rank_spec("127.0.0.1", ranks), kv_segments=segments)
        for rank in ranks:
            self._ranks.spawn(rank, spec)

    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        """Kill ``ranks`` (whatever state they are in) and start them again; the
        groups they share with other ranks move to the next generation. Returns those
        groups with their new generation: each live member must form them anew
        (``RebuildGroups``) while the new processes start. Their ``RankReady`` comes
        through ``channels``, which change for these ranks."""
        dead = set(ranks)
        for rank in dead:
            self._ranks.stop(rank)
            self._incarnations[rank] = self._incarnations.get(rank, 0) + 1
        rebuild = self._forget(dead)
        self._spawn(sorted(dead))
        return rebuild

    def _alive(self, rank: int) -> bool:
        proc = self._ranks.procs.get(rank)
        return proc is not None and proc.is_alive()

    def incarnation(self, rank: int) -> int:
        """How many times ``rank`` was restarted: a group formed with it on demand
        (a KV copy's pair) is named by its members' incarnations, so a restarted rank
        never meets the half of a group its predecessor formed."""
        return self._incarnations.get(rank, 0)

    def kill(self, rank: int) -> None:
        """SIGKILL one rank process (a hung rank; tests)."""
        self._ranks.kill(rank)

    def pid(self, rank: int) -> int | None:
        proc = self._ranks.procs.get(rank)
        return None if proc is None else proc.pid

    def host_of(self, rank: int) -> str:
        return socket.gethostname()

    def send(self, rank: int, msg: object) -> None:
        """Never blocks: the rank's sender thread writes it."""
        self._ranks.send(rank, msg)

    def channels(self) -> list[tuple[int, Any, int]]:
        """(rank, result connection, process sentinel) of every rank: an event loop can
        watch them directly (``loop.add_reader``) instead of calling ``poll``."""
        procs = self._ranks.procs
        return [(rank, conn, procs[rank].sentinel) for rank, conn in self._ranks.results.items()]

    def poll(self, timeout_s: float) -> object | None:
        """Next message from any rank, or None after ``timeout_s``; raises RanksError
        if a rank process died (after handing out what it sent before)."""
        sentinels = {p.sentinel: p.name for p in self._ranks.procs.values()}
        results = list(self._ranks.results.values())
        return poll_channels(self._pending, results, sentinels, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to exit, wait, then terminate stragglers; idempotent."""
        self._ranks.close(timeout_s)
        self.kv_segments.close()
        self._pending = []
        self._store = None


def next_generations(
    groups: Sequence[tuple[int, ...]], generations: dict[tuple[int, ...], int], dead: set[int]
) -> list[tuple[tuple[int, ...], int]]:
    """Move every group with a member in ``dead`` to its next generation (in
    ``generations``); returns those that keep a live member, with the new generation."""
    rebuild = []
    for group in groups:
        if dead & set(group):
            generations[group] = generations.get(group, 0) + 1
            if set(group) - dead:
                rebuild.append((group, generations[group]))
    return rebuild
