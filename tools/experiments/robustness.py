"""The robustness suite: randomized scenarios, the adaptive pool against every baseline.

    .venv/bin/python -m tools.experiments.robustness [--seeds report|tune|all|100,103,110-119]
        [--jobs N] [--out results/robustness] [--duration-scale X] [--only vertumnus]
        [--set controller.KEY=VALUE ...] [--tag NAME]

Per scenario (``vertumnus.sim.scenarios``: 60 report seeds, 16 tune seeds, apart) it
runs (a) ``fixed`` at every composition of the lattice (among them hold-the-start,
``fixed`` at each start), (b) ``vertumnus`` from each of the scenario's three starts
and (c) each peer router at the fixed pool's ``PEER_COMPOSITIONS`` best compositions:
15 runs on 40 GPUs. Runs go to ``--jobs`` processes (spawn). A baseline (a, c) holds
its composition, so its controller only notes decisions: it runs the rules
controller, which notes them cheaply (the what-if replays would not change what it
serves). Baselines do not depend on the controller, so each is kept in
``OUT/cache/<key>.json``, the key a hash of the scenario's parameters, the run's
label and ``BASELINE_VERSION`` (bump it when the simulator or the fixed pool's
scheduler changes; ``PEER_VERSION`` when a peer router does: a peer's key holds both;
the pilots that set each scenario's rates are kept under ``PILOT_VERSION``, so
that a bump reruns the same workloads); the ``vertumnus`` runs are run every time. ``--only
vertumnus`` runs nothing else: a scenario whose baselines are not all cached is
left out (and named). ``--duration-scale`` shrinks every scenario's timeline
(rates, gaps and load kept) for a quick run. ``--set TABLE.KEY=VALUE`` lays a
setting over the adaptive runs only (a choice weighed side by side against the
default, the baselines unchanged), and ``--tag NAME`` writes that run's report as
``robustness-NAME.*`` beside the default's.

Per scenario and start it compares vertumnus's mean TTFT with hold-the-start's
(and the P90s), with the best fixed composition's and the best peer's
(router@composition) after the fact, counts the targets (v/hold <= 1.01 and P90
ratio <= 1.03 everywhere; v/best-fixed <= 1.03 in 90 % and <= 1.10 everywhere; v
<= best peer in 95 %) and lists the worst five by v/hold and by v/best-fixed with
the scenario and its moves (time, rule, gain, busy fraction). Writes
``OUT/robustness.json`` (everything, every run) and ``OUT/robustness.md``, and
prints the markdown.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import multiprocessing
import os
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.geometry import composition_name, reachable_compositions
from vertumnus.policy.pool_config import PRESETS
from vertumnus.sim import config as sim_config
from vertumnus.sim import scenarios
from vertumnus.sim.pilot import calibrated
from vertumnus.sim.results import RequestRecord
from vertumnus.sim.scenarios import Scenario
from vertumnus.sim.simulator import Simulation
from vertumnus.sim.workload import SimRequest
from vertumnus.stats import percentile

BASELINE_VERSION = "6"  # 6: each run's TTFT per decision period (5: pulled blocks pinned)
PEER_VERSION = "2"
PILOT_VERSION = "4"  # 4: pulled blocks pinned (3: saturation under the backlog term)
PEERS = ("sglang-cache-aware", "dynamo-kv", "llm-d")
# Each peer runs at the compositions best for the fixed pool (a full sweep of every
# peer at every composition would triple the suite's cost; their routing changes
# little which composition the workload needs).
PEER_COMPOSITIONS = 2
TINY_WORKLOAD = {"seed": 0, "phases": [{"duration_s": 10.0, "rate": 10.0}]}  # (not run)
# The convergence's clock: the controller's default decision period. A pair converges
# at period k when the requests arriving from k * PERIOD_S on are served within
# CONVERGED of the best fixed composition's TTFT for the same requests.
PERIOD_S = ControllerConfig().decision_s
CONVERGED = 1.03
CONVERGE_PERIODS = 6  # the bound (issue 67): converged after at most this many periods


def parse_seeds(text: str) -> list[int]:
    """``report``, ``tune``, ``all`` (tune then report) or ``1,4,10-12``."""
    named = {
        "report": list(scenarios.REPORT_SEEDS),
        "tune": list(scenarios.TUNE_SEEDS),
        "all": [*scenarios.TUNE_SEEDS, *scenarios.REPORT_SEEDS],
    }
    if text in named:
        return named[text]
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def piloted(out: Path, seed: int) -> Scenario:
    """The seed's scenario, its load against the saturation its pilots measured
    (``sim/pilot.py``), the pilots' result kept in the cache."""
    drawn = scenarios.draw(seed)
    path = cache_path(out, {"version": PILOT_VERSION, "pilot": drawn.describe()})
    if path.exists():
        known = orjson.loads(path.read_bytes())
        return calibrated(drawn, known=(known["saturation_rate"], known["composition"]))
    scenario = calibrated(drawn)
    path.write_bytes(orjson.dumps({"saturation_rate": scenario.saturation_rate,
                                   "composition": scenario.saturation_composition}))  # fmt: skip
    return scenario


