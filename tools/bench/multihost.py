"""Figures of a pool across hosts on Ray, on one machine: what running the ranks as
Ray actors costs a request, how fast a lost node is seen and served around, and how
long its worker takes to come back on a new node.

    .venv/bin/python -m tools.bench.multihost [--requests 100] [--prompt-tokens 64]
        [--clients 8] [--down-s 5] [--poll-s 0.5] [--lost-degrees 1,2,4] [--json PATH]

It starts a Ray cluster of this machine in its own process (``ray.cluster_utils``:
a head node with no CPUs and two nodes of 2 CPUs, token authentication with a token
made for the run), runs the ``tiny`` model (seeded weights) with the coordinator in
this process, and ends everything it started (the cluster's nodes included).

**Overhead per request.** One degree-4 worker, twice: **local**, a ``ChildRanks`` of
4 ranks, children of this process (the reference); **Ray**, a ``RayRanks`` of one
rank actor per CPU of the two nodes (the worker spans both). For each,
``--requests`` sequential prefills of distinct ``--prompt-tokens`` prompts on an
idle pool (after 5 for warm-up). A request's overhead is the coordinator's prefill
time minus the slowest rank's compute time: commands out and answers back (for Ray:
actor calls, and the answers Ray's thread hands to the coordinator's pipes). It
prints the medians, their difference (target: Ray within 2 ms of local) and ratio.

**Node lost under load.** Two degree-2 workers, one per node (``[pool] degrees``:
``--lost-degrees``; with 4, a group spans both nodes), and ``--clients`` clients
sending distinct prompts one after the other. After 3 s it removes host 1's node
(``Cluster.remove_node`` with ``allow_graceful=False``: its raylet and every
process on it SIGKILLed) and measures:

  * **detection**: from the removal until worker 1 leaves the candidate set (not
    ``active``: a rank actor gone or the node lost, whichever Ray reported first),
    and until Ray reported the node dead (the host vacant: ``ray_host_lost``);
  * **serving meanwhile**: the longest gap between answers from the removal until
    worker 1 is back (and before the removal, for comparison): worker 0 should keep
    serving, and the requests that were on worker 1 be placed again;
  * **rejoin**: ``--down-s`` after Ray's report it adds a node of 2 CPUs; from
    ``add_node`` until worker 1 is active again (the node joins, its slots are
    reserved, two rank actors start, load the weights and form their groups) and
    until worker 1 has answered a prefill.

Every request must be answered once, by a result of its own, and correctly: its
first token is the argmax of a single-process forward of the same model (or ties
it within 1e-4); else it exits 1. ``--json PATH`` writes the figures with the
machine and source they were measured on (``harness.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import logging
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from tools.bench import harness
from tools.ray_local import local_cluster
from vertumnus.config import EngineConfig, resolve_model
from vertumnus.config.pool import PoolConfig
from vertumnus.perfmodel import DegreeCoeffs, Profile
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.cluster.ray_ranks import RayRanks
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ClusterConfig, ServeConfig

NODES, CPUS_PER_NODE = 2, 2
WARM_S = 3.0  # load before the removal (the baseline gap)
WAIT_S = 180.0  # the longest wait for a state or an answer
VOCAB = resolve_model("tiny")[0].vocab_size


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


def config(
    tmp: Path,
    layout: tuple[int, ...],
    cluster: ClusterConfig | None = None,
    degrees: tuple[int, ...] = (1, 2, 4),
) -> ServeConfig:
    per_host = CPUS_PER_NODE if cluster else None
    return ServeConfig(
        model="tiny",
        pool=PoolConfig(degrees, layout, devices_per_host=per_host),
        engine=EngineConfig(device="cpu", threads_per_rank=1, rank_timeout_s=60.0),
        profile=str(profile(tmp / "profile.json")),
        policy=PolicyConfig(adaptive=False, replication=False),
        cluster=cluster,
    )


def prompt(index: int, tokens: int) -> list[int]:
    """Distinct prompts: one seed per index."""
    rng = random.Random(index)
    return [rng.randrange(VOCAB) for _ in range(tokens)]


def ray_cluster() -> contextlib.AbstractContextManager[Any]:
    """A Ray cluster of this machine with token authentication (a fresh token): head
    (no CPUs) and ``NODES`` nodes (``tools/ray_local.py``)."""
    return local_cluster(NODES, CPUS_PER_NODE)


async def ray_pool(
    tmp: Path, address: str, layout: tuple[int, ...], poll_s: float, degrees: tuple[int, ...]
) -> tuple[Coordinator, RayRanks]:
    cluster = ClusterConfig(address=address, hosts=NODES, poll_s=poll_s)
    cfg = config(tmp, layout, cluster, degrees)
    model, model_dir = resolve_model(cfg.model)
    ranks = RayRanks(cluster, model, model_dir, cfg.engine, CPUS_PER_NODE)
    try:
        await asyncio.get_running_loop().run_in_executor(None, ranks.gather)
        ranks.configure(cfg.degrees)
        coord = Coordinator(cfg, ranks)
    except BaseException:
        ranks.close()
        raise
    await coord.start()
    return coord, ranks


async def overheads(coord: Coordinator, n: int, tokens: int) -> tuple[list[float], list[float]]:
    over, compute = [], []
    for i in range(n + 5):
        result = await coord.prefill(prompt(i, tokens))
        if i >= 5:  # warm-up
            over.append(result.prefill_s - result.rank_compute_s)
            compute.append(result.rank_compute_s)
    return over, compute


@dataclass
class Sent:
    index: int  # its prompt's seed
    answered_s: float | None = None
    first_token: int | None = None
    request_id: int | None = None
    worker: int | None = None
    error: str | None = None


async def client(
    coord: Coordinator, ids: Iterator[int], tokens: int, stop: asyncio.Event, log: list[Sent]
) -> None:
    """Prefills one after the other until ``stop``."""
    while not stop.is_set():
        sent = Sent(next(ids))
        log.append(sent)
        try:
            result = await coord.prefill(prompt(sent.index, tokens))
        except Exception as exc:
            sent.error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.1)  # (refused at once while nothing serves)
            continue
        sent.answered_s = time.monotonic()
        sent.first_token, sent.request_id = result.first_token, result.request_id
        sent.worker = result.worker


async def until(done: Callable[[], bool]) -> float | None:
    """Wait (polling every 5 ms) until ``done()``: when (None: not within ``WAIT_S``)."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.005)
    return time.monotonic()


