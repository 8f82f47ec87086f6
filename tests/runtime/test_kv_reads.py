"""KV reads into shared memory (``runtime/kv/reads.py``), the ranks' answers given by
hand: a read that every rank answered hands its segment on, and the segment is
reused once given back; a read that failed with one rank's answer still owed (a
``RankFailed`` of the other, or the time-out) never reuses its segment, since the
rank that owes it may still write there, into the next pull's bytes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from support.factories import TINY, engine_config
from vertumnus.engine.messages import KVData, KVRead, RankFailed
from vertumnus.policy.cache.index import BlockLocation
from vertumnus.runtime.kv.reads import KVReads
from vertumnus.runtime.kv.segments import KVSegments
from vertumnus.runtime.ranks import ChildRanks, CurrentRanks, RanksError


class SentRanks(ChildRanks):
    """Ranks on this host (reads go through shared memory) that only record."""

    def __init__(self) -> None:  # (no processes)
        self.commands: list[tuple[int, Any]] = []
        self.kv_segments = KVSegments(TINY, engine_config())  # (none made: no start)

    def send(self, rank: int, msg: object) -> None:
        self.commands.append((rank, msg))


GROUP = [BlockLocation(block_id=d, depth=d, rank=d % 2, slot=d // 2) for d in range(2)]


def segment_of(ranks: SentRanks) -> str:
    reads = [m for _, m in ranks.commands if isinstance(m, KVRead)]
    assert reads[-1].shm is not None
    return reads[-1].shm


@pytest.mark.timeout(30)
def test_a_failed_read_never_reuses_its_segment() -> None:
    async def main() -> None:
        ranks = SentRanks()
        reads = KVReads(engine_config(), TINY, CurrentRanks(ranks))
        try:
            done = reads.read(0, GROUP)
            first = segment_of(ranks)
            for device in (0, 1):
                reads.answer(KVData(read_id=1, rank=device, data=None))
            _, payload, shm = await done
            reads.give_back_segment(payload, shm)
            again = reads.read(0, GROUP)
            assert segment_of(ranks) == first  # (given back: reused)
            reads.answer(KVData(read_id=2, rank=0, data=None))  # rank 1 still owes its
            reads.answer(RankFailed(0, None, "broken", "", read_id=2))
            with pytest.raises(RanksError):
                await again
            after = reads.read(0, GROUP)
            assert segment_of(ranks) != first  # rank 1 may still write into the first
            after.cancel()
        finally:
            reads.close()

    asyncio.run(main())
