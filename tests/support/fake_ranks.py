"""Ranks in the test process: the coordinator's ``Ranks`` contract without processes.

Every command is answered after the time the simulator's own time model gives it
(``sim/time_model.py``): a prefill after E_C(L - P, P) from the profile at the
prefix the command reuses, a switch after ``switch_s``, a KV copy after the copy
model's time. Answers go straight to the coordinator's ``RankLink`` (no pipes), on
the event loop's clock, so on a ``VirtualTimeLoop`` the coordinator lives through
the same simulated time as the simulator. A test can make ranks hang
(``hung_on_switch``); killed ranks answer nothing, and restarted ones come back
``restart_s`` later."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from vertumnus.engine.messages import (
    EpochAck,
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
    def __init__(
        self, world_size: int, curves: Mapping[int, ReuseCurve], time_model: TimeModel
    ) -> None:
        self.world_size = world_size
        self.curves, self.time = curves, time_model
        self.deliver: Callable[[object], None] | None = None  # the coordinator's link
        self.on_rejoin: Callable[[list[int]], None] | None = None
        self.sent: list[tuple[int, object]] = []
        self.killed: list[int] = []
        self.hung_on_switch: set[int] = set()  # ranks that never acknowledge an epoch
        self.restart_s = 1.0  # a restarted rank is ready after this long
        self._prefill_s: dict[int, float] = {}  # request id -> its time, once per worker
        self._incarnation = dict.fromkeys(range(world_size), 0)
        self._loop: asyncio.AbstractEventLoop | None = None

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
                done = PrefillDone(msg.request_id, rank, seconds, logits, {})
                self._later(seconds, done, rank)
            case SwitchEpoch():
                if rank not in self.hung_on_switch:
                    self._later(self.time.switch_s, EpochAck(rank, msg.epoch), rank)
            case KVTransfer():
                self._later(self.time.copy_s(msg.moves), KVWritten(msg.copy_id, rank), rank)
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
            if r in self.killed:
                self.killed.remove(r)

            def ready(r: int = r) -> None:
                loop.call_later(delay, deliver, RankReady(r, "cpu", 0))

            loop.call_soon_threadsafe(ready)
        return []

    def incarnation(self, rank: int) -> int:
        return self._incarnation[rank]

    def kill(self, rank: int) -> None:
        """The rank is dead: what it owed is never answered."""
        self._incarnation[rank] += 1
        if rank not in self.killed:
            self.killed.append(rank)

    def pid(self, rank: int) -> int | None:
        return None

    def host_of(self, rank: int) -> str:
        return "in-process"

    def close(self, timeout_s: float = 10.0) -> None:
        pass
