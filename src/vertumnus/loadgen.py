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

With ``output_tokens`` 1 (the default) each request is a prefill,
``POST /v1/prefill``, and TTFT is what the client sees, from sending the request to
its answer (the server's own TTFT is kept beside it). With N > 1 it is a generation,
measured as ``vllm bench serve`` does: ``POST /v1/completions`` with ``max_tokens``
N, ``stream``, ``temperature`` 0 and ``ignore_eos``, its server-sent events read as
they arrive (one ``data:`` line, one event). TTFT runs to the first token event,
the ITLs are the gaps between token events, the latency runs to the last one, and
TPOT = (latency - TTFT) / (output tokens - 1), counting the events' ``token_ids``.
A stream that ends before ``data: [DONE]``, brings an error event or no token fails.

The results use the field names of ``vllm bench serve``: duration, completed,
failed, request_throughput, total_input_tokens, {mean,median,p90,p99}_ttft_ms,
token_slo_attainment, token_hit_rate; with N > 1 also total_output_tokens,
output_throughput (tokens/s) and {mean,median,p90,p99}_{tpot,itl}_ms, over the
completed requests. A request that fails is counted in ``failed``, with its error,
and never dropped. token_hit_rate counts the answers that say what was cached; a
stream whose usage does not say it is left out (none saying: NaN).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from vertumnus.sim.traces import MOONCAKE_BLOCK_TOKENS, Trace
from vertumnus.slo import TtftSlo
from vertumnus.stats import percentile, progress

if TYPE_CHECKING:
    from aiohttp import ClientSession


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
    cached_tokens: int | None = 0  # None: the answer did not say (a stream may not)
    worker: int | None = None
    cp_degree: int | None = None
    error: str | None = None
    # Generation (output_tokens > 1) only:
    output_tokens: int = 0  # counted from the events' token_ids
    latency_s: float | None = None  # from sending to the last token event
    itl_s: list[float] = field(default_factory=list)  # gaps between token events
    server_tpot_s: float | None = None  # the server's own, when its last event says

    @property
    def tpot_s(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1); None below two tokens."""
        if self.output_tokens < 2 or self.latency_s is None or self.ttft_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    outcomes: list[Outcome]
    duration_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    output_tokens: int = 1  # asked of each request (1: prefill only)


_JSON = {"Content-Type": "application/json"}


async def run(
    url: str,
    requests: Sequence[LoadRequest],
    max_concurrency: int = 64,
    duration_s: float | None = None,
    timeout_s: float = 300.0,
    progress: Callable[[int, int], None] | None = None,
    output_tokens: int = 1,
) -> LoadResult:
    """Send ``requests`` open-loop at their arrival times; answers, or errors, for all.
    ``output_tokens`` 1 asks for prefills, more streams completions of that length."""
    import aiohttp

    if output_tokens < 1:
        raise ValueError("output_tokens must be >= 1")
    gate = asyncio.Semaphore(max_concurrency)
    outcomes: list[Outcome] = []
    done = 0
    start = time.perf_counter()
    todo = [r for r in requests if duration_s is None or r.arrival_s < duration_s]

    async def one(session: ClientSession, req: LoadRequest) -> None:
        nonlocal done
        delay = req.arrival_s - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            sent = time.perf_counter()
            out = Outcome(req.index, req.input_tokens, sent - start)
            try:
                if output_tokens == 1:
                    await _prefill(session, url, req, out, sent)
                else:
                    await _stream(session, url, req, output_tokens, out, sent)
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
    return LoadResult(outcomes, time.perf_counter() - start, output_tokens=output_tokens)


def _http_error(status: int, data: bytes) -> str:
    body = orjson.loads(data)
    return f"HTTP {status}: {body.get('error', {}).get('message')}"


async def _prefill(
    session: ClientSession, url: str, req: LoadRequest, out: Outcome, sent: float
) -> None:
    """``POST /v1/prefill``; TTFT is the whole answer's time."""
    payload = orjson.dumps({"token_ids": list(req.token_ids)})
    async with session.post(f"{url}/v1/prefill", data=payload, headers=_JSON) as resp:
        data = await resp.read()
        if resp.status != 200:
            out.error = _http_error(resp.status, data)
            return
        body = orjson.loads(data)
        out.ttft_s = time.perf_counter() - sent
        out.server_ttft_s = body["ttft_s"]
        out.server_queue_s = body.get("queue_s")
        out.server_prefill_s = body.get("prefill_s")
        out.server_rank_compute_s = body.get("rank_compute_s")
        out.cached_tokens = body["cached_tokens"]
        out.worker, out.cp_degree = body["worker"], body["cp_degree"]


async def _stream(
    session: ClientSession, url: str, req: LoadRequest, max_tokens: int, out: Outcome, sent: float
) -> None:
    """``POST /v1/completions`` streamed; the event times, as each line arrives, give
    the TTFT, the ITLs and the latency. Sets ``out.error`` unless ``[DONE]`` came
    after at least one token; what was measured before a failure stays."""
    payload = {"prompt": list(req.token_ids), "max_tokens": max_tokens, "stream": True}
    payload |= {"temperature": 0, "ignore_eos": True}  # greedy, to the length: as vLLM's
    out.cached_tokens = None
    last: float | None = None  # when the latest token event arrived
    async with session.post(
        f"{url}/v1/completions", data=orjson.dumps(payload), headers=_JSON
    ) as resp:
        if resp.status != 200:
            out.error = _http_error(resp.status, await resp.read())
            return
        async for line in resp.content:  # blank lines end events; ':' starts comments
            now = time.perf_counter()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if last is None:
                    out.error = "the stream ended with no token"
                return
            event = orjson.loads(data)
            if not isinstance(event, dict):
                raise ValueError(f"an event that is no object: {data[:80]!r}")
            if (error := event.get("error")) is not None:
                message = error.get("message") if isinstance(error, dict) else error
                kind = error.get("type") if isinstance(error, dict) else None
                out.error = f"stream error: {message} ({kind})"
                return
            if choices := event.get("choices"):
                if last is None:
                    out.ttft_s = now - sent
                else:
                    out.itl_s.append(now - last)
                last = now
                out.latency_s = now - sent
                out.output_tokens += len(choices[0].get("token_ids") or ())
            # The last event may say what was cached (OpenAI's usage), the server's
            # TTFT and its split (the proxy's timings), and its TPOT.
            details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
            out.cached_tokens = details.get("cached_tokens", out.cached_tokens)
            timings = event.get("timings") or {}
            for key in ("tpot_s", "ttft_s", "queue_s", "prefill_s", "rank_compute_s"):
                setattr(out, f"server_{key}", timings.get(key, getattr(out, f"server_{key}")))
            out.worker, out.cp_degree = event.get("worker"), event.get("cp_degree")
    out.error = f"the stream ended before [DONE], after {out.output_tokens} tokens"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _spread(name: str, values_ms: Sequence[float]) -> dict[str, float]:
    """``{mean,median,p90,p99}_<name>_ms``."""
    return {
        f"mean_{name}_ms": _mean(values_ms),
        f"median_{name}_ms": percentile(values_ms, 50),
        f"p90_{name}_ms": percentile(values_ms, 90),
        f"p99_{name}_ms": percentile(values_ms, 99),
    }


def summarize(
    result: LoadResult,
    slo: TtftSlo | None = None,
    tau_of: Callable[[int], float] | None = None,
    detailed: bool = False,
) -> dict[str, Any]:
    """vLLM-style results. ``slo`` (fixed) or ``tau_of`` (per-request rule, by input
    length) sets the targets of the token-weighted attainment. Generation runs add
    the output tokens, their throughput, TPOT and ITL, over completed requests."""
    ok = [o for o in result.outcomes if o.error is None and o.ttft_s is not None]
    ttft_ms = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    server_ms = [o.server_ttft_s * 1e3 for o in ok if o.server_ttft_s is not None]
    tokens = sum(o.input_tokens for o in result.outcomes)
    # A stream need not say what was cached: the hit rate is over those that did.
    reported = [o for o in ok if o.cached_tokens is not None]
    out: dict[str, Any] = {
        "duration": result.duration_s,
        "completed": len(ok),
        "failed": len(result.outcomes) - len(ok),
        "request_throughput": len(ok) / result.duration_s if result.duration_s else 0.0,
        "total_input_tokens": tokens,
        **_spread("ttft", ttft_ms),
        "mean_server_ttft_ms": _mean(server_ms),
        "median_server_ttft_ms": percentile(server_ms, 50),
        "p90_server_ttft_ms": percentile(server_ms, 90),
        "token_hit_rate": sum(o.cached_tokens or 0 for o in reported)
        / max(1, sum(o.input_tokens for o in reported))
        if reported or not ok
        else math.nan,
    }
    generation = result.output_tokens > 1
    if generation:
        output = sum(o.output_tokens for o in ok)
        out["total_output_tokens"] = output
        out["output_throughput"] = output / result.duration_s if result.duration_s else 0.0
        out |= _spread("tpot", [o.tpot_s * 1e3 for o in ok if o.tpot_s is not None])
        out |= _spread("itl", [gap * 1e3 for o in ok for gap in o.itl_s])
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
        out["requests"] = [_record(o, generation) for o in result.outcomes]
    return out


_GENERATION_FIELDS = ("output_tokens", "latency_s", "itl_s", "server_tpot_s")


def _record(o: Outcome, generation: bool) -> dict[str, Any]:
    record = asdict(o)
    if generation:
        return record | {"tpot_s": o.tpot_s}
    return {k: v for k, v in record.items() if k not in _GENERATION_FIELDS}


def text_summary(s: dict[str, Any]) -> str:
    """One screen: the counts and TTFT; for generation also the output tokens, then
    TPOT and ITL under ``vllm bench serve``'s section lines."""

    def row(label: str, value: str) -> str:
        return f"{label:<29} {value}"

    def spread(name: str, key: str, stats: Sequence[str]) -> list[str]:
        return [row(f"{q} {name} (ms):", f"{s[f'{q.lower()}_{key}_ms']:.2f}") for q in stats]

    generation = "total_output_tokens" in s
    lines = [
        "============ Vertumnus load generator ============",
        row("Successful requests:", f"{s['completed']}"),
        row("Failed requests:", f"{s['failed']}"),
        row("Duration (s):", f"{s['duration']:.2f}"),
        row("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        row("Total input tokens:", f"{s['total_input_tokens']}"),
    ]
    if generation:
        lines += [
            row("Total generated tokens:", f"{s['total_output_tokens']}"),
            row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            "---------------Time to First Token----------------",
        ]
    lines += spread("TTFT", "ttft", ("Mean", "Median", "P90", "P99"))
    if generation:
        lines += [
            "-----Time per Output Token (excl. 1st token)------",
            *spread("TPOT", "tpot", ("Mean", "Median", "P99")),
            "---------------Inter-token Latency----------------",
            *spread("ITL", "itl", ("Mean", "Median", "P99")),
            "==================================================",
        ]
    if not math.isnan(s["token_hit_rate"]):
        lines.append(row("Token hit rate:", f"{s['token_hit_rate']:.3f}"))
    if "token_slo_attainment" in s:
        lines.append(f"Token SLO attainment ({s['ttft_slo']}): {s['token_slo_attainment']:.3f}")
    if s["errors"]:
        lines.append(row("Errors:", f"{s['errors']}"))
    return "\n".join(lines)


def terminal_progress(done: int, total: int) -> None:
    progress(done, total, "requests")
