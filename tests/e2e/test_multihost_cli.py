"""The multi-host pool from the command line, on Ray: ``serve`` with a ``[cluster]``
table joins a Ray cluster of two nodes (on this machine, with token authentication),
says it waits for them, serves prefills over HTTP on ranks of both, and SIGTERM ends
it (exit 0) with no rank actor and no process of its session left. A cluster started
without authentication is refused (a client without a token got in) unless
``private_network = true``. And the clear errors, each before anything joins:
``vertumnus agent``, the agents' old ``[cluster]`` keys, no token in serve's
environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.processes import sessions_left
from support.ray_cluster import AUTH, actors_gone, ray_cluster, raylets
from support.server import serving, start_serve, write_serve_config

pytestmark = pytest.mark.multiproc
SERVE = [sys.executable, "-m", "vertumnus", "serve", "--port", "0", "--config"]
NO_TOKEN = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Head (no CPUs) and two nodes of two CPUs: two hosts of two ranks each."""
    with ray_cluster(nodes=2, cpus=2) as c:
        yield c


def stop(proc: subprocess.Popen[str]) -> int | None:
    """SIGTERM, then its exit status (None: it hung, and its session was killed)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def cluster_config(
    path: Path, address: str, layout: tuple[int, ...] = (2, 2), **cluster: Any
) -> Path:
    """Two workers of degree 2 (one per host of two ranks) unless ``layout``."""
    return write_serve_config(
        path,
        pool={"degrees": [1, 2], "layout": list(layout)},
        engine={"kv_blocks_per_rank": 64},
        cluster={"engine": "ray", "address": address, **cluster},
    )


@pytest.mark.timeout(30)
def test_agent_is_gone_and_says_what_replaced_it() -> None:
    for old in ([], ["--coordinator", "127.0.0.1:7700", "--devices", "2"]):
        out = subprocess.run(
            [sys.executable, "-m", "vertumnus", "agent", *old], capture_output=True, text=True
        )
        assert out.returncode == 2, out.stderr
        assert "Ray" in out.stderr and "docs/multi-host.md" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.timeout(30)
def test_agent_keys_are_refused_by_name(tmp_path: Path) -> None:
    config = cluster_config(
        tmp_path / "old.toml", "auto", listen="0.0.0.0:7700", secret="s" * 16, hosts=2
    )
    out = subprocess.run([*SERVE, str(config)], capture_output=True, text=True, timeout=25)
    assert out.returncode == 2, out.stderr
    removed = "[cluster] listen, secret: the node agents these configured were removed"
    assert removed in out.stderr
    assert "docs/multi-host.md" in out.stderr and out.stdout == ""


@pytest.mark.timeout(60)
def test_serve_without_a_token_is_refused_before_joining(tmp_path: Path) -> None:
    # Nothing listens at this address: joining it would hang until join_timeout_s.
    config = cluster_config(tmp_path / "no-token.toml", "127.0.0.1:1", hosts=2)
    out = subprocess.run([*SERVE, str(config)], env=NO_TOKEN, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "the Ray cluster must use token authentication" in out.stderr
    assert "private_network" in out.stderr and "Traceback" not in out.stderr


@pytest.fixture(scope="class")
def open_cluster() -> Iterator[Any]:
    """A Ray cluster started without token authentication: one node of two CPUs
    (for one class: it ends before the module's cluster starts)."""
    with ray_cluster(nodes=1, cpus=2, auth=False) as c:
        yield c


class TestClusterWithoutAuth:
    @pytest.mark.timeout(120)
    def test_is_refused(self, open_cluster: Any, tmp_path: Path) -> None:
        config = cluster_config(tmp_path / "open.toml", open_cluster.address, hosts=1)
        proc = start_serve(config, {**os.environ, **AUTH})  # a token here proves nothing
        try:
            assert proc.wait(timeout=100) == 2
        finally:
            if proc.poll() is None:
                stop(proc)
        log = (tmp_path / "server.log").read_text()
        assert "let a client without a token in" in log, log[-2000:]
        assert "must use token authentication" in log
        assert not actors_gone(raylets(), 15.0) and not sessions_left([proc.pid])

    @pytest.mark.timeout(180)
    def test_serves_on_a_private_network(self, open_cluster: Any, tmp_path: Path) -> None:
        config = cluster_config(
            tmp_path / "private.toml",
            open_cluster.address,
            layout=(2,),
            hosts=1,
            private_network=True,
        )
        proc = start_serve(config, dict(os.environ))  # (Ray's auth disabled: no token)
        try:
            srv = serving(proc, config)
            status, answer = srv.call("POST", "/v1/prefill", {"prompt": "a private pool " * 9})
            assert status == 200, answer
            assert answer["cp_degree"] == 2
        finally:
            code = stop(proc)
        assert code == 0, (tmp_path / "server.log").read_text()[-2000:]
        assert not actors_gone(raylets(), 15.0) and not sessions_left([proc.pid])


@pytest.mark.timeout(240)
def test_serve_two_ray_hosts_over_http(cluster: Any, tmp_path: Path) -> None:
    config = cluster_config(tmp_path / "two-hosts.toml", cluster.address, hosts=2)
    proc = start_serve(config, {**os.environ, **AUTH})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"vertumnus waiting for 2 Ray node(s) at {cluster.address}\n", line
        srv = serving(proc, config)
        status, workers = srv.call("GET", "/v1/workers")
        assert status == 200
        assert [(w["ranks"], w["hosts"]) for w in workers["workers"]] == [
            ([0, 1], [0]),
            ([2, 3], [1]),
        ]
        names = [w["host_names"] for w in workers["workers"]]
        assert len(names[0]) == len(names[1]) == 1 and names[0] != names[1], names
        for _ in range(2):
            status, answer = srv.call("POST", "/v1/prefill", {"prompt": "hello, two hosts " * 9})
            assert status == 200, answer
            assert answer["cp_degree"] == 2
        assert answer["cached_tokens"] > 0  # the second one reused the first's prefix
    finally:
        code = stop(proc)
    assert code == 0, (tmp_path / "server.log").read_text()[-2000:]
    assert not actors_gone(raylets(), 15.0)
    left = sessions_left([proc.pid])
    assert not left, left
