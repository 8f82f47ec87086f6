"""The live dashboard's routes, and the sampler that feeds its timeline.

    GET /dashboard                the page (``dashboard.live_page``): it polls
                                  /v1/timeline every second
    GET /dashboard/{asset}        its script, style sheet and plotly.js, served from
                                  the installed packages (nothing from outside)
    GET /v1/timeline?since=T      the samples and reshape events after T (seconds
                                  since the server started; none: every one kept),
                                  with the workers, composition and epoch now,
                                  and the host tier's use (``host_tier``)

The page and its assets hold no data and are open; ``/v1/timeline`` follows the rule
of the rest of ``/v1`` (the API key when one is set: the page asks for it). The
sampler closes one sample of ``coord.metrics.timeline`` every ``[server]
timeline_s``, reading the policy on the event loop (a few microseconds per worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from vertumnus.dashboard import LIVE_ASSETS, asset, live_page
from vertumnus.http_json import error_response, json_response
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.server.keys import COORDINATOR

log = structlog.get_logger("vertumnus")


async def dashboard(request: web.Request) -> web.Response:
    coord: Coordinator = request.app[COORDINATOR]
    period_ms = max(250, int(coord.cfg.timeline_s * 1000))
    return web.Response(
        text=live_page(f"Vertumnus · {coord.cfg.model}", period_ms),
        content_type="text/html",
        headers={"Cache-Control": "no-cache"},
    )


async def dashboard_asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    if name not in LIVE_ASSETS:
        return error_response(404, f"no dashboard asset {name!r}", "not_found")
    body = await asyncio.get_running_loop().run_in_executor(None, asset, name)
    return web.Response(
        body=body,
        headers={"Content-Type": LIVE_ASSETS[name], "Cache-Control": "public, max-age=3600"},
    )


async def timeline(request: web.Request) -> web.Response:
    coord: Coordinator = request.app[COORDINATOR]
    raw = request.query.get("since")
    since = None
    if raw is not None:
        try:
            since = float(raw)
        except ValueError:
            since = math.nan
        if not math.isfinite(since):
            return error_response(
                400, f"'since' must be a number of seconds, not {raw!r}", "invalid_request"
            )
    metrics = coord.metrics
    body = metrics.timeline.since(since)
    view = coord.composition_view()
    body.update(
        started_unix=metrics.started_unix,
        now=round(coord.clock() - metrics.timeline.origin_s, 3),
        composition=view["composition"],
        epoch=view["epoch"],
        degrees=view["degrees"],
        workers=coord.workers_view(),
        slo=coord.cfg.slo.describe(),  # [server] slo: "5x" is 5x the isolated prefill
        host_tier=coord.tier_view(),  # the host tier's use (None: no tier)
    )
    return json_response(body)


async def sampler(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: one sample per period while the app runs."""
    coord = app[COORDINATOR]
    line = coord.metrics.timeline

    async def run() -> None:
        while True:
            await asyncio.sleep(max(0.0, line.next_s - coord.clock()))
            try:
                line.sample(coord.clock(), coord.policy)
            except Exception as exc:  # a bug here must not stop the server's work
                log.error("timeline_sample_failed", error=repr(exc))
                line.next_s = coord.clock() + line.period_s

    task = asyncio.create_task(run(), name="vertumnus-timeline")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


ROUTES = [
    web.get("/dashboard", dashboard),
    web.get("/dashboard/{asset}", dashboard_asset),
    web.get("/v1/timeline", timeline),
]
