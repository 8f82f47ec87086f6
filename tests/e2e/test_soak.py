"""The soak in short form (``tools/soak.py``, 30 s instead of 10 minutes): steady
load, splits and merges every 7 s, one rank killed half-way. No request lost,
refused, answered twice or answered wrong; the killed worker restarted once; no
process left. (Memory growth is measured in the long run: docs/reliability.md.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from support.processes import is_running

pytestmark = pytest.mark.multiproc

TOOL = Path(__file__).resolve().parents[2] / "tools" / "soak.py"


@pytest.mark.timeout(240)
def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--duration-s",
            "30",
            "--rate",
            "6",
            "--reshape-every-s",
            "7",
            "--kill-at-s",
            "15",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    s = orjson.loads(out.read_bytes())
    assert s["sent"] > 100 and s["answered"] == s["sent"]
    assert (s["lost"], s["refused"], s["wrong"], s["answered_twice"]) == (0, 0, 0, 0)
    assert s["reshapes_done"] >= 3 and s["reshape_errors"] == []
    assert s["killed"]["pid"] > 0 and s["worker_restarts"] == 1
    time.sleep(0.5)
    pids = {int(p) for sample in s["memory"] for p in sample["ranks_kib"]}
    assert pids and not [p for p in pids if is_running(p)]
