"""The hand-off routes of the REST API (docs/api.md, "Hand-off"): a prompt's KV kept
for a decode server, and its pull.

    POST /v1/completions, /v1/prefill   with "kv_transfer_params": {"do_remote_decode":
                                        true}: the answer carries kv_transfer_params
                                        naming where and how to pull the KV
    GET    /v1/kv/{handle}              the KV, streamed (``kv_wire.py``)
    POST   /v1/kv/{handle}/dist         the ``dist`` transport: the ranks send the
                                        blocks point to point (NCCL / gloo)
    DELETE /v1/kv/{handle}              the decode side gave up: the lease ends
    GET    /v1/handoffs                 the leases: open, pinned, ended, bytes pulled

Pull and release need ``Authorization: Bearer`` with the API key, the cluster
secret or the hand-off secret (``[handoff] secret``, or the one made at start and
handed to the local decode process): the KV of a prompt is never open to anyone.
An unknown handle is a 404, an ended one (pulled, expired, released, moved) a 410,
each a JSON error like the rest of the API.
"""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

import orjson
import structlog
from aiohttp import web

from vertumnus.kv_wire import END, HandoffError, chunk_header
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.kv.leases import Lease
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.request_path import PrefillResult
from vertumnus.server.keys import ADDRESS, COORDINATOR

log = structlog.get_logger("vertumnus.api")


def wants_handoff(body: dict[str, Any]) -> bool:
    """True if the request asks for its KV to be kept for a decode server; ValueError
    for a malformed ``kv_transfer_params``."""
    params = body.get("kv_transfer_params")
    if params is None:
        return False
    if not isinstance(params, dict):
        raise ValueError("'kv_transfer_params' must be an object")
    flag = params.get("do_remote_decode", False)
    if not isinstance(flag, bool):
        raise ValueError("'kv_transfer_params.do_remote_decode' must be true or false")
    return flag


def transfer_params(request: web.Request, coord: Coordinator, result: PrefillResult) -> Any:
    """What a decode server needs to pull the result's KV (None: nothing was kept)."""
    lease = result.handoff
    if lease is None:
        return None
    address = request.app.get(ADDRESS) or [request.url.host, request.url.port]
    host = coord.cfg.handoff.advertise_host or address[0]
    if host in ("0.0.0.0", "::"):
        host = request.url.host
    # Behind a TLS-terminating proxy the pull goes through it, as this request came.
    scheme = request.headers.get("X-Forwarded-Proto", request.scheme).split(",")[0].strip()
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_host": host,
        "remote_port": address[1],
        "remote_scheme": "https" if scheme == "https" else "http",
        "remote_handle": lease.handle,
        "num_tokens": lease.num_tokens,
        "prompt_tokens": lease.prompt_tokens,
        "block_size": coord.cfg.engine.block_size,
        "model": coord.cfg.model,
        "expires_at": round(lease.expires_unix, 3),
        "transport": "http",
    }


def may_pull(coord: Coordinator, token: str | None) -> bool:
    """The bearer of a pull or release: the API key or the hand-off secret."""
    if token is None:
        return False
    accepted = [coord.cfg.api_key, coord.handoffs.secret]
    return any(s is not None and hmac.compare_digest(token.encode(), s.encode()) for s in accepted)


def _gone(exc: HandoffError) -> web.Response:
    status = exc.status or 500
    kind = {404: "not_found", 409: "conflict", 410: "gone"}.get(status, "error")
    return web.json_response({"error": {"message": str(exc), "type": kind}}, status=status)


class SocketSink:
    """A pull's response body, written to its socket directly (``runtime/kv/handoffs.py``
    ``Sink``). After the first write (which sends the HTTP head with it), buffers go
    to the transport as they are, many at once (uvloop writes them with one
    ``writev``): the KV store's runs leave the process with no copy here. Flow
    control is the transport's own: over ``HIGH_BYTES`` queued, the protocol is
    paused, and ``drain`` waits on aiohttp's writer until it resumes."""

    HIGH_BYTES = 64 << 20

    def __init__(self, response: web.StreamResponse, request: web.Request) -> None:
        self.response = response
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the puller went away")
        self.transport = transport
        # aiohttp's writer of this response: its drain() waits on the protocol's
        # pause (StreamResponse.drain is deprecated in favour of write, which this
        # bypasses for scatter-gather writes).
        writer = response._payload_writer
        assert writer is not None, "the response is prepared"
        self.writer = writer

    async def start(self, data: bytes) -> None:
        await self.response.write(data)
        self.transport.set_write_buffer_limits(high=self.HIGH_BYTES)

    def writev(self, views: Any) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the puller went away")
        self.transport.writelines(views)

    async def drain(self) -> None:
        await self.writer.drain()
        if self.transport.is_closing():
            raise ConnectionResetError("the puller went away")

    async def flush(self) -> None:
        self.transport.set_write_buffer_limits(high=0)  # paused until the buffer is empty
        try:
            await self.drain()
        finally:
            self.transport.set_write_buffer_limits(high=self.HIGH_BYTES)

    def abort(self) -> None:
        self.transport.abort()


