"""A late ``RankFailed``: rank 0 of a CP2 worker dies mid-prefill, and its live peer,
rank 1, reports its broken collective after the request's attempt has ended (the
request is placed again). Injected exactly there, on fake ranks in simulated time:

- with another worker, the request's new attempt runs there when the report comes:
  that attempt, and that worker, are untouched (once, the report failed the new
  attempt and took the healthy worker down with it);
- with no other worker, the request waits for its worker's restart when the report
  comes: the pool goes on serving (once, the report was taken for a failure of the
  whole pool, and every later request got a 503).

Either way the request is answered once, the failed worker restarts once, and no
bug is counted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from support.fake_ranks import FakeRanks, fake_pool_config, start_coordinator
from support.virtual_time import run_virtual
from vertumnus.engine.messages import PrefillCommand, RankFailed
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.sim.time_model import SimSettings

BROKEN = "RuntimeError: Connection closed by peer"
SETTINGS = SimSettings(switch_s=0.01)


async def sent_to(fake: FakeRanks, request_id: int, ranks: tuple[int, ...]) -> None:
    """Until the request's prefill command has gone to ``ranks``."""
    for _ in range(10_000):
        if any(
            isinstance(m, PrefillCommand) and m.request_id == request_id and m.worker_ranks == ranks
            for _, m in fake.sent
        ):
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"request {request_id} never went to ranks {ranks}")


def restarts(coord: Coordinator) -> float:
    return coord.metrics.registry.get_sample_value("vertumnus_worker_restarts_total") or 0.0


@pytest.mark.timeout(60)
def test_a_late_report_leaves_the_new_attempt_and_its_worker_alone(tmp_path: Path) -> None:
    async def main() -> None:
        coord, fake = await start_coordinator(fake_pool_config(tmp_path, (2, 2)), SETTINGS)
        try:
            answer = asyncio.ensure_future(coord.prefill(list(range(1, 200))))
            rid = 1
            await sent_to(fake, rid, (0, 1))  # the first request: worker 0, ranks 0 and 1
            fake.kill(0)
            coord.recovery.rank_exited(0)
            await sent_to(fake, rid, (2, 3))  # placed again, on the other worker
            coord.link.on_message(RankFailed(1, rid, BROKEN, ""))
            result = await asyncio.wait_for(answer, 30)
            assert result.cp_degree == 2 and result.worker != 0
            assert 2 not in fake.killed and 3 not in fake.killed
            while restarts(coord) < 1:
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)  # (a restart of the other worker would come by now)
            assert restarts(coord) == 1 and coord.rank_error is None
            again = await coord.prefill(list(range(1, 60)))
            assert again.request_id == 2
            assert coord.metrics.internal_error_count == 0
        finally:
            await coord.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_late_report_while_the_request_waits_does_not_fail_the_pool(tmp_path: Path) -> None:
    async def main() -> None:
        coord, fake = await start_coordinator(fake_pool_config(tmp_path, (2,)), SETTINGS)
        try:
            answer = asyncio.ensure_future(coord.prefill(list(range(1, 200))))
            rid = 1
            await sent_to(fake, rid, (0, 1))
            fake.kill(0)
            coord.recovery.rank_exited(0)
            for _ in range(50):  # (the attempt ends; the request waits for the restart)
                await asyncio.sleep(0)
            coord.link.on_message(RankFailed(1, rid, BROKEN, ""))
            assert coord.rank_error is None and coord.ready
            result = await asyncio.wait_for(answer, 30)
            assert result.request_id == rid and result.worker == 0
            assert restarts(coord) == 1 and coord.rank_error is None
            again = await coord.prefill(list(range(1, 60)))
            assert again.cached_tokens > 0  # (the restarted worker cached the first)
            assert coord.metrics.internal_error_count == 0
        finally:
            await coord.close()

    run_virtual(main())
