"""The REST API (aiohttp, orjson) in front of the coordinator; see docs/api.md.

    POST /v1/prefill            {"token_ids": [...]} or {"prompt": "..."}
    POST /v1/completions        the OpenAI completions subset (max_tokens > 1 and
                                streams through the decode proxy, ``proxy.py``)
    GET, DELETE /v1/kv/{handle} a prompt's KV kept for a decode server
                                (``handoff_routes.py``)
    GET  /v1/models             the served model (OpenAI's list)
    GET  /v1/workers            the workers, their state, queue and cache
    GET  /v1/composition        the composition and configuration epoch
    GET  /v1/cache              the trie: nodes, holders per worker, hit rate
    POST /v1/admin/reconfigure  {"op": "split", "worker": W} | {"op": "merge",
                                "workers": [W1, W2]} | {"op": ...} (controller chooses)
    GET  /v1/timeline?since=T   the pool over time, for the dashboard
    GET  /dashboard             a live page of it (``dashboard_routes.py``)
    GET  /health  /ready  /metrics  /openapi.json

Errors are JSON, ``{"error": {"message": ..., "type": ...}}``, with a 4xx for what the
client sent and a 503 (with ``Retry-After``) when the pool cannot take work now.

Access: ``/v1/admin/*`` needs ``Authorization: Bearer <admin token>`` (401 without
it, 403 with a wrong one, 403 for every call when no token is configured). When an
API key is configured, every other ``/v1/*`` route needs ``Bearer <api key>`` (401).
``/health``, ``/ready``, ``/metrics`` and ``/openapi.json`` stay open. Tokens are
compared in constant time and never logged. Nothing from the network is unpickled:
bodies are JSON (orjson); only the rank processes' own pipes carry pickles.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from vertumnus.policy.lattice import LatticeError
from vertumnus.runtime.coordinator import Coordinator, Overloaded, Unavailable
from vertumnus.runtime.ranks import RanksError
from vertumnus.runtime.request_path import InternalError
from vertumnus.runtime.reshaping import ReshapeFailed
from vertumnus.server import dashboard_routes, handoff_routes
from vertumnus.server.handoff_routes import transfer_params, wants_handoff
from vertumnus.server.http import (
    BadRequest,
    Handler,
    bearer,
    error_response,
    json_errors,
    json_response,
    matches,
    model_list,
    parse_json,
)
from vertumnus.server.keys import ADDRESS, COORDINATOR, PROXY, TOKENIZER
from vertumnus.server.openapi import OPENAPI
from vertumnus.server.tokenizer import Tokenizer, TokenizerError

MAX_BODY_BYTES = 16 * 1024 * 1024


async def _body(request: web.Request) -> dict[str, Any]:
    return parse_json(request.content_type, await request.read())


def _tokens(body: dict[str, Any], app: web.Application) -> list[int]:
    """The prompt's token ids, checked against the served model."""
    tokenizer, cfg = app[TOKENIZER], app[COORDINATOR].model_cfg
    vocab_size, max_len = cfg.vocab_size, cfg.max_position_embeddings
    ids = body.get("token_ids")
    prompt = body.get("prompt")
    if (ids is None) == (prompt is None):
        raise BadRequest("give exactly one of 'token_ids' (a list of integers) or 'prompt' (text)")
    if prompt is not None:
        if isinstance(prompt, list):  # the OpenAI form: a list of token ids
            ids = prompt
        elif isinstance(prompt, str):
            try:
                ids = tokenizer.encode(prompt)
            except TokenizerError as exc:
                raise BadRequest(str(exc)) from None
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise BadRequest("'token_ids' must be a list of integers")
    if not ids:
        raise BadRequest("the prompt is empty: at least one token is needed")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) > max_len:
        raise BadRequest(f"{len(ids)} tokens exceed the model's maximum of {max_len}")
    return ids


async def _serve_prefill(coord: Coordinator, tokens: list[int], handoff: bool = False) -> Any:
    """The coordinator's answer, or the error response for what stopped it."""
    try:
        return await coord.prefill(tokens, handoff)
    except Overloaded as exc:
        return error_response(503, f"overloaded: {exc}", "overloaded", retry_after_s=1)
    except (Unavailable, RanksError) as exc:
        return error_response(503, f"unavailable: {exc}", "unavailable", retry_after_s=2)
    except InternalError as exc:  # (logged with its traceback where it happened)
        return error_response(500, f"internal error: {exc}", "internal_error")


