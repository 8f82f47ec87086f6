"""What a KV hand-off is, on the prefill side: a lease on a prompt's KV, the rows
its prefill exports, and where a pull's stream goes (``Sink``); its errors are
``kv_wire.HandoffError``. The
leases themselves, their ends and their pulls are ``runtime/kv/handoffs.py``'s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from vertumnus.kv_wire import HandoffError
from vertumnus.policy.cache.holds import Hold, held_blocks
from vertumnus.policy.cache.index import BlockAllocation, BlockLocation, WorkerCacheIndex


class Sink(Protocol):
    """Where a pull's stream goes (the route's socket). ``start`` writes the first
    bytes; ``writev`` queues buffers that must stay untouched until ``flush``
    returns; ``drain`` waits until what is queued is below the sink's limit,
    ``flush`` until none is left in this process; ``abort`` drops the connection
    and what is queued. ``writev`` and both waits raise ``ConnectionError`` once
    the puller is gone."""

    async def start(self, data: bytes) -> None: ...
    def writev(self, views: Sequence[Any]) -> None: ...
    async def drain(self) -> None: ...
    async def flush(self) -> None: ...
    def abort(self) -> None: ...


@dataclass
class Lease:
    handle: str
    hold: Hold  # the policy's pin on the prompt's whole blocks
    first_device: int
    rows: Tensor | None  # K, V of the tokens after them: [2, layers, t, Hkv, D]
    num_tokens: int  # tokens handed off: the prompt but its last
    prompt_tokens: int
    expires_s: float  # on the coordinator's clock
    expires_unix: float
    pulling: bool = False
    ended: str | None = None  # why it ended (``Handoffs.end``); None while open
    # DeepSeek-V4: the prompt's state instead of rows (``engine/dsv4/state.to_bytes``,
    # uint8), streamed as ``kv_wire``'s chunk kind 3; ``rows`` is then None.
    state: Tensor | None = None

    @property
    def request_id(self) -> int:
        return self.hold.request_id

    @property
    def worker_id(self) -> int:
        return self.hold.worker_id

    @property
    def index(self) -> WorkerCacheIndex:
        return self.hold.index

    @property
    def blocks(self) -> list[BlockLocation]:
        """The blocks the pull streams: none with a state, which holds the whole prompt
        (the hold still pins its blocks: the prefix stays hot until it is pulled)."""
        return [] if self.state is not None else self.hold.blocks


def export_range(
    allocation: BlockAllocation, prompt_tokens: int, block: int, whole: bool = False
) -> tuple[int, int]:
    """The suffix rows [a, b) a hand-off prefill must return: the tokens of the
    prompt but its last that the hold's blocks (``held_blocks``) do not hold;
    ``whole`` (DeepSeek-V4, whose prefill returns the state of the prompt but its
    last token, cached prefix included): every computed row but the last."""
    prefix = allocation.prefix_blocks * block  # (reused, or loaded back from the host tier)
    if whole:
        return 0, prompt_tokens - 1 - prefix
    held = held_blocks(allocation, prompt_tokens, block)
    return held * block - prefix, prompt_tokens - 1 - prefix


def check_current(lease: Lease, indexes: Mapping[int, WorkerCacheIndex]) -> None:
    """A pull under way stops (``HandoffError``, 410) if its lease ended, or its
    worker's cache index is not the one it was taken from (a restart, a reshape)."""
    if lease.ended is not None:
        raise HandoffError(f"the KV hand-off {lease.handle!r} ended: {lease.ended}", "ended", 410)
    if indexes.get(lease.worker_id) is not lease.index:
        raise HandoffError(f"the KV hand-off {lease.handle!r} ended: moved", "ended", 410)
