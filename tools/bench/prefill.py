"""Prefill benchmark: Vertumnus against Hugging Face transformers, and CP scaling.

Measures, in one run and on the same seeded random weights of a preset (default
``qwen3-0.6b-4l``: Qwen3-0.6B's shape cut to 4 layers, fp32, CPU), at each prompt
length of ``--lengths``:

(a) Vertumnus at C=1 against ``transformers.Qwen3ForCausalLM`` (attn_implementation
    "sdpa", ``logits_to_keep=1``, ``use_cache=False``, under ``torch.inference_mode()``),
    both with ``--threads`` intra-op threads. Ours runs through the real serving path:
    a ``ChildRanks`` of one rank (``threads_per_rank=--threads``, ``kv_blocks_per_rank=0``
    so that no prefix is ever reused) and ``PrefillClient.prefill(tokens, logits="last")``,
    timed by ``PrefillOutcome.prefill_s`` (dispatch to answer, queue overhead included).
    transformers runs in this process, timed around its forward call. Ratio a =
    transformers time / ours (target >= 1.0x at every length). The last-position logits
    of both are compared (max abs difference) to show that both compute the same thing.

(b) Context-parallel scaling with one intra-op thread per rank: a ``ChildRanks`` of two
    ranks (``threads_per_rank=1``, ``kv_blocks_per_rank=0``) serving a C=1 worker (rank
    0 alone; rank 1 idles on its queue) and a C=2 worker (ranks 0 and 1). Ratio b =
    time(C=1) / time(C=2), by ``prefill_s`` (limit 2x; target >= 1.6x at 8192 tokens).

Method: one warm-up per configuration and length, then ``--repeats`` timed runs whose
median is reported. The two configurations of a comparison alternate run by run (in
the order A B, B A, A B, ...), so slow drift of the machine hits both alike; only one
configuration computes at any time (an idle rank blocks on its command queue). The
pool of (a) is closed and the transformers model freed before (b) starts. Each pool
is started once and kept across lengths. The machine may be shared: before each timed
run the script waits (up to ``--max-wait`` s) until other processes use less than
``--max-foreign`` cores, and a run during which they used more is redone (up to
``--retries`` times, then kept and flagged); every run prints the cores others used
(``harness.interleaved``). ``--json`` writes the figures with the machine and the
source they were measured on (``harness.py``).

Run (from the repository root)::

    .venv/bin/python -m tools.bench.prefill                      # 512, 2048, 8192 tokens
    .venv/bin/python -m tools.bench.prefill --lengths 512,2048 --repeats 5 --json out.json
    .venv/bin/python -m tools.bench.prefill --parts b            # CP scaling only
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tools.bench import harness
from vertumnus.config import PRESETS, EngineConfig, ModelConfig
from vertumnus.engine.transformers_config import hf_config
from vertumnus.engine.weights import random_model
from vertumnus.runtime.prefill import PrefillClient
from vertumnus.runtime.ranks import ChildRanks

TARGET_A = 1.0  # transformers / ours at C=1, every length
TARGET_B = 1.6  # C=1 / C=2 with one thread per rank
TARGET_B_LENGTH = 8192


def rank_runs(timed: harness.Timed) -> list[list[float]]:
    """The ranks' compute of each kept run (seconds, per rank); none for transformers."""
    return [ranks for ranks, _ in timed.details if ranks]


def rank_medians(timed: harness.Timed) -> list[float]:
    return [statistics.median(col) for col in zip(*rank_runs(timed), strict=True)]


def figures(timed: harness.Timed) -> dict[str, Any]:
    out = timed.to_dict()
    if rank_runs(timed):
        out["rank_compute_median_s"] = rank_medians(timed)
        out["rank_compute_runs_s"] = rank_runs(timed)
    return out


def make_tokens(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + length)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def hf_model(cfg: ModelConfig, seed: int) -> Any:
    """transformers' Qwen3ForCausalLM with exactly the weights every rank builds."""
    from transformers import Qwen3ForCausalLM

    hc = hf_config(cfg)
    hc.use_cache = False
    model = Qwen3ForCausalLM(hc).to(torch.float32).eval()
    model.load_state_dict(random_model(cfg, seed).state_dict(), strict=True)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == "sdpa"
    return model


def hf_prefill(model: Any, tokens: Sequence[int]) -> tuple[float, torch.Tensor]:
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=ids, logits_to_keep=1, use_cache=False)
        elapsed = time.perf_counter() - start
    return elapsed, out.logits[0, -1].float()


Run = tuple[float, tuple[list[float], torch.Tensor]]  # seconds, (rank compute, logits)


def ours_prefill(worker: PrefillClient, tokens: Sequence[int]) -> Run:
    out = worker.prefill(tokens, logits="last")
    assert out.cached_tokens == 0 and out.computed_tokens == len(tokens), "cache was reused"
    return out.prefill_s, (list(out.rank_compute_s), out.logits[-1])


