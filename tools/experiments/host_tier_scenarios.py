"""The host KV tier on the robustness suite's generated workloads, worst cases first:

    .venv/bin/python -m tools.experiments.host_tier_scenarios [--seeds report|tune|100-129]
        [--tier-bytes 1e12] [--duration-scale 0.5] [--jobs 2] [--out results/host-tier-scenarios]

Per seed (``vertumnus.sim.scenarios``: conversations, agents, system prompts, none;
steady, step, ramp, burst; 2-20 min; load 0.2-1.1 of the fluid saturation bound, not
the suite's piloted one), the cache manager (``fixed``) at the scenario's default start
without the tier, with ``--tier-bytes`` per host and against the bound (one unbounded
tier holding every block ever committed). Nobody tuned the tier on these seeds. Writes
``OUT/host_tier_scenarios.json`` and ``.md``: per scenario the three mean and P90
TTFTs, hit rates, the tier against none (%) and the headroom captured, sorted by the
tier's worst ratio to none; then the counts against the targets (no worse within 1 %
on mean and P90; hit rate within 5 points of the bound; half the headroom captured
where there is 1 % of it) for the scenarios below overload (load < 1).
"""

from __future__ import annotations

import argparse
import concurrent.futures
from pathlib import Path
from typing import Any

import orjson

from tools.experiments import robustness
from tools.experiments.host_tier import ROLES, trio
from vertumnus.sim import scenarios


def run_seed(seed: int, tier_bytes: int, duration_scale: float) -> dict[str, Any]:
    scenario = scenarios.scaled(scenarios.draw(seed), duration_scale)
    overrides: dict[str, dict[str, dict[str, Any]] | None] = {
        "no tier": None,
        "tier": {"cache": {"host_tier_bytes": tier_bytes}},
        "bound": {"cache": {"host_tier_bound": True}},
    }
    start = scenario.starts[0]
    runs = {role: robustness.simulate(scenario, "fixed", start, overrides[role]) for role in ROLES}
    mean = {r: runs[r]["mean_ttft_s"] for r in ROLES}
    p90 = {r: runs[r]["p90_ttft_s"] for r in ROLES}
    headroom = mean["no tier"] - mean["bound"]
    return {
        "seed": seed,
        "family": scenario.family,
        "shape": scenario.shape,
        "load": scenario.load,
        "duration_s": scenario.duration_s,
        "composition": start,
        "mean": mean,
        "p90": p90,
        "hit": {r: runs[r].get("token_hit_rate") for r in ROLES},
        "mean_ratio": mean["tier"] / mean["no tier"],
        "p90_ratio": p90["tier"] / p90["no tier"],
        "captured": (mean["no tier"] - mean["tier"]) / headroom if headroom > 0 else None,
        "headroom": headroom / mean["no tier"],
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| seed | family, shape | load | mean TTFT: none / tier / bound (s) | P90 | "
        "tier/none: mean, P90 | hit: none / tier / bound | captured |",
        "| ---: | --- | ---: | --- | --- | --- | --- | ---: |",
    ]
    for r in rows:
        hit, mean, p90 = trio(r["hit"]), trio(r["mean"]), trio(r["p90"])
        captured = "–" if r["captured"] is None else f"{100 * r['captured']:.0f} %"
        lines.append(
            f"| {r['seed']} | {r['family']}, {r['shape']} | {r['load']:.2f} "
            f"| {mean} | {p90} "
            f"| {r['mean_ratio']:.3f}, {r['p90_ratio']:.3f} | {hit} | {captured} |"
        )
    return "\n".join(lines) + "\n"


def verdicts(rows: list[dict[str, Any]]) -> str:
    below = [r for r in rows if r["load"] < 1.0]
    worse = [r for r in below if max(r["mean_ratio"], r["p90_ratio"]) > 1.01]
    far = [
        r
        for r in below
        if r["hit"]["bound"] is not None and r["hit"]["bound"] - r["hit"]["tier"] > 0.05
    ]
    headroom = [r for r in below if r["headroom"] > 0.01]
    short = [r for r in headroom if (r["captured"] or 0) < 0.5]
    return (
        f"{len(below)} scenarios below overload (load < 1) of {len(rows)}: the tier worse than "
        f"none by over 1 % (mean or P90) in {len(worse)} "
        f"({', '.join(str(r['seed']) for r in worse) or 'none'}); hit rate more than 5 points "
        f"below the bound in {len(far)} ({', '.join(str(r['seed']) for r in far) or 'none'}); "
        f"under half of the headroom captured in {len(short)} of the {len(headroom)} with "
        f"over 1 % headroom ({', '.join(str(r['seed']) for r in short) or 'none'})\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--seeds", default="report")
    parser.add_argument("--tier-bytes", type=float, default=1e12)
    parser.add_argument("--duration-scale", type=float, default=1.0)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("results/host-tier-scenarios"))
    args = parser.parse_args()
    seeds = robustness.parse_seeds(args.seeds)
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(run_seed, s, int(args.tier_bytes), args.duration_scale) for s in seeds]
        rows = [job.result() for job in jobs]
    rows.sort(key=lambda r: -max(r["mean_ratio"], r["p90_ratio"]))
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows) + "\n" + verdicts(rows)
    (args.out / "host_tier_scenarios.json").write_bytes(
        orjson.dumps(rows, option=orjson.OPT_INDENT_2)
    )
    (args.out / "host_tier_scenarios.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
