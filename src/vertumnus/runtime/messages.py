"""Messages across the coordinator <-> rank process boundary.

Every message is a small frozen dataclass sent through a ``torch.multiprocessing``
queue (tensors travel in shared memory); receivers ``match`` on the type. Nothing
here runs anything.

    coordinator --PrefillCommand / Shutdown--> rank r of worker w
    rank r      --RankReady / PrefillDone / RankFailed--> coordinator
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from vertumnus.engine.zigzag import RankPrefill


@dataclass(frozen=True)
class PrefillCommand:
    """One prefill on one worker; every rank of the worker receives the same command."""

    request_id: int
    worker_ranks: tuple[int, ...]  # global ranks of the worker, in CP rank order
    token_ids: Tensor  # [R] the uncached suffix (int64)
    prefix_len: int  # P cached tokens reused, a multiple of block_size
    prefix_slots: tuple[tuple[int, ...], ...]  # per CP rank: its prefix blocks' slots
    write: tuple[tuple[tuple[int, int], ...], ...]  # per CP rank: (depth, slot) to store
    block_size: int
    logits: str = "last"  # "last": [1, V]; "all": [R, V]

    def for_rank(self, cp_rank: int) -> RankPrefill:
        return RankPrefill(
            token_ids=self.token_ids,
            prefix_len=self.prefix_len,
            prefix_slots=self.prefix_slots[cp_rank],
            write=self.write[cp_rank],
            block_size=self.block_size,
        )


@dataclass(frozen=True)
class Shutdown:
    """Leave the command loop, tear down the process groups and exit."""


@dataclass(frozen=True)
class RankReady:
    rank: int
    device: str
    kv_bytes: int


@dataclass(frozen=True)
class PrefillDone:
    request_id: int
    rank: int
    compute_s: float  # wall time of this rank's part
    logits: Tensor | None  # fp32, only from CP rank 0 of the worker
    collectives: dict[str, int]  # collectives this rank issued, by tag


@dataclass(frozen=True)
class RankFailed:
    rank: int
    request_id: int | None  # None: failed outside a prefill (start-up)
    error: str  # one-line message
    traceback: str
