"""Life of a rank pool: start-up, process groups, errors, shutdown.

A pool of 4 ranks with degrees {1, 2, 4} creates every worker group at start-up, so
prefills run on any aligned worker without re-creating groups; a failing rank makes
``start`` raise and leaves no process; an error in a prefill surfaces as
``RanksError`` and leaves the pool serving; ``close`` leaves no process, even
with a rank stuck in a collective, and may be called again.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from support.factories import BLOCK_SIZE, engine_config, make_tokens
from support.processes import live_child_pids
from support.reference import (
    NUM_LAYERS,
    VOCAB,
    Checkpoint,
    assert_exact,
    drop_tensor,
    make_checkpoint,
)
from vertumnus.blocks import block_ids
from vertumnus.engine.messages import PrefillCommand, PrefillDone, RankFailed
from vertumnus.policy.geometry import LatticeConfig, LatticeError
from vertumnus.policy.lattice import Lattice
from vertumnus.runtime import prefill as prefill_module
from vertumnus.runtime.prefill import PrefillClient
from vertumnus.runtime.ranks import ChildRanks, RanksError, worker_groups

# Every test but test_worker_groups starts rank processes: marked one by one.
pytestmark = pytest.mark.usefixtures("no_leftover_ranks")
KV_BLOCKS = 32  # per rank


@pytest.fixture(scope="module")
def ranks4(checkpoint: Checkpoint) -> Iterator[ChildRanks]:
    ranks = ChildRanks(
        checkpoint.config,
        str(checkpoint.model_dir),
        engine_config(kv_blocks_per_rank=KV_BLOCKS),
        world_size=4,
        degrees=[1, 2, 4],
    )
    with ranks:
        yield ranks


def test_worker_groups() -> None:
    assert worker_groups(4, [1, 2, 4]) == ((0, 1), (2, 3), (0, 1, 2, 3))
    assert worker_groups(8, [4, 8]) == ((0, 1, 2, 3), (4, 5, 6, 7), tuple(range(8)))
    assert worker_groups(4, [2, 1, 2]) == ((0, 1), (2, 3))
    assert worker_groups(4, [4]) == ((0, 1, 2, 3),)
    assert worker_groups(4, [1]) == ()
    assert worker_groups(1, [1]) == ()
    assert worker_groups(3, [3]) == ((0, 1, 2),)


def test_worker_groups_are_the_lattices_workers() -> None:
    """The pool asks the lattice: 12 devices at {4, 8} are a top-level block of 8 and
    one of 4, which ``Lattice`` builds and the pool used to refuse."""
    assert worker_groups(12, [4, 8]) == (
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
        tuple(range(8)),
    )
    for layout in ([8, 4], [4, 4, 4]):
        lattice = Lattice(LatticeConfig(12, (4, 8)), layout)
        groups = set(worker_groups(12, [4, 8]))
        assert all(tuple(w.devices) in groups for w in lattice.workers.values())
    # What the lattice refuses, the pool refuses with the lattice's reason.
    for bad, reason in (
        ([3], "cannot be cut into aligned workers"),
        ([0], "degrees must be positive"),
        ([8], "cannot be cut into aligned workers"),
        ([1, 2, 8], "consecutive powers of two"),
    ):
        with pytest.raises(LatticeError, match=reason):
            worker_groups(4, bad)


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_every_rank_ready(ranks4: ChildRanks, checkpoint: Checkpoint) -> None:
    cfg = checkpoint.config
    kv_bytes = 2 * KV_BLOCKS * NUM_LAYERS * BLOCK_SIZE * cfg.num_key_value_heads * cfg.head_dim * 4
    assert sorted(ranks4.ready) == [0, 1, 2, 3]
    for rank, ready in ranks4.ready.items():
        assert (ready.rank, ready.device, ready.kv_bytes) == (rank, "cpu", kv_bytes)
    assert ranks4.groups == ((0, 1), (2, 3), (0, 1, 2, 3))
    ranks = [p for p in multiprocessing.active_children() if p.name.startswith("vertumnus-rank")]
    assert sorted(p.name for p in ranks) == [f"vertumnus-rank{r}" for r in range(4)]
    assert all(p.daemon for p in ranks)


@pytest.mark.multiproc
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "ranks",
    [(0, 1), (2, 3), (0, 1, 2, 3), (3,), (0, 1)],
    ids=["0-1", "2-3", "0-1-2-3", "3", "0-1-again"],
)
def test_prefill_on_any_worker(
    ranks4: ChildRanks, checkpoint: Checkpoint, ranks: tuple[int, ...]
) -> None:
    """Workers overlap on ranks here, one after another; each starts with an empty
    cache index, so none reads KV slots that another one wrote."""
    tokens = make_tokens(77, seed=sum(ranks) + len(ranks), vocab=VOCAB)
    worker = PrefillClient(ranks4, ranks)
    out = worker.prefill(tokens[:40], logits="all")
    assert_exact(out, checkpoint, tokens[:40], cached_tokens=0)
    out = worker.prefill(tokens, logits="all")
    assert_exact(out, checkpoint, tokens, cached_tokens=32)
    assert out.report.inserted == tuple(block_ids(tokens, BLOCK_SIZE)[2:])
    assert len(out.rank_compute_s) == len(ranks)


def _recv_answers(ranks: ChildRanks, members: tuple[int, ...]) -> dict[int, object]:
    answers: dict[int, object] = {}
    while len(answers) < len(members):
        msg = ranks.recv(30.0)
        assert isinstance(msg, (PrefillDone, RankFailed)), msg
        answers[msg.rank] = msg
    return answers


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_bad_command_rejected_by_every_rank(ranks4: ChildRanks, checkpoint: Checkpoint) -> None:
    """A command with a slot out of range on one rank only is rejected by all of the
    worker's ranks before any collective, so none waits on a peer that gave up."""
    ranks = (0, 1, 2, 3)
    cmd = PrefillCommand(
        request_id=10_000,
        worker_ranks=ranks,
        token_ids=torch.tensor(make_tokens(70, seed=3, vocab=VOCAB)),
        prefix_len=0,
        prefix_slots=((), (), (), ()),
        write=(((0, 0),), ((1, 0),), ((2, 0),), ((3, KV_BLOCKS),)),
        block_size=BLOCK_SIZE,
        logits="all",
    )
    for r in ranks:
        ranks4.send(r, cmd)
    answers = _recv_answers(ranks4, ranks)
    for rank, msg in answers.items():
        assert isinstance(msg, RankFailed), msg
        assert (msg.rank, msg.request_id) == (rank, 10_000)
        assert msg.error == (
            f"IndexError: CP rank 3: KV slots [{KV_BLOCKS}] out of range [0, {KV_BLOCKS})"
        )
    # The worker's group is in step: the next prefill on it is exact.
    tokens = make_tokens(70, seed=4, vocab=VOCAB)
    assert_exact(
        PrefillClient(ranks4, ranks).prefill(tokens, logits="all"),
        checkpoint,
        tokens,
        cached_tokens=0,
    )


