"""The whole model over real rank processes (gloo) against Hugging Face transformers.

Each pool runs one CP worker of degree C on a checkpoint that transformers wrote;
every prefill's logits at the computed positions must equal transformers'
``Qwen3ForCausalLM`` on the full sequence (fp32, within ``ATOL``), with and without
a cached prefix, and each rank must issue exactly one K/V all-gather per layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from support.factories import BLOCK_SIZE, engine_config, make_tokens
from support.reference import (
    ATOL,
    VOCAB,
    Checkpoint,
    assert_exact,
    hf_logits,
    make_checkpoint,
    max_abs_diff,
)
from vertumnus.blocks import block_ids
from vertumnus.runtime.prefill import PrefillClient
from vertumnus.runtime.ranks import ChildRanks

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("no_leftover_ranks"),
]


@dataclass(frozen=True)
class PoolCase:
    cp: int
    tied: bool

    @property
    def id(self) -> str:
        return f"cp{self.cp}-{'tied' if self.tied else 'untied'}"


CASES = [PoolCase(1, True), PoolCase(2, True), PoolCase(4, True), PoolCase(2, False)]


@dataclass(frozen=True)
class RunningPool:
    pool: ChildRanks
    checkpoint: Checkpoint
    cp: int

    def worker(self) -> PrefillClient:
        """A worker with an empty cache index over all the pool's ranks."""
        return PrefillClient(self.pool, tuple(range(self.cp)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Checkpoint]:
    return {
        tied: make_checkpoint(tmp_path_factory.mktemp(f"qwen3-tied{int(tied)}"), tied)
        for tied in (True, False)
    }


def _start(checkpoint: Checkpoint, cp: int, **engine: object) -> ChildRanks:
    pool = ChildRanks(
        checkpoint.config,
        str(checkpoint.model_dir),
        engine_config(**engine),
        world_size=cp,
        degrees=[cp],
    )
    pool.start()
    return pool


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.id)
def running(
    request: pytest.FixtureRequest, checkpoints: dict[bool, Checkpoint]
) -> Iterator[RunningPool]:
    case: PoolCase = request.param
    pool = _start(checkpoints[case.tied], case.cp)
    try:
        yield RunningPool(pool, checkpoints[case.tied], case.cp)
    finally:
        pool.close()


@pytest.fixture(scope="module")
def small_cache(checkpoints: dict[bool, Checkpoint]) -> Iterator[RunningPool]:
    """Degree 2 with 3 KV blocks per rank: 6 blocks (96 tokens) in the whole worker."""
    pool = _start(checkpoints[True], 2, kv_blocks_per_rank=3)
    try:
        yield RunningPool(pool, checkpoints[True], 2)
    finally:
        pool.close()


@pytest.mark.parametrize("length_spec", ["1", "2C-1", "37", "16", "64"])
def test_logits_match_transformers(running: RunningPool, length_spec: str) -> None:
    length = 2 * running.cp - 1 if length_spec == "2C-1" else int(length_spec)
    tokens = make_tokens(length, seed=length, vocab=VOCAB)
    worker = running.worker()
    out = worker.prefill(tokens, logits="all")
    assert_exact(out, running.checkpoint, tokens, cached_tokens=0)
    assert out.report.inserted == tuple(block_ids(tokens, BLOCK_SIZE))
    assert out.report.evicted == ()
    assert len(out.rank_compute_s) == running.cp


def test_last_logits_only(running: RunningPool) -> None:
    tokens = make_tokens(53, seed=53, vocab=VOCAB)
    out = running.worker().prefill(tokens)  # logits="last"
    ref = hf_logits(running.checkpoint.hf, tokens)
    assert out.logits.shape == (1, ref.shape[1])
    diff = max_abs_diff(out.logits, ref[-1:])
    assert diff < ATOL, f"max |logit difference| {diff:.3g}"
    assert out.computed_tokens == 53


