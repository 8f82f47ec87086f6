"""Figures of the serving runtime: coordinator overhead, switch and drain times.

    .venv/bin/python -m tools.bench.serve [--requests 200] [--reshapes 10]

Starts ``python -m vertumnus serve`` (the embedded default, the controller off) on a
free port and measures:

  * **Coordinator overhead per request**: TTFT seen by the coordinator minus the
    slowest rank's compute time, over sequential 64-token requests on an idle pool.
    It covers placement, the trie, cache-index planning, the command and answer
    crossing the process boundary, commit and reply. Target: under 1 ms.
  * **Switch time**: ``--reshapes`` merges and splits through
    ``/v1/admin/reconfigure`` on an idle pool (a new epoch, every rank
    acknowledges). Target: under 1 s.
  * **Drain time**: the same reshapes under a load of concurrent 512-token
    requests: the wait for the participants' running prefills to finish.

Prints medians and p90s with the ratio to each target; ``--json PATH`` writes the
figures with the machine and source they were measured on (``harness.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tools.bench import harness
from tools.bench._serving import start_server
from vertumnus.stats import percentile

ADMIN_TOKEN = "bench-serve-admin-token-0123"


def call(url: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if path.startswith("/v1/admin/"):
        req.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def reshape_cycle(url: str) -> list[dict[str, Any]]:
    merged = call(url, "/v1/admin/reconfigure", {"op": "merge"})
    split = call(url, "/v1/admin/reconfigure", {"op": "split", "worker": merged["new_workers"][0]})
    return [merged, split]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--reshapes", type=int, default=10)
    harness.add_arguments(parser)
    args = parser.parse_args()
    session = harness.Session("serve", args)
    config = Path(tempfile.mkdtemp()) / "bench-serve.toml"
    config.write_text(f'[controller]\nenabled = false\n[server]\nadmin_token = "{ADMIN_TOKEN}"\n')
    proc, url = start_server(config)
    try:
        rng = random.Random(0)
        overhead, ttft = [], []
        for _ in range(args.requests):
            out = call(url, "/v1/prefill", {"token_ids": [rng.randrange(256) for _ in range(64)]})
            overhead.append((out["ttft_s"] - out["rank_compute_s"]) * 1e3)
            ttft.append(out["ttft_s"] * 1e3)
        switch = []
        for _ in range(max(1, args.reshapes // 2)):
            switch += [r["switch_s"] * 1e3 for r in reshape_cycle(url)]
        stop = threading.Event()

        failures: list[str] = []

        def load() -> None:
            while not stop.is_set():
                try:
                    call(
                        url, "/v1/prefill", {"token_ids": [rng.randrange(256) for _ in range(512)]}
                    )
                except OSError as exc:
                    failures.append(str(exc))

        threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        drains, loaded_switch = [], []
        for _ in range(max(1, args.reshapes // 2)):
            for r in reshape_cycle(url):
                drains.append(r["drain_s"] * 1e3)
                loaded_switch.append(r["switch_s"] * 1e3)
        stop.set()
        for t in threads:
            t.join(120)
        med = statistics.median(overhead)
        print(
            f"{args.requests} sequential 64-token requests: "
            f"TTFT median {statistics.median(ttft):.2f} ms"
        )
        print(
            f"coordinator overhead per request: median {med:.3f} ms, "
            f"p90 {percentile(overhead, 90):.3f} ms "
            f"-> {med / 1.0:.2f}x of the 1 ms target"
        )
        sw = statistics.median(switch)
        print(
            f"switch, idle pool ({len(switch)} reshapes): median {sw:.2f} ms, "
            f"p90 {percentile(switch, 90):.2f} ms -> {sw / 1000:.4f}x of the 1 s target"
        )
        print(
            f"under load ({len(drains)} reshapes, 4 clients of 512-token requests): drain median "
            f"{statistics.median(drains):.1f} ms, p90 {percentile(drains, 90):.1f} ms; "
            f"switch median "
            f"{statistics.median(loaded_switch):.2f} ms; failed requests: {len(failures)}"
        )
        session.finish(
            args.json,
            {
                "args": vars(args),
                "ttft_ms": harness.summary(ttft),
                "overhead_ms": harness.summary(overhead),
                "switch_idle_ms": harness.summary(switch),
                "drain_loaded_ms": harness.summary(drains),
                "switch_loaded_ms": harness.summary(loaded_switch),
                "failed_requests": len(failures),
                "targets": {"overhead_median_ms": 1.0, "switch_median_ms": 1000.0},
            },
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main()
