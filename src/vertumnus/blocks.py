"""Block ids: a chained hash of (parent id, block tokens).

Equal prefixes map to equal block ids on every worker and in every process, so a
block id names a whole prefix, not only its last ``block_size`` tokens. Only full
blocks get ids. Pure Python (the coordinator, the trie and the simulator use it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_BLOCK_ID = 0  # parent of the first block of every sequence


def max_reuse_blocks(input_tokens: int, block_size: int) -> int:
    """Whole blocks a prefill of ``input_tokens`` may reuse from a cache: at least one
    token is always computed, since its logits give the first token. The one place
    this rule lives (the engine's planning, the policy and the trie all ask here)."""
    return max(0, (input_tokens - 1) // block_size)


def block_id(parent_id: int, tokens: Sequence[int]) -> int:
    """64-bit id of a block from its parent's id and its token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_id.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    value = int.from_bytes(h.digest(), "little")
    return value if value != ROOT_BLOCK_ID else 1


def block_ids(tokens: Sequence[int], block_size: int, parent_id: int = ROOT_BLOCK_ID) -> list[int]:
    """Ids of every full block of ``tokens`` (a trailing partial block gets none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    ids: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent_id = block_id(parent_id, tokens[start : start + block_size])
        ids.append(parent_id)
    return ids
