"""How the dialect refuses a request: ``BadRequest`` (a 400, or its own status, naming
the field at fault) and OpenAI's error object ``{"error": {"message", "type",
"param", "code"}}`` (``param``: the request field at fault, or null; ``code``: the
HTTP status, as vLLM answers). Not owned here: turning either into an HTTP answer
(``http_json.py``)."""

from __future__ import annotations

from typing import Any


class BadRequest(ValueError):
    """What the client sent cannot be served: a 400 (or ``status``) naming the field
    (``param``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: an error answer's body, or a stream's error event
    (``code``: the HTTP status it stands for)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
