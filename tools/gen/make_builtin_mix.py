"""Write the built-in length mix of ``vertumnus capacity`` from a Mooncake trace.

    .venv/bin/python -m tools.gen.make_builtin_mix ../shared/traces/conversation_trace.jsonl

A systematic sample (every ``--every``-th request) of the trace, each with the prefix
an unbounded cache would hold when it arrives (whole 512-token blocks seen in earlier
requests). Output: ``src/vertumnus/data/mix-mooncake-conversation.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vertumnus.capacity import BUILTIN_MIX
from vertumnus.traces import load_trace

OUT = Path(__file__).resolve().parents[2] / "src/vertumnus/data" / f"mix-{BUILTIN_MIX}.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--every", type=int, default=24)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    trace = load_trace(args.trace)
    cached = trace.cached_tokens_unbounded()
    rows = [
        f"{req.input_tokens},{p}"
        for i, (req, p) in enumerate(zip(trace.requests, cached, strict=True))
        if i % args.every == 0
    ]
    args.out.write_text("input_tokens,cached_tokens\n" + "\n".join(rows) + "\n")
    lengths = sorted(int(r.split(",")[0]) for r in rows)
    reuse = sum(int(r.split(",")[1]) for r in rows) / sum(lengths)
    print(
        f"{len(rows)} requests from {args.trace}: median input {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}, prefix reuse {100 * reuse:.1f}% -> {args.out}"
    )


if __name__ == "__main__":
    main()
