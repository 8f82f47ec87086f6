"""A pool on a Ray cluster of two nodes on this machine (two CPU ranks each), under
an in-process coordinator that joins the cluster as a driver; one cluster for the
whole module (its start-up is paid once).

A degree-4 worker spans both nodes and gives transformers' logits; a split leaves
one degree-2 worker on each node and a merge spans them again, under load, every
request answered once with the reference's first token; a prefix copied between
the nodes' workers (rank to rank over torch.distributed) is reused with the
reference's logits; a rank actor killed mid-load and a whole node removed mid-load
lose no accepted request, and the lost worker rejoins (the node once another takes
its place). Every test ends with no rank actor alive, every placement group
removed and the driver disconnected; a pool refuses a process without a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support.factories import BLOCK_SIZE, engine_config, make_profile, make_tokens
from support.ray_cluster import actors_gone, actors_left, ray_cluster, raylets, token_env
from support.reference import ATOL, VOCAB, Checkpoint, hf_logits, max_abs_diff
from vertumnus.config import ConfigError
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.cluster.ray_ranks import RayRanks
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.request_path import PrefillResult
from vertumnus.runtime.serve_config import ClusterConfig, ServeConfig

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Head (no CPUs) plus two nodes of 2 CPUs, token authentication on."""
    with ray_cluster(nodes=2, cpus=2) as c:
        c.raylets_seen = raylets()  # (and those of the nodes added later)
        assert len(c.raylets_seen) == 3
        yield c


def profile(path: Path) -> Path:
    """Coefficients of the tiny model's shape (these tests choose workers themselves
    or through the admin operations)."""
    coeffs = {
        1: DegreeCoeffs(d=0.004, c=3e-5, alpha=3e-8),
        2: DegreeCoeffs(d=0.009, c=2e-5, alpha=2e-8),
        4: DegreeCoeffs(d=0.02, c=1.2e-5, alpha=1e-8),
    }
    kappa_s = {c: 10.0 * c for c in coeffs}
    make_profile(coeffs, kappa_s, model="qwen3-test", hardware="cpu").save(path)
    return path


@dataclass
class Pool:
    coord: Coordinator
    ranks: RayRanks
    cluster: Any

    def node_of_host(self, host: int) -> Any:
        """The cluster's node object that runs ``host``."""
        node_id = self.ranks.hosts.hosts[host].node_id
        return next(n for n in self.cluster.worker_nodes if n.node_id == node_id)


def assert_nothing_left(cluster: Any) -> None:
    """No rank actor alive (Ray's table and this machine's processes), every placement
    group removed, the driver gone."""
    import ray

    assert not ray.is_initialized()
    cluster.raylets_seen |= raylets()
    assert actors_gone(cluster.raylets_seen) == []
    actors = cluster.global_state.actor_table(None)
    alive = [a for a in actors.values() if a["State"] != "DEAD"]
    assert alive == [], f"actors not dead: {alive}"
    groups = cluster.global_state.placement_group_table()
    assert {g["state"] for g in groups.values()} <= {"REMOVED"}


@contextlib.asynccontextmanager
async def pool(
    cluster: Any, tmp_path: Path, checkpoint: Checkpoint, layout: tuple[int, ...], **cache: float
) -> AsyncIterator[Pool]:
    engine = engine_config(kv_blocks_per_rank=128)
    cluster_cfg = ClusterConfig(address=cluster.address, hosts=2, poll_s=0.25)
    ranks = RayRanks(cluster_cfg, checkpoint.config, str(checkpoint.model_dir), engine)
    coord: Coordinator | None = None
    try:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, ranks.gather) == (4, 2)
        cfg = ServeConfig(
            model=str(checkpoint.model_dir),
            pool=PoolConfig((1, 2, 4), layout, devices_per_host=2),
            engine=engine,
            profile=str(profile(tmp_path / "profile.json")),
            policy=PolicyConfig(
                adaptive=False,
                replication=False,
                cache=CacheManagerConfig(**cache),  # type: ignore[arg-type]
            ),
            step_timeout_s=30.0,
        )
        ranks.configure(cfg.degrees)
        coord = Coordinator(cfg, ranks)
        await coord.start()
        yield Pool(coord, ranks, cluster)
    finally:
        if coord is not None:
            await coord.close()
        else:
            ranks.close()
    assert_nothing_left(cluster)


def check_logits(result: PrefillResult, checkpoint: Checkpoint, tokens: list[int]) -> None:
    ref = hf_logits(checkpoint.hf, tokens)[-1]
    diff = max_abs_diff(result.logits, ref)
    assert diff < ATOL, f"max |logit difference| {diff:.3g} >= {ATOL}"
    assert result.first_token == int(ref.argmax())


