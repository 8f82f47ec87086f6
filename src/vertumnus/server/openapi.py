"""The OpenAPI 3.1 document served at ``/openapi.json`` (kept beside docs/api.md)."""

from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}},
            "required": ["message", "type"],
        }
    },
}
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_KV_TRANSFER = {
    "type": "object",
    "properties": {"do_remote_decode": {"type": "boolean"}},
    "description": "do_remote_decode: keep the prompt's KV for a decode server to pull; "
    "the answer's kv_transfer_params name where and how",
}
_HANDLE = [{"name": "handle", "in": "path", "required": True, "schema": {"type": "string"}}]


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "Invalid request",
        401: "A bearer token is needed",
        404: "No such hand-off",
        409: "Not possible now",
        410: "The hand-off ended (pulled, expired, released or moved)",
        502: "The decode server failed (its error passed on)",
        503: "Unavailable; retry (Retry-After)",
    }
    return {str(c): {"description": text[c], **_json(_ERROR)} for c in codes}


PREFILL_RESULT = {
    "type": "object",
    "properties": {
        name: {"type": kind}
        for name, kind in (
            ("request_id", "integer"),
            ("first_token", "integer"),
            ("cached_tokens", "integer"),
            ("computed_tokens", "integer"),
            ("worker", "integer"),
            ("cp_degree", "integer"),
            ("queue_s", "number"),
            ("prefill_s", "number"),
            ("ttft_s", "number"),
            ("slo_met", "boolean"),
        )
    },
}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "Vertumnus prefill pool",
        "version": "0.1.0",
        "description": "Prefill over context-parallel workers of mixed degrees; see docs/api.md.",
    },
    "paths": {
        "/v1/prefill": {
            "post": {
                "summary": "Prefill one prompt and return its first token",
                "requestBody": {
                    "required": True,
                    **_json(
                        {
                            "type": "object",
                            "properties": {
                                "token_ids": _TOKENS,
                                "prompt": {"type": "string", "minLength": 1},
                                "ttft_slo_s": {"type": "number", "exclusiveMinimum": 0},
                                "kv_transfer_params": _KV_TRANSFER,
                            },
                            "additionalProperties": False,
                        }
                    ),
                },
                "responses": {
                    "200": {"description": "Done", **_json(PREFILL_RESULT)},
                    **_errors(400, 503),
                },
            }
        },
        "/v1/completions": {
            "post": {
                "summary": "OpenAI-compatible completion: max_tokens = 1 is the prefill; more, "
                "or stream, go through the decode server (server-sent events when streaming)",
                "requestBody": {
                    "required": True,
                    **_json(
                        {
                            "type": "object",
                            "properties": {
                                "model": {"type": "string"},
                                "prompt": {"oneOf": [{"type": "string", "minLength": 1}, _TOKENS]},
                                "max_tokens": {"type": "integer", "minimum": 1},
                                "stream": {"type": "boolean"},
                                "temperature": {"type": "number", "minimum": 0},
                                "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                                "seed": {"type": "integer"},
                                "ignore_eos": {"type": "boolean"},
                                "kv_transfer_params": _KV_TRANSFER,
                            },
                            "required": ["prompt"],
                        }
                    ),
                },
                "responses": {
                    "200": {"description": "An OpenAI text_completion, or its event stream"},
                    **_errors(400, 502, 503),
                },
            }
        },
        "/v1/timeline": {
            "get": {
                "summary": "The pool over time: samples and reshape events after 'since'",
                "parameters": [
                    {
                        "name": "since",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "number"},
                    }
                ],
                "responses": {"200": {"description": "OK"}, **_errors(400)},
            }
        },
        "/v1/models": {
            "get": {"summary": "The served model", "responses": {"200": {"description": "OK"}}}
        },
        "/v1/workers": {
            "get": {
                "summary": "Workers, state, queues, cache",
                "responses": {"200": {"description": "OK"}},
            }
        },
        "/v1/composition": {
            "get": {"summary": "Composition and epoch", "responses": {"200": {"description": "OK"}}}
        },
        "/v1/cache": {
            "get": {
                "summary": "Prefix trie statistics",
                "responses": {"200": {"description": "OK"}},
            }
        },
        "/v1/admin/reconfigure": {
            "post": {
                "summary": "Split or merge now (the controller chooses the workers if none given)",
                "requestBody": {
                    "required": True,
                    **_json(
                        {
                            "type": "object",
                            "properties": {
                                "op": {"enum": ["split", "merge"]},
                                "worker": {"type": "integer"},
                                "workers": {"type": "array", "items": {"type": "integer"}},
                            },
                            "required": ["op"],
                            "additionalProperties": False,
                        }
                    ),
                },
                "responses": {
                    "200": {"description": "The reshape is done"},
                    **_errors(400, 409, 503),
                },
            }
        },
        "/v1/kv/{handle}": {
            "get": {
                "summary": "Pull a prompt's KV (the hand-off wire format, docs/api.md); "
                "bearer: the API key, the cluster secret or the hand-off secret",
                "parameters": _HANDLE,
                "responses": {
                    "200": {"description": "application/octet-stream"},
                    **_errors(401, 404, 409, 410),
                },
            },
            "delete": {
                "summary": "The decode side gave up: release the lease",
                "parameters": _HANDLE,
                "responses": {
                    "200": {"description": "Released"},
                    **_errors(401, 404, 409, 410),
                },
            },
        },
        "/v1/kv/{handle}/dist": {
            "post": {
                "summary": "The dist transport: the ranks send the KV point to point to the "
                "caller's torch.distributed store (docs/api.md, Transport)",
                "parameters": _HANDLE,
                "requestBody": {
                    "required": True,
                    **_json(
                        {
                            "type": "object",
                            "properties": {
                                "store_host": {"type": "string"},
                                "store_port": {"type": "integer"},
                                "prefix": {"type": "string"},
                            },
                            "required": ["store_host", "store_port", "prefix"],
                        }
                    ),
                },
                "responses": {
                    "200": {"description": "application/octet-stream: the layout, then rows"},
                    **_errors(400, 401, 404, 409, 410),
                },
            }
        },
        "/v1/handoffs": {
            "get": {
                "summary": "KV hand-off leases: open, pinned, ended, bytes pulled",
                "responses": {"200": {"description": "OK"}},
            }
        },
        "/health": {"get": {"summary": "Liveness", "responses": {"200": {"description": "OK"}}}},
        "/ready": {
            "get": {
                "summary": "Readiness",
                "responses": {"200": {"description": "Ready"}, **_errors(503)},
            }
        },
        "/metrics": {
            "get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}
        },
    },
}
