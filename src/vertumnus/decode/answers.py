"""A request's answer from the decode thread (``DecodeLoop``): one ``NewSequence`` per
prompt with ``best_of`` copies (forked there from the one pulled KV), each sequence's
tokens relayed from that thread through an asyncio queue
(``loop.call_soon_threadsafe``) into its ``Choice`` (copy ``j`` of prompt ``p`` is
choice ``p * best_of + j``), answered whole once every choice has finished, or as
server-sent events as they come (``protocol/answers.py`` shapes both).

A choice that a stop string ended has its sequence cancelled (what the thread still
sends for it is dropped); an echo without decode (``max_tokens`` 0) submits nothing,
and its choices end with "length". A client that goes away cancels every sequence
of its request. The answer's ``timings`` (``timings.py``) are in the whole body, and
in a stream on its last data event before ``[DONE]``: the usage event with
``stream_options.include_usage``, else the event that finished the last choice.
Not here: the hand-off (``handoff.py``), the routes (``server.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson
import structlog
from aiohttp import web

from vertumnus.decode.engine import StepOutput
from vertumnus.decode.keys import RESOURCES, SETTINGS
from vertumnus.decode.kv_pull import PulledKV
from vertumnus.decode.loop import DecodeFailure, DecodeLoop, Deliver, NewSequence
from vertumnus.decode.timings import Timings
from vertumnus.http_json import json_response
from vertumnus.protocol.answers import Answer
from vertumnus.protocol.choices import Choice
from vertumnus.protocol.errors import error_body
from vertumnus.protocol.request import GenerateRequest, Prompt

log = structlog.get_logger("vertumnus.decode")
DONE = b"data: [DONE]\n\n"


class DecodeFailed(RuntimeError):
    pass


def _submit(
    decode: DecodeLoop,
    req: GenerateRequest,
    prompt: Prompt,
    pulled: PulledKV,
    eos: tuple[int, ...],
    deliver: Deliver,
) -> list[int]:
    """The prompt's ``best_of`` copies handed to the decode thread; their seq ids."""
    new = NewSequence(
        pulled.prompt,
        prompt.token_ids[-1],
        req.params,
        req.max_tokens,
        eos,
        req.ignore_eos,
        pulled.release,
        prompt_ids=tuple(prompt.token_ids),
        stop_token_ids=req.stop_token_ids,
        min_tokens=req.min_tokens,
        logprobs=req.logprobs,
        copies=req.best_of,
    )
    return decode.submit(new, deliver)


async def _decode(
    request: web.Request, answer: Answer, pending: list[PulledKV], timings: Timings
) -> AsyncGenerator[Choice, None]:
    """Each choice as it takes a token (or ends), until all have finished; every
    sequence still decoding leaves the batch when the consumer stops early (the client
    went away). ``pending``: the prompts' pulled KV, given to the decode thread (none:
    an echo only). Use under ``aclosing``, so that leaving happens when the consumer
    stops."""
    req = answer.req
    if req.max_tokens == 0:
        for choice in answer.choices:
            choice.finish_reason = "length"
            yield choice
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[StepOutput | DecodeFailure, float]] = asyncio.Queue()

    def deliver(event: StepOutput | DecodeFailure, at: float) -> None:  # decode thread
        loop.call_soon_threadsafe(queue.put_nowait, (event, at))

    decode = request.app[RESOURCES].decode
    eos = () if req.ignore_eos else request.app[SETTINGS].eos_token_ids
    of: dict[int, Choice] = {}
    timings.start()
    try:
        for p, prompt in enumerate(req.prompts):
            seq_ids = _submit(decode, req, prompt, pending[0], eos, deliver)
            del pending[0]  # the decode thread holds it until every copy has joined
            for j, seq_id in enumerate(seq_ids):
                of[seq_id] = answer.choices[p * req.best_of + j]
        while not answer.finished:
            event, at = await queue.get()
            choice = of[event.seq_id]
            if choice.finished:  # a stop string ended it: its sequence is cancelled
                continue
            if isinstance(event, DecodeFailure):
                raise DecodeFailed(event.message)
            timings.token(choice.index, at)
            if choice.add(event.logprobs, event.finish_reason):
                decode.cancel(event.seq_id)
            yield choice
    finally:
        for kv in pending:  # not handed to the decode thread (it failed to take one)
            kv.release()
        for seq_id, choice in of.items():
            if not choice.finished:
                decode.cancel(seq_id)


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def answer_json(
    request: web.Request, answer: Answer, pending: list[PulledKV], timings: Timings
) -> web.StreamResponse:
    async with aclosing(_decode(request, answer, pending, timings)) as choices:
        async for _ in choices:
            if _client_gone(request):  # a backstop: handlers are cancelled on disconnect
                log.info("client_gone", **answer.usage())
                return web.Response(status=499)
    return json_response(answer.body() | {"timings": timings.as_dict()})


def _event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def answer_stream(
    request: web.Request, answer: Answer, pending: list[PulledKV], timings: Timings
) -> web.StreamResponse:
    """The events of each choice as it goes (``Answer.events``), the usage event
    when asked for, then ``[DONE]``; the last data event carries the ``timings``. A
    failure is one error event, then the end."""
    stream = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await stream.prepare(request)
    usage, tail = answer.req.include_usage, DONE
    try:
        try:
            async with aclosing(_decode(request, answer, pending, timings)) as choices:
                async for choice in choices:
                    events = answer.events(choice)
                    if events and answer.finished and not usage:
                        events[-1]["timings"] = timings.as_dict()
                    for event in events:
                        await stream.write(_event(event))
            if usage:
                await stream.write(_event(answer.usage_event() | {"timings": timings.as_dict()}))
        except DecodeFailed as exc:
            log.warning("decode_failed", error=str(exc), **answer.usage())
            tail = _event(error_body(str(exc), "decode_error", 500))
        except Exception as exc:  # a bug: the headers are sent, so it ends the stream
            if isinstance(exc, ConnectionResetError):
                raise
            log.exception("internal_error", path=request.path, error=repr(exc))
            message = f"internal error: {type(exc).__name__}"
            tail = _event(error_body(message, "internal_error", 500))
        await stream.write(tail)
        await stream.write_eof()
    except ConnectionResetError:
        log.info("client_gone", **answer.usage())
    return stream
