"""Messages across the coordinator <-> rank process boundary.

Every message is a small frozen dataclass, pickled onto a one-way pipe between the
coordinator and a local rank process, or the argument and result of a Ray actor's
call for a rank on another host; receivers ``match`` on the type. Nothing here
runs anything. The tensors of a command (token ids) and of an answer (logits)
cross as plain bytes (``wire.py``).

    coordinator --PrefillCommand / SwitchEpoch / RebuildGroups / KVTransfer /
                  KVRead / Shutdown--> rank r
    rank r      --RankReady / PrefillDone / EpochAck / GroupsReady / KVWritten /
                  KVData / RankFailed--> coordinator
    rank r      <--K and V of a KVTransfer's blocks (torch.distributed)--> rank s

KV bytes cross this boundary only for a hand-off to a decode pool (``KVRead``, the
exported rows of a ``PrefillDone``): a ``KVTransfer`` names the moves, and the
ranks send the blocks to each other over their pair's process group.

This module belongs to the engine (the rank side's vocabulary): the coordinator
imports it, and nothing in ``engine/`` imports the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from vertumnus.engine.logprobs import PromptLogprobs
from vertumnus.engine.wire import TensorsAsBytes
from vertumnus.engine.zigzag import RankPrefill


@dataclass(frozen=True)
class PrefillCommand(TensorsAsBytes):
    """One prefill on one worker; every rank of the worker receives the same command."""

    request_id: int
    worker_ranks: tuple[int, ...]  # global ranks of the worker, in CP rank order
    token_ids: Tensor  # [R] the uncached suffix (int64)
    prefix_len: int  # P cached tokens reused, a multiple of block_size
    prefix_slots: tuple[tuple[int, ...], ...]  # per CP rank: its prefix blocks' slots
    write: tuple[tuple[tuple[int, int], ...], ...]  # per CP rank: (depth, slot) to store
    block_size: int
    logits: str = "last"  # "last": [1, V]; "all": [R, V]
    # Suffix rows [a, b) whose K and V CP rank 0 returns in ``PrefillDone.exported``
    # (a KV hand-off: the prompt's tokens that no cache block holds); None: none.
    export: tuple[int, int] | None = None
    # k: CP rank 0 also returns ``PrefillDone.prompt_logprobs``, the log-probabilities
    # of the suffix's tokens after its first and their top k (``logprobs.py``)
    prompt_logprobs: int | None = None
    # [P] the cached prefix's token ids, for a model that may compute some of them again
    # (DeepSeek-V4: those after the last cached block keeping its raw rows,
    # ``engine/dsv4/blocks.py``); None: not sent.
    prefix_ids: Tensor | None = None
    _tensor_fields = ("token_ids", "prefix_ids")

    def for_rank(self, cp_rank: int) -> RankPrefill:
        return RankPrefill(
            token_ids=self.token_ids,
            prefix_len=self.prefix_len,
            prefix_slots=self.prefix_slots[cp_rank],
            write=self.write[cp_rank],
            block_size=self.block_size,
            export=self.export,
            prompt_logprobs=self.prompt_logprobs,
            peer_writes=tuple(tuple(d for d, _ in w) for w in self.write),
        )


@dataclass(frozen=True)
class SwitchEpoch:
    """Adopt configuration epoch ``epoch``: from now on this rank serves the worker of
    ``worker_ranks`` (a group created at start-up). Answered by ``EpochAck``."""

    epoch: int
    worker_ranks: tuple[int, ...]


@dataclass(frozen=True)
class EpochAck:
    rank: int
    epoch: int


@dataclass(frozen=True)
class RebuildGroups:
    """Form these worker groups anew, at these generations (ranks, generation), with
    a restarted peer; answered by ``GroupsReady``. Every member forms them in the
    same order, so rendezvous cannot deadlock."""

    token: int
    groups: tuple[tuple[tuple[int, ...], int], ...]


@dataclass(frozen=True)
class GroupsReady:
    rank: int
    token: int


@dataclass(frozen=True)
class KVTransfer:
    """One KV copy: each move (src rank, src slot, dst rank, dst slot) puts the K and V
    of one block (all layers) of the source rank into a slot of the destination rank,
    within a rank or over the two ranks' pair group (formed on first use, named by
    both ``incarnations``). Every rank of ``ranks`` receives the same command and
    answers ``KVWritten`` once it has sent and stored its blocks, or ``RankFailed``
    with the ``copy_id``."""

    copy_id: int
    moves: tuple[tuple[int, int, int, int], ...]
    incarnations: tuple[tuple[int, int], ...]  # (rank, restarts) of each of ``ranks``

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks involved: a source or destination of some move, ascending."""
        return tuple(sorted({r for src, _, dst, _ in self.moves for r in (src, dst)}))


