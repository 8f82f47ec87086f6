"""The headline table "Vertumnus against the best configuration of each peer", from
experiments' ``comparison.json`` (``tools/experiments/sim_experiment.py`` with
``sweep_routers``):

    .venv/bin/python -m tools.experiments.peers_table results/sim/time-varying \\
        results/sim/all-policies results/sim/cache-ablation

One row per experiment, rate and phase: Vertumnus's mean / P90 TTFT and token SLO
attainment, and for each peer router its best composition (after the fact) with the
same figures and Vertumnus's gap on mean TTFT (negative: Vertumnus faster).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

PEERS = ("sglang-cache-aware", "dynamo-kv", "llm-d")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--phases", action="store_true", help="a row per phase too")
    args = parser.parse_args()
    head = "| experiment | rate / phase | vertumnus | " + " | ".join(PEERS) + " |"
    print(head)
    print("| --- | --- | --- | " + " | ".join("---" for _ in PEERS) + " |")
    for folder in args.folders:
        data = orjson.loads((folder / "comparison.json").read_bytes())
        for e in data.get("against_each_peer", []):
            if e["phase"] is not None and not args.phases:
                continue
            rate = f"×{e['rate_scale']:g}" if e["rate_scale"] is not None else ""
            scope = "whole run" if e["phase"] is None else f"phase {e['phase']}"
            m = e["mine"]
            cells = [f"{m['mean_ttft_s']:.3f} / {m['p90_ttft_s']:.3f}, {m['attainment']:.3f}"]
            for peer in PEERS:
                p = e["peers"].get(peer)
                if p is None:
                    cells.append("–")
                    continue
                comp = p["label"].removeprefix(peer).strip()
                cells.append(
                    f"{p['mean_ttft_s']:.3f} / {p['p90_ttft_s']:.3f}, {p['attainment']:.3f}"
                    f" ({comp}; {p['gap_pct']:+.1f} %)"
                )
            where = ", ".join(x for x in (rate, scope) if x)
            print(f"| {folder.name} | {where} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
