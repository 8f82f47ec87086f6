"""The pool's own routes: its state, its one admin call, and the probes
(docs/api.md); the served model's routes are ``model_routes.py``.

    GET  /v1/workers            the workers, their state, queue and cache
    GET  /v1/composition        the composition and configuration epoch
    GET  /v1/cache              the trie: nodes, holders per worker, hit rate
    POST /v1/admin/reconfigure  {"op": "split", "worker": W} | {"op": "merge",
                                "workers": [W1, W2]} | {"op": ...} (controller chooses)
    GET  /health  /ready  /metrics  /openapi.json
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from vertumnus.http_json import error_response, json_response
from vertumnus.policy.geometry import LatticeError
from vertumnus.protocol.errors import BadRequest
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.reshaping import ReshapeFailed
from vertumnus.server.keys import COORDINATOR, PROXY
from vertumnus.server.openapi import served_document
from vertumnus.server.request_bodies import read_body


async def workers(request: web.Request) -> web.Response:
    return json_response({"workers": request.app[COORDINATOR].workers_view()})


async def composition(request: web.Request) -> web.Response:
    return json_response(request.app[COORDINATOR].composition_view())


async def cache(request: web.Request) -> web.Response:
    return json_response(request.app[COORDINATOR].cache_view())


async def reconfigure(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    try:
        body = await read_body(request)
        unknown = sorted(set(body) - {"op", "worker", "workers"})
        if unknown:
            raise BadRequest(f"unknown fields {unknown}")
        op_name = body.get("op")
        chosen = body.get("workers") or ([body["worker"]] if "worker" in body else [])
        if not isinstance(chosen, list) or not all(isinstance(w, int) for w in chosen):
            raise BadRequest("'worker' must be an integer and 'workers' a list of integers")
        if not coord.ready:
            return error_response(
                503, coord.rank_error or "the pool is not ready", "unavailable", retry_after_s=1
            )
        op = coord.reshape_for(str(op_name), chosen)
        done = coord.begin_reshape(op)
        timeout_s = coord.cfg.request_timeout_s
        transition = await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request")
    except LatticeError as exc:
        return error_response(409, str(exc), "conflict")
    except TimeoutError:
        message = f"the reshape is not done after [server] request_timeout_s = {timeout_s:g} s"
        return error_response(503, f"unavailable: {message}", "unavailable", retry_after_s=2)
    except (ReshapeFailed, RanksError) as exc:
        return error_response(503, f"unavailable: {exc}", "unavailable", retry_after_s=2)
    return json_response(
        {
            "op": op.kind,
            "sources": list(op.sources),
            "new_workers": transition.new_workers,
            "cp_degree": op.target_degree,
            "epoch": coord.lattice.epoch,
            "drain_s": transition.drain_s,
            "switch_s": transition.switch_s,
            "composition": coord.composition_name(),
        }
    )


async def health(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    return json_response(
        {
            "status": "ok",
            "uptime_s": coord.uptime_s(),
            "window_phase_s": coord.window_phase_s(),
            "rank_error": coord.rank_error,
        }
    )


async def ready(request: web.Request) -> web.Response:
    """200 while the pool can dispatch a request (and its decode server, if it has
    one, is up); else 503 naming why (``runtime/readiness.py``, ``proxy.py``)."""
    coord = request.app[COORDINATOR]
    proxy = request.app.get(PROXY)
    reason = coord.unready_reason() or (proxy.unready_reason() if proxy is not None else None)
    if reason is None:
        return json_response({"ready": True})
    return error_response(503, reason, "unavailable", retry_after_s=1)


async def metrics(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    return web.Response(
        body=coord.metrics.render(
            coord.workers_view(),
            len(coord.handoffs.leases),
            waiting=coord.policy.waiting,
            tier=coord.tier_view(),
        ),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def openapi(request: web.Request) -> web.Response:
    coord, decodes = request.app[COORDINATOR], PROXY in request.app
    return json_response(served_document(coord.cfg.model, coord.model_cfg.vocab_size, decodes))


ROUTES = [
    web.get("/v1/workers", workers),
    web.get("/v1/composition", composition),
    web.get("/v1/cache", cache),
    web.post("/v1/admin/reconfigure", reconfigure),
    web.get("/health", health),
    web.get("/ready", ready),
    web.get("/metrics", metrics),
    web.get("/openapi.json", openapi),
]