def run_labels(scenario: Scenario) -> list[tuple[str, str, str]]:
    """(label, preset, composition) of the fixed sweep and the adaptive runs."""
    names = [composition_name(c) for c in reachable_compositions(sim_config.DEFAULT_POOL.lattice)]
    runs = [(f"fixed@{n}", "fixed", n) for n in names]
    return runs + [(f"vertumnus@{s}", "vertumnus", s) for s in scenario.starts]


def peer_labels(entry: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Each peer router at the ``PEER_COMPOSITIONS`` compositions best for the fixed
    pool in this scenario (its fixed sweep must have run)."""
    fixed = [
        (r["mean_ttft_s"], r["composition_start"])
        for r in entry["runs"].values()
        if r["preset"] == "fixed" and r["mean_ttft_s"] is not None
    ]
    best = [c for _, c in sorted(fixed)[:PEER_COMPOSITIONS]]
    return [(f"{peer}@{n}", peer, n) for peer in PEERS for n in best]


def cache_key(scenario: Scenario, label: str) -> dict[str, Any]:
    # (a peer runs on the simulator and the shared stack too: both versions)
    peer = label.partition("@")[0] in PEERS
    version = f"{BASELINE_VERSION}.{PEER_VERSION}" if peer else BASELINE_VERSION
    return {"version": version, "scenario": scenario.describe(), "label": label}


def cache_path(out: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(orjson.dumps(key, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return out / "cache" / f"{digest[:24]}.json"


def cached_row(path: Path) -> dict[str, Any]:
    """A baseline's row from the cache (a row kept before its preset was named
    ``preset`` names it ``policy``)."""
    row = orjson.loads(path.read_bytes())["row"]
    return {("preset" if k == "policy" else k): v for k, v in row.items()}


@functools.lru_cache(maxsize=4)
def _requests(scenario: Scenario) -> list[SimRequest]:
    return scenarios.requests(scenario)


Overrides = dict[str, dict[str, Any]]  # table -> key -> value


def configured(
    scenario: Scenario, preset: str, composition: str, overrides: Overrides | None = None
) -> tuple[sim_config.SimConfig, list[SimRequest]]:
    """One run's configuration (``preset`` at ``composition``, with ``overrides``
    laid over it) and the scenario's requests."""
    tables: dict[str, Any] = {"pool": {"composition": composition}, "sim": {"seed": scenario.seed}}
    if not PRESETS[preset]["adaptive"]:
        # (only noted: the same run, 1.5-2x faster; tests/sim/test_robustness_tool.py)
        tables["controller"] = {"mode": "rules"}
    for table, values in (overrides or {}).items():
        tables[table] = {**tables.get(table, {}), **values}
    cfg = sim_config.load(None, tables, raw={"workload": TINY_WORKLOAD}, preset=preset)
    return cfg, _requests(scenario)


