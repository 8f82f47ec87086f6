"""``python -m vertumnus agent``: run this host's ranks for a multi-host pool.

Connects to the coordinator (``serve`` with a ``[cluster]`` table) at
``--coordinator HOST:PORT``, starts this host's rank processes when told, and keeps
them connected (``runtime/cluster/agent.py``). The cluster secret comes from
``$VERTUMNUS_CLUSTER_SECRET`` (at least 16 characters, the same as the
coordinator's). The model must be readable at the same path on every host. Exits 0
when the coordinator shuts the pool down, on SIGTERM or SIGINT, and 1 when the
coordinator refuses this host (it says why). See docs/multi-host.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--name", default=None, help="this host's name in the pool (default: hostname)")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="rank processes to run here, one per GPU (default: the GPUs, or 1 without one)",
    )


def run(args: argparse.Namespace) -> int:
    from vertumnus.cli.serve import configure_logging
    from vertumnus.config import ConfigError
    from vertumnus.runtime.cluster import channel

    try:
        keys = channel.Keys(os.environ.get(channel.SECRET_ENV, ""))
        host, port = channel.split_address(args.coordinator)
    except channel.ControlError as exc:
        raise ConfigError(str(exc)) from exc
    if args.devices is not None and args.devices < 1:
        raise ConfigError("--devices must be >= 1")
    configure_logging()
    import torch

    from vertumnus.runtime.cluster.agent import Agent

    cuda = torch.cuda.is_available()
    devices = args.devices if args.devices is not None else (torch.cuda.device_count() or 1)
    agent = Agent(keys, f"{host}:{port}", args.name or socket.gethostname(), devices, cuda)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop.set())
    return agent.run()