def _corrupt_write(cmd: PrefillCommand) -> PrefillCommand:
    """The last CP rank stores its first new block in slot ``KV_BLOCKS`` (out of range)."""
    write = list(cmd.write)
    (depth, _), *rest = write[-1]
    write[-1] = ((depth, KV_BLOCKS), *rest)
    return dataclasses.replace(cmd, write=tuple(write))


def _corrupt_prefix(cmd: PrefillCommand) -> PrefillCommand:
    """The last CP rank reads its first prefix block from slot ``KV_BLOCKS``."""
    slots = list(cmd.prefix_slots)
    slots[-1] = (KV_BLOCKS, *slots[-1][1:])
    return dataclasses.replace(cmd, prefix_slots=tuple(slots))


@pytest.mark.multiproc
@pytest.mark.timeout(90)
@pytest.mark.parametrize("corrupt", [_corrupt_write, _corrupt_prefix], ids=["write", "prefix"])
@pytest.mark.parametrize("ranks", [(0, 1), (0, 1, 2, 3)], ids=["0-1", "0-1-2-3"])
def test_prefill_error_surfaces_and_pool_serves_on(
    ranks4: ChildRanks,
    checkpoint: Checkpoint,
    monkeypatch: pytest.MonkeyPatch,
    ranks: tuple[int, ...],
    corrupt: Callable[[PrefillCommand], PrefillCommand],
) -> None:
    # Blocks 0-3 cached first, then 4-7 new: some on every rank.
    tokens = make_tokens(130, seed=5, vocab=VOCAB)
    worker = PrefillClient(ranks4, ranks)
    assert_exact(
        worker.prefill(tokens[:64], logits="all"), checkpoint, tokens[:64], cached_tokens=0
    )
    plan = prefill_module.plan_prefill

    def corrupted_plan(*args: object, **kwargs: object) -> tuple[object, PrefillCommand]:
        allocation, cmd = plan(*args, **kwargs)  # type: ignore[arg-type]
        return allocation, corrupt(cmd)

    monkeypatch.setattr(prefill_module, "plan_prefill", corrupted_plan)
    with pytest.raises(
        RanksError,
        match=(
            rf"prefill 1 failed on rank {ranks[0]}: IndexError: CP rank {len(ranks) - 1}: "
            rf"KV slots \[{KV_BLOCKS}\] out of range \[0, {KV_BLOCKS}\)"
        ),
    ):
        worker.prefill(tokens)
    monkeypatch.undo()
    # The failed prefill's new blocks are freed; the prefix stays cached and correct.
    worker.index.check_invariants()
    assert len(worker.index) == 4
    out = worker.prefill(tokens, logits="all")
    assert_exact(out, checkpoint, tokens, cached_tokens=64)
    assert out.request_id == 2


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_token_outside_vocabulary_fails_cleanly(ranks4: ChildRanks, checkpoint: Checkpoint) -> None:
    """Only one rank's chunk holds the bad id; every rank rejects the prefill."""
    tokens = make_tokens(90, seed=6, vocab=VOCAB)
    bad = [*tokens[:50], VOCAB, *tokens[51:]]
    worker = PrefillClient(ranks4, (0, 1, 2, 3))
    with pytest.raises(RanksError, match=rf"token ids outside the vocabulary \[0, {VOCAB}\)"):
        worker.prefill(bad)
    assert len(worker.index) == 0
    assert_exact(worker.prefill(tokens, logits="all"), checkpoint, tokens, cached_tokens=0)


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_rank_start_failure_raises_and_leaves_no_process(tmp_path: Path) -> None:
    broken = make_checkpoint(tmp_path, tie_word_embeddings=False)
    drop_tensor(tmp_path, "model.layers.1.mlp.up_proj.weight")
    before = live_child_pids()
    ranks = ChildRanks(broken.config, str(tmp_path), engine_config(), world_size=2, degrees=[2])
    with pytest.raises(
        RanksError,
        match=(
            r"rank [01] failed to start: ConfigError: .*checkpoint lacks tensors: "
            r"model\.layers\.1\.mlp\.up_proj\.weight"
        ),
    ):
        ranks.start()
    assert live_child_pids() - before == set()
    ranks.close()  # still fine after a failed start
    assert live_child_pids() - before == set()


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_close_is_idempotent_and_stops_a_stuck_rank(checkpoint: Checkpoint) -> None:
    ChildRanks(checkpoint.config, None, engine_config(), 2, [2]).close()  # never started
    before = live_child_pids()
    ranks = ChildRanks(
        checkpoint.config, str(checkpoint.model_dir), engine_config(), world_size=2, degrees=[2]
    )
    with ranks:
        started = live_child_pids() - before
        assert len(started) == 2
        tokens = make_tokens(30, seed=7, vocab=VOCAB)
        assert_exact(
            PrefillClient(ranks, (0, 1)).prefill(tokens, logits="all"),
            checkpoint,
            tokens,
            cached_tokens=0,
        )
        # Rank 0 alone enters the worker's all-gather and waits for rank 1 there.
        ranks.send(
            0,
            PrefillCommand(
                request_id=99,
                worker_ranks=(0, 1),
                token_ids=torch.tensor(tokens),
                prefix_len=0,
                prefix_slots=((), ()),
                write=((), ()),
                block_size=BLOCK_SIZE,
            ),
        )
        ranks.close(timeout_s=2.0)  # Shutdown waits behind the stuck command: terminate
        assert live_child_pids() & started == set()
        ranks.close()
    ranks.close()
    assert live_child_pids() - before == set()
