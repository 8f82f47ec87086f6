"""Prefixes on their way: the blocks that the requests outstanding at a worker bring.

A worker runs its queue FIFO, so every request outstanding there (queued or
running) has written its whole prefix before a request placed now starts, and the
start reuses what the worker then holds. The cost rule (``scheduler``) therefore
counts, as P_iw, the longest leading run of the request's blocks that w holds or
that a request outstanding at w brings: an agent's next step, or a conversation's
next turn, that arrives while its predecessor waits is priced at w as its start
will find it, and goes where its prefix is being built rather than to the
least-loaded worker, which would compute it a second time.

The index keeps, per worker, the blocks each outstanding request brings beyond what
w held when it was placed (an agent's step adds a block or two), counted, since
requests share blocks. Block ids are chained, so past what w holds (h blocks) the
blocks coming along a request's path are a prefix of the rest of it: when block h
is coming, a binary search over (h, usable] finds the end of the run
(``coming_run``). Invariant (``check``): the counts equal those rebuilt from the
outstanding requests.

Pure Python. Not owned here: what a worker holds (the trie, ``manager``), the
queues and the cost rule (``scheduler``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def coming_run(coming: Mapping[int, int], ids: Sequence[int], held: int, usable: int) -> int:
    """Leading blocks of ``ids`` held or coming, given that the first ``held`` are
    held (at most ``usable``, unless more are held)."""
    if held >= usable or ids[held] not in coming:
        return held
    lo, hi = held + 1, usable
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ids[mid - 1] in coming:
            lo = mid
        else:
            hi = mid - 1
    return min(lo, hi)


class ComingBlocks:
    """worker -> block id -> the outstanding requests there that bring it."""

    def __init__(self) -> None:
        self.by_worker: dict[int, dict[int, int]] = {}
        self._brings: dict[int, tuple[int, int]] = {}  # request -> (worker, first block)

    def add(self, request_id: int, worker_id: int, block_ids: Sequence[int], first: int) -> None:
        """The request, placed at the worker that holds its first ``first`` blocks,
        brings the rest there."""
        if first >= len(block_ids):
            return
        self._brings[request_id] = (worker_id, first)
        coming = self.by_worker.setdefault(worker_id, {})
        for block_id in block_ids[first:]:
            coming[block_id] = coming.get(block_id, 0) + 1

    def remove(self, request_id: int, block_ids: Sequence[int]) -> None:
        """The request is no longer outstanding (done, cancelled or handed back)."""
        entry = self._brings.pop(request_id, None)
        if entry is None:
            return
        worker_id, first = entry
        coming = self.by_worker[worker_id]
        for block_id in block_ids[first:]:
            left = coming[block_id] - 1
            if left:
                coming[block_id] = left
            else:
                del coming[block_id]
        if not coming:
            del self.by_worker[worker_id]

    def check(self, outstanding: Mapping[int, tuple[int, Sequence[int]]]) -> None:
        """Raise AssertionError unless the counts are those of ``outstanding``
        (request -> (its worker, its block ids))."""
        rebuilt: dict[int, dict[int, int]] = {}
        for request_id, (worker_id, first) in self._brings.items():
            assert outstanding[request_id][0] == worker_id
            held = rebuilt.setdefault(worker_id, {})
            for block_id in outstanding[request_id][1][first:]:
                held[block_id] = held.get(block_id, 0) + 1
        assert rebuilt == self.by_worker
