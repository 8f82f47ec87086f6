"""Live KV movement between workers of the serving coordinator, on real rank
processes (gloo): an intra-degree copy between degree-1 workers, an inter-degree
copy re-sharded from a degree-2 worker to a degree-1 worker, two copies on
disjoint ranks at once, and a pull the policy makes itself. After each, a prefill
on the destination reuses the copied prefix and gives the logits of a fresh full
prefill of the same tokens."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from support.coordinator import only
from support.factories import cpu_profile, engine_config, make_tokens
from vertumnus.blocks import block_ids
from vertumnus.config.pool import PoolConfig
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.cache.retention import RetentionConfig
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig

pytestmark = pytest.mark.multiproc
ATOL = 1e-4


def make_config(
    tmp_path: Path, ranks: int, layout: tuple[int, ...], fetch_at_switch: bool = False
) -> ServeConfig:
    # A fixed composition and no periodic scans: each test scans and reshapes itself
    # (and, unless asked, fetches pending prefixes itself).
    policy = PolicyConfig(
        adaptive=False,
        replication=False,
        cache=CacheManagerConfig(theta_intra=0.5, theta_reclaim=0.1, theta_inter_s=1e9),
        retention=RetentionConfig(fetch_at_switch=fetch_at_switch),
    )
    pool = PoolConfig((1, 2), layout)
    assert pool.ranks == ranks
    profile = cpu_profile(tmp_path)
    return ServeConfig(pool=pool, engine=engine_config(), profile=profile, policy=policy)


async def reuses_the_whole_prefix(  # type: ignore[no-untyped-def]
    coord: Coordinator, left: int, right: int, prompt: list[int], fresh
) -> None:
    """After a split of the worker that prefilled ``prompt`` (100 tokens), the left
    child reuses its 6 whole blocks exactly, and the right child's retained slots
    went back once fetched."""
    again = await only(coord, left, prompt)
    assert again.cached_tokens == 96 and again.cp_degree == 1
    assert again.first_token == fresh.first_token
    assert torch.allclose(again.logits, fresh.logits, atol=ATOL)
    assert coord.indexes[right].num_free_slots(0) == 1024


@pytest.mark.timeout(240)
def test_intra_degree_copy_by_scan_then_reuse(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, 2, (1, 1)))
        await coord.start()
        try:
            prompt = make_tokens(200, seed=200, vocab=256)
            fresh = await only(coord, 0, prompt)
            again = await only(coord, 0, prompt)  # a reuse: access 1 > 0.5 per replica
            assert again.cached_tokens == 192 and again.worker == 0
            # The hot chain grows at the new holder from its root, at most
            # max_intra_per_scan (4) one-block copies per scan: 12 blocks, 3 scans,
            # while it stays hot at worker 0 (a reuse before each scan).
            copies = []
            for n in range(3):
                if n:
                    assert (await only(coord, 0, prompt)).cached_tokens == 192
                scan = await coord.scan_now()
                copies.append((scan["copies"], scan["blocks_copied"]))
            assert copies == [(4, 4), (4, 4), (4, 4)]
            # Visible to placement now that the destination confirmed it.
            assert coord.cache.reusable_tokens(block_ids(prompt, 16), 200) == {0: 192, 1: 192}
            moved = await only(coord, 1, prompt)
            assert moved.worker == 1 and moved.cached_tokens == 192
            assert moved.first_token == fresh.first_token
            assert torch.allclose(moved.logits, fresh.logits, atol=ATOL)
            assert coord.cache_view()["replications"] == 12
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_inter_degree_copy_is_resharded(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, 4, (1, 1, 2)))
        await coord.start()
        try:
            prompt = make_tokens(300, seed=300, vocab=256)
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


@pytest.mark.timeout(300)
def test_copies_on_disjoint_ranks_run_at_once(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, 4, (1, 1, 1, 1)))
        await coord.start()
        try:
            prompts = [make_tokens(200, seed=400 + k, vocab=256) for k in range(2)]
            fresh = [await only(coord, k, p) for k, p in enumerate(prompts)]
            plans = [
                coord.cache.plan_copy(block_ids(p, 16)[-1], source=k, dest=k + 2)
                for k, p in enumerate(prompts)
            ]
            copies = asyncio.gather(*(coord.run_copy(plan) for plan in plans))
            await asyncio.sleep(0)  # both queued: ranks 0 -> 2 and 1 -> 3 share nothing
            assert set(coord.policy.lanes.running) == {p.plan_id for p in plans}
            assert await copies == [12, 12]
            for k, p in enumerate(prompts):
                moved = await only(coord, k + 2, p)
                assert moved.worker == k + 2 and moved.cached_tokens == 192
                assert torch.allclose(moved.logits, fresh[k].logits, atol=ATOL)
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_merge_and_split_adopt_the_blocks_left_in_place(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, 2, (1, 1)))
        await coord.start()
        try:
            prompt = make_tokens(130, seed=130, vocab=256)  # 8 whole blocks reusable
            fresh = await only(coord, 0, prompt)
            await only(coord, 1, prompt)  # both degree-1 workers hold the prefix
            merge = coord.reshape_for("merge", [0, 1])
            transition = await coord.begin_reshape(merge)
            (merged,) = transition.new_workers
            # Merged on ranks 0-1, block j belongs on rank j % 2: even blocks sit on
            # rank 0 (worker 0's), odd ones on rank 1 (worker 1's): all in place.
            index = coord.indexes[merged]
            assert len(index) == 8
            after = await coord.prefill(prompt)
            assert after.worker == merged and after.cp_degree == 2 and after.cached_tokens == 128
            assert after.first_token == fresh.first_token
            assert torch.allclose(after.logits, fresh.logits, atol=ATOL)
            split = coord.reshape_for("split", [merged])
            transition = await coord.begin_reshape(split)
            left, right = transition.new_workers
            # Each child keeps what sits on its own rank at the right depth: the prefix
            # goes to one child, which adopts its first block (on rank 0) only.
            held = {w: len(coord.indexes[w]) for w in (left, right)}
            assert held == {left: 1, right: 0}
            again = await only(coord, left, prompt)
            assert again.cached_tokens == 16
            assert torch.allclose(again.logits, fresh.logits, atol=ATOL)
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_split_fetches_the_misplaced_half_from_the_retained_slots(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, 2, (2,)))
        await coord.start()
        try:
            # 6 whole blocks reusable, alternating ranks 0 and 1
            prompt = make_tokens(100, seed=100, vocab=256)
            fresh = await coord.prefill(prompt)
            assert fresh.cp_degree == 2
            transition = await coord.begin_reshape(coord.reshape_for("split", None))
            left, right = transition.new_workers
            assert len(coord.indexes[left]) == 1  # block 0 adopted in place
            # Blocks 1..5 wait in reserved slots: 2 and 4 on this child's rank, 1, 3
            # and 5 on the other child's.
            assert coord.indexes[left].num_free_slots(0) == 1024 - 1 - 2
            assert coord.indexes[right].num_free_slots(0) == 1024 - 3
            update = coord.cache.on_request(block_ids(prompt, 16), len(prompt), left)
            assert update.fetch is not None and update.fetch.kind == "fetch"
            assert await coord.run_copy(update.fetch) == 5
            await reuses_the_whole_prefix(coord, left, right, prompt, fresh)
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_a_split_fetches_its_prefix_back_at_the_switch(tmp_path: Path) -> None:
    """The default: right after the switch the children fetch the prefixes the split
    left out of place, and the next request reuses the whole prefix, exactly."""

    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, 2, (2,), fetch_at_switch=True))
        await coord.start()
        try:
            prompt = make_tokens(100, seed=100, vocab=256)  # 6 whole blocks reusable
            fresh = await coord.prefill(prompt)
            transition = await coord.begin_reshape(coord.reshape_for("split", None))
            left, right = transition.new_workers
            deadline = asyncio.get_running_loop().time() + 60.0
            while coord.cache.copies_in_flight:
                assert asyncio.get_running_loop().time() < deadline, "the fetch never ended"
                await asyncio.sleep(0.05)
            assert len(coord.indexes[left].match(block_ids(prompt, 16))) == 6
            await reuses_the_whole_prefix(coord, left, right, prompt, fresh)
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(240)
def test_a_pull_makes_a_replica_that_is_then_served(tmp_path: Path) -> None:
    """The policy itself (not a test's plan): a request placed where its prefix is not
    held pulls it from the holder, waits for it, and reuses it; the replica then
    serves the next request there, and both give a fresh prefill's logits."""

    async def main() -> None:
        cfg = make_config(tmp_path, 2, (1, 1))
        policy = dataclasses.replace(
            cfg.policy,
            replication=True,
            scan_interval_s=1e6,  # no periodic scans: only the pull moves KV
            cache=CacheManagerConfig(copy_latency_s=1e-4, copy_block_s=1e-5),
        )
        coord = Coordinator(dataclasses.replace(cfg, policy=policy))
        await coord.start()
        try:
            prompt = make_tokens(250, seed=250, vocab=256)
            fresh = await only(coord, 0, prompt)  # worker 0 holds 15 blocks
            assert fresh.cached_tokens == 0
            moved = await only(coord, 1, prompt)  # placed on 1: pulled from 0
            assert moved.worker == 1 and moved.cached_tokens == 240
            assert moved.first_token == fresh.first_token
            assert torch.allclose(moved.logits, fresh.logits, atol=ATOL)
            audit = coord.cache_view()["audit"]["pull"]
            assert (audit["copies"], audit["installed_blocks"], audit["used_blocks"]) == (1, 15, 15)
            # The replica serves the next request at worker 1 (no second pull).
            # The replica serves the next request there: no second pull.
            served = await only(coord, 1, prompt)
            assert served.worker == 1 and served.cached_tokens == 240
            assert torch.allclose(served.logits, fresh.logits, atol=ATOL)
            audit = coord.cache_view()["audit"]["pull"]
            assert (audit["copies"], audit["hits"], audit["waste_fraction"]) == (1, 2, 0.0)
            assert coord.cache_view()["replications"] >= 1
        finally:
            await coord.close()

    asyncio.run(main())
