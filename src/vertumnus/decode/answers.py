"""A completion's answer from the decode thread (``DecodeLoop``): its sequence
submitted, its tokens relayed from that thread through an asyncio queue
(``loop.call_soon_threadsafe``), and answered as JSON once done or as server-sent
events as they come. A client that goes away takes its sequence out of the batch.
Not here: the hand-off (``handoff.py``), the routes (``server.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson
import structlog
from aiohttp import web

from vertumnus.decode.completion import Detokenizer, Generation
from vertumnus.decode.engine import StepOutput
from vertumnus.decode.keys import RESOURCES, SETTINGS, TOKENIZER
from vertumnus.decode.loop import DecodeFailure, NewSequence
from vertumnus.server.http import json_response

log = structlog.get_logger("vertumnus.decode")


class DecodeFailed(RuntimeError):
    pass


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
    (seq_id,) = decode.submit(new, deliver)  # one copy
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


async def answer_json(request: web.Request, run: Generation) -> web.StreamResponse:
    async with aclosing(_decode(request, run)) as tokens:
        async for _ in tokens:
            if _client_gone(request):  # a backstop: handlers are cancelled on disconnect
                log.info("client_gone", completion_tokens=len(run.ids))
                return web.Response(status=499)
    return json_response(run.answer(request.app[TOKENIZER].decode(run.ids)))


def _event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def answer_stream(request: web.Request, run: Generation) -> web.StreamResponse:
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
