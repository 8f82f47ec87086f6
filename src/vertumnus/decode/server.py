"""The reference decode server's HTTP API (aiohttp, orjson)::

    POST /v1/completions        OpenAI completions and chat completions, read by
    POST /v1/chat/completions   ``protocol/request.py``: pull each prompt's KV from
                                the prefill pool, decode every choice, answer as
                                JSON or as server-sent events (``stream``)
    GET  /v1/models             the served model
    GET  /v1/models/{model_id}  the served model, or 404
    GET  /health

A request with ``kv_transfer_params`` (a proxy's: one object per prompt, as the
prefill pool answered them) pulls the KV they name from
``{remote_scheme}://{remote_host}:{remote_port}``; without them this server asks its
prefill pool for the prefills first (``handoff.py``). The steps run on the decode
thread (``loop.py``), whose tokens each request relays (``answers.py``). A client
that goes away (its handler cancelled, its stream broken, its connection closed)
takes its sequences out of the batch.

Errors are JSON ``{"error": {"message", "type", "param", "code"}}``: 400 naming the
field for what the client sent, 404 for another ``model``; for the hand-off, the
pool's 400 and 503 pass through and anything else is a 502 ``handoff_error`` that
quotes the pool. Once a stream has begun, a failure is one ``data: {"error": ...}``
event, and the stream ends. With an API key, ``/v1/*`` needs ``Authorization: Bearer
<key>`` (compared in constant time).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from vertumnus.decode.answers import DecodeFailed, answer_json, answer_stream
from vertumnus.decode.engine import DecodeEngine
from vertumnus.decode.handoff import handoff, handoff_error
from vertumnus.decode.keys import (
    RESOURCES,
    SERVED,
    SETTINGS,
    TOKENIZER,
    DecodeSettings,
    Resources,
)
from vertumnus.decode.loop import DecodeLoop
from vertumnus.decode.timings import Timings
from vertumnus.http_json import (
    bad_request,
    bearer,
    error_response,
    json_errors,
    json_response,
    matches,
    model_list,
    parse_json,
)
from vertumnus.kv_wire import HandoffError
from vertumnus.protocol.answers import Answer
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.request import Served, parse
from vertumnus.protocol.tokenizer import Tokenizer

MAX_BODY_BYTES = 16 * 1024 * 1024
log = structlog.get_logger("vertumnus.decode")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    try:
        body = parse_json(request.content_type, await request.read())
        req = parse(body, request.app[SERVED], chat)
        kv = await handoff(request, req)
    except BadRequest as exc:
        return bad_request(exc)
    except HandoffError as exc:
        log.warning("handoff_failed", kind=exc.kind, status=exc.status, error=str(exc))
        return handoff_error(exc)
    answer = Answer(req, request.app[TOKENIZER], kv.prompt_logprobs)
    timings = Timings(kv.handoff_s, kv.handoff_bytes, kv.prefill_s)
    pending = kv.take()  # handed to the decode thread, then dropped
    if req.stream:
        response = await answer_stream(request, answer, pending, timings)
    else:
        try:
            response = await answer_json(request, answer, pending, timings)
        except DecodeFailed as exc:
            log.warning("decode_failed", error=str(exc), **answer.usage())
            return error_response(500, str(exc), "decode_error")
    if answer.finished:
        log.info(
            "completion",
            chat=chat,
            prompts=len(req.prompts),
            choices=len(answer.choices),
            **answer.usage(),
            finish_reasons=sorted({str(c.finish_reason) for c in answer.choices}),
            stream=req.stream,
            **timings.as_dict(),
        )
    return response


async def models(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    return model_list(served.model, served.max_model_len)


async def model(request: web.Request) -> web.Response:
    """One model by its id: the served one (as listed), or a 404 as vLLM answers."""
    served, name = request.app[SERVED], request.match_info["model_id"]
    if name != served.model:
        return bad_request(BadRequest(f"The model `{name}` does not exist.", "model", 404))
    entry = {
        "id": served.model,
        "object": "model",
        "owned_by": "vertumnus",
        "max_model_len": served.max_model_len,
    }
    return json_response(entry)


async def health(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    return json_response(
        {
            "status": "ok",
            "model": settings.served_model,
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
    cfg = settings.model
    app[SERVED] = Served(
        settings.served_model, tokenizer, cfg.vocab_size, cfg.max_position_embeddings
    )
    app[RESOURCES] = Resources(DecodeLoop(engine))
    app.cleanup_ctx.append(_lifetime)
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.post("/v1/chat/completions", chat_completions),
            web.get("/v1/models", models),
            web.get("/v1/models/{model_id:.+}", model),
            web.get("/health", health),
        ]
    )
    return app
