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
from collections.abc import Iterator
from typing import Any

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
    mine = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _field(entry, "PPid") == mine and b"raylet" in _cmdline(entry):
            found.add(int(entry))
    return found


def actors_left(raylets: set[int]) -> list[str]:
    """Rank actors' processes alive on this machine under one of ``raylets`` (each
    Ray worker names its raylet in its environment; a node removed may leave its
    workers orphaned, so pass the raylets of removed nodes too)."""
    wanted = {f"RAY_RAYLET_PID={pid}".encode() for pid in raylets}
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or b"RankActor" not in _cmdline(entry):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:  # (gone meanwhile)
            continue
        if env & wanted:
            left.append(f"{entry}: {_cmdline(entry).decode(errors='replace')[:60]}")
    return left


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def _field(pid: str, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split()[1]
    except OSError:
        pass
    return None
