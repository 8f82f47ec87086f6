"""Recovery's windows, each injected exactly where an ``await`` opens it, on fake ranks:

- the shutdown begins while a worker's ranks are being restarted in a thread: the
  ranks are closed after that restart returns, never beside it, and the recovery
  then stops (nothing watched or sent, no failure logged over the shutdown's);
- a restarted rank dies while it starts: the restart fails at once, not after
  ``rank_timeout_s``, and is tried again (the worker rejoins sooner than a restart
  that waited for its time-out could);
- the shutdown closes the ranks while a switch waits for the pulls on its ranks:
  the switch sends nothing to the closed ranks and counts no bug."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from support.fake_ranks import FakeRanks, fake_pool_config, start_coordinator
from support.virtual_time import run_virtual
from vertumnus.engine.messages import RebuildGroups, SwitchEpoch
from vertumnus.policy.lattice import WorkerState
from vertumnus.runtime.kv.handoffs import Handoffs
from vertumnus.sim.time_model import SimSettings

SETTINGS = SimSettings(switch_s=0.01)


class GatedRanks(FakeRanks):
    """A restart that blocks (in its thread) until the test opens the gate; what
    happened, in order, in ``events``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.events: list[str] = []

    def restart(self, ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
        self.events.append("restart began")
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        rebuild = super().restart(ranks)
        self.events.append("restart ended")
        return rebuild

    def close(self, timeout_s: float = 10.0) -> None:
        self.events.append("closed")
        super().close(timeout_s)


@pytest.mark.timeout(60)
def test_a_shutdown_during_a_restart_closes_the_ranks_after_it(tmp_path: Path) -> None:
    cfg = fake_pool_config(tmp_path, (1, 1))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        coord, fake = await start_coordinator(cfg, SETTINGS, GatedRanks)
        assert isinstance(fake, GatedRanks)
        closed = False
        try:
            fake.kill(0)
            coord.recovery.rank_exited(0)
            await loop.run_in_executor(None, fake.entered.wait, 30)  # the restart's thread
            coord.stop_admission()
            closing = asyncio.ensure_future(coord.close())
            for _ in range(20):
                await asyncio.sleep(0.01)
            assert not closing.done() and fake.events == ["restart began"]
            sent = len(fake.sent)
            fake.gate.set()
            await asyncio.wait_for(closing, 30)
            closed = True
            assert fake.events == ["restart began", "restart ended", "closed"]
            assert not any(isinstance(m, RebuildGroups) for _, m in fake.sent[sent:])
            assert coord.rank_error == "the server is shutting down"
            assert coord.metrics.internal_error_count == 0
        finally:
            fake.gate.set()
            if not closed:
                await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_rank_that_dies_while_it_restarts_fails_its_restart_at_once(tmp_path: Path) -> None:
    cfg = fake_pool_config(tmp_path, (1, 1))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        coord, fake = await start_coordinator(cfg, SETTINGS)
        fake.restart_s = 3.0  # a restarted rank is ready 3 s after its restart
        try:
            began = loop.time()
            fake.kill(0)
            coord.recovery.rank_exited(0)
            await asyncio.sleep(1.0)  # restarting (ready at +3 s)
            fake.kill(0)  # it dies starting
            coord.recovery.rank_exited(0)
            worker = coord.recovery.worker_of_rank(0)
            assert worker is not None
            while worker.state is not WorkerState.ACTIVE:
                await asyncio.sleep(0.05)
            # Failed at +1 s, tried again 2 s later, ready 3 s after that: +6 s (a
            # restart that waited for its time-out: +5, +7, ready at +10 s).
            assert loop.time() - began == pytest.approx(6.0, abs=0.2)
            assert coord.rank_error is None and coord.metrics.internal_error_count == 0
            served = await coord.prefill(list(range(1, 30)))
            assert served.request_id == 1
        finally:
            await coord.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_switch_that_outlives_the_ranks_sends_them_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = fake_pool_config(tmp_path, (1, 1))
    gate, settling = asyncio.Event(), asyncio.Event()

    async def held_settle(
        self: Handoffs, devices: set[int], timeout_s: float | None = None
    ) -> None:
        settling.set()
        await gate.wait()  # (a pull still streams from these ranks)

    monkeypatch.setattr(Handoffs, "settle", held_settle)

    async def main() -> None:
        coord, fake = await start_coordinator(cfg, SETTINGS)
        coord.begin_reshape(coord.reshape_for("merge", [0, 1]))
        await asyncio.wait_for(settling.wait(), 30)
        coord.stop_admission()
        await coord.close()
        sent = len(fake.sent)
        gate.set()
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not any(isinstance(m, SwitchEpoch) for _, m in fake.sent[sent:])
        assert coord.metrics.internal_error_count == 0

    asyncio.run(main())
