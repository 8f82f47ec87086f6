"""Soak: the real server as users run it (the pool and its local decode process),
under steady load with periodic splits and merges, one rank killed and one decode
process killed, checked for lost requests, wrong answers, leaks and memory growth.

    .venv/bin/python -m tools.bench.soak [--duration-s 600] [--rate 8] [--reshape-every-s 20]
        [--kill-at-s DURATION/2] [--decode-kill-at-s DURATION*0.7] [--hosts 1|2]
        [--node-down-s 10] [--out results/soak.json]

It starts ``python -m vertumnus serve`` on the embedded default (tiny, 2 CPU ranks,
loopback only, its local decode process; the controller off: this tool reshapes by
hand) and sends Poisson arrivals of prompts drawn from 48 prompts over 8 shared
prefixes. Of them, 40 % are prefills (``/v1/prefill``) and 60 % completions of 2-32
tokens through the decode process: non-streamed (25 %), streamed (25 %) and streams
the client abandons after the first token (10 %). It merges and splits every
``--reshape-every-s`` through the admin API, SIGKILLs one rank of a busy worker at
``--kill-at-s`` and the decode process at ``--decode-kill-at-s``. Every answer's
first token is checked against a single-process reference forward of the same
seeded model (a differing token counts as wrong unless the two logits tie within
1e-4), and every completion's length. A completion whose decode process was killed
under it ends with a clear error (``decode_failed``: answered, with the error); one
that arrives while the decode process restarts gets a 503 naming why (``refused``);
one prefilled while it was away waits for the restarted one (``decode_waits``).
``/ready`` is sampled every 0.5 s between two reads of ``/v1/workers``, its 503s
counted with their reasons; where the two reads agree, the pool's readiness must be
exactly "some worker is active" (``ready_disagreed`` counts the samples where not). At the end
no lease, pin or held row may be left, every worker must be active and nothing may
be logged as a bug. Resident memory (VmRSS) of the coordinator and of each rank is
sampled every 5 s; growth is measured from the end of the warm-up (the first fifth
of the run) to the end. Prints a summary, writes the JSON, and exits 1 if a request
was lost, answered wrongly or twice, or something leaked.

``--hosts 2`` runs the same two ranks as a two-host pool on Ray
(``docs/multi-host.md``): the soak starts a Ray cluster of this machine with token
authentication (a head with no CPUs and two nodes of one CPU, one rank each; the
token in the server's environment), so the degree-2 worker a merge makes spans both
nodes. At ``--kill-at-s`` the second host's node is removed instead of a rank (its
raylet and every process on it SIGKILLed), and a new node of one CPU joins
``--node-down-s`` later to take its place; ``killed`` says which node went, when,
when the new one joined and when every worker was active again. The cluster's
nodes end with the soak, whatever happens.

The JSON holds the machine and source it ran on, and what other processes used
meanwhile (``harness.py``; the soak does not wait for a quiet machine unless given
``--max-wait``: its verdicts do not depend on speed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson

from tools.bench import harness
from tools.bench._serving import start_server
from tools.ray_local import local_cluster
from vertumnus.stats import percentile

ADMIN_TOKEN = "soak-admin-token-0123456789"
KINDS = (("prefill", 0.4), ("complete", 0.25), ("stream", 0.25), ("abandon", 0.1))
# log lines that mean a bug was contained ("bug": true), or a reshape needed its bound
BUG_MARKS = ('"bug":true', '"event":"reshape_rolled_back"', '"event":"reshape_forced"')


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(256, 1024))] for _ in range(8)]
    out = []
    for k in range(48):
        own = [rng.randrange(256) for _ in range(rng.randrange(64, 1024))]
        out.append(prefixes[k % 8] + own)
    return out


def reference(prompt_list: list[list[int]]) -> list[tuple[int, Any]]:
    """(argmax, last-position logits) of each prompt, one process, no cache."""
    import torch

    from vertumnus.config import EngineConfig, resolve_model
    from vertumnus.engine.model import causal_attention
    from vertumnus.engine.weights import build_model

    cfg, model_dir = resolve_model("tiny")
    engine = EngineConfig()
    model = build_model(cfg, model_dir, engine.seed, torch.float32, torch.device("cpu"))
    out = []
    with torch.inference_mode():
        for p in prompt_list:
            ids = torch.tensor(p, dtype=torch.long)
            hidden = model(ids, torch.arange(len(p)), causal_attention())
            logits = model.logits(hidden[-1:])[0]
            out.append((int(logits.argmax()), logits))
    return out


def call(url: str, path: str, body: Any = None, timeout: float = 120) -> Any:
    data = None if body is None else orjson.dumps(body)
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if path.startswith("/v1/admin/"):
        req.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return orjson.loads(resp.read())


@contextlib.contextmanager
def ray_nodes(hosts: int) -> Iterator[Any]:
    """For more than one host: a ``ray.cluster_utils.Cluster`` of this machine, a head
    with no CPUs and ``hosts`` nodes of one CPU, with token authentication (a fresh
    token in this process's environment, so in the server's); None for one host.
    Every node it has, those added meanwhile included, ends with it."""
    if hosts == 1:
        yield None
        return
    with local_cluster(hosts, 1) as cluster:  # (a fresh token, in the server's environment)
        yield cluster


class MainThread:
    """Ray starts a node only from the main thread (it sets a SIGTERM handler, and the
    node's processes die with the thread that started them): ``run`` drives the load
    on a thread of its own while the main thread carries out what ``call`` hands it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )

    def run(self, work: Callable[[], Any]) -> Any:
        out: Future[Any] = Future()

        def load() -> None:
            try:
                out.set_result(work())
            except BaseException as exc:
                out.set_exception(exc)
            finally:
                self._jobs.put(None)

        threading.Thread(target=load, name="soak-load", daemon=True).start()
        while (job := self._jobs.get()) is not None:
            fn, done = job
            try:
                done.set_result(fn())
            except Exception as exc:
                done.set_exception(exc)
        return out.result()

    async def call(self, fn: Callable[[], Any]) -> Any:
        done: Future[Any] = Future()
        self._jobs.put((fn, done))
        return await asyncio.wrap_future(done)


