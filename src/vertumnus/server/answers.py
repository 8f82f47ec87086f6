"""What the completions and prefill routes answer, as JSON: a prefill's result or
the error for what stopped it (one prompt, or every prompt of a request at once),
the one-token answer the pool gives by itself, and a decode server's answer (whole,
or its streamed event that carries "timings") with the pool's share of the request:
where the time went (queue, prefill, hand-off, first decode step, time per output
token), the worker and the cached tokens. Sends nothing: ``proxy.py`` relays, the
routes respond.

The pool's share of a request of several prompts is that of its slowest prefill
(the largest ``ttft_s``: it decides when the first token can come) for ``timings``,
``worker`` and ``cp_degree``; ``usage.prompt_tokens_details.cached_tokens`` sums the
cached tokens of every prompt."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import orjson
from aiohttp import web

from vertumnus.decode.first_token import first_tokens, prompt_entries
from vertumnus.http_json import error_response
from vertumnus.protocol.answers import Answer
from vertumnus.protocol.request import GenerateRequest
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.request_path import InternalError, Overloaded, PrefillResult, Unavailable


async def serve_prefill(
    coord: Coordinator,
    tokens: list[int],
    handoff: bool,
    overloaded_retry_s: int = 1,
    prompt_logprobs: int | None = None,
) -> PrefillResult | web.Response:
    """The coordinator's answer, or the error response for what stopped it (503s
    with a ``Retry-After``: ``overloaded_retry_s`` when the pool is full, 2 s when
    it is unavailable)."""
    try:
        return await coord.prefill(tokens, handoff, prompt_logprobs)
    except Overloaded as exc:
        return error_response(
            503, f"overloaded: {exc}", "overloaded", retry_after_s=overloaded_retry_s
        )
    except (Unavailable, RanksError) as exc:
        return error_response(503, f"unavailable: {exc}", "unavailable", retry_after_s=2)
    except InternalError as exc:  # (logged with its traceback where it happened)
        return error_response(500, f"internal error: {exc}", "internal_error")


def release_leases(coord: Coordinator, results: Sequence[PrefillResult]) -> None:
    """The KV kept for these results will not be pulled: their leases end now."""
    for result in results:
        if result.handoff is not None:
            coord.handoffs.end(result.handoff.handle, "released")


async def serve_prefills(
    coord: Coordinator,
    prompts: Sequence[list[int]],
    handoff: bool,
    prompt_logprobs: int | None = None,
    overloaded_retry_s: int = 1,
) -> list[PrefillResult] | web.Response:
    """Every prompt's prefill, all at once, in prompt order; or the first failure's
    error response. A request is served whole or not at all: when one prefill fails
    (or this is cancelled), the leases the others opened are released."""
    tasks = [
        asyncio.ensure_future(
            serve_prefill(coord, tokens, handoff, overloaded_retry_s, prompt_logprobs)
        )
        for tokens in prompts
    ]
    try:
        outs = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:  # (gather cancelled the prefills still under way)
        done = [t.result() for t in tasks if t.done() and not t.cancelled() and not t.exception()]
        release_leases(coord, [o for o in done if isinstance(o, PrefillResult)])
        raise
    results = [o for o in outs if isinstance(o, PrefillResult)]
    if len(results) == len(outs):
        return results
    release_leases(coord, results)
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    return next(o for o in outs if isinstance(o, web.Response))


def slowest(results: Sequence[PrefillResult]) -> PrefillResult:
    """The prefill whose time to the first token was the longest (ties: the first)."""
    return max(results, key=lambda r: r.ttft_s)


def cached_tokens(results: Sequence[PrefillResult]) -> int:
    return sum(r.cached_tokens for r in results)


def pool_answer(
    req: GenerateRequest,
    results: Sequence[PrefillResult],
    tokenizer: Tokenizer,
    eos_token_ids: tuple[int, ...],
    arrived: float,
) -> dict[str, Any]:
    """The whole answer to a request the pool serves alone (``max_tokens`` 0 or 1,
    not streamed): each copy's token chosen from its prompt's last logits, with the
    pool's share of the request."""
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        prompt_logprobs = []
        for prompt, result in zip(req.prompts, results, strict=True):
            got = result.prompt_logprobs
            assert got is not None, "the prefill was asked for its prompt's log-probabilities"
            entries = prompt_entries(
                prompt.token_ids, got.token_logprobs, got.top_ids, got.top_values
            )
            prompt_logprobs.append(entries)
    answer = Answer(req, tokenizer, prompt_logprobs)
    for p, (prompt, result) in enumerate(zip(req.prompts, results, strict=True)):
        copies = answer.choices[p * req.best_of : (p + 1) * req.best_of]
        chosen = first_tokens(result.logits, req, prompt, eos_token_ids)
        if not chosen:  # max_tokens 0: the echo alone
            for choice in copies:
                choice.finish_reason = "length"
            continue
        for choice, (entry, finish_reason) in zip(copies, chosen, strict=True):
            choice.add(entry, finish_reason)
    out = answer.body()
    out["usage"]["prompt_tokens_details"] = {"cached_tokens": cached_tokens(results)}
    critical = slowest(results)
    out["timings"] = timings(critical, {}, arrived)
    out["worker"], out["cp_degree"] = critical.worker, critical.cp_degree
    return out


