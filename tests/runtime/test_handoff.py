"""The prefill side of the KV hand-off on real rank processes (gloo): a request with
``kv_transfer_params.do_remote_decode`` keeps its prompt's KV under a lease; the
pull streams it in sequence order (gathered from a CP worker's ranks, the rows no
block holds from the prefill itself) and equals a single-process reference; 404,
410 and 401 are JSON; a reshape of the worker waits for its leases (one not pulled
in time ends as moved) and a decode server that cannot be reached releases it; and
no lease, pin or row is left after many requests that are pulled, released or
abandoned."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from support.factories import TINY, cpu_profile, engine_config, make_tokens
from support.pool_app import rank_app
from vertumnus import kv_wire as wire
from vertumnus.config.pool import PoolConfig
from vertumnus.decode.dist_client import pull_dist
from vertumnus.engine.messages import KVRead
from vertumnus.engine.model import CausalLM, causal_attention
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.kv import segments
from vertumnus.runtime.serve_config import DecodeConfig, HandoffConfig, ServeConfig
from vertumnus.server.app import build_app
from vertumnus.server.proxy import DecodeProxy

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("no_leftover_ranks")]
ATOL = 1e-4


def make_config(tmp_path: Path, layout: tuple[int, ...], **handoff: Any) -> ServeConfig:
    return ServeConfig(
        pool=PoolConfig((1, 2), layout),
        engine=engine_config(),
        profile=cpu_profile(tmp_path),
        policy=PolicyConfig(adaptive=False, replication=False),
        handoff=HandoffConfig(**handoff),
    )


def reference_kv(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """K and V of every token, [2, layers, n, Hkv, D], from one causal pass."""
    layers: list[torch.Tensor] = []
    attend = causal_attention()

    def capture(
        layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        layers.append(torch.stack((k, v)))
        return attend(layer, q, k, v, *rest)  # type: ignore[arg-type]

    with torch.inference_mode():
        ids = torch.tensor(tokens, dtype=torch.long)
        model(ids, torch.arange(len(tokens)), capture)
    return torch.stack(layers, dim=1)


def parse(stream: bytes, kinds: set[int] | None = None) -> tuple[wire.KVHeader, torch.Tensor]:
    """The wire format read back: its header and [2, layers, n, Hkv, D]; the kinds
    of its chunks are added to ``kinds``."""
    n = wire.header_length(stream[:4])
    header = wire.KVHeader.decode(stream[4 : 4 + n])
    at, parts = 4 + n, []
    shape = (header.num_layers, header.num_kv_heads, header.head_dim)
    block = header.block_size
    while True:
        chunk = wire.parse_chunk_header(stream[at : at + 8], block)
        at += 8
        if chunk is None:
            break
        kind, tokens = chunk
        if kinds is not None:
            kinds.add(kind)
        size = tokens * header.token_bytes
        data = torch.frombuffer(bytearray(stream[at : at + size]), dtype=torch.float32)
        if kind == wire.CHUNK_BLOCKS:  # [2, m, L, B, Hkv, D] -> [2, L, m * B, Hkv, D]
            blocks = data.view(2, tokens // block, shape[0], block, *shape[1:])
            parts.append(blocks.transpose(1, 2).reshape(2, shape[0], tokens, *shape[1:]))
        else:
            parts.append(data.view(2, shape[0], tokens, *shape[1:]))
        at += size
    assert at == len(stream), "bytes after the end mark"
    rows = torch.cat(parts, dim=2) if parts else torch.empty(2, shape[0], 0, *shape[1:])
    assert rows.shape[2] == header.num_tokens
    return header, rows


async def handoff(client: TestClient, tokens: list[int]) -> dict[str, Any]:
    body = {"token_ids": tokens, "kv_transfer_params": {"do_remote_decode": True}}
    response = await client.post("/v1/prefill", json=body)
    assert response.status == 200, await response.text()
    params: dict[str, Any] = (await response.json())["kv_transfer_params"]
    return params


def pins(coord: Coordinator) -> int:
    """Blocks held in use in every worker's cache index (no prefill runs)."""
    return sum(1 for index in coord.indexes.values() for e in index._entries.values() if e.refcount)


