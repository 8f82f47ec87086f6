"""Who may call what on the REST API, as one middleware.

``/v1/admin/*`` needs ``Authorization: Bearer <admin token>`` (401 without it, 403
with a wrong one, 403 for every call when no token is configured). A KV pull or
release (``/v1/kv/*``) needs the API key or the hand-off secret
(``handoff_routes.may_pull``). When an API key is configured, every other ``/v1/*``
route needs ``Bearer <api key>`` (401), and so do ``/tokenize`` and ``/detokenize``
(they run the tokenizer and the chat template; vLLM leaves them open).
``/health``, ``/ready``, ``/metrics``, ``/openapi.json``, ``/version`` and the
dashboard's page stay open. Tokens are compared in
constant time and never logged.
"""

from __future__ import annotations

from aiohttp import web

from vertumnus.http_json import Handler, bearer, error_response, matches
from vertumnus.server import handoff_routes
from vertumnus.server.keys import COORDINATOR

KEYED = frozenset({"/tokenize", "/detokenize"})  # outside /v1, behind the API key too


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
    elif (path.startswith("/v1/") or path in KEYED) and cfg.api_key is not None:
        token = bearer(request)
        if not matches(token, cfg.api_key):
            response = error_response(
                401, "a valid API key is needed: 'Authorization: Bearer <key>'", "unauthorized"
            )
            response.headers.update(challenge)
            return response
    return await handler(request)
