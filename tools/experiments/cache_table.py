"""The prefix-cache manager against its bound, from experiments' ``comparison.json``
(``tools/experiments/sim_experiment.py`` with the presets ``fixed``, ``no-replication`` and
``ideal-replication`` at the same compositions):

    .venv/bin/python -m tools.experiments.cache_table results/sim/cache-ablation \\
        results/sim/cache-ablation-conversation

One row per experiment, rate and starting composition: mean / P90 TTFT with the
manager off (``no-replication``), on (``fixed``) and ideal; the headroom
(off - ideal) / off; the share of it captured, (off - on) / (off - ideal); whether on
is within 1 % of off on both mean and P90; the waste fraction of all copies (blocks
evicted before any hit, over those resolved), and the wasted and resolved blocks of
each kind. A rate where off is overloaded (mean TTFT over ``--overload-s``) is
marked and left out of the verdicts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

ROLES = {"no-replication": "off", "fixed": "on", "ideal-replication": "ideal"}


def _pct(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{100 * x:.2f} %" if abs(x) < 0.01 else f"{100 * x:.0f} %"


def _waste(run: dict[str, Any], kind: str) -> float | None:
    entry = run.get("cache_audit", {}).get(kind)
    return None if entry is None else entry.get("waste_fraction")


def _blocks(run: dict[str, Any], kind: str) -> str:
    """``wasted / resolved`` copied blocks of one kind ("–": none copied)."""
    entry = run.get("cache_audit", {}).get(kind)
    if entry is None:
        return "–"
    return f"{entry['wasted_blocks']:,} / {entry['wasted_blocks'] + entry['used_blocks']:,}"


def rows(folder: Path, overload_s: float) -> list[dict[str, Any]]:
    data = orjson.loads((folder / "comparison.json").read_bytes())
    groups: dict[tuple[Any, Any], dict[str, dict[str, Any]]] = {}
    for run in data["runs"]:
        # (``policy``: the preset, in a comparison written before it was named ``preset``)
        role = ROLES.get(run.get("preset", run.get("policy", "")))
        if role is not None:
            key = (run["rate_scale"], run["composition_start"])
            groups.setdefault(key, {})[role] = run
    out = []
    for (rate, composition), runs in groups.items():
        if set(runs) != {"off", "on", "ideal"}:
            continue
        off, on, ideal = (runs[r] for r in ("off", "on", "ideal"))
        m = {r: runs[r]["mean_ttft_s"] for r in runs}
        p90 = {r: runs[r]["p90_ttft_s"] for r in runs}
        overloaded = m["off"] > overload_s
        headroom = (m["off"] - m["ideal"]) / m["off"]
        captured = (m["off"] - m["on"]) / (m["off"] - m["ideal"]) if headroom > 0 else None
        out.append(
            {
                "experiment": folder.name,
                "rate": rate,
                "composition": composition,
                "off": (m["off"], p90["off"]),
                "on": (m["on"], p90["on"]),
                "ideal": (m["ideal"], p90["ideal"]),
                "headroom": headroom,
                "captured": captured,
                "never_worse": m["on"] <= 1.01 * m["off"] and p90["on"] <= 1.01 * p90["off"],
                "overloaded": overloaded,
                "waste": _waste(on, "all"),
                "blocks": {k: _blocks(on, k) for k in ("all", "pull", "intra", "inter")},
                "off_run": off["run"],
                "ideal_run": ideal["run"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--overload-s", type=float, default=10.0)
    args = parser.parse_args()
    print(
        "| experiment | rate | composition | off: mean / P90 (s) | on | ideal | headroom "
        "| captured | on no worse | waste | wasted / resolved blocks: pull; intra; inter |"
    )
    print("| --- | ---: | --- | --- | --- | --- | ---: | ---: | --- | ---: | --- |")
    misses = []
    for folder in args.folders:
        for r in rows(folder, args.overload_s):
            rate = "–" if r["rate"] is None else f"×{r['rate']:g}"
            cells = [f"{r[k][0]:.3f} / {r[k][1]:.3f}" for k in ("off", "on", "ideal")]
            if r["overloaded"]:
                cells[0] += " (overloaded)"
            blocks = "; ".join(r["blocks"][k] for k in ("pull", "intra", "inter"))
            verdict = "yes" if r["never_worse"] else "**no**"
            print(
                f"| {r['experiment']} | {rate} | {r['composition']} | {' | '.join(cells)} "
                f"| {_pct(r['headroom'])} | {_pct(r['captured'])} | {verdict} "
                f"| {_pct(r['waste'])} | {blocks} |"
            )
            if r["overloaded"]:
                continue
            if not r["never_worse"]:
                misses.append(f"{r['experiment']} {rate}: on worse than off")
            if r["headroom"] >= 0.03 and (r["captured"] or 0) < 0.5:
                misses.append(f"{r['experiment']} {rate}: captured {_pct(r['captured'])}")
            if r["waste"] is not None and r["waste"] >= 0.3:
                misses.append(f"{r['experiment']} {rate}: waste {_pct(r['waste'])}")
    print()
    print("targets missed: " + ("; ".join(misses) if misses else "none"))


if __name__ == "__main__":
    main()
