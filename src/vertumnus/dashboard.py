"""The dashboard's pages: the server's live ``/dashboard`` and the self-contained
HTML reports of a simulation (``report.html``) and of an experiment's variants.

Every page is the project's own script (``data/dashboard/dashboard.js``) and style
sheet over plotly.js, which the ``plotly`` package ships (``plotly.offline.
get_plotlyjs``): nothing is fetched from outside. The live page loads both scripts
from the server (``LIVE_ASSETS``); a report carries them inline with its data, so it
opens from disk. The data is ``policy/timeline.py``'s samples and events.
"""

from __future__ import annotations

import functools
import html
from importlib import resources
from typing import Any

import orjson

from vertumnus.policy.timeline import plain

# what the live page loads from the server: path under /dashboard/ -> content type
LIVE_ASSETS = {
    "plotly.min.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


@functools.cache
def asset(name: str) -> bytes:
    """The bytes of one of ``LIVE_ASSETS`` (read once)."""
    if name == "plotly.min.js":
        from plotly.offline import get_plotlyjs  # type: ignore[import-untyped]

        script: str = get_plotlyjs()
        return script.encode()
    if name not in LIVE_ASSETS:
        raise KeyError(name)
    return (resources.files("vertumnus") / "data" / "dashboard" / name).read_bytes()


def _page(title: str, head: str, body: str) -> str:
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title>{head}</head>"
        f'<body><div id="app"></div>{body}</body></html>\n'
    )


def live_page(title: str = "Vertumnus", period_ms: int = 1000) -> str:
    """``GET /dashboard``: polls ``/v1/timeline`` every ``period_ms``."""
    options = orjson.dumps({"url": "/v1/timeline", "periodMs": period_ms, "title": title})
    return _page(
        title,
        '<link rel=stylesheet href="/dashboard/dashboard.css">'
        '<script src="/dashboard/plotly.min.js"></script>'
        '<script src="/dashboard/dashboard.js"></script>',
        f"<script>Vertumnus.live(document.getElementById('app'), {options.decode()});</script>",
    )


def _inline(data: Any, call: str, title: str) -> str:
    """A page that opens from disk: both scripts, the style sheet and ``data`` inline."""
    payload = orjson.dumps(plain(data)).decode().replace("</", "<\\/")
    head = (
        f"<style>{asset('dashboard.css').decode()}</style>"
        f"<script>{asset('plotly.min.js').decode()}</script>"
        f"<script>{asset('dashboard.js').decode()}</script>"
    )
    body = (
        f'<script type="application/json" id="data">{payload}</script>'
        "<script>Vertumnus."
        f"{call}(document.getElementById('app'), "
        "JSON.parse(document.getElementById('data').textContent));</script>"
    )
    return _page(title, head, body)


def report_html(
    title: str,
    timeline: dict[str, Any],
    workers: list[dict[str, Any]],
    summary: dict[str, Any],
) -> str:
    """One run: ``timeline`` is ``Timeline.since()``; ``workers`` at the run's end."""
    samples = timeline["samples"]
    data = {
        "title": title,
        "samples": samples,
        "events": timeline["events"],
        "workers": workers,
        "summary": summary,
        "window_s": timeline.get("window_s"),
        "composition": samples[-1]["composition"] if samples else None,
    }
    return _inline(data, "report", title)


def comparison_html(
    title: str,
    columns: list[str],
    runs: list[dict[str, Any]],
    variants: list[dict[str, Any]],
) -> str:
    """Several runs: a table of every run (``{"name", "summary"}``, the summary's
    ``columns``), and over time the ``variants`` (``{"name", "samples", "events"}``)."""
    data = {"title": title, "columns": columns, "runs": runs, "variants": variants}
    return _inline(data, "compare", title)
