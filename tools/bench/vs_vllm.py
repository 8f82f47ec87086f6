"""Vertumnus against vLLM itself, measured in one run with one client nobody here
wrote (``vllm bench serve``), on one random Qwen3 folder, the same cores, one dtype
(``--dtype``: ``auto`` is what ``vertumnus serve`` computes in on this CPU, bf16 where
it has bf16 in hardware, and vLLM is given the same):

    vllm            ``vllm serve`` alone, prefix caching on (the baseline)
    fixed           ``vertumnus serve``, its default composition held still, with its
                    local decode process
    adaptive        ``vertumnus serve`` on its defaults (the controller reshapes)
    vllm-decode     ``vertumnus serve`` in front of ``vllm serve`` with
                    ``VertumnusConnector``: the pool prefills, vLLM decodes

Two request streams: ``random`` (random prompts of ``--input-len`` tokens) and
``trace`` (``--trace-requests`` requests of ``conversation_trace.jsonl``'s
conversations of two turns or more, in trace order: a later turn extends an earlier
one's prompt, as a chat client resends its history; each prompt is built from text
chunks named by its hash ids, so prompts that share hash ids share prefixes;
``--chunk-words`` words per chunk, at most 64 chunks). Every
stream: ``--num-prompts`` requests at ``--request-rate`` per second,
``--output-len`` tokens out, ``ignore_eos``.

Prints TTFT mean, P50 and P99, request throughput, failures, and each system's ratio
to vLLM alone; ``--json`` writes them with the harness's machine and source.

    bash tools/vllm/setup.sh && .venv/bin/python -m tools.bench.vs_vllm --json out/vs_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tools.bench import harness
from tools.bench._serving import start_server
from tools.clients import model_folder
from tools.vllm import vllm_server

REPO = Path(__file__).resolve().parents[2]

SYSTEMS = ("vllm", "fixed", "adaptive", "vllm-decode")
SECRET = "bench-handoff-secret-0123456789"
WORDS = (
    "prefill",
    "decode",
    "cache",
    "block",
    "worker",
    "rank",
    "prompt",
    "token",
    "stream",
    "trace",
    "pool",
    "router",
    "context",
    "parallel",
    "zigzag",
    "attention",
    "layer",
    "batch",
    "queue",
    "latency",
    "throughput",
)


def trace_dataset(
    trace: Path, requests: int, chunk_words: int, path: Path, max_chunks: int = 64
) -> Path:
    """A ``custom`` dataset for ``vllm bench serve``: the first ``requests`` turns of
    the trace's multi-turn conversations (a conversation: the records whose first two
    hash ids agree; taken in the order they start, their turns in trace order), each
    prompt the text chunks of its first ``max_chunks`` hash ids. The trace's own
    windows of consecutive records hold mostly first turns hours apart from their
    follow-ups, so they share little more than a system prompt."""
    records = [json.loads(line) for line in trace.open()]
    turns: dict[tuple[int, ...], list[int]] = {}
    for i, record in enumerate(records):
        turns.setdefault(tuple(record["hash_ids"][:2]), []).append(i)
    picked: list[int] = []
    for indices in turns.values():  # in the order the conversations start
        if len(picked) >= requests:
            break
        if len(indices) >= 2:
            picked += indices
    chunks: dict[int, str] = {}
    with path.open("w") as out:
        for i in sorted(picked)[:requests]:
            parts = []
            for h in records[i]["hash_ids"][:max_chunks]:
                if h not in chunks:
                    rng = random.Random(h)
                    chunks[h] = " ".join(rng.choice(WORDS) for _ in range(chunk_words))
                parts.append(chunks[h])
            out.write(json.dumps({"prompt": " ".join(parts)}) + "\n")
    return path


def serve_config(path: Path, folder: Path, system: str, decode_url: str | None, dtype: str) -> Path:
    lines = [
        "[model]", f'name = "{folder}"',
        "[engine]", f'dtype = "{dtype}"', 'device = "cpu"',
        "[handoff]", f'secret = "{SECRET}"',
    ]  # fmt: skip
    if system == "fixed":
        lines += ["[controller]", "enabled = false"]
    if decode_url is not None:
        lines += ["[decode]", f'url = "{decode_url}"', 'engine = "vllm"']
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def running(system: str, folder: Path, work: Path, dtype: str) -> Iterator[str]:
    """The base URL of ``system`` serving ``folder``, stopped on leaving."""
    log = (work / f"{system}.log").open("w")
    procs: list[Any] = []
    try:
        if system == "vllm":
            proc, url = vllm_server.start_vllm(
                folder, log, connector=False, prefix_caching=True, dtype=dtype
            )
            procs.append(proc)
            yield url
            return
        decode_url = None
        if system == "vllm-decode":
            proc, decode_url = vllm_server.start_vllm(
                folder, log, connector=True, prefix_caching=True, prefill_key=SECRET, dtype=dtype
            )
            procs.append(proc)
        config = serve_config(work / f"{system}.toml", folder, system, decode_url, dtype)
        server, url = start_server(config, stderr=log, timeout_s=300.0)
        procs.insert(0, server)
        yield url
    finally:
        for proc in procs:
            if isinstance(proc.args, list) and "vllm.entrypoints.cli.main" in proc.args:
                vllm_server.stop(proc)
            else:
                proc.terminate()
                proc.wait(timeout=60)
        log.close()


def bench(
    url: str, folder: Path, stream: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved result."""
    name = out.name
    command = [
        str(vllm_server.VLLM_PYTHON), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", str(folder), "--tokenizer", str(folder),
        "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
        "--ignore-eos", "--seed", "0", "--save-result",
        "--result-dir", str(out.parent), "--result-filename", name,
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    if stream == "random":
        command += [
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
        ]  # fmt: skip
    else:
        command += [
            "--dataset-name", "custom", "--dataset-path", str(args.trace_file),
            "--custom-output-len", str(args.output_len), "--skip-chat-template",
            "--disable-shuffle",  # a conversation's turns in their order
        ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def row(result: dict[str, Any]) -> dict[str, Any]:
    completed = int(result.get("completed", 0))
    return {
        "completed": completed,
        "failed": int(result.get("failed", int(result.get("num_prompts", 0)) - completed)),
        "ttft_mean_ms": result["mean_ttft_ms"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "tpot_mean_ms": result.get("mean_tpot_ms"),
        "req_per_s": result["request_throughput"],
        "input_tokens": result.get("total_input_tokens"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--streams", default="random,trace")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument(
        "--trace", type=Path, default=REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"
    )
    p.add_argument("--trace-requests", type=int, default=30)
    p.add_argument("--chunk-words", type=int, default=6, help="words per trace hash id")
    p.add_argument("--hidden", type=int, default=256, help="the random Qwen3's hidden size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    harness.add_arguments(p)
    args = p.parse_args()
    import torch

    from vertumnus.engine.weights import resolve_dtype

    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    if not vllm_server.VLLM_PYTHON.exists():
        p.error("no vLLM in .venv-vllm: run tools/vllm/setup.sh")
    harness.adopt_orphans()  # vLLM's engine core outlives its parent at a stop
    session = harness.Session("vs_vllm", args)
    work = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    folder = model_folder.write_model_folder(
        work / "model", head_dim=64, hidden_size=args.hidden, layers=args.layers
    )
    args.trace_file = trace_dataset(
        args.trace, args.trace_requests, args.chunk_words, work / "trace.jsonl"
    )
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for system in systems:
        with running(system, folder, work, dtype) as url:
            for stream in args.streams.split(","):
                result = bench(url, folder, stream, args, work / f"{system}-{stream}.json")
                rows.setdefault(stream, {})[system] = row(result)
                r = rows[stream][system]
                print(
                    f"{stream:7} {system:12} TTFT mean {r['ttft_mean_ms']:8.1f} ms  P50 "
                    f"{r['ttft_p50_ms']:8.1f}  P99 {r['ttft_p99_ms']:8.1f}  "
                    f"{r['req_per_s']:.2f} req/s  failed {r['failed']}",
                    flush=True,
                )
    print("\nratios to vLLM alone (TTFT mean, P50, P99: < 1 is faster than vLLM)")
    for stream, by_system in rows.items():
        base = by_system.get("vllm")
        for system, r in by_system.items():
            if base is None or system == "vllm":
                continue
            ratios = [r[k] / base[k] for k in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms")]
            r["ratio_to_vllm"] = ratios
            print(f"{stream:7} {system:12} " + "  ".join(f"{x:5.2f}x" for x in ratios))
    figures = {
        "folder": {"hidden": args.hidden, "layers": args.layers, "head_dim": 64},
        "dtype": dtype,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "trace_file")},
        "rows": rows,
    }
    session.finish(args.json, json.loads(json.dumps(figures, default=str)))
    return 1 if any(r["failed"] for s in rows.values() for r in s.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
