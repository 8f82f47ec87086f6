"""Step 2: the C = 1 prefill of a Qwen3-30B-A3B-shaped model with random bf16 weights,
timed on the device, against transformers on the same tensors and the shipped
profile's prediction.

The weights are drawn on the device, in bf16, by a seeded generator there
(``random_model(dtype=, device=)``): no fp32 copy, on the host or the device. The
layers are as many as fit (``model_math.fit_layers``; 48, Qwen3-30B-A3B's, on an
H100 or H200). For each length: one warm-up of each side, then ``repeats`` timed
runs of each, interleaved in alternating order; a run is timed from a quiet device
to its work done (``common.timed``). The engine runs ``prefill_rank`` (C = 1, the
logits of the last token, the new blocks written to its paged store) on an empty
cache, planned outside the timer; transformers runs one forward with
``logits_to_keep=1``, no cache, SDPA attention and its default experts kernel. A
transformers out-of-memory error or a warm-up past ``slow_s`` is recorded (and ends
its runs at longer lengths); so is any engine error at one length. The prefix-cached
points time the engine alone: the prefix is prefilled untimed, then the whole
prompt. Every timed point carries its FLOPs, its MFU and the shipped profile's
E_1(R, P).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tools.device import hf_twin, model_math
from tools.device.common import EngineRunner, error_text, is_oom, release, timed
from vertumnus.config import ModelConfig
from vertumnus.engine.weights import random_model
from vertumnus.perfmodel import Profile

SHIPPED_PROFILE = "qwen3-30b-a3b-h100"


def _summary(times: list[float], flops: float, peak: float | None, tokens: int) -> dict[str, Any]:
    median = statistics.median(times)
    return {
        "times_s": times,
        "median_s": median,
        "tokens_s": tokens / median,
        "tflops_s": flops / median / 1e12,
        "mfu": None if peak is None else flops / (median * peak),
    }


class SpeedRun:
    """One model on the device, its engine runner and transformers' twin."""

    def __init__(
        self, cfg: ModelConfig, device: torch.device, block: int, capacity: int, seed: int
    ) -> None:
        start = time.perf_counter()
        self.cfg, self.device = cfg, device
        self.model = random_model(cfg, seed, dtype=torch.bfloat16, device=device).eval()
        self.build_s = time.perf_counter() - start
        self.runner = EngineRunner(self.model, block, capacity)
        self.hf = hf_twin.twin(self.model)
        self.hf_state = "ok"  # "oom" / "too_slow" after a failure: no longer lengths
        self.hf_fallback: str | None = None  # why the default experts kernel was dropped
        self.gen = torch.Generator().manual_seed(seed + 1)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.cfg.vocab_size, (n,), generator=self.gen).tolist()

    def engine_once(self, tokens: Sequence[int], prefix: int) -> float:
        index = self.runner.fresh_index()
        if prefix:
            self.runner.prefill(index, tokens[:prefix], logits="last")
        lease, step = self.runner.plan(index, tokens, "last")
        if step.prefix_len != prefix:
            raise RuntimeError(f"reused {step.prefix_len} cached tokens, not {prefix}")
        seconds = timed(lambda: self.runner.run(step, "last"), self.device)
        index.commit(lease)
        return seconds

    def hf_once(self, tokens: Sequence[int]) -> float:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)

        def forward() -> None:
            with torch.inference_mode():
                self.hf(input_ids=ids, use_cache=False, logits_to_keep=1)

        return timed(forward, self.device)

    def hf_warmup(self, tokens: Sequence[int]) -> float:
        """The first call; where transformers' default experts kernel fails (not for
        memory), its plain loop ("eager") instead, and the switch recorded."""
        try:
            return self.hf_once(tokens)
        except Exception as exc:
            fixed = not hasattr(self.hf, "set_experts_implementation")  # transformers 4.x
            if is_oom(exc) or fixed or hf_twin.experts_implementation(self.hf) == "eager":
                raise
            self.hf_fallback = error_text(exc)
            release(self.device)
            self.hf.set_experts_implementation("eager")
            return self.hf_once(tokens)


