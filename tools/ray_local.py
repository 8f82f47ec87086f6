"""A Ray cluster of this machine, for the tests and the benchmarks of pools across
hosts: a head node that runs nothing (no CPUs: a coordinator joins it as a driver)
and ``nodes`` nodes of ``cpus`` CPUs each, every one with token authentication (a
token in this process's environment while the cluster lives, so in the processes
it starts too; restored after), or none (``auth=False``). Ray reports its nodes at
this machine's own interface address: every process stays on this machine. The
cluster's nodes, those added meanwhile included, end with it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment and in Ray's configuration (which Ray
    reads once, when it loads: something may have imported it already)."""
    from ray._raylet import Config

    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    Config.initialize("")
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        Config.initialize("")


def token_auth(token: str | None = None) -> dict[str, str]:
    """The environment of token authentication (a fresh token unless given)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token or secrets.token_hex(24)}


@contextlib.contextmanager
def local_cluster(
    nodes: int,
    cpus: int,
    auth: Mapping[str, str] | None = None,
    health_check_s: float | None = None,
) -> Iterator[Any]:
    """A ``ray.cluster_utils.Cluster``: head (no CPUs) plus ``nodes`` nodes of
    ``cpus``; ``auth``: its authentication environment (None: a fresh token;
    ``{"RAY_AUTH_MODE": "disabled"}``: none). ``health_check_s``: how often the GCS
    checks each node, a node failing 3 checks in a row being dead (None: Ray's own
    settings, which declare a killed node dead after about 13-15 s here)."""
    from ray.cluster_utils import Cluster

    with environment(token_auth() if auth is None else auth):
        head: dict[str, Any] = {"num_cpus": 0, "include_dashboard": False}
        if health_check_s is not None:
            period_ms = int(health_check_s * 1000)
            head["_system_config"] = {
                "health_check_period_ms": period_ms,
                # (a killed node refuses at once; a slow one has 10 s per check)
                "health_check_timeout_ms": 10_000,
                "health_check_failure_threshold": 3,
            }
        cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            for _ in range(nodes):
                cluster.add_node(num_cpus=cpus)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            cluster.shutdown()
