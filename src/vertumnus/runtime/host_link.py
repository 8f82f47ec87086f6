"""Measure the host link that the host KV tier prices (``policy/cache/host_tier.py``).

``measure_host_link`` moves whole KV blocks of the model (at the ranks' KV dtype)
between a rank's KV store and the host tier's memory, block by block as the tier
does (K and V of all layers, scattered store slots to consecutive tier slots), and
returns a profile's ``host_link``: ``kv_bytes_per_token``, ``d2h_bytes_s`` (store to
tier, a demotion), ``h2d_bytes_s`` (tier to store, a load-back), ``source``. A
figure is the bytes of a pass over the median of ``repeats`` timed passes, after one
untimed pass each way. CPU: the store is a shared-memory segment laid out as a
rank's, the tier another one viewed as ``[blocks, 2, layers, block_size, Hkv, D]``,
copied in this process (as the coordinator copies), timed by the wall clock. CUDA:
the store on the device, the tier a pinned host tensor, ``non_blocking`` copies
timed by CUDA events.

``python -m vertumnus profile`` calls it once its ranks are closed (and names the
hardware it measured with ``hardware_name``, as the host link does); ``python -m
vertumnus.runtime.host_link`` prints it (``--into F.json``: sets F's host_link).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vertumnus.config import EngineConfig, ModelConfig, resolve_model
from vertumnus.engine.kv_store import store_shape, store_tensors
from vertumnus.engine.rank import resolve_device
from vertumnus.engine.weights import resolve_dtype

TOTAL_BYTES = 64 << 20  # moved per timed pass (whole blocks, at least MIN_BLOCKS)
MIN_BLOCKS = 8
REPEATS = 5

Shape = tuple[int, ...]
Move = Callable[[], None]
Times = tuple[list[float], list[float]]  # seconds per pass: (device to host, host to device)


def hardware_name(device: str) -> str:
    """What a profile and a host link record as the hardware of ``device``."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu-{platform.machine()}-{platform.processor() or 'unknown'}"


def measure_host_link(
    model: ModelConfig,
    engine: EngineConfig,
    device: str | torch.device | None = None,
    *,
    total_bytes: int = TOTAL_BYTES,
    repeats: int = REPEATS,
    by: str = "`profile`",
) -> dict[str, Any]:
    """The ``host_link`` of ``model``'s KV blocks (``engine``'s block size and dtype)
    on ``device`` (None: rank 0's device under ``engine``)."""
    if repeats < 1 or total_bytes < 1:
        raise ValueError("repeats and total_bytes must be >= 1")
    dev = resolve_device(engine, 0) if device is None else torch.device(device)
    dtype = resolve_dtype(engine.dtype, dev)
    per_token = model.kv_bytes(dtype.itemsize)
    block_bytes = per_token * engine.block_size
    blocks = max(MIN_BLOCKS, math.ceil(total_bytes / block_bytes))
    shape = (blocks, *store_shape(model, 1, engine.block_size)[1:])  # (any model's blocks)
    order = list(range(blocks))
    random.Random(0).shuffle(order)  # evicted blocks sit in scattered store slots
    if dev.type == "cuda":
        d2h, h2d = _cuda_passes(shape, dtype, dev, order, repeats)
    else:
        d2h, h2d = _cpu_passes(shape, dtype, order, repeats)
    moved = blocks * block_bytes
    when = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    return {
        "kv_bytes_per_token": per_token,
        "d2h_bytes_s": moved / statistics.median(d2h),
        "h2d_bytes_s": moved / statistics.median(h2d),
        "source": f"measured by {by} on {hardware_name(str(dev))}, {when}",
    }


def _moves(
    k: Tensor, v: Tensor, tier: Tensor, order: Sequence[int], non_blocking: bool
) -> tuple[Move, Move]:
    """(demote all, load all back): store slot ``order[i]`` <-> tier slot ``i``."""

    def d2h() -> None:
        for i, slot in enumerate(order):
            tier[i, 0].copy_(k[slot], non_blocking=non_blocking)
            tier[i, 1].copy_(v[slot], non_blocking=non_blocking)

    def h2d() -> None:
        for i, slot in enumerate(order):
            k[slot].copy_(tier[i, 0], non_blocking=non_blocking)
            v[slot].copy_(tier[i, 1], non_blocking=non_blocking)

    return d2h, h2d


def _cpu_passes(shape: Shape, dtype: torch.dtype, order: list[int], repeats: int) -> Times:
    size = 2 * math.prod(shape) * dtype.itemsize
    segments = [SharedMemory(create=True, size=size) for _ in range(2)]
    try:
        return _cpu_timed(segments, shape, dtype, order, repeats)
    finally:  # the views died with _cpu_timed's frame (unless it raised)
        for shm in segments:
            with contextlib.suppress(BufferError):
                shm.close()
            shm.unlink()


def _cpu_timed(
    segments: list[SharedMemory], shape: Shape, dtype: torch.dtype, order: list[int], repeats: int
) -> Times:
    store, host = (shm.buf for shm in segments)
    assert store is not None and host is not None
    k, v = store_tensors(store, shape, dtype)
    k.fill_(1.0)  # the store's pages are resident, as a rank's are
    v.fill_(1.0)
    tier = torch.frombuffer(host, dtype=dtype, count=2 * k.numel()).view(shape[0], 2, *shape[1:])
    d2h, h2d = _moves(k, v, tier, order, non_blocking=False)

    def timed(move: Move) -> float:
        start = time.perf_counter()
        move()
        return time.perf_counter() - start

    return _passes(d2h, h2d, timed, repeats)


def _cuda_passes(
    shape: Shape, dtype: torch.dtype, dev: torch.device, order: Sequence[int], repeats: int
) -> Times:
    with torch.cuda.device(dev):
        k = torch.ones(shape, dtype=dtype, device=dev)
        v = torch.ones(shape, dtype=dtype, device=dev)
        tier = torch.empty((shape[0], 2, *shape[1:]), dtype=dtype, pin_memory=True)
        d2h, h2d = _moves(k, v, tier, order, non_blocking=True)
        stream = torch.cuda.current_stream(dev)

        def timed(move: Move) -> float:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(stream)
            move()
            end.record(stream)
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3  # ms -> s

        torch.cuda.synchronize(dev)
        return _passes(d2h, h2d, timed, repeats)


def _passes(d2h: Move, h2d: Move, timed: Callable[[Move], float], repeats: int) -> Times:
    """One untimed pass each way, then ``repeats`` timed ones, interleaved."""
    timed(d2h)
    timed(h2d)
    out: Times = ([], [])
    for _ in range(repeats):
        out[0].append(timed(d2h))
        out[1].append(timed(h2d))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vertumnus.runtime.host_link",
        description="Measure the host link; print a profile's host_link object.",
    )
    p.add_argument("--model", default="tiny", help="preset or Hugging Face folder")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default=EngineConfig.dtype, help="KV dtype (auto: as the ranks)")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    p.add_argument("--total-mib", type=int, default=TOTAL_BYTES >> 20)
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--into", type=Path, metavar="F.json", help="set F's host_link (only)")
    args = p.parse_args(argv)
    cfg, _ = resolve_model(args.model)
    engine = EngineConfig(block_size=args.block_size, device=args.device, dtype=args.dtype)
    link = measure_host_link(
        cfg, engine, total_bytes=args.total_mib << 20, repeats=args.repeats, by=f"`{p.prog}`"
    )
    print(json.dumps(link, indent=2))
    if args.into is not None:
        raw = json.loads(args.into.read_text())
        raw["host_link"] = link
        args.into.write_text(json.dumps(raw, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
