"""The decode proxy: ``serve``'s one front door for completions past the first token
(``max_tokens`` > 1, or a stream), in the P/D shape the field uses (vLLM's
disaggregated prefill, SGLang's bootstrap room):

    client --POST /v1/completions or /v1/chat/completions--> proxy (this server)
    proxy  --prefill of every prompt, KV kept--> the pool: each pinned under a lease
    proxy  --the client's body, same path, kv_transfer_params: [one per prompt]--> decode
    decode --GET /v1/kv/{handle}, per prompt--> the pool (the KV, streamed; the lease ends)
    decode --tokens (JSON, or server-sent events)--> proxy --> client

The body goes on as the client sent it, but for ``kv_transfer_params``: the list of
each prompt's, in order, with its prompt's log-probabilities when the request asks
for them (completions, ``echo`` with ``logprobs``). The decode server is the local
decode process (``decode_process.py``) or a separate one (``[decode] url``, possibly
on another host). A decode server that fails or dies mid-stream gives the client an
error event; the leases not pulled are released (as are those already opened when
another prompt's prefill fails); the pool keeps serving. Each answer carries the
pool's share of the request (``answers.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web

from vertumnus.decode.sampling import LOGPROB_FLOOR
from vertumnus.protocol.request import GenerateRequest
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.request_path import PrefillResult
from vertumnus.runtime.serve_tables import DecodeConfig
from vertumnus.server.answers import (
    decoded_tokens,
    last_event,
    release_leases,
    serve_prefills,
    with_pool_share,
)
from vertumnus.server.decode_process import LocalDecode
from vertumnus.server.handoff_routes import transfer_params
from vertumnus.server.http import BadRequest, error_body, error_response

log = structlog.get_logger("vertumnus.proxy")

GONE_CHECK_S = 0.25  # how often a non-streamed completion looks for its client


def _unavailable(message: str) -> web.Response:
    return error_response(503, message, "unavailable", retry_after_s=2)


class ClientGone(RuntimeError):
    """The client of a non-streamed completion closed its connection."""


async def _unless_gone(request: web.Request, work: Any) -> Any:
    """``work``'s result; cancelled (``ClientGone``) as soon as the client's
    connection closes, or with this handler, so that the decode server stops
    decoding for nobody (its own handler ends with the connection it answers)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=GONE_CHECK_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ClientGone("the client closed its connection")
    except (ClientGone, asyncio.CancelledError):  # (a server that cancels its handlers)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise


