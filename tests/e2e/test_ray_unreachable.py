"""A pool whose Ray cluster stops answering says so: ``serve`` on a one-node Ray
cluster, then the cluster's GCS is killed. Ray's calls then wait rather than fail,
so the coordinator's watch reports a check unanswered after ``reach_timeout_s``:
``/ready`` answers 503 naming Ray, and the log has ``ray_unreachable``. (Ray ends a
driver that has had no GCS for 60 s, as it ends the nodes: the test ends the
server itself before that.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from support.ray_cluster import ray_cluster
from support.server import serving, start_serve, write_serve_config

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_ready_says_ray_does_not_answer_once_its_gcs_is_gone(tmp_path: Path) -> None:
    with ray_cluster(nodes=1, cpus=2) as cluster:
        config = write_serve_config(
            tmp_path / "serve.toml",
            pool={"degrees": [1, 2], "layout": [2]},
            engine={"compile": "off", "threads_per_rank": 1},
            decode={"local": False},
            cluster={
                "engine": "ray",
                "address": cluster.address,
                "hosts": 1,
                "poll_s": 0.2,
                "reach_timeout_s": 2.0,
            },
        )
        proc = start_serve(config, os.environ)  # (the cluster's token: set here)
        try:
            assert proc.stdout is not None
            waiting = proc.stdout.readline()
            assert waiting.startswith("vertumnus waiting for 1 Ray node(s) at "), waiting
            srv = serving(proc, config)
            status, body = srv.call("POST", "/v1/prefill", {"prompt": "hello there"})
            assert status == 200 and body["cp_degree"] == 2, body
            gcs = cluster.head_node.all_processes["gcs_server"][0].process
            gcs.kill()
            gcs.wait()
            killed = time.monotonic()
            while True:
                status, body = srv.call("GET", "/ready")
                if status == 503:
                    break
                assert time.monotonic() - killed < 30, "/ready still 200 without a GCS"
                time.sleep(0.2)
            assert "the Ray cluster does not answer" in body["error"]["message"], body
            assert srv.events("ray_unreachable")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
