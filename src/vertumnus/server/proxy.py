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

A decode server that goes away while the prompts are prefilled (the local process
killed and restarting, a separate server refusing connections) does not cost the
prefill: the completion waits for it, its leases kept, up to ``[decode]
restart_wait_s`` and never past them, then goes on to whichever process is up; if
none comes back in time, or a lease ended meanwhile (its worker failed, a reshape's
wait), the answer is a 503 naming why, the leases released. Where the decode server
is, and whether each lease is still open, are read after the last ``await`` that
could change them, never before.
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

from vertumnus.http_json import error_response
from vertumnus.protocol.errors import BadRequest, error_body
from vertumnus.protocol.request import GenerateRequest
from vertumnus.protocol.sampling_params import LOGPROB_FLOOR
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
from vertumnus.server.decode_process import DecodeTarget, LocalDecode
from vertumnus.server.decode_side import DecodeSide, Undelivered
from vertumnus.server.handoff_routes import transfer_params

log = structlog.get_logger("vertumnus.proxy")

GONE_CHECK_S = 0.25  # how often a non-streamed completion looks for its client
RETRY_S = 0.25  # the first wait before asking again a decode server that went away
RETRY_MAX_S = 2.0  # (doubling up to this)
PULL_MARGIN_S = 5.0  # what a wait for the decode server leaves of a lease for its pull


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
    def __init__(
        self, coord: Coordinator, cfg: DecodeConfig, model: str, local: LocalDecode | None = None
    ) -> None:
        """``local``: the local decode process's supervisor (default: one made here
        when ``cfg`` asks for a local decode process)."""
        self.coord, self.cfg = coord, cfg
        if local is None and cfg.url is None and cfg.local:
            engine, secret = coord.cfg.engine, coord.handoffs.secret
            local = LocalDecode(cfg, engine, model, secret, coord.cfg.model)
        self.local = local
        self.side = DecodeSide(cfg, local)
        self._session: aiohttp.ClientSession | None = None
        self._prefill_url = ""
        self.waiting = 0  # completions prefilled that wait for the decode server now

    @property
    def url(self) -> str | None:
        """Where the decode server listens now (None: not up)."""
        target = self.side.current()
        return None if target is None else target.url

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
        if self.side.closing:
            return "the server is shutting down"
        if self.url is not None and self._session is not None:
            return None
        if self.local is not None:
            return self.local.state
        if self.cfg.url is None:
            return "the local decode process is starting"
        return "the decode proxy is starting"

    async def close(self) -> None:
        await self.side.close()
        if self._session is not None:
            await self._session.close()

    # -- a completion ---------------------------------------------------------------------

    async def complete(
        self, request: web.Request, req: GenerateRequest, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        """Prefill every prompt of ``req`` with its KV kept, and have the decode
        server answer the client's ``body`` on the same path, its
        ``kv_transfer_params`` replaced by the list of every prompt's (in order).
        A request that comes while the decode server is known to be down is refused
        at once (nothing computed); one whose prefill is done waits for it
        (``_hand_over``)."""
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
        # The prompts' KV waits under leases from here: every way out hands it to the
        # decode server or releases it (an exception too, the handler's cancellation).
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            with coord.metrics.decoding():
                return await self._hand_over(request, path, body, results, arrived, req.stream)
        except BaseException:
            release_leases(coord, results)
            raise

    async def _hand_over(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        results: list[PrefillResult],
        arrived: float,
        stream: bool,
    ) -> web.StreamResponse:
        """Forward the completion to the decode server that is up now; while there is
        none, or the one it went to went away before answering (``Undelivered``),
        wait for one up to ``_wait_s``, the leases kept. Each try reads where the
        decode server is, and that every lease is still open, after the wait that
        preceded it."""
        coord, loop = self.coord, asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self._wait_s(results)
        delay, waited = RETRY_S, False
        undelivered: Undelivered | None = None
        while True:
            target = None if undelivered is not None else self.side.current()
            if target is None:
                waited = True
                self.waiting += 1
                try:
                    wait = self.side.wait(deadline, undelivered, delay)
                    target = await _unless_gone(request, wait)
                except (ClientGone, asyncio.CancelledError) as exc:  # (or its handler)
                    coord.metrics.decode_waited("client_gone")
                    release_leases(coord, results)
                    log.info("client_gone", request_id=results[0].request_id, waiting=True)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    return web.Response(status=499)
                finally:
                    self.waiting -= 1
                delay = min(2 * delay, RETRY_MAX_S)
            if target is None:
                release_leases(coord, results)
                coord.metrics.decode_waited("unavailable")
                why = self.side.away(undelivered)
                log.warning("decode_wait_over", request_id=results[0].request_id, why=why)
                message = f"unavailable: {why}; the prompt was prefilled and waited "
                message += f"{loop.time() - began:.1f} s for it ([decode] restart_wait_s)"
                return _unavailable(message)
            ended = self._ended(results)
            if ended is not None:
                release_leases(coord, results)
                if waited:
                    coord.metrics.decode_waited("unavailable")
                if undelivered is not None:
                    ended += f" and {self.side.who} that had it went away"
                elif waited:
                    ended += " while the completion waited for a decode server"
                return _unavailable(f"unavailable: {ended}; retry the request")
            transfers = [self._params(request, r) for r in results]
            one = self.cfg.engine == "vllm"  # vLLM's kv_transfer_params: one object
            forward = {**body, "kv_transfer_params": transfers[0] if one else transfers}
            try:
                response = await self._decode(
                    request, target, path, forward, results, arrived, stream
                )
            except Undelivered as exc:
                undelivered = exc
                log.warning("decode_went_away", request_id=results[0].request_id, error=str(exc))
                continue
            if waited:
                coord.metrics.decode_waited("forwarded")
                log.info("decode_waited", request_id=results[0].request_id, url=target.url)
            return response

    def _wait_s(self, results: list[PrefillResult]) -> float:
        """How long the completion may wait for its decode server: ``restart_wait_s``,
        leaving each lease time for its pull (``PULL_MARGIN_S``, at most a quarter of
        ``lease_s``)."""
        handoffs = self.coord.handoffs
        margin_s = min(PULL_MARGIN_S, handoffs.cfg.lease_s / 4)
        now = handoffs.clock()
        left = [r.handoff.expires_s - now for r in results if r.handoff is not None]
        return max(0.0, min([self.cfg.restart_wait_s, *(t - margin_s for t in left)]))

    def _ended(self, results: list[PrefillResult]) -> str | None:
        """None while every result's lease is open; else which ended, and why."""
        for n, result in enumerate(results):
            lease = result.handoff
            why = None if lease is None else self.coord.handoffs.why_ended(lease)
            if why is not None:
                which = f"prompt {n}" if len(results) > 1 else "the prompt"
                return f"the KV kept for {which} ended ({why})"
        return None

    async def _decode(
        self,
        request: web.Request,
        target: DecodeTarget,
        path: str,
        forward: dict[str, Any],
        results: list[PrefillResult],
        arrived: float,
        stream: bool,
    ) -> web.StreamResponse:
        """The decode server's answer, relayed with the pool's share; ``Undelivered``
        if it went away before anything came back (``DecodeSide.went_away``)."""
        coord, request_id = self.coord, results[0].request_id
        try:
            if stream:
                return await self._stream(request, target, path, forward, results, arrived)
            status, data = await _unless_gone(request, self._answer(target.url + path, forward))
            if status != 200:
                release_leases(coord, results)
                return web.Response(body=data, status=status, content_type="application/json")
        except (aiohttp.ClientError, ConnectionError) as exc:
            if await self.side.went_away(target, exc):
                raise Undelivered(str(exc)) from exc
            release_leases(coord, results)
            return _unavailable(self.side.failed(exc))
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
        if self.local is not None:  # the local decode process pulls over loopback
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

    async def _stream(
        self,
        request: web.Request,
        target: DecodeTarget,
        path: str,
        forward: dict[str, Any],
        results: list[PrefillResult],
        arrived: float,
    ) -> web.StreamResponse:
        """Relay the decode server's events as they come; a failure after the first
        byte becomes an error event, then the end (before it: ``Undelivered`` where
        the decode server went away). A client that goes away ends the relay, and
        with it the call to the decode server (which stops decoding)."""
        assert self._session is not None
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        first: float | None = None
        try:
            async with self._session.post(target.url + path, json=forward) as answer:
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
            if not response.prepared and await self.side.went_away(target, exc):
                raise Undelivered(str(exc)) from exc
            release_leases(self.coord, results)
            if not response.prepared:
                return _unavailable(self.side.failed(exc))
            message = self.side.failed(exc)
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
