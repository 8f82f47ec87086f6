"""Load generator: replay a trace or a synthetic workload against the REST API.

Workloads:
  * **Mooncake JSONL**: each ``hash_id`` becomes a deterministic block of token ids
    (seeded by the id), so equal hash ids give equal token prefixes. Each 512-token
    block becomes ``round(512 * length_scale)`` tokens, and the input length is
    scaled the same way, so a small machine keeps the trace's prefix structure.
    With ``length_scale`` = 1/32, one trace block is one 16-token engine block.
  * **Azure CSV**: lengths (scaled) and arrivals; random tokens, no shared prefix.
  * **random**: log-normal lengths.
  * **shared-prefix groups**: every request starts with one of ``prefix_groups``
    prefixes.

Arrivals come from the trace (divided by ``rate_scale``), or are Poisson or gamma at
``request_rate`` (``burstiness`` is the gamma shape). Requests are sent open-loop at
their arrival times, at most ``max_concurrency`` in flight.

The results use the field names of ``vllm bench serve``: duration, completed,
failed, request_throughput, total_input_tokens, {mean,median,p90,p99}_ttft_ms,
token_slo_attainment, token_hit_rate. TTFT is what the client sees, from sending
the request to its answer; the server's own TTFT is kept beside it. A request that
fails is counted in ``failed``, with its error, and never dropped.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from vertumnus.sim.traces import MOONCAKE_BLOCK_TOKENS, Trace
from vertumnus.slo import TtftSlo
from vertumnus.stats import percentile, progress


@dataclass(frozen=True)
class LoadRequest:
    index: int
    arrival_s: float  # from the start of the run
    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...] = ()  # the trace's prefix blocks (empty: none)
    block_tokens: int = 0  # tokens per entry of block_hashes

    @property
    def input_tokens(self) -> int:
        return len(self.token_ids)


def block_of(hash_id: int, length: int, vocab: int, seed: int) -> list[int]:
    """The token ids standing for one trace block: a function of the hash id only."""
    rng = random.Random(hash_id * 1_000_003 + seed)
    return [rng.randrange(vocab) for _ in range(length)]


def from_trace(
    trace: Trace, length_scale: float, vocab: int, seed: int = 0, rate_scale: float = 1.0
) -> list[LoadRequest]:
    if not (length_scale > 0 and rate_scale > 0):
        raise ValueError("length_scale and rate_scale must be > 0")
    block_len = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    rng = random.Random(seed)
    out = []
    for i, r in enumerate(trace.requests):
        n = max(1, round(r.input_tokens * length_scale))
        if r.block_hashes:
            tokens: list[int] = []
            for h in r.block_hashes:
                tokens += block_of(h, block_len, vocab, seed)
                if len(tokens) >= n:
                    break
            tokens = tokens[:n]
            hashes = r.block_hashes
        else:
            tokens = [rng.randrange(vocab) for _ in range(n)]
            hashes = ()
        out.append(LoadRequest(i, r.arrival_s / rate_scale, tuple(tokens), hashes, block_len))
    return out


def synthetic(
    num_requests: int,
    median_tokens: int,
    sigma: float,
    vocab: int,
    seed: int = 0,
    prefix_groups: int = 0,
    prefix_tokens: int = 0,
) -> list[LoadRequest]:
    """Log-normal lengths; with groups, each request starts with a group's prefix."""
    rng = random.Random(seed)
    groups = [[rng.randrange(vocab) for _ in range(prefix_tokens)] for _ in range(prefix_groups)]
    out = []
    for i in range(num_requests):
        n = max(1, int(rng.lognormvariate(math.log(median_tokens), sigma)))
        head = groups[rng.randrange(len(groups))][:n] if groups else []
        tail = [rng.randrange(vocab) for _ in range(n - len(head))]
        out.append(LoadRequest(i, 0.0, tuple(head + tail)))
    return out


def with_arrivals(
    requests: Sequence[LoadRequest], request_rate: float, burstiness: float, seed: int
) -> list[LoadRequest]:
    """Poisson (burstiness 1) or gamma arrivals at ``request_rate`` per second."""
    if not (request_rate > 0 and burstiness > 0):
        raise ValueError("request_rate and burstiness must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in requests:
        out.append(LoadRequest(r.index, t, r.token_ids, r.block_hashes, r.block_tokens))
        t += rng.gammavariate(burstiness, 1.0 / (burstiness * request_rate))
    return out


@dataclass
class Outcome:
    index: int
    input_tokens: int
    sent_s: float
    ttft_s: float | None = None
    server_ttft_s: float | None = None
    server_queue_s: float | None = None  # the server's split of its TTFT: queued,
    server_prefill_s: float | None = None  # then running
    server_rank_compute_s: float | None = None  # of which the slowest rank computed
    cached_tokens: int = 0
    worker: int | None = None
    cp_degree: int | None = None
    error: str | None = None


@dataclass
class LoadResult:
    outcomes: list[Outcome]
    duration_s: float
    extra: dict[str, Any] = field(default_factory=dict)


async def run(
    url: str,
    requests: Sequence[LoadRequest],
    max_concurrency: int = 64,
    duration_s: float | None = None,
    timeout_s: float = 300.0,
    progress: Callable[[int, int], None] | None = None,
) -> LoadResult:
    """Send ``requests`` open-loop at their arrival times; answers, or errors, for all."""
    import aiohttp

    gate = asyncio.Semaphore(max_concurrency)
    outcomes: list[Outcome] = []
    done = 0
    start = time.perf_counter()
    todo = [r for r in requests if duration_s is None or r.arrival_s < duration_s]

    async def one(session: aiohttp.ClientSession, req: LoadRequest) -> None:
        nonlocal done
        delay = req.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            sent = time.perf_counter()
            out = Outcome(req.index, req.input_tokens, sent - start)
            try:
                async with session.post(
                    f"{url}/v1/prefill",
                    data=orjson.dumps({"token_ids": list(req.token_ids)}),
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    body = orjson.loads(await resp.read())
                    if resp.status != 200:
                        out.error = f"HTTP {resp.status}: {body.get('error', {}).get('message')}"
                    else:
                        out.ttft_s = time.perf_counter() - sent
                        out.server_ttft_s = body["ttft_s"]
                        out.server_queue_s = body.get("queue_s")
                        out.server_prefill_s = body.get("prefill_s")
                        out.server_rank_compute_s = body.get("rank_compute_s")
                        out.cached_tokens = body["cached_tokens"]
                        out.worker, out.cp_degree = body["worker"], body["cp_degree"]
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                out.error = f"{type(exc).__name__}: {exc}"
            outcomes.append(out)
            done += 1
            if progress is not None:
                progress(done, len(todo))

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=max_concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(session, r) for r in todo))
    outcomes.sort(key=lambda o: o.index)
    return LoadResult(outcomes, time.perf_counter() - start)


