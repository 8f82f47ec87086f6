"""Shutdown and overload on the real server: SIGTERM stops admission, the accepted
requests finish, the ranks stop, nothing is left behind; past ``max_queued`` a 503
with ``Retry-After``."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from server_support import children_of, is_running, running_server

pytestmark = pytest.mark.multiproc


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(180)
def test_sigterm_finishes_accepted_work_and_leaves_nothing(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        "[controller]\nenabled = false\n[engine]\nthreads_per_rank = 1\n"
        "[server]\nshutdown_grace_s = 60\n"
    )
    shm_before = shm_entries()
    with running_server(config) as server:
        ranks = children_of(server.proc.pid)
        assert len(ranks) >= 2
        with ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(server.call, "POST", "/v1/prefill", {"token_ids": prompt(3000, s)})
                for s in range(8)
            ]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # some running, more queued
                ws = server.call("GET", "/v1/workers")[1]["workers"]
                if any(w["running"] is not None for w in ws):
                    break
                time.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        # Every accepted request was answered, and right.
        assert [a[0] for a in answers] == [200] * 8, [a[1] for a in answers if a[0] != 200]
        server.proc.wait(timeout=60)
        assert server.proc.returncode == 0
        time.sleep(0.5)
        assert not [p for p in ranks if is_running(p)]
    assert shm_entries() - shm_before == set()
    log = (tmp_path / "server.log").read_text()
    assert '"event":"shutting_down"' in log and '"event":"stopped"' in log
    assert "grace_period_over" not in log


@pytest.mark.timeout(180)
def test_past_max_queued_a_503_with_retry_after(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        "[controller]\nenabled = false\n[engine]\nthreads_per_rank = 1\n[server]\nmax_queued = 3\n"
    )
    with running_server(config) as server:

        def call(seed: int) -> tuple[int, Any, dict[str, str]]:
            return server.call_full("POST", "/v1/prefill", {"token_ids": prompt(3000, seed)})

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(call, range(12)))
        codes = [a[0] for a in answers]
        assert codes.count(200) >= 3 and codes.count(503) >= 1, codes
        assert set(codes) <= {200, 503}
        for status, body, headers in answers:
            if status == 503:
                assert body["error"]["type"] == "overloaded" and int(headers["Retry-After"]) > 0
        # Still serving after the burst.
        assert call(99)[0] == 200
