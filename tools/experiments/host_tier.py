"""The host KV tier on every simulator experiment: the cache manager (``fixed``) without
the tier, with it, and the unbounded-cache bound, at each experiment's composition and
rates (docs/cache.md, "The host tier")::

    .venv/bin/python -m tools.experiments.host_tier [CONFIG ...] [--tier-bytes 1e12]
        [--out results/sim/host-tier] [--jobs 2] [--table-only]

CONFIG defaults to every ``configs/sim/*.toml``. For each, the three variants run at
the file's rates (``[experiment] rate_scales``) on the composition its ``fixed``
variant runs (else its ``[pool] composition``), through ``sim_experiment.py``:

    no tier   the cache manager, no host tier
    tier      the same, ``[cache] host_tier_bytes`` = ``--tier-bytes`` per host
    bound     one unbounded tier holding every block ever committed
              (``host_tier_bound``): every prefix ever seen, at the load-back cost

It writes ``OUT/<experiment>/`` (each run's files), ``OUT/host_tier.json`` and
``OUT/host_tier.md``: per experiment and rate, the token hit rates, mean and P90
TTFT of the three, the tier against no tier (%), the share of the TTFT headroom to
the bound that the tier captures, the tier's memory (peak on one host) and the
bytes it moved each way; then the targets (no worse within 1 % on mean and P90 below
overload; hit rate within 5 points of the bound; at least half the headroom), the
worst cases first.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
from pathlib import Path
from typing import Any

import orjson

from tools.experiments.sim_experiment import run_experiment
from vertumnus.config.tables import read_toml

ROLES = ("no tier", "tier", "bound")
OVERLOAD_S = 10.0  # mean TTFT (no tier) above this: overloaded, out of the verdicts


def composition_of(raw: dict[str, Any]) -> str:
    for v in raw["experiment"]["variants"]:
        if v.get("preset") == "fixed":
            c = v.get("composition") or v.get("pool", {}).get("composition")
            if c:
                return str(c)
    return str(raw.get("pool", {}).get("composition"))


def derived(config: Path, tier_bytes: int, out: Path) -> dict[str, Any]:
    """The experiment's tables with the three variants only."""
    raw = read_toml(config)
    composition = composition_of(raw)
    experiment = {k: v for k, v in raw["experiment"].items() if k in ("rate_scales",)}
    experiment["out"] = str(out)
    experiment["variants"] = [
        {"label": "no tier", "preset": "fixed", "composition": composition},
        {
            "label": "tier",
            "preset": "fixed",
            "composition": composition,
            "cache": {"host_tier_bytes": tier_bytes},
        },
        {
            "label": "bound",
            "preset": "fixed",
            "composition": composition,
            "cache": {"host_tier_bound": True},
        },
    ]
    raw["experiment"] = experiment
    pool = dict(raw.get("pool", {}))
    pool.pop("composition", None)
    pool.pop("start_rate", None)
    raw["pool"] = pool
    return raw


def run_one(config: Path, tier_bytes: int, out: Path) -> Path:
    folder = out / config.stem
    raw = derived(config, tier_bytes, folder)
    return run_experiment(config, folder, echo=False, raw=raw)


def rows(folder: Path) -> list[dict[str, Any]]:
    data = orjson.loads((folder / "comparison.json").read_bytes())
    groups: dict[Any, dict[str, dict[str, Any]]] = {}
    for run in data["runs"]:
        if run["label"] in ROLES:
            groups.setdefault(run["rate_scale"], {})[run["label"]] = run
    out = []
    for rate, runs in groups.items():
        if set(runs) != set(ROLES):
            continue
        tier, bound = runs["tier"], runs["bound"]
        m = {r: runs[r]["mean_ttft_s"] for r in ROLES}
        p90 = {r: runs[r]["p90_ttft_s"] for r in ROLES}
        hit = {r: runs[r]["token_hit_rate"] for r in ROLES}
        headroom = m["no tier"] - m["bound"]
        ht = tier.get("host_tier") or {}
        out.append(
            {
                "experiment": folder.name,
                "rate": rate,
                "composition": tier["composition_start"],
                "mean": m,
                "p90": p90,
                "hit": hit,
                "tier_hit": tier.get("tier_hit_rate"),
                "mean_change": m["tier"] / m["no tier"] - 1,
                "p90_change": p90["tier"] / p90["no tier"] - 1,
                "captured": (m["no tier"] - m["tier"]) / headroom if headroom > 0 else None,
                "overloaded": m["no tier"] > OVERLOAD_S,
                "peak_bytes_per_host": ht.get("peak_bytes"),
                "demoted_bytes": ht.get("demoted_bytes"),
                "loaded_bytes": ht.get("loaded_bytes"),
                "d2h_busy_s": ht.get("d2h_busy_s"),
                "simulated_s": tier.get("simulated_s"),
                "bound_bytes": (bound.get("host_tier") or {}).get("peak_bytes"),
            }
        )
    return out


