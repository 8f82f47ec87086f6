"""Helpers for tests that run ``python -m vertumnus serve``: its config file, an HTTP
caller, and the server's start and its clean stop (no rank process left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from support.processes import descendants_of, wait_gone

START_TIMEOUT_S = 90.0
ADMIN_TOKEN = "test-admin-token-0123456789"
# What every served test runs with: the controller off (tests reshape by hand, at
# known moments), one intra-op thread per rank (ranks outnumber the cores here), eager
# layers (compiling costs every rank seconds at each start; tests/e2e/test_server.py
# and the client lanes serve compiled, as the default does), and no decode process
# (prefills only) unless a test asks for one.
SERVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "controller": {"enabled": False},
    "engine": {"threads_per_rank": 1, "compile": "off"},
    "decode": {"local": False},
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string, for the strings used here
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def write_serve_config(path: Path, **sections: Mapping[str, Any]) -> Path:
    """Write a ``serve`` config to ``path``: ``SERVE_DEFAULTS`` with ``sections``
    (table name -> settings) merged over it; returns ``path``."""
    tables: dict[str, dict[str, Any]] = {k: dict(v) for k, v in SERVE_DEFAULTS.items()}
    for name, settings in sections.items():
        tables.setdefault(name, {}).update(settings)
    lines = []
    for name, settings in tables.items():
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in settings.items())
    path.write_text("\n".join(lines) + "\n")
    return path


def write_folder_config(path: Path, model_dir: Path, **sections: Mapping[str, Any]) -> Path:
    """``write_serve_config`` for a checkpoint folder served in fp32 on two CPU ranks
    (two workers of CP degree 1, which a merge makes one of degree 2), with
    ``sections`` over it key by key (``engine={"compile": "auto"}`` keeps fp32 on
    the CPU)."""
    folder: dict[str, dict[str, Any]] = {
        "model": {"name": str(model_dir)},
        "profile": {"path": "tiny-cpu"},
        "engine": {"dtype": "float32", "device": "cpu"},
        "pool": {"degrees": [1, 2], "layout": [1, 1]},
    }
    for name, settings in sections.items():
        folder[name] = {**folder.get(name, {}), **settings}
    return write_serve_config(path, **folder)


def _json_or_none(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Server:
    def __init__(self, proc: subprocess.Popen[str], url: str, log: Path | None = None) -> None:
        self.proc, self.url, self.log = proc, url, log  # log: its stderr's JSON lines

    def events(self, name: str) -> list[dict[str, Any]]:
        """The log lines of event ``name`` so far."""
        assert self.log is not None
        lines = self.log.read_text(errors="replace").splitlines()
        return [e for e in map(_json_or_none, lines) if e and e.get("event") == name]

    def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> tuple[int, Any]:
        """(status, JSON or text body): ``call_full`` without the headers."""
        status, payload, _ = self.call_full(method, path, *args, **kwargs)
        return status, payload

    def call_full(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any, dict[str, str]]:
        """(status, JSON or text body, headers)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        if path.startswith("/v1/admin/"):
            req.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                payload, status, headers = resp.read(), resp.status, dict(resp.headers)
        except urllib.error.HTTPError as err:
            payload, status, headers = err.read(), err.code, dict(err.headers)
        ctype = headers.get("Content-Type", "")
        return status, json.loads(payload) if "json" in ctype else payload.decode(), headers


@contextmanager
def running_server(config: Path, wait_ready: bool = True) -> Iterator[Server]:
    """Start the server on ``config`` (a free port), wait until ready (unless not
    ``wait_ready``: from the moment it listens); on exit, SIGTERM, and check it
    exited 0 with none of its rank processes left. Its logs go to ``server.log``
    beside the config (a pipe nobody reads would fill and block it)."""
    log = (config.parent / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vertumnus", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("vertumnus listening on "), (
            line,
            (config.parent / "server.log").read_text()[-2000:],
        )
        srv = Server(proc, line.split()[-1], config.parent / "server.log")
        while wait_ready and time.monotonic() < deadline and srv.call("GET", "/ready")[0] != 200:
            time.sleep(0.2)
        yield srv
    finally:
        started = descendants_of(proc.pid)  # its fork server, ranks, decode process
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        log.close()
        alive = wait_gone(started)
        assert proc.returncode == 0 and not alive, (proc.returncode, alive)


def start_serve(config: Path, env: Mapping[str, str]) -> subprocess.Popen[str]:
    """``serve`` on ``config`` (a free port) in a session of its own, with ``env``, its
    stderr to ``server.log`` beside ``config``: for the tests that watch its start
    (a multi-host pool first says it waits for its Ray nodes) or end it themselves."""
    with (config.parent / "server.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "vertumnus", "serve", "--config", str(config), "--port", "0"],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )


def serving(proc: subprocess.Popen[str], config: Path) -> Server:
    """The server ``start_serve`` started, once it listens and ``/ready`` says 200."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.startswith("vertumnus waiting for "):
        line = proc.stdout.readline()
    assert line.startswith("vertumnus listening on "), (config.parent / "server.log").read_text()
    srv = Server(proc, line.split()[-1], config.parent / "server.log")
    deadline = time.monotonic() + START_TIMEOUT_S
    while srv.call("GET", "/ready")[0] != 200:
        assert time.monotonic() < deadline, srv.call("GET", "/ready")
        time.sleep(0.2)
    return srv
