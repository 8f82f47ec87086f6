"""What a simulation run writes: summary, per-request records, timeline, plots.

``DIR/summary.json``   the preset (or the three choices spelled out), counts, TTFT
                       mean and percentiles (linear interpolation), token-weighted
                       SLO attainment, token hit rate, splits and merges with
                       drain and switch times, copies and reclamations,
                       the copies' audit (``cache.audit``: hits, waste fraction),
                       speed, and per-phase figures when the workload has phases
``DIR/requests.jsonl`` one line per request: id, arrival_s, input_tokens,
                       cached_tokens, worker, cp_degree, ttft_s, tau_s
``DIR/timeline.csv``   one row per controller window: arrivals and rate, demand,
                       capacity, composition, long fraction, mean and p90 TTFT of
                       the window's arrivals, the decision's rule
``DIR/decisions.jsonl`` one line per controller decision: ``Decision.to_json()``
                       (rule, ops, demand, capacity and the controller's inputs, e.g.
                       the what-if candidates), its window's end time ``end_s`` and
                       the window's rule as run (``window_rule``: "fixed" for a
                       decision only noted, "end" for the run's last window)
``DIR/scans.jsonl``    one line per cache-manager scan: what it started (copies, blocks,
                       predicted benefit; reclamations, predicted loss; candidates
                       that did not pay) and what its copies then served (hits,
                       blocks used, blocks evicted unused), ``cache.audit.ScanRecord``
``DIR/ttft_composition.png``  TTFT and composition over time (the paper's Fig. 13), the
                       decisions that moved the composition marked (split ▲, merge ▼)
``DIR/report.html``    the run as the server's dashboard draws it (composition with
                       each reshape's rule, inputs and candidates; TTFT against the
                       SLO; rate and attainment; cache; queues), the workers at the
                       end and the summary: one self-contained page (``dashboard.py``)
``DIR/timeline.json``  the samples and events it draws (``policy/timeline.py``)
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

from vertumnus.dashboard import report_html
from vertumnus.policy.geometry import composition_name
from vertumnus.policy.timeline import plain
from vertumnus.sim.config import SimConfig
from vertumnus.sim.plots import plot
from vertumnus.sim.results import RequestRecord, SimResult
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
        "tier_hit_rate": sum(r.tier_tokens for r in done) / tokens if tokens else math.nan,
    }


def summarize(result: SimResult, cfg: SimConfig) -> dict[str, Any]:
    records = result.records
    completed = sum(r.end_s is not None for r in records)
    drains = [r.drain_s for r in result.reshapes if r.drain_s is not None]
    switches = [r.switch_s for r in result.reshapes if r.switch_s is not None]
    summary: dict[str, Any] = {
        "preset": cfg.policy.name,
        "requests": len(records),
        "completed": completed,
        **ttft_stats(records),
        "splits": sum(r.kind == "split" for r in result.reshapes),
        "merges": sum(r.kind == "merge" for r in result.reshapes),
        "reshapes": len(result.reshapes),
        "mean_drain_s": sum(drains) / len(drains) if drains else None,
        "mean_switch_s": sum(switches) / len(switches) if switches else None,
        "copies": result.copies,
        "blocks_copied": result.blocks_copied,
        "reclaims": result.reclaims,
        "copy_waste_fraction": result.cache_audit["all"]["waste_fraction"],
        "cache_audit": result.cache_audit,
        "host_tier": result.host_tier,
        "devices": result.devices,
        "composition_start": composition_name(cfg.composition),
        # "config" (given), or the source of [pool] composition = "auto" (config/start.py)
        "start_source": "config" if cfg.start is None else cfg.start.source,
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
    write_decisions(result, out / "decisions.jsonl")
    with (out / "scans.jsonl").open("wb") as f:
        for record in result.scans:
            f.write(orjson.dumps(record.as_dict()) + b"\n")
    plot(result, cfg, by_window, out / "ttft_composition.png")
    timeline = result.timeline.since()
    (out / "timeline.json").write_bytes(orjson.dumps(timeline))
    title = f"Vertumnus simulation · {cfg.policy.name} · {out.name}"
    page = report_html(title, timeline, result.workers, summary)
    (out / "report.html").write_text(page, encoding="utf-8")
    return summary


def write_decisions(result: SimResult, path: Path) -> None:
    """One JSON line per decision, with its window's end time and rule as run."""
    rows = {w.window: w for w in result.windows}
    with path.open("wb") as f:
        for d in result.decisions:
            row = rows.get(d.window)
            line = {
                **plain(d.to_json()),
                "end_s": row.end_s if row is not None else None,
                "window_rule": row.rule if row is not None else None,
            }
            f.write(orjson.dumps(line) + b"\n")
