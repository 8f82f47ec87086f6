"""A stand-in OpenAI server that records what a benchmark client sends.

    python -m tools.clients.capture --out requests.jsonl [--port 0] [--model NAME]

Answers ``/health``, ``/ready``, ``/metrics``, ``/v1/models`` and both
``/v1/completions`` and ``/v1/chat/completions`` (whole, or streamed as server-sent
events with a usage event when ``stream_options.include_usage`` asks), each with
three words of text; every other path is a 404. Every request is one line of
``--out``: the method, the path, the client's ``User-Agent`` and the JSON body (or
None). The first line on stdout says where it listens; SIGTERM stops it. ``run_lane.py --capture``
runs the clients against it and lists the body fields each one sent; it tests no
server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any, TextIO

from aiohttp import web

WORDS = ("capture", "stand", "in")


def _answer(chat: bool, model: str, body: dict[str, Any]) -> dict[str, Any]:
    text = " ".join(WORDS)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {
        "id": "capture-1",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or model,
        "choices": [choice],
        "usage": {"prompt_tokens": 1, "completion_tokens": len(WORDS), "total_tokens": 4},
    }


def _event(chat: bool, model: str, word: str | None, usage: bool) -> dict[str, Any]:
    event: dict[str, Any] = {
        "id": "capture-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
    }
    if usage:
        n = len(WORDS)
        event["usage"] = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
    elif word is not None:
        delta: dict[str, Any] = {"delta": {"role": "assistant", "content": word}}
        event["choices"] = [{"index": 0, **(delta if chat else {"text": word})}]
    return event


async def _stream(request: web.Request, chat: bool, model: str, usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, word in enumerate(WORDS):
        event = _event(chat, model, word if i == 0 else " " + word, usage=False)
        if i == len(WORDS) - 1:
            event["choices"][0]["finish_reason"] = "length"
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    if usage:
        await resp.write(f"data: {json.dumps(_event(chat, model, None, True))}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def build_app(log: TextIO, model: str) -> web.Application:
    async def record(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        line = {
            "method": request.method,
            "path": request.path,
            "user_agent": request.headers.get("User-Agent"),
            "body": body,
        }
        log.write(json.dumps(line) + "\n")
        log.flush()
        path = request.path
        if path in ("/health", "/ready"):
            return web.json_response({"status": "ok"})
        if path == "/metrics":
            return web.Response(text="")
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": model}]})
        if path in ("/v1/completions", "/v1/chat/completions") and isinstance(body, dict):
            chat = path.endswith("chat/completions")
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await _stream(request, chat, body.get("model") or model, usage)
            return web.json_response(_answer(chat, model, body))
        return web.json_response({"error": {"message": "not found"}}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="capture")
    args = ap.parse_args()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(build_app(log, args.model), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        port = runner.addresses[0][1]
        print(f"capture listening on http://{args.host}:{port}", flush=True)
        return runner

    with args.out.open("a") as log:
        loop = asyncio.new_event_loop()
        runner = loop.run_until_complete(start())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, loop.stop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())


if __name__ == "__main__":
    main()
