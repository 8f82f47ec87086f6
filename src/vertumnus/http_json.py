"""What every HTTP server of the project answers alike (the pool's REST API in
``server/`` and the reference decode server in ``decode/``, which both import it):
JSON bodies in and out with orjson, JSON errors in OpenAI's error object
(``protocol/errors.py``), bearer tokens compared in constant time, and a middleware
that turns unknown routes, wrong methods, oversized bodies and bugs into JSON errors
too. Not owned here: the dialect itself (``protocol/``)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from vertumnus.protocol.errors import BadRequest, error_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(
    data: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


def model_card(name: str, max_model_len: int) -> dict[str, Any]:
    """The served model as OpenAI describes a model (``max_model_len``: vLLM's)."""
    return {"id": name, "object": "model", "owned_by": "vertumnus", "max_model_len": max_model_len}


def model_list(name: str, max_model_len: int) -> web.Response:
    """``GET /v1/models``: the one served model, as OpenAI clients list it."""
    return json_response({"object": "list", "data": [model_card(name, max_model_len)]})


def error_response(
    status: int,
    message: str,
    kind: str,
    retry_after_s: int | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> web.Response:
    extra = dict(headers or {})
    if retry_after_s is not None:
        extra["Retry-After"] = str(retry_after_s)
    return json_response(error_body(message, kind, status, param), status, extra or None)


def bad_request(exc: BadRequest, kind: str = "invalid_request_error") -> web.Response:
    """The answer to what the client sent (404 for a model this server does not serve)."""
    if exc.status == 404:
        kind = "NotFoundError"
    return error_response(exc.status, str(exc), kind, param=exc.param)


def parse_json(content_type: str, raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (``BadRequest`` otherwise)."""
    if content_type != "application/json":
        raise BadRequest(f"expected Content-Type application/json, got {content_type!r}")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def matches(given: str | None, expected: str | None) -> bool:
    """``given`` is ``expected`` (constant time); never true when either is missing."""
    if given is None or expected is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def json_errors(logger: str, on_bug: Callable[[], None] | None = None) -> Middleware:
    """Middleware: HTTP errors and bugs (logged with their traceback, and counted by
    ``on_bug``) as JSON."""
    log = structlog.get_logger(logger)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.reason or "error", "http_error")
        except Exception as exc:  # a bug: logged, answered as JSON
            log.exception("internal_error", path=request.path, error=repr(exc), bug=True)
            if on_bug is not None:
                on_bug()
            return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    return middleware
