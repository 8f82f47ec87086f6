"""A pool on two hosts, on one machine: two node agents on loopback
(``python -m vertumnus agent``, two CPU ranks each) under an in-process coordinator.

A degree-4 worker spans both hosts and gives transformers' logits; a split leaves
one degree-2 worker inside each host and a merge spans them again, under load,
every request answered once with the reference's first token; a prefix copied
between the hosts' workers (rank to rank over torch.distributed) is reused with the
reference's logits; an agent SIGKILLed mid-load loses no accepted request, its
worker leaves the candidate set at once and rejoins when the agent is back. Every
test ends with no agent or rank process left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.factories import BLOCK_SIZE, engine_config, make_profile, make_tokens
from support.processes import ranks_in_session, sessions_left, start_agent
from support.reference import ATOL, VOCAB, Checkpoint, hf_logits, max_abs_diff
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.cluster.ranks import ClusterRanks
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.request_path import PrefillResult
from vertumnus.runtime.serve_config import ClusterConfig, ServeConfig

pytestmark = pytest.mark.multiproc
SECRET = "multihost-test-secret-0123"


def profile(path: Path) -> Path:
    """Coefficients of the tiny model's shape (the policy needs some; these tests
    choose workers themselves or through the admin operations)."""
    coeffs = {
        1: DegreeCoeffs(d=0.004, c=3e-5, alpha=3e-8),
        2: DegreeCoeffs(d=0.009, c=2e-5, alpha=2e-8),
        4: DegreeCoeffs(d=0.02, c=1.2e-5, alpha=1e-8),
    }
    kappa_s = {c: 10.0 * c for c in coeffs}
    make_profile(coeffs, kappa_s, model="qwen3-test", hardware="cpu").save(path)
    return path


@dataclass
class Cluster:
    coord: Coordinator
    ranks: ClusterRanks
    agents: dict[str, subprocess.Popen[bytes]]
    address: str
    logs: Path

    def start_agent(self, name: str) -> None:
        log = self.logs / f"agent-{name}.log"
        self.agents[name] = start_agent(self.address, name, log, SECRET)


@contextlib.asynccontextmanager
async def cluster(
    tmp_path: Path, checkpoint: Checkpoint, layout: tuple[int, ...], **cache: float
) -> AsyncIterator[Cluster]:
    cluster_cfg = ClusterConfig(
        listen="127.0.0.1:0", hosts=2, secret=SECRET, heartbeat_s=0.5, agent_timeout_s=3.0
    )
    engine = engine_config(kv_blocks_per_rank=128)
    hosts = ClusterRanks(cluster_cfg, checkpoint.config, str(checkpoint.model_dir), engine)
    c = Cluster(None, hosts, {}, f"127.0.0.1:{hosts.port}", tmp_path)  # type: ignore[arg-type]
    sessions: set[int] = set()
    try:
        for name in ("host0", "host1"):
            c.start_agent(name)
        loop = asyncio.get_running_loop()
        ranks, per_host = await loop.run_in_executor(None, hosts.gather)
        assert (ranks, per_host) == (4, 2)
        cfg = ServeConfig(
            model=str(checkpoint.model_dir),
            pool=PoolConfig((1, 2, 4), layout, devices_per_host=per_host),
            engine=engine,
            profile=str(profile(tmp_path / "profile.json")),
            policy=PolicyConfig(
                adaptive=False,
                replication=False,
                cache=CacheManagerConfig(**cache),  # type: ignore[arg-type]
            ),
            step_timeout_s=30.0,
        )
        assert cfg.ranks == ranks
        hosts.configure(cfg.degrees)
        c.coord = Coordinator(cfg, hosts)
        await c.coord.start()
        yield c
    finally:
        sessions = {a.pid for a in c.agents.values()}
        if c.coord is not None:
            await c.coord.close()
        else:
            hosts.close()
        for agent in c.agents.values():
            try:  # the coordinator's Stop ends each agent
                assert agent.wait(timeout=30) == 0
            finally:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
        # (ranks whose agent died exit within a second; its fork server soon after)
        left = sessions_left(sessions)
        assert not left, f"processes left: {left}"


def check_logits(result: PrefillResult, checkpoint: Checkpoint, tokens: list[int]) -> None:
    ref = hf_logits(checkpoint.hf, tokens)[-1]
    diff = max_abs_diff(result.logits, ref)
    assert diff < ATOL, f"max |logit difference| {diff:.3g} >= {ATOL}"
    assert result.first_token == int(ref.argmax())


def first_tokens(checkpoint: Checkpoint, prompts: list[list[int]]) -> list[int]:
    return [int(hf_logits(checkpoint.hf, p)[-1].argmax()) for p in prompts]


@pytest.mark.timeout(240)
def test_degree4_worker_spanning_two_hosts_matches_reference(
    tmp_path: Path, checkpoint: Checkpoint
) -> None:
    async def main() -> None:
        async with cluster(tmp_path, checkpoint, (4,)) as c:
            view = c.coord.workers_view()
            assert [(w["ranks"], w["hosts"]) for w in view] == [([0, 1, 2, 3], [0, 1])]
            assert {c.ranks.host_of(r) for r in (0, 1)} == {"host0"}
            assert {c.ranks.host_of(r) for r in (2, 3)} == {"host1"}
            prompt = make_tokens(300, seed=1, vocab=VOCAB)
            fresh = await c.coord.prefill(prompt)
            assert fresh.cp_degree == 4 and fresh.cached_tokens == 0
            check_logits(fresh, checkpoint, prompt)
            longer = prompt + make_tokens(77, seed=2, vocab=VOCAB)
            reuse = await c.coord.prefill(longer)
            assert reuse.cached_tokens == 288  # 18 whole blocks of the first prompt
            check_logits(reuse, checkpoint, longer)

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_split_and_merge_across_hosts_under_load(tmp_path: Path, checkpoint: Checkpoint) -> None:
    prompts = [make_tokens(200 + 40 * i, seed=10 + i, vocab=VOCAB) for i in range(16)]
    expected = first_tokens(checkpoint, prompts)

    async def main() -> None:
        async with cluster(tmp_path, checkpoint, (4,)) as c:
            coord = c.coord

            async def load(batch: range) -> list[PrefillResult]:
                return list(await asyncio.gather(*(coord.prefill(prompts[i]) for i in batch)))

            first = asyncio.ensure_future(load(range(8)))
            await asyncio.sleep(0.05)
            split = await coord.begin_reshape(coord.reshape_for("split", None))
            assert split.op.kind == "split"
            halves = sorted((w["ranks"], w["hosts"]) for w in coord.workers_view())
            assert halves == [([0, 1], [0]), ([2, 3], [1])]  # each inside its host
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
def test_prefix_copied_between_hosts_is_reused(tmp_path: Path, checkpoint: Checkpoint) -> None:
    async def main() -> None:
        cache = dict(theta_intra=0.5, theta_reclaim=0.1, theta_inter_s=1e9)
        async with cluster(tmp_path, checkpoint, (2, 2), **cache) as c:
            coord = c.coord
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
            assert copied.worker == 1  # on host1, with KV that came from host0
            assert copied.cached_tokens == summary["blocks_copied"] * BLOCK_SIZE
            check_logits(copied, checkpoint, prompt)

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_agent_killed_mid_load_loses_no_request(tmp_path: Path, checkpoint: Checkpoint) -> None:
    prompts = [make_tokens(900 + 50 * i, seed=30 + i, vocab=VOCAB) for i in range(12)]
    expected = first_tokens(checkpoint, prompts)

    async def main() -> None:
        async with cluster(tmp_path, checkpoint, (2, 2)) as c:
            coord = c.coord
            load = asyncio.gather(*(coord.prefill(p) for p in prompts))
            deadline = time.monotonic() + 30
            while coord.scheduler.running(1) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert coord.scheduler.running(1) is not None, "host1's worker never ran"
            killed_s = time.monotonic()
            c.agents["host1"].kill()  # the agent alone: its ranks see it gone and exit
            c.agents["host1"].wait()
            while coord.lattice.workers[1].state is WorkerState.ACTIVE:
                assert time.monotonic() - killed_s < 1.0, "host1's worker still a candidate"
                await asyncio.sleep(0.01)
            results = await load
            assert [r.first_token for r in results] == expected
            assert len({r.request_id for r in results}) == len(prompts)
            assert coord.open_requests == 0
            c.start_agent("host1")
            while coord.lattice.workers[1].state is not WorkerState.ACTIVE:
                assert time.monotonic() - killed_s < 120, "host1's worker did not rejoin"
                await asyncio.sleep(0.1)
            assert coord.metrics.restarts._value.get() >= 1
            coord.lattice.workers[0].state = WorkerState.UNAVAILABLE
            try:
                after = await coord.prefill(prompts[0])
            finally:
                coord.lattice.workers[0].state = WorkerState.ACTIVE
            assert after.worker == 1 and after.cached_tokens == 0  # an empty cache
            assert after.first_token == expected[0]

    asyncio.run(main())


@pytest.mark.timeout(240)
def test_agent_outlives_a_lost_coordinator(tmp_path: Path, checkpoint: Checkpoint) -> None:
    """A coordinator that vanishes (no ``Stop``): its agent kills its ranks after
    ``agent_timeout_s`` of silence and joins the next coordinator on that address."""
    engine = engine_config(kv_blocks_per_rank=16)
    settings = dict(hosts=1, secret=SECRET, heartbeat_s=0.5, agent_timeout_s=2.0)
    first = ClusterRanks(
        ClusterConfig(listen="127.0.0.1:0", **settings),  # type: ignore[arg-type]
        checkpoint.config,
        str(checkpoint.model_dir),
        engine,
    )
    address = f"127.0.0.1:{first.port}"
    c = Cluster(None, first, {}, address, tmp_path)  # type: ignore[arg-type]
    c.start_agent("host0")
    agent = c.agents["host0"]
    try:
        assert first.gather() == (2, 2)
        first.configure((1, 2))
        first.start()
        old_ranks = ranks_in_session(agent.pid)
        assert len(old_ranks) == 2
        first.hub.crash_for_tests()  # silence, as if the coordinator's host died
        second = ClusterRanks(
            ClusterConfig(listen=address, **settings),  # type: ignore[arg-type]
            checkpoint.config,
            str(checkpoint.model_dir),
            engine,
        )
        try:
            assert second.gather() == (2, 2)  # the same agent, back
            assert not old_ranks & ranks_in_session(agent.pid)  # it killed the old ranks
            second.configure((1, 2))
            second.start()
            assert sorted(second.ready) == [0, 1]
        finally:
            second.close()
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert not sessions_left([agent.pid])


@pytest.mark.timeout(240)
def test_rank_killed_on_an_agent_host_is_restarted_through_its_agent(
    tmp_path: Path, checkpoint: Checkpoint
) -> None:
    """One rank of host 1 dies (its agent lives): the agent reports it, the worker
    leaves the candidate set, its ranks restart through the agent, and the degree-4
    group they share with host 0's ranks is formed anew (a spanning merge works)."""
    prompt = make_tokens(400, seed=50, vocab=VOCAB)
    expected = first_tokens(checkpoint, [prompt])[0]

    async def main() -> None:
        async with cluster(tmp_path, checkpoint, (2, 2)) as c:
            coord = c.coord
            old = c.ranks.pid(3)
            assert old is not None
            os.kill(old, signal.SIGKILL)
            killed = time.monotonic()
            while coord.lattice.workers[1].state is WorkerState.ACTIVE:
                assert time.monotonic() - killed < 5.0, "the dead rank's worker is still in"
                await asyncio.sleep(0.01)
            while coord.lattice.workers[1].state is not WorkerState.ACTIVE:
                assert time.monotonic() - killed < 120, "the worker did not rejoin"
                await asyncio.sleep(0.1)
            assert c.ranks.pid(3) not in (None, old) and c.ranks.incarnation(3) == 1
            assert c.agents["host1"].poll() is None  # the agent lived on
            merge = await coord.begin_reshape(coord.reshape_for("merge", None))
            assert [w["ranks"] for w in coord.workers_view()] == [[0, 1, 2, 3]]
            assert merge.new_workers
            result = await coord.prefill(prompt)
            assert result.cp_degree == 4 and result.first_token == expected

    asyncio.run(main())
