"""The CPU ranks' KV stores in shared memory (``runtime/kv/segments.py``)."""

from __future__ import annotations

from support.factories import TINY, engine_config
from vertumnus.runtime.kv.segments import KVSegments


def test_ranks_without_blocks_get_no_segment() -> None:
    """A pool of ranks without KV blocks (a benchmark of prefills alone) has no store
    to share: no segment, where making one of size zero failed the start."""
    segments = KVSegments(TINY, engine_config(kv_blocks_per_rank=0))
    try:
        assert segments.names(range(2)) == (None, None)
        assert segments.store_bytes(0) is None
    finally:
        segments.close()


def test_cpu_ranks_with_blocks_share_their_store() -> None:
    segments = KVSegments(TINY, engine_config(kv_blocks_per_rank=4))
    try:
        names = segments.names(range(2))
        assert all(isinstance(n, str) for n in names) and names[0] != names[1]
        k, v = segments.store_bytes(1) or (None, None)
        assert k is not None and v is not None and len(k) + len(v) == segments.size
    finally:
        segments.close()
