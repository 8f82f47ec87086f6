"""The decode proxy: ``serve``'s one front door for completions of more than one
token, in the P/D shape the field uses (vLLM's disaggregated prefill, SGLang's
bootstrap room):

    client --POST /v1/completions--> proxy (this server)
    proxy  --prefill, do_remote_decode--> the pool: KV pinned under a lease
    proxy  --POST /v1/completions + kv_transfer_params--> decode server
    decode --GET /v1/kv/{handle}--> the pool (the KV, streamed; the lease ends)
    decode --tokens (JSON, or server-sent events)--> proxy --> client

The decode server is a local process (``[decode] local``, the default: started
beside the pool in the background, told the hand-off secret, restarted with backoff
whenever it dies or fails to start, while ``/ready`` says so and prefills go on) or
a separate one (``[decode] url``, possibly on another host). A decode server that fails or
dies mid-stream gives the client an error event; the lease is released if it was
not pulled; the pool keeps serving. Each answer carries where its time went:
queue, prefill, hand-off, first decode step, and the time per output token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web

from vertumnus.runtime.coordinator import Coordinator, Overloaded, Unavailable
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.request_path import InternalError, PrefillResult
from vertumnus.runtime.serve_config import DecodeConfig
from vertumnus.server.handoff_routes import transfer_params

log = structlog.get_logger("vertumnus.proxy")

START_TIMEOUT_S = 120.0  # a local decode process's start (it imports torch, builds the model)
STABLE_S = 30.0  # a decode process up this long had served: its restart backoff starts over
GONE_CHECK_S = 0.25  # how often a non-streamed completion looks for its client


def _error(status: int, message: str, kind: str) -> web.Response:
    headers = {"Retry-After": "2"} if status == 503 else None
    body = orjson.dumps({"error": {"message": message, "type": kind}})
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


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
        self.coord, self.cfg, self.model = coord, cfg, model
        self.url: str | None = cfg.url  # where the decode server listens (None: not yet)
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._session: aiohttp.ClientSession | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False
        self._prefill_url = ""
        self._state = (
            "the local decode process is starting"
            if cfg.url is None
            else "the decode proxy is starting"
        )

    # -- the local decode process ---------------------------------------------------------

    async def start(self, prefill_url: str) -> None:
        """``prefill_url``: where this pool listens, for the local decode process,
        which starts in the background (``unready_reason`` says until it is up)."""
        self._prefill_url = prefill_url
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), headers=headers
        )
        if self.cfg.url is None and self.cfg.local:
            self._supervisor = asyncio.create_task(self._supervise())

    def unready_reason(self) -> str | None:
        """None when completions can be decoded now; else why not."""
        if self.url is not None and self._session is not None:
            return None
        return self._state

    async def _spawn(self) -> None:
        engine = self.coord.cfg.engine
        argv = [
            sys.executable,
            "-m",
            "vertumnus",
            "decode",
            "--prefill",
            self._prefill_url,
            "--port",
            "0",
            "--model",
            self.model,
            "--seed",
            str(engine.seed),
            "--dtype",
            engine.dtype,
            "--device",
            engine.device,
            "--parent-pid",
            str(os.getpid()),
            "--transport",
            self.cfg.transport,
        ]
        # Told the hand-off secret; its own API (local, loopback only) stays open.
        env = {**os.environ, "VERTUMNUS_PREFILL_KEY": self.coord.handoffs.secret}
        env.pop("VERTUMNUS_DECODE_API_KEY", None)
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env
        )
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError("the local decode process did not start in time") from None
        text = line.decode().strip()
        if "http://" not in text:
            code = await process.wait()
            said = f": {text!r}" if text else ""
            raise RuntimeError(f"the local decode process exited with code {code}{said}")
        self.url = text[text.index("http://") :]
        self.process = process
        log.info("decode_started", url=self.url, pid=process.pid, restarts=self.restarts)

    async def _supervise(self) -> None:
        """Start the local decode process, and again whenever it ends or fails to
        start (until ``close``): after ``restart_s``, doubling while it keeps failing,
        up to ``restart_max_s``. The pool serves prefills meanwhile."""
        delay = self.cfg.restart_s
        while not self._closing:
            began = time.monotonic()
            try:
                await self._spawn()
                assert self.process is not None
                code = await self.process.wait()
                if self._closing:
                    return
                self.url = None
                log.error("decode_exited", pid=self.process.pid, code=code, retry_in_s=delay)
                if time.monotonic() - began > STABLE_S:
                    delay = self.cfg.restart_s  # it had served a while: not a crash loop
                what = f"exited with code {code}"
            except Exception as exc:  # (a start that failed, or a bug here: retried)
                log.error("decode_start_failed", error=str(exc), retry_in_s=delay, exc_info=exc)
                what = f"failed to start ({exc})"
            self._state = f"the local decode process {what}; it restarts in {delay:g} s"
            await asyncio.sleep(delay)
            self.restarts += 1
            self._state = "the local decode process is restarting"
            delay = min(self.cfg.restart_max_s, max(2 * delay, 1.0))

    async def close(self) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._session is not None:
            await self._session.close()

    # -- a completion ---------------------------------------------------------------------

    async def complete(
        self, request: web.Request, body: dict[str, Any], tokens: list[int]
    ) -> web.StreamResponse:
        coord, arrived = self.coord, time.perf_counter()
        if self.url is None or self._session is None:
            reason = self.unready_reason() or "the decode server is not up"
            return _error(503, f"unavailable: {reason}", "unavailable")
        try:
            result = await coord.prefill(tokens, handoff=True)
        except Overloaded as exc:
            return _error(503, f"overloaded: {exc}", "overloaded")
        except (Unavailable, RanksError) as exc:
            return _error(503, f"unavailable: {exc}", "unavailable")
        except InternalError as exc:  # (logged with its traceback where it happened)
            return _error(500, f"internal error: {exc}", "internal_error")
        assert result.handoff is not None
        params = transfer_params(request, coord, result)
        if self.process is not None:  # the local decode process pulls over loopback
            local = self._prefill_url.removeprefix("http://").rpartition(":")
            params["remote_host"], params["remote_port"] = local[0], int(local[2])
            params["remote_scheme"] = "http"
        forward = {k: v for k, v in body.items() if k not in ("prompt", "kv_transfer_params")}
        forward.update(prompt=tokens, kv_transfer_params=params)
        handle = result.handoff.handle
        url = f"{self.url}/v1/completions"
        try:
            if body.get("stream"):
                return await self._stream(request, url, forward, result, arrived, handle)
            status, data = await _unless_gone(request, self._answer(url, forward))
            if status != 200:
                self._release(handle)
                return web.Response(body=data, status=status, content_type="application/json")
        except (aiohttp.ClientError, ConnectionError) as exc:
            self._release(handle)
            return _error(503, self._failed(exc), "unavailable")
        except ClientGone:  # its decode stopped with the connection to the decode server
            self._release(handle)
            log.info("client_gone", request_id=result.request_id)
            return web.Response(status=499)
        except asyncio.CancelledError:  # the same, where the server cancels its handlers
            self._release(handle)
            log.info("client_gone", request_id=result.request_id)
            raise
        out = orjson.loads(data)
        out["timings"] = self._timings(result, out.get("timings", {}), arrived)
        out["worker"], out["cp_degree"] = result.worker, result.cp_degree
        usage = out.setdefault("usage", {})
        usage["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
        return web.Response(body=orjson.dumps(out), content_type="application/json")

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
        result: PrefillResult,
        arrived: float,
        handle: str,
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
                    self._release(handle)
                    data = await answer.read()
                    return web.Response(
                        body=data, status=answer.status, content_type="application/json"
                    )
                await response.prepare(request)
                async for line in answer.content:
                    if first is None:
                        first = time.perf_counter()
                    if line.startswith(b"data: {") and b'"usage"' in line:
                        line = self._last_event(line, result, arrived)
                    try:
                        await response.write(line)
                    except ConnectionError:  # the client left: nothing more to send
                        self._release(handle)
                        log.info("client_gone", request_id=result.request_id, stream=True)
                        return response
        except (aiohttp.ClientError, ConnectionError, asyncio.IncompleteReadError) as exc:
            self._release(handle)
            if not response.prepared:
                return _error(503, self._failed(exc), "unavailable")
            message = self._failed(exc)
            event = {"error": {"message": message, "type": "decode_error"}}
            try:
                await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
            except ConnectionError:  # (the client has gone too)
                return response
        if first is not None:
            ttft = first - arrived
            log.info("streamed", request_id=result.request_id, ttft_s=round(ttft, 6))
        with contextlib.suppress(ConnectionError):  # (a client that left just now)
            await response.write_eof()
        return response

    async def _answer(self, url: str, forward: dict[str, Any]) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.post(url, json=forward) as answer:
            return answer.status, await answer.read()

    def _last_event(self, line: bytes, result: PrefillResult, arrived: float) -> bytes:
        """The decode server's last event (it carries the usage): with the pool's
        share of the request, as a non-streamed answer has it."""
        event = orjson.loads(line[len(b"data: ") :])
        event["timings"] = self._timings(result, event.get("timings") or {}, arrived)
        event["worker"], event["cp_degree"] = result.worker, result.cp_degree
        usage = event.get("usage")
        if isinstance(usage, dict):
            usage["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
        return b"data: " + orjson.dumps(event) + b"\n"

    def _release(self, handle: str) -> None:
        """The decode side never pulled (or failed): the lease ends now."""
        self.coord.handoffs.end(handle, "released")

    def _timings(
        self, result: PrefillResult, decode: dict[str, Any], arrived: float
    ) -> dict[str, Any]:
        """TTFT split into queue, prefill, hand-off and first decode step."""
        handoff_s = float(decode.get("handoff_s", 0.0))
        first_step_s = float(decode.get("first_step_s", 0.0))
        return {
            "queue_s": round(result.queue_s, 6),
            "prefill_s": round(result.prefill_s, 6),
            "rank_compute_s": round(result.rank_compute_s, 6),
            "handoff_s": round(handoff_s, 6),
            "handoff_bytes": decode.get("handoff_bytes"),
            "first_step_s": round(first_step_s, 6),
            "ttft_s": round(result.ttft_s + handoff_s + first_step_s, 6),
            "tpot_s": decode.get("tpot_s"),
            "total_s": round(time.perf_counter() - arrived, 6),
        }
