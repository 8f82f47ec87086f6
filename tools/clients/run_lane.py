"""The client lane: benchmark clients nobody here wrote, run against ``serve``.

    python -m tools.clients.run_lane [--out out/clients-lane] [--runs aiperf-chat,...]
        [--requests 20] [--concurrency 2] [--capture]

Builds a small random Qwen3 folder with a tokenizer and chat template
(``model_folder.py``), starts ``python -m vertumnus serve --model FOLDER`` on a free
127.0.0.1 port (``server.py``), waits for ``/ready``, then runs each client
(``clients.py``: aiperf and guidellm, from the virtual environments that
``tools/clients/setup.sh`` made) and reads its result files for the requests that
completed and those that failed. Stops the server (by its pid) at the end, also
on failure. Exits 0 only when every run completed every request without an error
and the server exited 0 with nothing of it left.

``--capture`` runs the same clients against ``capture.py``, a stand-in that answers
everything and records each request: the lane then lists, per run, every body
field the client sent with its values (``fields`` in ``lane.json``).

Writes ``lane.json`` (the server, each run's outcome, the fields) and, per run, the
client's result files and log under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tools.clients.clients import RUNS, Load, Outcome, Run, read_outcome
from tools.clients.model_folder import write_model_folder
from tools.clients.server import REPO, capture_command, serve_command, start, wait_session

RUN_TIMEOUT_S = 600
TEXT_FIELDS = ("prompt", "messages")  # their text is left out of the field lists
MAX_VALUES = 3  # distinct values listed per field


def run_client(run: Run, venvs: Path, load: Load, out: Path) -> Outcome:
    folder = out / run.name
    folder.mkdir(parents=True, exist_ok=True)
    outcome = Outcome(run.name, run.path, load.requests, exit_code=None)
    started = time.monotonic()
    with (out / f"{run.name}.log").open("w") as log:
        proc = subprocess.Popen(
            run.command(venvs, load, folder), stdout=log, stderr=subprocess.STDOUT,
            env=run.env(folder), cwd=folder, start_new_session=True,
        )  # fmt: skip
        try:
            outcome.exit_code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            outcome.messages.append(f"killed after {RUN_TIMEOUT_S} s")
        if not wait_session(proc.pid, timeout_s=15.0):
            outcome.messages.append("processes of the client outlived it: killed")
            outcome.exit_code = outcome.exit_code or -signal.SIGKILL
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    outcome.seconds = round(time.monotonic() - started, 1)
    read_outcome(run, folder, outcome)
    return outcome


def _shape(value: Any) -> Any:
    """A prompt's or conversation's shape, its text left out."""
    if isinstance(value, str):
        return "<text>"
    if isinstance(value, list):
        return [_shape(v) for v in value[:2]]
    if isinstance(value, dict):
        return {k: v if k in ("role", "type") else _shape(v) for k, v in value.items()}
    return value


def fields_sent(lines: list[str]) -> dict[str, Any]:
    """What a client sent: its other requests ("GET /health"), and for each POSTed
    path every body field with its distinct values (up to ``MAX_VALUES``)."""
    other: list[str] = []
    posts: dict[str, dict[str, list[Any]]] = {}
    for line in lines:
        request = json.loads(line)
        if request["method"] != "POST":
            asked = f"{request['method']} {request['path']}"
            other += [] if asked in other else [asked]
            continue
        seen = posts.setdefault(request["path"], {})
        for name, value in (request["body"] or {}).items():
            value = _shape(value) if name in TEXT_FIELDS else value
            values = seen.setdefault(name, [])
            if value not in values and len(values) < MAX_VALUES:
                values.append(value)
    return {"other": other, "post": posts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "out" / "clients-lane")
    ap.add_argument("--venvs", type=Path, default=REPO / ".venv-clients")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"of {', '.join(RUNS)}")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--capture", action="store_true", help="against capture.py, not serve")
    args = ap.parse_args()
    runs = [RUNS[name] for name in args.runs.split(",")]
    missing = [r.client for r in runs if not (args.venvs / r.client / "bin" / r.client).exists()]
    if missing:
        names = ", ".join(sorted(set(missing)))
        print(f"no {names} under {args.venvs}: run tools/clients/setup.sh")
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    lane_started = time.monotonic()
    model_dir = write_model_folder(out / "lane-model")
    requests_log = out / "requests.jsonl"
    requests_log.write_text("")
    command = (
        capture_command(requests_log, model_dir.name) if args.capture else serve_command(model_dir)
    )
    server = start(command, out / "server.log")
    outcomes: list[Outcome] = []
    fields: dict[str, Any] = {}
    try:
        load = Load(server.url, server.model, model_dir, args.requests, args.concurrency)
        served = {path: server.serves(path) for path in {r.path for r in runs}}
        for run in runs:
            before = len(requests_log.read_text().splitlines())
            outcomes.append(run_client(run, args.venvs, load, out))
            outcomes[-1].endpoint_served = served[run.path]
            fields[run.name] = fields_sent(requests_log.read_text().splitlines()[before:])
            print(_line(outcomes[-1]), flush=True)
    finally:
        server.stop()
    report = {
        "server": {"command": command, "url": server.url, "pid": server.proc.pid,
                   "exit_code": server.exit_code, "killed": server.killed},
        "seconds": round(time.monotonic() - lane_started, 1),
        "runs": [asdict(o) | {"passed": o.passed} for o in outcomes],
        "fields": fields if args.capture else {},
    }  # fmt: skip
    (out / "lane.json").write_text(json.dumps(report, indent=1))
    if args.capture:
        print(json.dumps(fields, indent=1))
    ok = all(o.passed for o in outcomes) and server.exit_code == 0 and not server.killed
    print(
        f"lane {'passed' if ok else 'FAILED'} in {report['seconds']} s; server exit "
        f"{server.exit_code}{' (killed)' if server.killed else ''}; {out / 'lane.json'}"
    )
    return 0 if ok else 1


def _line(o: Outcome) -> str:
    verdict = "ok" if o.passed else "FAILED"
    served = "" if o.endpoint_served else f" ({o.path} is not served)"
    head = f"{o.run:22} {verdict:6} completed {o.completed}/{o.expected}, errors {o.errors}, "
    tail = f"exit {o.exit_code}, {o.seconds} s{served}"
    return head + tail + "".join(f"\n    {m}" for m in o.messages)


if __name__ == "__main__":
    sys.exit(main())
