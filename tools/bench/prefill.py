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
``--retries`` times, then kept and flagged); every run prints the cores others used.

Run (from the repository root)::

    .venv/bin/python tools/bench/prefill.py                      # 512, 2048, 8192 tokens
    .venv/bin/python tools/bench/prefill.py --lengths 512,2048 --repeats 5 --json out.json
    .venv/bin/python tools/bench/prefill.py --parts b            # CP scaling only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vertumnus.config import PRESETS, EngineConfig, ModelConfig
from vertumnus.engine.weights import random_model
from vertumnus.runtime.prefill import PrefillClient
from vertumnus.runtime.ranks import ChildRanks

TARGET_A = 1.0  # transformers / ours at C=1, every length
TARGET_B = 1.6  # C=1 / C=2 with one thread per rank
TARGET_B_LENGTH = 8192


@dataclass
class Timed:
    """Timed runs of one configuration at one length (seconds)."""

    runs: list[float] = field(default_factory=list)
    rank_compute: list[list[float]] = field(default_factory=list)  # per run, per rank
    foreign: list[float] = field(default_factory=list)  # cores used by others, per run
    discarded: int = 0  # runs redone because other processes were busy
    flagged: int = 0  # runs kept although other processes were busy (retries exhausted)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def rank_compute_median(self) -> list[float]:
        if not self.rank_compute:
            return []
        return [statistics.median(col) for col in zip(*self.rank_compute, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "median_s": self.median,
            "runs_s": self.runs,
            "others_cores_per_run": self.foreign,
            "discarded_runs": self.discarded,
            "flagged_runs": self.flagged,
        }
        if self.rank_compute:
            out["rank_compute_median_s"] = self.rank_compute_median()
            out["rank_compute_runs_s"] = self.rank_compute
        return out


def src_fingerprint() -> str:
    """sha256 (12 hex digits) of the engine's source files, as imported by the ranks."""
    import hashlib
    from pathlib import Path

    import vertumnus

    root = Path(vertumnus.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def machine_info(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = float("nan")
    import subprocess

    import transformers

    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        git = f"{head}{' + uncommitted changes in src/' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        git = "unknown"
    import vertumnus

    return {
        "git": git,
        "src": os.path.dirname(vertumnus.__file__),
        "src_sha256": src_fingerprint(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "threads_a": threads,
        "mkldnn": torch.backends.mkldnn.is_available(),
    }


def make_tokens(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + length)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def hf_model(cfg: ModelConfig, seed: int) -> Any:
    """transformers' Qwen3ForCausalLM with exactly the weights every rank builds."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        use_cache=False,
    )
    import inspect

    if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:  # transformers 4.x
        kwargs["rope_theta"] = cfg.rope_theta
    hc = Qwen3Config(**kwargs)
    hc._attn_implementation = "sdpa"
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


def ours_prefill(worker: PrefillClient, tokens: Sequence[int]) -> tuple[float, list[float], Any]:
    out = worker.prefill(tokens, logits="last")
    assert out.cached_tokens == 0 and out.computed_tokens == len(tokens), "cache was reused"
    return out.prefill_s, list(out.rank_compute_s), out.logits[-1]


Runner = Callable[[Sequence[int]], tuple[float, list[float], torch.Tensor]]


class Load:
    """CPU use of the whole machine and of this benchmark's process tree, from /proc.

    The machine may be shared: a run during which other processes used more than
    ``max_foreign`` cores on average is discarded and repeated (``--max-foreign``).
    """

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, max_foreign: float, max_wait_s: float, retries: int) -> None:
        self.max_foreign, self.max_wait_s, self.retries = max_foreign, max_wait_s, retries
        self.available = os.path.exists("/proc/stat")

    @staticmethod
    def _machine() -> tuple[int, int]:
        """(busy jiffies, steal jiffies) summed over all CPUs."""
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        return v[0] + v[1] + v[2] + v[5] + v[6], v[7] if len(v) > 7 else 0

    @staticmethod
    def _own() -> int:
        """utime + stime jiffies of this process and its live descendants."""
        procs: dict[int, tuple[int, int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2 :].split()
            procs[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        mine, frontier, total = {os.getpid()}, [os.getpid()], 0
        while frontier:
            pid = frontier.pop()
            total += procs.get(pid, (0, 0))[1]
            for child, (ppid, _) in procs.items():
                if ppid == pid and child not in mine:
                    mine.add(child)
                    frontier.append(child)
        return total

    def snapshot(self) -> tuple[float, int, int, int]:
        if not self.available:
            return time.perf_counter(), 0, 0, 0
        busy, steal = self._machine()
        return time.perf_counter(), busy, steal, self._own()

    def foreign(self, a: tuple[float, int, int, int], b: tuple[float, int, int, int]) -> float:
        """Average cores used by other processes between two snapshots."""
        wall = b[0] - a[0]
        if not self.available or wall <= 0:
            return 0.0
        return max(0.0, ((b[1] - a[1]) - (b[3] - a[3])) / self.TICK / wall)

    def wait_quiet(self) -> float:
        """Wait (at most max_wait_s) until others use < max_foreign cores over 1 s."""
        if not self.available:
            return 0.0
        deadline = time.monotonic() + self.max_wait_s
        while True:
            a = self.snapshot()
            time.sleep(1.0)
            f = self.foreign(a, self.snapshot())
            if f < self.max_foreign or time.monotonic() >= deadline:
                return f


def compare(
    runners: dict[str, Runner], tokens: Sequence[int], repeats: int, load: Load
) -> tuple[dict[str, Timed], dict[str, torch.Tensor]]:
    """Warm each runner up once, then ``repeats`` timed rounds of one run each.

    The order within a round reverses every round (A B, B A, A B, ...), so that
    neither configuration always runs right after the other.

    Each timed run waits for a quiet machine first; a run during which other processes
    used more than ``load.max_foreign`` cores is discarded and redone (at most
    ``load.retries`` times per run; after that it is kept and flagged).
    """
    timed = {name: Timed() for name in runners}
    logits: dict[str, torch.Tensor] = {}
    for name, run in runners.items():
        t, _, lg = run(tokens)
        logits[name] = lg
        print(f"    warm-up {name:<18} {t:8.3f} s", flush=True)
    for i in range(repeats):
        order = list(runners.items())
        for name, run in order if i % 2 == 0 else reversed(order):
            for attempt in range(load.retries + 1):
                load.wait_quiet()
                before = load.snapshot()
                t, ranks, _ = run(tokens)
                foreign = load.foreign(before, load.snapshot())
                steal = (load.snapshot()[2] - before[2]) / load.TICK / max(t, 1e-9)
                extra = (
                    f"  (rank compute {', '.join(f'{r:.3f}' for r in ranks)} s)" if ranks else ""
                )
                clean = foreign <= load.max_foreign
                note = "" if clean else "  DISCARDED: " if attempt < load.retries else "  FLAGGED: "
                if note:
                    note += f"other processes used {foreign:.2f} cores"
                print(
                    f"    run {i + 1}/{repeats} {name:<18} {t:8.3f} s{extra}"
                    f"  [others {foreign:.2f} cores, steal {steal:.2f}]{note}",
                    flush=True,
                )
                if clean or attempt == load.retries:
                    timed[name].runs.append(t)
                    timed[name].foreign.append(foreign)
                    timed[name].flagged += not clean
                    if ranks:
                        timed[name].rank_compute.append(ranks)
                    break
                timed[name].discarded += 1
    return timed, logits


def part_a(
    cfg: ModelConfig,
    lengths: list[int],
    threads: int,
    repeats: int,
    seed: int,
    timeout: float,
    load: Load,
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

        def run_hf(tokens: Sequence[int]) -> tuple[float, list[float], torch.Tensor]:
            t, lg = hf_prefill(model, tokens)
            return t, [], lg

        runners: dict[str, Runner] = {
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
                "transformers": hf.to_dict(),
                "vertumnus_c1": ours.to_dict(),
                "ratio": hf.median / ours.median,
                "logits_max_abs_diff": diff,
                "logits_max_abs": scale,
                "same_argmax": same_argmax,
            }
            print(
                f"  -> transformers {hf.median:.3f} s, ours {ours.median:.3f} s "
                f"(rank compute {ours.rank_compute_median()[0]:.3f} s), "
                f"ratio {hf.median / ours.median:.2f}x, logits max|diff| {diff:.2e} "
                f"(max|logit| {scale:.1f}, same argmax: {same_argmax})",
                flush=True,
            )
    return results  # the transformers model goes with this frame


def part_b(
    cfg: ModelConfig, lengths: list[int], repeats: int, seed: int, timeout: float, load: Load
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
        runners: dict[str, Runner] = {
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
                "c1": one.to_dict(),
                "c2": two.to_dict(),
                "ratio": one.median / two.median,
                "logits_max_abs_diff": diff,
            }
            rc2 = ", ".join(f"{r:.3f}" for r in two.rank_compute_median())
            print(
                f"  -> C=1 {one.median:.3f} s (rank compute {one.rank_compute_median()[0]:.3f}),"
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
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.25,
        help="redo a timed run if other processes used more cores than this during it",
    )
    parser.add_argument(
        "--max-wait", type=float, default=300.0, help="longest wait (s) for a quiet machine"
    )
    parser.add_argument("--retries", type=int, default=5, help="redos per timed run")
    parser.add_argument("--json", metavar="OUT", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not lengths or any(n < 1 for n in lengths) or not parts <= {"a", "b"} or not parts:
        parser.error("--lengths must be positive integers and --parts a subset of a,b")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be positive")
    cfg = PRESETS[args.model]
    load = Load(args.max_foreign, args.max_wait, args.retries)
    info = machine_info(args.threads)
    print(f"vertumnus prefill benchmark: model {cfg.name} (random weights, seed {args.seed}), fp32")
    print(f"lengths {lengths}, {args.repeats} timed run(s) after 1 warm-up, median reported")
    for k, v in info.items():
        print(f"  {k}: {v}")
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
    if src_fingerprint() != info["src_sha256"]:
        print(
            "WARNING: the engine's source files changed during the run "
            f"(src_sha256 {info['src_sha256']} -> {src_fingerprint()}): figures may mix versions"
        )
    if args.json:
        doc = {
            "model": cfg.name,
            "seed": args.seed,
            "lengths": lengths,
            "repeats": args.repeats,
            "threads_a": args.threads,
            "machine": info,
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "a": {str(n): r for n, r in a.items()},
            "b": {str(n): r for n, r in b.items()},
            "verdicts": v,
            "total_wall_s": total,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
