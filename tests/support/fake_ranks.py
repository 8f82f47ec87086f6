"""Ranks in the test process: the coordinator's ``Ranks`` contract without processes.

Every command is answered after the time the simulator's own time model gives it
(``sim/time_model.py``): a prefill after E_C(L - P, P) from the profile at the
prefix the command reuses, a switch after ``switch_s``, a KV copy after the copy
model's time. Answers go straight to the coordinator's ``RankLink`` (no pipes), on
the event loop's clock, so on a ``VirtualTimeLoop`` the coordinator lives through
the same simulated time as the simulator. A prefill that exports rows (a KV
hand-off) returns zero rows of ``kv_shape``, one that asks for its prompt's
log-probabilities zeros of their shapes, and a hand-off's ``KVRead`` is answered
with zero blocks after the copy model's time for them. A test can make ranks hang
(``hung_on_switch``, ``hung_on_copy``); killed ranks answer nothing, and restarted
ones come back ``restart_s`` later."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from vertumnus.engine.logprobs import PromptLogprobs
from vertumnus.engine.messages import (
    EpochAck,
    KVData,
    KVRead,
    KVTransfer,
    KVWritten,
    PrefillCommand,
    PrefillDone,
    RankReady,
    Shutdown,
    SwitchEpoch,
)
from vertumnus.policy.costs import ReuseCurve
from vertumnus.sim.time_model import TimeModel


class FakeRanks:
    holds_kv = False  # (no KV bytes: a host tier runs its policy, moves nothing)
    local_stores = None  # (no stores on this host to stream from)

    def __init__(
        self,
        world_size: int,
        curves: Mapping[int, ReuseCurve],
        time_model: TimeModel,
        kv_shape: tuple[int, int, int] = (1, 1, 1),
        block_size: int = 16,
    ) -> None:
        """``kv_shape``: (layers, KV heads, head dim) of the rows and blocks the fake
        hands off (float32); ``block_size``: tokens per block."""
        self.world_size = world_size
        self.kv_shape, self.block_size = kv_shape, block_size
        self.curves, self.time = curves, time_model
        self.deliver: Callable[[object], None] | None = None  # the coordinator's link
        self.ready: dict[int, RankReady] = {}  # (no start: no readiness to report)
        self.attention_ms: dict[str, dict[str, float]] = {}
        self.sent: list[tuple[int, object]] = []
        self.killed: list[int] = []
        self.hung_on_switch: set[int] = set()  # ranks that never acknowledge an epoch
        self.hung_on_copy: set[int] = set()  # ranks that never answer a KV copy
        self.restart_s = 1.0  # a restarted rank is ready after this long
        self._prefill_s: dict[int, float] = {}  # request id -> its time, once per worker
        self._incarnation = dict.fromkeys(range(world_size), 0)
        self._loop: asyncio.AbstractEventLoop | None = None

    def report_to(self, loop: asyncio.AbstractEventLoop, switchboard: Any) -> None:
        pass  # (no hosts: nothing to report)

    def start(self) -> None:
        pass

    def _later(self, seconds: float, msg: object, rank: int | None = None) -> None:
        """Deliver ``msg`` in ``seconds``, unless ``rank`` is killed meanwhile."""
        assert self.deliver is not None, "attach the coordinator: fake.deliver = ..."
        deliver = self.deliver
        alive = None if rank is None else self._incarnation[rank]

        def answer() -> None:
            if rank is None or self._incarnation[rank] == alive:
                deliver(msg)

        asyncio.get_running_loop().call_later(seconds, answer)

    def send(self, rank: int, msg: object) -> None:
        self._loop = asyncio.get_running_loop()
        self.sent.append((rank, msg))
        if rank in self.killed:
            return  # a dead rank reads nothing
        match msg:
            case PrefillCommand():
                first = rank == msg.worker_ranks[0]
                if first:
                    cached = msg.prefix_len
                    computed = int(msg.token_ids.numel())
                    curve = self.curves[len(msg.worker_ranks)]
                    exec_s = curve.time_s(cached + computed, cached)
                    self._prefill_s[msg.request_id] = self.time.prefill_s(exec_s)
                seconds = self._prefill_s[msg.request_id]
                if rank == msg.worker_ranks[-1]:
                    del self._prefill_s[msg.request_id]
                logits = torch.zeros(1, 8) if first else None
                exported = None
                if first and msg.export is not None:
                    layers, heads, dim = self.kv_shape
                    rows = msg.export[1] - msg.export[0]
                    exported = torch.zeros(2, layers, rows, heads, dim)
                prompt = None
                if first and msg.prompt_logprobs is not None:
                    n, k = computed - 1, msg.prompt_logprobs
                    ids = torch.zeros(n, k, dtype=torch.long)
                    prompt = PromptLogprobs(torch.zeros(n), ids, torch.zeros(n, k))
                done = PrefillDone(
                    msg.request_id,
                    rank,
                    seconds,
                    logits,
                    {},
                    exported=exported,
                    prompt_logprobs=prompt,
                )
                self._later(seconds, done, rank)
            case KVRead():
                layers, heads, dim = self.kv_shape
                rows = torch.zeros(2, layers, len(msg.slots) * self.block_size, heads, dim)
                moves = [(rank, s, rank + 1, s) for s in msg.slots]  # (as far as the wire)
                self._later(self.time.copy_s(moves), KVData(msg.read_id, rank, rows), rank)
            case SwitchEpoch():
                if rank not in self.hung_on_switch:
                    self._later(self.time.switch_s, EpochAck(rank, msg.epoch), rank)
            case KVTransfer():
                if rank not in self.hung_on_copy:
                    written = KVWritten(msg.copy_id, rank)
                    self._later(self.time.copy_s(msg.moves), written, rank)
            case Shutdown():
                pass
            case _:
                raise AssertionError(f"FakeRanks cannot answer {type(msg).__name__}")

    def channels(self) -> list[tuple[int, Any, int]]:
        return []

    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        """New processes for ``ranks`` (called from an executor thread): each is ready
        ``restart_s`` later, answers again, and shares no group with a live rank."""
        loop = self._loop
        assert loop is not None and self.deliver is not None
        deliver, delay = self.deliver, self.restart_s
        for r in ranks:
            self._incarnation[r] += 1
            self.hung_on_switch.discard(r)
            self.hung_on_copy.discard(r)
            if r in self.killed:
                self.killed.remove(r)

            def ready(r: int = r, alive: int = self._incarnation[r]) -> None:
                def answer() -> None:  # (not if killed meanwhile, starting)
                    if self._incarnation[r] == alive:
                        deliver(RankReady(r, "cpu", 0))

                loop.call_later(delay, answer)

            loop.call_soon_threadsafe(ready)
        return []

    def incarnation(self, rank: int) -> int:
        return self._incarnation[rank]

    def kill(self, rank: int) -> None:
        """The rank is dead: what it owed is never answered."""
        self._loop = asyncio.get_running_loop()  # (a restart answers on it)
        self._incarnation[rank] += 1
        if rank not in self.killed:
            self.killed.append(rank)

    def pid(self, rank: int) -> int | None:
        return None

    def host_of(self, rank: int) -> str:
        return "in-process"

    def close(self, timeout_s: float = 10.0) -> None:
        pass


class MemorySink:
    """A hand-off pull's stream kept in memory (the ``Sink`` of ``runtime/kv/leases.py``);
    ``aborted`` once cut off, after which its writes fail as a closed socket's do."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.aborted = False

    async def start(self, data: bytes) -> None:
        self.data += data

    def writev(self, views: Sequence[Any]) -> None:
        if self.aborted:
            raise ConnectionResetError("the puller went away")
        for view in views:
            self.data += bytes(view)

    async def drain(self) -> None:
        await asyncio.sleep(0)
        if self.aborted:
            raise ConnectionResetError("the puller went away")

    async def flush(self) -> None:
        await self.drain()

    def abort(self) -> None:
        self.aborted = True