def first_tokens(checkpoint: Checkpoint, prompts: list[list[int]]) -> list[int]:
    return [int(hf_logits(checkpoint.hf, p)[-1].argmax()) for p in prompts]


async def wait_until(what: str, ok: Any, within_s: float, step_s: float = 0.02) -> float:
    """Seconds until ``ok()``; fails naming ``what`` after ``within_s``."""
    start = time.monotonic()
    while not ok():
        assert time.monotonic() - start < within_s, f"{what} within {within_s:g} s"
        await asyncio.sleep(step_s)
    return time.monotonic() - start


@pytest.mark.timeout(240)
def test_degree4_worker_spanning_two_nodes_matches_reference(
    cluster: Any, tmp_path: Path, checkpoint: Checkpoint
) -> None:
    async def main() -> None:
        async with pool(cluster, tmp_path, checkpoint, (4,)) as p:
            view = p.coord.workers_view()
            assert [(w["ranks"], w["hosts"]) for w in view] == [([0, 1, 2, 3], [0, 1])]
            names = [p.ranks.host_of(r) for r in range(4)]
            assert names[0] == names[1] != names[2] == names[3]
            pids = [p.ranks.pid(r) for r in range(4)]
            assert None not in pids and len(set(pids)) == 4 and os.getpid() not in pids
            assert len(actors_left(cluster.raylets_seen)) == 4  # (what the end checks)
            prompt = make_tokens(300, seed=1, vocab=VOCAB)
            fresh = await p.coord.prefill(prompt)
            assert fresh.cp_degree == 4 and fresh.cached_tokens == 0
            check_logits(fresh, checkpoint, prompt)
            longer = prompt + make_tokens(77, seed=2, vocab=VOCAB)
            reuse = await p.coord.prefill(longer)
            assert reuse.cached_tokens == 288  # 18 whole blocks of the first prompt
            check_logits(reuse, checkpoint, longer)

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_split_and_merge_across_nodes_under_load(
    cluster: Any, tmp_path: Path, checkpoint: Checkpoint
) -> None:
    prompts = [make_tokens(200 + 40 * i, seed=10 + i, vocab=VOCAB) for i in range(16)]
    expected = first_tokens(checkpoint, prompts)

    async def main() -> None:
        async with pool(cluster, tmp_path, checkpoint, (4,)) as p:
            coord = p.coord

            async def load(batch: range) -> list[PrefillResult]:
                return list(await asyncio.gather(*(coord.prefill(prompts[i]) for i in batch)))

            first = asyncio.ensure_future(load(range(8)))
            await asyncio.sleep(0.05)
            split = await coord.begin_reshape(coord.reshape_for("split", None))
            assert split.op.kind == "split"
            halves = sorted((w["ranks"], w["hosts"]) for w in coord.workers_view())
            assert halves == [([0, 1], [0]), ([2, 3], [1])]  # each on its own node
            second = asyncio.ensure_future(load(range(8, 16)))
            await asyncio.sleep(0.05)
            merge = await coord.begin_reshape(coord.reshape_for("merge", None))
            assert merge.op.kind == "merge"
            assert [(w["ranks"], w["hosts"]) for w in coord.workers_view()] == [
                ([0, 1, 2, 3], [0, 1])
            ]
            results = await first + await second
            assert [r.first_token for r in results] == expected
            assert len({r.request_id for r in results}) == len(prompts)
            assert coord.open_requests == 0

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_prefix_copied_between_nodes_is_reused(
    cluster: Any, tmp_path: Path, checkpoint: Checkpoint
) -> None:
    async def main() -> None:
        cache = dict(theta_intra=0.5, theta_reclaim=0.1, theta_inter_s=1e9)
        async with pool(cluster, tmp_path, checkpoint, (2, 2), **cache) as p:
            coord = p.coord
            prompt = make_tokens(260, seed=5, vocab=VOCAB)
            coord.lattice.workers[1].state = WorkerState.UNAVAILABLE
            try:
                await coord.prefill(prompt)
                again = await coord.prefill(prompt)  # hot: a replica pays off
            finally:
                coord.lattice.workers[1].state = WorkerState.ACTIVE
            assert again.worker == 0 and again.cached_tokens == 256
            summary = await coord.scan_now()
            assert summary["copies"] >= 1 and summary["blocks_copied"] > 0
            assert len(coord.indexes[1]) == summary["blocks_copied"]
            coord.lattice.workers[0].state = WorkerState.UNAVAILABLE
            try:
                copied = await coord.prefill(prompt)
            finally:
                coord.lattice.workers[0].state = WorkerState.ACTIVE
            assert copied.worker == 1  # on the second node, with KV from the first
            assert copied.cached_tokens == summary["blocks_copied"] * BLOCK_SIZE
            check_logits(copied, checkpoint, prompt)

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_rank_actor_killed_mid_load_loses_no_request(
    cluster: Any, tmp_path: Path, checkpoint: Checkpoint
) -> None:
    """A rank actor's process dies under load (its node lives): Ray fails its pending
    ``alive`` call, the worker leaves the candidate set, every request is answered
    once and right, the worker's actors are recreated in the same bundles and the
    degree-4 group they share with the other node's ranks is formed anew (a
    spanning merge serves)."""
    prompts = [make_tokens(900 + 50 * i, seed=30 + i, vocab=VOCAB) for i in range(12)]
    expected = first_tokens(checkpoint, prompts)

    async def main() -> None:
        async with pool(cluster, tmp_path, checkpoint, (2, 2)) as p:
            coord = p.coord
            load = asyncio.gather(*(coord.prefill(x) for x in prompts))
            await wait_until("worker 1 runs", lambda: coord.scheduler.running(1), 60)
            old = p.ranks.pid(3)
            assert old is not None
            os.kill(old, signal.SIGKILL)
            await wait_until(
                "the dead rank's worker leaves",
                lambda: coord.lattice.workers[1].state is not WorkerState.ACTIVE,
                10,
            )
            results = await load
            assert [r.first_token for r in results] == expected
            assert len({r.request_id for r in results}) == len(prompts)
            assert coord.open_requests == 0
            await wait_until(
                "the worker rejoins",
                lambda: coord.lattice.workers[1].state is WorkerState.ACTIVE,
                120,
                0.1,
            )
            assert p.ranks.pid(3) not in (None, old) and p.ranks.incarnation(3) == 1
            merge = await coord.begin_reshape(coord.reshape_for("merge", None))
            assert merge.new_workers
            assert [w["ranks"] for w in coord.workers_view()] == [[0, 1, 2, 3]]
            result = await coord.prefill(prompts[0])
            assert result.cp_degree == 4 and result.first_token == expected[0]

    asyncio.run(main())