def since(t: float | None, start: float | None) -> float | None:
    return None if t is None or start is None else t - start


def longest_gap(log: list[Sent], start_s: float, end_s: float) -> float:
    """The longest time without an answer between ``start_s`` and ``end_s``."""
    times = sorted(t for s in log if (t := s.answered_s) is not None and start_s <= t <= end_s)
    points = [start_s, *times, end_s]
    return max(b - a for a, b in itertools.pairwise(points))


async def node_lost(
    cluster: Any, coord: Coordinator, ranks: RayRanks, args: argparse.Namespace
) -> tuple[dict[str, float | None], list[Sent]]:
    """Host 1's node removed under load, then a new node added (see the module).
    Returns the figures (None: what did not happen within ``WAIT_S``) and the log."""
    loop = asyncio.get_running_loop()
    host = ranks.hosts.hosts[1]
    node = next(n for n in cluster.worker_nodes if n.node_id == host.node_id)
    worker = coord.lattice.workers[1]
    ids, stop, log = itertools.count(10_000), asyncio.Event(), []
    tokens = args.prompt_tokens
    clients = [
        asyncio.create_task(client(coord, ids, tokens, stop, log)) for _ in range(args.clients)
    ]
    began = time.monotonic()
    out = vacant = added = active = served = None
    add_call_s = None
    try:
        await asyncio.sleep(WARM_S)
        removed = time.monotonic()
        await loop.run_in_executor(None, lambda: cluster.remove_node(node, allow_graceful=False))
        remove_call_s = time.monotonic() - removed
        out = await until(lambda: worker.state is not WorkerState.ACTIVE)
        vacant = await until(lambda: host.group is None)  # Ray said the node is dead
        if vacant is not None:
            await asyncio.sleep(args.down_s)
            added = time.monotonic()
            # Ray registers a node's exit hooks from the main thread only; this one
            # ends with the cluster (``Cluster.shutdown``) all the same.
            cluster._shutdown_at_exit = False
            await loop.run_in_executor(None, lambda: cluster.add_node(num_cpus=CPUS_PER_NODE))
            add_call_s = time.monotonic() - added
            active = await until(lambda: worker.state is WorkerState.ACTIVE)
        if active is not None:
            served = await until(
                lambda: any(s.worker == 1 and (s.answered_s or 0.0) > active for s in log)
            )
        await asyncio.sleep(1.0)
    finally:
        stop.set()  # (each client ends after its request in flight)
        await asyncio.wait_for(asyncio.gather(*clients), WAIT_S)
    end = time.monotonic() if active is None else active
    after = [t for s in log if (t := s.answered_s) is not None and t >= (out or end)]
    figures = {
        "detection_s": since(out, removed),
        "ray_report_s": since(vacant, removed),
        "remove_call_s": remove_call_s,
        "longest_gap_s": longest_gap(log, removed, end),
        "baseline_gap_s": longest_gap(log, began + 1.0, removed),
        "serves_again_s": since(min(after, default=None), out),
        "add_call_s": add_call_s,
        "rejoin_active_s": since(active, added),
        "rejoin_served_s": since(served, added),
    }
    return figures, log