def fake_pool_config(tmp_path: Any, layout: tuple[int, ...], **overrides: Any) -> Any:
    """A ``ServeConfig`` for a coordinator over ``FakeRanks``: workers of degrees
    ``layout`` (of 1 and 2), ``tiny``'s CPU profile (``cpu_profile``), eager layers,
    no controller and no replication, ``rank_timeout_s`` 5 s (simulated, on a
    ``VirtualTimeLoop``) and ``request_timeout_s`` 600 s; ``overrides`` on top."""
    from support.factories import cpu_profile
    from vertumnus.config import EngineConfig
    from vertumnus.config.pool import PoolConfig
    from vertumnus.policy.pool_config import PolicyConfig
    from vertumnus.runtime.serve_config import ServeConfig

    cfg = ServeConfig(
        pool=PoolConfig((1, 2), layout),
        engine=EngineConfig(compile="off", rank_timeout_s=5.0),
        profile=cpu_profile(tmp_path),
        policy=PolicyConfig(adaptive=False, replication=False),
        request_timeout_s=600.0,
    )
    return dataclasses.replace(cfg, **overrides)


async def start_coordinator(
    cfg: Any, settings: Any, fake_class: type[FakeRanks] = FakeRanks
) -> tuple[Any, FakeRanks]:
    """A coordinator on ``cfg`` over ``FakeRanks`` (or ``fake_class``) timed by
    ``settings`` (a ``SimSettings``), on the running loop's clock, started:
    (coordinator, fake)."""
    from vertumnus.config import resolve_model
    from vertumnus.perfmodel import Profile
    from vertumnus.policy.costs import reuse_curves
    from vertumnus.runtime.coordinator import Coordinator

    loop = asyncio.get_running_loop()
    block = cfg.engine.block_size
    model, _ = resolve_model(cfg.model)
    fake = fake_class(
        cfg.ranks,
        reuse_curves(Profile.load(cfg.profile).coeffs),
        TimeModel(settings, block),
        (model.num_hidden_layers, model.num_key_value_heads, model.head_dim),
        block,
    )
    coord = Coordinator(cfg, ranks=fake, clock=loop.time, offload_decisions=False)
    fake.deliver = coord.link.on_message
    await coord.start()
    return coord, fake
