"""The server the lane's clients run against, started and stopped by the lane.

``python -m vertumnus serve --model FOLDER --port 0`` on its defaults (the adaptive
pool on two CPU ranks and a local decode process), or the stand-in ``capture.py``;
either in a session of its own, its logs in the lane's folder. Ready once it
printed where it listens and ``/ready`` answers 200. Stopped by SIGTERM to its pid
(serve drains, stops its ranks and decode process, exits 0); whatever of its
session is left after ``STOP_TIMEOUT_S`` is killed, and said.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def call(url: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    """(status, JSON or text) of one request; (0, reason) when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except OSError as exc:
        return 0, str(exc)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str = ""
    exit_code: int | None = None
    killed: bool = False  # some of its session outlived STOP_TIMEOUT_S

    @property
    def model(self) -> str:
        """The served model's id, as ``/v1/models`` names it."""
        status, listing = call(self.url + "/v1/models")
        assert status == 200, f"/v1/models: {status} {listing}"
        return str(listing["data"][0]["id"])

    def serves(self, path: str) -> bool:
        """Whether ``path`` is a route: a POST of ``{}`` is answered by something
        other than a 404 or 405 (a route refuses it with a 400)."""
        status, _ = call(self.url + path, "POST", {})
        return status not in (404, 405)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.killed = True
        if not wait_session(self.proc.pid, STOP_TIMEOUT_S):
            self.killed = True
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.exit_code = self.proc.wait()


def wait_session(sid: int, timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` for the process group ``sid`` (a session this lane
    started) to empty; whether it did."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(sid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def start(command: list[str], log: Path) -> Server:
    """Start ``command``; wait until it says where it listens and is ready. Stops it
    and raises if it does neither within ``START_TIMEOUT_S``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *_pythonpath()])}
    with log.open("w") as err:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
    server = Server(proc)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if " listening on " not in line:
            raise RuntimeError(f"the server did not start: {line!r}; its log: {log}")
        server.url = line.split()[-1]
        while call(server.url + "/ready")[0] != 200:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the server was not ready in time; its log: {log}")
            time.sleep(0.5)
    except BaseException:
        server.stop()
        raise
    return server


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def serve_command(model_dir: Path) -> list[str]:
    return [sys.executable, "-m", "vertumnus", "serve", "--model", str(model_dir), "--port", "0"]


def capture_command(requests_log: Path, model: str) -> list[str]:
    script = Path(__file__).with_name("capture.py")
    return [sys.executable, str(script), "--out", str(requests_log), "--model", model]
