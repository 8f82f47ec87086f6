"""``python -m vertumnus decode``: the reference decode server beside a prefill pool.

Serves ``POST /v1/completions`` and ``/v1/chat/completions`` (docs/api.md, "The
decode server"): a request's prompts are prefilled by the pool at ``--prefill`` (or
were, when it brings the pool's ``kv_transfer_params``), their KV is pulled from the
pool, and this server decodes the rest with continuous batching on one thread
(``vertumnus/decode/``), under the name ``--served-model-name`` (default: ``--model``
as given). The model must be the pool's: the same preset and ``--seed``, or the same
folder. Its end-of-sequence ids come from the folder's ``generation_config.json`` (else
``config.json``); presets have none. ``--prefill-key`` (or
``$VERTUMNUS_PREFILL_KEY``) is the bearer sent to the pool for prefills and pulls;
``--api-key`` (or ``$VERTUMNUS_DECODE_API_KEY``) guards this server's ``/v1/*``.

Binds 127.0.0.1 unless told otherwise; ``--port 0`` picks a free port. The first
line on stdout says where it listens; logs are JSON lines on stderr. SIGTERM or
SIGINT stops it (requests under way get up to 10 s to finish) and
it exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
from typing import Any

import structlog

from vertumnus.cli.serve import configure_logging
from vertumnus.config import ConfigError, resolve_model
from vertumnus.config.model import eos_token_ids

SHUTDOWN_GRACE_S = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill", required=True, metavar="URL", help="the prefill pool, http://host:port"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0: a free port (default: 8100)")
    p.add_argument(
        "--model", default="tiny", help="the pool's preset or Hugging Face folder (default: tiny)"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model's name in the API, which a request's 'model' must be "
        "(default: --model as given; serve passes the pool's)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of a preset's random weights (default: 0)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument(
        "--prefill-key",
        default=os.environ.get("VERTUMNUS_PREFILL_KEY"),
        help="bearer for the pool's prefills and pulls (default: $VERTUMNUS_PREFILL_KEY)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("VERTUMNUS_DECODE_API_KEY"),
        help="guards /v1/* of this server (default: $VERTUMNUS_DECODE_API_KEY; none: open)",
    )
    p.add_argument(
        "--transport",
        default="http",
        choices=("http", "dist"),
        help="how the KV comes: the pull stream (http) or sent by the pool's ranks over "
        "torch.distributed (dist: gloo on CPU, NCCL between GPUs; both sides alike)",
    )
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone (serve's local decode process sets it)",
    )


async def _exit_with(pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once process ``pid`` is gone (or is no longer our parent)."""
    while os.getppid() == pid:
        await asyncio.sleep(1.0)
    structlog.get_logger("vertumnus").warning("parent_gone", parent=pid)
    stop.set()


async def serve(args: argparse.Namespace, settings: Any, engine: Any, tokenizer: Any) -> int:
    from aiohttp import web

    from vertumnus.decode.server import build_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = build_app(engine, tokenizer, settings)
    # Handlers are cancelled when their client goes away: its sequence leaves the batch.
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S
    )
    await runner.setup()
    log = structlog.get_logger("vertumnus")
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        port = runner.addresses[0][1]
        gc.freeze()  # start-up's objects out of the collector's sight (as serve does)
        print(f"vertumnus listening on http://{args.host}:{port}", flush=True)
        log.info(
            "listening",
            host=args.host,
            port=port,
            model=settings.served_model,
            prefill=settings.prefill_url,
            eos_token_ids=list(settings.eos_token_ids),
        )
        watch = None
        if args.parent_pid is not None:
            watch = asyncio.create_task(_exit_with(args.parent_pid, stop))
        await stop.wait()
        if watch is not None:
            watch.cancel()
        log.info("shutting_down")
    finally:
        await runner.cleanup()
        log.info("stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    cfg, model_dir = resolve_model(args.model)
    if not args.prefill.startswith(("http://", "https://")):
        raise ConfigError(f"--prefill must start with http:// or https://, got {args.prefill!r}")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    eos = eos_token_ids(model_dir)

    # Heavy imports only once the arguments are known to be good.
    import torch

    from vertumnus.decode.engine import DecodeEngine
    from vertumnus.decode.keys import DecodeSettings
    from vertumnus.engine.weights import build_model, resolve_dtype
    from vertumnus.protocol.tokenizer import Tokenizer

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if on_cuda else "cpu")
    model = build_model(cfg, model_dir, args.seed, resolve_dtype(args.dtype, device), device)
    model.requires_grad_(False)
    settings = DecodeSettings(
        model=cfg,
        served_model=args.served_model_name or args.model,
        eos_token_ids=eos,
        prefill_url=args.prefill.rstrip("/"),
        prefill_key=args.prefill_key or None,
        api_key=args.api_key or None,
        transport=args.transport,
        dist_host=args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1",
    )
    tokenizer = Tokenizer.for_model(model_dir, cfg.vocab_size)
    configure_logging()
    if cfg.dsv4 is not None:  # its prompt's state, not K and V rows
        from vertumnus.decode.dsv4_engine import DsV4DecodeEngine

        if args.transport != "http":
            raise ConfigError("DeepSeek-V4's hand-off runs over http only (--transport http)")
        engine: DecodeEngine = DsV4DecodeEngine(model)  # type: ignore[arg-type]
    else:
        engine = DecodeEngine(model)
    main = serve(args, settings, engine, tokenizer)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
