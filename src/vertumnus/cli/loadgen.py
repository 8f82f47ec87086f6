"""``python -m vertumnus loadgen``: drive a running server and measure it.

Replays a trace (Mooncake JSONL or Azure CSV, detected) or a synthetic workload
against ``--url`` and writes one JSON file of results in the style of
``vllm bench serve``, then prints a one-screen summary (see ``vertumnus.loadgen``).
``--output-tokens 1`` (the default) measures prefills (``/v1/prefill``); N > 1
streams completions of N tokens (``/v1/completions``) and adds TPOT and ITL.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import orjson

from vertumnus.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="Mooncake JSONL or Azure CSV")
    src.add_argument("--random", type=int, metavar="N", help="N requests of log-normal lengths")
    p.add_argument("--median-tokens", type=int, default=256, help="--random: median length")
    p.add_argument("--sigma", type=float, default=0.8, help="--random: log-normal sigma")
    p.add_argument("--prefix-groups", type=int, default=0, help="--random: shared prefixes")
    p.add_argument("--prefix-tokens", type=int, default=128, help="--random: prefix length")
    p.add_argument("--length-scale", type=float, default=1.0, help="scale trace lengths")
    p.add_argument("--vocab-size", type=int, default=256, help="token ids drawn below this")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson/gamma rate (req/s)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the trace's rate")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument(
        "--output-tokens",
        type=int,
        default=1,
        metavar="N",
        help="tokens per request: 1 = prefill only; N > 1 = streamed completions (TPOT, ITL)",
    )
    p.add_argument("--num-requests", type=int, default=None, help="first N requests only")
    p.add_argument("--duration-s", type=float, default=None, help="send for this long only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ttft-slo",
        default=None,
        help="fixed ('2.5s', '800ms') or a rule ('5x', needs --profile)",
    )
    p.add_argument("--profile", type=Path, default=None, help="for a scaled TTFT SLO")
    p.add_argument("--save-detailed", action="store_true", help="add per-request records")
    p.add_argument("--out", type=Path, required=True, metavar="RESULT.json")


def run(args: argparse.Namespace) -> int:
    from vertumnus import loadgen
    from vertumnus.perfmodel import Profile, ProfileError
    from vertumnus.slo import SloError, TtftSlo
    from vertumnus.traces import TraceError, load_trace

    try:
        if args.trace is not None:
            requests = loadgen.from_trace(
                load_trace(args.trace),
                args.length_scale,
                args.vocab_size,
                args.seed,
                args.rate_scale,
            )
        else:
            requests = loadgen.synthetic(
                args.random,
                args.median_tokens,
                args.sigma,
                args.vocab_size,
                args.seed,
                args.prefix_groups,
                args.prefix_tokens,
            )
        if args.num_requests is not None:
            requests = requests[: args.num_requests]
        if args.request_rate is not None or args.trace is None:
            rate = args.request_rate if args.request_rate is not None else 10.0
            requests = loadgen.with_arrivals(
                requests, rate * args.rate_scale, args.burstiness, args.seed
            )
        slo = TtftSlo.parse(args.ttft_slo) if args.ttft_slo else None
        tau_of = None
        if slo is not None and slo.fixed_s is None:
            if args.profile is None:
                raise ConfigError("a scaled --ttft-slo (like 5x) needs --profile")
            profile = Profile.load(args.profile)

            def tau_of(n: int) -> float:
                return slo.tau_s(n, profile.predict, profile.degrees)

        if args.max_concurrency < 1:
            raise ConfigError("--max-concurrency must be >= 1")
        if args.output_tokens < 1:
            raise ConfigError("--output-tokens must be >= 1")
        if not args.out.parent.is_dir():
            raise ConfigError(f"--out {args.out}: no directory {args.out.parent}")
    except (TraceError, SloError, ProfileError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    result = asyncio.run(
        loadgen.run(
            args.url.rstrip("/"),
            requests,
            args.max_concurrency,
            args.duration_s,
            progress=loadgen.terminal_progress,
            output_tokens=args.output_tokens,
        )
    )
    summary = loadgen.summarize(result, slo, tau_of, args.save_detailed)
    args.out.write_bytes(
        orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    print(loadgen.text_summary(summary))
    return 0
