"""A rank that hangs in the middle of a switch, on simulated time: the coordinator
takes it down after ``rank_timeout_s`` (its acknowledgement is skipped), the switch
completes, the new worker with the dead rank is restarted and serves again, and
every request sent meanwhile is answered once. (A missing
acknowledgement once failed the switch and left its new workers out for good.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from support.factories import make_profile
from support.fake_ranks import FakeRanks
from support.virtual_time import run_virtual
from vertumnus.config import EngineConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.sim.time_model import SimSettings, TimeModel

RANK_TIMEOUT_S = 5.0


def make_config(tmp_path: Path) -> ServeConfig:
    coeffs = {1: DegreeCoeffs(d=0.01, c=1e-5), 2: DegreeCoeffs(d=0.012, c=6e-6)}
    path = tmp_path / "profile.json"
    make_profile(coeffs, {1: 1.0, 2: 1.5}).save(path)
    return ServeConfig(
        pool=PoolConfig((1, 2), (2, 2)),
        engine=EngineConfig(compile="off", rank_timeout_s=RANK_TIMEOUT_S),
        profile=str(path),
        policy=PolicyConfig(adaptive=False, replication=False),
        request_timeout_s=600.0,
    )


@pytest.mark.timeout(60)
def test_a_rank_hung_in_a_switch_is_restarted_and_the_switch_completes(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        curves = reuse_curves(Profile.load(cfg.profile).coeffs)
        fake = FakeRanks(cfg.ranks, curves, TimeModel(SimSettings(switch_s=0.01), 16))
        coord = Coordinator(cfg, ranks=fake, clock=loop.time, offload_decisions=False)
        fake.deliver = coord.link.on_message
        await coord.start()
        try:
            fake.hung_on_switch.add(1)  # rank 1 will never adopt the next epoch
            split = coord.reshape_for("split", [0])
            done = coord.begin_reshape(split)
            # Requests keep coming while the switch waits for rank 1.
            answers = [
                asyncio.ensure_future(coord.prefill(list(range(1, 40 + i)))) for i in range(8)
            ]
            transition = await done
            assert loop.time() == pytest.approx(RANK_TIMEOUT_S, abs=0.1)
            assert fake.killed == [1]  # taken down when its acknowledgement did not come
            left, right = transition.new_workers
            assert coord.lattice.workers[left].state is WorkerState.ACTIVE
            # The new worker on the dead rank restarts, then serves.
            while coord.lattice.workers[right].state is not WorkerState.ACTIVE:
                await asyncio.sleep(0.25)
            assert fake.killed == [] and coord.rank_error is None
            results = await asyncio.gather(*answers)
            assert sorted(r.request_id for r in results) == sorted({r.request_id for r in results})
            others = [w for w in coord.lattice.workers.values() if w.worker_id != right]
            for w in others:
                w.state = WorkerState.UNAVAILABLE
            served = await coord.prefill(list(range(1, 30)))
            assert served.worker == right and served.cp_degree == 1
            for w in others:
                w.state = WorkerState.ACTIVE
            assert coord.composition_name() == "2CP1/1CP2"
        finally:
            await coord.close()

    run_virtual(main())