async def pull(request: web.Request) -> web.StreamResponse:
    """The lease is claimed before the first ``await`` (no second pull, release or
    expiry takes it while the head goes out); ``stream`` writes it only if it is still
    open then (a worker failure or a reshape's wait may have ended it: the answer is
    cut short, as for any pull that fails)."""
    coord: Coordinator = request.app[COORDINATOR]
    handle = request.match_info["handle"]
    try:
        lease = coord.handoffs.claim(handle)
    except HandoffError as exc:
        return _gone(exc)
    try:
        return await _send(request, coord, lease)
    finally:
        coord.handoffs.unclaim(lease)  # (a pull that never began: the lease is free again)


async def _send(request: web.Request, coord: Coordinator, lease: Lease) -> web.StreamResponse:
    handle = lease.handle
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = coord.handoffs.stream_bytes(lease)
    await response.prepare(request)
    try:
        sent = await coord.handoffs.stream(lease, SocketSink(response, request))
    except Exception as exc:  # cut short: the client sees no end mark; the lease stays
        # The puller left, the lease ended (410), or a rank the pull reads from
        # died (a rank on another host: its KV is read through it) and its KV with it.
        if isinstance(exc, ConnectionError | HandoffError | RanksError):
            log.warning("handoff_pull_cut", handle=handle, error=repr(exc))
        else:  # a bug: logged with its traceback, counted
            coord.metrics.bug("handoff", "handoff_pull_failed", exc, handle=handle)
        if request.transport is not None:  # the answer has begun: end it at once
            request.transport.abort()
        return response
    await response.write_eof()
    log.info("handoff_pulled", handle=handle, tokens=lease.num_tokens, bytes=sent)
    return response


async def send_dist(request: web.Request) -> web.StreamResponse:
    """``POST /v1/kv/{handle}/dist`` ``{"store_host", "store_port", "prefix"}``: the
    ``dist`` transport. The ranks send the lease's blocks to the decode server over
    torch.distributed (it hosts the store and is member 0 of each group); the answer
    is the layout (a length-prefixed JSON: the stream's header, per rank its group
    and the depths of its blocks, ``rows_from``), then the rows no block holds as
    one wire chunk, then the end mark."""
    coord: Coordinator = request.app[COORDINATOR]
    handle = request.match_info["handle"]
    try:
        body = await request.json()
        host, port, prefix = body["store_host"], body["store_port"], body["prefix"]
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(prefix, str)):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        message = 'expected {"store_host": str, "store_port": int, "prefix": str}'
        return web.json_response(
            {"error": {"message": message, "type": "invalid_request"}}, status=400
        )
    try:
        lease = coord.handoffs.claim(handle)
        header, ranks, rows = coord.handoffs.send_dist(lease, (host, port), prefix)
    except HandoffError as exc:
        return _gone(exc)
    layout = {
        "header": dataclasses.asdict(header),
        "ranks": ranks,
        "rows_from": header.num_tokens - (0 if rows is None else len(rows) // header.token_bytes),
    }
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    body_json = orjson.dumps(layout)
    await response.write(len(body_json).to_bytes(4, "little") + body_json)
    if rows is not None:
        await response.write(chunk_header(len(rows) // header.token_bytes))
        await response.write(rows)
    await response.write(END)
    await response.write_eof()
    return response


async def release(request: web.Request) -> web.Response:
    coord: Coordinator = request.app[COORDINATOR]
    handle = request.match_info["handle"]
    try:
        coord.handoffs.release(handle)
    except HandoffError as exc:
        return _gone(exc)
    return web.json_response({"released": handle})


async def leases(request: web.Request) -> web.Response:
    """``GET /v1/handoffs``: leases open, pinned blocks, held rows, how leases ended,
    bytes and seconds pulled."""
    return web.json_response(request.app[COORDINATOR].handoffs.view())


ROUTES = [
    web.get("/v1/kv/{handle}", pull),
    web.post("/v1/kv/{handle}/dist", send_dist),
    web.delete("/v1/kv/{handle}", release),
    web.get("/v1/handoffs", leases),
]