def ms(seconds: float | None) -> str:
    return f"(not within {WAIT_S:g} s)" if seconds is None else f"{seconds * 1e3:.0f} ms"


def reference_tokens(indices: list[int], tokens: int) -> dict[int, tuple[int, Any]]:
    """(argmax, last-position logits) of each prompt: one process, no cache."""
    import torch

    from vertumnus.engine.model import causal_attention
    from vertumnus.engine.weights import build_model

    cfg, model_dir = resolve_model("tiny")
    model = build_model(cfg, model_dir, EngineConfig().seed, torch.float32, torch.device("cpu"))
    out = {}
    with torch.inference_mode():
        for index in indices:
            ids = torch.tensor(prompt(index, tokens), dtype=torch.long)
            hidden = model(ids, torch.arange(len(ids)), causal_attention())
            logits = model.logits(hidden[-1:])[0]
            out[index] = (int(logits.argmax()), logits)
    return out


def check(log: list[Sent], tokens: int) -> dict[str, int]:
    """Every request answered, once (a request id of its own), with the reference's
    first token (or one that ties it within 1e-4)."""
    answered = [s for s in log if s.error is None]
    expected = reference_tokens([s.index for s in answered], tokens)
    wrong = 0
    for s in answered:
        token, logits = expected[s.index]
        assert s.first_token is not None
        if s.first_token != token and float(logits[token] - logits[s.first_token]) > 1e-4:
            wrong += 1
    return {
        "sent": len(log),
        "answered": len(answered),
        "failed": len(log) - len(answered),
        "answered_twice": len(answered) - len({s.request_id for s in answered}),
        "wrong": wrong,
        "by_worker_0": sum(s.worker == 0 for s in answered),
        "by_worker_1": sum(s.worker == 1 for s in answered),
    }


