"""What a simulation run writes: summary, per-request records, timeline, plots.

``DIR/summary.json``   counts, TTFT mean and percentiles (linear interpolation),
                       token-weighted SLO attainment, token hit rate, splits and
                       merges with drain and switch times, copies and reclamations,
                       speed, and per-phase figures when the workload has phases
``DIR/requests.jsonl`` one line per request: id, arrival_s, input_tokens,
                       cached_tokens, worker, cp_degree, ttft_s, tau_s
``DIR/timeline.csv``   one row per controller window: arrivals and rate, demand,
                       capacity, composition, long fraction, mean and p90 TTFT of
                       the window's arrivals, the decision's rule
``DIR/ttft_composition.png``  TTFT and composition over time (the paper's Fig. 13)
``DIR/config.json``    the configuration the run used
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from vertumnus.policy.lattice import composition_name
from vertumnus.sim.config import SimConfig
from vertumnus.sim.simulator import RequestRecord, SimResult
from vertumnus.stats import percentile


def ttft_stats(records: Sequence[RequestRecord]) -> dict[str, float]:
    done = [r for r in records if r.end_s is not None]
    ttfts = [r.end_s - r.arrival_s for r in done if r.end_s is not None]
    tokens = sum(r.input_tokens for r in done)
    met = sum(r.input_tokens for r, t in zip(done, ttfts, strict=True) if t <= r.tau_s)
    return {
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "p50_ttft_s": percentile(ttfts, 50),
        "p90_ttft_s": percentile(ttfts, 90),
        "p99_ttft_s": percentile(ttfts, 99),
        "token_slo_attainment": met / tokens if tokens else math.nan,
        "token_hit_rate": sum(r.cached_tokens for r in done) / tokens if tokens else math.nan,
    }


def summarize(result: SimResult, cfg: SimConfig) -> dict[str, Any]:
    records = result.records
    completed = sum(r.end_s is not None for r in records)
    drains = [r.drain_s for r in result.reshapes if r.drain_s is not None]
    switches = [r.switch_s for r in result.reshapes if r.switch_s is not None]
    summary: dict[str, Any] = {
        "policy": cfg.policy.name,
        "requests": len(records),
        "completed": completed,
        **ttft_stats(records),
        "splits": sum(r.kind == "split" for r in result.reshapes),
        "merges": sum(r.kind == "merge" for r in result.reshapes),
        "mean_drain_s": sum(drains) / len(drains) if drains else None,
        "mean_switch_s": sum(switches) / len(switches) if switches else None,
        "copies": result.copies,
        "blocks_copied": result.blocks_copied,
        "reclaims": result.reclaims,
        "devices": result.devices,
        "composition_start": composition_name(cfg.composition),
        "composition_end": result.windows[-1].composition if result.windows else None,
        "slo": cfg.settings.slo.describe(),
        "simulated_s": result.sim_end_s,
        "wall_s": result.wall_s,
        "requests_per_wall_s": len(records) / result.wall_s if result.wall_s > 0 else None,
        "seed": cfg.settings.seed,
    }
    if cfg.phase_bounds:
        phases = []
        for k, (start, end) in enumerate(cfg.phase_bounds):
            mine = [r for r in records if r.phase == k]
            comps = Counter(w.composition for w in result.windows if start <= w.start_s < end)
            phases.append(
                {
                    "phase": k,
                    "start_s": start,
                    "end_s": end,
                    "requests": len(mine),
                    **ttft_stats(mine),
                    "composition": comps.most_common(1)[0][0] if comps else None,
                }
            )
        summary["phases"] = phases
    return summary


def write(result: SimResult, cfg: SimConfig, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result, cfg)
    (out / "summary.json").write_bytes(
        orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    with (out / "requests.jsonl").open("wb") as f:
        for r in result.records:
            f.write(
                orjson.dumps(
                    {
                        "id": r.request_id,
                        "arrival_s": r.arrival_s,
                        "input_tokens": r.input_tokens,
                        "cached_tokens": r.cached_tokens,
                        "worker": r.worker,
                        "cp_degree": r.cp_degree,
                        "ttft_s": r.ttft_s,
                        "tau_s": r.tau_s,
                    }
                )
                + b"\n"
            )
    by_window: dict[int, list[float]] = {}
    h = cfg.policy.controller.period_s
    for r in result.records:
        if r.end_s is not None:
            by_window.setdefault(int(r.arrival_s // h), []).append(r.end_s - r.arrival_s)
    with (out / "timeline.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "window",
                "start_s",
                "end_s",
                "arrivals",
                "rate",
                "demand_s",
                "capacity_s",
                "composition",
                "long_fraction",
                "mean_ttft_s",
                "p90_ttft_s",
                "decision",
            ]
        )
        for w in result.windows:
            ttfts = by_window.get(w.window, [])
            writer.writerow(
                [
                    w.window,
                    f"{w.start_s:.3f}",
                    f"{w.end_s:.3f}",
                    w.arrivals,
                    f"{w.arrivals / h:.4f}",
                    f"{w.demand_s:.4f}",
                    f"{w.capacity_s:.4f}",
                    w.composition,
                    f"{w.long_fraction:.4f}",
                    f"{sum(ttfts) / len(ttfts):.4f}" if ttfts else "",
                    f"{percentile(ttfts, 90):.4f}" if ttfts else "",
                    w.rule,
                ]
            )
    (out / "config.json").write_bytes(
        orjson.dumps(
            {**cfg.raw, "resolved": {"profile": str(cfg.profile_path), "layout": cfg.layout}},
            option=orjson.OPT_INDENT_2,
            default=str,
        )
    )
    plot(result, cfg, by_window, out / "ttft_composition.png")
    return summary


def plot(result: SimResult, cfg: SimConfig, by_window: dict[int, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = cfg.policy.controller.period_s
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    xs = [(k + 0.5) * h / 60 for k in sorted(by_window)]
    top.plot(xs, [sum(v) / len(v) for _, v in sorted(by_window.items())], label="mean TTFT")
    top.plot(
        xs, [percentile(v, 90) for _, v in sorted(by_window.items())], label="P90 TTFT", alpha=0.6
    )
    top.set(ylabel="TTFT (s)", yscale="log", title=f"{cfg.policy.name}: TTFT by arrival window")
    top.legend(loc="upper left")
    for start, _ in cfg.phase_bounds[1:]:
        top.axvline(start / 60, color="grey", linewidth=0.8, linestyle=":")
        bottom.axvline(start / 60, color="grey", linewidth=0.8, linestyle=":")
    degrees = cfg.lattice.degrees
    times = [w.end_s / 60 for w in result.windows]
    counts = {c: [] for c in degrees}  # type: dict[int, list[int]]
    for w in result.windows:
        parsed = {
            int(p.split("CP")[1]): int(p.split("CP")[0])
            for p in w.composition.split("/")
            if "CP" in p
        }
        for c in degrees:
            counts[c].append(parsed.get(c, 0))
    for c in degrees:
        bottom.step(times, counts[c], where="post", label=f"CP{c} workers")
    bottom.set(xlabel="time (min)", ylabel="workers")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


Series = tuple[list[float], list[float], list[str]]  # minutes, mean TTFT, composition


def window_series(result: SimResult, cfg: SimConfig) -> Series:
    """Per window: its middle (minutes), the mean TTFT of its arrivals, the composition."""
    h = cfg.policy.controller.period_s
    sums: dict[int, list[float]] = {}
    for r in result.records:
        if r.end_s is not None:
            sums.setdefault(int(r.arrival_s // h), []).append(r.end_s - r.arrival_s)
    comps = {w.window: w.composition for w in result.windows}
    keys = sorted(sums)
    return (
        [(k + 0.5) * h / 60 for k in keys],
        [sum(sums[k]) / len(sums[k]) for k in keys],
        [comps.get(k, "") for k in keys],
    )


def plot_comparison(
    rows: Sequence[dict[str, Any]], series: dict[str, Series], path: Path, sweep: bool
) -> None:
    """Variants side by side: TTFT over time (one run each), or against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if sweep:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        labels = sorted({r["label"] for r in rows}, key=[r["label"] for r in rows].index)
        for label in labels:
            mine = [r for r in rows if r["label"] == label]
            xs = [r["rate_scale"] for r in mine]
            axes[0].plot(xs, [r["mean_ttft_s"] for r in mine], marker="o", label=label)
            axes[1].plot(xs, [r["p90_ttft_s"] for r in mine], marker="o", label=label)
            axes[2].plot(xs, [r["token_hit_rate"] for r in mine], marker="o", label=label)
        for ax, name in zip(axes, ("mean TTFT (s)", "P90 TTFT (s)", "token hit rate"), strict=True):
            ax.set(xlabel="rate scale", ylabel=name)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        axes[0].legend(fontsize=8)
    else:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
        for r in rows:
            xs, ys, _ = series[r["run"]]
            top.plot(xs, ys, label=r["label"], linewidth=1.2)
        top.set(ylabel="mean TTFT (s)", yscale="log")
        top.legend(fontsize=8)
        first = rows[0]
        xs, _, comps = series[first["run"]]
        degrees = sorted({int(p.split("CP")[1]) for c in comps for p in c.split("/") if "CP" in p})
        for c in degrees:
            counts = []
            for comp in comps:
                parsed = {
                    int(p.split("CP")[1]): int(p.split("CP")[0])
                    for p in comp.split("/")
                    if "CP" in p
                }
                counts.append(parsed.get(c, 0))
            bottom.step(xs, counts, where="mid", label=f"CP{c} workers ({first['label']})")
        bottom.set(xlabel="time (min)", ylabel="workers")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
