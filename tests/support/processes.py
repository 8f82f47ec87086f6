"""Process hygiene for the tests that start processes: what a test started must be
gone when it ends. Who is alive (rank processes of this process, members of a
session, children of a pid), and the start of a ``vertumnus agent`` in a session of
its own, so that a test can find (and kill) everything it left."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
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


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def start_agent(address: str, name: str, log: Path, secret: str) -> subprocess.Popen[bytes]:
    """``python -m vertumnus agent`` for 2 devices, joining the coordinator at
    ``address`` with ``secret``; its output appended to ``log``; in a new session (a
    session leader's sid is its pid)."""
    cmd = [sys.executable, "-m", "vertumnus", "agent", "--coordinator", address]
    with log.open("ab") as out:
        return subprocess.Popen(
            [*cmd, "--name", name, "--devices", "2"],
            env={**os.environ, "VERTUMNUS_CLUSTER_SECRET": secret},
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
