"""Write the Grafana dashboard over the pool's Prometheus metrics.

    .venv/bin/python -m tools.gen.grafana_dashboard [--out configs/grafana/vertumnus.json]

The dashboard (Grafana's JSON model, schema 39) asks for its Prometheus data source
on import (``__inputs``: ``DS_PROMETHEUS``) and has a ``job`` variable. Rows: the
composition (workers per degree and state), request rate and TTFT percentiles
against their parts (queue, prefill), the workers' queues and outstanding work,
reshapes (count, drain, switch), the prefix cache (token hit rate, replications,
copied blocks, reclamations, copy time) and the KV hand-off to decode servers.
Every series is one of ``runtime/metrics.py``'s (a test checks each name against a
live registry, and that this file is what the committed JSON holds). How to import
it: ``docs/api.md``, "Grafana".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "vertumnus.json"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SEL = '{job=~"$job"}'
RATE = "$__rate_interval"


def q(expr: str, legend: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ""}


def quantiles(metric: str, what: str) -> list[dict[str, Any]]:
    return [
        q(
            f"histogram_quantile({p}, sum by (le) (rate({metric}_bucket{SEL}[{RATE}])))",
            f"{what} P{int(p * 100)}",
        )
        for p in (0.5, 0.9, 0.99)
    ]


def panel(
    title: str,
    targets: list[dict[str, Any]],
    unit: str = "short",
    kind: str = "timeseries",
    stack: bool = False,
    description: str = "",
) -> dict[str, Any]:
    for i, target in enumerate(targets):
        target["refId"] = chr(ord("A") + i)
    custom: dict[str, Any] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if stack:
        custom.update(stacking={"mode": "normal", "group": "A"}, fillOpacity=60)
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout() -> list[dict[str, Any]]:
    """Rows and panels, top to bottom (two panels a line)."""
    return [
        row("Composition and load"),
        panel(
            "Workers per degree",
            [
                q(
                    'sum by (cp_degree) (vertumnus_workers{job=~"$job",state="active"})',
                    "CP{{cp_degree}}",
                ),
                q('sum(vertumnus_workers{job=~"$job",state!="active"})', "reshaping or out"),
            ],
            stack=True,
            description="Active workers of each CP degree, stacked; reshaping ones apart.",
        ),
        panel(
            "Requests per second, by degree",
            [
                q(
                    f"sum by (cp_degree) (rate(vertumnus_requests_total{SEL}[{RATE}]))",
                    "CP{{cp_degree}}",
                )
            ],
            unit="reqps",
            stack=True,
        ),
        panel("Time to first token", quantiles("vertumnus_ttft_seconds", "TTFT"), unit="s"),
        panel(
            "Queue and prefill time",
            quantiles("vertumnus_queue_seconds", "queue")
            + quantiles("vertumnus_prefill_seconds", "prefill"),
            unit="s",
        ),
        row("Workers"),
        panel(
            "Queued requests, per worker",
            [q(f"vertumnus_worker_queue_depth{SEL}", "worker {{worker}}")],
        ),
        panel(
            "Predicted work outstanding, per worker",
            [q(f"vertumnus_worker_outstanding_seconds{SEL}", "worker {{worker}}")],
            unit="s",
        ),
        row("Reshapes"),
        panel(
            "Splits and merges",
            [
                q(
                    f"sum by (kind) (increase(vertumnus_reconfigurations_total{SEL}[{RATE}]))",
                    "{{kind}}",
                )
            ],
        ),
        panel(
            "Drain and switch time",
            quantiles("vertumnus_drain_seconds", "drain")[1:2]
            + quantiles("vertumnus_switch_seconds", "switch")[1:2],
            unit="s",
        ),
        row("Prefix cache"),
        panel(
            "Token hit rate",
            [
                q(
                    f"sum(rate(vertumnus_cached_tokens_total{SEL}[{RATE}])) / "
                    f"(sum(rate(vertumnus_cached_tokens_total{SEL}[{RATE}])) + "
                    f"sum(rate(vertumnus_computed_tokens_total{SEL}[{RATE}])))",
                    "hit rate",
                )
            ],
            unit="percentunit",
        ),
        panel(
            "Replications, copied blocks and reclamations",
            [
                q(f"sum(rate(vertumnus_replications_total{SEL}[{RATE}]))", "replications / s"),
                q(f"sum(rate(vertumnus_copied_blocks_total{SEL}[{RATE}]))", "blocks copied / s"),
                q(f"sum(rate(vertumnus_reclamations_total{SEL}[{RATE}]))", "reclamations / s"),
                q(
                    f"sum(increase(vertumnus_worker_restarts_total{SEL}[{RATE}]))",
                    "worker restarts",
                ),
            ],
        ),
        panel("KV copy time", quantiles("vertumnus_copy_seconds", "copy"), unit="s"),
        row("KV hand-off to decode servers"),
        panel(
            "Leases and how they ended",
            [
                q(f"sum(vertumnus_handoff_leases{SEL})", "open"),
                q(
                    f"sum by (why) (rate(vertumnus_handoff_ended_total{SEL}[{RATE}]))",
                    "{{why}} / s",
                ),
            ],
        ),
        panel(
            "Hand-off bytes pulled",
            [q(f"sum(rate(vertumnus_handoff_bytes_total{SEL}[{RATE}]))", "bytes / s")],
            unit="Bps",
        ),
        panel(
            "Pull time, first byte to last",
            quantiles("vertumnus_handoff_seconds", "pull"),
            unit="s",
        ),
    ]


def dashboard() -> dict[str, Any]:
    panels, x, y, ident = [], 0, 0, 1
    for item in layout():
        item["id"] = ident
        ident += 1
        if item["type"] == "row":
            y += 0 if x == 0 else 8
            item["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            x, y = 0, y + 1
        else:
            item["gridPos"] = {"h": 8, "w": 12, "x": x, "y": y}
            x, y = (12, y) if x == 0 else (0, y + 8)
        panels.append(item)
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "description": "The Prometheus that scrapes the pool's /metrics",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
        ],
        "title": "Vertumnus prefill pool",
        "uid": "vertumnus-pool",
        "description": (
            "The prefill pool's composition, latency, workers, reshapes, cache and KV hand-off"
        ),
        "tags": ["vertumnus", "llm", "prefill"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "templating": {
            "list": [
                {
                    "name": "job",
                    "label": "job",
                    "type": "query",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(vertumnus_ttft_seconds_count, job)",
                        "refId": "job",
                    },
                    "definition": "label_values(vertumnus_ttft_seconds_count, job)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {},
                    "refresh": 2,
                    "sort": 1,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
        "version": 1,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
