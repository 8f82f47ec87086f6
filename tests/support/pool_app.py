"""The pool's REST app in process, over fake ranks (``support/fake_ranks.py``: no
process), with an optional decode server in process that records what the proxy
sends it and answers as the decode server's contract says (``FakeDecode``). For the
local decode process, ``proxy_app`` gives the proxy a supervisor without a process
(``FakeLocalDecode``): the test says when the process dies and when it is back, and
the decode server's listener can be stopped and started again on its port
(``DecodeSite``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
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
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import DecodeConfig, HandoffConfig, ServeConfig
from vertumnus.server.app import build_app
from vertumnus.server.decode_process import LocalDecode
from vertumnus.server.proxy import DecodeProxy
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
    (and dies there when ``dies`` says so) and answers ``status``; a 200 is two
    tokens per prompt, whole or as a stream whose last event before ``[DONE]``
    carries the timings (the usage event, with ``stream_options.include_usage``)."""

    status: int = 200
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # Called with each body as it comes; True: the server dies there (the connection
    # is cut with no answer)
    dies: Callable[[dict[str, Any]], bool] | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((request.path, body))
        if self.dies is not None and self.dies(body):
            assert request.transport is not None
            request.transport.abort()
            raise ConnectionResetError("the fake decode server died")
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


def make_config(
    tmp_path: Path, decode_url: str | None, decode: DecodeConfig | None = None
) -> ServeConfig:
    """One worker of CP degree 2 (every prompt placed on it: cached prefixes are
    known), and a decode server at ``decode_url`` (None: prefills only), or
    ``decode`` as given."""
    return ServeConfig(
        pool=PoolConfig((1, 2), (2,)),
        engine=EngineConfig(compile="off", block_size=16, kv_blocks_per_rank=64),
        profile=cpu_profile(tmp_path),
        policy=PolicyConfig(adaptive=False, replication=False),
        handoff=HandoffConfig(lease_s=30.0),
        decode=decode or DecodeConfig(url=decode_url, local=False),
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


class DecodeSite:
    """``FakeDecode`` listening on 127.0.0.1: ``stop`` closes its listener and its
    connections (a connection is then refused), ``start`` opens it again on the same
    port (or another: ``port = 0`` first)."""

    def __init__(self, decode: FakeDecode) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", decode.handle)
        app.router.add_post("/v1/chat/completions", decode.handle)
        self.runner = web.AppRunner(app)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        if self.runner.server is None:
            await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        """As a killed process: no listener, and every connection closed."""
        for site in list(self.runner.sites):
            await site.stop()
        assert self.runner.server is not None
        for connection in list(self.runner.server.connections):
            connection.force_close()

    async def close(self) -> None:
        await self.runner.cleanup()


class FakeLocalDecode(LocalDecode):
    """The local decode process's supervisor with no process: up at ``url`` from
    ``start``; ``die`` is what the supervisor does when the process exits, ``back``
    what it does when a new one listens."""

    def __init__(self, cfg: DecodeConfig, url: str) -> None:
        super().__init__(cfg, EngineConfig(), "tiny", "fake-handoff-secret-0123")
        self.fake_url = url

    def start(self, prefill_url: str) -> None:
        self._prefill_url = prefill_url
        self._mark_up(self.fake_url, None)

    def die(self) -> None:
        self._mark_down()
        self.state = "the local decode process exited with code -9; it restarts in 1 s"

    def back(self, url: str | None = None) -> None:
        self.restarts += 1
        self._mark_up(url or self.fake_url, None)


@dataclass
class ProxyApp:
    client: Client
    coord: Coordinator
    proxy: DecodeProxy
    decode: FakeDecode
    site: DecodeSite
    local: FakeLocalDecode | None


@asynccontextmanager
async def proxy_app(tmp_path: Path, decode: DecodeConfig, local: bool) -> AsyncIterator[ProxyApp]:
    """The app with its decode proxy in front of a ``FakeDecode``: as the local
    decode process (``local``: under a ``FakeLocalDecode``) or at ``[decode] url``
    (``decode.url`` is replaced by the fake's)."""
    fake = FakeDecode()
    site = DecodeSite(fake)
    await site.start()
    if not local:
        decode = dataclasses.replace(decode, url=site.url, local=False)
    cfg = make_config(tmp_path, None, decode)
    coord, _ = await start_coordinator(cfg, SETTINGS)
    supervisor = FakeLocalDecode(cfg.decode, site.url) if local else None
    proxy = DecodeProxy(coord, cfg.decode, cfg.model, supervisor)
    try:
        tokenizer = Tokenizer.for_model(coord.model_dir, coord.model_cfg.vocab_size)
        async with TestClient(TestServer(build_app(coord, tokenizer, proxy))) as client:
            await proxy.start(f"http://127.0.0.1:{client.port}")
            yield ProxyApp(client, coord, proxy, fake, site, supervisor)
    finally:
        await proxy.close()
        await coord.close()
        await site.close()


@asynccontextmanager
async def rank_app(cfg: ServeConfig) -> AsyncIterator[tuple[Client, Coordinator, DecodeProxy]]:
    """The app over real rank processes (``Coordinator(cfg)``, started), with its decode
    proxy (a local decode process, or ``[decode] url``) started: (client, coordinator,
    proxy); all of it closed after."""
    coord = Coordinator(cfg)
    await coord.start()
    proxy = DecodeProxy(coord, cfg.decode, cfg.model)
    try:
        app = build_app(coord, Tokenizer.for_model(None, coord.model_cfg.vocab_size), proxy)
        async with TestClient(TestServer(app)) as client:
            await proxy.start(f"http://127.0.0.1:{client.port}")
            yield client, coord, proxy
    finally:
        await proxy.close()
        await coord.close()
