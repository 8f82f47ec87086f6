"""``tools/bench/harness.py``: the fingerprint and the run written into every
benchmark's JSON, the guard that counts a benchmark's own processes (reaped ones too)
as its own, interleaved runs that alternate and redo a run while others are busy, and
the summary of a list of timings."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from support.tools import load_tool


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    return load_tool("bench/harness.py")


def options(harness: ModuleType, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    harness.add_arguments(parser, retries=True)
    return parser.parse_args(list(argv))


def test_the_json_carries_the_machine_the_source_and_the_run(
    harness: ModuleType, tmp_path: Path
) -> None:
    import vertumnus

    session = harness.Session("example", options(harness, "--max-wait", "0"))
    out = tmp_path / "deep" / "example.json"
    session.finish(out, {"figure_s": 1.5, "per_length": {512: 0.25}})
    doc = json.loads(out.read_bytes())
    assert doc["figure_s"] == 1.5 and doc["per_length"] == {"512": 0.25}
    machine = doc["machine"]
    assert machine["src"] == str(Path(vertumnus.__file__).parent)
    assert len(machine["src_sha256"]) == 12 and int(machine["src_sha256"], 16) >= 0
    assert machine["src_sha256"] == harness.src_sha256()
    assert machine["cores"] == os.cpu_count() and machine["cpu"]
    assert machine["python"] == ".".join(map(str, sys.version_info[:3]))
    head = subprocess.run(
        ["git", "-C", machine["src"], "rev-parse", "--short=12", "HEAD"],
        capture_output=True,
        text=True,
    )
    if head.returncode == 0:  # a checkout (not an installed wheel)
        assert machine["git_commit"] == head.stdout.strip()
        assert isinstance(machine["git_dirty"], bool)
    run = doc["run"]
    assert run["benchmark"] == "example" and run["waited_s"] < 1.0
    assert run["max_foreign"] == 0.25 and run["source_changed"] is False
    assert run["wall_s"] >= 0 and run["others_cores"] >= 0 and run["command"]
    with pytest.raises(AssertionError, match="harness's"):
        session.document({"machine": "mine"})


# Half a second of CPU, in a process of its own.
BUSY = "import time\nwhile time.process_time() < 0.5:\n    pass\n"


@pytest.mark.multiproc
@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the guard reads /proc")
def test_a_reaped_child_counts_as_the_benchmarks_own(harness: ModuleType) -> None:
    load = harness.Load(max_foreign=0.25, max_wait_s=0)
    before = load.snapshot()
    subprocess.run([sys.executable, "-c", BUSY], check=True)
    after = load.snapshot()
    assert after[3] - before[3] >= 0.45 * load.TICK  # its half second of CPU is ours


ORPHAN = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[2])
import harness
if sys.argv[1] == "adopt":
    assert harness.adopt_orphans()
load = harness.Load(max_foreign=0.25, max_wait_s=0)
before = load.snapshot()
busy = sys.argv[3]
spawn = (
    "import subprocess, sys; "
    f"print(subprocess.Popen([sys.executable, '-c', {busy!r}]).pid, flush=True)"
)
done = subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, check=True)
orphan = int(done.stdout)  # its parent has ended: it is an orphan now
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        with open(f"/proc/{orphan}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
    except OSError:
        break
    time.sleep(0.05)
after = load.snapshot()
print((after[3] - before[3]) / load.TICK)
"""


@pytest.mark.multiproc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux subreaper")
@pytest.mark.parametrize("adopt", [True, False])
def test_an_adopted_orphan_counts_as_the_benchmarks_own(adopt: bool) -> None:
    """A grandchild whose parent ended spends half a second of CPU: the benchmark
    counts it as its own once it adopted its orphans, and loses it otherwise (run in
    a process of its own, since adopting lasts for the process's life)."""
    bench = Path(__file__).resolve().parents[2] / "tools" / "bench"
    mode = "adopt" if adopt else "leave"
    done = subprocess.run(
        [sys.executable, "-c", ORPHAN, mode, str(bench), BUSY],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    own_s = float(done.stdout.split()[-1])
    if adopt:
        assert own_s >= 0.45, own_s
    else:
        assert own_s < 0.45, own_s


class ScriptedLoad:
    """A guard whose measurements are given: the others' cores of each run in turn."""

    def __init__(self, foreign: list[float], retries: int) -> None:
        self.max_foreign, self.retries, self.foreign_per_run = 0.25, retries, foreign
        self.snapshots = 0

    def wait_quiet(self) -> float:
        return 0.0

    def snapshot(self) -> tuple[float, int, int, int]:
        self.snapshots += 1
        return float(self.snapshots), 0, 0, 0

    def foreign(self, a: Any, b: Any) -> float:
        return self.foreign_per_run.pop(0)

    def steal(self, a: Any, b: Any) -> float:
        return 0.0


def test_interleaved_runs_alternate_and_redo_a_busy_run(harness: ModuleType) -> None:
    calls: list[str] = []

    def runner(name: str, seconds: float) -> Any:
        def run() -> tuple[float, str]:
            calls.append(name)
            return seconds, f"{name}{len(calls)}"

        return run

    # After the warm-ups: A; B busy, redone; then in reverse order B; A busy twice,
    # kept and flagged.
    load = ScriptedLoad([0.0, 0.9, 0.0, 0.0, 0.5, 0.6], retries=1)
    runners = {"A": runner("A", 1.0), "B": runner("B", 2.0)}
    timed, warm = harness.interleaved(runners, 2, load)
    assert calls == ["A", "B", "A", "B", "B", "B", "A", "A"]
    assert warm == {"A": "A1", "B": "B2"}
    assert timed["A"].runs == [1.0, 1.0] and timed["A"].details == ["A3", "A8"]
    assert (timed["A"].discarded, timed["A"].flagged) == (1, 1)
    assert timed["A"].foreign == [0.0, 0.6]
    assert timed["B"].details == ["B5", "B6"] and timed["B"].foreign == [0.0, 0.0]
    assert (timed["B"].discarded, timed["B"].flagged) == (1, 0)
    assert timed["B"].to_dict() == {
        "median_s": 2.0,
        "runs_s": [2.0, 2.0],
        "others_cores_per_run": [0.0, 0.0],
        "discarded_runs": 1,
        "flagged_runs": 0,
    }


def test_summary(harness: ModuleType) -> None:
    assert harness.summary([4.0, 1.0, 3.0, 2.0]) == pytest.approx(
        {"n": 4, "mean": 2.5, "median": 2.5, "p90": 3.7, "p99": 3.97, "min": 1.0, "max": 4.0}
    )
    assert harness.summary([]) == {"n": 0}
