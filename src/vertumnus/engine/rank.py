"""Starting one rank, and the main loop of a rank process.

Owns a rank's start (``open_rank``): its device, the model weights, its paged KV
store and the ``torch.distributed`` process groups of every worker it can belong to
(created once at start-up, so a lattice split or merge only switches which group is
used); and ``rank_main``, a local rank process that reads commands from its pipe in
arrival order and answers each on its answer pipe (``RankState.handle`` in
``engine/rank_state.py`` executes them; a Ray actor drives the same two). It does
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
from vertumnus.engine.comm import SoloComm, make_group, worker_group_name
from vertumnus.engine.dsv4.model import DeepseekV4LM
from vertumnus.engine.fused import prepare_layers
from vertumnus.engine.host_copy import keep_freed_host_memory
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.messages import RankFailed, RankReady
from vertumnus.engine.model import CausalLM
from vertumnus.engine.rank_state import RankState
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
    same kernel and none is timed while others compile; a rank of a multi-host pool
    (a Ray actor) settles it itself. Unchanged where there is nothing to decide (a
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


def open_rank(rank: int, spec: RankSpec) -> tuple[RankState, RankReady]:
    """Start rank ``rank`` of the pool ``spec`` describes, in this process: its device,
    the groups of every worker it can belong to, the model and its KV store. Returns
    the started rank and its readiness; raises what failed."""
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
    if isinstance(model, DeepseekV4LM):  # its own kernels, eager (engine/dsv4)
        why, attention = "DeepSeek-V4 runs eager", "dsv4"
    else:
        why = prepare_layers(model, spec.engine.compile, lambda: _warm_up(model, block_size))
        attention = _pick_attention(model, spec.engine, spec.local_ranks or spec.world_size)
    ready = RankReady(rank, str(device), kv.nbytes, model.layer_fns.name, why, attention)
    return RankState(rank, model, kv, groups, store, device, timeout), ready


def rank_main(rank: int, spec: RankSpec, commands: Any, results: Any) -> None:
    """Entry point of a spawned rank process (``commands``: the read end of its
    one-way command pipe; ``results``: the write end of its one-way answer pipe).

    SIGINT and SIGTERM are ignored: a Ctrl-C or a SIGTERM to the whole process group
    reaches the coordinator, which finishes what runs and then sends ``Shutdown``. A
    rank whose coordinator is gone (its parent changed) exits by itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        state, ready = open_rank(rank, spec)
    except Exception as exc:
        results.send(RankFailed(rank, None, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    results.send(ready)
    parent = os.getppid()
    while True:
        try:
            if not commands.poll(1.0):
                if os.getppid() != parent:  # the fork server went: the coordinator died
                    return
                continue
            msg = commands.recv()
        except (EOFError, OSError):  # the coordinator closed its end
            return
        answer = state.handle(msg)
        if answer is None:  # Shutdown
            return
        results.send(answer)


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
    (the coordinator settled "auto" before starting this rank), else timed here, as a
    rank of a multi-host pool does (``settle_cpu_attention``); "cuda" on a GPU, whose
    kernel is chosen per call."""
    if model.device.type != "cpu":
        return "cuda"
    model.cpu_attention = settle_cpu_attention(model.config, engine, local_ranks)[0].cpu_attention
    return model.cpu_attention
