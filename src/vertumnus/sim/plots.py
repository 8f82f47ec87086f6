"""The simulator's plots: TTFT and composition over a run (the paper's Fig. 13) with
the decisions that moved the composition marked, and an experiment's comparison.
Written by ``sim/report.py`` and ``tools/experiments/sim_experiment.py``; matplotlib
only here.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vertumnus.policy.control.decision import Decision
from vertumnus.sim.config import SimConfig
from vertumnus.sim.results import SimResult
from vertumnus.stats import percentile


@dataclasses.dataclass(frozen=True)
class Move:
    """A decision that moved the composition: when (its window's end), which way."""

    time_s: float
    kind: str  # "split" | "merge"
    rule: str


def moves(result: SimResult) -> list[Move]:
    """The decisions whose reshapes ran: a rule that is no hold, with operations, in a
    window whose rule as run is neither "fixed" (noted only) nor "end"."""
    decisions: dict[int, Decision] = {d.window: d for d in result.decisions}
    out = []
    for w in result.windows:
        d = decisions.get(w.window)
        if d is None or not d.ops or w.rule.startswith("hold") or w.rule in ("fixed", "end"):
            continue
        kind = w.rule.partition(":")[0]
        if kind not in ("split", "merge"):
            kind = d.ops[0].kind
        out.append(Move(w.end_s, kind, w.rule))
    return out


MOVE_MARKERS = {"split": "^", "merge": "v"}


def plot(result: SimResult, cfg: SimConfig, by_window: dict[int, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = cfg.policy.controller.period_s
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10.5, 5.5), sharex=True)
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
    mark_moves(bottom, moves(result))
    bottom.set(xlabel="time (min)", ylabel="workers")
    # Outside, right: the moves are marked along the top of the panel.
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mark_moves(ax: Any, found: Sequence[Move]) -> None:
    """The moves on a composition panel: a faint vertical line each, and a triangle at
    the top (▲ split, ▼ merge), one colour and one legend entry per rule."""
    if not found:
        return
    transform = ax.get_xaxis_transform()  # x in data, y in axes fractions
    rules = sorted({m.rule for m in found}, key=lambda r: (r.partition(":")[0], r))
    colours = {rule: f"C{(k + 4) % 10}" for k, rule in enumerate(rules)}
    for m in found:
        ax.axvline(m.time_s / 60, color=colours[m.rule], linewidth=0.6, alpha=0.3)
    for rule in rules:
        mine = [m for m in found if m.rule == rule]
        ax.scatter(
            [m.time_s / 60 for m in mine],
            [0.95 for _ in mine],
            transform=transform,
            marker=MOVE_MARKERS.get(mine[0].kind, "o"),
            s=28,
            color=colours[rule],
            label=f"{rule} ({len(mine)})",
            zorder=3,
            clip_on=False,
        )


@dataclasses.dataclass(frozen=True)
class Series:
    """Per window with arrivals: its middle (minutes), the mean TTFT of its arrivals,
    the composition; and the run's moves."""

    minutes: list[float]
    mean_ttft_s: list[float]
    compositions: list[str]
    moves: list[Move]


def window_series(result: SimResult, cfg: SimConfig) -> Series:
    h = cfg.policy.controller.period_s
    sums: dict[int, list[float]] = {}
    for r in result.records:
        if r.end_s is not None:
            sums.setdefault(int(r.arrival_s // h), []).append(r.end_s - r.arrival_s)
    comps = {w.window: w.composition for w in result.windows}
    keys = sorted(sums)
    return Series(
        [(k + 0.5) * h / 60 for k in keys],
        [sum(sums[k]) / len(sums[k]) for k in keys],
        [comps.get(k, "") for k in keys],
        moves(result),
    )


def plot_comparison(
    rows: Sequence[dict[str, Any]], series: dict[str, Series], path: Path, sweep: bool
) -> None:
    """Variants side by side: TTFT over time (one run each), or against the rate. Runs
    without a controller (``adaptive`` false) are thin dashed lines; on the TTFT over
    time, the adaptive runs' moves are triangles on their line (▲ split, ▼ merge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def style(row: dict[str, Any]) -> dict[str, Any]:
        if row.get("adaptive", True):
            return {"linewidth": 1.4}
        return {"linewidth": 0.9, "linestyle": "--", "alpha": 0.75}

    labels = sorted({r["label"] for r in rows}, key=[r["label"] for r in rows].index)
    legend_size = 8 if len(labels) <= 6 else 6.5
    if sweep:
        fig, axes = plt.subplots(1, 3, figsize=(15, 3.8 if len(labels) <= 8 else 4.6))
        for label in labels:
            mine = [r for r in rows if r["label"] == label]
            xs = [r["rate_scale"] for r in mine]
            kw = style(mine[0])
            axes[0].plot(xs, [r["mean_ttft_s"] for r in mine], marker="o", label=label, **kw)
            axes[1].plot(xs, [r["p90_ttft_s"] for r in mine], marker="o", label=label, **kw)
            axes[2].plot(xs, [r["token_hit_rate"] for r in mine], marker="o", label=label, **kw)
        for ax, name in zip(axes, ("mean TTFT (s)", "P90 TTFT (s)", "token hit rate"), strict=True):
            ax.set(xlabel="rate scale", ylabel=name)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        axes[2].legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        fig, (top, bottom) = plt.subplots(
            2, 1, figsize=(12, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
        )
        marked = False
        for r in rows:
            s = series[r["run"]]
            (line,) = top.plot(s.minutes, s.mean_ttft_s, label=r["label"], **style(r))
            if not r.get("adaptive", True) or not s.minutes:
                continue
            for kind, marker in MOVE_MARKERS.items():
                these = [m for m in s.moves if m.kind == kind]
                if these:
                    top.scatter(
                        [m.time_s / 60 for m in these],
                        [_at(s, m.time_s / 60) for m in these],
                        marker=marker,
                        s=22,
                        color=line.get_color(),
                        edgecolors="black",
                        linewidths=0.4,
                        zorder=3,
                    )
                    marked = True
        if marked:  # one legend entry per marker, not per run
            for kind, marker in MOVE_MARKERS.items():
                top.scatter([], [], marker=marker, color="white", edgecolors="black", label=kind)
        top.set(ylabel="mean TTFT (s)", yscale="log")
        top.legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        first = next((r for r in rows if r.get("adaptive")), rows[0])
        s = series[first["run"]]
        degrees = sorted(
            {int(p.split("CP")[1]) for c in s.compositions for p in c.split("/") if "CP" in p}
        )
        for c in degrees:
            counts = []
            for comp in s.compositions:
                parsed = {
                    int(p.split("CP")[1]): int(p.split("CP")[0])
                    for p in comp.split("/")
                    if "CP" in p
                }
                counts.append(parsed.get(c, 0))
            bottom.step(s.minutes, counts, where="mid", label=f"CP{c} workers")
        mark_moves(bottom, s.moves)
        bottom.set(xlabel="time (min)", ylabel=f"workers ({first['label']})")
        bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _at(s: Series, minute: float) -> float:
    """The series' mean TTFT at its window nearest ``minute``."""
    k = bisect.bisect_left(s.minutes, minute)
    near = min(
        (j for j in (k - 1, k) if 0 <= j < len(s.minutes)), key=lambda j: abs(s.minutes[j] - minute)
    )
    return s.mean_ttft_s[near]
