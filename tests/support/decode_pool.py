"""The decode server against a fake prefill pool, in process: ``FakePool`` (a tiny
aiohttp app that keeps a prompt's KV, computed by the model, under a handle, streams
it in ``kv_wire``'s format, answers prefills and releases as the pool does, and,
when asked, the prompt's log-probabilities as the pool's proxy hands them on),
``serving`` (the pool and a decode server on free local ports), ``greedy_ids`` (what
the engine decodes alone) and ``events`` (a finished stream's server-sent events)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import orjson
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from vertumnus import kv_wire as wire
from vertumnus.decode.engine import DecodeEngine
from vertumnus.decode.keys import DecodeSettings
from vertumnus.decode.server import build_app
from vertumnus.engine.logprobs import prompt_logprobs
from vertumnus.engine.model import CausalLM, causal_attention
from vertumnus.protocol.sampling_params import SamplingParams
from vertumnus.protocol.tokenizer import Tokenizer

POOL_KEY = "pool-key-0123456789abcdef"
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.inference_mode()
def prompt_kv(model: CausalLM, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, n, Hkv, D] of the prompt but its last token."""
    ks, vs = [], []
    reference = causal_attention()

    def capture(
        layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        ks.append(k.clone())
        vs.append(v.clone())
        return reference(layer, q, k, v, *rest)  # type: ignore[arg-type]

    n, cfg = len(prompt) - 1, model.config
    if n == 0:
        empty = torch.empty(cfg.num_hidden_layers, 0, cfg.num_key_value_heads, cfg.head_dim)
        return empty, empty
    model(torch.tensor(prompt[:-1]), torch.arange(n), capture)
    return torch.stack(ks), torch.stack(vs)


def greedy_ids(model: CausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """What the engine decodes alone from the prompt's KV."""
    k, v = prompt_kv(model, prompt)
    engine = DecodeEngine(model)
    engine.add(0, list(zip(k, v, strict=True)), prompt[-1], SamplingParams(0.0), max_tokens)
    ids: list[int] = []
    while len(engine):
        ids += [o.token_id for o in engine.step()]
    return ids


class FakePool:
    """The prefill pool's hand-off, in process. ``POST /v1/completions`` keeps the
    prompt's KV under a new handle; ``GET /v1/kv/{handle}`` streams it once, in chunks
    of ``chunk_tokens`` (then 410); ``DELETE`` releases it. Every call needs
    ``Bearer key``. Switches: ``busy`` (503 prefills), ``truncate`` (the stream stops
    after its first chunk), ``layers`` (a header of another model), ``listed`` (a
    prefill answers its kv_transfer_params as a list of one)."""

    def __init__(self, model: CausalLM, dtype: str = "float32", chunk_tokens: int = 4):
        self.model, self.dtype, self.chunk_tokens = model, dtype, chunk_tokens
        self.key = POOL_KEY
        self.leases: dict[str, tuple[wire.KVHeader, torch.Tensor, torch.Tensor]] = {}
        self.ended: set[str] = set()
        self.auth: list[str | None] = []
        self.prefills = 0
        self.released: list[str] = []
        self.busy = self.truncate = self.listed = False
        self.layers: int | None = None
        self.port = 0
        self._ids = itertools.count()

    def keep(self, prompt: list[int], logprobs: int | None = None) -> dict[str, Any]:
        """The prompt's KV under a new lease; its kv_transfer_params (with the
        prompt's log-probabilities and top ``logprobs``, as the proxy adds them)."""
        handle = f"h{next(self._ids)}"
        k, v = prompt_kv(self.model, prompt)
        cfg = self.model.config
        header = wire.KVHeader(
            handle=handle,
            num_tokens=len(prompt) - 1,
            num_layers=self.layers or cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            block_size=16,
            model=cfg.name,
        )
        self.leases[handle] = (header, k.to(TORCH[self.dtype]), v.to(TORCH[self.dtype]))
        params = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "remote_handle": handle,
            "num_tokens": len(prompt) - 1,
            "prompt_tokens": len(prompt),
            "block_size": 16,
            "model": cfg.name,
            "expires_at": 0,
            "transport": "http",
        }
        if logprobs is not None:
            params["prompt_logprobs"] = self.prompt_logprobs(prompt, logprobs)
        return params

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: list[int], k: int) -> dict[str, Any]:
        """As the pool computes them (``engine/logprobs.py``), floats clamped at -9999."""
        hidden = self.model(torch.tensor(prompt), torch.arange(len(prompt)), causal_attention())
        out = prompt_logprobs(self.model.logits, hidden[:-1], torch.tensor(prompt[1:]), k)
        return {
            "token_logprobs": out.token_logprobs.clamp(min=-9999.0).tolist(),
            "top_ids": out.top_ids.tolist(),
            "top_values": out.top_values.clamp(min=-9999.0).tolist(),
        }

    def stream_bytes(self, num_tokens: int) -> int:
        cfg = self.model.config
        dims = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        header = wire.KVHeader("h0", num_tokens, *dims, self.dtype, 16, cfg.name)
        chunks = -(-num_tokens // self.chunk_tokens)
        return len(header.encode()) + header.total_bytes + (chunks + 1) * wire.CHUNK_HEADER_BYTES

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization")
        self.auth.append(given)
        if given != f"Bearer {self.key}":
            return _pool_error(401, "a valid key is needed")
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.get("/v1/kv/{handle}", self._pull),
                web.delete("/v1/kv/{handle}", self._release),
            ]
        )
        return app

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        asked = body["max_tokens"] == 1 and body["kv_transfer_params"] == {"do_remote_decode": True}
        assert asked, f"not a decode server's prefill: {body}"
        if self.busy:
            return _pool_error(503, "overloaded")
        self.prefills += 1
        params = self.keep(body["prompt"])
        return web.json_response({"kv_transfer_params": [params] if self.listed else params})

    def _lease(
        self, handle: str
    ) -> tuple[wire.KVHeader, torch.Tensor, torch.Tensor] | web.Response:
        if handle in self.ended:
            return _pool_error(410, f"the KV hand-off {handle!r} has ended")
        if handle not in self.leases:
            return _pool_error(404, f"unknown KV hand-off {handle!r}")
        return self.leases.pop(handle)

    async def _pull(self, request: web.Request) -> web.StreamResponse:
        lease = self._lease(request.match_info["handle"])
        if isinstance(lease, web.Response):
            return lease
        header, k, v = lease
        self.ended.add(header.handle)
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        chunks = -(-header.num_tokens // self.chunk_tokens)
        # as the pool does: the whole stream's length (a truncated one falls short)
        response.content_length = len(header.encode()) + 8 * (chunks + 1) + header.total_bytes
        await response.prepare(request)
        await response.write(header.encode())
        for start in range(0, header.num_tokens, self.chunk_tokens):
            rows = slice(start, start + self.chunk_tokens)
            tokens = k[:, rows].shape[1]
            await response.write(wire.chunk_header(tokens) + _raw(k[:, rows]) + _raw(v[:, rows]))
            if self.truncate:
                return response  # ends cleanly, without the end mark
        await response.write(wire.END)
        return response

    async def _release(self, request: web.Request) -> web.Response:
        lease = self._lease(request.match_info["handle"])
        if isinstance(lease, web.Response):
            return lease
        self.released.append(lease[0].handle)
        self.ended.add(lease[0].handle)
        return web.json_response({"released": lease[0].handle})


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _pool_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "x"}}, status=status)


@asynccontextmanager
async def serving(
    model: CausalLM,
    pool: FakePool,
    engine: DecodeEngine | None = None,
    tokenizer: Tokenizer | None = None,
    **settings: Any,
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    """The fake pool and a decode server in front of it, on free local ports (the
    preset's byte-level tokenizer unless given one)."""
    async with TestServer(pool.app()) as pool_server:
        pool.port = pool_server.port or 0
        fields: dict[str, Any] = dict(
            model=model.config, prefill_url=f"http://127.0.0.1:{pool.port}", prefill_key=POOL_KEY
        )
        fields.update(settings)
        tokenizer = tokenizer or Tokenizer.for_model(None, model.config.vocab_size)
        engine = engine if engine is not None else DecodeEngine(model)  # (empty: falsy)
        app = build_app(engine, tokenizer, DecodeSettings(**fields))
        async with TestClient(TestServer(app)) as client:
            yield client


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


def events(text: str) -> list[Any]:
    """The server-sent events of a finished stream: JSON objects, then "[DONE]"."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out
