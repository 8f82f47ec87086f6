"""Properties of the zigzag partition of an uncached suffix over C ranks
(docs/architecture.md, "Zigzag CP prefill")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vertumnus.engine.zigzag import ZigzagPartition

lengths = st.integers(min_value=1, max_value=5000)
degrees = st.integers(min_value=1, max_value=8)
props = settings(max_examples=200, deadline=None)


def causal_work(part: ZigzagPartition, rank: int) -> int:
    """Attention work of ``rank`` without a prefix: query at suffix index i sees i + 1 keys."""
    return sum(i + 1 for i in part.indices(rank) if i < part.num_tokens)


def work_spread_bound(part: ZigzagPartition) -> int:
    """Bound on max - min of ``causal_work`` over ranks.

    With s = chunk_len and Rp = 2Cs, chunk j holds indices [js, (j+1)s), whose work
    counting padding too is s*j*s + s(s+1)/2. Rank k holds chunks k and 2C-1-k, so its
    padded work is s^2*(2C-1) + s(s+1): the same on every rank. Real work is padded
    work minus the work of the padded indices [R, Rp) the rank owns; each weighs at
    most Rp, and a rank owns at most min(Rp - R, 2s) of them. Hence
        max_k W_k - min_k W_k <= max_k removed_k <= min(Rp - R, 2s) * Rp,
    and the spread is exactly 0 when R is a multiple of 2C (no padding).
    """
    return min(part.padded_len - part.num_tokens, 2 * part.chunk_len) * part.padded_len


def check_partition(r: int, c: int) -> None:
    part = ZigzagPartition(r, c)
    s, rp = part.chunk_len, part.padded_len

    # padded_len: the smallest multiple of 2C that is >= R.
    assert rp % (2 * c) == 0
    assert rp >= r
    assert rp - 2 * c < r
    assert s * 2 * c == rp

    # Every suffix index in [0, Rp) is owned by exactly one rank.
    owner: dict[int, int] = {}
    for rank in range(c):
        for i in part.indices(rank):
            assert 0 <= i < rp
            assert i not in owner, f"index {i} owned by ranks {owner[i]} and {rank}"
            owner[i] = rank
    assert sorted(owner) == list(range(rp))

    # Balance: 2s tokens per rank; rank k owns exactly chunks k and 2C-1-k.
    for rank in range(c):
        idx = part.indices(rank)
        assert len(idx) == 2 * s
        first, second = rank, 2 * c - 1 - rank
        assert idx == list(range(first * s, (first + 1) * s)) + list(
            range(second * s, (second + 1) * s)
        )
        # Adjacent chunks (rank C-1 owns chunks C-1 and C) come as one range.
        if second == first + 1:
            expected_ranges = [(first * s, (second + 1) * s)]
        else:
            expected_ranges = [(first * s, (first + 1) * s), (second * s, (second + 1) * s)]
        assert part.ranges(rank) == expected_ranges

    # restore_index: flat (rank-major, each rank in its local order) -> sequence order.
    flat = [i for rank in range(c) for i in part.indices(rank)]
    restore = part.restore_index()
    assert len(restore) == rp
    assert sorted(restore) == list(range(rp))
    for i in range(rp):
        assert flat[restore[i]] == i

    # Causal attention work per rank differs by at most the derived bound.
    work = [causal_work(part, rank) for rank in range(c)]
    assert sum(work) == r * (r + 1) // 2
    spread = max(work) - min(work)
    assert spread <= work_spread_bound(part)
    if r % (2 * c) == 0:
        assert spread == 0


@props
@given(r=lengths, c=degrees)
def test_partition_properties(r: int, c: int) -> None:
    check_partition(r, c)


@pytest.mark.parametrize(
    ("r", "c"),
    [
        (1, 1),  # R = 1
        (1, 8),  # R = 1, seven ranks own only padding
        (3, 2),  # R < 2C
        (7, 4),  # R = 2C - 1
        (5, 1),  # odd R, one rank
        (10, 3),  # R not a multiple of 2C
        (17, 4),  # one real token in the last chunk row
        (48, 4),  # R a multiple of 2C: perfectly balanced
        (5000, 8),
        (4999, 7),
    ],
)
def test_partition_examples(r: int, c: int) -> None:
    check_partition(r, c)


def test_explicit_layout_c2() -> None:
    # R = 7, C = 2: s = 2, Rp = 8; chunks [0,2) [2,4) [4,6) [6,8); index 7 is padding.
    part = ZigzagPartition(7, 2)
    assert (part.chunk_len, part.padded_len) == (2, 8)
    assert part.ranges(0) == [(0, 2), (6, 8)]
    assert part.ranges(1) == [(2, 6)]  # chunks 1 and 2 are adjacent
    assert part.indices(0) == [0, 1, 6, 7]
    assert part.indices(1) == [2, 3, 4, 5]
    assert part.restore_index() == [0, 1, 4, 5, 6, 7, 2, 3]
    # Work: rank 0 = 1 + 2 + 7 (index 7 is padding) = 10; rank 1 = 3 + 4 + 5 + 6 = 18.
    assert [causal_work(part, k) for k in range(2)] == [10, 18]


def test_explicit_layout_r1() -> None:
    part = ZigzagPartition(1, 3)
    assert (part.chunk_len, part.padded_len) == (1, 6)
    assert [part.indices(k) for k in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [causal_work(part, k) for k in range(3)] == [1, 0, 0]


def test_single_rank_is_one_contiguous_range() -> None:
    part = ZigzagPartition(9, 1)
    assert (part.chunk_len, part.padded_len) == (5, 10)
    assert part.ranges(0) == [(0, 10)]
    assert part.restore_index() == list(range(10))


@pytest.mark.parametrize(("r", "c"), [(0, 1), (-3, 2), (1, 0), (10, -1), (0, 0)])
def test_invalid_sizes_raise(r: int, c: int) -> None:
    with pytest.raises(ValueError):
        ZigzagPartition(r, c)


@pytest.mark.parametrize("rank", [-1, 2, 5])
def test_rank_outside_worker_raises(rank: int) -> None:
    with pytest.raises(ValueError, match="outside a degree-2 worker"):
        ZigzagPartition(8, 2).ranges(rank)
