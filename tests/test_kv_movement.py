"""Live KV movement between workers of the serving coordinator, on real rank
processes (gloo): an intra-degree copy between degree-1 workers and an inter-degree
copy re-sharded from a degree-2 worker to a degree-1 worker. After each, a prefill
on the destination reuses the copied prefix and gives the logits of a fresh full
prefill of the same tokens."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from vertumnus.blocks import block_ids
from vertumnus.config import EngineConfig
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.cache_plans import CacheManagerConfig
from vertumnus.policy.lattice import WorkerState
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig

pytestmark = pytest.mark.multiproc
ATOL = 1e-4


def make_config(tmp_path: Path, ranks: int, layout: tuple[int, ...]) -> ServeConfig:
    profile = Profile(
        "tiny",
        "cpu",
        16,
        {
            1: DegreeCoeffs(d=0.004, c=3e-5, alpha=3e-8),
            2: DegreeCoeffs(d=0.009, c=4e-5, alpha=2e-8),
        },
    )
    profile.capacity = {1: {"kappa_s": 10.0}, 2: {"kappa_s": 15.0}}
    path = tmp_path / "profile.json"
    profile.save(path)
    return ServeConfig(
        ranks=ranks,
        degrees=(1, 2),
        layout=layout,
        engine=EngineConfig(device="cpu", dtype="float32", threads_per_rank=1, rank_timeout_s=60.0),
        profile=path,
        controller_enabled=False,
        scan_interval_s=0.0,
        cache=CacheManagerConfig(theta_intra=0.5, theta_reclaim=0.1, theta_inter_s=1e9),
    )


def tokens(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(256) for _ in range(n)]


async def only(coord: Coordinator, worker: int, prompt: list[int]):  # type: ignore[no-untyped-def]
    """Prefill with every other worker out of the candidate set."""
    others = [w for w in coord.lattice.workers.values() if w.worker_id != worker]
    for w in others:
        w.state = WorkerState.UNAVAILABLE
    try:
        return await coord.prefill(prompt)
    finally:
        for w in others:
            w.state = WorkerState.ACTIVE


@pytest.mark.timeout(240)
def test_intra_degree_copy_by_scan_then_reuse(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, 2, (1, 1)))
        await coord.start()
        try:
            prompt = tokens(200)
            fresh = await only(coord, 0, prompt)
            again = await only(coord, 0, prompt)  # a reuse: access 1 > 0.5 per replica
            assert again.cached_tokens == 192 and again.worker == 0
            scan = await coord.scan_now()
            assert scan["copies"] == 1  # the hot chain, in one copy
            # Visible to placement now that the destination confirmed it.
            assert coord.cache.reusable_tokens(block_ids(prompt, 16), 200) == {0: 192, 1: 192}
            moved = await only(coord, 1, prompt)
            assert moved.worker == 1 and moved.cached_tokens == 192
            assert moved.first_token == fresh.first_token
            assert torch.allclose(moved.logits, fresh.logits, atol=ATOL)
            assert coord.cache_view()["replications"] == 1
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_inter_degree_copy_is_resharded(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, 4, (1, 1, 2)))
        await coord.start()
        try:
            prompt = tokens(300)
            fresh = await only(coord, 2, prompt)  # degree 2: blocks alternate ranks 2, 3
            assert fresh.cp_degree == 2
            last = block_ids(prompt, 16)[-1]
            plan = coord.cache.plan_copy(last, source=2, dest=0)
            assert plan.kind == "inter" and plan.reshard
            assert await coord.run_copy(plan) == 18  # 288 tokens in 16-token blocks
            moved = await only(coord, 0, prompt)
            assert moved.cp_degree == 1 and moved.cached_tokens == 288
            assert moved.first_token == fresh.first_token
            assert torch.allclose(moved.logits, fresh.logits, atol=ATOL)
            # One replica per degree: a scan reclaims nothing (the last copy at a
            # degree is left to the LRU).
            assert (await coord.scan_now())["reclaims"] == 0
        finally:
            await coord.close()

    asyncio.run(main())
