"""The live dashboard's cost to the server, and its responsiveness, at 64 workers and
1,000 samples.

    .venv/bin/python -m tools.bench.dashboard [--workers 64] [--samples 1000]
        [--seconds 60] [--polls 2000]

Serves the REST app in this process (the coordinator's event loop, as ``serve`` runs
it; the ranks are not started: the page reads only the coordinator) over a pool of
``--workers`` degree-1 workers whose timeline already holds ``--samples`` samples
(with arrivals, answers and a reshape every 100), and its sampler adding one a
second. Then, in the same run:

1. ``/v1/timeline?since=T`` asked ``--polls`` times as the page asks it (the newest
   sample, the 64 workers): the server's CPU per poll;
2. the server's CPU over ``--seconds`` with no page open (the sampler alone), then
   over ``--seconds`` with ``/dashboard`` open in headless Chromium, polling once a
   second: the difference is the page's cost, in % of one core (target: under 1 %);
3. in the browser: the time from opening the page to its first drawing of the
   1,000 samples, and the longest redraw while it polls (``vertumnusStats``).

CPU is this process's (``time.process_time``): the server's loop; Chromium runs in
processes of its own. Needs Chromium and ChromeDriver (``tools/browser.sh``).
``--json PATH`` writes the figures with the machine and source they were measured
on (``harness.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, web

from tools.bench import harness
from tools.browser import chromium
from vertumnus.config.pool import PoolConfig
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import DecodeConfig, ServeConfig
from vertumnus.server.app import build_app


def filled(workers: int, samples: int) -> Coordinator:
    """A coordinator (ranks not started) whose timeline holds ``samples`` samples."""
    cfg = ServeConfig(pool=PoolConfig((1, 2), (1,) * workers), decode=DecodeConfig(local=False))
    coord = Coordinator(cfg)
    line = coord.metrics.timeline
    rng = random.Random(0)
    start = coord.clock() - samples * line.period_s
    line.origin_s = start
    coord.metrics.started_unix -= samples * line.period_s
    line.next_s = start + line.period_s
    decision = {"rule": "whatif", "ops": [], "demand_s": 10.0, "capacity_s": 12.0}
    for k in range(1, samples + 1):
        now = start + k * line.period_s
        for _ in range(rng.randint(0, 12)):
            line.arrived(now - 0.5)
            ttft = rng.lognormvariate(-2.0, 0.8)
            line.finished(now, ttft, 0.5, rng.randint(100, 32_000), rng.randint(0, 8_000))
        if k % 100 == 0:
            ops = [{"kind": "merge", "sources": [0, 1], "degree": 2}]
            candidates = [{"ops": ops, "mean_ttft_s": 0.1 * c} for c in range(4)]
            line.reshaped(now, "merge", {**decision, "ops": ops, "candidates": candidates})
        line.sample(now, coord.policy)
    return coord


def cpu_percent(seconds: float) -> float:
    started, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return 100 * (time.process_time() - started) / (time.perf_counter() - wall)


def browse(url: str, seconds: float, folder: Path) -> dict[str, Any]:
    """Idle, then the page open: CPU of this process in each, and the page's times."""
    out: dict[str, Any] = {}
    with chromium(folder) as browser:
        browser.get("about:blank")
        out["idle_cpu_pct"] = cpu_percent(seconds)
        opened = time.perf_counter()
        browser.get(url + "/dashboard")
        while not browser.execute_script("return window.vertumnusStats.renders"):
            time.sleep(0.05)
        out["first_draw_s"] = time.perf_counter() - opened
        time.sleep(5)  # past the first load of the scripts
        browser.execute_script("window.vertumnusStats.maxRenderMs = 0")
        polls = browser.execute_script("return window.vertumnusStats.polls")
        out["page_cpu_pct"] = cpu_percent(seconds)
        stats = browser.execute_script("return window.vertumnusStats")
        out["polls"] = stats["polls"] - polls
        out["errors"] = stats["errors"]
        out["samples_drawn"] = stats["samples"]
        out["last_redraw_ms"] = stats["lastRenderMs"]
        out["max_redraw_ms"] = stats["maxRenderMs"]
        browser.save_screenshot(str(folder / "dashboard-64.png"))
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    coord = filled(args.workers, args.samples)
    app = build_app(coord, Tokenizer.for_model(coord.model_dir, coord.model_cfg.vocab_size))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    try:
        async with ClientSession() as session:
            async with session.get(url + "/v1/timeline") as resp:
                whole = await resp.read()
                body = await resp.json()
            since = body["samples"][-2]["t"]  # the page's usual ask: the newest sample
            started = time.process_time()
            for _ in range(args.polls):
                async with session.get(f"{url}/v1/timeline?since={since}") as resp:
                    answer = await resp.read()
            per_poll_ms = 1000 * (time.process_time() - started) / args.polls
        print(
            f"pool of {args.workers} workers, {len(body['samples'])} samples, "
            f"{len(body['events'])} reshape events"
        )
        print(f"first answer (every sample): {len(whole):,} bytes; a poll: {len(answer):,} bytes")
        print(
            f"a poll, server and client in this process: {per_poll_ms:.3f} ms of CPU "
            f"(at one a second: {per_poll_ms / 10:.3f} % of a core at most)"
        )
        folder = Path(args.folder)
        folder.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(None, browse, url, args.seconds, folder)
        cost = result["page_cpu_pct"] - result["idle_cpu_pct"]
        print(
            f"server CPU, no page: {result['idle_cpu_pct']:.3f} % of a core; "
            f"with /dashboard polling ({result['polls']} polls in {args.seconds:.0f} s): "
            f"{result['page_cpu_pct']:.3f} %; the page's cost: {cost:.3f} % (target < 1 %)"
        )
        print(
            f"browser: first drawing {result['first_draw_s']:.2f} s after opening; redraws "
            f"with {result['samples_drawn']} samples: last {result['last_redraw_ms']:.0f} ms, "
            f"longest {result['max_redraw_ms']:.0f} ms; errors {result['errors']}"
        )
        print(f"screenshot: {folder / 'dashboard-64.png'}")
        return {
            "args": vars(args),
            "samples": len(body["samples"]),
            "reshape_events": len(body["events"]),
            "first_answer_bytes": len(whole),
            "poll_bytes": len(answer),
            "poll_cpu_ms": per_poll_ms,
            "browser": result,
            "page_cpu_pct": cost,
            "target_page_cpu_pct": 1.0,
            "screenshot": str(folder / "dashboard-64.png"),
        }
    finally:
        await runner.cleanup()
        await coord.close()


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--folder", default="results/dashboard")
    harness.add_arguments(parser)
    args = parser.parse_args()
    session = harness.Session("dashboard", args)
    threading.current_thread().name = "server"
    session.finish(args.json, asyncio.run(main(args)))


if __name__ == "__main__":
    run()
