"""The reference decode server's HTTP API (aiohttp, orjson)::

    POST /v1/completions   the OpenAI completions subset (one prompt): pull the
                           prompt's KV from the prefill pool, decode, answer as JSON
                           or as server-sent events (``stream``)
    GET  /v1/models        the served model
    GET  /health

A request with ``kv_transfer_params`` (a proxy's, as the prefill pool answered them)
pulls the KV they name from ``{remote_scheme}://{remote_host}:{remote_port}``; without them
this server asks its prefill pool for the prefill first (``kv_client``). The steps
run on the decode thread (``DecodeLoop``); each request waits on an asyncio queue
that thread feeds through ``loop.call_soon_threadsafe``. A client that goes away
(its handler cancelled, its stream broken, its connection closed) takes its
sequence out of the batch.

Errors are JSON ``{"error": {"message", "type"}}``: 400 naming the field for what
the client sent; for the hand-off, the pool's 400 and 503 pass through and anything
else is a 502 ``handoff_error`` that quotes the pool. Once a stream has begun, a
failure is one ``data: {"error": ...}`` event, and the stream ends. With an API key,
``/v1/*`` needs ``Authorization: Bearer <key>`` (compared in constant time).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from vertumnus.config import ModelConfig
from vertumnus.decode.completion import (
    Completion,
    Detokenizer,
    Generation,
    parse_completion,
)
from vertumnus.decode.dist_client import pull_dist
from vertumnus.decode.engine import DecodeEngine, StepOutput
from vertumnus.decode.kv_client import (
    DEFAULT_TIMEOUT_S,
    PREFILL_TIMEOUT_S,
    HandoffError,
    PulledKV,
    TransferParams,
    pull,
    release,
    request_prefill,
)
from vertumnus.decode.loop import DecodeFailure, DecodeLoop, NewSequence
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


@dataclass(frozen=True)
class DecodeSettings:
    """What the app needs besides the engine. ``prefill_url`` None: every request
    must bring ``kv_transfer_params``; ``prefill_key``: the bearer sent to the pool
    for prefills and pulls; ``api_key``: guards ``/v1/*`` here."""

    model: ModelConfig
    eos_token_ids: tuple[int, ...] = ()
    prefill_url: str | None = None
    prefill_key: str | None = None
    api_key: str | None = None
    pool_timeout_s: float = DEFAULT_TIMEOUT_S  # connect, and between two reads of a pull
    # How the KV travels: "http" (the pull stream) or "dist" (the pool's ranks send it
    # point to point; ``dist_host``: this server's address as they reach it)
    transport: str = "http"
    dist_host: str = "127.0.0.1"
    prefill_timeout_s: float = PREFILL_TIMEOUT_S  # for the answer of a prefill we ask for


SETTINGS = web.AppKey("settings", DecodeSettings)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)


@dataclass
class Resources:
    """What lives as long as the app: the decode thread (started with the app,
    closed at its cleanup) and the client session to the prefill pool."""

    decode: DecodeLoop
    session: aiohttp.ClientSession | None = None

    def pool_session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the app has not started")
        return self.session


RESOURCES = web.AppKey("resources", Resources)


class DecodeFailed(RuntimeError):
    pass


async def _handoff(request: web.Request, req: Completion) -> tuple[PulledKV, float | None]:
    """The prompt's KV (``PulledKV``) and the seconds of the prefill this server asked
    for (None when the request brought ``kv_transfer_params``)."""
    settings, session = request.app[SETTINGS], request.app[RESOURCES].pool_session()
    key, timeout_s = settings.prefill_key, settings.pool_timeout_s
    transfer, prefill_s = req.transfer, None
    if transfer is None:
        if settings.prefill_url is None:
            raise BadRequest("'kv_transfer_params' is needed: this server has no prefill pool")
        start = time.perf_counter()
        params = await request_prefill(
            settings.prefill_url,
            req.token_ids,
            key,
            session=session,
            timeout_s=settings.prefill_timeout_s,
        )
        prefill_s = time.perf_counter() - start
        try:
            transfer = TransferParams.parse(params)
        except ValueError as exc:
            raise HandoffError(f"the prefill pool's answer: {exc}", "malformed") from None
    n = len(req.token_ids) - 1
    if transfer.num_tokens != n:
        try:  # nobody will pull it: let the pool free it now
            await release(transfer.base_url, transfer.handle, key, session=session, timeout_s=5.0)
        except HandoffError as exc:
            log.warning("release_failed", handle=transfer.handle, error=str(exc))
        raise BadRequest(
            f"'kv_transfer_params.num_tokens' is {transfer.num_tokens}; a prompt of "
            f"{len(req.token_ids)} tokens needs the KV of {n}"
        )
    fetch = (
        pull
        if settings.transport == "http"
        else partial(pull_dist, host=settings.dist_host, session=session)
    )
    pulled = await fetch(
        transfer.base_url, transfer.handle, key, model=settings.model, timeout_s=timeout_s
    )
    if pulled.header.num_tokens != n:
        raise BadRequest(
            f"the pulled KV holds {pulled.header.num_tokens} tokens; a prompt of "
            f"{len(req.token_ids)} tokens needs {n}"
        )
    return pulled, prefill_s


def _handoff_error(exc: HandoffError) -> web.Response:
    if exc.status == 400:
        return error_response(400, str(exc), "invalid_request_error")
    if exc.status == 503:
        return error_response(503, str(exc), "unavailable", retry_after_s=1)
    return error_response(502, str(exc), "handoff_error")


async def _decode(request: web.Request, run: Generation) -> AsyncGenerator[StepOutput, None]:
    """The sequence's tokens as the decode thread chooses them (recorded in ``run``);
    the sequence leaves the batch if the consumer stops early (the client went away).
    Use under ``aclosing``, so that leaving happens when the consumer stops."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[StepOutput | DecodeFailure, float]] = asyncio.Queue()

    def deliver(event: StepOutput | DecodeFailure, at: float) -> None:  # decode thread
        loop.call_soon_threadsafe(queue.put_nowait, (event, at))

    decode, req = request.app[RESOURCES].decode, run.req
    eos = request.app[SETTINGS].eos_token_ids
    if run.pulled is None:
        raise RuntimeError("this generation was handed to the decode thread already")
    new = NewSequence(
        run.pulled.prompt,
        req.token_ids[-1],
        req.params,
        req.max_tokens,
        eos,
        req.ignore_eos,
        run.pulled.release,
    )
    run.pulled = None
    run.submitted = time.perf_counter()
    seq_id = decode.submit(new, deliver)
    del new  # the decode thread holds the prompt's KV until it has joined the batch
    finished = False
    try:
        while not finished:
            event, at = await queue.get()
            if isinstance(event, DecodeFailure):
                finished = True
                raise DecodeFailed(event.message)
            finished = event.finish_reason is not None
            run.ids.append(event.token_id)
            run.times.append(at)
            run.finish_reason = event.finish_reason
            yield event
    finally:
        if not finished:
            decode.cancel(seq_id)


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def _answer_json(request: web.Request, run: Generation) -> web.StreamResponse:
    async with aclosing(_decode(request, run)) as tokens:
        async for _ in tokens:
            if _client_gone(request):  # a backstop: handlers are cancelled on disconnect
                log.info("client_gone", completion_tokens=len(run.ids))
                return web.Response(status=499)
    return json_response(run.answer(request.app[TOKENIZER].decode(run.ids)))


def _event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _answer_stream(request: web.Request, run: Generation) -> web.StreamResponse:
    """One event per token (the last with ``finish_reason``, ``usage`` and
    ``timings``), then ``[DONE]``; a failure is one error event, then the end."""
    stream = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await stream.prepare(request)
    text = Detokenizer(request.app[TOKENIZER])
    tail = b"data: [DONE]\n\n"
    try:
        try:
            async with aclosing(_decode(request, run)) as tokens:
                async for out in tokens:
                    piece = text.add(out.token_id, last=out.finish_reason is not None)
                    await stream.write(_event(run.chunk(piece)))
        except DecodeFailed as exc:
            log.warning("decode_failed", error=str(exc), completion_tokens=len(run.ids))
            tail = _event({"error": {"message": str(exc), "type": "decode_error"}})
        except Exception as exc:  # a bug: the headers are sent, so it ends the stream
            if isinstance(exc, ConnectionResetError):
                raise
            log.exception("internal_error", path=request.path, error=repr(exc))
            message = f"internal error: {type(exc).__name__}"
            tail = _event({"error": {"message": message, "type": "internal_error"}})
        await stream.write(tail)
        await stream.write_eof()
    except ConnectionResetError:
        log.info("client_gone", completion_tokens=len(run.ids))
    return stream


async def completions(request: web.Request) -> web.StreamResponse:
    tokenizer, cfg = request.app[TOKENIZER], request.app[SETTINGS].model
    try:
        body = parse_json(request.content_type, await request.read())
        req = parse_completion(body, tokenizer, cfg)
        pulled, prefill_s = await _handoff(request, req)
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request_error")
    except HandoffError as exc:
        log.warning("handoff_failed", kind=exc.kind, status=exc.status, error=str(exc))
        return _handoff_error(exc)
    run = Generation(req, pulled, prefill_s)
    del pulled  # ``run`` holds the KV until the decode thread has it
    if req.stream:
        response = await _answer_stream(request, run)
    else:
        try:
            response = await _answer_json(request, run)
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
