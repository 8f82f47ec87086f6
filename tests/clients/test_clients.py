"""The client lane: aiperf and guidellm, benchmark clients nobody here wrote, run
against a whole ``python -m vertumnus serve`` by ``tools/clients/run_lane.py``.

Every run completes each of its 20 requests without an error, as the client's own
result files count them, and the server, stopped by the lane, exits 0 with nothing
of it left. Skipped, saying why, where
``tools/clients/setup.sh`` has not installed the clients.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.processes import sessions_left

REPO = Path(__file__).resolve().parents[2]
VENVS = REPO / ".venv-clients"
CLIENTS = ("aiperf", "guidellm")
RUNS = ("aiperf-chat", "aiperf-completions", "guidellm-chat", "guidellm-completions")
REQUESTS = 20
LANE_TIMEOUT_S = 900

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.timeout(LANE_TIMEOUT_S + 60),
    pytest.mark.skipif(
        not all((VENVS / c / "bin" / c).exists() for c in CLIENTS),
        reason=f"the benchmark clients are not installed in {VENVS}: run tools/clients/setup.sh",
    ),
]


@pytest.fixture(scope="module")
def lane(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The lane's ``lane.json``, with its exit status as ``exit_code``."""
    out = tmp_path_factory.mktemp("clients-lane")
    done = subprocess.run(
        [sys.executable, "-m", "tools.clients.run_lane", "--out", str(out),
         "--runs", ",".join(RUNS), "--requests", str(REQUESTS)],
        capture_output=True, text=True, timeout=LANE_TIMEOUT_S, cwd=REPO,
    )  # fmt: skip
    report_file = out / "lane.json"
    assert report_file.is_file(), (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    report: dict[str, Any] = json.loads(report_file.read_text())
    report["exit_code"] = done.returncode
    return report


@pytest.mark.parametrize("name", RUNS)
def test_every_request_completes_without_an_error(lane: dict[str, Any], name: str) -> None:
    (run,) = [r for r in lane["runs"] if r["run"] == name]
    assert (run["completed"], run["errors"], run["exit_code"]) == (REQUESTS, 0, 0), run


def test_the_server_stops_cleanly_and_the_lane_says_whether_it_passed(
    lane: dict[str, Any],
) -> None:
    server = lane["server"]
    assert (server["exit_code"], server["killed"]) == (0, False), server
    assert sessions_left([server["pid"]]) == {}
    assert [r["run"] for r in lane["runs"]] == list(RUNS)
    passed = all(r["passed"] for r in lane["runs"])
    assert lane["exit_code"] == (0 if passed else 1), lane["runs"]
