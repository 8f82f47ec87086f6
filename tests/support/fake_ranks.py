"""Ranks in the test process: the coordinator's ``Ranks`` contract without processes.

Every command is answered after the time the simulator's own time model gives it
(``sim/time_model.py``): a prefill after E_C(L - P, P) from the profile at the
prefix the command reuses, a switch after ``switch_s``, a KV copy after the copy
model's time. Answers go straight to the coordinator's ``RankLink`` (no pipes), on
the event loop's clock, so on a ``VirtualTimeLoop`` the coordinator lives through
the same simulated time as the simulator."""

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
        self._prefill_s: dict[int, float] = {}  # request id -> its time, once per worker

    def start(self) -> None:
        pass

    def _later(self, seconds: float, msg: object) -> None:
        assert self.deliver is not None, "attach the coordinator: fake.deliver = ..."
        asyncio.get_running_loop().call_later(seconds, self.deliver, msg)

    def send(self, rank: int, msg: object) -> None:
        self.sent.append((rank, msg))
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
                self._later(seconds, PrefillDone(msg.request_id, rank, seconds, logits, {}))
            case SwitchEpoch():
                self._later(self.time.switch_s, EpochAck(rank, msg.epoch))
            case KVTransfer():
                self._later(self.time.copy_s(msg.moves), KVWritten(msg.copy_id, rank))
            case Shutdown():
                pass
            case _:
                raise AssertionError(f"FakeRanks cannot answer {type(msg).__name__}")

    def channels(self) -> list[tuple[int, Any, int]]:
        return []

    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        raise AssertionError("FakeRanks do not fail")

    def incarnation(self, rank: int) -> int:
        return 0

    def kill(self, rank: int) -> None:
        raise AssertionError("FakeRanks do not fail")

    def pid(self, rank: int) -> int | None:
        return None

    def host_of(self, rank: int) -> str:
        return "in-process"

    def close(self, timeout_s: float = 10.0) -> None:
        pass