async def drive(
    url: str, args: argparse.Namespace, server_pid: int, cluster: Any, main: MainThread
) -> dict[str, Any]:
    import aiohttp

    pool = prompts(args.seed)
    rng = random.Random(args.seed + 1)
    outcomes: list[dict[str, Any]] = []
    reshapes: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    unready: list[dict[str, Any]] = []
    checks = {"ready_samples": 0, "ready_checked": 0, "ready_disagreed": 0}
    killed: dict[str, Any] = {}
    start = time.monotonic()
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, k: int, at: float, kind: str, n: int) -> None:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
        rec: dict[str, Any] = {"prompt": k, "kind": kind, "sent_s": time.monotonic() - start}
        try:
            if kind == "prefill":
                await prefill(session, url, pool[k], rec)
            else:
                await complete(session, url, pool[k], kind, n, rec)
        except Exception as exc:  # the client saw no answer: lost
            rec["status"] = None
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["took_s"] = time.monotonic() - start - rec["sent_s"]
        outcomes.append(rec)

    async def reshaper() -> None:
        while time.monotonic() - start < args.duration_s - args.reshape_every_s:
            await asyncio.sleep(args.reshape_every_s)
            try:
                ws = (await loop.run_in_executor(None, call, url, "/v1/workers"))["workers"]
                if any(w["state"] != "active" for w in ws):
                    reshapes.append({"at_s": time.monotonic() - start, "skipped": "restarting"})
                    continue  # a worker is restarting: reshape next time
                body: dict[str, Any] = (
                    {"op": "merge"} if len(ws) == 2 else {"op": "split", "worker": ws[0]["worker"]}
                )
                done = await loop.run_in_executor(None, call, url, "/v1/admin/reconfigure", body)
                reshapes.append({"at_s": time.monotonic() - start, **done})
            except Exception as exc:
                reshapes.append({"at_s": time.monotonic() - start, "error": str(exc)})

    async def killer() -> None:
        await asyncio.sleep(args.kill_at_s)
        ws = (await loop.run_in_executor(None, call, url, "/v1/workers"))["workers"]
        if cluster is not None:
            await kill_node(ws)
            return
        busy = [w for w in ws if w["running"] is not None] or ws
        victim = busy[0]
        os.kill(victim["pids"][0], signal.SIGKILL)
        killed.update(at_s=time.monotonic() - start, worker=victim["worker"], pid=victim["pids"][0])

    async def kill_node(ws: list[dict[str, Any]]) -> None:
        """Remove host 1's Ray node; a new one joins ``--node-down-s`` later."""
        names = {h: n for w in ws for h, n in zip(w["hosts"], w["host_names"], strict=True)}
        node = next(n for n in cluster.worker_nodes if n.node_id.startswith(names[1][-8:]))
        killed.update(at_s=time.monotonic() - start, host=1, node=names[1])
        await loop.run_in_executor(None, lambda: cluster.remove_node(node, allow_graceful=False))
        killed["node_removed_at_s"] = time.monotonic() - start
        await asyncio.sleep(args.node_down_s)
        await main.call(lambda: cluster.add_node(num_cpus=1))
        killed["node_added_at_s"] = time.monotonic() - start
        while time.monotonic() - start < args.duration_s:
            ws = (await loop.run_in_executor(None, call, url, "/v1/workers"))["workers"]
            if all(w["state"] == "active" for w in ws):
                killed["workers_active_at_s"] = time.monotonic() - start
                killed["host_names"] = sorted({n for w in ws for n in w["host_names"]})
                return
            await asyncio.sleep(0.25)

    async def decode_killer() -> None:
        await asyncio.sleep(args.decode_kill_at_s)
        pids = decode_pids(server_pid)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed["decode"] = {"at_s": time.monotonic() - start, "pids": pids}

    async def watch_ready() -> None:
        """``/ready`` every 0.5 s, between two reads of ``/v1/workers``: where both
        reads agree, the pool could dispatch exactly when some worker was active."""
        async with aiohttp.ClientSession() as probe:

            async def active() -> bool:
                async with probe.get(f"{url}/v1/workers") as resp:
                    return any(w["state"] == "active" for w in (await resp.json())["workers"])

            while time.monotonic() - start < args.duration_s:
                before = await active()
                async with probe.get(f"{url}/ready") as resp:
                    status = resp.status
                    reason = None if status == 200 else (await resp.json())["error"]["message"]
                after = await active()
                checks["ready_samples"] += 1
                if reason is not None:
                    unready.append({"t_s": time.monotonic() - start, "reason": reason})
                if before == after:
                    checks["ready_checked"] += 1
                    pool_ready = reason is None or "decode process" in reason
                    checks["ready_disagreed"] += pool_ready != before
                await asyncio.sleep(0.5)

    async def sampler() -> None:
        while time.monotonic() - start < args.duration_s:
            ws = (await loop.run_in_executor(None, call, url, "/v1/workers"))["workers"]
            ranks = [p for w in ws for p in w["pids"] if p is not None]
            memory.append(
                {
                    "t_s": time.monotonic() - start,
                    "coordinator_kib": rss_kib(server_pid),
                    "ranks_kib": {str(p): rss_kib(p) for p in ranks},
                }
            )
            await asyncio.sleep(5.0)

    arrivals, t = [], 0.0
    kinds, weights = zip(*KINDS, strict=True)
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration_s:
            break
        kind = rng.choices(kinds, weights)[0]
        arrivals.append((rng.randrange(len(pool)), t, kind, rng.randrange(2, 33)))
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        work = (reshaper(), killer(), decode_killer(), sampler(), watch_ready())
        side = [asyncio.create_task(c) for c in work]
        await asyncio.gather(*(one(session, *a) for a in arrivals))
        for task in side:
            task.cancel()
    return {
        "sent": len(arrivals),
        "outcomes": outcomes,
        "reshapes": reshapes,
        "killed": killed,
        "memory": memory,
        "unready": unready,
        "checks": checks,
    }


