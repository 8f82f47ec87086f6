"""What the completions and prefill routes answer, as JSON: a prefill's result or
the error for what stopped it, the one-token completion the pool answers itself,
and a decode server's answer (whole, or its last streamed event) with the pool's
share of the request: where the time went (queue, prefill, hand-off, first decode
step, time per output token), the worker and the cached tokens. Sends nothing:
``proxy.py`` relays, the routes respond."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from vertumnus.runtime.coordinator import Coordinator, Overloaded, Unavailable
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.request_path import InternalError, PrefillResult
from vertumnus.server.http import error_response


async def serve_prefill(
    coord: Coordinator, tokens: list[int], handoff: bool, overloaded_retry_s: int = 1
) -> PrefillResult | web.Response:
    """The coordinator's answer, or the error response for what stopped it (503s
    with a ``Retry-After``: ``overloaded_retry_s`` when the pool is full, 2 s when
    it is unavailable)."""
    try:
        return await coord.prefill(tokens, handoff)
    except Overloaded as exc:
        return error_response(
            503, f"overloaded: {exc}", "overloaded", retry_after_s=overloaded_retry_s
        )
    except (Unavailable, RanksError) as exc:
        return error_response(503, f"unavailable: {exc}", "unavailable", retry_after_s=2)
    except InternalError as exc:  # (logged with its traceback where it happened)
        return error_response(500, f"internal error: {exc}", "internal_error")


def first_token_completion(
    result: PrefillResult, text: str, model: str, num_prompt_tokens: int
) -> dict[str, Any]:
    """A completion of one token, the prefill's own (``text``: the token decoded)."""
    return {
        "id": f"cmpl-{result.request_id}",
        "object": "text_completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "token_ids": [result.first_token],
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": num_prompt_tokens + 1,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        },
    }


def with_pool_share(data: bytes, result: PrefillResult, arrived: float) -> bytes:
    """A decode server's whole answer, with the pool's share of the request."""
    out = orjson.loads(data)
    out["timings"] = timings(result, out.get("timings", {}), arrived)
    out["worker"], out["cp_degree"] = result.worker, result.cp_degree
    usage = out.setdefault("usage", {})
    usage["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    return orjson.dumps(out)


def last_event(line: bytes, result: PrefillResult, arrived: float) -> bytes:
    """The decode server's last event (it carries the usage): with the pool's
    share of the request, as a non-streamed answer has it."""
    event = orjson.loads(line[len(b"data: ") :])
    event["timings"] = timings(result, event.get("timings") or {}, arrived)
    event["worker"], event["cp_degree"] = result.worker, result.cp_degree
    usage = event.get("usage")
    if isinstance(usage, dict):
        usage["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    return b"data: " + orjson.dumps(event) + b"\n"


def timings(result: PrefillResult, decode: dict[str, Any], arrived: float) -> dict[str, Any]:
    """TTFT split into queue, prefill, hand-off and first decode step."""
    handoff_s = float(decode.get("handoff_s", 0.0))
    first_step_s = float(decode.get("first_step_s", 0.0))
    return {
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