@pytest.mark.timeout(360)
def test_node_removed_mid_load_then_replaced(
    cluster: Any, tmp_path: Path, checkpoint: Checkpoint
) -> None:
    """The second node is removed under load: its worker leaves at once, the first
    node's worker answers every request (once, right), the host waits vacant (its
    restarts fail), and a new node takes its place: the worker rejoins there with an
    empty cache and serves."""
    prompts = [make_tokens(900 + 50 * i, seed=60 + i, vocab=VOCAB) for i in range(12)]
    expected = first_tokens(checkpoint, prompts)

    async def main() -> None:
        async with pool(cluster, tmp_path, checkpoint, (2, 2)) as p:
            coord = p.coord
            load = asyncio.gather(*(coord.prefill(x) for x in prompts))
            await wait_until("worker 1 runs", lambda: coord.scheduler.running(1), 60)
            node = p.node_of_host(1)
            old_name = p.ranks.host_of(2)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: cluster.remove_node(node, False))
            await wait_until(
                "the lost node's worker leaves",
                lambda: coord.lattice.workers[1].state is not WorkerState.ACTIVE,
                30,
            )
            results = await load
            assert [r.first_token for r in results] == expected
            assert len({r.request_id for r in results}) == len(prompts)
            assert coord.open_requests == 0
            await wait_until("the host is vacant", lambda: p.ranks.hosts.vacant([2]), 30)
            cluster.add_node(num_cpus=2)  # (on the main thread: it sets a signal handler)
            cluster.raylets_seen |= raylets()
            await wait_until(
                "the worker rejoins on the new node",
                lambda: coord.lattice.workers[1].state is WorkerState.ACTIVE,
                120,
                0.1,
            )
            assert p.ranks.host_of(2) != old_name
            coord.lattice.workers[0].state = WorkerState.UNAVAILABLE
            try:
                after = await coord.prefill(prompts[0])
            finally:
                coord.lattice.workers[0].state = WorkerState.ACTIVE
            assert after.worker == 1 and after.cached_tokens == 0  # an empty cache
            assert after.first_token == expected[0]

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_process_without_a_token_is_refused_before_joining(
    cluster: Any, checkpoint: Checkpoint
) -> None:
    cfg = ClusterConfig(address=cluster.address, hosts=2)
    ranks = RayRanks(cfg, checkpoint.config, str(checkpoint.model_dir), engine_config())
    with (
        token_env({"RAY_AUTH_MODE": "disabled"}),
        pytest.raises(ConfigError, match="must use token authentication"),
    ):
        ranks.gather()
    ranks.close()
    assert_nothing_left(cluster)
