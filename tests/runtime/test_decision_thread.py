"""The server computes the what-if controller's replays off its event loop: on the
coordinator's decision thread, the pool read before and the decision applied after
on the loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from support.factories import make_profile
from support.fake_ranks import FakeRanks
from vertumnus.config import EngineConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.control import whatif
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.sim.time_model import SimSettings, TimeModel


def make_config(tmp_path: Path) -> ServeConfig:
    coeffs = {1: DegreeCoeffs(d=0.002, c=2e-6), 2: DegreeCoeffs(d=0.003, c=1.2e-6)}
    path = tmp_path / "profile.json"
    make_profile(coeffs).save(path)
    controller = ControllerConfig(decision_s=0.2, horizon_s=0.2, min_requests=20)
    return ServeConfig(
        pool=PoolConfig((1, 2), (2, 2)),
        engine=EngineConfig(),
        profile=str(path),
        policy=PolicyConfig(controller=controller, replication=False),
        request_timeout_s=60.0,
    )


@pytest.mark.timeout(60)
def test_decisions_replay_on_the_decision_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path)
    threads: list[str] = []
    evaluate = whatif.WhatIfController.evaluate

    def on_thread(plan: whatif.WhatIfPlan) -> whatif.Evaluation:
        threads.append(threading.current_thread().name)
        return evaluate(plan)

    monkeypatch.setattr(whatif.WhatIfController, "evaluate", staticmethod(on_thread))

    async def main() -> Coordinator:
        curves = reuse_curves(Profile.load(cfg.profile).coeffs)
        fake = FakeRanks(cfg.ranks, curves, TimeModel(SimSettings(switch_s=0.005), 16))
        coord = Coordinator(cfg, ranks=fake)  # offload_decisions: the default
        fake.deliver = coord.link.on_message
        await coord.start()
        try:
            answers = []
            for i in range(150):  # 1.5 s of requests
                answers.append(asyncio.ensure_future(coord.prefill(list(range(1, 30 + i % 50)))))
                await asyncio.sleep(0.01)
            results = await asyncio.gather(*answers)
            assert len({r.request_id for r in results}) == 150
            await asyncio.sleep(0.3)
        finally:
            await coord.close()
        return coord

    coord = asyncio.run(main())
    history = coord.policy.controller.history
    assert len(history) >= 5
    assert threads and all(name.startswith("vertumnus-decide") for name in threads)
    assert len(coord.decision_s) == len(threads)
    with_load = [d for d in history if d.inputs.get("forecast_requests")]
    assert with_load and all(d.inputs["candidates"] for d in with_load)
    # The composition view lists the latest decisions, explained.
    view = coord.composition_view()
    assert view["controller"]["mode"] == "whatif" and view["controller"]["period_s"] == 0.2
    latest = view["controller"]["decisions"]
    assert len(latest) == min(10, len(history)) and latest[-1]["window"] == history[-1].window
    assert {"margin", "chosen", "candidates"} <= set(with_load[-1].to_json())
