"""The soak in short form (``tools/bench/soak.py``, 30 s instead of 10 minutes): steady
load, 60 % of it completions through the local decode process (streamed, not, and
abandoned), splits and merges every 7 s, one rank killed half-way and the decode
process at 21 s. No request lost, answered twice, short or wrong; only the
completions that came while the decode process restarted were refused, each with
that reason; the killed worker and the decode process restarted once; no lease,
pin or row left, every worker active, no bug logged; no process left. (Memory
growth is measured in the long run: docs/reliability.md.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from support.processes import wait_gone

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench.soak",
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
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    s = orjson.loads(out.read_bytes())
    assert s["sent"] > 100 and s["answered"] + s["refused"] + s["decode_failed"] == s["sent"]
    assert (s["lost"], s["wrong"], s["answered_twice"], s["short"]) == (0, 0, 0, 0)
    assert all("decode process" in e for e in s["errors"]), s["errors"]
    decode_killed_s = s["killed"]["decode"]["at_s"]  # refusals only while it restarted
    assert all(decode_killed_s <= t <= decode_killed_s + 60 for t in s["refused_at_s"])
    assert s["sent_by_kind"]["prefill"] < s["sent"] / 2
    assert s["reshapes_done"] >= 3 and s["reshape_errors"] == []
    assert s["killed"]["pid"] > 0 and s["worker_restarts"] == 1
    assert s["killed"]["decode"]["pids"] and s["decode_restarts"] == 1
    assert s["left_at_end"] == {"leases": 0, "pinned_blocks": 0, "held_rows": 0}
    assert set(s["workers_at_end"]) == {"active"}
    assert s["ready_at_end"] == 200, s["unready_reason_at_end"]
    assert s["bugs_logged"] == 0 and s["internal_errors_counted"] == []
    assert s["ready_checked"] > 20 and s["ready_disagreed"] == 0
    pids = {int(p) for sample in s["memory"] for p in sample["ranks_kib"]}
    assert pids and not wait_gone(pids)
