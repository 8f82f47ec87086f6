"""The REST API (aiohttp, orjson) in front of the coordinator; see docs/api.md.
This module builds the app from the routes of its neighbours:

    POST /v1/prefill, /v1/completions,   a prompt served (``completion_routes.py``;
         /v1/chat/completions            past the first token, the decode proxy,
                                         ``proxy.py``)
    GET, DELETE /v1/kv/{handle}          a prompt's KV kept for a decode server
                                         (``handoff_routes.py``)
    GET  /v1/models, /v1/models/{model_id},
    POST /tokenize, /detokenize,
    GET  /version                        the served model and its tokenizer, as OpenAI
                                         and vLLM serve them (``model_routes.py``)
    GET  /v1/workers, /v1/composition, /v1/cache,
    POST /v1/admin/reconfigure,
    GET  /health  /ready  /metrics  /openapi.json   the pool's own (``pool_routes.py``)
    GET  /v1/timeline, /dashboard        the pool over time, and a live page of it
                                         (``dashboard_routes.py``)

Errors are JSON, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx for what the
client sent and a 503 (with ``Retry-After``) when the pool cannot take work now.
Who may call what is ``access.py``. Nothing from the network is unpickled: bodies
are JSON (orjson); only the rank processes' own pipes carry pickles.
"""

from __future__ import annotations

from aiohttp import web

from vertumnus.config.model import eos_token_ids
from vertumnus.http_json import json_errors
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.server import (
    completion_routes,
    dashboard_routes,
    handoff_routes,
    model_routes,
    pool_routes,
)
from vertumnus.server.access import access
from vertumnus.server.keys import (
    ADDRESS,
    COORDINATOR,
    EOS_TOKEN_IDS,
    PROXY,
    TOKENIZER,
    Completer,
)

MAX_BODY_BYTES = 16 * 1024 * 1024


def build_app(
    coordinator: Coordinator, tokenizer: Tokenizer, proxy: Completer | None = None
) -> web.Application:
    """``proxy``: the decode proxy (``server/proxy.py``), for completions of more
    than one token; None: prefills only."""
    bug = json_errors("vertumnus.api", lambda: coordinator.metrics.internal_error("api"))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[bug, access])
    app[COORDINATOR] = coordinator
    app[TOKENIZER] = tokenizer
    app[EOS_TOKEN_IDS] = eos_token_ids(coordinator.model_dir)
    app[ADDRESS] = []  # [host, port] once ``serve`` has bound
    if proxy is not None:
        app[PROXY] = proxy
    app.add_routes(
        [
            *completion_routes.ROUTES,
            *model_routes.ROUTES,
            *pool_routes.ROUTES,
            *handoff_routes.ROUTES,
            *dashboard_routes.ROUTES,
        ]
    )
    app.cleanup_ctx.append(dashboard_routes.sampler)
    return app
