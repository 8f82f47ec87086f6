"""Prefill throughput of the Qwen3-MoE engine against transformers, same weights.

    .venv/bin/python -m tools.bench.moe [--lengths 512,2048] [--repeats 3] [--threads 2]
        [--kernels auto|loop,grouped_mm] [--dtype float32|bfloat16]

The model is Qwen3-30B-A3B's layer shape cut to 2 layers (the ``qwen3-30b-a3b-2l``
preset: hidden 2048, 32 query and 4 KV heads of 128, 128 experts of 768, top 8,
vocabulary 151,936), with random weights. transformers' ``Qwen3MoeForCausalLM`` is
built first; the engine's model then takes the very same tensors (no copy). For each
length: one warm-up each, then ``--repeats`` timed prefills of each, interleaved in
alternating order, each guarded against other processes' load
(``harness.interleaved``). The engine runs its C = 1 path (``prefill_rank`` with the
KV written to a paged store); transformers runs one forward with ``logits_to_keep=1``
and no cache. ``--kernels`` times the engine once per experts' kernel named
(``engine/moe.py``: ``loop``, ``grouped_mm``; ``auto``, the default, is the engine's
own choice), each run interleaved with the others, and prints the ratio of the
second to the first; ``--dtype`` sets both models' weights and the KV store. Prints
tokens per second and the ratio to transformers, and the engine's expert load of the
last run; ``--json PATH`` writes the figures with the machine and source they were
measured on (``harness.py``).
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch
import transformers

from tools.bench import harness
from vertumnus.config import PRESETS
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.model import CausalLM, SparseMoeBlock
from vertumnus.engine.moe import KERNELS, Kernel
from vertumnus.engine.transformers_config import hf_config
from vertumnus.engine.zigzag import prefill_rank
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.runtime.prefill import plan_prefill

BLOCK = 16


def hf_model(cfg_name: str, dtype: torch.dtype) -> transformers.Qwen3MoeForCausalLM:
    c = PRESETS[cfg_name]
    hf_cfg = hf_config(c)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(hf_cfg).float().to(dtype).eval()


def engine_model(cfg_name: str, hf: transformers.Qwen3MoeForCausalLM) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(PRESETS[cfg_name])
    state = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not k.endswith("tokens_per_expert")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
    for layer in model.model.layers:  # the non-persistent load counters
        if hasattr(layer.mlp, "tokens_per_expert"):
            layer.mlp.tokens_per_expert = torch.zeros(
                PRESETS[cfg_name].num_experts, dtype=torch.long
            )
    return model.eval()


def set_kernel(model: CausalLM, kernel: Kernel | None) -> None:
    """Force every sparse layer's experts' kernel (None: the engine's own choice)."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.kernel = kernel


def parse_kernels(text: str) -> list[Kernel | None]:
    names = text.split(",")
    for name in names:
        if name != "auto" and name not in KERNELS:
            raise SystemExit(
                f"--kernels: unknown kernel {name!r}; known: auto, {', '.join(KERNELS)}"
            )
    return [next((k for k in KERNELS if k == name), None) for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="qwen3-30b-a3b-2l")
    parser.add_argument("--kernels", default="auto", help="comma list: auto, loop, grouped_mm")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    harness.add_arguments(parser, retries=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = parse_kernels(args.kernels)
    dtype = getattr(torch, args.dtype)
    session = harness.Session("moe", args)
    cfg = PRESETS[args.model]
    start = time.perf_counter()
    hf = hf_model(args.model, dtype)
    ours = engine_model(args.model, hf)
    print(f"built {args.model} in {time.perf_counter() - start:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(1)
    lengths: dict[int, Any] = {}
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        blocks = -(-n // BLOCK) + 1

        def run_ours(
            kernel: Kernel | None, tokens: list[int] = tokens, blocks: int = blocks
        ) -> tuple[float, None]:
            set_kernel(ours, kernel)
            ours.reset_expert_tokens()
            index = WorkerCacheIndex(1, blocks)
            store = PagedKVStore(cfg, blocks, BLOCK, dtype, torch.device("cpu"))
            _, cmd = plan_prefill(index, tokens, BLOCK, 0, (0,), logits="last")
            t = time.perf_counter()
            with torch.inference_mode():
                prefill_rank(ours, SoloComm(), store, cmd.for_rank(0), logits="last")
            return time.perf_counter() - t, None

        def run_hf(tokens: list[int] = tokens) -> float:
            ids = torch.tensor([tokens])
            t = time.perf_counter()
            with torch.inference_mode():
                hf(input_ids=ids, use_cache=False, logits_to_keep=1)
            return time.perf_counter() - t

        engines = {f"engine[{k or 'auto'}]": k for k in kernels}
        runners: dict[str, harness.Runner] = {
            name: functools.partial(run_ours, k) for name, k in engines.items()
        }
        runners["transformers"] = lambda: (run_hf(), None)
        timed, _ = harness.interleaved(runners, args.repeats, session.load)
        h = timed["transformers"].median
        load = ours.expert_tokens() or {}  # of the last engine run, by sparse layer
        first = load[min(load)]
        figures: dict[str, Any] = {"transformers": timed["transformers"].to_dict()}
        figures["transformers_tokens_s"] = n / h
        for name in engines:
            o = timed[name].median
            print(
                f"{n:>6} tokens: {name} {n / o:8.1f} tok/s ({o:.3f} s), transformers "
                f"{n / h:8.1f} tok/s ({h:.3f} s), ratio {h / o:.2f}x",
                flush=True,
            )
            figures[name] = timed[name].to_dict()
            figures[f"{name}_tokens_s"] = n / o
            figures[f"{name}_ratio"] = h / o
        if len(engines) > 1:
            (a, ta), (b, tb) = [(name, timed[name].median) for name in list(engines)[:2]]
            print(f"{n:>6} tokens: {b} / {a} time {tb / ta:.3f} ({ta / tb:.2f}x)", flush=True)
            figures["kernel_time_ratio"] = {"of": b, "to": a, "ratio": tb / ta}
        print(
            f"{n:>6} tokens: layer 0 expert load: {sum(first)} assignments, busiest "
            f"expert {max(first)}, idle experts {sum(c == 0 for c in first)} of {len(first)}",
            flush=True,
        )
        figures["layer0_expert_load"] = first
        lengths[n] = figures
    session.finish(args.json, {"args": vars(args), "lengths": lengths})


if __name__ == "__main__":
    main()
