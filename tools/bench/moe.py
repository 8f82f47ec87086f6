"""Prefill throughput of the Qwen3-MoE engine against transformers, same weights.

    .venv/bin/python tools/bench/moe.py [--lengths 512,2048] [--repeats 3] [--threads 2]

The model is Qwen3-30B-A3B's layer shape cut to 2 layers (the ``qwen3-30b-a3b-2l``
preset: hidden 2048, 32 query and 4 KV heads of 128, 128 experts of 768, top 8,
vocabulary 151,936), with random weights. transformers' ``Qwen3MoeForCausalLM`` is
built first; the engine's model then takes the very same tensors (no copy). For each
length: one warm-up each, then ``--repeats`` timed prefills of each, interleaved in
alternating order, each guarded against other processes' load
(``harness.interleaved``). The engine runs its C = 1 path (``prefill_rank`` with the
KV written to a paged store); transformers runs one forward with ``logits_to_keep=1``
and no cache. Prints tokens per second and the ratio, and the engine's expert load of
the last run; ``--json PATH`` writes the figures with the machine and source they
were measured on (``harness.py``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import transformers

import harness
from vertumnus.config import PRESETS
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.model import Qwen3ForCausalLM
from vertumnus.engine.zigzag import prefill_rank
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.runtime.prefill import plan_prefill

BLOCK = 16


def hf_model(cfg_name: str) -> transformers.Qwen3MoeForCausalLM:
    c = PRESETS[cfg_name]
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(hf_cfg).float().eval()


def engine_model(cfg_name: str, hf: transformers.Qwen3MoeForCausalLM) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(PRESETS[cfg_name])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="qwen3-30b-a3b-2l")
    harness.add_arguments(parser, retries=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    session = harness.Session("moe", args)
    cfg = PRESETS[args.model]
    start = time.perf_counter()
    hf = hf_model(args.model)
    ours = engine_model(args.model, hf)
    print(f"built {args.model} in {time.perf_counter() - start:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(1)
    lengths: dict[int, Any] = {}
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        blocks = -(-n // BLOCK) + 1

        def run_ours(tokens: list[int] = tokens, blocks: int = blocks) -> float:
            ours.reset_expert_tokens()
            index = WorkerCacheIndex(1, blocks)
            store = PagedKVStore(cfg, blocks, BLOCK, torch.float32, torch.device("cpu"))
            _, cmd = plan_prefill(index, tokens, BLOCK, 0, (0,), logits="last")
            t = time.perf_counter()
            with torch.inference_mode():
                prefill_rank(ours, SoloComm(), store, cmd.for_rank(0), logits="last")
            return time.perf_counter() - t

        def run_hf(tokens: list[int] = tokens) -> float:
            ids = torch.tensor([tokens])
            t = time.perf_counter()
            with torch.inference_mode():
                hf(input_ids=ids, use_cache=False, logits_to_keep=1)
            return time.perf_counter() - t

        runners = {"engine": lambda: (run_ours(), None), "transformers": lambda: (run_hf(), None)}
        timed, _ = harness.interleaved(runners, args.repeats, session.load)
        o, h = timed["engine"].median, timed["transformers"].median
        load = ours.expert_tokens() or {}  # of the last engine run, by sparse layer
        first = load[min(load)]
        print(
            f"{n:>6} tokens: engine {n / o:8.1f} tok/s ({o:.3f} s), transformers "
            f"{n / h:8.1f} tok/s ({h:.3f} s), ratio {h / o:.2f}x; layer 0 expert load: "
            f"{sum(first)} assignments, busiest expert {max(first)}, idle experts "
            f"{sum(c == 0 for c in first)} of {len(first)}",
            flush=True,
        )
        lengths[n] = {
            "engine": timed["engine"].to_dict(),
            "transformers": timed["transformers"].to_dict(),
            "engine_tokens_s": n / o,
            "transformers_tokens_s": n / h,
            "ratio": h / o,
            "layer0_expert_load": first,
        }
    session.finish(args.json, {"args": vars(args), "lengths": lengths})


if __name__ == "__main__":
    main()