def with_pool_share(
    data: bytes, results: Sequence[PrefillResult], arrived: float
) -> tuple[bytes, int]:
    """A decode server's whole answer, with the pool's share of the request, and
    its generated tokens."""
    out = orjson.loads(data)
    decoded = int((out.get("timings") or {}).get("decoded_tokens") or 0)
    critical = slowest(results)
    out["timings"] = timings(critical, out.get("timings") or {}, arrived)
    out["worker"], out["cp_degree"] = critical.worker, critical.cp_degree
    usage = out.setdefault("usage", {})
    usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens(results)}
    return orjson.dumps(out), int(usage.get("completion_tokens") or decoded)


def decoded_tokens(line: bytes) -> int | None:
    """The generated tokens of a stream, from its event with "timings" (this
    project's decode server), else from its final usage event (vLLM's, with
    ``include_usage``); None for any other event."""
    if not line.startswith(b"data: {") or (
        b'"decoded_tokens"' not in line and b'"usage"' not in line
    ):
        return None
    event = orjson.loads(line[len(b"data: ") :])
    timings, usage = event.get("timings"), event.get("usage")
    if isinstance(timings, dict) and "decoded_tokens" in timings:
        return int(timings["decoded_tokens"] or 0)
    if event.get("choices") == [] and isinstance(usage, dict) and timings is None:
        return int(usage.get("completion_tokens") or 0)
    return None


def last_event(line: bytes, results: Sequence[PrefillResult], arrived: float) -> bytes:
    """A decode server's streamed event, with the pool's share of the request if it
    is the one event that carries "timings" (the stream's last before ``[DONE]``);
    any other line as it is. Usage gets the cached tokens where it is present (the
    final ``choices: []`` event, with ``stream_options.include_usage``)."""
    if not line.startswith(b"data: {") or b'"timings"' not in line:
        return line
    event = orjson.loads(line[len(b"data: ") :])
    if not isinstance(event.get("timings"), dict):  # (a token's text named so, say)
        return line
    critical = slowest(results)
    event["timings"] = timings(critical, event["timings"], arrived)
    event["worker"], event["cp_degree"] = critical.worker, critical.cp_degree
    usage = event.get("usage")
    if isinstance(usage, dict):
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens(results)}
    return b"data: " + orjson.dumps(event) + b"\n"


def timings(result: PrefillResult, decode: dict[str, Any], arrived: float) -> dict[str, Any]:
    """TTFT split into queue, prefill, hand-off and first decode step: the decode
    server's ``timings`` (``decode``) with the pool's share over them."""
    handoff_s = float(decode.get("handoff_s") or 0.0)
    first_step_s = float(decode.get("first_step_s") or 0.0)
    return {
        **decode,
        "queue_s": round(result.queue_s, 6),
        "prefill_s": round(result.prefill_s, 6),
        "rank_compute_s": round(result.rank_compute_s, 6),
        "handoff_s": round(handoff_s, 6),
        "handoff_bytes": decode.get("handoff_bytes"),
        "first_step_s": round(first_step_s, 6),
        "ttft_s": round(result.ttft_s + handoff_s + first_step_s, 6),
        "tpot_s": decode.get("tpot_s"),
        "total_s": round(time.perf_counter() - arrived, 6),
    }
