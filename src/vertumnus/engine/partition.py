"""The zigzag partition of one prefill's uncached suffix over a worker's C ranks.

The suffix of R tokens is padded to Rp = 2C * s tokens, s = ceil(R / 2C) (rounded up
to a multiple of ``align``: DeepSeek-V4's chunks hold whole compression windows), and
cut into 2C chunks of s tokens; rank k owns chunks k and 2C-1-k, which balances causal
attention work (``zigzag.py`` for the attention, ``halo.py`` for sliding windows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ZigzagPartition:
    num_tokens: int  # R: real tokens in the uncached suffix
    cp_degree: int  # C
    align: int = 1  # the chunk length is a multiple of it

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"a prefill computes at least one token, got {self.num_tokens}")
        if self.cp_degree < 1 or self.align < 1:
            raise ValueError(
                f"cp_degree and align must be positive, got {self.cp_degree}, {self.align}"
            )

    @property
    def chunk_len(self) -> int:
        return self.align * math.ceil(self.num_tokens / (2 * self.cp_degree * self.align))

    @property
    def padded_len(self) -> int:
        return self.chunk_len * 2 * self.cp_degree

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """Suffix index ranges [start, end) owned by ``rank``, in the rank's local order."""
        if not 0 <= rank < self.cp_degree:
            raise ValueError(f"rank {rank} outside a degree-{self.cp_degree} worker")
        s = self.chunk_len
        first, second = rank, 2 * self.cp_degree - 1 - rank
        if second == first + 1:  # rank C-1 (all of C = 1): adjacent chunks, one range
            return [(first * s, (second + 1) * s)]
        return [(first * s, (first + 1) * s), (second * s, (second + 1) * s)]

    def indices(self, rank: int) -> list[int]:
        """Suffix indices of the tokens ``rank`` computes (indices >= R are padding)."""
        return [i for a, b in self.ranges(rank) for i in range(a, b)]

    def restore_index(self) -> list[int]:
        """``flat[restore_index()[i]]`` is suffix token i, where ``flat`` concatenates
        every rank's tokens in rank order (what an all-gather produces); all Rp slots."""
        out = [0] * self.padded_len
        pos = 0
        for rank in range(self.cp_degree):
            for i in self.indices(rank):
                out[i] = pos
                pos += 1
        return out
