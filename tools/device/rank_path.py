"""Step 5: the serving path's rank process on the device.

A ``ChildRanks`` of one rank (what ``serve`` spawns: the device chosen by
``resolve_device``, the model built there, its paged KV store) runs the tiny
preset's prefill twice through ``PrefillClient``: a fresh prompt, then one that
reuses its first blocks from the rank's store. The logits come back through the
rank's ``HostStaging`` (pinned buffer, asynchronous copies on CUDA) and its compute
time from ``StepTimer`` (CUDA events); they are compared, in fp32, with the same
seeded model's prefill in this process (within 1e-4). The rank's compute time and
the client's time around it are recorded.
"""

from __future__ import annotations

from typing import Any

import torch

from vertumnus.config import PRESETS, EngineConfig
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.weights import random_model
from vertumnus.engine.zigzag import RankPrefill, prefill_rank
from vertumnus.runtime.prefill import PrefillClient
from vertumnus.runtime.ranks import ChildRanks

ATOL = 1e-4
BLOCK = 16


def run(device: torch.device, tokens: int = 300, seed: int = 0) -> dict[str, Any]:
    cfg = PRESETS["tiny"]
    engine = EngineConfig(
        block_size=BLOCK,
        kv_blocks_per_rank=64,
        device=device.type,
        dtype="float32",
        seed=seed,
        threads_per_rank=1,
    )
    gen = torch.Generator().manual_seed(seed)
    first, rest = torch.randint(0, cfg.vocab_size, (2, tokens), generator=gen).tolist()
    second = first[: tokens // 2] + rest
    with ChildRanks(cfg, None, engine, world_size=1, degrees=(1,)) as pool:
        client = PrefillClient(pool, (0,))
        outs = [client.prefill(t, logits="all") for t in (first, second)]
    model = random_model(cfg, seed).to(device).eval()
    runs = []
    for prompt, out in zip((first, second), outs, strict=True):
        # The reference recomputes the whole prompt; its rows after the cached prefix.
        full = torch.tensor(prompt, dtype=torch.long, device=device)
        ref = prefill_rank(model, SoloComm(), None, RankPrefill(full, 0, (), (), BLOCK), "all")
        assert ref is not None and out.logits.shape[0] == len(prompt) - out.cached_tokens
        diff = float((out.logits - ref[out.cached_tokens :].cpu()).abs().max())
        runs.append(
            {
                "tokens": len(prompt),
                "cached_tokens": out.cached_tokens,
                "max_abs_diff": diff,
                "passed": diff <= ATOL,
                "rank_compute_s": max(out.rank_compute_s),
                "client_s": out.prefill_s,
            }
        )
    if runs[1]["cached_tokens"] == 0:
        raise AssertionError("the second prompt reused nothing from the rank's store")
    return {"model": cfg.name, "dtype": "float32", "tolerance": ATOL, "runs": runs}
