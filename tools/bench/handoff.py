"""The KV hand-off's bandwidth against a plain socket copy of the same bytes.

    .venv/bin/python -m tools.bench.handoff [--model tiny] [--layout 1,1]
        [--tokens 8192,16384,32768] [--repeat 3]

Starts a coordinator with its rank processes (CPU, fp32) and the REST app on
127.0.0.1, then for each prompt length: one prefill with ``kv_transfer_params.
do_remote_decode``, and its pull (``GET /v1/kv/{handle}``) by the decode server's
own client (``decode/kv_pull.py``, into its tensors), timed from the request to
the last byte (``pull``) and from the answer's first bytes to the last
(``stream``: the bandwidth, without the request's round trip). The puller runs in
a process of its own, on uvloop, as a decode server does. Also: the stream read
whole by a plain aiohttp client, and the ``dist`` transport. The reference,
measured in the same run: the same number of bytes sent over a TCP loopback
connection by one thread (``sendall`` of one buffer) and received by another
(``recv_into`` one buffer). Prints per length the KV bytes (and bytes per token
of the model), GB/s of each, and the ratios to the reference (target: 0.8 or
more from 8K tokens up). The pull is repeated ``--repeat`` times (a fresh prefill
each), interleaved with the others, and the median taken. ``--json PATH`` writes the
figures with the machine and source they were measured on (``harness.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import random
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tools.bench import harness
from vertumnus.config import EngineConfig, resolve_model
from vertumnus.config.pool import PoolConfig
from vertumnus.decode import kv_pull
from vertumnus.decode.dist_client import pull_dist
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.server.app import build_app
from vertumnus.server.keys import ADDRESS


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


def copy_sender(ports: Any) -> None:
    """A process that sends, to each connection, as many bytes as it asks for (8
    bytes, little-endian) from one buffer written before: the two-process
    reference's sending end."""
    server = socket.create_server(("127.0.0.1", 0))
    ports.put(server.getsockname()[1])
    payload = bytearray()
    while True:
        conn, _ = server.accept()
        size = int.from_bytes(conn.recv(8), "little")
        if size > len(payload):
            payload = bytearray(size)  # zero-filled: its pages exist before the copy
        conn.sendall(memoryview(payload)[:size])
        conn.close()


SINKS: dict[int, bytearray] = {}  # the receiving end's buffers, kept warm


def copy_receive(port: int, size: int) -> tuple[float, float]:
    """In the puller's process: ``size`` bytes from ``copy_sender`` into one buffer;
    seconds from the request, and from the first bytes, to the last."""
    if size not in SINKS:
        SINKS[size] = bytearray(size)
    view, got, first = memoryview(SINKS[size]), 0, None
    conn = socket.create_connection(("127.0.0.1", port))
    start = time.perf_counter()
    conn.sendall(size.to_bytes(8, "little"))
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise RuntimeError("the copy's sender stopped")
        first = first or time.perf_counter()
        got += n
    end = time.perf_counter()
    conn.close()
    return end - start, end - (first or start)


def pull_in_process(url: str, secret: str, mode: str) -> tuple[int, float, float | None]:
    """In the puller's own process (as a decode server is): the KV of one hand-off.
    ``mode``: "tensors", with the decode server's own client (``decode/kv_pull.py``:
    the stream parsed, and put into per-layer K and V tensors); "read", the stream
    only read; "dist", the ranks send it over torch.distributed (gloo here) into
    tensors (``decode/dist_client.py``)."""

    async def pull() -> tuple[int, float, float | None]:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            start = time.perf_counter()
            base, _, handle = url.rpartition("/v1/kv/")
            if mode == "tensors":
                pulled = await kv_pull.pull(base, handle, secret)
                seconds = time.perf_counter() - start
                pulled.release()  # as the decode server does once the KV is in its cache
                return pulled.num_bytes, seconds, pulled.stream_s
            if mode == "dist":
                pulled = await pull_dist(base, handle, secret, session=session)
                return pulled.num_bytes, time.perf_counter() - start, None
            got = 0
            async with session.get(url, headers={"Authorization": f"Bearer {secret}"}) as resp:
                assert resp.status == 200, await resp.text()
                async for chunk in resp.content.iter_any():
                    got += len(chunk)
            return got, time.perf_counter() - start, None

    try:  # the event loop the decode server runs on
        import uvloop

        return uvloop.run(pull())
    except ImportError:
        return asyncio.run(pull())


