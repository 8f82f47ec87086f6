"""C = 1 prefill against vLLM's CPU build, per core, measured side by side in one run.

Both servers serve one random Qwen3 folder (``--hidden`` 256, ``--layers`` 4, head dim
64, GQA 4/2, written by ``tools/clients/model_folder.py``) in one dtype:

    vllm        ``vllm serve --dtype D``, prefix caching off; its CPU worker is bound
                to one core and leaves the other to its API server (its default)
    vertumnus   ``vertumnus serve`` with ``[engine] dtype = "auto"`` (what a user
                gets: bf16 where the CPU computes in bf16, else fp32) and ``compile =
                "auto"`` (its layers compiled, as vLLM compiles its model), the
                controller off, its default composition here (workers of one rank,
                one intra-op thread each): a request runs on one rank, one core

``D`` is what Vertumnus's ``auto`` resolves to on this CPU, so both compute in the
same dtype (``--dtype float32`` compares fp32 with fp32). Requests go one at a time:
a token-id prompt of each ``--lengths`` length (fresh random ids every run, the same
ids for both systems in a round), ``max_tokens = 1``, not streamed; the client's time
to the answer is the TTFT. Runs alternate A B, B A, ... under the harness's load
guard (``harness.interleaved``), after one warm-up each; the median of ``--repeats``
is reported with the ratio Vertumnus / vLLM (below 1: Vertumnus is faster) and
Vertumnus's rank compute time from its answer's ``timings``.

    bash tools/vllm/setup.sh
    .venv/bin/python -m tools.bench.prefill_vs_vllm --json out/prefill_vs_vllm.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tools.bench import harness
from tools.bench._serving import start_server
from tools.clients import model_folder
from tools.vllm import vllm_server

REPO = Path(__file__).resolve().parents[2]

MAX_POSITIONS = 16384


def complete(url: str, model: str, ids: list[int], timeout_s: float = 600.0) -> tuple[float, Any]:
    """(seconds to the one-token answer, the answer's ``timings`` or None)."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0})
    request = urllib.request.Request(
        url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        answer = json.loads(resp.read())
    elapsed = time.perf_counter() - start
    if len(answer["choices"]) != 1:
        raise RuntimeError(f"expected one choice, got {answer}")
    return elapsed, answer.get("timings")


class Prompts:
    """Token-id prompts of ``length``: each round draws a fresh one, and both systems
    get the same one in a round (in either order)."""

    def __init__(self, length: int, vocab: int) -> None:
        self.length, self.vocab, self.rng = length, vocab, random.Random(length)
        self.drawn: list[list[int]] = []
        self.taken: dict[str, int] = {}

    def next(self, system: str) -> list[int]:
        i = self.taken.get(system, 0)
        self.taken[system] = i + 1
        if i == len(self.drawn):
            self.drawn.append([self.rng.randrange(8, self.vocab - 8) for _ in range(self.length)])
        return self.drawn[i]


def serve_config(path: Path, folder: Path, dtype: str) -> Path:
    lines = [
        "[model]", f'name = "{folder}"',
        "[engine]", f'dtype = "{dtype}"', 'device = "cpu"',
        "[controller]", "enabled = false",
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="512,2048,8000")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    harness.add_arguments(p, retries=True)
    args = p.parse_args()
    if not vllm_server.VLLM_PYTHON.exists():
        p.error("no vLLM in .venv-vllm: run tools/vllm/setup.sh")
    import torch

    from vertumnus.engine.weights import resolve_dtype

    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) >= MAX_POSITIONS:
        p.error(f"lengths must be below {MAX_POSITIONS}")
    harness.adopt_orphans()  # vLLM's engine core outlives its parent at a stop
    session = harness.Session("prefill_vs_vllm", args)
    work = Path(tempfile.mkdtemp(prefix="prefill-vs-vllm-"))
    folder = model_folder.write_model_folder(
        work / "model",
        head_dim=64,
        hidden_size=args.hidden,
        layers=args.layers,
        max_positions=MAX_POSITIONS,
    )
    log = (work / "servers.log").open("w")
    print(f"dtype {dtype} (--dtype {args.dtype}); logs in {log.name}", flush=True)
    vllm, vllm_url = vllm_server.start_vllm(
        folder,
        log,
        connector=False,
        prefix_caching=False,
        dtype=dtype,
        max_model_len=MAX_POSITIONS,
    )
    ours = None
    rows: dict[int, dict[str, Any]] = {}
    try:
        config = serve_config(work / "serve.toml", folder, args.dtype)
        ours, our_url = start_server(config, stderr=log, timeout_s=300.0)
        for n in lengths:
            print(f"{n} tokens", flush=True)
            prompts = Prompts(n, model_folder.VOCAB_SIZE)
            runners = {
                "vllm": lambda p=prompts: complete(vllm_url, str(folder), p.next("vllm")),
                "vertumnus": lambda p=prompts: complete(our_url, str(folder), p.next("vertumnus")),
            }
            timed, _ = harness.interleaved(runners, args.repeats, session.load)
            v, o = (statistics.median(timed[s].runs) for s in ("vllm", "vertumnus"))
            compute = [d["rank_compute_s"] for d in timed["vertumnus"].details if d]
            rows[n] = {
                "vllm_s": harness.summary(timed["vllm"].runs),
                "vertumnus_s": harness.summary(timed["vertumnus"].runs),
                "vertumnus_rank_compute_s": harness.summary(compute),
                "ratio": o / v,
                "flagged": timed["vllm"].flagged + timed["vertumnus"].flagged,
            }
    finally:
        if ours is not None:
            ours.terminate()
            ours.wait(timeout=60)
        vllm_server.stop(vllm)
        log.close()
    print(f"\nC = 1 prefill, one core, {dtype}: median client TTFT (max_tokens = 1)")
    print(f"{'tokens':>7} {'vLLM':>10} {'Vertumnus':>10} {'ratio':>7} {'rank compute':>13}")
    for n, r in rows.items():
        v_ms, o_ms = r["vllm_s"]["median"] * 1e3, r["vertumnus_s"]["median"] * 1e3
        c_ms = r["vertumnus_rank_compute_s"]["median"] * 1e3
        print(f"{n:>7} {v_ms:>8.1f}ms {o_ms:>8.1f}ms {r['ratio']:>6.2f}x {c_ms:>11.1f}ms")
    figures = {
        "folder": {"hidden": args.hidden, "layers": args.layers, "head_dim": 64},
        "dtype": dtype,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "rows": rows,
    }
    session.finish(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