async def pins_once_copied(coord: Coordinator) -> int:
    """``pins`` once the copies in flight have ended: a reshape's new workers fetch
    the prefixes it left out of place, pinning their own slots while they run."""
    for _ in range(600):
        if not coord.cache.copies_in_flight:
            break
        await asyncio.sleep(0.1)
    return pins(coord)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("layout", "from_store"),
    [((1, 1), True), ((2,), True), ((2,), False)],
    ids=["cp1", "cp2", "cp2-through-ranks"],
)
def test_the_pull_streams_the_prompts_kv_in_order(
    tmp_path: Path,
    tiny_model: CausalLM,
    layout: tuple[int, ...],
    from_store: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The KV comes whole and in order: straight from the ranks' shared-memory
    stores (blocks as they lie), or, where shared memory has no room for them,
    read through the ranks (``KVRead``, rows)."""
    if not from_store:
        monkeypatch.setattr(segments, "free_shared_bytes", lambda: 0)

    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, layout))
        await coord.start()
        secret = {"Authorization": f"Bearer {coord.handoffs.secret}"}
        assert coord.ranks is not None
        sent_to_ranks: list[object] = []
        send = coord.ranks.send
        coord.ranks.send = lambda rank, msg: (sent_to_ranks.append(msg), send(rank, msg))[1]  # type: ignore[method-assign]
        kinds: set[int] = set()
        try:
            app = build_app(coord, Tokenizer.for_model(None, TINY.vocab_size))
            async with TestClient(TestServer(app)) as client:
                shared = make_tokens(80, seed=1)
                # a partial last block, an exact multiple of the block, under one
                # block, and one whose first 80 tokens are cached by the first
                for tokens in ([*shared, 5, 6, 7], make_tokens(48, 2), [9, 8, 7], [*shared, 1]):
                    params = await handoff(client, tokens)
                    assert params["num_tokens"] == len(tokens) - 1
                    assert params["do_remote_prefill"] and params["remote_port"] == client.port
                    assert params["remote_scheme"] == "http"
                    url = f"/v1/kv/{params['remote_handle']}"
                    assert (await client.get(url)).status == 401  # never open
                    response = await client.get(url, headers=secret)
                    assert response.status == 200
                    header, rows = parse(await response.read(), kinds)
                    assert header.model == "tiny" and header.dtype == "float32"
                    ref = reference_kv(tiny_model, tokens[:-1])
                    assert float((rows - ref).abs().max()) < ATOL
                    again = await client.get(url, headers=secret)  # pulled: the lease ended
                    assert again.status == 410
                    assert "pulled" in (await again.json())["error"]["message"]
                missing = await client.get("/v1/kv/kv-nothing", headers=secret)
                assert missing.status == 404 and (await missing.json())["error"]["type"]
                # behind a TLS-terminating proxy, the pull is to go through it too
                body = {"token_ids": [4, 5, 6], "kv_transfer_params": {"do_remote_decode": True}}
                tls = {"X-Forwarded-Proto": "https"}
                behind = await (await client.post("/v1/prefill", json=body, headers=tls)).json()
                assert behind["kv_transfer_params"]["remote_scheme"] == "https"
                handle = behind["kv_transfer_params"]["remote_handle"]
                assert (await client.delete(f"/v1/kv/{handle}", headers=secret)).status == 200
                assert coord.handoffs.view()["open"] == 0 and pins(coord) == 0
                reads = [m for m in sent_to_ranks if isinstance(m, KVRead)]
                if from_store:  # no rank was asked: the blocks went from its store
                    assert not reads and wire.CHUNK_BLOCKS in kinds
                else:
                    assert reads and kinds == {wire.CHUNK_ROWS}
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_no_lease_or_pin_is_left_after_pulls_releases_and_abandonment(tmp_path: Path) -> None:
    """1,000 hand-offs on two workers, each pulled, released or abandoned (left to
    expire): the leases, the pinned blocks and the held rows return to zero."""

    async def main() -> None:
        cfg = make_config(tmp_path, (1, 1), lease_s=0.5)
        coord = Coordinator(dataclasses.replace(cfg, max_queued=64))
        await coord.start()
        secret = {"Authorization": f"Bearer {coord.handoffs.secret}"}
        rng = random.Random(0)
        try:
            app = build_app(coord, Tokenizer.for_model(None, TINY.vocab_size))
            async with TestClient(TestServer(app)) as client:

                async def one(n: int) -> str:
                    tokens = make_tokens(rng.randrange(2, 70), seed=n % 50)
                    params = await handoff(client, tokens)
                    url = f"/v1/kv/{params['remote_handle']}"
                    fate = rng.choice(("pull", "release", "abandon"))
                    if fate == "pull":
                        assert (await client.get(url, headers=secret)).status == 200
                    elif fate == "release":
                        assert (await client.delete(url, headers=secret)).status == 200
                    return fate

                fates: list[str] = []
                for start in range(0, 1000, 50):
                    fates += await asyncio.gather(*(one(n) for n in range(start, start + 50)))
                counts = coord.handoffs.counts
                assert counts["pulled"] == fates.count("pull")
                assert counts["released"] == fates.count("release")
                # Past every lease (0.5 s), allowing a loaded machine's late timer.
                for _ in range(50):
                    await asyncio.sleep(0.1)
                    if not coord.handoffs.leases:
                        break
                view = coord.handoffs.view()
                assert (view["open"], view["pinned_blocks"], view["held_rows"]) == (0, 0, 0)
                assert counts["expired"] == fates.count("abandon") and counts["opened"] == 1000
                assert pins(coord) == 0
                for index in coord.indexes.values():
                    index.check_invariants()
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(240)
def test_a_reshape_waits_for_its_leases_and_a_dead_decode_server_releases_it(
    tmp_path: Path, tiny_model: CausalLM
) -> None:
    """A merge of workers that hold leases waits for them: one is pulled during the
    drain (its KV equal to the reference), the other, which nobody pulls, ends as
    moved after ``reshape_wait_s`` (410), and the merge completes. A completion whose
    decode server cannot be reached is a 503, and its lease is released at once."""

    async def main() -> None:
        cfg = make_config(tmp_path, (1, 1), reshape_wait_s=1.0)
        dead = dataclasses.replace(cfg, decode=DecodeConfig(url="http://127.0.0.1:9"))
        coord = Coordinator(dead)
        await coord.start()
        secret = {"Authorization": f"Bearer {coord.handoffs.secret}"}
        proxy = DecodeProxy(coord, dead.decode, dead.model)
        try:
            app = build_app(coord, Tokenizer.for_model(None, TINY.vocab_size), proxy)
            async with TestClient(TestServer(app)) as client:
                await proxy.start(f"http://127.0.0.1:{client.port}")
                tokens = make_tokens(40, seed=3)
                params = await handoff(client, tokens)
                unasked = await handoff(client, make_tokens(40, seed=5))
                merge = asyncio.ensure_future(
                    coord.begin_reshape(coord.reshape_for("merge", [0, 1]))
                )
                await asyncio.sleep(0.2)
                assert not merge.done()  # the leases hold both workers
                pulled = await client.get(f"/v1/kv/{params['remote_handle']}", headers=secret)
                assert pulled.status == 200
                _, rows = parse(await pulled.read())
                ref = reference_kv(tiny_model, tokens[:-1])
                assert float((rows - ref).abs().max()) < ATOL
                await asyncio.wait_for(merge, 30.0)
                assert coord.composition_name() == "1CP2"
                moved = await client.get(f"/v1/kv/{unasked['remote_handle']}", headers=secret)
                assert moved.status == 410
                assert "moved" in (await moved.json())["error"]["message"]
                body = {"prompt": make_tokens(30, seed=4), "max_tokens": 5}
                answer = await client.post("/v1/completions", json=body)
                assert answer.status == 503 and answer.headers["Retry-After"]
                view = await (await client.get("/v1/handoffs")).json()
                assert (view["open"], view["moved"], view["released"]) == (0, 1, 1)
                assert (view["pulled"], view["expired"]) == (1, 0)
                assert await pins_once_copied(coord) == 0  # the merged worker fetched its KV
        finally:
            await proxy.close()
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [(1, 1), (2,)], ids=["cp1", "cp2"])
def test_the_dist_transport_sends_the_same_kv_point_to_point(
    tmp_path: Path, tiny_model: CausalLM, layout: tuple[int, ...]
) -> None:
    """``dist`` (gloo here): the ranks send their blocks to the puller over
    torch.distributed, the rows no block holds come over HTTP; the KV equals the
    reference, and the lease ends (pulled)."""

    async def main() -> None:
        coord = Coordinator(make_config(tmp_path, layout))
        await coord.start()
        try:
            app = build_app(coord, Tokenizer.for_model(None, TINY.vocab_size))
            async with TestClient(TestServer(app)) as client:
                base = str(client.make_url("")).rstrip("/")
                for tokens in (make_tokens(83, seed=7), make_tokens(48, seed=8), [4, 5]):
                    params = await handoff(client, tokens)
                    pulled = await pull_dist(
                        base, params["remote_handle"], coord.handoffs.secret, model=TINY
                    )
                    got = torch.stack(
                        [
                            torch.stack([k for k, _ in pulled.kv]),
                            torch.stack([v for _, v in pulled.kv]),
                        ]
                    )
                    ref = reference_kv(tiny_model, tokens[:-1])
                    assert float((got - ref).abs().max()) < ATOL
                    await asyncio.sleep(0.05)  # the ranks' answers end the lease
                assert coord.handoffs.counts["pulled"] == 3
                assert coord.handoffs.view()["open"] == 0 and pins(coord) == 0
        finally:
            await coord.close()

    asyncio.run(main())


@pytest.mark.timeout(240)
def test_a_client_that_leaves_stops_its_decode(tmp_path: Path) -> None:
    """A non-streamed completion whose client closes its connection: the proxy drops
    its call to the decode server (whose handler is cancelled with it), and the
    lease is released."""
    cancelled = asyncio.Event()

    async def slow_decode(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.json_response({})

    async def main() -> None:
        decoder = web.Application()
        decoder.router.add_post("/v1/completions", slow_decode)
        runner = web.AppRunner(decoder, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        cfg = dataclasses.replace(make_config(tmp_path, (1, 1)), decode=DecodeConfig(url=url))
        try:
            async with rank_app(cfg) as (client, coord, _):
                body = orjson.dumps({"prompt": make_tokens(40, seed=5), "max_tokens": 50})
                _reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                await asyncio.sleep(1.0)  # prefilled by now, waiting for its decode
                writer.close()  # the client leaves
                await asyncio.wait_for(cancelled.wait(), 5.0)
                for _ in range(50):
                    if coord.handoffs.view()["released"] == 1:
                        break
                    await asyncio.sleep(0.1)
                view = coord.handoffs.view()
                assert (view["open"], view["released"]) == (0, 1) and pins(coord) == 0
        finally:
            await runner.cleanup()

    asyncio.run(main())
