"""The pool's REST app in process, over fake ranks (``support/fake_ranks.py``: no
process), with an optional decode server in process that records what the proxy
sends it and answers as the decode server's contract says (``FakeDecode``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from support.factories import cpu_profile
from support.fake_ranks import start_coordinator
from vertumnus.config import EngineConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import DecodeConfig, HandoffConfig, ServeConfig
from vertumnus.server.app import build_app
from vertumnus.server.proxy import DecodeProxy
from vertumnus.server.tokenizer import Tokenizer
from vertumnus.sim.time_model import SimSettings

Client = TestClient[web.Request, web.Application]
SETTINGS = SimSettings(switch_s=0.02, transfer_latency_s=0.001, kv_bytes_per_token=2048)
# What the fake decode server's answers carry as its own timings.
DECODE_TIMINGS = {
    "handoff_s": 0.01,
    "handoff_bytes": 100,
    "prefill_s": 0.0,
    "first_step_s": 0.002,
    "decode_s": 0.1,
    "tpot_s": 0.01,
    "decoded_tokens": 2,
}


@dataclass
class FakeDecode:
    """A decode server that decodes nothing: it records each (path, body) it gets
    and answers ``status``; a 200 is two tokens per prompt, whole or as a stream
    whose last event before ``[DONE]`` carries the timings (the usage event, with
    ``stream_options.include_usage``)."""

    status: int = 200
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((request.path, body))
        if self.status != 200:
            error = {"message": "refused by the decode server", "type": "x", "param": "seed"}
            return web.json_response({"error": error}, status=self.status)
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        choice = {"index": 0, "text": "ab", "token_ids": [97, 98], "finish_reason": "length"}
        if not body.get("stream"):
            answer = {"id": "cmpl-d", "choices": [choice], "usage": usage}
            return web.json_response({**answer, "timings": DECODE_TIMINGS})
        with_usage = (body.get("stream_options") or {}).get("include_usage", False)
        events: list[dict[str, Any]] = [
            {"id": "cmpl-d", "choices": [{**choice, "text": "a", "finish_reason": None}]},
            {"id": "cmpl-d", "choices": [{**choice, "text": "b"}]},
        ]
        if with_usage:
            events.append({"id": "cmpl-d", "choices": [], "usage": usage})
        events[-1]["timings"] = DECODE_TIMINGS
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def make_config(tmp_path: Path, decode_url: str | None) -> ServeConfig:
    """One worker of CP degree 2 (every prompt placed on it: cached prefixes are
    known), and a decode server at ``decode_url`` (None: prefills only)."""
    return ServeConfig(
        pool=PoolConfig((1, 2), (2,)),
        engine=EngineConfig(compile="off", block_size=16, kv_blocks_per_rank=64),
        profile=cpu_profile(tmp_path),
        policy=PolicyConfig(adaptive=False, replication=False),
        handoff=HandoffConfig(lease_s=30.0),
        decode=DecodeConfig(url=decode_url, local=False),
    )


@asynccontextmanager
async def pool_app(
    tmp_path: Path, decode: FakeDecode | None = None
) -> AsyncIterator[tuple[Client, Coordinator]]:
    """A client of the app on 127.0.0.1 (a free port), and its coordinator."""
    runner, url = None, None
    if decode is not None:
        app = web.Application()
        app.router.add_post("/v1/completions", decode.handle)
        app.router.add_post("/v1/chat/completions", decode.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    cfg = make_config(tmp_path, url)
    coord, _ = await start_coordinator(cfg, SETTINGS)
    proxy = DecodeProxy(coord, cfg.decode, cfg.model) if cfg.decode.enabled else None
    try:
        tokenizer = Tokenizer.for_model(coord.model_dir, coord.model_cfg.vocab_size)
        async with TestClient(TestServer(build_app(coord, tokenizer, proxy))) as client:
            if proxy is not None:
                await proxy.start(f"http://127.0.0.1:{client.port}")
            yield client, coord
    finally:
        if proxy is not None:
            await proxy.close()
        await coord.close()
        if runner is not None:
            await runner.cleanup()


async def post(client: Client, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON body) of a POST."""
    response = await client.post(path, json=body)
    return response.status, await response.json()


async def stream_events(client: Client, path: str, body: dict[str, Any]) -> list[Any]:
    """The data of each event of a streamed answer (``"[DONE]"`` as it is)."""
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    events: list[Any] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
