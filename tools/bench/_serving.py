"""Start ``python -m vertumnus serve`` for a tool (benchmarks, the soak): on a free
port, wait until ``/ready``, and say clearly when it does not come up."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def start_server(
    config: Path,
    stderr: IO[Any] | int = subprocess.DEVNULL,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    on_waiting: Callable[[str], None] | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """(process, base URL) of a server on ``config``, ready to serve. A multi-host
    pool's server first waits for its Ray nodes: ``on_waiting`` gets the Ray
    address it joins (and may start the nodes there)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vertumnus", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.startswith("vertumnus waiting for ") and on_waiting is not None:
        on_waiting(line.split()[-1])
        line = proc.stdout.readline()
    if not line.startswith("vertumnus listening on "):
        proc.kill()
        raise RuntimeError(f"the server did not start (exit {proc.wait()}): {line!r}")
    url = line.split()[-1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}") from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")
