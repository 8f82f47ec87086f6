"""What every step of the device check shares: the device and its bf16 peak, timing
that waits for the device, a guarded step, and the engine's C = 1 prefill on one
paged KV store.

Owns the peak table (dense bf16 FLOP/s by device name), ``timed`` (synchronise,
wall clock, synchronise: the time a caller waits, host overheads included, as a
prefill's client sees it), ``run_step`` (a step's status, seconds and error, never
an exception out of it) and ``EngineRunner`` (plan with the worker's cache index,
run ``prefill_rank`` on ``SoloComm``, commit), which the exactness and speed steps
both use, so that they time and check the same call.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from vertumnus.engine.comm import SoloComm
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.model import CausalLM
from vertumnus.engine.zigzag import RankPrefill, prefill_rank
from vertumnus.policy.cache.index import BlockAllocation, WorkerCacheIndex
from vertumnus.runtime.prefill import plan_prefill

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from NVIDIA's datasheets; the
# first entry whose every word occurs in the device name wins (PCIe before plain H100).
PEAK_BF16: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 989.4e12),
    (("H100", "PCIe"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H100",), 989.4e12),  # SXM (HBM3)
    (("A100",), 312e12),
)
# The dry run's peak: a round figure, so that the MFU arithmetic runs; meaningless.
NOMINAL_PEAK = 1e12


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from vertumnus.runtime.host_link import hardware_name

    return hardware_name("cpu")


def peak_flops(name: str, override_tflops: float | None, nominal: bool) -> dict[str, Any]:
    """``{"flops_s", "source", "nominal"}``: the override, the table's entry, the
    nominal figure of a dry run, or None for a device the table lacks."""
    if override_tflops is not None:
        return {"flops_s": override_tflops * 1e12, "source": "--peak-tflops", "nominal": False}
    if nominal:
        return {"flops_s": NOMINAL_PEAK, "source": "nominal (dry run)", "nominal": True}
    lowered = name.lower()
    for words, flops in PEAK_BF16:
        if all(w.lower() in lowered for w in words):
            return {"flops_s": flops, "source": f"table: {' '.join(words)}", "nominal": False}
    return {"flops_s": None, "source": f"{name!r} not in the table: pass --peak-tflops"}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds from a quiet device to ``fn``'s work done on it."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def release(device: torch.device) -> None:
    """Return freed memory (between steps, after an out-of-memory error)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:600]}"


def run_step(
    steps: dict[str, Any], name: str, device: torch.device, body: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Run one step; record ``status`` ("ok" or "error"), ``seconds`` and its figures
    (or its error and the traceback's last lines) under ``steps[name]``."""
    print(f"[device-check] step {name} ...", flush=True)
    start = time.perf_counter()
    try:
        record = {"status": "ok", **body()}
    except Exception as exc:  # a failing step is recorded; the next ones still run
        tail = traceback.format_exc().strip().splitlines()[-8:]
        record = {"status": "error", "error": error_text(exc), "traceback": tail}
    record["seconds"] = round(time.perf_counter() - start, 3)
    steps[name] = record
    release(device)
    print(f"[device-check] step {name}: {record['status']} in {record['seconds']} s", flush=True)
    return record


@dataclass
class EngineRunner:
    """The engine's C = 1 prefill of ``model`` on one paged store of ``capacity``
    tokens; each ``fresh_index`` is an empty worker cache over that store."""

    model: CausalLM
    block_size: int
    capacity_tokens: int

    def __post_init__(self) -> None:
        self.blocks = -(-self.capacity_tokens // self.block_size) + 1
        cfg, dev = self.model.config, self.model.device
        self.store = PagedKVStore(cfg, self.blocks, self.block_size, self.model.dtype, dev)

    def fresh_index(self) -> WorkerCacheIndex:
        return WorkerCacheIndex(1, self.blocks)

    def plan(
        self, index: WorkerCacheIndex, tokens: Sequence[int], logits: str
    ) -> tuple[BlockAllocation, RankPrefill]:
        allocation, cmd = plan_prefill(index, list(tokens), self.block_size, 0, (0,), logits=logits)
        step = cmd.for_rank(0)
        return allocation, replace(step, token_ids=step.token_ids.to(self.model.device))

    def run(self, step: RankPrefill, logits: str) -> Tensor:
        out = prefill_rank(self.model, SoloComm(), self.store, step, logits=logits)
        assert out is not None, "rank 0 of a degree-1 worker returns logits"
        return out

    def prefill(
        self, index: WorkerCacheIndex, tokens: Sequence[int], logits: str = "all"
    ) -> tuple[Tensor, int]:
        """Plan, run, commit: (logits of the computed rows, cached prefix tokens)."""
        allocation, step = self.plan(index, tokens, logits)
        try:
            out = self.run(step, logits)
        except BaseException:
            index.abort(allocation)
            raise
        index.commit(allocation)
        return out, step.prefix_len
