"""Process hygiene for the tests that start processes: what a test started must be
gone when it ends. Who is alive (rank processes of this process, members of a
session, children of a pid), so that a test can find (and kill) everything it left."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path


def live_child_pids() -> set[int]:
    """Pids of this process's live ``multiprocessing`` children (rank processes)."""
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def pids_in_session(sid: int) -> set[int]:
    """Pids of live (non-zombie) processes in session ``sid`` (Linux /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        # After the parenthesised command name: state ppid pgrp session ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.add(int(entry))
    return found


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def descendants_of(pid: int) -> list[int]:
    """Children, their children and so on: a server's rank processes are children
    of its fork server (``runtime/ranks.py``)."""
    found, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def rank_processes_of(pid: int) -> list[int]:
    """The rank processes under ``pid``: the children of its fork server."""
    return _forked_by(descendants_of(pid))


def wait_gone(pids: Iterable[int], timeout_s: float = 15.0) -> list[int]:
    """Waits up to ``timeout_s`` for ``pids`` to exit; those still running. (A fork
    server finishes its interpreter's teardown, torch's included, after its parent
    exits.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if is_running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def sessions_left(sids: Iterable[int], timeout_s: float = 15.0) -> dict[int, set[int]]:
    """Waits up to ``timeout_s`` for sessions ``sids`` to empty; the live members
    of those that did not."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {sid: pids for sid in sids if (pids := pids_in_session(sid))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def ranks_in_session(sid: int) -> set[int]:
    """The rank processes in session ``sid``: the children of its fork servers."""
    return set(_forked_by(pids_in_session(sid)))


def _forked_by(pids: Iterable[int]) -> list[int]:
    """The children of those of ``pids`` that are fork servers."""
    return [
        child
        for pid in pids
        if b"multiprocessing.forkserver" in cmdline(pid)
        for child in children_of(pid)
    ]


def cmdline(pid: int) -> bytes:
    """Its command line, NUL-separated (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
