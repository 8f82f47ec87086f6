"""Step 4: the host link, as the host KV tier and a KV hand-off use it.

The tier's both ways are ``runtime.host_link.measure_host_link`` itself (whole KV
blocks of the model, block by block between the device's store and pinned host
memory, CUDA events; docs/gpu-profile.md, "Host link"). The hand-off's device to host
is measured beside it as a hand-off moves it: the K and V rows of one prompt, all
layers ([2, layers, tokens, KV heads, head dim]), brought to the host by the rank's
own ``HostStaging`` (a pinned buffer kept across prefills, ``non_blocking`` copies,
one event), timed by the wall clock around it; on CPU nothing moves (the rows are
in host memory already), so the dry run's figure only shows the code ran. The
tier's figures also go into the measured profile's ``host_link``, when step 3 wrote
one.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.engine.host_copy import HostStaging
from vertumnus.engine.weights import resolve_dtype
from vertumnus.perfmodel import Profile
from vertumnus.runtime.host_link import measure_host_link


def handoff_d2h(
    cfg: ModelConfig, device: torch.device, tokens: int, repeats: int
) -> dict[str, Any]:
    """The rank's own staging (``engine.host_copy.HostStaging``: one pinned buffer,
    kept; ``non_blocking`` copies; one event waited on), timed by the wall clock
    around ``fetch`` after the device is idle: what a rank's answer waits for."""
    dtype = resolve_dtype("auto", device)
    shape = (2, cfg.num_hidden_layers, tokens, cfg.num_key_value_heads, cfg.head_dim)
    rows = torch.ones(shape, dtype=dtype, device=device)
    staging = HostStaging(device)

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (host,) = staging.fetch([rows])
        elapsed = time.perf_counter() - start
        assert host is not None and host.shape == rows.shape and host.device.type == "cpu"
        return elapsed

    once()  # untimed: the staging buffer's allocation and pinning, lazy CUDA set-up
    times = [once() for _ in range(repeats)]
    nbytes = rows.numel() * rows.element_size()
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "dtype": str(dtype).removeprefix("torch."),
        "times_s": times,
        "d2h_bytes_s": nbytes / max(statistics.median(times), 1e-9),
    }


def run(
    cfg: ModelConfig,
    device: torch.device,
    block: int,
    total_bytes: int,
    repeats: int,
    handoff_tokens: int,
    profile_path: str | None,
) -> dict[str, Any]:
    """Step 4's record (``profile_path``: step 3's file, which gets the tier's figures)."""
    engine = EngineConfig(block_size=block, device=device.type)
    tier = measure_host_link(
        cfg,
        engine,
        device,
        total_bytes=total_bytes,
        repeats=repeats,
        by="`tools/device_check.sh`",
    )
    record: dict[str, Any] = {
        "model": cfg.name,
        "layers": cfg.num_hidden_layers,
        "block_size": block,
        "tier": tier,
        "handoff": handoff_d2h(cfg, device, handoff_tokens, repeats),
    }
    if profile_path is not None and Path(profile_path).is_file():
        profile = Profile.load(profile_path)
        profile.host_link = dict(tier)
        profile.save(profile_path)
        record["written_into"] = profile_path
    return record
