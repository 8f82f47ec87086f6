"""Tables for the what-if controller, from an experiment's run folders
(``tools/experiments/sim_experiment.py`` output):

    .venv/bin/python -m tools.experiments.whatif_report results/sim/time-varying [--after-s 60]

1. predicted against measured, per phase (or rate) and candidate composition: the
   mean of the adaptive run's ``steady`` predictions of that composition over the
   decisions of the phase, beside the mean TTFT the fixed run of that composition
   measured in the phase;
2. per run: the adaptive run's moves (time, rule, composition after), the shortest
   time between two reshapes after the first ``--after-s`` seconds, and the mean
   TTFT of the requests that arrived after them against the best fixed run's.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path
from typing import Any

import orjson


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--after-s", type=float, default=60.0)
    parser.add_argument("--adaptive", default="vertumnus", help="the adaptive run's label slug")
    args = parser.parse_args()
    comparison = orjson.loads((args.folder / "comparison.json").read_bytes())
    runs = comparison["runs"]
    groups: dict[Any, list[dict[str, Any]]] = {}
    for row in runs:
        groups.setdefault(row["rate_scale"], []).append(row)
    for rate, rows in groups.items():
        suffix = f"@{rate:g}" if rate is not None else ""
        adaptive = next(r for r in rows if r["run"] == args.adaptive + suffix)
        fixed = {r["composition_start"]: r for r in rows if r["label"].startswith("fixed ")}
        decisions = load_jsonl(args.folder / adaptive["run"] / "decisions.jsonl")
        phases = adaptive.get("phases") or [{"start_s": 0.0, "end_s": float("inf")}]
        title = f"×{rate:g}" if rate is not None else "run"
        print(f"\n### {title}: predicted (steady, mean over the phase's decisions) vs measured\n")
        print("| phase | composition | predicted (s) | measured fixed (s) | error |")
        print("| --- | --- | ---: | ---: | ---: |")
        for k, phase in enumerate(phases):
            lo, hi = phase.get("start_s", 0.0), phase.get("end_s", float("inf"))
            predicted: dict[str, list[float]] = {}
            for d in decisions:
                if not lo + 30.0 <= d["end_s"] <= hi:  # the phase's own forecasts
                    continue
                for c in d.get("candidates", []):
                    if c["steady_s"] is not None:
                        predicted.setdefault(c["composition"], []).append(c["steady_s"])
            for name, values in sorted(predicted.items()):
                run = fixed.get(name)
                if run is None:
                    continue
                measured = (
                    run["phases"][k]["mean_ttft_s"] if len(phases) > 1 else run["mean_ttft_s"]
                )
                mean = statistics.mean(values)
                print(
                    f"| {k if len(phases) > 1 else title} | {name} | {mean:.3f} | "
                    f"{measured:.3f} | {100 * (mean / measured - 1):+.1f} % |"
                )
        moved = [d for d in decisions if d["ops"] and d.get("window_rule") not in ("fixed", "end")]
        late = [d["end_s"] for d in moved if d["end_s"] > args.after_s]
        gaps = [b - a for a, b in itertools.pairwise(late)]
        requests = load_jsonl(args.folder / adaptive["run"] / "requests.jsonl")
        best = min(
            (r for r in rows if r["label"].startswith("fixed ")),
            key=lambda r: after(args.folder / r["run"], args.after_s),
        )
        mine = statistics.mean(r["ttft_s"] for r in requests if r["arrival_s"] >= args.after_s)
        theirs = after(args.folder / best["run"], args.after_s)
        moves = [(round(d["end_s"]), d["rule"]) for d in moved]
        shortest = f", shortest gap {min(gaps):.0f} s" if gaps else ""
        print(f"\n{title}: moves {moves}; reshapes after {args.after_s:g} s: {len(late)}{shortest}")
        print(
            f"{title}: mean TTFT of arrivals after {args.after_s:g} s: {args.adaptive} "
            f"{mine:.4f} s, best fixed ({best['label']}) {theirs:.4f} s "
            f"({100 * (mine / theirs - 1):+.1f} %)"
        )


def after(folder: Path, after_s: float) -> float:
    return statistics.mean(
        r["ttft_s"] for r in load_jsonl(folder / "requests.jsonl") if r["arrival_s"] >= after_s
    )


if __name__ == "__main__":
    main()