async def prefill(session: Any, url: str, tokens: list[int], rec: dict[str, Any]) -> None:
    async with session.post(f"{url}/v1/prefill", json={"token_ids": tokens}) as resp:
        body = await resp.json()
        rec["status"] = resp.status
        if resp.status == 200:
            rec.update(
                first_token=body["first_token"],
                request_id=f"prefill-{body['request_id']}",
                ttft_s=body["ttft_s"],
                ok=True,
            )
        else:
            rec["error"] = body.get("error", {}).get("message")


async def complete(
    session: Any, url: str, tokens: list[int], kind: str, n: int, rec: dict[str, Any]
) -> None:
    """A completion of ``n`` tokens: whole (``complete``), streamed, or a stream the
    client leaves after its first token (``abandon``)."""
    body = {"prompt": tokens, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    body["stream"] = kind != "complete"
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        rec["status"] = resp.status
        if resp.status != 200:
            rec["error"] = (await resp.json()).get("error", {}).get("message")
            return
        if kind == "complete":
            answer = await resp.json()
            ids = answer["choices"][0]["token_ids"]
            rec.update(request_id=answer["id"], ttft_s=answer["timings"]["ttft_s"])
            rec.update(first_token=ids[0], ok=len(ids) == n)
            return
        ids: list[int] = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                rec["ok"] = len(ids) == n
                break
            event = orjson.loads(data)
            if "error" in event:  # the decode process failed under it: a clear error
                rec.update(status="decode_failed", error=event["error"]["message"])
                return
            ids += event["choices"][0].get("token_ids", [])
            rec.setdefault("request_id", event.get("id"))
            if "timings" in event:
                rec["ttft_s"] = event["timings"]["ttft_s"]
            if kind == "abandon" and ids:
                rec["ok"] = True  # the client leaves: the pool must clean up after it
                break
        if ids:
            rec["first_token"] = ids[0]


def decode_pids(server_pid: int) -> list[int]:
    """The server's local decode processes."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == server_pid and b"decode" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def growth(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, float | None]:
    """RSS growth from the first sample after the warm-up to the last, per process
    that lived through both (a restarted rank is a new process that warms up again:
    it is left out)."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2:
        return {}
    first, last = after[0], after[-1]
    out: dict[str, float | None] = {}
    if first["coordinator_kib"] and last["coordinator_kib"]:
        out["coordinator"] = last["coordinator_kib"] / first["coordinator_kib"] - 1
    for pid, kib in first["ranks_kib"].items():
        end = last["ranks_kib"].get(pid)
        if kib and end:
            out[f"rank pid {pid}"] = end / kib - 1
    return out


def settle(url: str, timeout_s: float = 40.0) -> dict[str, Any]:
    """After the load: wait for the last leases to end (``lease_s`` = 10 here) and
    for the pool to be ready again (a last reshape or a restart may still be under
    way on a busy host), then what is left: leases, pins, held rows, the workers'
    states, ``/ready``'s status and reason, bugs counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = call(url, "/v1/handoffs")
        status, reason = readiness(url)
        if (view["open"] == 0 and status == 200) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {
        "handoffs": view,
        "workers": [w["state"] for w in call(url, "/v1/workers")["workers"]],
        "ready": status,
        "unready_reason": reason,
        "metrics": metrics,
    }


def readiness(url: str) -> tuple[int, str | None]:
    """``/ready``'s status, and its reason when it is not 200."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as resp:
            return resp.status, None
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--reshape-every-s", type=float, default=20.0)
    parser.add_argument("--kill-at-s", type=float, default=None)
    parser.add_argument("--decode-kill-at-s", type=float, default=None)
    parser.add_argument("--hosts", type=int, choices=(1, 2), default=1)
    parser.add_argument("--node-down-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/soak.json"))
    harness.add_arguments(parser, json_option=False, max_wait_s=0.0)
    args = parser.parse_args()
    if args.kill_at_s is None:
        args.kill_at_s = args.duration_s / 2
    if args.decode_kill_at_s is None:
        args.decode_kill_at_s = args.duration_s * 0.7
    pool = prompts(args.seed)
    expected = reference(pool)
    session = harness.Session("soak", args)
    config = Path(tempfile.mkdtemp()) / "soak.toml"
    config.write_text(
        "[controller]\nenabled = false\n[engine]\nthreads_per_rank = 1\n"
        f'[server]\nadmin_token = "{ADMIN_TOKEN}"\nstep_timeout_s = 20\n'
        "[handoff]\nlease_s = 10\n[decode]\nrestart_s = 0.5\n"
    )
    log_path = config.with_name("server.log")
    with ray_nodes(args.hosts) as cluster, log_path.open("w") as log:
        if cluster is not None:  # one rank per host: two workers, a merge spans both
            with config.open("a") as f:
                f.write("[pool]\ndegrees = [1, 2]\ndevices_per_host = 1\n")
                f.write(f'[cluster]\nengine = "ray"\naddress = "{cluster.address}"\n')
                f.write(f"hosts = {args.hosts}\npoll_s = 0.5\n")
        waiting = None if cluster is None else (lambda _address: None)
        proc, url = start_server(config, stderr=log, on_waiting=waiting)
        try:
            wall = time.monotonic()
            main = MainThread()
            run = main.run(lambda: asyncio.run(drive(url, args, proc.pid, cluster, main)))
            wall = time.monotonic() - wall
            end = settle(url)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    summary = summarize(run, end, expected, args, wall, log_path)
    session.finish(args.out, summary)
    for key, value in summary.items():
        if key not in ("memory", "args", "unready", "refused_at_s"):
            print(f"{key:<24} {value}")
    bad = (
        summary["lost"]
        or summary["wrong"]
        or summary["answered_twice"]
        or summary["short"]
        or summary["bugs_logged"]
        or summary["ready_disagreed"]
        or summary["left_at_end"] != {"leases": 0, "pinned_blocks": 0, "held_rows": 0}
        or set(summary["workers_at_end"]) != {"active"}
    )
    return 1 if bad else 0