def measure_length(
    run: SpeedRun, n: int, repeats: int, slow_s: float, peak: float | None
) -> dict[str, Any]:
    tokens = run.tokens(n)
    flops = model_math.prefill_flops(run.cfg, n)
    record: dict[str, Any] = {"tokens": n, "prefix": 0, "flops": flops}
    engine: list[float] = []
    theirs: list[float] = []
    hf = {"status": run.hf_state}
    try:
        record["engine_warmup_s"] = run.engine_once(tokens, 0)
    except Exception as exc:
        release(run.device)
        return {**record, "engine": {"status": "error", "error": error_text(exc)}}
    if run.hf_state == "ok":
        try:
            hf["warmup_s"] = run.hf_warmup(tokens)
            if hf["warmup_s"] > slow_s:
                hf["status"] = run.hf_state = "too_slow"
        except Exception as exc:
            release(run.device)
            hf = {"status": "oom" if is_oom(exc) else "error", "error": error_text(exc)}
            run.hf_state = hf["status"]
    else:
        hf["note"] = "not run: transformers failed or was too slow at a shorter length"
    sides: list[tuple[Callable[[], float], list[float]]] = [
        (lambda: run.engine_once(tokens, 0), engine)
    ]
    if hf["status"] == "ok":
        sides.append((lambda: run.hf_once(tokens), theirs))
    try:
        for i in range(repeats):
            for once, out in sides if i % 2 == 0 else sides[::-1]:
                out.append(once())
    except Exception as exc:  # recorded; the runs that finished still count
        release(run.device)
        record["repeat_error"] = error_text(exc)
        if hf["status"] == "ok" and not theirs:
            hf = {"status": "oom" if is_oom(exc) else "error", "error": record["repeat_error"]}
    if not engine:
        record["engine"] = {"status": "error", "error": record["repeat_error"]}
    else:
        record["engine"] = {"status": "ok", **_summary(engine, flops["total"], peak, n)}
    if theirs and engine:
        hf.update(_summary(theirs, flops["total"], peak, n))
        record["engine_speedup"] = hf["median_s"] / record["engine"]["median_s"]
    record["transformers"] = {**hf, "experts": hf_twin.experts_implementation(run.hf)}
    return record


def measure_prefix(
    run: SpeedRun, r: int, p: int, repeats: int, peak: float | None
) -> dict[str, Any]:
    tokens = run.tokens(p + r)
    flops = model_math.prefill_flops(run.cfg, r, p)
    record: dict[str, Any] = {"tokens": r, "prefix": p, "flops": flops}
    try:
        run.engine_once(tokens, p)  # warm-up
        times = [run.engine_once(tokens, p) for _ in range(repeats)]
    except Exception as exc:
        release(run.device)
        return {**record, "engine": {"status": "error", "error": error_text(exc)}}
    return {**record, "engine": {"status": "ok", **_summary(times, flops["total"], peak, r)}}


def run(
    cfg: ModelConfig,
    device: torch.device,
    lengths: Sequence[int],
    prefix_points: Sequence[tuple[int, int]],
    block: int,
    repeats: int,
    peak: dict[str, Any],
    deadline: float,
    slow_s: float,
    full_shape: bool,
    seed: int = 0,
) -> dict[str, Any]:
    """Step 2's record. ``full_shape``: ``cfg`` is the shipped profile's model (its
    E_1 is comparable, given all its layers fit); ``deadline``: time.monotonic() after
    which no further point starts."""
    capacity = max([*lengths, *(r + p for r, p in prefix_points)])
    free = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        free = torch.cuda.mem_get_info(device)[0]
    cfg, memory = model_math.fit_layers(cfg, free, max(lengths), capacity, block, 2)
    speed = SpeedRun(cfg, device, block, capacity, seed)
    profile = Profile.load(SHIPPED_PROFILE)
    comparable = full_shape and not memory["reduced"]
    rate = peak["flops_s"]
    points: list[dict[str, Any]] = []
    for r, p in [*((n, 0) for n in lengths), *prefix_points]:
        if time.monotonic() > deadline:
            points.append({"tokens": r, "prefix": p, "engine": {"status": "skipped: time budget"}})
            continue
        print(f"[device-check]   prefill R={r} P={p}", flush=True)
        if p:
            point = measure_prefix(speed, r, p, repeats, rate)
        else:
            point = measure_length(speed, r, repeats, slow_s, rate)
        point["profile_e1_s"] = profile.predict(1, r, p)
        if point["engine"]["status"] == "ok":
            point["measured_over_profile"] = point["engine"]["median_s"] / point["profile_e1_s"]
        points.append(point)
    record: dict[str, Any] = {
        "model": {
            "name": cfg.name,
            "layers": cfg.num_hidden_layers,
            "params": model_math.param_count(cfg),
            "active_params_per_token": model_math.active_params_per_token(cfg),
            "dtype": "bfloat16",
            "build_s": speed.build_s,
            "weights_on": str(device),
        },
        "memory": memory,
        "block_size": block,
        "repeats": repeats,
        "peak": peak,
        "points": points,
        "profile": SHIPPED_PROFILE,
        "profile_comparable": comparable,
        "transformers_experts": hf_twin.experts_implementation(speed.hf),
    }
    if speed.hf_fallback is not None:
        record["transformers_default_experts_failed"] = speed.hf_fallback
    if device.type == "cuda":
        record["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    if not comparable:
        record["profile_note"] = "E_1 is the shipped 48-layer profile's: not this model's"
    return record