@pytest.mark.parametrize(
    ("prefix_len", "total_len", "cached_tokens"),
    [
        (40, 100, 32),  # a partial last block of the prefix is not cached
        (64, 101, 64),  # a block-aligned prefix is reused whole
        (64, 64, 48),  # the same sequence again: its last block is computed again
        (17, 17, 16),  # ... down to a single computed token
        (16, 16, 0),  # a one-block sequence is always computed whole
    ],
)
def test_prefix_reuse(
    running: RunningPool, prefix_len: int, total_len: int, cached_tokens: int
) -> None:
    tokens = make_tokens(total_len, seed=1000 + total_len, vocab=VOCAB)
    ids = block_ids(tokens, BLOCK_SIZE)
    worker = running.worker()
    first = worker.prefill(tokens[:prefix_len], logits="all")
    assert_exact(first, running.checkpoint, tokens[:prefix_len], cached_tokens=0)
    assert first.report.inserted == tuple(ids[: prefix_len // BLOCK_SIZE])
    out = worker.prefill(tokens, logits="all")
    assert_exact(out, running.checkpoint, tokens, cached_tokens=cached_tokens)
    assert out.report.inserted == tuple(ids[prefix_len // BLOCK_SIZE :])
    worker.index.check_invariants()


def test_requests_share_prefix_blocks(running: RunningPool) -> None:
    shared = make_tokens(48, seed=7, vocab=VOCAB)
    a = shared + make_tokens(22, seed=8, vocab=VOCAB)  # blocks: shared 0-2, own 3
    b = shared + make_tokens(42, seed=9, vocab=VOCAB)  # reuses a's 0-2; own 3-4
    d = b[:80] + make_tokens(30, seed=10, vocab=VOCAB)  # reuses a's 0-2 and b's 3-4
    worker = running.worker()
    out_a = worker.prefill(a, logits="all")
    assert_exact(out_a, running.checkpoint, a, cached_tokens=0)
    out_b = worker.prefill(b, logits="all")
    assert_exact(out_b, running.checkpoint, b, cached_tokens=48)
    assert out_b.report.inserted == tuple(block_ids(b, BLOCK_SIZE)[3:])
    out_d = worker.prefill(d, logits="all")
    assert_exact(out_d, running.checkpoint, d, cached_tokens=80)
    assert out_d.report.inserted == tuple(block_ids(d, BLOCK_SIZE)[5:])
    again = worker.prefill(a, logits="all")
    assert_exact(again, running.checkpoint, a, cached_tokens=64)
    assert again.report.inserted == ()
    worker.index.check_invariants()


def test_eviction_keeps_results_exact(small_cache: RunningPool) -> None:
    a = make_tokens(96, seed=21, vocab=VOCAB)  # 6 blocks: fills the worker's cache
    b = make_tokens(64, seed=22, vocab=VOCAB)  # 4 blocks, nothing in common with a
    ids_a, ids_b = block_ids(a, BLOCK_SIZE), block_ids(b, BLOCK_SIZE)
    worker = small_cache.worker()
    out = worker.prefill(a, logits="all")
    assert_exact(out, small_cache.checkpoint, a, cached_tokens=0)
    assert out.report.inserted == tuple(ids_a)
    # b evicts a's blocks from the leaf up, LRU first (a2 and a3 to free rank 0's slots).
    out = worker.prefill(b, logits="all")
    assert_exact(out, small_cache.checkpoint, b, cached_tokens=0)
    assert out.report.inserted == tuple(ids_b)
    assert out.report.evicted == (ids_a[5], ids_a[4], ids_a[3], ids_a[2])
    # a's first two blocks survived on the ranks and are read back exactly.
    out = worker.prefill(a, logits="all")
    assert_exact(out, small_cache.checkpoint, a, cached_tokens=32)
    assert out.report.inserted == tuple(ids_a[2:])
    assert out.report.evicted == (ids_b[3], ids_b[2], ids_b[1], ids_b[0])
    worker.index.check_invariants()


def test_request_longer_than_cache(small_cache: RunningPool) -> None:
    tokens = make_tokens(133, seed=23, vocab=VOCAB)  # 8 full blocks, room for 6
    ids = block_ids(tokens, BLOCK_SIZE)
    worker = small_cache.worker()
    out = worker.prefill(tokens, logits="all")
    assert_exact(out, small_cache.checkpoint, tokens, cached_tokens=0)
    assert out.report.inserted == tuple(ids[:6])
    out = worker.prefill(tokens, logits="all")
    assert_exact(out, small_cache.checkpoint, tokens, cached_tokens=96)
    assert out.report.inserted == ()
    worker.index.check_invariants()