class DecodeProxy:
    def __init__(self, coord: Coordinator, cfg: DecodeConfig, model: str) -> None:
        self.coord, self.cfg = coord, cfg
        self.local = (
            LocalDecode(cfg, coord.cfg.engine, model, coord.handoffs.secret, coord.cfg.model)
            if cfg.url is None and cfg.local
            else None
        )
        self._session: aiohttp.ClientSession | None = None
        self._prefill_url = ""

    @property
    def url(self) -> str | None:
        """Where the decode server listens (None: not yet)."""
        return self.local.url if self.local is not None else self.cfg.url

    @property
    def process(self) -> asyncio.subprocess.Process | None:
        """The local decode process, once one has started (None: a separate server)."""
        return self.local.process if self.local is not None else None

    async def start(self, prefill_url: str) -> None:
        """``prefill_url``: where this pool listens, for the local decode process,
        which starts in the background (``unready_reason`` says until it is up)."""
        self._prefill_url = prefill_url
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), headers=headers
        )
        if self.local is not None:
            self.local.start(prefill_url)

    def check(self, req: GenerateRequest) -> None:
        """A vLLM decode server takes one prompt per request, and computes no prompt
        log-probabilities from a pulled KV."""
        if self.cfg.engine != "vllm":
            return
        if len(req.prompts) > 1:
            raise BadRequest("the vLLM decode pool takes one prompt per request", "prompt")
        if req.prompt_logprobs is not None:
            raise BadRequest(
                "'echo' with 'logprobs' needs max_tokens 0 or 1 here (the pool answers it): "
                "the vLLM decode pool cannot compute a pulled prompt's log-probabilities",
                "echo",
            )

    def unready_reason(self) -> str | None:
        """None when completions can be decoded now; else why not."""
        if self.url is not None and self._session is not None:
            return None
        if self.local is not None:
            return self.local.state
        if self.cfg.url is None:
            return "the local decode process is starting"
        return "the decode proxy is starting"

    async def close(self) -> None:
        if self.local is not None:
            await self.local.close()
        if self._session is not None:
            await self._session.close()

    # -- a completion ---------------------------------------------------------------------

    async def complete(
        self, request: web.Request, req: GenerateRequest, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        """Prefill every prompt of ``req`` with its KV kept, and have the decode
        server answer the client's ``body`` on the same path, its
        ``kv_transfer_params`` replaced by the list of every prompt's (in order)."""
        coord, arrived = self.coord, time.perf_counter()
        if self.url is None or self._session is None:
            reason = self.unready_reason() or "the decode server is not up"
            return _unavailable(f"unavailable: {reason}")
        prompts = [p.token_ids for p in req.prompts]
        results = await serve_prefills(
            coord, prompts, True, req.prompt_logprobs, overloaded_retry_s=2
        )
        if isinstance(results, web.Response):
            return results
        transfers = [self._params(request, r) for r in results]
        one = self.cfg.engine == "vllm"  # vLLM's kv_transfer_params: one object
        forward = {**body, "kv_transfer_params": transfers[0] if one else transfers}
        url = self.url + ("/v1/chat/completions" if chat else "/v1/completions")
        with coord.metrics.decoding():
            return await self._decode(request, url, forward, results, arrived, req.stream)

    async def _decode(
        self,
        request: web.Request,
        url: str,
        forward: dict[str, Any],
        results: list[PrefillResult],
        arrived: float,
        stream: bool,
    ) -> web.StreamResponse:
        """The decode server's answer, relayed with the pool's share."""
        coord, request_id = self.coord, results[0].request_id
        try:
            if stream:
                return await self._stream(request, url, forward, results, arrived)
            status, data = await _unless_gone(request, self._answer(url, forward))
            if status != 200:
                release_leases(coord, results)
                return web.Response(body=data, status=status, content_type="application/json")
        except (aiohttp.ClientError, ConnectionError) as exc:
            release_leases(coord, results)
            return _unavailable(self._failed(exc))
        except ClientGone:  # its decode stopped with the connection to the decode server
            release_leases(coord, results)
            log.info("client_gone", request_id=request_id)
            return web.Response(status=499)
        except asyncio.CancelledError:  # the same, where the server cancels its handlers
            release_leases(coord, results)
            log.info("client_gone", request_id=request_id)
            raise
        answer, generated = with_pool_share(data, results, arrived)
        coord.metrics.request_done(time.perf_counter() - arrived, generated)
        return web.Response(body=answer, content_type="application/json")

    def _params(self, request: web.Request, result: PrefillResult) -> dict[str, Any]:
        """One prompt's ``kv_transfer_params`` for the decode server: where its KV
        waits (over loopback for the local decode process) and, when asked for, its
        prompt's log-probabilities (clamped at -9999: JSON has no infinity)."""
        params: dict[str, Any] = transfer_params(request, self.coord, result)
        if self.process is not None:  # the local decode process pulls over loopback
            local = self._prefill_url.removeprefix("http://").rpartition(":")
            params["remote_host"], params["remote_port"] = local[0], int(local[2])
            params["remote_scheme"] = "http"
        got = result.prompt_logprobs
        if got is not None:
            params["prompt_logprobs"] = {
                "token_logprobs": got.token_logprobs.clamp(min=LOGPROB_FLOOR).tolist(),
                "top_ids": got.top_ids.tolist(),
                "top_values": got.top_values.clamp(min=LOGPROB_FLOOR).tolist(),
            }
        return params

    def _failed(self, exc: BaseException) -> str:
        """The error a decode failure answers with, naming the local decode process
        where it is the decode server (a kill cuts its answers before its exit is
        seen)."""
        who = "the local decode process" if self.process is not None else "the decode server"
        return f"{who} failed: {exc}"

    async def _stream(
        self,
        request: web.Request,
        url: str,
        forward: dict[str, Any],
        results: list[PrefillResult],
        arrived: float,
    ) -> web.StreamResponse:
        """Relay the decode server's events as they come; a failure after the first
        byte becomes an error event, then the end. A client that goes away ends the
        relay, and with it the call to the decode server (which stops decoding)."""
        assert self._session is not None
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        first: float | None = None
        try:
            async with self._session.post(url, json=forward) as answer:
                if answer.status != 200:
                    release_leases(self.coord, results)
                    data = await answer.read()
                    return web.Response(
                        body=data, status=answer.status, content_type="application/json"
                    )
                await response.prepare(request)
                async for line in answer.content:
                    if first is None:
                        first = time.perf_counter()
                    generated = decoded_tokens(line)
                    if generated is not None:
                        self.coord.metrics.request_done(time.perf_counter() - arrived, generated)
                    line = last_event(line, results, arrived)
                    try:
                        await response.write(line)
                    except ConnectionError:  # the client left: nothing more to send
                        release_leases(self.coord, results)
                        log.info("client_gone", request_id=results[0].request_id, stream=True)
                        return response
        except (aiohttp.ClientError, ConnectionError, asyncio.IncompleteReadError) as exc:
            release_leases(self.coord, results)
            if not response.prepared:
                return _unavailable(self._failed(exc))
            message = self._failed(exc)
            event = error_body(message, "decode_error", 502)
            try:
                await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
            except ConnectionError:  # (the client has gone too)
                return response
        if first is not None:
            ttft = first - arrived
            log.info("streamed", request_id=results[0].request_id, ttft_s=round(ttft, 6))
        with contextlib.suppress(ConnectionError):  # (a client that left just now)
            await response.write_eof()
        return response

    async def _answer(self, url: str, forward: dict[str, Any]) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.post(url, json=forward) as answer:
            return answer.status, await answer.read()