def summarize(
    run: dict[str, Any],
    end: dict[str, Any],
    expected: list[tuple[int, Any]],
    args: argparse.Namespace,
    wall: float,
    log_path: Path,
) -> dict[str, Any]:
    outcomes = run["outcomes"]
    answered = [o for o in outcomes if o["status"] == 200]
    lost = [o for o in outcomes if o["status"] is None]
    decode_failed = [o for o in outcomes if o["status"] == "decode_failed"]
    refused = [o for o in outcomes if o["status"] not in (None, 200, "decode_failed")]
    wrong = []
    for o in answered:
        if "first_token" not in o:
            continue
        token, logits = expected[o["prompt"]]
        if o["first_token"] != token and float(logits[token] - logits[o["first_token"]]) > 1e-4:
            wrong.append(o)
    ids = [o["request_id"] for o in answered]
    metrics = end["metrics"].splitlines()
    restarts = sum(
        float(line.split()[-1])
        for line in metrics
        if line.startswith("vertumnus_worker_restarts_total")
    )
    ttft = [o["ttft_s"] for o in answered if "ttft_s" in o]
    log = log_path.read_text()
    view = end["handoffs"]
    reasons = sorted({u["reason"].split(":")[0] for u in run["unready"]})
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": wall,
        "sent": run["sent"],
        "sent_by_kind": {k: sum(o["kind"] == k for o in outcomes) for k, _ in KINDS},
        "answered": len(answered),
        "lost": len(lost),
        "refused": len(refused),
        # when each refusal came (a request sent just before the decode process was
        # killed is refused after, once its prefill is done)
        "refused_at_s": [round(o["sent_s"] + o["took_s"], 3) for o in refused],
        "decode_failed": len(decode_failed),
        "wrong": len(wrong),
        "short": sum(not o.get("ok", False) for o in answered),
        "answered_twice": len(ids) - len(set(ids)),
        "slowest_s": max((o["took_s"] for o in outcomes), default=None),
        "reshapes_done": sum("op" in r for r in run["reshapes"]),
        "reshapes_skipped": sum("skipped" in r for r in run["reshapes"]),
        "reshape_errors": [r["error"] for r in run["reshapes"] if "error" in r],
        "killed": run["killed"],
        "worker_restarts": restarts,
        "decode_restarts": log.count('"decode_started"') - 1,
        "ready_samples": run["checks"]["ready_samples"],
        "unready_samples": len(run["unready"]),
        "ready_checked": run["checks"]["ready_checked"],
        "ready_disagreed": run["checks"]["ready_disagreed"],
        "unready_reasons": reasons,
        "unready": run["unready"],
        "left_at_end": {
            "leases": view["open"],
            "pinned_blocks": view["pinned_blocks"],
            "held_rows": view["held_rows"],
        },
        "leases_ended": {k: view[k] for k in ("pulled", "released", "expired", "moved")},
        "workers_at_end": end["workers"],
        "ready_at_end": end["ready"],
        "unready_reason_at_end": end["unready_reason"],
        "bugs_logged": sum(any(b in line for b in BUG_MARKS) for line in log.splitlines()),
        "internal_errors_counted": [m for m in metrics if m.startswith("vertumnus_internal_")],
        # completions prefilled while the decode process was away, by how their wait
        # ended (forwarded: decoded by the restarted process)
        "decode_waits": {
            line.split('outcome="')[1].split('"')[0]: float(line.split()[-1])
            for line in metrics
            if line.startswith("vertumnus_decode_waits_total{")
        },
        "mean_ttft_ms": 1e3 * statistics.fmean(ttft) if ttft else None,
        "p99_ttft_ms": 1e3 * percentile(ttft, 99) if ttft else None,
        "rss_growth_after_warmup": growth(run["memory"], args.duration_s / 5),
        "errors": sorted({str(o.get("error")) for o in lost + refused + decode_failed})[:10],
        "server_log": str(log_path),
        "memory": run["memory"],
    }


if __name__ == "__main__":
    sys.exit(main())
