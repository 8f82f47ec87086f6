"""The simulator-speed benchmark (``tools/bench/sim_speed.py``) on a few seconds of its
1,024-GPU experiment: the run pauses the collector unless asked not to, and the
figures it prints are those of the run."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from tools.bench import sim_speed

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


@pytest.mark.skipif(not TRACE.is_file(), reason="the shared traces are not here")
@pytest.mark.timeout(300)
def test_the_benchmark_runs_the_pool_with_and_without_the_collector() -> None:
    assert gc.isenabled()
    paused = sim_speed.run(2.0, collector=False)
    running = sim_speed.run(2.0, collector=True)
    assert gc.isenabled()
    for out in (paused, running):
        assert out["requests"] > 500
        assert out["simulated_s"] >= 2.0
        assert out["wall_over_simulated"] == out["wall_s"] / out["simulated_s"]
    assert paused["requests"] == running["requests"]
    assert paused["collections"] == 0  # (nothing collects while it is paused)
    assert running["collections"] > 0
