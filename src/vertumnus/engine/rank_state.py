"""What one rank holds once it has started, and how it answers a command.

Owns a started rank's state (``RankState``: its device, model, paged KV store, the
process groups of every worker it can belong to, the TCP store they rendezvous on,
and the pair groups of KV copies) and ``handle``, which executes one command and
returns its answer. It does not know how commands arrive: a rank process reads them
from its pipe (``engine/rank.py``), a Ray actor receives them as calls
(``runtime/cluster/rank_actor.py``); both hand each to ``handle`` in arrival order.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch

# torch.distributed re-exports TCPStore from torch._C without listing it in __all__.
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from vertumnus.engine.comm import Communicator, DistComm, SoloComm, make_group, worker_group_name
from vertumnus.engine.dsv4.model import DeepseekV4LM, command_rank
from vertumnus.engine.dsv4.state import to_bytes
from vertumnus.engine.host_copy import HostStaging, StepTimer
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.kv_transfer import PairGroups, check_transfer, run_transfer
from vertumnus.engine.logprobs import PromptLogprobs
from vertumnus.engine.messages import (
    EpochAck,
    GroupsReady,
    KVData,
    KVRead,
    KVSend,
    KVTransfer,
    KVWritten,
    PrefillCommand,
    PrefillDone,
    RankFailed,
    RebuildGroups,
    Shutdown,
    SwitchEpoch,
)
from vertumnus.engine.shared_rows import Attached
from vertumnus.engine.zigzag import prefill_rank


@dataclass
class RankState:
    """A started rank: ``groups`` maps the ranks of each multi-rank worker it belongs
    to onto that worker's process group (formed at start-up; a ``RebuildGroups``
    forms some anew)."""

    rank: int
    model: Any  # engine.model.CausalLM
    kv: PagedKVStore
    groups: dict[tuple[int, ...], Any]
    store: Any  # the pool's TCPStore
    device: torch.device
    timeout: timedelta
    pairs: PairGroups = field(init=False)  # of the KV copies
    attached: Attached = field(init=False, default_factory=Attached)  # hand-off reads
    staging: HostStaging = field(init=False)  # a prefill's outputs on their way out

    def __post_init__(self) -> None:
        self.pairs = PairGroups(self.store, self.rank, self.device, self.timeout)
        self.staging = HostStaging(self.device)

    def handle(self, msg: object) -> object | None:
        """Execute ``msg``; its answer (a ``RankFailed`` if it failed), or None for
        ``Shutdown`` (the rank ends)."""
        rank, kv = self.rank, self.kv
        match msg:
            case Shutdown():
                return None
            case PrefillCommand():
                return _run(rank, self.model, kv, self.groups, msg, self.staging)
            case KVTransfer():

                def transfer(m: KVTransfer = msg) -> KVWritten:
                    check_transfer(rank, m, kv)
                    run_transfer(rank, kv, m, lambda peer: self.pairs.get(peer, m.incarnations))
                    return KVWritten(m.copy_id, rank)

                return _answer(rank, transfer, "KVTransfer", msg.copy_id)
            case KVRead():

                def read(m: KVRead = msg) -> KVData:
                    if m.shm is None:
                        return KVData(m.read_id, rank, kv.rows(m.slots).cpu())
                    shape = (2, kv.k.shape[1], m.rows, *kv.k.shape[3:])
                    view = self.attached.view(m.shm, kv.k.dtype, shape)
                    kv.rows_into(m.slots, view, m.rows_at)
                    return KVData(m.read_id, rank, None)

                return _answer(rank, read, "KVRead", read_id=msg.read_id)
            case KVSend():

                def send(m: KVSend = msg) -> KVData:
                    wait = timedelta(seconds=m.timeout_s)
                    peer = TCPStore(m.store_host, m.store_port, is_master=False, timeout=wait)
                    group = make_group(peer, m.name, (0, 1), 1, self.device, wait)
                    group.send([kv.rows(m.slots).contiguous()], 0, 0).wait()
                    return KVData(m.read_id, rank, None)

                return _answer(rank, send, "KVSend", read_id=msg.read_id)
            case RebuildGroups():

                def rebuild(m: RebuildGroups = msg) -> GroupsReady:
                    for ranks, generation in m.groups:
                        if rank in ranks:
                            name = worker_group_name(ranks, generation)
                            self.groups[ranks] = make_group(
                                self.store, name, ranks, rank, self.device, self.timeout
                            )
                    return GroupsReady(rank, m.token)

                return _answer(rank, rebuild, "RebuildGroups")
            case SwitchEpoch():
                # The groups exist since start-up: adopting an epoch only checks that
                # this rank belongs to the worker and can reach its group.
                if rank not in msg.worker_ranks or (
                    len(msg.worker_ranks) > 1 and msg.worker_ranks not in self.groups
                ):
                    error = f"no process group for worker ranks {msg.worker_ranks}"
                    return RankFailed(rank, None, error, "")
                return EpochAck(rank, msg.epoch)
            case _:
                return RankFailed(rank, None, f"unknown command {type(msg).__name__}", "")


def _answer(
    rank: int,
    make: Any,
    what: str,
    copy_id: int | None = None,
    read_id: int | None = None,
) -> object:
    """``make()``, or a ``RankFailed`` naming ``what`` if it raises."""
    try:
        answer = make()
    except Exception as exc:
        error = f"{what}: {type(exc).__name__}: {exc}"
        answer = RankFailed(rank, None, error, traceback.format_exc(), copy_id, read_id)
    return answer


def _run(
    rank: int,
    model: Any,
    kv: PagedKVStore,
    groups: dict[tuple[int, ...], Any],
    cmd: PrefillCommand,
    staging: HostStaging,
) -> PrefillDone | RankFailed:
    try:
        cp_rank = cmd.worker_ranks.index(rank)
        size = len(cmd.worker_ranks)
        comm: Communicator
        if size == 1:
            comm = SoloComm()
        elif cmd.worker_ranks in groups:
            comm = DistComm(groups[cmd.worker_ranks], cp_rank, size)
        else:
            raise ValueError(f"no process group for worker ranks {cmd.worker_ranks}")
        _check_command(cmd, model.config.vocab_size, kv)
        timer = StepTimer(model.device)
        timer.start()
        step = cmd.for_rank(cp_rank)
        step = replace(step, token_ids=step.token_ids.to(model.device))
        exported: list[torch.Tensor] = []
        prompt: list[PromptLogprobs] = []
        if isinstance(model, DeepseekV4LM):
            _check_dsv4(cmd, model.config.block_cache_problem(cmd.block_size))
            logits, state = command_rank(model, comm, kv, cmd, step.token_ids)
            if cmd.export is not None and cp_rank == 0 and state is not None:  # its state
                exported.append(torch.frombuffer(bytearray(to_bytes(state)), dtype=torch.uint8))
        else:
            logits = prefill_rank(model, comm, kv, step, cmd.logits, exported, prompt)
        elapsed = timer.stop()
        host_logits, host_kv = staging.fetch([logits, exported[0] if exported else None])
        return PrefillDone(
            cmd.request_id,
            rank,
            elapsed,
            host_logits,
            dict(comm.calls),
            model.expert_tokens(),
            host_kv,
            prompt[0].cpu() if prompt else None,
        )
    except Exception as exc:
        return RankFailed(
            rank, cmd.request_id, f"{type(exc).__name__}: {exc}", traceback.format_exc()
        )


def _check_dsv4(cmd: PrefillCommand, block_problem: str | None) -> None:
    """DeepSeek-V4's prefills resume and store whole blocks of its prefix state where
    the block size allows (``block_problem``: why not, ``dsv4/blocks.py``), and a
    hand-off exports the state of the whole prompt but its last token
    (``PrefillDone.exported``: ``dsv4.state.to_bytes``, as uint8), cached prefix
    included."""
    n = int(cmd.token_ids.numel())
    export_ok = cmd.export is None or (cmd.export[0] == 0 and cmd.export[1] == n - 1)
    cached = cmd.prefix_len > 0 or any(cmd.write)
    if cached and block_problem is not None:
        raise ValueError(block_problem)
    if cmd.prefix_len and cmd.prefix_ids is None:
        raise ValueError("a DeepSeek-V4 prefill resuming a cached prefix needs its token ids")
    wanted = [
        what
        for what, asked in (
            ("exported rows other than the prompt but its last token", not export_ok),
            ("prompt logprobs", cmd.prompt_logprobs is not None),
        )
        if asked
    ]
    if wanted:
        raise ValueError(f"DeepSeek-V4 prefills take no {', '.join(wanted)} (not built yet)")


def _check_command(cmd: PrefillCommand, vocab_size: int, kv: PagedKVStore) -> None:
    """Reject a malformed command before the first collective.

    Every rank of the worker checks the whole command, not only its own share, so the
    ranks accept or reject a command together: a rank that gave up alone would leave
    its peers blocked in an all-gather, and the group out of step for the next prefill.
    """
    c, bs, p = len(cmd.worker_ranks), cmd.block_size, cmd.prefix_len
    ids = cmd.token_ids
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype != torch.long:
        raise ValueError(
            f"token_ids must be a non-empty 1-D int64 tensor, got "
            f"{ids.dtype} of shape {tuple(ids.shape)}"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token ids outside the vocabulary [0, {vocab_size})")
    if cmd.logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last' or 'all', got {cmd.logits!r}")
    k = cmd.prompt_logprobs
    if k is not None and not 0 <= k <= vocab_size:
        raise ValueError(f"prompt_logprobs must be in [0, {vocab_size}], got {k}")
    if cmd.prefix_ids is not None and cmd.prefix_ids.shape != (p,):
        raise ValueError(f"prefix_ids of shape {tuple(cmd.prefix_ids.shape)}, not ({p},)")
    if cmd.export is not None and not 0 <= cmd.export[0] <= cmd.export[1] <= ids.numel():
        raise ValueError(f"export rows {cmd.export} outside the {ids.numel()} computed tokens")
    if bs != kv.block_size:
        raise ValueError(f"block_size {bs} differs from the KV store's {kv.block_size}")
    if p < 0 or p % bs:
        raise ValueError(f"prefix_len {p} is not a non-negative multiple of {bs}")
    if len(cmd.prefix_slots) != c or len(cmd.write) != c:
        raise ValueError(f"prefix_slots and write must have one entry per rank ({c})")
    end_depth = (p + ids.numel()) // bs  # full blocks of the whole sequence
    for r in range(c):
        if len(cmd.prefix_slots[r]) != len(range(r, p // bs, c)):
            raise ValueError(f"CP rank {r}: prefix slots do not match its share of the prefix")
        bad_depths = [d for d, _ in cmd.write[r] if d % c != r or not p // bs <= d < end_depth]
        if bad_depths:
            raise ValueError(f"CP rank {r}: cannot store blocks at depths {bad_depths}")
        slots = [*cmd.prefix_slots[r], *(s for _, s in cmd.write[r])]
        bad = [s for s in slots if not 0 <= s < kv.num_blocks]
        if bad:
            raise IndexError(f"CP rank {r}: KV slots {bad} out of range [0, {kv.num_blocks})")
