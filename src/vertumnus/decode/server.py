"""The reference decode server's HTTP API (aiohttp, orjson)::

    POST /v1/completions   the OpenAI completions subset (one prompt): pull the
                           prompt's KV from the prefill pool, decode, answer as JSON
                           or as server-sent events (``stream``)
    GET  /v1/models        the served model
    GET  /health

A request with ``kv_transfer_params`` (a proxy's, as the prefill pool answered them)
pulls the KV they name from ``{remote_scheme}://{remote_host}:{remote_port}``; without them
this server asks its prefill pool for the prefill first (``handoff.py``). The steps
run on the decode thread (``loop.py``), whose tokens each request relays
(``answers.py``). A client that goes away (its handler cancelled, its stream
broken, its connection closed) takes its sequence out of the batch.

Errors are JSON ``{"error": {"message", "type"}}``: 400 naming the field for what
the client sent; for the hand-off, the pool's 400 and 503 pass through and anything
else is a 502 ``handoff_error`` that quotes the pool. Once a stream has begun, a
failure is one ``data: {"error": ...}`` event, and the stream ends. With an API key,
``/v1/*`` needs ``Authorization: Bearer <key>`` (compared in constant time).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from vertumnus.decode.answers import DecodeFailed, answer_json, answer_stream
from vertumnus.decode.completion import Generation, parse_completion
from vertumnus.decode.engine import DecodeEngine
from vertumnus.decode.handoff import handoff, handoff_error
from vertumnus.decode.keys import RESOURCES, SETTINGS, TOKENIZER, DecodeSettings, Resources
from vertumnus.decode.kv_client import HandoffError
from vertumnus.decode.loop import DecodeLoop
from vertumnus.server.http import (
    BadRequest,
    bearer,
    error_response,
    json_errors,
    json_response,
    matches,
    model_list,
    parse_json,
)
from vertumnus.server.tokenizer import Tokenizer

MAX_BODY_BYTES = 16 * 1024 * 1024
log = structlog.get_logger("vertumnus.decode")


async def completions(request: web.Request) -> web.StreamResponse:
    tokenizer, cfg = request.app[TOKENIZER], request.app[SETTINGS].model
    try:
        body = parse_json(request.content_type, await request.read())
        req = parse_completion(body, tokenizer, cfg)
        pulled, prefill_s = await handoff(request, req)
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request_error")
    except HandoffError as exc:
        log.warning("handoff_failed", kind=exc.kind, status=exc.status, error=str(exc))
        return handoff_error(exc)
    run = Generation(req, pulled, prefill_s)
    del pulled  # ``run`` holds the KV until the decode thread has it
    if req.stream:
        response = await answer_stream(request, run)
    else:
        try:
            response = await answer_json(request, run)
        except DecodeFailed as exc:
            log.warning("decode_failed", error=str(exc), completion_tokens=len(run.ids))
            return error_response(500, str(exc), "decode_error")
    if run.finish_reason is not None:
        log.info(
            "completion",
            prompt_tokens=len(req.token_ids),
            completion_tokens=len(run.ids),
            finish_reason=run.finish_reason,
            stream=req.stream,
            **run.timings(),
        )
    return response


async def models(request: web.Request) -> web.Response:
    cfg = request.app[SETTINGS].model
    return model_list(cfg.name, cfg.max_position_embeddings)


async def health(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    return json_response(
        {
            "status": "ok",
            "model": settings.model.name,
            "active_sequences": request.app[RESOURCES].decode.num_active,
            "prefill_url": settings.prefill_url,
        }
    )


@web.middleware
async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With an API key, every ``/v1/*`` call must carry it."""
    key = request.app[SETTINGS].api_key
    if key is not None and request.path.startswith("/v1/") and not matches(bearer(request), key):
        return error_response(
            401,
            "a valid API key is needed: 'Authorization: Bearer <key>'",
            "unauthorized",
            headers={"WWW-Authenticate": 'Bearer realm="vertumnus"'},
        )
    return await handler(request)


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    resources = app[RESOURCES]
    resources.decode.start()
    try:
        async with aiohttp.ClientSession() as session:  # timeouts: per call (kv_client)
            resources.session = session
            yield
    finally:
        await asyncio.get_running_loop().run_in_executor(None, resources.decode.close)


def build_app(
    engine: DecodeEngine, tokenizer: Tokenizer, settings: DecodeSettings
) -> web.Application:
    """The decode server's app; its decode thread starts with the app and stops at
    its cleanup (what is still decoding then fails)."""
    app = web.Application(
        client_max_size=MAX_BODY_BYTES, middlewares=[json_errors("vertumnus.decode"), access]
    )
    app[TOKENIZER], app[SETTINGS] = tokenizer, settings
    app[RESOURCES] = Resources(DecodeLoop(engine))
    app.cleanup_ctx.append(_lifetime)
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.get("/v1/models", models),
            web.get("/health", health),
        ]
    )
    return app