def trio(values: dict[str, float | None]) -> str:
    """A figure of the three variants, no tier / tier / bound ("–": none)."""
    return " / ".join("–" if values[k] is None else f"{values[k]:.3f}" for k in ROLES)


def _gb(x: float | None) -> str:
    return "–" if x is None else f"{x / 1e9:,.0f} GB"


def markdown(table: list[dict[str, Any]]) -> str:
    lines = [
        "| experiment | rate | hit: no tier / tier / bound | mean TTFT (s) | P90 TTFT (s) "
        "| tier vs none: mean / P90 | captured | tier peak per host | D2H / H2D moved |",
        "| --- | ---: | --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    for r in table:
        rate = "–" if r["rate"] is None else f"×{r['rate']:g}"
        hit, mean, p90 = trio(r["hit"]), trio(r["mean"]), trio(r["p90"])
        change = f"{100 * r['mean_change']:+.1f} / {100 * r['p90_change']:+.1f} %"
        captured = "–" if r["captured"] is None else f"{100 * r['captured']:.0f} %"
        if r["overloaded"]:
            rate += " (overloaded)"
        moved = f"{_gb(r['demoted_bytes'])} / {_gb(r['loaded_bytes'])}"
        lines.append(
            f"| {r['experiment']} | {rate} | {hit} | {mean} | {p90} | {change} | {captured} "
            f"| {_gb(r['peak_bytes_per_host'])} | {moved} |"
        )
    return "\n".join(lines) + "\n"


def verdicts(table: list[dict[str, Any]]) -> list[str]:
    """The targets missed: harm first (the tier worse than none), then hit rates short
    of the bound, then headroom not captured; each the worst first."""
    worse: list[tuple[float, str]] = []
    short: list[tuple[float, str]] = []
    uncaptured: list[tuple[float, str]] = []
    for r in table:
        if r["overloaded"]:
            continue
        rate = "–" if r["rate"] is None else f"×{r['rate']:g}"
        where = f"{r['experiment']} {rate}"
        change = max(r["mean_change"], r["p90_change"])
        if change > 0.01:
            worse.append((change, f"{where}: tier worse by {100 * change:.1f} % (mean or P90)"))
        gap = r["hit"]["bound"] - r["hit"]["tier"]
        if gap > 0.05:
            short.append((gap, f"{where}: hit rate {100 * gap:.1f} points below the bound"))
        headroom = r["mean"]["no tier"] - r["mean"]["bound"]
        if headroom > 0.01 * r["mean"]["no tier"] and (r["captured"] or 0) < 0.5:
            captured = r["captured"] or 0
            uncaptured.append((-captured, f"{where}: captured {captured:.0%}"))
    return [text for group in (worse, short, uncaptured) for _, text in sorted(group, reverse=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("configs", type=Path, nargs="*")
    parser.add_argument("--tier-bytes", type=float, default=1e12, help="per host (1 TB)")
    parser.add_argument("--out", type=Path, default=Path("results/sim/host-tier"))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--table-only", action="store_true", help="tabulate runs made before")
    args = parser.parse_args()
    configs = args.configs or sorted(Path("configs/sim").glob("*.toml"))
    if not args.table_only:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            jobs = {pool.submit(run_one, c, int(args.tier_bytes), args.out): c for c in configs}
            for job in concurrent.futures.as_completed(jobs):
                print(f"done: {jobs[job]} -> {job.result()}", file=sys.stderr)
    table = [r for c in configs for r in rows(args.out / c.stem)]
    text = markdown(table)
    missed = verdicts(table)
    text += "\ntargets missed: " + ("; ".join(missed) if missed else "none") + "\n"
    (args.out / "host_tier.json").write_bytes(orjson.dumps(table, option=orjson.OPT_INDENT_2))
    (args.out / "host_tier.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