async def pull_once(
    session: aiohttp.ClientSession,
    puller: ProcessPoolExecutor,
    base: str,
    secret: str,
    tokens: list[int],
    mode: str = "tensors",
) -> tuple[int, float, float | None]:
    body = {"token_ids": tokens, "kv_transfer_params": {"do_remote_decode": True}}
    async with session.post(f"{base}/v1/prefill", json=body) as resp:
        params = (await resp.json())["kv_transfer_params"]
    url = f"{base}/v1/kv/{params['remote_handle']}"
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(puller, pull_in_process, url, secret, mode)


async def main(args: argparse.Namespace) -> dict[str, Any]:
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
        gc.freeze()  # as serve does once started
        per_token = model_cfg.kv_bytes(4)
        print(f"model {args.model}, layout {layout}: {per_token} KV bytes per token (fp32)")
        print(
            "| tokens | bytes | pull | stream | aiohttp client | dist | copy, 2 processes "
            "| copy, 2 processes, from its first byte | copy, 2 threads | pull / copy "
            "| stream / copy from its first byte | pull / copy, 2 threads | aiohttp / copy "
            "| dist / copy |"
        )
        print("| ---: " * 14 + "|")
        ctx = multiprocessing.get_context("spawn")
        ports = ctx.Queue()
        sender = ctx.Process(target=copy_sender, args=(ports,), daemon=True)
        sender.start()
        copy_port = ports.get(timeout=60)
        puller = ProcessPoolExecutor(1, mp_context=ctx)
        loop = asyncio.get_running_loop()
        lengths: dict[int, Any] = {}
        try:
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                secret = coord.handoffs.secret
                # The puller's process warms up (imports, a first small pull).
                await pull_once(session, puller, base, secret, [1, 2, 3])
                for n in (int(x) for x in args.tokens.split(",")):
                    keys = ("pull", "stream", "aiohttp", "dist", "copy", "copy_first", "threads")
                    runs: dict[str, list[float]] = {key: [] for key in keys}
                    size = 0
                    for k in range(args.repeat):  # interleaved: the machine's noise hits all
                        rng = random.Random(1000 * k + n)
                        tokens = [rng.randrange(model_cfg.vocab_size) for _ in range(n)]
                        size, t, stream_s = await pull_once(session, puller, base, secret, tokens)
                        assert stream_s is not None
                        runs["pull"].append(t)
                        runs["stream"].append(stream_s)
                        _, t, _ = await pull_once(session, puller, base, secret, tokens, "read")
                        runs["aiohttp"].append(t)
                        _, t, _ = await pull_once(session, puller, base, secret, tokens, "dist")
                        runs["dist"].append(t)
                        copy = await loop.run_in_executor(puller, copy_receive, copy_port, size)
                        runs["copy"].append(copy[0])
                        runs["copy_first"].append(copy[1])
                        runs["threads"].append(socket_copy_s(size))
                    rate = {key: size / statistics.median(v) / 1e9 for key, v in runs.items()}
                    ratios = (
                        rate["pull"] / rate["copy"],
                        rate["stream"] / rate["copy_first"],
                        rate["pull"] / rate["threads"],
                        rate["aiohttp"] / rate["copy"],
                        rate["dist"] / rate["copy"],
                    )
                    print(
                        f"| {n} | {size:,} | "
                        + " | ".join(f"{rate[key]:.2f}" for key in keys)
                        + " | "
                        + " | ".join(f"{x:.2f}" for x in ratios)
                        + " |",
                        flush=True,
                    )
                    lengths[n] = {
                        "bytes": size,
                        "gb_s": rate,
                        "runs_s": runs,
                        "pull_over_copy": ratios[0],
                        "stream_over_copy_from_first_byte": ratios[1],
                        "pull_over_copy_threads": ratios[2],
                        "aiohttp_over_copy": ratios[3],
                        "dist_over_copy": ratios[4],
                    }
        finally:
            puller.shutdown()
            sender.kill()
            sender.join()
            await runner.cleanup()
            await coord.close()
    return {"args": vars(args), "kv_bytes_per_token": per_token, "lengths": lengths}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--layout", default="1,1", help="worker degrees, e.g. 1,1 or 2")
    parser.add_argument("--tokens", default="8192,16384,32768")
    parser.add_argument("--blocks", type=int, default=4096, help="KV blocks per rank")
    parser.add_argument("--repeat", type=int, default=3)
    harness.add_arguments(parser)
    args = parser.parse_args()
    session = harness.Session("handoff", args)
    try:  # the event loop serve runs on
        import uvloop

        figures = uvloop.run(main(args))
    except ImportError:
        figures = asyncio.run(main(args))
    session.finish(args.json, figures)
