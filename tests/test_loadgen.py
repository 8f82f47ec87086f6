"""The load generator: trace-to-token mapping keeps the prefix structure, arrivals
follow the rate, concurrency stays under its limit, and failures are counted."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from vertumnus import loadgen
from vertumnus.slo import TtftSlo
from vertumnus.traces import Trace, TraceRequest


def test_equal_hash_ids_give_equal_token_prefixes() -> None:
    trace = Trace(
        "t",
        "mooncake",
        512,
        (
            TraceRequest(0.0, 1100, 1, (0, 1, 2)),
            TraceRequest(2.0, 1536, 1, (0, 1, 3)),
            TraceRequest(4.0, 600, 1, (9, 2)),
        ),
    )
    reqs = loadgen.from_trace(trace, length_scale=1 / 32, vocab=256, rate_scale=2.0)
    a, b, c = (r.token_ids for r in reqs)
    assert [len(t) for t in (a, b, c)] == [34, 48, 19]  # round(L / 32)
    assert a[:32] == b[:32] and a[32:34] != b[32:34]  # blocks 0, 1 shared; 2 vs 3 not
    assert c[:16] != a[:16]  # block 9 is not block 0
    assert c[16:18] == a[32:34]  # block 2 is the same wherever it appears
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0]
    again = loadgen.from_trace(trace, length_scale=1 / 32, vocab=256, rate_scale=2.0)
    assert [r.token_ids for r in again] == [a, b, c]


def test_poisson_arrivals_follow_the_rate() -> None:
    reqs = loadgen.with_arrivals(loadgen.synthetic(2000, 100, 0.5, 256), 50.0, 1.0, seed=3)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(reqs)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.08)
    groups = loadgen.synthetic(50, 300, 0.2, 256, seed=1, prefix_groups=2, prefix_tokens=64)
    assert len({r.token_ids[:64] for r in groups}) == 2


class _Handler(BaseHTTPRequestHandler):
    active = 0
    peak = 0
    lock = threading.Lock()
    calls = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
            cls.calls += 1
            n = cls.calls
        threading.Event().wait(0.05)
        with cls.lock:
            cls.active -= 1
        if n % 5 == 0:  # every fifth request fails
            payload: dict[str, Any] = {"error": {"message": "overloaded", "type": "overloaded"}}
            status = 503
        else:
            tokens = len(body["token_ids"])
            payload = {"ttft_s": 0.05, "cached_tokens": tokens // 2, "worker": 0, "cp_degree": 1}
            status = 200
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.timeout(60)
def test_concurrency_limit_and_failures_are_counted() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reqs = loadgen.synthetic(30, 40, 0.1, 256, seed=random.randrange(1000))
        result = asyncio.run(loadgen.run(url, reqs, max_concurrency=3))
        summary = loadgen.summarize(result, TtftSlo(scale=None, fixed_s=10.0), detailed=True)
    finally:
        server.shutdown()
    assert _Handler.peak <= 3
    assert summary["completed"] + summary["failed"] == 30
    assert summary["failed"] == 6 and "HTTP 503: overloaded" in summary["errors"][0]
    assert len(summary["requests"]) == 30
    assert sum(r["error"] is not None for r in summary["requests"]) == 6
    assert summary["token_hit_rate"] == pytest.approx(0.5, abs=0.05)
    # Failed requests count against the SLO: their tokens are in the denominator.
    assert summary["token_slo_attainment"] < 0.9
    assert "Failed requests:              6" in loadgen.text_summary(summary)
    # The prefill-only path: no generation fields, the records as they always were.
    assert "mean_tpot_ms" not in summary and "total_output_tokens" not in summary
    assert list(summary["requests"][0]) == [
        "index",
        "input_tokens",
        "sent_s",
        "ttft_s",
        "server_ttft_s",
        "server_queue_s",
        "server_prefill_s",
        "server_rank_compute_s",
        "cached_tokens",
        "worker",
        "cp_degree",
        "error",
    ]