def compare(
    runners: dict[str, Callable[[Sequence[int]], Run]],
    tokens: Sequence[int],
    repeats: int,
    load: harness.Load,
) -> tuple[dict[str, harness.Timed], dict[str, torch.Tensor]]:
    """Each configuration on ``tokens``: ``harness.interleaved`` (a warm-up, then
    ``repeats`` rounds in alternating order, each run guarded against other
    processes' load), and the warm-up's last-position logits."""

    def ranks(detail: tuple[list[float], torch.Tensor]) -> str:
        return f"  (rank compute {', '.join(f'{r:.3f}' for r in detail[0])} s)" if detail[0] else ""

    bound = {name: functools.partial(run, tokens) for name, run in runners.items()}
    timed, warm = harness.interleaved(bound, repeats, load, ranks)
    return timed, {name: logits for name, (_, logits) in warm.items()}


def part_a(
    cfg: ModelConfig,
    lengths: list[int],
    threads: int,
    repeats: int,
    seed: int,
    timeout: float,
    load: harness.Load,
) -> dict[int, dict[str, Any]]:
    print(f"\n(a) transformers vs Vertumnus C=1, {threads} intra-op thread(s) each", flush=True)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = hf_model(cfg, seed)
    print(f"  transformers model built in {time.perf_counter() - t0:.1f} s", flush=True)
    engine = EngineConfig(
        device="cpu",
        threads_per_rank=threads,
        kv_blocks_per_rank=0,
        seed=seed,
        rank_timeout_s=timeout,
    )
    results: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    with ChildRanks(cfg, None, engine, world_size=1, degrees=(1,)) as pool:
        print(f"  pool of 1 rank started in {time.perf_counter() - t0:.1f} s", flush=True)
        worker = PrefillClient(pool, (0,))

        def run_hf(tokens: Sequence[int]) -> Run:
            t, lg = hf_prefill(model, tokens)
            return t, ([], lg)

        runners: dict[str, Callable[[Sequence[int]], Run]] = {
            "transformers": run_hf,
            "vertumnus C=1": lambda tokens: ours_prefill(worker, tokens),
        }
        for length in lengths:
            print(f"  length {length}", flush=True)
            tokens = make_tokens(length, cfg.vocab_size, seed)
            timed, logits = compare(runners, tokens, repeats, load)
            hf, ours = timed["transformers"], timed["vertumnus C=1"]
            diff = float((logits["transformers"] - logits["vertumnus C=1"]).abs().max())
            scale = float(logits["transformers"].abs().max())
            same_argmax = int(logits["transformers"].argmax()) == int(
                logits["vertumnus C=1"].argmax()
            )
            results[length] = {
                "transformers": figures(hf),
                "vertumnus_c1": figures(ours),
                "ratio": hf.median / ours.median,
                "logits_max_abs_diff": diff,
                "logits_max_abs": scale,
                "same_argmax": same_argmax,
            }
            print(
                f"  -> transformers {hf.median:.3f} s, ours {ours.median:.3f} s "
                f"(rank compute {rank_medians(ours)[0]:.3f} s), "
                f"ratio {hf.median / ours.median:.2f}x, logits max|diff| {diff:.2e} "
                f"(max|logit| {scale:.1f}, same argmax: {same_argmax})",
                flush=True,
            )
    return results  # the transformers model goes with this frame


def part_b(
    cfg: ModelConfig,
    lengths: list[int],
    repeats: int,
    seed: int,
    timeout: float,
    load: harness.Load,
) -> dict[int, dict[str, Any]]:
    print("\n(b) CP scaling, 1 intra-op thread per rank: C=1 vs C=2", flush=True)
    engine = EngineConfig(
        device="cpu",
        threads_per_rank=1,
        kv_blocks_per_rank=0,
        seed=seed,
        rank_timeout_s=timeout,
    )
    results: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    with ChildRanks(cfg, None, engine, world_size=2, degrees=(1, 2)) as pool:
        print(f"  pool of 2 ranks started in {time.perf_counter() - t0:.1f} s", flush=True)
        c1 = PrefillClient(pool, (0,), worker_id=0)
        c2 = PrefillClient(pool, (0, 1), worker_id=1)
        runners: dict[str, Callable[[Sequence[int]], Run]] = {
            "C=1": lambda tokens: ours_prefill(c1, tokens),
            "C=2": lambda tokens: ours_prefill(c2, tokens),
        }
        for length in lengths:
            print(f"  length {length}", flush=True)
            tokens = make_tokens(length, cfg.vocab_size, seed)
            timed, logits = compare(runners, tokens, repeats, load)
            one, two = timed["C=1"], timed["C=2"]
            diff = float((logits["C=1"] - logits["C=2"]).abs().max())
            results[length] = {
                "c1": figures(one),
                "c2": figures(two),
                "ratio": one.median / two.median,
                "logits_max_abs_diff": diff,
            }
            rc2 = ", ".join(f"{r:.3f}" for r in rank_medians(two))
            print(
                f"  -> C=1 {one.median:.3f} s (rank compute {rank_medians(one)[0]:.3f}),"
                f" C=2 {two.median:.3f} s (rank compute {rc2}), "
                f"ratio {one.median / two.median:.2f}x, logits max|diff| {diff:.2e}",
                flush=True,
            )
    return results


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(lengths: list[int], a: dict[int, Any], b: dict[int, Any], threads: int) -> None:
    head = (
        f"{'tokens':>7} | {'transformers s':>14} | {'ours C=1 s':>10} | {'ratio a':>7} | "
        f"{'max|dlogit|':>11} | {'C=1 1thr s':>10} | {'C=2 1thr s':>10} | {'ratio b':>7}"
    )
    print(f"\nResults (median; (a) with {threads} thread(s), (b) with 1 thread per rank)")
    print(head)
    print("-" * len(head))
    for n in lengths:
        ra, rb = a.get(n), b.get(n)
        print(
            f"{n:>7} | {fmt(ra and ra['transformers']['median_s']):>14} | "
            f"{fmt(ra and ra['vertumnus_c1']['median_s']):>10} | "
            f"{fmt(ra and ra['ratio'], '.2f'):>6}x | "
            f"{fmt(ra and ra['logits_max_abs_diff'], '.1e'):>11} | "
            f"{fmt(rb and rb['c1']['median_s']):>10} | {fmt(rb and rb['c2']['median_s']):>10} | "
            f"{fmt(rb and rb['ratio'], '.2f'):>6}x"
        )


