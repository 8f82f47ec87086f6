"""Shutdown and overload on the real server: SIGTERM stops admission, the accepted
requests finish, the ranks stop, nothing is left behind; past ``max_queued`` a 503
with ``Retry-After``."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from support.factories import make_tokens
from support.processes import descendants_of, rank_processes_of, wait_gone
from support.server import running_server, write_serve_config

pytestmark = pytest.mark.multiproc


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def mapped_shm() -> set[str]:
    """The /dev/shm entries some live process maps (readable ones: this user's)."""
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:
            continue  # gone, or not ours
        mapped |= {line.split("/dev/shm/", 1)[1] for line in lines if "/dev/shm/" in line}
    return {name.removesuffix(" (deleted)") for name in mapped}


def shm_left_since(before: set[str]) -> set[str]:
    """Entries made since ``before`` that nobody maps any more: a segment the stopped
    server left behind. (A live segment is mapped by its maker until it is closed and
    unlinked; so this ignores what other tests running beside this one hold, and is
    exact for a server whose processes are all gone.)"""
    left = shm_entries() - before
    for _ in range(3):  # what is left stays left; another test's come and go
        left &= (shm_entries() - mapped_shm()) & shm_entries()
        if not left:
            break
        time.sleep(0.5)
    return left


@pytest.mark.timeout(180)
def test_sigterm_finishes_accepted_work_and_leaves_nothing(tmp_path: Path) -> None:
    config = write_serve_config(tmp_path / "serve.toml", server={"shutdown_grace_s": 60})
    shm_before = shm_entries()
    with running_server(config) as server:
        ranks = rank_processes_of(server.proc.pid)
        assert len(ranks) >= 2
        prompts = [make_tokens(3000, seed=s, vocab=256) for s in range(8)]
        with ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(server.call, "POST", "/v1/prefill", {"token_ids": p}) for p in prompts
            ]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # all eight accepted: some running, more queued
                ws = server.call("GET", "/v1/workers")[1]["workers"]
                inside = sum(w["queued"] + (w["running"] is not None) for w in ws)
                answered = sum(f.done() for f in futures)
                if any(w["running"] is not None for w in ws) and inside + answered >= 8:
                    break
                time.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        # Every accepted request was answered, and right.
        assert [a[0] for a in answers] == [200] * 8, [a[1] for a in answers if a[0] != 200]
        server.proc.wait(timeout=60)
        assert server.proc.returncode == 0
        assert not wait_gone(ranks)
    assert shm_left_since(shm_before) == set()
    log = (tmp_path / "server.log").read_text()
    assert '"event":"shutting_down"' in log and '"event":"stopped"' in log
    assert "grace_period_over" not in log


@pytest.mark.timeout(180)
def test_past_max_queued_a_503_with_retry_after(tmp_path: Path) -> None:
    config = write_serve_config(tmp_path / "serve.toml", server={"max_queued": 3})
    with running_server(config) as server:

        def call(seed: int) -> tuple[int, Any, dict[str, str]]:
            return server.call_full(
                "POST", "/v1/prefill", {"token_ids": make_tokens(3000, seed=seed, vocab=256)}
            )

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


@pytest.mark.timeout(180)
def test_sigterm_to_the_whole_process_group_exits_and_restarts_nothing(tmp_path: Path) -> None:
    """A signal to serve's whole process group (a terminal's Ctrl-C, a container
    runtime's stop) reaches its ranks too: the ranks that die first are not
    restarted, and serve exits 0 with nothing left."""
    config = write_serve_config(tmp_path / "serve.toml", decode={"local": True})
    with running_server(config) as server:
        body = {"prompt": "hello", "max_tokens": 4}
        assert server.call("POST", "/v1/completions", body)[0] == 200  # the decode process too
        started = descendants_of(server.proc.pid)
        assert len(started) >= 3
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert not wait_gone(started)
    log = (tmp_path / "server.log").read_text()
    assert '"event":"worker_failed"' not in log
