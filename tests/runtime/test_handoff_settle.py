"""Pulls straight from the ranks' stores: a switch waits for the pulls that stream
from its ranks (``Handoffs.settle``): only those on its ranks, and a pull whose
puller stopped reading is cut off after the wait's bound; the runs a chunk of
blocks is sent as (``store_runs``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from vertumnus.policy.cache.index import BlockLocation
from vertumnus.runtime.kv.handoffs import Handoffs
from vertumnus.runtime.kv.segments import store_runs


class FakeSink:
    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done, self.aborted = done, False

    async def start(self, data: bytes) -> None: ...
    def writev(self, views: Sequence[Any]) -> None: ...
    async def drain(self) -> None: ...
    async def flush(self) -> None: ...

    def abort(self) -> None:  # the stream then fails and ends
        self.aborted = True
        self.done.get_loop().call_soon(self.done.set_result, None)


def test_settle_waits_for_the_pulls_on_its_ranks_and_cuts_off_a_stalled_one() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        handoffs = Handoffs.__new__(Handoffs)  # only its table of pulls is used here
        quick, other, stuck = (loop.create_future() for _ in range(3))
        sinks = {name: FakeSink(done) for name, done in (("q", quick), ("o", other), ("s", stuck))}
        handoffs._pulls = {
            "q": ({0, 1}, sinks["q"], quick),
            "o": ({4, 5}, sinks["o"], other),
            "s": ({2}, sinks["s"], stuck),
        }
        loop.call_later(0.05, quick.set_result, None)
        await asyncio.wait_for(handoffs.settle({1}, timeout_s=5.0), 2.0)
        assert quick.done() and not other.done() and not sinks["q"].aborted

        start = loop.time()
        await handoffs.settle({2, 3}, timeout_s=0.1)
        assert sinks["s"].aborted and stuck.done() and loop.time() - start < 2.0
        assert not sinks["o"].aborted and not other.done()  # not on those ranks
        await handoffs.settle({7}, timeout_s=0.1)  # nothing there: at once

    asyncio.run(main())


def test_store_runs_merge_consecutive_slots_of_one_rank() -> None:
    """Blocks in consecutive slots of one rank leave as one run; a CP worker's
    blocks alternate ranks, so each is a run of its own, K first, then V."""
    k0, v0 = memoryview(bytes(range(40))), memoryview(bytes(range(100, 140)))
    k1, v1 = memoryview(bytes(range(50, 90))), memoryview(bytes(range(150, 190)))
    stores = {3: (k0, v0), 4: (k1, v1)}
    one_rank = [
        BlockLocation(block_id=d, depth=d, rank=0, slot=s) for d, s in enumerate((1, 2, 3, 0))
    ]
    runs = store_runs(stores, 3, one_rank, 4)
    assert [bytes(r) for r in runs] == [
        bytes(k0[4:16]),
        bytes(k0[0:4]),
        bytes(v0[4:16]),
        bytes(v0[0:4]),
    ]
    cp2 = [BlockLocation(block_id=d, depth=d, rank=d % 2, slot=d // 2) for d in range(3)]
    runs = store_runs(stores, 3, cp2, 4)
    assert [bytes(r) for r in runs] == [
        bytes(k0[0:4]),
        bytes(k1[0:4]),
        bytes(k0[4:8]),
        bytes(v0[0:4]),
        bytes(v1[0:4]),
        bytes(v0[4:8]),
    ]
