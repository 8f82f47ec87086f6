"""``tools/experiments/host_tier.py``: an experiment's three variants (no tier, tier,
bound) on its composition, the table and the verdicts (a tiny conversation
trace whose conversations overflow the caches)."""

from __future__ import annotations

import json
from pathlib import Path

from support.tools import load_tool
from support.traces import write_trace

CONFIG = """
[experiment]
rate_scales = [1.0]
variants = [
  { label = "vertumnus", preset = "vertumnus" },
  { label = "fixed", preset = "fixed", composition = "2CP4" },
]

[pool]
composition = "1CP8"
degrees = [4, 8]

[engine]
kv_blocks_per_rank = 8

[workload]
trace = "TRACE"

[sim]
seed = 3
"""


def test_three_variants_on_the_fixed_composition(tmp_path: Path) -> None:
    tool = load_tool("experiments/host_tier.py")
    write_trace(tmp_path / "trace.jsonl", seed=3)  # (more conversations than 2CP4 holds)
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.replace("TRACE", str(tmp_path / "trace.jsonl")))
    folder = tool.run_one(config, 10**12, tmp_path / "out")
    runs = json.loads((folder / "comparison.json").read_text())["runs"]
    assert sorted(r["label"] for r in runs) == ["bound", "no tier", "tier"]
    assert {r["composition_start"] for r in runs} == {"2CP4"}  # (the fixed variant's)
    by = {r["label"]: r for r in runs}
    assert by["no tier"]["host_tier"]["enabled"] == 0
    assert by["tier"]["host_tier"]["demoted_blocks"] > 0
    assert by["bound"]["host_tier"]["capacity_blocks_per_host"] is None
    # The bound reuses at least what the tier does, the tier at least what none does.
    hits = [by[k]["token_hit_rate"] for k in ("no tier", "tier", "bound")]
    assert hits[0] <= hits[1] <= hits[2] and hits[1] > hits[0], hits
    (row,) = tool.rows(folder)
    assert row["experiment"] == "tiny" and row["hit"]["tier"] == hits[1]
    assert row["mean_change"] == by["tier"]["mean_ttft_s"] / by["no tier"]["mean_ttft_s"] - 1
    table = tool.markdown([row])
    assert table.count("\n") == 3 and "| tiny | ×1 |" in table
    # A made-up row that misses every target is named by each verdict.
    bad = dict(row, mean_change=0.2, p90_change=0.0, captured=0.1, overloaded=False)
    bad["hit"] = {"no tier": 0.1, "tier": 0.1, "bound": 0.5}
    bad["mean"] = {"no tier": 1.0, "tier": 1.2, "bound": 0.5}
    missed = tool.verdicts([bad])
    assert len(missed) == 3 and "worse by 20.0 %" in missed[0], missed
