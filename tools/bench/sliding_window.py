"""Sliding-window prefill benchmark: what a window layer moves under zigzag CP, and
what it costs at CP 1 against the window's attention cost alone.

A Mistral-shaped random model (hidden 512, 8 query heads on 4 KV heads of 64, 4
layers, every layer a sliding window of ``--window`` tokens; fp32 or bf16, CPU) and
one prompt of ``--tokens`` tokens, measured in one run:

(a) Moved K/V per rank, CP = 2 and 4 (ranks as threads, ``engine/comm.ThreadComm``,
    which counts what each rank receives): the halo exchange's rows per layer against
    the window (2 windows per rank, one per zigzag chunk) and against the whole
    sequence, which the full-attention all-gather delivers; once for a prefill that
    stores no blocks, once for one that stores every new block (a caching worker: a
    block lives on rank depth % C, so a rank also receives the rows of its blocks
    that other ranks computed). Counted, not timed.

(b) Time at CP 1 (one thread, median of ``--repeats``, alternating): the engine's
    windowed prefill (``prefill_rank``; ``attention.window_flash``) against the same
    model whose attention costs only the window's: each layer attends, with torch's
    fused kernel, causally within aligned blocks of 2 x ``window`` tokens, so a query
    sees ``window`` keys on average, as many as the window gives it (target ratio
    <= 1.2x). Also against blocks of ``window`` tokens (``window`` / 2 keys a query
    on average, half the window's work: a lower bound no windowed kernel reaches) and
    the same model with full causal attention, for what the window saves.

Run::

    .venv/bin/python -m tools.bench.sliding_window                 # 8192 tokens, window 1024
    .venv/bin/python -m tools.bench.sliding_window --tokens 4096 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from vertumnus.config import ModelConfig
from vertumnus.engine.comm import SoloComm, ThreadGroup
from vertumnus.engine.weights import random_model
from vertumnus.engine.zigzag import RankPrefill, prefill_rank


def model_config(window: int | None) -> ModelConfig:
    return ModelConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, rope_theta=10_000.0,
        max_position_embeddings=65_536, architecture="MistralForCausalLM", qk_norm=False,
        sliding_window=window, name="mistral-bench",
    )  # fmt: skip


def moved(cfg: ModelConfig, tokens: Tensor, c: int, stores: bool) -> list[int]:
    """K/V rows each rank of a degree-``c`` worker received per layer over one
    prefill; ``stores``: the worker stores every new block (each on rank depth % C)."""
    import threading

    model = random_model(cfg, 0)
    group = ThreadGroup(c)
    comms = [group.comm(r) for r in range(c)]
    blocks = tokens.numel() // 16
    writes = tuple(tuple(d for d in range(blocks) if stores and d % c == q) for q in range(c))
    # The exchange moves what ``peer_writes`` names; no store here to keep it.
    step = RankPrefill(tokens, 0, (), (), 16, peer_writes=writes)

    def run(r: int) -> None:
        prefill_rank(model, comms[r], None, step)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = 2 * cfg.num_key_value_heads * cfg.head_dim
    return [
        (comm.received["halo"] + comm.received["kv"]) // (row * cfg.num_hidden_layers)
        for comm in comms
    ]


def blockwise(window: int):  # type: ignore[no-untyped-def]
    """Attention within aligned blocks of ``window`` tokens, causal, fused kernel:
    ``window`` / 2 keys a query on average."""

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, *_: object) -> Tensor:
        t = q.shape[0]
        out = torch.empty_like(q)
        for lo in range(0, t, window):
            hi = min(t, lo + window)
            qh, kh, vh = (x[lo:hi].transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
            out[lo:hi] = o[0].transpose(0, 1)
        return out

    return attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    tokens = torch.randint(0, 4096, (args.tokens,), generator=torch.Generator().manual_seed(0))
    cfg = model_config(args.window)
    print(f"tokens {args.tokens}, window {args.window}, {args.dtype}")
    for c in (2, 4):
        gathered = (c - 1) * 2 * -(-args.tokens // (2 * c))
        for stores in (False, True):
            rows = moved(cfg, tokens, c, stores)
            print(
                f"(a) C={c}, {'storing every block' if stores else 'storing none'}: K/V "
                f"rows received per rank per layer {rows} (max {max(rows)}); two "
                f"windows {2 * (args.window - 1)}; an all-gather {gathered}; the "
                f"sequence {args.tokens}"
            )
    windowed = random_model(cfg, 0).to(dtype).eval()
    full = random_model(model_config(None), 0).to(dtype).eval()
    positions = torch.arange(args.tokens)
    step = RankPrefill(tokens, 0, (), (), 16)
    runs = {
        "windowed (engine)": lambda: prefill_rank(windowed, SoloComm(), None, step),
        "window's cost (2w blocks)": lambda: full(tokens, positions, blockwise(2 * args.window)),
        "half the window (w blocks)": lambda: full(tokens, positions, blockwise(args.window)),
        "full causal (engine)": lambda: prefill_rank(full, SoloComm(), None, step),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(args.repeats + 1):
            for name, run in runs.items():
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)
    median = {name: statistics.median(ts[1:]) for name, ts in times.items()}
    for name, t in median.items():
        print(f"(b) {name}: {t * 1e3:.1f} ms")
    ours = median["windowed (engine)"]
    ratio = ours / median["window's cost (2w blocks)"]
    print(f"(b) ratio windowed / the window's cost: {ratio:.2f}x (target <= 1.2x)")
    half = ours / median["half the window (w blocks)"]
    print(f"(b) ratio windowed / half the window's work (a lower bound): {half:.2f}x")


if __name__ == "__main__":
    main()
