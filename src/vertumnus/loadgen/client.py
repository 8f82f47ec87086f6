"""The load generator's client: requests sent open-loop, each answer measured.

Requests are sent at their arrival times, at most ``max_concurrency`` in flight.
With ``output_tokens`` 1 (the default) each request is a prefill,
``POST /v1/prefill``, and TTFT is what the client sees, from sending the request to
its answer (the server's own TTFT is kept beside it). With N > 1 it is a generation,
measured as ``vllm bench serve`` does: ``POST /v1/completions`` with ``max_tokens``
N, ``stream``, ``temperature`` 0 and ``ignore_eos``, its server-sent events read as
they arrive (one ``data:`` line, one event). TTFT runs to the first token event,
the ITLs are the gaps between token events, the latency runs to the last one, and
TPOT = (latency - TTFT) / (output tokens - 1), counting the events' ``token_ids``.
A stream that ends before ``data: [DONE]``, brings an error event or no token fails.
A request that fails keeps its error in its ``Outcome``, and is never dropped. Not
owned here: the summary (``report``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from vertumnus.loadgen.workloads import LoadRequest
from vertumnus.stats import progress

if TYPE_CHECKING:
    from aiohttp import ClientSession


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


def terminal_progress(done: int, total: int) -> None:
    progress(done, total, "requests")
