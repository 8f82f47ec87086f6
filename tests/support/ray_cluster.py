"""A Ray cluster of several nodes on this machine, for the multi-host tests.

``ray_cluster`` is ``tools/ray_local.py``'s cluster (a head that runs nothing and
``nodes`` nodes of ``cpus`` CPUs) with the tests' token (``TOKEN``, ``AUTH``; set
in this process's environment while the cluster lives; restored after).
``raylets`` lists the raylets (nodes) this process started; ``actors_left`` the rank
actors' processes (titled ``ray::RankActor`` by Ray) under given raylets: other
tests' clusters may run beside this one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from support.processes import children_of, cmdline
from tools.ray_local import environment, local_cluster, token_auth

TOKEN = "vertumnus-test-token-0123456789abcdef"
AUTH = token_auth(TOKEN)
token_env = environment


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 2, auth: bool = True) -> Iterator[Any]:
    """``tools.ray_local.local_cluster`` with the tests' token (or none), its nodes
    checked every second (a node removed is declared dead in about 3 s)."""
    auth_env = AUTH if auth else {"RAY_AUTH_MODE": "disabled"}
    with local_cluster(nodes, cpus, auth_env, health_check_s=1.0) as c:
        yield c


def raylets() -> set[int]:
    """Pids of the raylets (one per Ray node) that are children of this process."""
    return {pid for pid in children_of(os.getpid()) if b"raylet" in cmdline(pid)}


def actors_left(raylets: set[int]) -> list[str]:
    """Rank actors' processes alive on this machine under one of ``raylets`` (each
    Ray worker names its raylet in its environment; a node removed may leave its
    workers orphaned, so pass the raylets of removed nodes too)."""
    wanted = {f"RAY_RAYLET_PID={pid}".encode() for pid in raylets}
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or b"RankActor" not in cmdline(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:  # (gone meanwhile)
            continue
        if env & wanted:
            left.append(f"{entry}: {cmdline(int(entry)).decode(errors='replace')[:60]}")
    return left


def actors_gone(raylets: set[int], timeout_s: float = 30.0) -> list[str]:
    """Waits up to ``timeout_s`` for the rank actors under ``raylets`` to exit; those
    left."""
    deadline = time.monotonic() + timeout_s
    while (left := actors_left(raylets)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
