"""The prefix trie's records: a node per cache block, a worker's slot, and the bit
sets over worker slots.

Per node:
  * ``holders``: bit set over worker slots; bit w = worker w holds the *whole* prefix
    ending here, confirmed by its cache reports. Only reports set or clear it.
  * ``pending``: worker slot -> device that retains the block, for workers that
    inherited the prefix through a split or merge and must fetch it before reuse.
  * ``access[k]``, ``missed[k]``: per degree (index k into the trie's ``degrees``),
    decayed by the manager's scans; ``None`` while all zero.

A node knows its parent and its child count, not its children: block ids are
chained, so an id names its whole prefix. Pure Python. Not owned here: the trie
that keeps them consistent (``trie``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


class TrieError(ValueError):
    """A report or call that contradicts the trie's state (a driver bug)."""


class Node:
    __slots__ = (
        "access",
        "block_id",
        "depth",
        "holders",
        "missed",
        "num_children",
        "parent",
        "pending",
    )

    def __init__(self, block_id: int, parent: Node | None, depth: int) -> None:
        self.block_id = block_id
        self.parent = parent  # None for the first block of a sequence
        self.depth = depth  # 0-based: the node covers tokens [depth*B, (depth+1)*B)
        self.num_children = 0
        self.holders = 0
        self.pending: dict[int, int | None] | None = None
        self.access: list[float] | None = None
        self.missed: list[float] | None = None

    def path(self) -> list[Node]:
        """Root-side first: the nodes of the prefix ending here."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: int
    cp_degree: int
    first_device: int  # the worker's ranks are devices [first, first + C)
    slot: int  # its bit in the holder sets

    def device_of(self, depth: int) -> int:
        """The device holding a block at ``depth`` (block j on rank j % C)."""
        return self.first_device + depth % self.cp_degree


def bits(mask: int) -> Iterator[int]:
    """Indexes of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