def verdicts(a: dict[int, Any], b: dict[int, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if a:
        worst = min(a, key=lambda n: a[n]["ratio"])
        out["a"] = {
            "target": f"transformers / ours >= {TARGET_A}x at every length",
            "pass": all(r["ratio"] >= TARGET_A for r in a.values()),
            "per_length": {n: r["ratio"] >= TARGET_A for n, r in a.items()},
            "worst": {"tokens": worst, "ratio": a[worst]["ratio"]},
        }
    if b:
        r = b.get(TARGET_B_LENGTH)
        out["b"] = {
            "target": f"C=1 / C=2 >= {TARGET_B}x at {TARGET_B_LENGTH} tokens",
            "pass": None if r is None else r["ratio"] >= TARGET_B,
            "ratio": None if r is None else r["ratio"],
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b-4l", choices=sorted(PRESETS))
    parser.add_argument("--lengths", default="512,2048,8192", help="comma-separated tokens")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads for (a)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per config")
    parser.add_argument("--seed", type=int, default=0, help="weight (and prompt) seed")
    parser.add_argument("--parts", default="a,b", help="which comparisons: a, b or a,b")
    parser.add_argument(
        "--rank-timeout", type=float, default=1800.0, help="rank_timeout_s of the pools"
    )
    harness.add_arguments(parser, retries=True)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not lengths or any(n < 1 for n in lengths) or not parts <= {"a", "b"} or not parts:
        parser.error("--lengths must be positive integers and --parts a subset of a,b")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be positive")
    cfg = PRESETS[args.model]
    print(f"vertumnus prefill benchmark: model {cfg.name} (random weights, seed {args.seed}), fp32")
    print(f"lengths {lengths}, {args.repeats} timed run(s) after 1 warm-up, median reported")
    session = harness.Session("prefill", args)
    load = session.load
    started = time.perf_counter()
    a = (
        part_a(cfg, lengths, args.threads, args.repeats, args.seed, args.rank_timeout, load)
        if ("a" in parts)
        else {}
    )
    gc.collect()  # the transformers model of (a) is gone before (b) starts
    b = (
        part_b(cfg, lengths, args.repeats, args.seed, args.rank_timeout, load)
        if "b" in parts
        else {}
    )
    print_table(lengths, a, b, args.threads)
    runs = [t for r in (*a.values(), *b.values()) for t in r.values() if isinstance(t, dict)]
    redone = sum(t["discarded_runs"] for t in runs)
    flagged = sum(t["flagged_runs"] for t in runs)
    print(
        f"runs redone because other processes were busy: {redone}; "
        f"kept although busy (flagged): {flagged}"
    )
    v = verdicts(a, b)
    print()
    if "a" in v:
        per = ", ".join(
            f"{n}: {a[n]['ratio']:.2f}x {'PASS' if ok else 'MISS'}"
            for n, ok in v["a"]["per_length"].items()
        )
        print(f"target (a) {v['a']['target']}: {'PASS' if v['a']['pass'] else 'MISS'} ({per})")
    if "b" in v:
        r = v["b"]["ratio"]
        verdict = (
            "n/a (length not run)"
            if r is None
            else (f"{'PASS' if v['b']['pass'] else 'MISS'} ({r:.2f}x)")
        )
        print(f"target (b) {v['b']['target']}: {verdict}")
    total = time.perf_counter() - started
    print(f"total wall time {total:.0f} s")
    session.finish(
        args.json,
        {
            "model": cfg.name,
            "seed": args.seed,
            "lengths": lengths,
            "repeats": args.repeats,
            "threads_a": args.threads,
            "a": {str(n): r for n, r in a.items()},
            "b": {str(n): r for n, r in b.items()},
            "verdicts": v,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
