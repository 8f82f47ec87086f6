"""The host tier on real rank processes (gloo, a transformers checkpoint): blocks a
prefill evicts from its worker's ranks are copied into the host's tier, and a later
prompt sharing them has them loaded back, with the logits of a fresh prefill and of
transformers (CP 1, 2 and 3); the tier outlives a merge, a split and a rank's
restart (blocks demoted by one worker load into another, on other CP ranks);
``/metrics`` counts the copies; and a pool whose ranks cannot keep their KV in this
host's shared memory is refused (``runtime/kv/host_memory.py``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from support.coordinator import only
from support.factories import BLOCK_SIZE, engine_config, make_profile, make_tokens
from support.reference import VOCAB, Checkpoint, hf_logits, max_abs_diff
from support.server import write_serve_config
from vertumnus.blocks import block_ids
from vertumnus.config import ConfigError
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.cache.retention import RetentionConfig
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime import serve_config
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.kv import segments
from vertumnus.runtime.request_path import PrefillResult
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.server.app import build_app

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("no_leftover_ranks")]
ATOL = 1e-4
BLOCKS_PER_RANK = 8  # small: a prompt of 8 blocks per rank evicts everything else
TIER_BLOCKS = 64
PROMPT = 100  # tokens: 6 whole blocks reusable (at least one token is computed)


def tier_bytes(checkpoint: Checkpoint, blocks: int = TIER_BLOCKS) -> int:
    return blocks * checkpoint.config.kv_bytes(4) * BLOCK_SIZE  # fp32 ranks


def make_config(
    tmp_path: Path,
    checkpoint: Checkpoint,
    pool: PoolConfig,
    host_tier_bytes: int,
    retention: RetentionConfig | None = None,
    **engine: object,
) -> ServeConfig:
    profile = tmp_path / "profile.json"
    coeffs = {c: DegreeCoeffs(d=0.004, c=3e-5, alpha=3e-8) for c in (1, 2, 3)}
    kappa = dict.fromkeys((1, 2, 3), 10.0)
    make_profile(coeffs, kappa, model="checkpoint", hardware="cpu").save(profile)
    cache = CacheManagerConfig(host_tier_bytes=host_tier_bytes)
    return ServeConfig(
        model=str(checkpoint.model_dir),
        pool=pool,
        engine=engine_config(kv_blocks_per_rank=BLOCKS_PER_RANK, **engine),
        profile=str(profile),
        policy=PolicyConfig(
            adaptive=False,
            replication=False,
            cache=cache,
            retention=retention or RetentionConfig(),
        ),
    )


def loaded(coord: Coordinator) -> int:
    """Blocks copied from the tier into the ranks so far (the copies themselves)."""
    assert coord.tier is not None
    return coord.tier.loaded


def exact(
    result: PrefillResult, fresh: PrefillResult, checkpoint: Checkpoint, prompt: list[int]
) -> float:
    """The max abs diff of ``result``'s logits from a fresh prefill's (asserted under
    ``ATOL``, as is ``fresh``'s from transformers')."""
    reference = hf_logits(checkpoint.hf, prompt)[-1]
    assert max_abs_diff(fresh.logits, reference) < ATOL
    diff = max_abs_diff(result.logits, fresh.logits)
    assert diff < ATOL, diff
    assert max_abs_diff(result.logits, reference) < ATOL
    return diff


def tier_segment(coord: Coordinator) -> str:
    assert coord.tier is not None and coord.tier._shm is not None
    return f"{segments.SHM_DIR}/{coord.tier._shm.name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_evicted_blocks_load_back_exact(tmp_path: Path, checkpoint: Checkpoint, cp: int) -> None:
    cfg = make_config(tmp_path, checkpoint, PoolConfig((cp,), (cp,)), tier_bytes(checkpoint))

    async def main() -> None:
        coord = Coordinator(cfg)
        await coord.start()
        segment = tier_segment(coord)
        try:
            prompt = make_tokens(PROMPT, seed=10 + cp, vocab=VOCAB)
            fresh = await coord.prefill(prompt)
            assert fresh.cached_tokens == 0
            # Every slot of the worker: the prompt's 6 blocks go to the tier.
            filler = make_tokens(cp * BLOCKS_PER_RANK * BLOCK_SIZE + 1, seed=20 + cp, vocab=VOCAB)
            first = await coord.prefill(filler)
            assert first.cached_tokens == 0
            assert coord.tier is not None and coord.tier.demoted == 6 and loaded(coord) == 0
            # Back from the tier into the slots its lease evicts (the filler's, demoted
            # first): the whole prefix, computed by nobody, the logits of a fresh prefill.
            again = await coord.prefill(prompt)
            assert loaded(coord) == 6 and coord.policy.tiers.stats.loaded_blocks == 6
            assert again.cached_tokens == 96 and again.computed_tokens == PROMPT - 96
            diffs = [exact(again, fresh, checkpoint, prompt)]
            # The filler's blocks that the prompt evicted were demoted before the
            # prompt's were loaded into their slots: they load back exact too.
            second = await coord.prefill(filler)
            assert second.cached_tokens == cp * BLOCKS_PER_RANK * BLOCK_SIZE
            assert loaded(coord) == 12
            diffs.append(exact(second, first, checkpoint, filler))
            print(f"CP {cp}: max abs diff {max(diffs):.2e}")
            assert os.path.exists(segment)
        finally:
            await coord.close()
        assert not os.path.exists(segment)  # unlinked at shutdown

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_the_tier_outlives_merge_split_and_a_rank_restart(
    tmp_path: Path, checkpoint: Checkpoint
) -> None:
    """Blocks demoted by a degree-1 worker load into the merged degree-2 worker (the
    odd ones on the other rank), then into a child of its split, then into the same
    worker after its rank was killed and restarted (its own store's contents gone)."""
    # No slots kept for fetches at the reshapes: the new workers' slots are free for
    # the loads (the retained ones would fill the merged worker's rank 0).
    retention = RetentionConfig(reserve_fraction=0.0)
    pool = PoolConfig((1, 2), (1, 1))
    cfg = make_config(tmp_path, checkpoint, pool, tier_bytes(checkpoint), retention)

    async def main() -> None:
        coord = Coordinator(cfg)
        await coord.start()
        try:
            prompt = make_tokens(PROMPT, seed=31, vocab=VOCAB)
            fresh = await only(coord, 0, prompt)
            filler = make_tokens(BLOCKS_PER_RANK * BLOCK_SIZE + 1, seed=32, vocab=VOCAB)
            await only(coord, 0, filler)
            assert coord.tier is not None and coord.tier.demoted == 6
            diffs = []

            transition = await coord.begin_reshape(coord.reshape_for("merge", [0, 1]))
            (merged,) = transition.new_workers
            merged_again = await coord.prefill(prompt)
            assert merged_again.worker == merged and merged_again.cp_degree == 2
            assert merged_again.cached_tokens == 96 and loaded(coord) == 6
            diffs.append(exact(merged_again, fresh, checkpoint, prompt))

            transition = await coord.begin_reshape(coord.reshape_for("split", [merged]))
            left, _ = transition.new_workers
            # What the left child adopted in place of the prompt: its first block
            ids = block_ids(prompt, BLOCK_SIZE)
            held = coord.cache.reusable_tokens(ids, PROMPT).get(left, 0) // BLOCK_SIZE
            assert held == 1
            split_again = await only(coord, left, prompt)
            assert split_again.cached_tokens == 96 and loaded(coord) == 6 + 6 - held
            diffs.append(exact(split_again, fresh, checkpoint, prompt))

            assert coord.ranks is not None
            old_pid = coord.ranks.pid(0)
            coord.ranks.kill(0)  # the left child's rank: its store means nothing now
            for _ in range(240):
                await asyncio.sleep(0.5)
                w = coord.lattice.workers[left]
                back = w.state is WorkerState.ACTIVE and not coord.recovery.recovering(left)
                if back and coord.ranks.pid(0) not in (None, old_pid):
                    break
            assert coord.ranks.pid(0) != old_pid and len(coord.indexes[left]) == 0
            before = loaded(coord)
            restarted = await only(coord, left, prompt)
            assert restarted.cached_tokens == 96 and loaded(coord) == before + 6
            diffs.append(exact(restarted, fresh, checkpoint, prompt))
            print(f"after merge, split, restart: max abs diffs {[f'{d:.2e}' for d in diffs]}")
        finally:
            await coord.close()

    asyncio.run(main())


def metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.timeout(240)
def test_metrics_and_views_show_the_tier(tmp_path: Path, checkpoint: Checkpoint) -> None:
    cfg = make_config(tmp_path, checkpoint, PoolConfig((1,), (1,)), tier_bytes(checkpoint))
    block = checkpoint.config.kv_bytes(4) * BLOCK_SIZE

    async def main() -> None:
        coord = Coordinator(cfg)
        await coord.start()
        tokenizer = Tokenizer.for_model(str(checkpoint.model_dir), checkpoint.config.vocab_size)
        client = TestClient(TestServer(build_app(coord, tokenizer)))
        await client.start_server()
        try:
            text = await (await client.get("/metrics")).text()
            assert metric(text, "vertumnus_host_tier_demoted_blocks_total") == 0
            assert metric(text, "vertumnus_host_tier_capacity_bytes") == TIER_BLOCKS * block
            prompt = make_tokens(PROMPT, seed=41, vocab=VOCAB)
            await coord.prefill(prompt)
            await coord.prefill(make_tokens(BLOCKS_PER_RANK * BLOCK_SIZE + 1, seed=42, vocab=VOCAB))
            await coord.prefill(prompt)
            text = await (await client.get("/metrics")).text()
            assert metric(text, "vertumnus_host_tier_demoted_blocks_total") == 6 + 6
            assert metric(text, "vertumnus_host_tier_loaded_blocks_total") == 6
            assert metric(text, "vertumnus_host_tier_copy_seconds_total") > 0
            assert metric(text, "vertumnus_host_tier_used_bytes") == 12 * block
            cache = await (await client.get("/v1/cache")).json()
            tier = cache["host_tier"]
            assert tier["used_bytes"] == 12 * block and tier["capacity_bytes"] == 64 * block
            assert tier["demoted_blocks"] == 12 and tier["loaded_blocks"] == 6
            line = await (await client.get("/v1/timeline")).json()
            assert line["host_tier"]["loaded_blocks"] == 6
        finally:
            await client.close()
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_gpu_ranks_are_refused(tmp_path: Path, checkpoint: Checkpoint) -> None:
    """Nothing starts: the ranks would keep their KV on the GPU."""
    cfg = make_config(
        tmp_path, checkpoint, PoolConfig((1,), (1,)), tier_bytes(checkpoint), device="cuda"
    )
    with pytest.raises(ConfigError, match=r"\[cache\] host_tier_bytes .*GPU"):
        Coordinator(cfg)


@pytest.mark.timeout(120)
def test_ranks_without_shared_memory_are_refused(
    tmp_path: Path, checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room for the ranks' stores in /dev/shm (they would keep them in their own
    memory), or none for the tier: a clear error, no rank started, nothing left."""
    pool = PoolConfig((1,), (1,))
    huge = make_config(tmp_path, checkpoint, pool, host_tier_bytes=1 << 50)

    async def start(cfg: ServeConfig) -> None:
        coord = Coordinator(cfg)
        try:
            await coord.start()
        finally:
            await coord.close()

    made: list[str] = []

    class Recorded(shared_memory.SharedMemory):
        def __init__(self, name: str | None = None, create: bool = False, size: int = 0) -> None:
            super().__init__(name, create, size)
            if create:
                made.append(self.name)

    monkeypatch.setattr(shared_memory, "SharedMemory", Recorded)
    with pytest.raises(
        ConfigError, match=r"\[cache\] host_tier_bytes: the host tier .* does not fit"
    ):
        asyncio.run(start(huge))
    monkeypatch.setattr(segments, "free_shared_bytes", lambda: 0)
    cfg = make_config(tmp_path, checkpoint, pool, tier_bytes(checkpoint))
    with pytest.raises(ConfigError, match=r"\[cache\] host_tier_bytes needs the ranks' KV stores"):
        asyncio.run(start(cfg))
    assert len(made) == 1  # the rank's store (the tier was refused before it was made)
    assert not [name for name in made if os.path.exists(f"{segments.SHM_DIR}/{name}")]


@pytest.mark.timeout(120)
def test_serve_exits_with_the_reason(tmp_path: Path) -> None:
    """``serve`` itself: one error line naming the key, exit 2, nothing started."""
    config = write_serve_config(
        tmp_path / "serve.toml", engine={"device": "cuda"}, cache={"host_tier_bytes": 1 << 30}
    )
    cmd = [sys.executable, "-m", "vertumnus", "serve", "--config", str(config), "--port", "0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert result.returncode == 2, result.stderr
    assert "error: [cache] host_tier_bytes needs CPU ranks" in result.stderr
    assert "GPU" in result.stderr and "listening" not in result.stdout


@pytest.mark.timeout(60)
def test_serve_refuses_a_tier_it_cannot_keep(tmp_path: Path) -> None:
    """A multi-host pool's ranks, and the simulator's bound, are refused on loading."""
    config = tmp_path / "serve.toml"
    cluster = '[cluster]\nengine = "ray"\nhosts = 2\n'
    config.write_text(cluster + "[cache]\nhost_tier_bytes = 1e9\n")
    with pytest.raises(ConfigError, match=r"host_tier_bytes needs CPU ranks .* Ray nodes"):
        serve_config.load(config, topology=(2, 1))
    config.write_text("[cache]\nhost_tier_bound = true\n")
    with pytest.raises(ConfigError, match="host_tier_bound is a bound"):
        serve_config.load(config)
