"""DeepSeek-V4's prefixes in the pool's block cache on real rank processes (gloo, a
random folder transformers saved, 128-token blocks): a prompt's blocks are written by
its prefill, evicted into the host tier by a longer one, loaded back and resumed,
and a prompt sharing part of them resumes that part, each with transformers'
logits; at a block size that cannot hold the state (16) the pool serves it whole."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from support.dsv4 import write_dsv4_folder
from support.factories import engine_config, make_profile, make_tokens
from support.reference import hf_logits, max_abs_diff
from vertumnus.config import ModelConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("no_leftover_ranks")]
ATOL = 1e-4
BLOCK = 128
BLOCKS_PER_RANK = 4
VOCAB = 256


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("dsv4")
    return path, write_dsv4_folder(path)


def make_config(tmp_path: Path, model_dir: Path, cp: int, block: int, tier: bool) -> ServeConfig:
    profile = tmp_path / "profile.json"
    coeffs = {c: DegreeCoeffs(d=0.004, c=3e-5, alpha=3e-8) for c in (1, 2)}
    make_profile(coeffs, dict.fromkeys((1, 2), 10.0), model="dsv4", hardware="cpu").save(profile)
    per_token = ModelConfig.from_dir(model_dir).kv_bytes(4)  # fp32 ranks
    cache = CacheManagerConfig(host_tier_bytes=32 * per_token * block if tier else 0)
    return ServeConfig(
        model=str(model_dir),
        pool=PoolConfig((cp,), (cp,)),
        engine=engine_config(kv_blocks_per_rank=BLOCKS_PER_RANK, block_size=block),
        profile=str(profile),
        policy=PolicyConfig(adaptive=False, replication=False, cache=cache),
    )


@pytest.mark.timeout(400)
def test_blocks_are_written_evicted_to_the_host_tier_and_resumed(
    tmp_path: Path, folder: tuple[Path, Any]
) -> None:
    model_dir, hf = folder
    cfg = make_config(tmp_path, model_dir, 2, BLOCK, tier=True)

    async def main() -> None:
        coord = Coordinator(cfg)
        await coord.start()
        try:
            prompt = make_tokens(700, seed=1, vocab=VOCAB)  # 5 whole blocks reusable
            want = hf_logits(hf, prompt)[-1]
            fresh = await coord.prefill(prompt)
            assert fresh.cached_tokens == 0 and max_abs_diff(fresh.logits, want) < ATOL
            # A prompt sharing 300 tokens resumes its 2 whole blocks from the ranks.
            shared = prompt[:300] + make_tokens(200, seed=2, vocab=VOCAB)
            part = await coord.prefill(shared)
            assert part.cached_tokens == 256
            assert max_abs_diff(part.logits, hf_logits(hf, shared)[-1]) < ATOL
            # Every slot of the worker: the prompt's blocks go to the host tier ...
            filler = make_tokens(2 * BLOCKS_PER_RANK * BLOCK + 1, seed=3, vocab=VOCAB)
            await coord.prefill(filler)
            assert coord.tier is not None and coord.tier.demoted >= 5
            # ... and come back from it, resumed exactly.
            again = await coord.prefill(prompt)
            assert coord.tier.loaded >= 5 and again.cached_tokens == 640
            assert max_abs_diff(again.logits, want) < ATOL
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_a_block_size_that_cannot_hold_the_state_serves_whole_prompts(
    tmp_path: Path, folder: tuple[Path, Any]
) -> None:
    model_dir, hf = folder
    cfg = make_config(tmp_path, model_dir, 1, 16, tier=False)

    async def main() -> None:
        coord = Coordinator(cfg)
        await coord.start()
        try:
            prompt = make_tokens(300, seed=4, vocab=VOCAB)
            for _ in range(2):
                out = await coord.prefill(prompt)
                assert out.cached_tokens == 0
                assert max_abs_diff(out.logits, hf_logits(hf, prompt)[-1]) < ATOL
        finally:
            await coord.close()

    asyncio.run(main())
