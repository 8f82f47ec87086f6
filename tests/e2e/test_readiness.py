"""``/ready`` tells the truth about the default path, and a decode process that dies
at start-up takes nothing with it: ``python -m vertumnus serve`` with its local
decode process, which the test SIGKILLs the moment it appears (before it listens).
``serve`` once exited then (``the local decode process failed to start:
''``), and ``/ready`` answered 200 before the decode process was up.

Now ``serve`` keeps serving prefills, ``/ready`` is 503 naming the decode process
(and ``/health`` stays 200), a completion meanwhile gets a 503 that says why, the
proxy starts a new decode process (with backoff), and from the first 200 of
``/ready`` a completion is decoded."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from support.factories import make_tokens
from support.processes import children_of
from support.server import running_server, write_serve_config

pytestmark = pytest.mark.multiproc


def decode_children(pid: int) -> list[int]:
    found = []
    for child in children_of(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"decode" in cmdline:
            found.append(child)
    return found


@pytest.mark.timeout(240)
def test_a_decode_process_that_dies_at_start_up_is_restarted_and_ready_says_so(
    tmp_path: Path,
) -> None:
    config = write_serve_config(tmp_path / "serve.toml", decode={"local": True, "restart_s": 1.0})
    with running_server(config, wait_ready=False) as server:
        deadline = time.monotonic() + 30
        first: list[int] = []
        while not first and time.monotonic() < deadline:
            first = decode_children(server.proc.pid)
        assert first, "no decode process was started"
        os.kill(first[0], signal.SIGKILL)  # it is still importing torch: not listening
        status, body = server.call("GET", "/ready")
        assert status == 503 and "decode process" in body["error"]["message"], body
        assert server.call("GET", "/health")[0] == 200
        tokens = make_tokens(200, seed=1)
        status, body = server.call("POST", "/v1/prefill", {"token_ids": tokens})
        assert status == 200, body  # the pool serves prefills meanwhile
        status, body = server.call("POST", "/v1/completions", {"prompt": tokens, "max_tokens": 4})
        if status != 200:  # (unless the new decode process is up already)
            assert status == 503 and "decode process" in body["error"]["message"], body
        deadline = time.monotonic() + 120
        while server.call("GET", "/ready")[0] != 200:
            assert server.proc.poll() is None, "serve exited"
            assert time.monotonic() < deadline, "the decode process never came back"
            time.sleep(0.05)
        # From the first 200 of /ready on, a completion is decoded.
        body = {"prompt": tokens, "max_tokens": 4, "ignore_eos": True}
        status, answer = server.call("POST", "/v1/completions", body)
        assert status == 200, answer
        assert len(answer["choices"][0]["token_ids"]) == 4
        assert decode_children(server.proc.pid) not in ([], first)
    log = (tmp_path / "server.log").read_text()
    assert '"decode_start_failed"' in log and log.count('"decode_started"') == 1
