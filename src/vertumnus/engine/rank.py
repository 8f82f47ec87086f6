"""Main loop of one rank process.

Owns everything a rank holds: its device, the model weights, its paged KV store and
the ``torch.distributed`` process groups of every worker it can belong to (created
once at start-up, so a lattice split or merge only switches which group is used).
It executes commands in arrival order and answers each on its answer pipe. It does
not decide anything: placement, cache slots and worker membership come in commands.

Life: connect to the coordinator's TCP store -> form the group of every worker this
rank can belong to (NCCL on CUDA, gloo on CPU) -> build the model and KV store ->
send ``RankReady`` -> loop until ``Shutdown``.

Groups are built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) over a store
prefix named by the group's ranks and *generation*, not from a default group of the
whole pool: when a rank dies and is restarted, its peers form the groups they share
with it anew at the next generation (``RebuildGroups``), and nothing else changes.
A KV copy (``KVTransfer``) moves blocks rank to rank, never through the coordinator
(``engine/kv_transfer.py``).
"""

from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch

# torch.distributed re-exports TCPStore from torch._C without listing it in __all__.
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.engine.attention import pick_cpu_kernel
from vertumnus.engine.comm import Communicator, DistComm, SoloComm, make_group, worker_group_name
from vertumnus.engine.fused import prepare_layers
from vertumnus.engine.host_copy import HostStaging, StepTimer, keep_freed_host_memory
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
    RankReady,
    RebuildGroups,
    Shutdown,
    SwitchEpoch,
)
from vertumnus.engine.model import CausalLM
from vertumnus.engine.shared_rows import Attached
from vertumnus.engine.weights import build_model, resolve_dtype
from vertumnus.engine.zigzag import RankPrefill, prefill_rank


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to start; the same for every rank of a pool."""

    model: ModelConfig
    model_dir: str | None  # None: seeded random weights of a preset
    engine: EngineConfig
    world_size: int
    worker_groups: tuple[tuple[int, ...], ...]  # every multi-rank worker the lattice can form
    store_host: str
    store_port: int
    # Generation of each group (absent: 0); a restarted rank joins the current ones.
    group_generations: tuple[tuple[tuple[int, ...], int], ...] = ()
    local_ranks: int | None = None  # ranks on this host (None: world_size), for threads
    # Per rank, the shared-memory segment its KV store lives in (None, or past the
    # end: its own memory); made by the coordinator (``runtime/kv/segments.py``).
    kv_segments: tuple[str | None, ...] = ()


def runs_on_cpu(engine: EngineConfig) -> bool:
    """The ranks of ``engine`` compute on the CPU (``device`` cpu, or auto without CUDA)."""
    return engine.device == "cpu" or (engine.device == "auto" and not torch.cuda.is_available())


def resolve_device(engine: EngineConfig, rank: int) -> torch.device:
    if runs_on_cpu(engine):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device = 'cuda' was asked for, but CUDA is not available")
    return torch.device("cuda", rank % torch.cuda.device_count())


def cpu_threads(engine: EngineConfig, local_ranks: int) -> int:
    """Intra-op threads of one CPU rank: ``threads_per_rank``, else this host's cores
    shared among its ``local_ranks`` ranks."""
    return engine.threads_per_rank or max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def settle_cpu_attention(
    model: ModelConfig, engine: EngineConfig, local_ranks: int
) -> tuple[EngineConfig, dict[int, dict[str, float]]]:
    """``engine`` with ``cpu_attention = "auto"`` replaced by the kernel this host's CPU
    ranks are to run, and the timings that chose it (``pick_cpu_kernel`` with one
    rank's threads). ``ChildRanks`` settles it before the ranks start, so all run the
    same kernel and none is timed while others compile; an agent-started rank of a
    multi-host pool settles it itself. Unchanged where there is nothing to decide (a
    kernel named, a GPU)."""
    if engine.cpu_attention != "auto" or not runs_on_cpu(engine):  # (no GPU: ranks say so)
        return engine, {}
    dtype = resolve_dtype(engine.dtype, torch.device("cpu"))
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_threads(engine, local_ranks))
    try:
        choice, timed = pick_cpu_kernel("auto", heads, kv_heads, model.head_dim, dtype)
    finally:
        torch.set_num_threads(before)
    return replace(engine, cpu_attention=choice), timed


def rank_main(rank: int, spec: RankSpec, commands: Any, results: Any) -> None:
    """Entry point of a spawned rank process (``commands``: the read end of its
    one-way command pipe; ``results``: the write end of its one-way answer pipe).

    SIGINT and SIGTERM are ignored: a Ctrl-C or a SIGTERM to the whole process group
    reaches the coordinator, which finishes what runs and then sends ``Shutdown``. A
    rank whose coordinator is gone (its parent changed) exits by itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        device = resolve_device(spec.engine, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(cpu_threads(spec.engine, spec.local_ranks or spec.world_size))
            keep_freed_host_memory()
        timeout = timedelta(seconds=spec.engine.rank_timeout_s)
        store = TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        generation = dict(spec.group_generations)
        # Every rank forms its groups in the same order: rendezvous cannot deadlock.
        groups: dict[tuple[int, ...], Any] = {}
        for ranks in spec.worker_groups:
            if rank in ranks:
                name = worker_group_name(ranks, generation.get(ranks, 0))
                groups[ranks] = make_group(store, name, ranks, rank, device, timeout)
        dtype = resolve_dtype(spec.engine.dtype, device)
        model = build_model(spec.model, spec.model_dir, spec.engine.seed, dtype, device)
        segment = spec.kv_segments[rank] if rank < len(spec.kv_segments) else None
        blocks, block_size = spec.engine.kv_blocks_per_rank, spec.engine.block_size
        kv = PagedKVStore(spec.model, blocks, block_size, dtype, device, segment)
        why = prepare_layers(model, spec.engine.compile, lambda: _warm_up(model, block_size))
        attention = _pick_attention(model, spec.engine, spec.local_ranks or spec.world_size)
    except Exception as exc:
        results.send(RankFailed(rank, None, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    ready = RankReady(rank, str(device), kv.nbytes, model.layer_fns.name, why, attention)
    results.send(ready)
    _serve(rank, model, kv, groups, commands, results, store, device, timeout)


def _warm_up(model: CausalLM, block_size: int) -> None:
    """One short prefill on this rank alone, no cache: compiles the layers (dynamic in
    the number of tokens, so every later length reuses the same code). 38 tokens: a
    length no model dimension is likely to equal, which would tie the two in the
    compiled code's guards and cost a recompile at the first other length."""
    ids = torch.arange(38, device=model.device) % model.config.vocab_size
    prefill_rank(model, SoloComm(), None, RankPrefill(ids, 0, (), (), block_size))
    model.reset_expert_tokens()


def _pick_attention(model: CausalLM, engine: EngineConfig, local_ranks: int) -> str:
    """A CPU rank's attention kernel family, set on the model: the one ``engine`` names
    (the coordinator settled "auto" before starting this rank), else timed here, as an
    agent-started rank does (``settle_cpu_attention``); "cuda" on a GPU, whose kernel
    is chosen per call."""
    if model.device.type != "cpu":
        return "cuda"
    model.cpu_attention = settle_cpu_attention(model.config, engine, local_ranks)[0].cpu_attention
    return model.cpu_attention


def _serve(
    rank: int,
    model: Any,
    kv: PagedKVStore,
    groups: dict[tuple[int, ...], Any],
    commands: Any,
    results: Any,
    store: Any,
    device: torch.device,
    timeout: timedelta,
) -> None:
    parent = os.getppid()
    pairs = PairGroups(store, rank, device, timeout)  # of the KV copies
    attached = Attached()  # shared memory of hand-off reads
    staging = HostStaging(device)  # a prefill's outputs on their way to the host
    while True:
        try:
            if not commands.poll(1.0):
                if os.getppid() != parent:  # the fork server went: the coordinator died
                    return
                continue
            msg = commands.recv()
        except (EOFError, OSError):  # the coordinator closed its end
            return
        match msg:
            case Shutdown():
                return
            case PrefillCommand():
                results.send(_run(rank, model, kv, groups, msg, staging))
            case KVTransfer():

                def transfer(m: KVTransfer = msg) -> KVWritten:
                    check_transfer(rank, m, kv)
                    run_transfer(rank, kv, m, lambda peer: pairs.get(peer, m.incarnations))
                    return KVWritten(m.copy_id, rank)

                _answer(results, rank, transfer, "KVTransfer", msg.copy_id)
            case KVRead():

                def read(m: KVRead = msg) -> KVData:
                    if m.shm is None:
                        return KVData(m.read_id, rank, kv.rows(m.slots).cpu())
                    shape = (2, kv.k.shape[1], m.rows, *kv.k.shape[3:])
                    kv.rows_into(m.slots, attached.view(m.shm, kv.k.dtype, shape), m.rows_at)
                    return KVData(m.read_id, rank, None)

                _answer(results, rank, read, "KVRead", read_id=msg.read_id)
            case KVSend():

                def send(m: KVSend = msg) -> KVData:
                    wait = timedelta(seconds=m.timeout_s)
                    peer = TCPStore(m.store_host, m.store_port, is_master=False, timeout=wait)
                    group = make_group(peer, m.name, (0, 1), 1, device, wait)
                    group.send([kv.rows(m.slots).contiguous()], 0, 0).wait()
                    return KVData(m.read_id, rank, None)

                _answer(results, rank, send, "KVSend", read_id=msg.read_id)
            case RebuildGroups():

                def rebuild(m: RebuildGroups = msg) -> GroupsReady:
                    for ranks, generation in m.groups:
                        if rank in ranks:
                            name = worker_group_name(ranks, generation)
                            groups[ranks] = make_group(store, name, ranks, rank, device, timeout)
                    return GroupsReady(rank, m.token)

                _answer(results, rank, rebuild, "RebuildGroups")
            case SwitchEpoch():
                # The groups exist since start-up: adopting an epoch only checks that
                # this rank belongs to the worker and can reach its group.
                if rank not in msg.worker_ranks or (
                    len(msg.worker_ranks) > 1 and msg.worker_ranks not in groups
                ):
                    error = f"no process group for worker ranks {msg.worker_ranks}"
                    results.send(RankFailed(rank, None, error, ""))
                else:
                    results.send(EpochAck(rank, msg.epoch))
            case _:
                results.send(RankFailed(rank, None, f"unknown command {type(msg).__name__}", ""))


def _answer(
    results: Any,
    rank: int,
    make: Any,
    what: str,
    copy_id: int | None = None,
    read_id: int | None = None,
) -> None:
    """Send ``make()``, or a ``RankFailed`` naming ``what`` if it raises."""
    try:
        answer = make()
    except Exception as exc:
        error = f"{what}: {type(exc).__name__}: {exc}"
        answer = RankFailed(rank, None, error, traceback.format_exc(), copy_id, read_id)
    results.send(answer)


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
