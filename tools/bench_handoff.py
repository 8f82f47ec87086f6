"""The KV hand-off's bandwidth against a plain socket copy of the same bytes.

    .venv/bin/python tools/bench_handoff.py [--model tiny] [--layout 1,1]
        [--tokens 8192,16384,32768] [--repeat 3]

Starts a coordinator with its rank processes (CPU, fp32) and the REST app on
127.0.0.1, then for each prompt length: one prefill with ``kv_transfer_params.
do_remote_decode``, and its pull (``GET /v1/kv/{handle}``, read whole by an aiohttp
client, as the decode server reads it), timed from the request to the last byte. The
puller runs in a process of its own, as a decode server does. The reference,
measured in the same run: the same number of bytes sent over a TCP loopback
connection by one thread (``sendall`` of one buffer) and received by another
(``recv_into`` one buffer). Prints per length the KV bytes (and bytes per
token of the model), seconds, GB/s of each, and the ratio (target: 0.8 or more
from 8K tokens up). The pull is repeated ``--repeat`` times (a fresh prefill each)
and the median taken.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import aiohttp
from aiohttp import web

from vertumnus.config import EngineConfig, resolve_model
from vertumnus.config.pool import PoolConfig
from vertumnus.handoff import kv_client
from vertumnus.handoff.dist_client import pull_dist
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.server.app import build_app
from vertumnus.server.keys import ADDRESS
from vertumnus.server.tokenizer import Tokenizer


def socket_copy_s(num_bytes: int) -> float:
    """Seconds to move ``num_bytes`` over TCP loopback, one buffer each side."""
    payload = bytearray(num_bytes)
    sink = bytearray(num_bytes)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        view, got = memoryview(sink), 0
        while got < num_bytes:
            n = conn.recv_into(view[got:])
            if n == 0:
                break
            got += n
        conn.close()
        done.set()

    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    start = time.perf_counter()
    client.sendall(payload)
    done.wait()
    seconds = time.perf_counter() - start
    client.close()
    thread.join()
    server.close()
    return seconds


def pull_in_process(url: str, secret: str, mode: str) -> tuple[int, float]:
    """In the puller's own process (as a decode server is): the KV of one hand-off.
    ``mode``: "tensors", with the decode server's own client (``handoff/kv_client.py``:
    the stream parsed, and put into per-layer K and V tensors); "read", the stream
    only read; "dist", the ranks send it over torch.distributed (gloo here) into
    tensors (``handoff/dist_client.py``)."""

    async def pull() -> tuple[int, float]:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            start = time.perf_counter()
            base, _, handle = url.rpartition("/v1/kv/")
            if mode == "tensors":
                pulled = await kv_client.pull(base, handle, secret, session=session)
                return pulled.num_bytes, time.perf_counter() - start
            if mode == "dist":
                pulled = await pull_dist(base, handle, secret, session=session)
                return pulled.num_bytes, time.perf_counter() - start
            got = 0
            async with session.get(url, headers={"Authorization": f"Bearer {secret}"}) as resp:
                assert resp.status == 200, await resp.text()
                async for chunk in resp.content.iter_any():
                    got += len(chunk)
            return got, time.perf_counter() - start

    return asyncio.run(pull())


async def pull_once(
    session: aiohttp.ClientSession,
    puller: ProcessPoolExecutor,
    base: str,
    secret: str,
    tokens: list[int],
    mode: str = "tensors",
) -> tuple[int, float]:
    body = {"token_ids": tokens, "kv_transfer_params": {"do_remote_decode": True}}
    async with session.post(f"{base}/v1/prefill", json=body) as resp:
        params = (await resp.json())["kv_transfer_params"]
    url = f"{base}/v1/kv/{params['remote_handle']}"
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(puller, pull_in_process, url, secret, mode)


async def main(args: argparse.Namespace) -> None:
    layout = tuple(int(x) for x in args.layout.split(","))
    coeffs = {c: DegreeCoeffs(d=0.004, c=3e-5, alpha=3e-8) for c in sorted(set(layout))}
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.json"
        # Placement needs a profile; its numbers do not matter for one request at a time.
        made = Profile(args.model, "cpu", 16, coeffs)
        made.capacity = {c: {"kappa_s": 10.0} for c in coeffs}
        made.save(profile)
        degrees = tuple(sorted(set(layout)))
        cfg = ServeConfig(
            model=args.model,
            pool=PoolConfig(degrees, layout),
            engine=EngineConfig(device="cpu", dtype="float32", kv_blocks_per_rank=args.blocks),
            profile=str(profile),
            policy=PolicyConfig(adaptive=False, replication=False),
            request_timeout_s=600.0,
        )
        model_cfg, _ = resolve_model(args.model)
        coord = Coordinator(cfg)
        await coord.start()
        app = build_app(coord, Tokenizer.for_model(None, model_cfg.vocab_size))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        app[ADDRESS].extend(["127.0.0.1", port])
        base = f"http://127.0.0.1:{port}"
        per_token = model_cfg.kv_bytes(4)
        print(f"model {args.model}, layout {layout}: {per_token} KV bytes per token (fp32)")
        print(
            "| tokens | bytes | pull into tensors (GB/s) | pull, bytes read only (GB/s) "
            "| dist transport (GB/s) | socket copy (GB/s) | ratio (tensors) "
            "| ratio (read only) | ratio (dist) |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        puller = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                secret = coord.handoffs.secret
                # The puller's process warms up (imports, a first small pull).
                await pull_once(session, puller, base, secret, [1, 2, 3])
                for n in (int(x) for x in args.tokens.split(",")):
                    runs: dict[str, list[float]] = {
                        "tensors": [],
                        "read": [],
                        "dist": [],
                        "socket": [],
                    }
                    size = 0
                    for k in range(args.repeat):  # interleaved: the machine's noise hits all
                        rng = random.Random(1000 * k + n)
                        tokens = [rng.randrange(model_cfg.vocab_size) for _ in range(n)]
                        size, t = await pull_once(session, puller, base, secret, tokens)
                        runs["tensors"].append(t)
                        _, t = await pull_once(session, puller, base, secret, tokens, "read")
                        runs["read"].append(t)
                        _, t = await pull_once(session, puller, base, secret, tokens, "dist")
                        runs["dist"].append(t)
                        runs["socket"].append(socket_copy_s(size))
                    med = {key: statistics.median(v) for key, v in runs.items()}
                    rate = {key: size / v / 1e9 for key, v in med.items()}
                    print(
                        f"| {n} | {size:,} | {rate['tensors']:.2f} | {rate['read']:.2f} | "
                        f"{rate['dist']:.2f} | {rate['socket']:.2f} | "
                        f"{rate['tensors'] / rate['socket']:.2f} | "
                        f"{rate['read'] / rate['socket']:.2f} | "
                        f"{rate['dist'] / rate['socket']:.2f} |",
                        flush=True,
                    )
        finally:
            puller.shutdown()
            await runner.cleanup()
            await coord.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--layout", default="1,1", help="worker degrees, e.g. 1,1 or 2")
    parser.add_argument("--tokens", default="8192,16384,32768")
    parser.add_argument("--blocks", type=int, default=4096, help="KV blocks per rank")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    try:  # the event loop serve runs on
        import uvloop

        uvloop.run(main(args))
    except ImportError:
        asyncio.run(main(args))
