"""Request traces on disk: the Mooncake JSONL and Azure CSV formats, detected.

- Mooncake (``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
  [...]}`` per line): arrival in milliseconds from the trace start; ``hash_ids`` are
  chained prefix-block ids of ``MOONCAKE_BLOCK_TOKENS`` (512) tokens, the last block
  partial; equal ids mean a reusable prefix.
- Azure LLM inference 2023 (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``):
  absolute wall-clock arrivals, lengths only, no prefix information.

Both become a ``Trace``: requests sorted by arrival, arrivals in seconds from the
first one. Errors name the file and line. Pure Python, a top-level module below its
readers: the simulator, the capacity profiler, the auto start's replay
(``config/start.py``) and the load generator read traces through here. Not owned
here: synthetic workloads and rate/time transforms (the simulator's and load
generator's business).
"""

from __future__ import annotations

import csv
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from vertumnus.blocks import max_reuse_blocks

MOONCAKE_BLOCK_TOKENS = 512
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # from the trace's first arrival
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] | None  # prefix-block ids, None when the trace has none


@dataclass(frozen=True)
class Trace:
    source: str
    format: str  # "mooncake" or "azure"
    block_tokens: int | None  # tokens per entry of block_hashes
    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def cached_tokens_unbounded(self) -> list[int]:
        """Per request, the prefix an infinite cache would hold when it arrives: the
        leading blocks seen in earlier requests, whole blocks only and at least one
        token left to compute (as the engine caches). All zeros without prefix ids."""
        seen: set[int] = set()
        cached = []
        for req in self.requests:
            if req.block_hashes is None or self.block_tokens is None:
                cached.append(0)
                continue
            hits = 0
            for block in req.block_hashes:
                if block not in seen:
                    break
                hits += 1
            full_blocks = max_reuse_blocks(req.input_tokens, self.block_tokens)
            cached.append(min(hits, full_blocks) * self.block_tokens)
            seen.update(req.block_hashes)
        return cached


def load_trace(path: str | Path) -> Trace:
    """Read a Mooncake JSONL or Azure CSV trace, whichever ``path`` holds."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: {exc}") from exc
    first = text.lstrip()[:1]
    if first == "{":
        return Trace(str(path), "mooncake", MOONCAKE_BLOCK_TOKENS, tuple(_mooncake(path, text)))
    header = text.partition("\n")[0].strip().split(",")
    if tuple(h.strip() for h in header) == AZURE_HEADER:
        return Trace(str(path), "azure", None, tuple(_azure(path, text)))
    raise TraceError(
        f"{path}: unknown trace format: expected Mooncake JSONL (lines like "
        '{"timestamp": 0, "input_length": ..., "hash_ids": [...]}) or an Azure CSV with '
        f"the header {','.join(AZURE_HEADER)}"
    )


def _mooncake(path: Path, text: str) -> Iterator[TraceRequest]:
    start_ms: float | None = None
    last_ms = float("-inf")
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = orjson.loads(line)
            ts, n_in = rec["timestamp"], rec["input_length"]
            n_out, hashes = rec.get("output_length", 0), rec.get("hash_ids")
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise TraceError(f"{path}:{line_no}: not a Mooncake record ({exc})") from None
        if not _is_int(n_in) or n_in < 1 or not _is_int(n_out) or n_out < 0:
            raise TraceError(f"{path}:{line_no}: input_length must be an integer >= 1")
        if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < last_ms:
            raise TraceError(f"{path}:{line_no}: timestamps must be numbers in arrival order")
        if hashes is not None:
            want = -(-n_in // MOONCAKE_BLOCK_TOKENS)
            if not isinstance(hashes, list) or not all(_is_int(h) for h in hashes):
                raise TraceError(f"{path}:{line_no}: hash_ids must be a list of integers")
            if len(hashes) != want:
                raise TraceError(
                    f"{path}:{line_no}: {len(hashes)} hash_ids for {n_in} tokens, "
                    f"expected ceil({n_in}/{MOONCAKE_BLOCK_TOKENS}) = {want}"
                )
        last_ms = ts
        start_ms = ts if start_ms is None else start_ms
        yield TraceRequest(
            arrival_s=(ts - start_ms) / 1000.0,
            input_tokens=n_in,
            output_tokens=n_out,
            block_hashes=None if hashes is None else tuple(hashes),
        )


def _azure(path: Path, text: str) -> Iterator[TraceRequest]:
    start: dt.datetime | None = None
    last: dt.datetime | None = None
    rows = csv.reader(text.splitlines())
    next(rows)
    for line_no, row in enumerate(rows, start=2):
        if not row:
            continue
        try:
            when = dt.datetime.fromisoformat(row[0].strip())
            n_in, n_out = int(row[1]), int(row[2])
        except (ValueError, IndexError):
            raise TraceError(
                f"{path}:{line_no}: expected TIMESTAMP,ContextTokens,GeneratedTokens, "
                f"got {','.join(row)!r}"
            ) from None
        if n_in < 1 or n_out < 0:
            raise TraceError(f"{path}:{line_no}: ContextTokens must be >= 1")
        if last is not None and when < last:
            raise TraceError(f"{path}:{line_no}: timestamps must be in arrival order")
        last = when
        start = when if start is None else start
        yield TraceRequest((when - start).total_seconds(), n_in, n_out, None)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