@dataclass(frozen=True)
class KVWritten:
    copy_id: int
    rank: int


@dataclass(frozen=True)
class KVRead:
    """Send back the K and V of these slots (a KV hand-off's blocks, in this order);
    answered by ``KVData`` or ``RankFailed`` with the ``read_id``.

    With ``shm`` (a rank on the coordinator's host): write them instead into that
    shared-memory segment, viewed as [2, layers, ``rows``, Hkv, D] in the KV dtype,
    slot i's block at row ``rows_at[i]``; the ``KVData`` then carries nothing."""

    read_id: int
    slots: tuple[int, ...]
    shm: str | None = None
    rows: int = 0
    rows_at: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVSend:
    """Send the K and V of these slots (as ``KVRead``'s rows) to a decode server
    over torch.distributed point to point: join the two-member group ``name`` (the
    decode server is member 0, this rank member 1) through the store the decode
    server hosts at ``store_host:store_port``, send one tensor, leave. NCCL where the
    rank is on a GPU, gloo on CPU: both sides must be alike. Answered by a ``KVData``
    without data (or ``RankFailed``) with ``read_id``."""

    read_id: int
    slots: tuple[int, ...]
    store_host: str
    store_port: int
    name: str
    timeout_s: float = 60.0


@dataclass(frozen=True)
class KVData(TensorsAsBytes):
    """The blocks of a ``KVRead`` as rows: [2 (K, V), layers, slots * block_size,
    Hkv, D], in the order the slots were named."""

    read_id: int
    rank: int
    data: Tensor | None  # None: written into the read's shared memory
    _tensor_fields = ("data",)


@dataclass(frozen=True)
class Shutdown:
    """Leave the command loop, tear down the process groups and exit."""


@dataclass(frozen=True)
class RankReady:
    rank: int
    device: str
    kv_bytes: int
    layers: str = "eager"  # how the layers run: "compiled" or "eager"
    eager_because: str | None = None  # why not compiled under ``compile = "auto"``
    attention: str = "flash"  # a CPU rank's attention kernel family; "cuda" on a GPU


@dataclass(frozen=True)
class PrefillDone(TensorsAsBytes):
    request_id: int
    rank: int
    compute_s: float  # wall time of this rank's part
    logits: Tensor | None  # fp32, only from CP rank 0 of the worker
    collectives: dict[str, int]  # collectives this rank issued, by tag
    # MoE models: this rank's (token, expert) assignments per expert, by sparse layer
    expert_tokens: dict[int, list[int]] | None = None
    # CP rank 0, when the command exports rows: their K and V, [2, layers, n, Hkv, D]
    exported: Tensor | None = None
    # CP rank 0, when the command asks for them (``PrefillCommand.prompt_logprobs``)
    prompt_logprobs: PromptLogprobs | None = None
    _tensor_fields = ("logits", "exported")


@dataclass(frozen=True)
class RankFailed:
    rank: int
    request_id: int | None  # None: failed outside a prefill (start-up, a KV copy)
    error: str  # one-line message
    traceback: str
    copy_id: int | None = None  # the KV copy that failed, if one did
    read_id: int | None = None  # the KV read that failed, if one did