async def overhead(tmp: Path, address: str, args: argparse.Namespace) -> dict[str, Any]:
    """A degree-4 worker of local ranks, then of Ray's (see the module)."""
    n, tokens = args.requests, args.prompt_tokens
    local = Coordinator(config(tmp, (4,)))
    await local.start()
    try:
        local_over, local_compute = await overheads(local, n, tokens)
    finally:
        await local.close()
    coord, _ = await ray_pool(tmp, address, (4,), args.poll_s, (1, 2, 4))
    try:
        ray_over, ray_compute = await overheads(coord, n, tokens)
    finally:
        await coord.close()
    lo, ro = statistics.median(local_over), statistics.median(ray_over)
    lc, rc = statistics.median(local_compute), statistics.median(ray_compute)
    print(f"degree-4 worker, {n} sequential {tokens}-token prefills on an idle pool")
    print(
        f"  overhead per request: local {lo * 1e3:.3f} ms, Ray {ro * 1e3:.3f} ms "
        f"(+{(ro - lo) * 1e3:.3f} ms, x{ro / lo:.2f}; target: within 2 ms)"
    )
    print(f"  rank compute:         local {lc * 1e3:.3f} ms, Ray {rc * 1e3:.3f} ms", flush=True)
    return {
        "overhead_s": {"local": harness.summary(local_over), "ray": harness.summary(ray_over)},
        "rank_compute_s": {
            "local": harness.summary(local_compute),
            "ray": harness.summary(ray_compute),
        },
    }


async def losing(tmp: Path, cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Two degree-2 workers, host 1's node removed under load (see the module)."""
    degrees = tuple(int(c) for c in args.lost_degrees.split(","))
    coord, ranks = await ray_pool(tmp, cluster.address, (2, 2), args.poll_s, degrees)
    try:
        lost, log = await node_lost(cluster, coord, ranks, args)
    finally:
        await coord.close()
    requests = check(log, args.prompt_tokens)
    print(
        f"host 1's node removed under load (layout 2CP2 of degrees {list(degrees)}, one "
        f"worker per node, {args.clients} clients, poll_s {args.poll_s:g})"
    )
    print(
        f"  detection (removal -> worker 1 out of the candidate set): {ms(lost['detection_s'])}"
        f"; Ray reported the node dead after {ms(lost['ray_report_s'])}"
    )
    print(
        f"  longest gap between answers, removal -> worker 1 back: "
        f"{ms(lost['longest_gap_s'])} (before the removal: {ms(lost['baseline_gap_s'])})"
        f"; detection -> next answer: {ms(lost['serves_again_s'])}"
    )
    print(
        f"  rejoin, {args.down_s:g} s after Ray's report: add_node -> worker 1 active "
        f"{ms(lost['rejoin_active_s'])}, -> worker 1 served a prefill "
        f"{ms(lost['rejoin_served_s'])} (add_node call {ms(lost['add_call_s'])})"
    )
    ok = requests["failed"] == requests["answered_twice"] == requests["wrong"] == 0
    ok = ok and lost["rejoin_served_s"] is not None
    print(f"  requests: {requests} -> {'OK' if ok else 'FAILED'}")
    errors = collections.Counter(s.error for s in log if s.error is not None)
    return {"node_lost": {**lost, "requests": requests, "errors": dict(errors)}, "ok": ok}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    structlog.configure(  # the pool's warnings and errors, on stderr
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    with tempfile.TemporaryDirectory() as d, ray_cluster() as cluster:
        figures = await overhead(Path(d), cluster.address, args)
        return {"args": vars(args), **figures, **await losing(Path(d), cluster, args)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, node lost")
    p.add_argument("--down-s", type=float, default=5.0, help="detection -> a new node")
    p.add_argument("--poll-s", type=float, default=0.5, help="[cluster] poll_s")
    p.add_argument("--lost-degrees", default="1,2,4", help="[pool] degrees, node lost")
    harness.add_arguments(p)
    args = p.parse_args()
    session = harness.Session("multihost", args)
    doc = session.finish(args.json, asyncio.run(main(args)))
    sys.exit(0 if doc["ok"] else 1)
