"""``configs/grafana/vertumnus.json``: what ``tools/gen/grafana_dashboard.py`` writes, an
importable dashboard (a Prometheus data source asked for on import, unique panel
ids, a place on the grid for each), and every series it queries one that the
pool's ``/metrics`` exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from support.tools import load_tool
from vertumnus.runtime.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "configs" / "grafana" / "vertumnus.json"


def tool_output() -> str:
    text: str = load_tool("gen/grafana_dashboard.py").render()
    return text


def exported_series() -> set[str]:
    """The sample names a pool's /metrics carries (every labelled family filled)."""
    metrics = Metrics()
    metrics.requests.labels(cp_degree="1").inc()
    metrics.reconfigurations.labels(kind="merge").inc()
    metrics.leases_ended.labels(why="pulled").inc()
    workers = [
        {"worker": 0, "cp_degree": 1, "state": "active", "queued": 2, "outstanding_s": 0.5},
        {"worker": 1, "cp_degree": 1, "state": "draining", "queued": 0, "outstanding_s": 0.0},
    ]
    text = metrics.render(workers, leases=1).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}


def test_the_committed_dashboard_is_the_tools_output() -> None:
    assert COMMITTED.read_text() == tool_output(), (
        "configs/grafana/vertumnus.json is stale: run tools/gen/grafana_dashboard.py"
    )


def test_it_imports_and_queries_only_exported_series() -> None:
    board = json.loads(COMMITTED.read_text())
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    exported = exported_series()
    queried = set()
    for p in panels:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys()
        if p["type"] == "row":
            continue
        assert p["targets"] and p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        for target in p["targets"]:
            names = re.findall(r"\bvertumnus_[a-z_]+", target["expr"])
            assert names, target
            queried.update(names)
    missing = sorted(queried - exported)
    assert missing == [], f"queried but not exported: {missing}"
    # the composition, latency, cache and hand-off are each on the board
    for family in (
        "vertumnus_workers",
        "vertumnus_ttft_seconds_bucket",
        "vertumnus_cached_tokens_total",
        "vertumnus_handoff_bytes_total",
    ):
        assert family in queried


def test_workers_that_a_reshape_ended_leave_the_gauges() -> None:
    metrics = Metrics()
    before = [
        {"worker": w, "cp_degree": 1, "state": "active", "queued": 1, "outstanding_s": 1.0}
        for w in (0, 1)
    ]
    metrics.render(before)
    after = [{"worker": 2, "cp_degree": 2, "state": "active", "queued": 0, "outstanding_s": 0.0}]
    text = metrics.render(after).decode()
    assert 'vertumnus_workers{cp_degree="2",state="active"} 1.0' in text
    assert 'vertumnus_workers{cp_degree="1"' not in text
    assert 'vertumnus_worker_queue_depth{worker="0"}' not in text
