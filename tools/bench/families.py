"""Per-core prefill speed of every model family against transformers on the same
weights, with Qwen3 (the path measured before the families) as the reference ratio.

For each family a random model of the same small size (hidden 1024, 16 query heads
on 8 KV heads of 64, MLP 2816, 4 layers, vocab 32000; MoE families: 8 experts of
704, top 2; the family's own features on: Qwen2's q/k/v biases, Mistral's window of
4096, Mixtral's w1/w2/w3 experts, Qwen2-MoE's shared expert, gpt-oss's sinks, window
of 128 on alternate layers, YaRN and expert biases) is written by transformers with
seeded weights and loaded by the engine from that folder. At each length of
``--lengths``, one thread, ``--dtype``: transformers' forward (``sdpa`` attention, or
``eager`` where the family has no other: gpt-oss; ``logits_to_keep=1``, no cache)
against the engine's CP-1 prefill in this process (``prefill_rank``, last logits;
layers eager unless ``--compile``), alternating, median of ``--repeats`` after one
warm-up. Ratio = transformers / engine; the target: every family's ratio at least
Qwen3's in the same run (the Qwen3 path's standing against transformers today).

Run::

    .venv/bin/python -m tools.bench.families                 # 512, 2048 tokens, fp32
    .venv/bin/python -m tools.bench.families --dtype bfloat16 --families qwen3,gpt-oss
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from vertumnus.config import ModelConfig
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.fused import compiled_layer_fns
from vertumnus.engine.weights import load_model
from vertumnus.engine.zigzag import RankPrefill, prefill_rank

SHAPE: dict[str, Any] = dict(
    vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=32_768, tie_word_embeddings=False,
)  # fmt: skip
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}
MOE: dict[str, Any] = dict(num_experts_per_tok=2)
YARN = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip
FAMILIES: dict[str, Any] = {
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, **ROPE),
    "llama": lambda: transformers.LlamaConfig(**SHAPE, **ROPE),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, **ROPE, sliding_window=4096),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, **ROPE),
    "mixtral": lambda: transformers.MixtralConfig(
        **{**SHAPE, "intermediate_size": 704}, **ROPE, **MOE, num_local_experts=8
    ),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **SHAPE,
        **ROPE,
        **MOE,
        num_experts=8,
        moe_intermediate_size=704,
        shared_expert_intermediate_size=1408,
    ),
    "gpt-oss": lambda: transformers.GptOssConfig(
        **{**SHAPE, "intermediate_size": 704},
        **MOE,
        num_local_experts=8,
        sliding_window=128,
        rope_parameters=YARN,
    ),
}


def build(name: str, folder: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    cfg = FAMILIES[name]()
    cfg._attn_implementation = "eager" if name == "gpt-oss" else "sdpa"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(hf.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)
    hf.save_pretrained(folder)
    ours = load_model(ModelConfig.from_dir(folder), folder, dtype, torch.device("cpu"))
    return hf.to(dtype), ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="compiled engine layers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for name in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            hf, ours = build(name, Path(tmp), dtype)
        if args.compile:
            ours.layer_fns = compiled_layer_fns()
        for n in lengths:
            ids = torch.randint(0, 32_000, (n,), generator=torch.Generator().manual_seed(n))
            step = RankPrefill(ids, 0, (), (), 16)
            runs = {
                "transformers": lambda hf=hf, ids=ids: hf(
                    input_ids=ids[None], use_cache=False, logits_to_keep=1
                ),
                "engine": lambda ours=ours, step=step: prefill_rank(ours, SoloComm(), None, step),
            }
            times: dict[str, list[float]] = {k: [] for k in runs}
            with torch.inference_mode():
                for i in range(args.repeats + 1):
                    for key in runs if i % 2 == 0 else reversed(list(runs)):
                        began = time.perf_counter()
                        runs[key]()
                        times[key].append(time.perf_counter() - began)
            hf_s = statistics.median(times["transformers"][1:])
            ours_s = statistics.median(times["engine"][1:])
            rows.append((name, n, hf_s, ours_s))
            line = f"transformers {hf_s * 1e3:8.1f} ms, engine {ours_s * 1e3:8.1f} ms"
            print(f"{name:10s} {n:5d} tokens: {line}, ratio {hf_s / ours_s:.2f}x", flush=True)
    ref = {n: hf_s / ours_s for name, n, hf_s, ours_s in rows if name == "qwen3"}
    for name, n, hf_s, ours_s in rows:
        if name != "qwen3" and n in ref:
            ratio = hf_s / ours_s
            verdict = "ok" if ratio >= ref[n] else "below qwen3"
            print(f"{name:10s} {n:5d}: {ratio:.2f}x against qwen3's {ref[n]:.2f}x: {verdict}")


if __name__ == "__main__":
    main()
