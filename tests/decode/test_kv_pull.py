"""The decode side's pull client (``decode/kv_pull.py``) against hand-made streams:
whole blocks and rows received exactly, the receive buffer reused once released,
an answer without Content-Length refused clearly, and a cancelled pull stopped at
once (its thread freed); the scheme a pull is to use."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from vertumnus import kv_wire as wire
from vertumnus.decode.kv_client import TransferParams
from vertumnus.decode.kv_pull import pull
from vertumnus.decode.kv_stream import Arena
from vertumnus.kv_wire import HandoffError

L, H, D, B = 2, 2, 8, 4


def stream_of(k: torch.Tensor, v: torch.Tensor, blocks: int) -> tuple[wire.KVHeader, bytes]:
    """K, V [L, n, H, D] as the wire carries them: ``blocks`` whole blocks as one
    chunk of blocks, the rest as rows."""
    n = k.shape[1]
    header = wire.KVHeader("h", n, L, H, D, "float32", B, "test")

    def raw(x: torch.Tensor) -> bytes:
        return x.contiguous().view(torch.uint8).numpy().tobytes()

    cut = blocks * B
    as_blocks = [x[:, :cut].reshape(L, blocks, B, H, D).transpose(0, 1) for x in (k, v)]
    body = header.encode()
    body += wire.chunk_header(cut, wire.CHUNK_BLOCKS) + raw(as_blocks[0]) + raw(as_blocks[1])
    body += wire.chunk_header(n - cut) + raw(k[:, cut:]) + raw(v[:, cut:]) + wire.END
    return header, body


def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g)


def test_blocks_and_rows_arrive_exactly_and_the_buffer_is_reused() -> None:
    k, v = kv(11)
    _, body = stream_of(k, v, blocks=2)

    async def serve(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer key"
        return web.Response(body=body, content_type="application/octet-stream")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/kv/{handle}", serve)
        async with TestServer(app) as server:
            base, arena = f"http://127.0.0.1:{server.port}", Arena()
            pulled = await pull(base, "h", "key", arena=arena)
            assert pulled.num_bytes == len(body) and pulled.stream_s is not None
            assert [p.blocked for p in pulled.prompt.pieces] == [True, False]
            for layer, (pk, pv) in enumerate(pulled.kv):
                assert torch.equal(pk, k[layer]) and torch.equal(pv, v[layer])
            first = pulled.prompt.pieces[0].k.data_ptr()
            pulled.release()
            pulled.release()  # idempotent
            again = await pull(base, "h", "key", arena=arena)
            assert again.prompt.pieces[0].k.data_ptr() == first  # the same memory
            assert all(torch.equal(pk, k[i]) for i, (pk, _) in enumerate(again.kv))

    asyncio.run(main())


def test_an_answer_without_content_length_is_refused_clearly() -> None:
    k, v = kv(5)
    _, body = stream_of(k, v, blocks=1)

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(body)
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/kv/{handle}", chunked)
        async with TestServer(app) as server:
            with pytest.raises(HandoffError, match="no Content-Length") as err:
                await pull(f"http://127.0.0.1:{server.port}", "h", None)
            assert err.value.kind == "malformed"

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_cancelled_pull_stops_at_once() -> None:
    k, v = kv(9)
    _, body = stream_of(k, v, blocks=2)
    hold = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[:40])  # then nothing, until let go
        await hold.wait()
        await response.write(body[40:])
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/kv/{handle}", stall)
        async with TestServer(app) as server:
            task = asyncio.create_task(pull(f"http://127.0.0.1:{server.port}", "h", None))
            await asyncio.sleep(0.3)
            assert not task.done()
            start = time.perf_counter()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            hold.set()
            # the thread saw its socket shut and returned: the next pull gets a thread
            short = await asyncio.wait_for(
                pull(f"http://127.0.0.1:{server.port}", "h", None), timeout=10
            )
            assert short.num_bytes == len(body) and time.perf_counter() - start < 10

    asyncio.run(main())


def test_transfer_params_name_the_scheme_to_pull_with() -> None:
    """``remote_scheme`` (http when absent; https behind TLS), an IPv6 host in
    brackets, and a clear error for a scheme the client cannot speak."""
    params = {"remote_host": "pool", "remote_port": 8443, "remote_handle": "kv-1", "num_tokens": 3}
    assert TransferParams.parse(params).base_url == "http://pool:8443"
    tls = TransferParams.parse({**params, "remote_scheme": "https", "remote_host": "::1"})
    assert tls.base_url == "https://[::1]:8443"
    with pytest.raises(ValueError, match="remote_scheme"):
        TransferParams.parse({**params, "remote_scheme": "ftp"})
