"""KV copies rank to rank (``KVTransfer``) on a pool of two real rank processes (gloo).

Blocks are written by real prefills on one rank; a copy is checked by a *probe*: a
prefill of the same suffix that reads its whole prefix from given slots. With one
intra-op thread per rank and the same seeded weights everywhere, a probe on copied
slots gives logits bit-identical to the probe on the original slots only if every
K and V value of every layer arrived unchanged (and a probe on empty slots differs).
Covered: one direction, both directions in one copy, a copy within a rank, a copy
with a restarted peer (a new incarnation, so a new pair group), and a malformed
copy that every involved rank rejects, after which the pool copies on; a peer
killed mid-copy fails the copy at once on the other side.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from support.factories import BLOCK_SIZE, TINY, engine_config, make_tokens
from vertumnus.engine.messages import (
    KVTransfer,
    KVWritten,
    PrefillCommand,
    PrefillDone,
    RankFailed,
)
from vertumnus.runtime.ranks import ChildRanks, RanksError, wait_ready

pytestmark = pytest.mark.multiproc
KV_BLOCKS = 16  # per rank
PREFIX_BLOCKS = 3
SUFFIX = 5  # tokens a probe computes after the prefix
Move = tuple[int, int, int, int]  # (src rank, src slot, dst rank, dst slot)

_ids = itertools.count(1)


@pytest.fixture(scope="module")
def pool(no_leftover_ranks: None) -> Iterator[ChildRanks]:
    engine = engine_config(block_size=BLOCK_SIZE, kv_blocks_per_rank=KV_BLOCKS)
    with ChildRanks(TINY, None, engine, world_size=2, degrees=[1]) as pool:
        yield pool


def _prefill(
    pool: ChildRanks,
    rank: int,
    tokens: Sequence[int],
    prefix_slots: Sequence[int],
    write: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """Logits ("all") of a prefill of ``tokens`` on the degree-1 worker ``rank``."""
    prefix_len = len(prefix_slots) * BLOCK_SIZE
    cmd = PrefillCommand(
        request_id=next(_ids),
        worker_ranks=(rank,),
        token_ids=torch.tensor(tokens[prefix_len:]),
        prefix_len=prefix_len,
        prefix_slots=(tuple(prefix_slots),),
        write=(tuple(write),),
        block_size=BLOCK_SIZE,
        logits="all",
    )
    pool.send(rank, cmd)
    msg = pool.recv(30.0)
    assert isinstance(msg, PrefillDone) and msg.rank == rank, msg
    assert msg.logits is not None
    return msg.logits


def _fill(pool: ChildRanks, rank: int, tokens: Sequence[int], slots: Sequence[int]) -> None:
    """Store the K and V of the prefix blocks of ``tokens`` at ``slots`` of ``rank``."""
    _prefill(pool, rank, tokens[: len(slots) * BLOCK_SIZE], (), list(enumerate(slots)))


def _probe(
    pool: ChildRanks, rank: int, tokens: Sequence[int], slots: Sequence[int]
) -> torch.Tensor:
    """Logits of the suffix of ``tokens`` with its prefix read from ``slots`` of ``rank``."""
    return _prefill(pool, rank, tokens, slots, ())


def _transfer(pool: ChildRanks, moves: Sequence[Move]) -> dict[int, object]:
    """Send one copy to every rank involved, as the coordinator does; answers by rank."""
    ranks = sorted({r for src, _, dst, _ in moves for r in (src, dst)})
    cmd = KVTransfer(next(_ids), tuple(moves), tuple((r, pool.incarnation(r)) for r in ranks))
    assert cmd.ranks == tuple(ranks)
    for r in ranks:
        pool.send(r, cmd)
    answers: dict[int, object] = {}
    while len(answers) < len(ranks):
        msg = pool.recv(30.0)
        assert isinstance(msg, (KVWritten, RankFailed)), msg
        assert msg.copy_id == cmd.copy_id, msg
        answers[msg.rank] = msg
    return answers


def _copied(pool: ChildRanks, moves: Sequence[Move]) -> None:
    answers = _transfer(pool, moves)
    assert all(isinstance(msg, KVWritten) for msg in answers.values()), answers


def _prompt(seed: int) -> list[int]:
    return make_tokens(PREFIX_BLOCKS * BLOCK_SIZE + SUFFIX, seed=seed)


@pytest.mark.timeout(120)
def test_cross_rank_copy_is_bit_identical(pool: ChildRanks) -> None:
    tokens = _prompt(seed=1)
    src, dst = [3, 7, 1], [12, 0, 5]
    _fill(pool, 0, tokens, src)
    reference = _probe(pool, 0, tokens, src)
    assert not torch.equal(_probe(pool, 1, tokens, dst), reference)  # nothing there yet
    _copied(pool, [(0, s, 1, d) for s, d in zip(src, dst, strict=True)])
    assert torch.equal(_probe(pool, 1, tokens, dst), reference)


@pytest.mark.timeout(120)
def test_copy_in_both_directions_at_once(pool: ChildRanks) -> None:
    """Rank 0 sends to rank 1 and rank 1 to rank 0 in one copy, moves interleaved."""
    a, b = _prompt(seed=2), _prompt(seed=3)
    a_src, a_dst = [2, 9, 4], [8, 14, 6]  # rank 0 -> rank 1
    b_src, b_dst = [1, 10, 13], [11, 5, 15]  # rank 1 -> rank 0
    _fill(pool, 0, a, a_src)
    _fill(pool, 1, b, b_src)
    ref_a, ref_b = _probe(pool, 0, a, a_src), _probe(pool, 1, b, b_src)
    moves = [
        move
        for i in range(PREFIX_BLOCKS)
        for move in ((0, a_src[i], 1, a_dst[i]), (1, b_src[i], 0, b_dst[i]))
    ]
    _copied(pool, moves)
    assert torch.equal(_probe(pool, 1, a, a_dst), ref_a)
    assert torch.equal(_probe(pool, 0, b, b_dst), ref_b)


@pytest.mark.timeout(120)
def test_copy_within_a_rank(pool: ChildRanks) -> None:
    tokens = _prompt(seed=4)
    src, dst = [6, 0, 11], [15, 2, 7]
    _fill(pool, 1, tokens, src)
    reference = _probe(pool, 1, tokens, src)
    _copied(pool, [(1, s, 1, d) for s, d in zip(src, dst, strict=True)])
    assert torch.equal(_probe(pool, 1, tokens, dst), reference)


@pytest.mark.timeout(180)
def test_copy_with_a_restarted_peer(pool: ChildRanks) -> None:
    """Rank 0 holds a pair group with rank 1 from earlier copies; rank 1 restarts (a
    new incarnation), and the next copy forms the pair anew."""
    tokens = _prompt(seed=5)
    src, dst = [5, 8, 3], [1, 4, 9]
    _fill(pool, 0, tokens, src)
    _copied(pool, [(0, src[0], 1, dst[0])])  # the pair at rank 1's current incarnation
    before = pool.incarnation(1)
    assert pool.restart([1]) == []  # degree 1 only: no worker group to rebuild
    wait_ready(pool, [1], 60.0)
    assert pool.incarnation(1) == before + 1
    reference = _probe(pool, 0, tokens, src)
    _copied(pool, [(0, s, 1, d) for s, d in zip(src, dst, strict=True)])
    assert torch.equal(_probe(pool, 1, tokens, dst), reference)


@pytest.mark.timeout(120)
def test_bad_copy_rejected_by_every_rank(pool: ChildRanks) -> None:
    """One destination slot out of range on rank 1: rank 0, which only sends, rejects
    the copy too, so neither waits on a peer that gave up; the pool copies on."""
    tokens = _prompt(seed=6)
    src, dst = [0, 1, 2], [3, 4, KV_BLOCKS]
    _fill(pool, 0, tokens, src)
    answers = _transfer(pool, [(0, s, 1, d) for s, d in zip(src, dst, strict=True)])
    assert sorted(answers) == [0, 1]
    for rank, msg in answers.items():
        assert isinstance(msg, RankFailed), msg
        assert (msg.rank, msg.request_id) == (rank, None)
        assert msg.error == (
            f"KVTransfer: IndexError: KV slots [{KV_BLOCKS}] out of range [0, {KV_BLOCKS})"
        )
    dst = [3, 4, 10]
    _copied(pool, [(0, s, 1, d) for s, d in zip(src, dst, strict=True)])
    assert torch.equal(_probe(pool, 1, tokens, dst), _probe(pool, 0, tokens, src))


@pytest.mark.timeout(180)
def test_peer_killed_mid_copy_fails_the_copy_at_once(pool: ChildRanks) -> None:
    """Rank 1 is stopped before it reads the copy, then SIGKILLed: rank 0, blocked
    sending to it, fails the copy as soon as the connection closes (not after the
    group's time-out), answers RankFailed, and then serves and copies on."""
    tokens = _prompt(seed=7)
    src, dst = [2, 6, 9], [2, 6, 9]
    _fill(pool, 0, tokens, src)
    moves = [(0, s, 1, d) for s, d in zip(src, dst, strict=True)]
    _copied(pool, moves)  # the pair exists: rank 0's send needs no rendezvous
    pid = pool.pid(1)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    cmd = KVTransfer(next(_ids), tuple(moves), ((0, pool.incarnation(0)), (1, pool.incarnation(1))))
    for r in (0, 1):
        pool.send(r, cmd)
    time.sleep(0.5)  # rank 0 is in its send now
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    answer = None
    while answer is None:
        assert time.monotonic() - killed < 20, "rank 0 still blocked on its dead peer"
        try:
            msg = pool.poll(1.0)
        except RanksError:  # rank 1's sentinel: expected
            continue
        if isinstance(msg, RankFailed) and msg.rank == 0:
            answer = msg
    assert answer.copy_id == cmd.copy_id and answer.error.startswith("KVTransfer:")
    assert pool.restart([1]) == []
    wait_ready(pool, [1], 60.0)
    reference = _probe(pool, 0, tokens, src)  # rank 0 serves on
    _copied(pool, moves)
    assert torch.equal(_probe(pool, 1, tokens, dst), reference)