def parse_set(items: Sequence[str]) -> Overrides:
    """``TABLE.KEY=VALUE`` items (the value as TOML reads it) as overrides."""
    out: Overrides = {}
    for item in items:
        name, eq, value = item.partition("=")
        table, dot, key = name.partition(".")
        if not (eq and dot and table and key):
            raise SystemExit(f"--set wants TABLE.KEY=VALUE, got {item!r}")
        out.setdefault(table, {})[key] = tomllib.loads(f"v = {value}")["v"]
    return out


def simulate(
    scenario: Scenario, preset: str, composition: str, overrides: Overrides | None = None
) -> dict[str, Any]:
    """One run: its figures, and for an adaptive run its moves."""
    cfg, reqs = configured(scenario, preset, composition, overrides)
    result = Simulation(cfg.settings, cfg.profile, cfg.spec, cfg.policy, reqs).run()
    ttfts = [t for r in result.records if (t := r.ttft_s) is not None]
    tokens = sum(r.input_tokens for r in result.records if r.end_s is not None)
    rows = {w.window: w for w in result.windows}
    moves = [  # the decisions that began reshapes (not those noted at the end, or fixed)
        {
            "time_s": rows[d.window].end_s,
            "kinds": [op.kind for op in d.ops],
            "rule": d.rule,
            "gain": d.inputs.get("gain"),
            "busy_fraction": d.inputs.get("busy_fraction"),
            "chosen": d.inputs.get("chosen"),
        }
        for d in result.decisions
        if d.ops and d.window in rows and rows[d.window].rule not in ("end", "fixed")
    ]
    audits = [  # every move's audit (the what-if controller's, policy/control/audit.py)
        {k: a[k] for k in ("at_s", "move", "band", "predicted_s", "replayed_s",
                           "measured_s", "replayed_hold_s", "vs_hold", "overlapped")}
        for d in result.decisions
        for a in d.inputs.get("move_audits", ())
    ]  # fmt: skip
    return {
        "preset": preset,
        "composition_start": composition,
        "audits": audits,
        "composition_end": result.windows[-1].composition if result.windows else composition,
        "requests": len(result.records),
        "completed": len(ttfts),
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "p90_ttft_s": percentile(ttfts, 90) if ttfts else None,
        "p99_ttft_s": percentile(ttfts, 99) if ttfts else None,
        "token_slo_attainment": (
            sum(
                r.input_tokens
                for r in result.records
                if r.ttft_s is not None and r.ttft_s <= r.tau_s
            )
            / tokens
            if tokens
            else None
        ),
        "token_hit_rate": (
            sum(r.cached_tokens for r in result.records if r.end_s is not None) / tokens
            if tokens
            else None
        ),
        "reshapes": len(result.reshapes),
        "moves": moves,
        "period_ttft": period_ttft(result.records, PERIOD_S),
        "wall_s": result.wall_s,
    }


