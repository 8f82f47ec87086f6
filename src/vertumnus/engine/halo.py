"""The halo of a sliding-window layer under zigzag CP: which K/V rows each rank needs
from which, so that a prefill moves only what some query can see or some rank must
keep, never the whole sequence.

A query at position i of a layer with window w sees keys i - w < j <= i. Rank r owns
the suffix ranges [a, b) of its zigzag chunks (``ZigzagPartition``), and holds the
prefix blocks of depth d with d % C == r (the cache's rule). Its queries need, per
owned range, the w - 1 positions before it (the halo), which sit in the cached prefix
or in the chunks of other ranks; besides, it must hold the rows of the new blocks it
stores (``write`` depths: depth d's rows are [d*bs, (d+1)*bs)) and, on CP rank 0,
the rows a KV hand-off exports. Everything else stays where it was computed::

    C = 2, w = 3:   chunks | 0 | 1 | 2 | 3 |     rank 0 owns 0, 3; rank 1 owns 1, 2
                    rank 0 needs the last 2 rows of chunk 2 (for chunk 3)
                    rank 1 needs the last 2 rows of chunk 0 (for chunk 1); chunk 2's
                    halo is its own chunk 1

Every rank derives every rank's needs from the same facts (the partition, the prefix
length, the window, each rank's write depths, the export range), so one all-to-all,
with the row counts known on both sides, carries the halo: per rank it receives at
most 2(w - 1) halo rows plus the rows of the blocks it stores, against the whole
prefix and suffix an all-gather delivers.
"""

from __future__ import annotations

from dataclasses import dataclass

from vertumnus.engine.partition import ZigzagPartition


@dataclass(frozen=True)
class HaloPlan:
    """This rank's part of one exchange. Positions are absolute (prefix included);
    local rows index the rank's packed K/V: [its prefix share, padded to ``width`` |
    its suffix tokens in local order]."""

    own_rows: tuple[int, ...]  # local rows this rank holds ...
    own_positions: tuple[int, ...]  # ... and their positions
    send_rows: tuple[tuple[int, ...], ...]  # per peer q: local rows to send, in q's order
    recv_positions: tuple[tuple[int, ...], ...]  # per peer q: positions of q's rows

    @property
    def received(self) -> int:
        return sum(len(p) for p in self.recv_positions)


def plan_halo(
    part: ZigzagPartition,
    rank: int,
    prefix_len: int,
    block_size: int,
    window: int,
    write_depths: tuple[tuple[int, ...], ...],
    export: tuple[int, int] | None,
) -> HaloPlan:
    """The exchange of ``rank`` (module docstring). ``write_depths[q]``: the depths of
    the new blocks rank q stores; ``export``: suffix rows CP rank 0 returns."""
    c, p, bs = part.cp_degree, prefix_len, block_size
    width = -(-(p // bs) // c) * bs  # the prefix share of the largest holder, padded

    def locate(pos: int) -> tuple[int, int]:
        """(owner rank, local row) of position ``pos``."""
        if pos < p:
            depth = pos // bs
            return depth % c, (depth // c) * bs + pos % bs
        return suffix_owner[pos - p]

    suffix_owner: list[tuple[int, int]] = [(0, 0)] * part.padded_len
    for q in range(c):
        for k, i in enumerate(part.indices(q)):
            suffix_owner[i] = (q, width + k)

    def needs(q: int) -> list[int]:
        wanted: set[int] = set()
        for a, _ in part.ranges(q):
            if a < part.num_tokens:  # a range of padding alone needs nothing
                wanted.update(range(max(0, p + a - window + 1), p + a))
        for d in write_depths[q]:
            wanted.update(range(d * bs, (d + 1) * bs))
        if export is not None and q == 0:
            wanted.update(range(p + export[0], p + export[1]))
        return sorted(pos for pos in wanted if locate(pos)[0] != q)

    mine = needs(rank)
    own: list[tuple[int, int]] = []  # (local row, position)
    for pos in range(p):
        holder, row = locate(pos)
        if holder == rank:
            own.append((row, pos))
    own += [(width + k, p + i) for k, i in enumerate(part.indices(rank))]
    send = tuple(
        tuple(locate(pos)[1] for pos in needs(q) if locate(pos)[0] == rank) if q != rank else ()
        for q in range(c)
    )
    recv = tuple(tuple(pos for pos in mine if locate(pos)[0] == q) for q in range(c))
    return HaloPlan(
        own_rows=tuple(r for r, _ in own),
        own_positions=tuple(pos for _, pos in own),
        send_rows=send,
        recv_positions=recv,
    )
