"""Run one simulator experiment: every variant (and rate) of a ``configs/sim`` file.

    .venv/bin/python tools/sim_experiment.py configs/sim/time-varying.toml [--out DIR]

The file is a ``simulate`` configuration (see ``vertumnus.sim.config``) plus an
``[experiment]`` table::

    [experiment]
    out = "results/sim/time-varying"        # default output folder
    rate_scales = [2, 4, 6]                 # optional: every variant at each
    variants = [
      { label = "vertumnus", policy = "vertumnus" },
      { label = "fixed 4CP4/3CP8", policy = "fixed", composition = "4CP4/3CP8" },
      { label = "no scans", policy = "fixed", cache = { replication = false } },
    ]

A variant's ``policy`` is a preset (``--policy``); its tables override the file's.

Each run writes the usual files under ``OUT/<label>[@<rate>]/``. The tool then
writes ``OUT/comparison.json`` and ``OUT/comparison.md``: one row per run, with
per-phase rows when the workload has phases. It also writes ``OUT/comparison.png``,
which shows TTFT over time for each variant, or TTFT and hit rate against the rate
for a sweep.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

import orjson

from vertumnus.config import read_toml
from vertumnus.sim import config as sim_config
from vertumnus.sim import report
from vertumnus.sim.simulator import Simulation


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    raw = read_toml(args.config)
    experiment = raw.pop("experiment")
    out = args.out or Path(experiment.get("out", f"results/sim/{args.config.stem}"))
    out.mkdir(parents=True, exist_ok=True)
    rates = experiment.get("rate_scales", [None])
    rows: list[dict[str, Any]] = []
    timelines: dict[str, report.Series] = {}
    for rate in rates:
        for variant in experiment["variants"]:
            label = variant["label"]
            name = slug(label) + (f"@{rate:g}" if rate is not None else "")
            overrides = {
                "pool": {"composition": variant.get("composition")},
                "workload": {"rate_scale": rate},
                **{k: v for k, v in variant.items() if isinstance(v, dict)},
            }
            cfg = sim_config.load(
                None, overrides, raw=copy.deepcopy(raw), preset=variant.get("policy")
            )
            result = Simulation(cfg.settings, cfg.profile, cfg.spec, cfg.policy, cfg.requests).run()
            summary = report.write(result, cfg, out / name)
            row = {"label": label, "rate_scale": rate, "run": name, **summary}
            rows.append(row)
            timelines[name] = report.window_series(result, cfg)
            print(
                f"{name:<28} mean {summary['mean_ttft_s']:.3f} s"
                f"  P90 {summary['p90_ttft_s']:.3f} s"
                f"  attain {summary['token_slo_attainment']:.3f}"
                f"  hit {summary['token_hit_rate']:.3f}"
                f"  {summary['composition_start']} -> {summary['composition_end']}"
                f"  ({summary['wall_s']:.1f} s)",
                file=sys.stderr,
            )
    (out / "comparison.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    (out / "comparison.md").write_text(markdown(rows))
    report.plot_comparison(rows, timelines, out / "comparison.png", sweep=rates != [None])
    print(markdown(rows))
    print(f"results in {out}")


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| run | mean TTFT (s) | P50 | P90 | P99 | token SLO attainment | token hit rate"
        " | compositions | splits / merges |\n"
    )
    head += "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |\n"
    lines = []
    for r in rows:
        comps = f"{r['composition_start']} → {r['composition_end']}"
        lines.append(
            f"| {r['run']} | {r['mean_ttft_s']:.3f} | {r['p50_ttft_s']:.3f}"
            f" | {r['p90_ttft_s']:.3f}"
            f" | {r['p99_ttft_s']:.3f} | {r['token_slo_attainment']:.3f}"
            f" | {r['token_hit_rate']:.3f} | {comps} | {r['splits']} / {r['merges']} |"
        )
        for ph in r.get("phases", []):
            lines.append(
                f"| · phase {ph['phase']} ({ph['start_s'] / 60:.0f}–{ph['end_s'] / 60:.0f} min) "
                f"| {ph['mean_ttft_s']:.3f} | {ph['p50_ttft_s']:.3f} | {ph['p90_ttft_s']:.3f}"
                f" | {ph['p99_ttft_s']:.3f} | {ph['token_slo_attainment']:.3f}"
                f" | {ph['token_hit_rate']:.3f} | {ph['composition']} | |"
            )
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
