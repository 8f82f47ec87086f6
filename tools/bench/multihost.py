"""Figures of a two-host pool on one machine: what the agent hop costs, how fast a
lost host is seen, and how long its worker takes to rejoin.

    .venv/bin/python -m tools.bench.multihost [--requests 100] [--prompt-tokens 64]

Runs the ``tiny`` model on 4 CPU ranks as one degree-4 worker (seeded weights),
twice, with the coordinator in this process:

  * **local**: a ``ChildRanks`` of 4 ranks, children of this process (the reference);
  * **two hosts**: a ``ClusterRanks``, with two ``python -m vertumnus agent``
    processes of 2 ranks each on loopback. The degree-4 worker spans both.

For each, it sends ``--requests`` sequential prefills of distinct prompts. The
**overhead** per request is the coordinator's prefill time minus the slowest rank's
compute time: commands out, answers back, and for the two-host pool the hop through
the agents (ZeroMQ, signed). It prints the medians and their ratio. Both
layouts run the same degree-4 prefill, so their compute times compare too.

Then, on a layout of two degree-2 workers (one per host), it SIGKILLs host 1's
agent and measures two things:
  * **detection**: from the kill until that worker leaves the candidate set;
  * **rejoin**: from a new agent's start until the worker serves again. This
    includes starting its 2 rank processes, loading weights and forming groups.

``--json PATH`` writes the figures with the machine and source they were measured
on (``harness.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.bench import harness
from vertumnus.config import EngineConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.cluster.ranks import ClusterRanks
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ClusterConfig, ServeConfig

SECRET = "bench-multihost-secret-0123"


def profile(path: Path) -> Path:
    p = Profile(
        "tiny",
        "cpu",
        16,
        {c: DegreeCoeffs(d=0.004 * c, c=3e-5 / c, alpha=3e-8 / c) for c in (1, 2, 4)},
    )
    p.capacity = {c: {"kappa_s": 10.0 * c} for c in (1, 2, 4)}
    p.save(path)
    return path


def config(tmp: Path, layout: tuple[int, ...], per_host: int | None) -> ServeConfig:
    return ServeConfig(
        model="tiny",
        pool=PoolConfig((1, 2, 4), layout, devices_per_host=per_host),
        engine=EngineConfig(device="cpu", threads_per_rank=1, rank_timeout_s=60.0),
        profile=str(profile(tmp / "profile.json")),
        policy=PolicyConfig(adaptive=False, replication=False),
    )


def start_agent(address: str, name: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "vertumnus", "agent", "--coordinator", address]
    with log.open("ab") as out:
        return subprocess.Popen(
            [*cmd, "--name", name, "--devices", "2"],
            env={**os.environ, "VERTUMNUS_CLUSTER_SECRET": SECRET},
            stdout=out,
            stderr=out,
            start_new_session=True,
        )


async def two_hosts(
    tmp: Path, layout: tuple[int, ...]
) -> tuple[Coordinator, dict[str, subprocess.Popen[bytes]], str]:
    """The coordinator of a two-host pool, its agents by name, and their address."""
    cluster = ClusterConfig(
        listen="127.0.0.1:0", hosts=2, secret=SECRET, heartbeat_s=0.5, agent_timeout_s=3.0
    )
    cfg = config(tmp, layout, 2)
    from vertumnus.config import resolve_model

    model, model_dir = resolve_model("tiny")
    pool = ClusterRanks(cluster, model, model_dir, cfg.engine)
    address = f"127.0.0.1:{pool.port}"
    agents = {n: start_agent(address, n, tmp / f"{n}.log") for n in ("host0", "host1")}
    await asyncio.get_running_loop().run_in_executor(None, pool.gather)
    pool.configure(cfg.degrees)
    coord = Coordinator(cfg, pool)
    await coord.start()
    return coord, agents, address


async def stop(coord: Coordinator, agents: dict[str, subprocess.Popen[bytes]]) -> None:
    await coord.close()
    for a in agents.values():
        try:
            a.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()


async def overheads(coord: Coordinator, n: int, tokens: int) -> tuple[list[float], list[float]]:
    rng = random.Random(0)
    over, compute = [], []
    for i in range(n + 5):
        result = await coord.prefill([rng.randrange(256) for _ in range(tokens)])
        if i >= 5:  # warm-up
            over.append(result.prefill_s - result.rank_compute_s)
            compute.append(result.rank_compute_s)
    return over, compute


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        local = Coordinator(config(tmp, (4,), None))
        await local.start()
        try:
            local_over, local_compute = await overheads(local, args.requests, args.prompt_tokens)
        finally:
            await local.close()
        coord, agents, _ = await two_hosts(tmp, (4,))
        try:
            remote_over, remote_compute = await overheads(coord, args.requests, args.prompt_tokens)
        finally:
            await stop(coord, agents)
        lo, ro = statistics.median(local_over), statistics.median(remote_over)
        print(f"degree-4 worker, {args.requests} sequential {args.prompt_tokens}-token prefills")
        print(
            f"  overhead per request: local {lo * 1e3:.3f} ms, two hosts {ro * 1e3:.3f} ms "
            f"(x{ro / lo:.2f}; +{(ro - lo) * 1e3:.3f} ms)"
        )
        lc, rc = statistics.median(local_compute), statistics.median(remote_compute)
        print(f"  rank compute:         local {lc * 1e3:.3f} ms, two hosts {rc * 1e3:.3f} ms")

        coord, agents, address = await two_hosts(tmp, (2, 2))
        try:
            killed = time.monotonic()
            agents["host1"].kill()
            while coord.lattice.workers[1].state is WorkerState.ACTIVE:
                await asyncio.sleep(0.001)
            detect_s = time.monotonic() - killed
            agents["host1"].wait()
            await asyncio.sleep(1.0)
            started = time.monotonic()
            agents["host1"] = start_agent(address, "host1", tmp / "host1b.log")
            while coord.lattice.workers[1].state is not WorkerState.ACTIVE:
                await asyncio.sleep(0.01)
            rejoin_s = time.monotonic() - started
        finally:
            await stop(coord, agents)
        print("host 1's agent SIGKILLed (layout 2CP2, one worker per host)")
        print(f"  detection (kill -> out of the candidate set): {detect_s * 1e3:.1f} ms")
        print(f"  rejoin (agent started -> worker active):      {rejoin_s:.2f} s")
        return {
            "args": vars(args),
            "overhead_s": {
                "local": harness.summary(local_over),
                "two_hosts": harness.summary(remote_over),
            },
            "rank_compute_s": {
                "local": harness.summary(local_compute),
                "two_hosts": harness.summary(remote_compute),
            },
            "detection_s": detect_s,
            "rejoin_s": rejoin_s,
        }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--prompt-tokens", type=int, default=64)
    harness.add_arguments(p)
    args = p.parse_args()
    session = harness.Session("multihost", args)
    session.finish(args.json, asyncio.run(main(args)))