def summarize(
    result: LoadResult,
    slo: TtftSlo | None = None,
    tau_of: Callable[[int], float] | None = None,
    detailed: bool = False,
) -> dict[str, Any]:
    """vLLM-style results. ``slo`` (fixed) or ``tau_of`` (per-request rule, by input
    length) sets the targets of the token-weighted attainment."""
    ok = [o for o in result.outcomes if o.error is None and o.ttft_s is not None]
    ttft_ms = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    server_ms = [o.server_ttft_s * 1e3 for o in ok if o.server_ttft_s is not None]
    tokens = sum(o.input_tokens for o in result.outcomes)
    out: dict[str, Any] = {
        "duration": result.duration_s,
        "completed": len(ok),
        "failed": len(result.outcomes) - len(ok),
        "request_throughput": len(ok) / result.duration_s if result.duration_s else 0.0,
        "total_input_tokens": tokens,
        "mean_ttft_ms": sum(ttft_ms) / len(ttft_ms) if ttft_ms else math.nan,
        "median_ttft_ms": percentile(ttft_ms, 50),
        "p90_ttft_ms": percentile(ttft_ms, 90),
        "p99_ttft_ms": percentile(ttft_ms, 99),
        "mean_server_ttft_ms": sum(server_ms) / len(server_ms) if server_ms else math.nan,
        "median_server_ttft_ms": percentile(server_ms, 50),
        "p90_server_ttft_ms": percentile(server_ms, 90),
        "token_hit_rate": sum(o.cached_tokens for o in ok)
        / max(1, sum(o.input_tokens for o in ok)),
    }
    if slo is not None or tau_of is not None:
        met = 0
        for o in ok:
            tau = tau_of(o.input_tokens) if tau_of is not None else slo.fixed_s  # type: ignore[union-attr]
            if o.ttft_s is not None and tau is not None and o.ttft_s <= tau:
                met += o.input_tokens
        out["token_slo_attainment"] = met / tokens if tokens else math.nan
        out["ttft_slo"] = slo.describe() if slo is not None else "rule"
    out["errors"] = sorted({o.error for o in result.outcomes if o.error})[:10]
    if detailed:
        out["requests"] = [
            {
                "index": o.index,
                "input_tokens": o.input_tokens,
                "sent_s": o.sent_s,
                "ttft_s": o.ttft_s,
                "server_ttft_s": o.server_ttft_s,
                "server_queue_s": o.server_queue_s,
                "server_prefill_s": o.server_prefill_s,
                "server_rank_compute_s": o.server_rank_compute_s,
                "cached_tokens": o.cached_tokens,
                "worker": o.worker,
                "cp_degree": o.cp_degree,
                "error": o.error,
            }
            for o in result.outcomes
        ]
    return out


def text_summary(s: dict[str, Any]) -> str:
    lines = [
        "============ Vertumnus load generator ============",
        f"Successful requests:          {s['completed']}",
        f"Failed requests:              {s['failed']}",
        f"Duration (s):                 {s['duration']:.2f}",
        f"Request throughput (req/s):   {s['request_throughput']:.2f}",
        f"Total input tokens:           {s['total_input_tokens']}",
        f"Mean TTFT (ms):               {s['mean_ttft_ms']:.2f}",
        f"Median TTFT (ms):             {s['median_ttft_ms']:.2f}",
        f"P90 TTFT (ms):                {s['p90_ttft_ms']:.2f}",
        f"P99 TTFT (ms):                {s['p99_ttft_ms']:.2f}",
        f"Token hit rate:               {s['token_hit_rate']:.3f}",
    ]
    if "token_slo_attainment" in s:
        lines.append(f"Token SLO attainment ({s['ttft_slo']}): {s['token_slo_attainment']:.3f}")
    if s["errors"]:
        lines.append(f"Errors:                       {s['errors']}")
    return "\n".join(lines)


def terminal_progress(done: int, total: int) -> None:
    progress(done, total, "requests")
