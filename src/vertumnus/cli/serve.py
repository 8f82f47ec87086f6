"""``python -m vertumnus serve``: the prefill pool behind a REST API.

Starts the rank processes (the embedded default: the ``tiny`` model on two CPU ranks,
see ``runtime/serve_config.py``), the asyncio coordinator on uvloop and the aiohttp
API (docs/api.md). Binds 127.0.0.1 unless told otherwise; ``--port 0`` picks a free
port. Logs are JSON lines on stderr, one per request and per reconfiguration. The
first line on stdout says where it listens. SIGTERM or SIGINT stops admission (new
requests get a 503), lets accepted requests finish for up to ``[server]
shutdown_grace_s`` (30 s), fails what is left with a 503, stops the ranks and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

from vertumnus.cli.args import Renamed
from vertumnus.policy.pool_config import PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, metavar="configs/serve/NAME.toml")
    p.add_argument(
        "--model", default=None, help="preset or Hugging Face folder (overrides the config)"
    )
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help="a preset of router, composition and replication, over the config file",
    )
    p.add_argument("--policy", action=Renamed, new="--preset", help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port")


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    import orjson

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # ``log.exception`` (and ``exc_info=True``) put the traceback in the line
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=orjson.dumps),
        ],
        logger_factory=structlog.BytesLoggerFactory(sys.stderr.buffer),
        cache_logger_on_first_use=True,
    )


async def serve(args: argparse.Namespace, cluster: Any, cfg: Any) -> int:
    """``cfg``: the configuration, read already (None for a multi-host pool, whose
    configuration needs its Ray nodes' topology: ``cluster``)."""
    from aiohttp import web

    from vertumnus import native
    from vertumnus.protocol.tokenizer import Tokenizer
    from vertumnus.runtime.coordinator import Coordinator
    from vertumnus.server.app import build_app
    from vertumnus.server.keys import ADDRESS
    from vertumnus.server.proxy import DecodeProxy

    ranks = None
    if cfg is None:
        ranks, cfg = await gather_cluster(args, cluster)
    try:
        coordinator = Coordinator(cfg, ranks)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    tokenizer = Tokenizer.for_model(coordinator.model_dir, coordinator.model_cfg.vocab_size)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await coordinator.start()
    proxy = DecodeProxy(coordinator, cfg.decode, cfg.model) if cfg.decode.enabled else None
    app = build_app(coordinator, tokenizer, proxy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
        port = runner.addresses[0][1]
        app[ADDRESS].extend([args.host, port])
        if proxy is not None:  # (a local decode process starts in the background)
            local = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
            await proxy.start(f"http://{local}:{port}")
        # What start-up made lives as long as the process: out of the collector's
        # sight, a full collection takes a millisecond instead of about 100 (measured:
        # 93 ms pauses of the event loop mid-pull before).
        gc.freeze()
        print(f"vertumnus listening on http://{args.host}:{port}", flush=True)
        structlog.get_logger("vertumnus").info(
            "listening", host=args.host, port=port, decode=proxy and proxy.url,
            native=native.status(),
        )  # fmt: skip
        await stop.wait()
    finally:
        log = structlog.get_logger("vertumnus")
        # Stop admission, let accepted requests finish (up to the grace period),
        # then close the listener and stop the ranks.
        coordinator.stop_admission()
        log.info("shutting_down", open_requests=coordinator.open_requests)
        left = await coordinator.drain(cfg.shutdown_grace_s)
        if left:
            log.warning("grace_period_over", failed_requests=left)
        await runner.cleanup()
        if proxy is not None:
            await proxy.close()
        await coordinator.close()
        log.info("stopped")
    return 0


async def gather_cluster(args: argparse.Namespace, cluster: Any) -> tuple[Any, Any]:
    """Join the Ray cluster of a multi-host pool and reserve its hosts; its
    configuration then has their topology (ranks, ranks per host)."""
    from vertumnus.config import resolve_model
    from vertumnus.runtime.cluster.ray_ranks import RayRanks
    from vertumnus.runtime.serve_config import load, load_rank_setup

    model, engine, per_host = load_rank_setup(args.config, args.model)
    model_cfg, model_dir = resolve_model(model)
    ranks = RayRanks(cluster, model_cfg, model_dir, engine, per_host)
    try:
        print(f"vertumnus waiting for {cluster.hosts} Ray node(s) at {cluster.address}", flush=True)
        structlog.get_logger("vertumnus").info(
            "waiting_for_ray", hosts=cluster.hosts, address=cluster.address
        )
        topology = await asyncio.get_running_loop().run_in_executor(None, ranks.gather)
        cfg = load(args.config, args.model, topology=topology, preset=args.preset)
        ranks.configure(cfg.degrees)
    except BaseException:
        ranks.close()
        raise
    return ranks, cfg


def run(args: argparse.Namespace) -> int:
    from vertumnus.runtime.serve_config import load, load_cluster

    # A mistake in the configuration is one error line, before anything starts.
    cluster = load_cluster(args.config)
    cfg = None if cluster is not None else load(args.config, args.model, preset=args.preset)
    configure_logging()
    try:
        import uvloop

        return uvloop.run(serve(args, cluster, cfg))
    except ImportError:
        return asyncio.run(serve(args, cluster, cfg))
