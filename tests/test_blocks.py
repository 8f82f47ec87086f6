"""Chained block ids (docs/architecture.md, "Zigzag CP prefill"): a block id names the
whole prefix up to its block."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from support.factories import make_tokens
from vertumnus.blocks import ROOT_BLOCK_ID, block_id, block_ids

BS = 4


def test_equal_prefixes_give_equal_ids() -> None:
    a = make_tokens(40, seed=1)
    b = a[:24] + make_tokens(16, seed=2)  # shares 6 whole blocks with a
    ids_a, ids_b = block_ids(a, BS), block_ids(b, BS)
    assert len(ids_a) == len(ids_b) == 10
    assert ids_a[:6] == ids_b[:6]
    assert all(x != y for x, y in zip(ids_a[6:], ids_b[6:], strict=True))
    # A prefix of a sequence gets the ids of the sequence's first blocks.
    assert block_ids(a[:24], BS) == ids_a[:6]


@pytest.mark.parametrize("j", [0, 3, 9])
def test_a_change_in_block_j_changes_ids_from_j_on(j: int) -> None:
    tokens = make_tokens(40, seed=3)
    changed = list(tokens)
    changed[j * BS + 2] += 1  # one token inside block j
    before, after = block_ids(tokens, BS), block_ids(changed, BS)
    assert before[:j] == after[:j]
    assert all(x != y for x, y in zip(before[j:], after[j:], strict=True))


def test_same_block_tokens_under_another_parent_get_another_id() -> None:
    block = [7, 7, 7, 7]
    ids = block_ids(block * 3, BS)
    assert len(set(ids)) == 3  # the chain, not the tokens, names a block


def test_partial_trailing_block_gets_no_id() -> None:
    tokens = make_tokens(11, seed=4)
    assert len(block_ids(tokens, BS)) == 2
    assert block_ids(tokens, BS) == block_ids(tokens[:8], BS)
    assert block_ids(tokens[:3], BS) == []
    assert block_ids([], BS) == []
    assert len(block_ids(tokens[:4], BS)) == 1


def test_ids_are_the_chain_of_block_id() -> None:
    tokens = make_tokens(12, seed=5)
    first = block_id(ROOT_BLOCK_ID, tokens[0:4])
    second = block_id(first, tokens[4:8])
    third = block_id(second, tokens[8:12])
    assert block_ids(tokens, BS) == [first, second, third]
    # An explicit parent continues a chain: the ids of a suffix after a known prefix.
    assert block_ids(tokens[4:], BS, parent_id=first) == [second, third]


def test_ids_are_deterministic_64_bit_values() -> None:
    # Fixed values: ids must agree across processes, runs and machines (blake2b-64 of
    # the parent id and the tokens as little-endian int64).
    tokens = list(range(8))
    ids = block_ids(tokens, BS)
    assert ids == block_ids(list(range(8)), BS)
    assert ids == [2141542520064864664, 15377408733496924908]
    # The first id, recomputed from the definition.
    h = hashlib.blake2b(digest_size=8)
    h.update(ROOT_BLOCK_ID.to_bytes(8, "little"))
    h.update(array("q", [0, 1, 2, 3]).tobytes())
    assert ids[0] == int.from_bytes(h.digest(), "little")
    assert all(0 < i < 2**64 and i != ROOT_BLOCK_ID for i in ids)


def test_block_size_must_be_positive() -> None:
    for bad in (0, -4):
        with pytest.raises(ValueError, match="block_size"):
            block_ids([1, 2, 3], bad)
