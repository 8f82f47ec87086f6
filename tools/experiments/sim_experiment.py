"""Run one simulator experiment: every variant (and rate) of a ``configs/sim`` file.

    .venv/bin/python -m tools.experiments.sim_experiment configs/sim/time-varying.toml [--out DIR]

The file is a ``simulate`` configuration (see ``vertumnus.sim.config``) plus an
``[experiment]`` table::

    [experiment]
    out = "results/sim/time-varying"        # default output folder
    rate_scales = [2, 4, 6]                 # optional: every variant at each
    sweep_fixed = true                      # optional: every composition, fixed
    sweep_routers = ["dynamo-kv"]           # optional: each router on every composition
    variants = [
      { label = "vertumnus", preset = "vertumnus", pool = { composition = "auto", ranks = 40 } },
      { label = "fixed 4CP4/3CP8", preset = "fixed", composition = "4CP4/3CP8" },
      { label = "no scans", preset = "fixed", cache = { replication = false } },
    ]

A variant's ``preset`` is a ``--preset`` name; its tables override the file's,
key by key (``composition = X`` is ``pool = { composition = X }``). A variant that
starts at ``composition = "auto"`` needs what it starts from, in its ``pool`` or the
file's (``start_rate = 15.0``, or ``start_workload = "FILE"``: ``config/start.py``);
with ``rate_scales``, that ``start_rate`` (or ``start_rate_scale``) is scaled with
the run's rate too: an operator knows the rate they run at, never the requests to
come.

``sweep_fixed = true`` adds a variant ``{ label = "fixed 6CP4-2CP8", preset = "fixed",
composition = "6CP4/2CP8" }`` for every composition the lattice allows (its bounds
kept) that no ``fixed`` variant already runs. The lattice is the file's ``[pool]``
with the first variant's ``pool`` over it (the devices, degrees and bounds).

Each run writes the usual files under ``OUT/<label>[@<rate>]/``. The tool then
writes ``OUT/comparison.json`` (``runs``: one row per run, with per-phase rows when
the workload has phases; ``against_best_fixed``: per rate, and per phase, the fixed
variant of least mean TTFT and every other variant's gap to it in %) and
``OUT/comparison.md`` (the same as tables). It also writes ``OUT/comparison.png``,
which shows TTFT over time for each variant (the adaptive ones' moves marked), or
TTFT and hit rate against the rate for a sweep, and ``OUT/report.html``: one
self-contained page with every run's figures in a table and, over time, the
adaptive variants beside the best run of each fixed preset (``fixed`` and each
router) at each rate: TTFT, attainment, hit rate, and each one's composition with
its reshapes (``vertumnus/dashboard.py``; each run's own ``report.html`` has the
rest).
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import sys
import tomllib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from vertumnus.config import ConfigError, read_toml
from vertumnus.config.dialect import check_keys
from vertumnus.config.pool import PoolConfig, parse_composition
from vertumnus.dashboard import comparison_html
from vertumnus.policy.geometry import LatticeConfig, composition_name, reachable_compositions
from vertumnus.sim import config as sim_config
from vertumnus.sim import plots, report
from vertumnus.sim.simulator import Simulation

VARIANT_KEYS = frozenset({"label", "preset", "composition"})  # besides its tables


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def variant_overrides(
    variant: dict[str, Any], rate: float | None, raw: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """The variant's tables as ``sim_config.load`` overrides, merged key by key:
    ``composition`` goes into ``pool`` and the rate scale into ``workload`` (and
    into the start's rate, read from the file ``raw`` with the variant over it)."""
    overrides: dict[str, dict[str, Any]] = {
        k: dict(v) for k, v in variant.items() if isinstance(v, dict)
    }
    if variant.get("composition") is not None:
        pool = overrides.setdefault("pool", {})
        given = pool.get("composition")
        if given is not None and given != variant["composition"]:
            raise SystemExit(
                f"variant {variant['label']!r}: composition {variant['composition']!r} and "
                f"pool.composition {given!r} differ"
            )
        pool["composition"] = variant["composition"]
    if rate is not None:
        overrides.setdefault("workload", {})["rate_scale"] = rate
        # The operator knows the rate they run at (never the requests to come): the
        # rate of what "auto" starts from scales with the run's.
        start = _pool_table(raw or {}, variant)
        if start.get("start_workload") is not None:
            scale = float(start.get("start_rate_scale", 1.0)) * rate
            overrides.setdefault("pool", {})["start_rate_scale"] = scale
        elif start.get("start_rate") is not None:
            overrides.setdefault("pool", {})["start_rate"] = float(start["start_rate"]) * rate
    return overrides


def _pool_table(raw: dict[str, Any], variant: dict[str, Any] | None) -> dict[str, Any]:
    table = dict(raw.get("pool", {}))
    if variant is not None:
        table.update(variant_overrides(variant, None).get("pool", {}))
    return table


def experiment_lattice(raw: dict[str, Any], variants: list[dict[str, Any]]) -> LatticeConfig:
    """The file's pool with the first variant's ``pool`` over it, as a lattice (devices,
    degrees, bounds, hosts); no workload is read."""
    table = _pool_table(raw, variants[0] if variants else None)
    if table.get("composition") == "auto":
        del table["composition"]
    return PoolConfig.from_table(table, sim_config.DEFAULT_POOL).lattice


def start_composition(raw: dict[str, Any], variant: dict[str, Any]) -> dict[int, int] | None:
    """The composition a variant starts from (None: "auto", or not given)."""
    table = _pool_table(raw, variant)
    if table.get("layout") is not None:
        return dict(Counter(int(c) for c in table["layout"]))
    composition = table.get("composition")
    if composition is None or composition == "auto":
        return None
    return parse_composition(str(composition))


def sweep_variants(raw: dict[str, Any], variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ``fixed`` variant for every composition of the lattice that no plain ``fixed``
    variant (no table but ``pool``) already runs."""
    present = [
        start_composition(raw, v)
        for v in variants
        if v.get("preset") == "fixed"
        and all(k == "pool" for k, val in v.items() if isinstance(val, dict))
    ]
    added = []
    for counts in reachable_compositions(experiment_lattice(raw, variants)):
        if counts in present:
            continue
        name = composition_name(counts)
        added.append(
            {"label": f"fixed {name.replace('/', '-')}", "preset": "fixed", "composition": name}
        )
    return added


def router_sweep(
    raw: dict[str, Any], variants: list[dict[str, Any]], router: str
) -> list[dict[str, Any]]:
    """``sweep_routers``: the router (a preset: fixed composition, LRU caches) on
    every composition of the lattice, labelled ``<router> 6CP4-2CP8``."""
    return [
        {
            "label": f"{router} {composition_name(c).replace('/', '-')}",
            "preset": router,
            "composition": composition_name(c),
        }
        for c in reachable_compositions(experiment_lattice(raw, variants))
    ]


def best_of_each(rows: list[dict[str, Any]], mine: str) -> list[dict[str, Any]]:
    """Per rate (and phase): the run labelled ``mine`` against the best run of every
    other fixed-composition preset (``fixed`` and each router), that preset's best
    composition chosen after the fact."""
    out = []
    for rate in dict.fromkeys(r["rate_scale"] for r in rows):
        here = [r for r in rows if r["rate_scale"] == rate]
        me = next((r for r in here if r["label"] == mine), None)
        if me is None:
            continue
        phases = here[0].get("phases", [])
        scopes: list[int | None] = [None] + (
            [ph["phase"] for ph in phases] if len(phases) > 1 else []
        )
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in here:
            if not r.get("adaptive") and r["label"] != mine:
                groups.setdefault(str(r.get("preset")), []).append(r)
        for phase in scopes:
            entry: dict[str, Any] = {"rate_scale": rate, "phase": phase, "mine": {
                "mean_ttft_s": _mean(me, phase),
                "p90_ttft_s": _stat(me, phase, "p90_ttft_s"),
                "attainment": _stat(me, phase, "token_slo_attainment"),
            }, "peers": {}}  # fmt: skip
            for preset, runs in groups.items():
                top = min(runs, key=lambda r: _mean(r, phase))
                best_s = _mean(top, phase)
                entry["peers"][preset] = {
                    "label": top["label"],
                    "mean_ttft_s": best_s,
                    "p90_ttft_s": _stat(top, phase, "p90_ttft_s"),
                    "attainment": _stat(top, phase, "token_slo_attainment"),
                    "gap_pct": 100 * (_mean(me, phase) / best_s - 1) if best_s > 0 else None,
                }
            out.append(entry)
    return out


def _stat(row: dict[str, Any], phase: int | None, key: str) -> float:
    value = row[key] if phase is None else row["phases"][phase][key]
    return float(value) if value is not None else math.nan


def peers_markdown(peers: list[dict[str, Any]]) -> str:
    if not peers or not any(e["peers"] for e in peers):
        return ""
    lines = [
        "\n## Against the best configuration of each peer\n",
        "Per rate and phase: `vertumnus` (mean / P90 TTFT, token SLO attainment) and, for"
        " each fixed-composition preset, its best composition after the fact and the gap"
        " of `vertumnus` to it (negative: faster).\n",
        "| rate / phase | vertumnus | preset | its best | mean / P90, attainment | gap |",
        "| --- | --- | --- | --- | --- | ---: |",
    ]
    for e in peers:
        scope = "whole run" if e["phase"] is None else f"phase {e['phase']}"
        where = (f"×{e['rate_scale']:g}, " if e["rate_scale"] is not None else "") + scope
        m = e["mine"]
        me = f"{m['mean_ttft_s']:.3f} / {m['p90_ttft_s']:.3f}, {m['attainment']:.3f}"
        for preset, p in sorted(e["peers"].items()):
            them = f"{p['mean_ttft_s']:.3f} / {p['p90_ttft_s']:.3f}, {p['attainment']:.3f}"
            gap = "–" if p["gap_pct"] is None else f"{p['gap_pct']:+.1f} %"
            lines.append(f"| {where} | {me} | {preset} | {p['label']} | {them} | {gap} |")
    return "\n".join(lines) + "\n"


def run_experiment(
    config: Path,
    out: Path | None = None,
    echo: bool = True,
    settings: Sequence[str] = (),
    raw: dict[str, Any] | None = None,
) -> Path:
    """Every variant at every rate of ``config``; the runs' files and the comparison
    under ``out`` (default: the file's ``[experiment] out``). ``settings``:
    ``TABLE.KEY=VALUE`` (a TOML value) laid over the file for every variant.
    ``raw``: the file's tables, already read (and changed) by the caller.
    Returns the folder."""
    raw = read_toml(config) if raw is None else copy.deepcopy(raw)
    for setting in settings:
        where, _, value = setting.partition("=")
        table, _, key = where.partition(".")
        if not (table and key and value):
            raise SystemExit(f"--set wants TABLE.KEY=VALUE, got {setting!r}")
        raw.setdefault(table, {})[key] = tomllib.loads(f"v = {value}")["v"]
    experiment = raw.pop("experiment")
    variants = [dict(v) for v in experiment["variants"]]
    for v in variants:
        where = f"{config}: variant {v.get('label')!r}"
        check_keys(v, "experiment.variants", where)
        unknown = sorted(k for k, value in v.items() if not isinstance(value, dict))
        unknown = [k for k in unknown if k not in VARIANT_KEYS]
        if unknown:
            raise ConfigError(
                f"{where}: unknown keys {unknown} (a variant has {sorted(VARIANT_KEYS)} "
                "and tables such as pool = { ... })"
            )
    out = out or Path(experiment.get("out", f"results/sim/{config.stem}"))
    out.mkdir(parents=True, exist_ok=True)
    if experiment.get("sweep_fixed", False):
        variants += sweep_variants(raw, variants)
    for router in experiment.get("sweep_routers", []):
        variants += router_sweep(raw, variants, str(router))
    labels = [v["label"] for v in variants]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"variant labels repeat: {sorted(labels)}")
    rates = experiment.get("rate_scales", [None])
    rows: list[dict[str, Any]] = []
    timelines: dict[str, plots.Series] = {}
    for rate in rates:
        for variant in variants:
            label = variant["label"]
            name = slug(label) + (f"@{rate:g}" if rate is not None else "")
            cfg = sim_config.load(
                None,
                variant_overrides(variant, rate, raw),
                raw=copy.deepcopy(raw),
                preset=variant.get("preset"),
            )
            result = Simulation(cfg.settings, cfg.profile, cfg.spec, cfg.policy, cfg.requests).run()
            summary = report.write(result, cfg, out / name)
            row = {
                "label": label,
                "rate_scale": rate,
                "run": name,
                "adaptive": cfg.policy.adaptive,
                **summary,
            }
            rows.append(row)
            timelines[name] = plots.window_series(result, cfg)
            if echo:
                print(
                    f"{name:<28} mean {summary['mean_ttft_s']:.3f} s"
                    f"  P90 {summary['p90_ttft_s']:.3f} s"
                    f"  attain {summary['token_slo_attainment']:.3f}"
                    f"  hit {summary['token_hit_rate']:.3f}"
                    f"  {summary['composition_start']} -> {summary['composition_end']}"
                    f"  ({summary['reshapes']} reshapes, {summary['wall_s']:.1f} s)",
                    file=sys.stderr,
                )
    best = against_best_fixed(rows)
    peers = best_of_each(rows, "vertumnus")
    comparison = {"runs": rows, "against_best_fixed": best, "against_each_peer": peers}
    (out / "comparison.json").write_bytes(orjson.dumps(comparison, option=orjson.OPT_INDENT_2))
    text = markdown(rows, best) + peers_markdown(peers)
    (out / "comparison.md").write_text(text)
    plots.plot_comparison(rows, timelines, out / "comparison.png", sweep=rates != [None])
    write_report(config.stem, rows, out)
    if echo:
        print(text)
        print(f"results in {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override a setting for every variant (e.g. sim.noise_cv=0.2)",
    )
    args = parser.parse_args(argv)
    try:
        run_experiment(args.config, args.out, settings=args.set)
    except ConfigError as exc:  # one line, as `python -m vertumnus simulate` says it
        raise SystemExit(f"error: {exc}") from exc


REPORT_COLUMNS = [
    "preset",
    "rate_scale",
    "composition_start",
    "composition_end",
    "mean_ttft_s",
    "p50_ttft_s",
    "p90_ttft_s",
    "p99_ttft_s",
    "token_slo_attainment",
    "token_hit_rate",
    "reshapes",
    "copies",
    "reclaims",
]
MAX_OVER_TIME = 12  # runs drawn over time in the comparison report


def over_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs the report draws over time: every adaptive one, and per rate the run
    of least mean TTFT of each fixed preset (``fixed``, each router)."""
    best: dict[tuple[Any, str], dict[str, Any]] = {}
    for row in rows:
        if row["adaptive"]:
            continue
        key = (row["rate_scale"], row["preset"])
        if key not in best or row["mean_ttft_s"] < best[key]["mean_ttft_s"]:
            best[key] = row
    chosen = {id(r) for r in rows if r["adaptive"]} | {id(r) for r in best.values()}
    return [r for r in rows if id(r) in chosen][:MAX_OVER_TIME]


def write_report(name: str, rows: list[dict[str, Any]], out: Path) -> None:
    """``OUT/report.html`` from the runs' rows and their ``timeline.json`` (over time,
    one rate at a time: the page has a select for it)."""
    runs = [{"name": r["run"], "summary": r} for r in rows]
    variants = []
    for row in over_time(rows):
        timeline = orjson.loads((out / row["run"] / "timeline.json").read_bytes())
        variants.append({"name": row["run"], "rate": row["rate_scale"], **timeline})
    page = comparison_html(f"Vertumnus experiment · {name}", REPORT_COLUMNS, runs, variants)
    (out / "report.html").write_text(page, encoding="utf-8")


def _mean(row: dict[str, Any], phase: int | None) -> float:
    value = row["mean_ttft_s"] if phase is None else row["phases"][phase]["mean_ttft_s"]
    return float(value) if value is not None else math.nan


def against_best_fixed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate scale (and per phase, when the workload has more than one): the fixed
    variant (preset ``fixed``) of least mean TTFT, and every other variant's mean TTFT
    and its gap to it, (mean - best) / best in %. Empty without fixed variants. Each
    run row also gets its whole-run gap, ``gap_vs_best_fixed_pct``."""
    out = []
    for rate in dict.fromkeys(r["rate_scale"] for r in rows):
        mine = [r for r in rows if r["rate_scale"] == rate]
        fixed = [r for r in mine if r.get("preset") == "fixed"]
        if not fixed:
            continue
        phases = mine[0].get("phases", [])
        scopes: list[int | None] = [None]
        if len(phases) > 1:
            scopes += [ph["phase"] for ph in phases]
        for phase in scopes:
            ranked = [r for r in fixed if not math.isnan(_mean(r, phase))]
            if not ranked:
                continue
            top = min(ranked, key=lambda r: _mean(r, phase))
            best_s = _mean(top, phase)
            others = []
            for r in mine:
                if r.get("preset") == "fixed":
                    continue
                mean = _mean(r, phase)
                gap = 100 * (mean - best_s) / best_s if best_s > 0 else math.nan
                others.append(
                    {
                        "label": r["label"],
                        "run": r["run"],
                        "preset": r.get("preset"),
                        "adaptive": r.get("adaptive"),
                        "mean_ttft_s": mean,
                        "gap_pct": gap,
                    }
                )
                if phase is None:
                    r["gap_vs_best_fixed_pct"] = gap
            out.append(
                {
                    "rate_scale": rate,
                    "phase": phase,
                    "start_s": None if phase is None else phases[phase]["start_s"],
                    "end_s": None if phase is None else phases[phase]["end_s"],
                    "best_fixed": {"label": top["label"], "run": top["run"], "mean_ttft_s": best_s},
                    "fixed": [{"label": r["label"], "mean_ttft_s": _mean(r, phase)} for r in fixed],
                    "variants": others,
                }
            )
    return out


def _scope(entry: dict[str, Any]) -> str:
    rate = entry["rate_scale"]
    parts = [] if rate is None else [f"×{rate:g}"]
    if entry["phase"] is None:
        parts.append("whole run")
    else:
        start, end = entry["start_s"] / 60, entry["end_s"] / 60
        parts.append(f"phase {entry['phase']} ({start:.0f}–{end:.0f} min)")
    return ", ".join(parts)


def markdown(rows: list[dict[str, Any]], best: list[dict[str, Any]] | None = None) -> str:
    head = (
        "| run | mean TTFT (s) | P50 | P90 | P99 | token SLO attainment | token hit rate"
        " | compositions | splits / merges | reshapes |\n"
    )
    head += "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |\n"
    lines = []
    for r in rows:
        comps = f"{r['composition_start']} → {r['composition_end']}"
        lines.append(
            f"| {r['run']} | {r['mean_ttft_s']:.3f} | {r['p50_ttft_s']:.3f}"
            f" | {r['p90_ttft_s']:.3f}"
            f" | {r['p99_ttft_s']:.3f} | {r['token_slo_attainment']:.3f}"
            f" | {r['token_hit_rate']:.3f} | {comps} | {r['splits']} / {r['merges']}"
            f" | {r['reshapes']} |"
        )
        for ph in r.get("phases", []):
            lines.append(
                f"| · phase {ph['phase']} ({ph['start_s'] / 60:.0f}–{ph['end_s'] / 60:.0f} min) "
                f"| {ph['mean_ttft_s']:.3f} | {ph['p50_ttft_s']:.3f} | {ph['p90_ttft_s']:.3f}"
                f" | {ph['p99_ttft_s']:.3f} | {ph['token_slo_attainment']:.3f}"
                f" | {ph['token_hit_rate']:.3f} | {ph['composition']} | | |"
            )
    text = head + "\n".join(lines) + "\n"
    if best:
        text += "\n" + best_fixed_markdown(best)
    return text


def best_fixed_markdown(best: list[dict[str, Any]]) -> str:
    """The section "Against the best fixed composition": the adaptive variants' mean
    TTFT and gap (negative: faster than the best fixed composition)."""
    adaptive = list(
        dict.fromkeys(v["label"] for e in best for v in e["variants"] if v.get("adaptive"))
    )
    text = (
        "## Against the best fixed composition\n\n"
        "Per rate and phase, the fixed composition of least mean TTFT (chosen after the "
        "fact), and each adaptive variant's mean TTFT with its gap to it (negative: "
        "faster).\n\n"
    )
    text += "| rate / phase | best fixed | mean (s) |" + "".join(f" {a} |" for a in adaptive)
    text += "\n| --- | --- | ---: |" + " ---: |" * len(adaptive) + "\n"
    for e in best:
        cells = []
        for label in adaptive:
            v = next((v for v in e["variants"] if v["label"] == label), None)
            cells.append("–" if v is None else f"{v['mean_ttft_s']:.3f} ({v['gap_pct']:+.1f} %)")
        text += (
            f"| {_scope(e)} | {e['best_fixed']['label']} | {e['best_fixed']['mean_ttft_s']:.3f} |"
            + "".join(f" {c} |" for c in cells)
            + "\n"
        )
    return text


if __name__ == "__main__":
    main()