def period_ttft(records: Sequence[RequestRecord], period_s: float) -> list[list[float]]:
    """Per period of ``period_s`` by arrival: [requests answered, the sum of their
    TTFTs] (a request never answered is in neither)."""
    out: list[list[float]] = []
    for r in records:
        if (ttft := r.ttft_s) is None:
            continue
        k = max(0, int(r.arrival_s // period_s))
        while len(out) <= k:
            out.append([0, 0.0])
        out[k][0] += 1
        out[k][1] += ttft
    return out


def converged_period(
    mine: Sequence[Sequence[float]], best: Sequence[Sequence[float]], bound: float = CONVERGED
) -> int | None:
    """The first period k such that the requests arriving from period k on are served
    within ``bound`` of ``best``'s mean TTFT for the same periods (``period_ttft``
    rows of two runs of one trace); None: never, or no rows."""
    n_mine = s_mine = n_best = s_best = 0.0
    first: int | None = None
    for k in range(max(len(mine), len(best)) - 1, -1, -1):  # the suffixes, shortest first
        a = mine[k] if k < len(mine) else (0, 0.0)
        b = best[k] if k < len(best) else (0, 0.0)
        n_mine, s_mine, n_best, s_best = n_mine + a[0], s_mine + a[1], n_best + b[0], s_best + b[1]
        if n_mine > 0 and n_best > 0 and s_mine / n_mine <= bound * s_best / n_best:
            first = k
    return first


Job = tuple[int, Scenario, str, str, str, Overrides]


def _task(job: Job) -> tuple[int, str, dict[str, Any]]:
    index, scenario, label, preset, composition, overrides = job
    return index, label, simulate(scenario, preset, composition, overrides)


Done = Callable[[int, str, dict[str, Any]], None]


def run_all(todo: list[Job], jobs: int, echo: bool, done_fn: Done) -> None:
    """Every job, in ``jobs`` processes (spawn; 1: here); ``done_fn`` gets each as it
    finishes (so that an interrupted suite keeps what it ran)."""
    done: list[tuple[int, str, dict[str, Any]]] = []
    started = time.perf_counter()
    left = Counter(job[1].seed for job in todo)
    busy_s: Counter[int] = Counter()

    def note(item: tuple[int, str, dict[str, Any]]) -> None:
        done.append(item)
        index, label, row = item
        done_fn(index, label, row)
        seed = todo[index][1].seed
        left[seed] -= 1
        busy_s[seed] += row["wall_s"]
        if echo:
            mean = "-" if row["mean_ttft_s"] is None else f"{row['mean_ttft_s']:.3f}"
            print(
                f"[{len(done)}/{len(todo)} {time.perf_counter() - started:6.0f} s] seed {seed}"
                f" {label:<32} mean {mean} s ({row['wall_s']:.1f} s)"
                + (f"; seed {seed} done, {busy_s[seed]:.0f} s of runs" if not left[seed] else ""),
                file=sys.stderr,
                flush=True,
            )

    if jobs <= 1 or len(todo) <= 1:
        for job in todo:
            note(_task(job))
        return
    # The children import this module as tools.experiments.robustness: spawn gives them
    # this process's sys.path, on which the repository root is.
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(jobs, len(todo))) as pool:
        # The largest scenarios first (fewer idle processes at the end).
        ordered = sorted(todo, key=lambda job: -job[1].mean_rate * job[1].duration_s)
        for item in pool.imap_unordered(_task, ordered):
            note(item)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b <= 0:
        return None
    return a / b


def compare(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Per start of one scenario: vertumnus against hold, best fixed and best peer."""
    runs = entry["runs"]
    fixed = [(k, r) for k, r in runs.items() if r["preset"] == "fixed" and r["mean_ttft_s"]]
    peers = [(k, r) for k, r in runs.items() if r["preset"] in PEERS and r["mean_ttft_s"]]
    best_fixed = min(fixed, key=lambda kr: kr[1]["mean_ttft_s"], default=None)
    best_peer = min(peers, key=lambda kr: kr[1]["mean_ttft_s"], default=None)
    out = []
    for start in entry["scenario"]["starts"]:
        v, hold = runs.get(f"vertumnus@{start}"), runs.get(f"fixed@{start}")
        if v is None or hold is None:
            continue
        bf = best_fixed[1]["mean_ttft_s"] if best_fixed else None
        bp = best_peer[1]["mean_ttft_s"] if best_peer else None
        converged = None
        if best_fixed is not None and "period_ttft" in v and "period_ttft" in best_fixed[1]:
            converged = converged_period(v["period_ttft"], best_fixed[1]["period_ttft"])
        out.append(
            {
                "seed": entry["scenario"]["seed"],
                "start": start,
                "vertumnus_mean_s": v["mean_ttft_s"],
                "vertumnus_p90_s": v["p90_ttft_s"],
                "hold_mean_s": hold["mean_ttft_s"],
                "hold_p90_s": hold["p90_ttft_s"],
                "best_fixed": best_fixed[0] if best_fixed else None,
                "best_fixed_mean_s": bf,
                "best_peer": best_peer[0] if best_peer else None,
                "best_peer_mean_s": bp,
                "v_hold": ratio(v["mean_ttft_s"], hold["mean_ttft_s"]),
                "v_hold_p90": ratio(v["p90_ttft_s"], hold["p90_ttft_s"]),
                "v_best_fixed": ratio(v["mean_ttft_s"], bf),
                "v_best_peer": ratio(v["mean_ttft_s"], bp),
                "hold_best_fixed": ratio(hold["mean_ttft_s"], bf),
                "shape": entry["scenario"]["shape"],
                # the first decision period from which on it serves within CONVERGED of
                # the best fixed composition (None: never)
                "converged_period": converged,
                "reshapes": v["reshapes"],
                "composition_end": v["composition_end"],
                "moves": v["moves"],
                "audits": v.get("audits", []),
            }
        )
    return out


def audit_summary(pairs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The move audits of every adaptive run (``policy/control/audit.py``), those no other
    move overlapped, per load band and in all: how far the transition's predicted mean
    TTFT (at the decision, from the forecast) and its replay on the arrivals that came
    were from the measured one, and the share within 25 %."""
    audits = [a for p in pairs for a in p["audits"] if not a["overlapped"] and a["measured_s"]]
    out: dict[str, dict[str, Any]] = {}
    for band in ("all", "light", "loaded", "saturated"):
        mine = [a for a in audits if band == "all" or a["band"] == band]
        if not mine:
            continue
        forecast = [abs(a["predicted_s"] / a["measured_s"] - 1) for a in mine]
        replayed = [abs(a["replayed_s"] / a["measured_s"] - 1) for a in mine]
        out[band] = {
            "audits": len(mine),
            "predicted_error_median": percentile(forecast, 50),
            "predicted_within_25pct": sum(e <= 0.25 for e in forecast) / len(mine),
            "replayed_error_median": percentile(replayed, 50),
            "replayed_within_25pct": sum(e <= 0.25 for e in replayed) / len(mine),
            "vs_hold_median": percentile([a["vs_hold"] for a in mine], 50),
        }
    return out


RATIOS = ("v_hold", "v_hold_p90", "v_best_fixed", "v_best_peer")


QUANTILES = {"min": 0, "median": 50, "p90": 90, "max": 100}


def distribution(pairs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per ratio: min, median, p90, max over the pairs that have it."""
    out: dict[str, dict[str, float | None]] = {}
    for key in RATIOS:
        values = [p[key] for p in pairs if p[key] is not None]
        out[key] = {q: percentile(values, v) if values else None for q, v in QUANTILES.items()}
    return out


def far_steady(pairs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pairs the convergence target counts: a steady scenario, a start over 1.10
    of the best fixed composition."""
    return [
        p for p in pairs if p.get("shape") == "steady" and (p.get("hold_best_fixed") or 0.0) > 1.10
    ]


def _late(pair: dict[str, Any]) -> float:
    """The pair's convergence period (inf: never)."""
    k = pair.get("converged_period")
    return math.inf if k is None else k


def targets(pairs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """(what, the pairs meeting it, the pairs it applies to, the share it needs):
    issue 67's targets. The convergence applies to the steady scenarios whose start
    is more than 10 % worse than the best fixed composition."""

    def share(key: str, bound: float, among: Sequence[dict[str, Any]] = pairs) -> tuple[int, int]:
        values = [p[key] for p in among if p[key] is not None]
        return sum(v <= bound for v in values), len(values)

    near = [
        p for p in pairs if p.get("hold_best_fixed") is not None and p["hold_best_fixed"] <= 1.10
    ]
    late = [_late(p) for p in far_steady(pairs)]
    rows = []
    for what, (met, total), needed in (
        ("v/hold mean <= 1.01", share("v_hold", 1.01), 1.0),
        ("v/hold P90 <= 1.03", share("v_hold_p90", 1.03), 1.0),
        ("v/best fixed <= 1.03", share("v_best_fixed", 1.03), 0.85),
        ("v/best fixed <= 1.10, start within 1.10", share("v_best_fixed", 1.10, near), 1.0),
        ("v <= best peer", share("v_best_peer", 1.0), 0.90),
        (
            f"converged in <= {CONVERGE_PERIODS} periods, steady, start over 1.10",
            (sum(k <= CONVERGE_PERIODS for k in late), len(late)),
            0.90,
        ),
    ):
        rows.append(
            {
                "target": what,
                "met": met,
                "total": total,
                "needed_share": needed,
                "ok": total > 0 and met >= math.ceil(needed * total - 1e-9),
            }
        )
    return rows


def worst(pairs: Sequence[dict[str, Any]], key: str, n: int = 5) -> list[dict[str, Any]]:
    return sorted((p for p in pairs if p[key] is not None), key=lambda p: -p[key])[:n]


def _f(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _digits(key: str) -> int:
    return {"requests": 0, "duration_min": 1}.get(key, 2)


def _moves_text(moves: Sequence[dict[str, Any]], limit: int = 12) -> str:
    parts = [
        f"{_f(m['time_s'], 0)} s {m['rule']} (gain {_f(m['gain'])}, busy "
        f"{_f(m['busy_fraction'], 2)}, to {m['chosen']})"
        for m in moves[:limit]
    ]
    more = f"; … {len(moves) - limit} more" if len(moves) > limit else ""
    return ("; ".join(parts) + more) or "none"


def _scenario_text(s: dict[str, Any], realised: dict[str, float]) -> str:
    return (
        f"{s['reuse']['family']}, {s['shape']}, {s['duration_s'] / 60:.1f} min, load "
        f"{realised['load']:.2f} of {s['saturation_rate']:.1f} req/s, reuse "
        f"{realised['token_reuse']:.2f}, long {realised['long_share']:.2f}, rates "
        f"{s['base_rate']:.1f}→{s['second_rate']:.1f} req/s"
    )


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def markdown(report: dict[str, Any]) -> str:
    pairs, entries = report["pairs"], {e["scenario"]["seed"]: e for e in report["scenarios"]}
    runs, ranges = report["runs"], report["realised_ranges"]
    lines = [
        f"# Robustness: {len(entries)} scenarios × 3 starts ({len(pairs)} pairs)\n",
        f"Seeds {report['seeds_text']}, duration scale {report['duration_scale']:g}, baselines"
        f" v{BASELINE_VERSION} (peers v{PEER_VERSION}): {runs['cached']} cached,"
        f" {runs['ran']} run; wall"
        f" {report['wall_s']:.0f} s."
        + "".join(
            f" Adaptive runs with {t}.{k} = {v!r}."
            for t, kv in report.get("overrides", {}).items()
            for k, v in kv.items()
        )
        + " Realised: "
        + ", ".join(
            f"{k} {_f(v['min'], _digits(k))}–{_f(v['max'], _digits(k))}" for k, v in ranges.items()
        )
        + ".\n",
    ]
    if report["left_out"]:
        lines.append(f"Left out (baselines not cached): seeds {report['left_out']}.\n")
    goals = [
        (t["target"], t["met"], t["total"], f"{t['needed_share']:.0%}", t["ok"])
        for t in report["targets"]
    ]
    quantiles = [(k, *(_f(d[q]) for q in QUANTILES)) for k, d in report["distribution"].items()]
    lines += ["## Targets\n", *_table(("target", "met", "of", "needed", "ok"), goals)]
    lines += ["\n## Ratios\n", *_table(("ratio", *QUANTILES), quantiles)]
    head_a = ("band", "audits", "predicted: median error", "within 25 %", "replayed: median error")
    audit_rows = [
        (band, a["audits"], _f(a["predicted_error_median"]), f"{a['predicted_within_25pct']:.0%}",
         _f(a["replayed_error_median"]), f"{a['replayed_within_25pct']:.0%}")
        for band, a in report["audits"].items()
    ]  # fmt: skip
    lines += ["\n## Move audits: the transition's mean TTFT, predicted against measured\n"]
    lines += _table((*head_a, "within 25 %"), audit_rows)
    for title, key in (("vertumnus / hold", "v_hold"), ("vertumnus / best fixed", "v_best_fixed")):
        lines.append(f"\n## Worst five by {title}\n")
        for p in worst(pairs, key):
            e = entries[p["seed"]]
            lines += [
                f"- **seed {p['seed']} from {p['start']}**: {key} {_f(p[key])}; v"
                f" {_f(p['vertumnus_mean_s'])} s, hold {_f(p['hold_mean_s'])} s, best fixed"
                f" {p['best_fixed']} {_f(p['best_fixed_mean_s'])} s, best peer {p['best_peer']}"
                f" {_f(p['best_peer_mean_s'])} s; ends at {p['composition_end']}",
                f"  - scenario: {_scenario_text(e['scenario'], e['realised'])}",
                f"  - moves: {_moves_text(p['moves'])}",
            ]
    slow = sorted(far_steady(pairs), key=lambda p: -_late(p))
    lines.append(
        f"\n## Convergence: steady scenarios whose start is over 1.10 of the best fixed\n\n"
        f"The first decision period ({PERIOD_S:g} s) from which on the requests arriving are"
        f" served within {CONVERGED} of the best fixed composition's TTFT for them (never:"
        f" –), slowest first.\n"
    )
    lines += _table(
        ("seed", "start", "hold / best fixed", "v / best fixed", "first move at period",
         "converged at period", "moves"),
        [
            (p["seed"], p["start"], _f(p["hold_best_fixed"]), _f(p["v_best_fixed"]),
             f"{p['moves'][0]['time_s'] / PERIOD_S:g}" if p["moves"] else "–",
             "–" if p["converged_period"] is None else p["converged_period"],
             _moves_text(p["moves"], limit=4))
            for p in slow
        ],
    )  # fmt: skip
    head = ["seed", "scenario", "start", "v mean", "hold", "best fixed", "best peer", "v/hold"]
    head += ["v/hold P90", "v/fixed", "v/peer", "converged at", "reshapes", "end"]
    rows = [
        (
            p["seed"],
            _scenario_text(entries[p["seed"]]["scenario"], entries[p["seed"]]["realised"]),
            p["start"],
            _f(p["vertumnus_mean_s"]),
            _f(p["hold_mean_s"]),
            f"{p['best_fixed']} {_f(p['best_fixed_mean_s'])}",
            f"{p['best_peer']} {_f(p['best_peer_mean_s'])}",
            *(_f(p[k]) for k in RATIOS),
            "–" if p["converged_period"] is None else p["converged_period"],
            p["reshapes"],
            p["composition_end"],
        )
        for p in pairs
    ]
    lines += ["\n## Every scenario and start\n", *_table(head, rows)]
    return "\n".join(lines) + "\n"


def run_suite(
    seeds: Sequence[int],
    out: Path,
    jobs: int,
    duration_scale: float = 1.0,
    only: str | None = None,
    echo: bool = True,
    seeds_text: str = "",
    overrides: Overrides | None = None,
    tag: str = "",
    peers: bool = True,
) -> dict[str, Any]:
    """Draw, run (the cache's baselines reused), compare, write; returns the report.
    ``overrides`` apply to the adaptive runs only (the baselines stay the cache's);
    ``tag`` names the report's files (``robustness-TAG.json``); ``peers`` false
    leaves the peer routers out (their stage is the longest: the best-peer ratio
    is then blank)."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache").mkdir(exist_ok=True)
    drawn = [scenarios.scaled(piloted(out, seed), duration_scale) for seed in seeds]
    entries: list[dict[str, Any]] = []
    kept: list[Scenario] = []  # the scenarios of ``entries``
    counts = {"cached": 0, "ran": 0}
    left_out: list[int] = []
    for scenario in drawn:
        realised = scenarios.measure(scenario, scenarios.requests(scenario))
        entries.append({"scenario": scenario.describe(), "runs": {}, "realised": realised})
        kept.append(scenario)

    def stage(labels_of: Callable[[Scenario, dict[str, Any]], list[tuple[str, str, str]]]) -> None:
        """Run the labels each scenario still lacks (baselines from the cache)."""
        todo: list[Job] = []
        owner: list[tuple[int, Path | None]] = []  # per job: its entry, its cache file
        for where, (scenario, entry) in enumerate(zip(kept, entries, strict=True)):
            if scenario.seed in left_out:
                continue
            mine = []
            for label, preset, composition in labels_of(scenario, entry):
                if label in entry["runs"]:
                    continue
                key = cache_key(scenario, label)
                path = None if preset == "vertumnus" else cache_path(out, key)
                if path is not None and path.exists():
                    entry["runs"][label] = cached_row(path)
                    counts["cached"] += 1
                elif path is not None and only == "vertumnus":
                    left_out.append(scenario.seed)
                    break
                else:
                    mine.append((label, preset, composition, path))
            else:
                for label, preset, composition, path in mine:
                    owner.append((where, path))
                    mine_overrides = (overrides or {}) if preset == "vertumnus" else {}
                    todo.append((len(todo), scenario, label, preset, composition, mine_overrides))

        def keep(index: int, label: str, row: dict[str, Any]) -> None:
            where, path = owner[index]
            entries[where]["runs"][label] = row
            if path is not None:
                body = orjson.dumps({"key": cache_key(todo[index][1], label), "row": row})
                path.with_suffix(".part").write_bytes(body)
                path.with_suffix(".part").replace(path)  # whole, or not there

        run_all(todo, jobs, echo, keep)
        counts["ran"] += len(todo)

    # First the fixed sweep and the adaptive runs, then each peer at the fixed pool's
    # best compositions (PEER_COMPOSITIONS of them).
    stage(lambda scenario, entry: run_labels(scenario))
    if peers:
        stage(lambda scenario, entry: peer_labels(entry))
    kept_entries = [(e, s) for e, s in zip(entries, kept, strict=True) if s.seed not in left_out]
    entries = [e for e, _ in kept_entries]
    kept = [s for _, s in kept_entries]
    for entry, scenario in zip(entries, kept, strict=True):
        labels = run_labels(scenario) + (peer_labels(entry) if peers else [])
        order = [label for label, _, _ in labels]
        entry["runs"] = {label: entry["runs"][label] for label in order}
        entry["run_wall_s"] = sum(r["wall_s"] for r in entry["runs"].values())
    pairs = [p for e in entries for p in compare(e)]
    realised = [e["realised"] for e in entries]
    ranges = {
        key: {
            "min": min((r[key] for r in realised), default=None),
            "max": max((r[key] for r in realised), default=None),
        }
        for key in ("load", "token_reuse", "long_share", "requests")
    }
    ranges["duration_min"] = {
        "min": min((e["scenario"]["duration_s"] / 60 for e in entries), default=None),
        "max": max((e["scenario"]["duration_s"] / 60 for e in entries), default=None),
    }
    report: dict[str, Any] = {
        "version": BASELINE_VERSION,
        "seeds": list(seeds),
        "seeds_text": seeds_text or ",".join(map(str, seeds)),
        "overrides": overrides or {},
        "duration_scale": duration_scale,
        "runs": dict(counts),
        "left_out": sorted(set(left_out)),
        "wall_s": time.perf_counter() - started,
        "realised_ranges": ranges,
        "targets": targets(pairs),
        "distribution": distribution(pairs),
        "worst": {key: worst(pairs, key) for key in ("v_hold", "v_best_fixed")},
        "audits": audit_summary(pairs),
        "pairs": pairs,
        "scenarios": entries,
    }
    name = f"robustness-{tag}" if tag else "robustness"
    (out / f"{name}.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    text = markdown(report)
    (out / f"{name}.md").write_text(text)
    if echo:
        print(text)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--seeds", default="report", help="report, tune, all or 1,4,10-12")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("results/robustness"))
    parser.add_argument("--duration-scale", type=float, default=1.0)
    parser.add_argument("--only", choices=["vertumnus"], default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="a setting laid over the adaptive runs (repeatable)",
    )
    parser.add_argument("--tag", default="", help="the report's files: robustness-TAG.*")
    parser.add_argument("--no-peers", action="store_true", help="leave the peer routers' stage out")
    args = parser.parse_args(argv)
    run_suite(
        parse_seeds(args.seeds),
        args.out,
        args.jobs,
        args.duration_scale,
        args.only,
        seeds_text=args.seeds,
        overrides=parse_set(args.set),
        tag=args.tag,
        peers=not args.no_peers,
    )


if __name__ == "__main__":
    main()