async def prefill(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    try:
        body = await _body(request)
        unknown = sorted(set(body) - {"token_ids", "prompt", "ttft_slo_s", "kv_transfer_params"})
        if unknown:
            raise BadRequest(f"unknown fields {unknown}")
        slo = body.get("ttft_slo_s")
        if slo is not None and not (isinstance(slo, int | float) and slo > 0):
            raise BadRequest("'ttft_slo_s' must be a positive number of seconds")
        handoff = _handoff(body)
        tokens = _tokens(body, request.app)
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request")
    result = await _serve_prefill(coord, tokens, handoff)
    if isinstance(result, web.Response):
        return result
    out = dict(result.__dict__)
    out.pop("logits")
    out.pop("handoff")
    if handoff:
        out["kv_transfer_params"] = transfer_params(request, coord, result)
    if slo is not None:
        out["slo_met"] = result.ttft_s <= slo
    return json_response(out)


def _handoff(body: dict[str, Any]) -> bool:
    try:
        return wants_handoff(body)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


async def completions(request: web.Request) -> web.StreamResponse:
    coord = request.app[COORDINATOR]
    try:
        body = await _body(request)
        max_tokens = body.get("max_tokens", 1)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("'max_tokens' must be an integer >= 1")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false")
        proxy = request.app.get(PROXY)
        if (max_tokens > 1 or stream) and proxy is None:
            raise BadRequest(
                "this server has no decode server ([decode] local = false and no url): "
                "max_tokens = 1 without stream only"
            )
        if (
            isinstance(body.get("prompt"), list)
            and body["prompt"]
            and isinstance(body["prompt"][0], list)
        ):
            raise BadRequest("one prompt per request")
        handoff = _handoff(body)
        tokens = _tokens({"prompt": body.get("prompt")}, request.app)
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request_error")
    if max_tokens > 1 or stream:
        assert proxy is not None
        return await proxy.complete(request, body, tokens)
    result = await _serve_prefill(coord, tokens, handoff)
    if isinstance(result, web.Response):
        return result
    tokenizer = request.app[TOKENIZER]
    return json_response(
        {
            "id": f"cmpl-{result.request_id}",
            "object": "text_completion",
            "model": body.get("model") or coord.cfg.model,
            "choices": [
                {
                    "index": 0,
                    "text": tokenizer.decode([result.first_token]),
                    "token_ids": [result.first_token],
                    "finish_reason": "length",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(tokens),
                "completion_tokens": 1,
                "total_tokens": len(tokens) + 1,
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            },
            **({"kv_transfer_params": transfer_params(request, coord, result)} if handoff else {}),
        }
    )


async def workers(request: web.Request) -> web.Response:
    return json_response({"workers": request.app[COORDINATOR].workers_view()})


async def composition(request: web.Request) -> web.Response:
    return json_response(request.app[COORDINATOR].composition_view())


async def models(request: web.Request) -> web.Response:
    """The served model, as OpenAI clients list it (the decode server answers alike)."""
    coord = request.app[COORDINATOR]
    return model_list(coord.cfg.model, coord.model_cfg.max_position_embeddings)


async def cache(request: web.Request) -> web.Response:
    return json_response(request.app[COORDINATOR].cache_view())


async def reconfigure(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    try:
        body = await _body(request)
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
        body=coord.metrics.render(coord.workers_view(), len(coord.handoffs.leases)),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def openapi(request: web.Request) -> web.Response:
    return json_response(OPENAPI)


@web.middleware
async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The admin token for /v1/admin/*, the API key (when set) for the rest of /v1."""
    cfg = request.app[COORDINATOR].cfg
    path = request.path
    challenge = {"WWW-Authenticate": 'Bearer realm="vertumnus"'}
    if path.startswith("/v1/admin/") or path == "/v1/admin":
        if cfg.admin_token is None:
            return error_response(
                403,
                "the admin API is disabled: set VERTUMNUS_ADMIN_TOKEN or [server] admin_token",
                "forbidden",
            )
        token = bearer(request)
        if token is None:
            response = error_response(
                401, "admin calls need 'Authorization: Bearer <token>'", "unauthorized"
            )
            response.headers.update(challenge)
            return response
        if not matches(token, cfg.admin_token):
            return error_response(403, "wrong admin token", "forbidden")
    elif path.startswith("/v1/kv/"):
        if not handoff_routes.may_pull(request.app[COORDINATOR], bearer(request)):
            response = error_response(
                401,
                "a KV pull needs 'Authorization: Bearer' with the API key, the cluster "
                "secret or the hand-off secret",
                "unauthorized",
            )
            response.headers.update(challenge)
            return response
    elif path.startswith("/v1/") and cfg.api_key is not None:
        token = bearer(request)
        if not matches(token, cfg.api_key):
            response = error_response(
                401, "a valid API key is needed: 'Authorization: Bearer <key>'", "unauthorized"
            )
            response.headers.update(challenge)
            return response
    return await handler(request)


def build_app(coordinator: Coordinator, tokenizer: Tokenizer, proxy: Any = None) -> web.Application:
    """``proxy``: the decode proxy (``server/proxy.py``), for completions of more
    than one token; None: prefills only."""
    bug = json_errors("vertumnus.api", lambda: coordinator.metrics.internal_error("api"))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[bug, access])
    app[COORDINATOR] = coordinator
    app[TOKENIZER] = tokenizer
    app[ADDRESS] = []  # [host, port] once ``serve`` has bound
    if proxy is not None:
        app[PROXY] = proxy
    app.add_routes(
        [
            web.post("/v1/prefill", prefill),
            web.post("/v1/completions", completions),
            web.get("/v1/models", models),
            web.get("/v1/workers", workers),
            web.get("/v1/composition", composition),
            web.get("/v1/cache", cache),
            web.post("/v1/admin/reconfigure", reconfigure),
            web.get("/health", health),
            web.get("/ready", ready),
            web.get("/metrics", metrics),
            web.get("/openapi.json", openapi),
            *handoff_routes.ROUTES,
            *dashboard_routes.ROUTES,
        ]
    )
    app.cleanup_ctx.append(dashboard_routes.sampler)
    return app
