"""A hand-off's blocks read from a rank's paged KV store as token rows: ``rows``
(in slot order) and ``rows_into`` (each block at its own rows of a shared buffer,
the way the ranks of a CP worker fill one segment together), in process."""

from __future__ import annotations

import pytest
import torch

from support.factories import TINY
from vertumnus.engine.kv_store import PagedKVStore

BLOCK = 4


def filled_store() -> PagedKVStore:
    store = PagedKVStore(TINY, 12, BLOCK, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    store.k.copy_(torch.randn(store.k.shape, generator=gen))
    store.v.copy_(torch.randn(store.v.shape, generator=gen))
    return store


def test_rows_are_the_blocks_in_slot_order() -> None:
    store = filled_store()
    rows = store.rows([7, 2, 9])
    assert rows.shape == (2, TINY.num_hidden_layers, 3 * BLOCK, 2, TINY.head_dim)
    for i, slot in enumerate((7, 2, 9)):
        assert torch.equal(rows[0, :, i * BLOCK : (i + 1) * BLOCK], store.k[slot])
        assert torch.equal(rows[1, :, i * BLOCK : (i + 1) * BLOCK], store.v[slot])


@pytest.mark.parametrize(
    "positions",
    [[0, 1, 2, 3], [1, 4, 7], [2], [5, 0, 3]],  # a run, every 3rd, one, out of order
    ids=["run", "every-third", "one", "scattered"],
)
def test_rows_into_puts_each_block_at_its_rows(positions: list[int]) -> None:
    store = filled_store()
    slots = [10, 3, 6, 1][: len(positions)]
    out = torch.zeros(2, TINY.num_hidden_layers, 8 * BLOCK, 2, TINY.head_dim)
    store.rows_into(slots, out, [p * BLOCK for p in positions])
    expected = store.rows(slots)
    for i, p in enumerate(positions):
        got = out[:, :, p * BLOCK : (p + 1) * BLOCK]
        assert torch.equal(got, expected[:, :, i * BLOCK : (i + 1) * BLOCK])
    untouched = [p for p in range(8) if p not in positions]
    for p in untouched:
        assert not out[:, :, p * BLOCK : (p + 1) * BLOCK].any()
    with pytest.raises(ValueError, match="multiple of the block size"):
        store.rows_into(slots, out, [p * BLOCK + 1 for p in positions])
