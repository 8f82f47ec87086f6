"""The multi-host pool from the command line: ``serve`` with a ``[cluster]`` table
waits for its agents, two ``agent`` processes join it as two hosts, prefills are
served over HTTP, a third agent is refused with the reason, and SIGTERM to the
server ends the agents too (exit 0) with no process left. Plus the agent's
errors for bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.processes import sessions_left, start_agent
from support.server import Server, write_serve_config

pytestmark = pytest.mark.multiproc
SECRET = "cli-multihost-secret-0123"
ENV = {**os.environ, "VERTUMNUS_CLUSTER_SECRET": SECRET}


def test_agent_rejects_bad_input() -> None:
    base = [sys.executable, "-m", "vertumnus", "agent"]
    env = {k: v for k, v in os.environ.items() if k != "VERTUMNUS_CLUSTER_SECRET"}
    out = subprocess.run([*base, "--coordinator", "127.0.0.1:1"], env=env, capture_output=True)
    assert out.returncode == 2
    assert b"VERTUMNUS_CLUSTER_SECRET" in out.stderr and b"16 characters" in out.stderr
    out = subprocess.run([*base, "--coordinator", "nohost"], env=ENV, capture_output=True)
    assert out.returncode == 2 and b"HOST:PORT" in out.stderr
    out = subprocess.run(
        [*base, "--coordinator", "127.0.0.1:1", "--devices", "0"], env=ENV, capture_output=True
    )
    assert out.returncode == 2 and b"--devices must be >= 1" in out.stderr


@pytest.mark.timeout(240)
def test_serve_two_hosts_over_http(tmp_path: Path) -> None:
    config = write_serve_config(
        tmp_path / "two-hosts.toml",
        pool={"degrees": [1, 2], "layout": [2, 2]},
        engine={"kv_blocks_per_rank": 64},
        cluster={"listen": "127.0.0.1:0", "hosts": 2, "heartbeat_s": 0.5},
    )
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vertumnus", "serve", "--config", str(config), "--port", "0"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    agents: list[subprocess.Popen[bytes]] = []
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("vertumnus waiting for 2 agent(s) on 127.0.0.1:"), line
        address = line.split()[-1]
        agents = [
            start_agent(address, f"host{k}", tmp_path / f"agent{k}.log", SECRET) for k in range(2)
        ]
        line = server.stdout.readline()
        assert line.startswith("vertumnus listening on "), (tmp_path / "server.log").read_text()
        srv = Server(server, line.split()[-1])
        deadline = time.monotonic() + 60
        while srv.call("GET", "/ready")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        status, workers = srv.call("GET", "/v1/workers")
        assert status == 200
        assert [(w["ranks"], w["hosts"]) for w in workers["workers"]] == [
            ([0, 1], [0]),
            ([2, 3], [1]),
        ]
        for _ in range(2):
            status, answer = srv.call("POST", "/v1/prefill", {"prompt": "hello, two hosts " * 9})
            assert status == 200, answer
            assert answer["cp_degree"] == 2
        assert answer["cached_tokens"] > 0  # the second one reused the first's prefix
        extra = start_agent(address, "host2", tmp_path / "agent2.log", SECRET)
        assert extra.wait(timeout=60) == 1
        assert "the pool has its 2 hosts" in (tmp_path / "agent2.log").read_text()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            assert server.wait(timeout=60) == 0
            for a in agents:  # the coordinator's Stop ends them
                assert a.wait(timeout=30) == 0
        finally:
            for p in (server, *agents):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            log.close()
    left = sessions_left([p.pid for p in (server, *agents)])
    assert not left, left
