"""The OpenAPI 3.1 document served at ``/openapi.json`` (kept beside docs/api.md):
every route, the pool's own schemas here and the OpenAI and vLLM ones from
``openai_schemas.py``."""

from __future__ import annotations

import copy
from typing import Any

from vertumnus.server.openai_schemas import (
    CHAT_CHUNK,
    CHAT_COMPLETION,
    CHAT_REQUEST,
    COMPLETION_REQUEST,
    DETOKENIZE_REQUEST,
    DETOKENIZE_RESPONSE,
    ERROR,
    KV_TRANSFER,
    MODEL_CARD,
    MODEL_LIST,
    TEXT_COMPLETION,
    TOKENIZE_REQUEST,
    TOKENIZE_RESPONSE,
    VERSION,
)

_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_HANDLE = [{"name": "handle", "in": "path", "required": True, "schema": {"type": "string"}}]


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int, not_found: str = "No such hand-off") -> dict[str, Any]:
    text = {
        400: "Invalid request",
        401: "A bearer token is needed",
        404: not_found,
        409: "Not possible now",
        410: "The hand-off ended (pulled, expired, released or moved)",
        502: "The decode server failed (its error passed on)",
        503: "Unavailable; retry (Retry-After)",
    }
    return {str(c): {"description": text[c], **_json(ERROR)} for c in codes}


_NO_MODEL = "The model named is not the served one"


def _answer(description: str, whole: str, chunk: str) -> dict[str, Any]:
    """A 200 that is JSON (the component ``whole``), or with ``stream`` server-sent
    events, each ``data: <the component chunk>``, then ``data: [DONE]``."""
    return {
        "description": f"{description}, or with stream its events",
        "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{whole}"}},
            "text/event-stream": {
                "schema": {
                    "type": "string",
                    "description": f"data: <{chunk}> per event, then data: [DONE]",
                }
            },
        },
    }


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
                                "kv_transfer_params": KV_TRANSFER,
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
                "summary": "OpenAI's completions: the pool prefills; past the first token, or "
                "streamed, a decode server generates (server-sent events when streaming)",
                "requestBody": {"required": True, **_json(COMPLETION_REQUEST)},
                "responses": {
                    "200": _answer("A text_completion", "TextCompletion", "TextCompletion"),
                    **_errors(400, 404, 502, 503, not_found=_NO_MODEL),
                },
            }
        },
        "/v1/chat/completions": {
            "post": {
                "summary": "OpenAI's chat completions: the messages through the model's chat "
                "template, then as a completion",
                "requestBody": {"required": True, **_json(CHAT_REQUEST)},
                "responses": {
                    "200": _answer("A chat.completion", "ChatCompletion", "ChatCompletionChunk"),
                    **_errors(400, 404, 502, 503, not_found=_NO_MODEL),
                },
            }
        },
        "/tokenize": {
            "post": {
                "summary": "vLLM's tokenize: a prompt's token ids, or a chat's through its "
                "template",
                "requestBody": {"required": True, **_json(TOKENIZE_REQUEST)},
                "responses": {
                    "200": {"description": "The token ids", **_json(TOKENIZE_RESPONSE)},
                    **_errors(400, 401, 404, not_found=_NO_MODEL),
                },
            }
        },
        "/detokenize": {
            "post": {
                "summary": "vLLM's detokenize: the text of token ids",
                "requestBody": {"required": True, **_json(DETOKENIZE_REQUEST)},
                "responses": {
                    "200": {"description": "The text", **_json(DETOKENIZE_RESPONSE)},
                    **_errors(400, 401, 404, not_found=_NO_MODEL),
                },
            }
        },
        "/version": {
            "get": {
                "summary": "Vertumnus's version",
                "responses": {"200": {"description": "OK", **_json(VERSION)}},
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
            "get": {
                "summary": "The served model (OpenAI's list)",
                "responses": {"200": {"description": "OK", **_json(MODEL_LIST)}},
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "The served model's card (any other id: 404)",
                "parameters": [{**_HANDLE[0], "name": "model_id"}],
                "responses": {
                    "200": {"description": "OK", **_json(MODEL_CARD)},
                    **_errors(401, 404, not_found=_NO_MODEL),
                },
            }
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
                "bearer: the API key or the hand-off secret",
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
            "get": {
                "summary": "Prometheus metrics: vertumnus_* and vLLM's vllm:* series",
                "responses": {"200": {"description": "text"}},
            }
        },
        "/openapi.json": {
            "get": {"summary": "This document", "responses": {"200": {"description": "OK"}}}
        },
    },
    "components": {
        "schemas": {
            "Error": ERROR,
            "TextCompletion": TEXT_COMPLETION,
            "ChatCompletion": CHAT_COMPLETION,
            "ChatCompletionChunk": CHAT_CHUNK,
        }
    },
}


def served_document(model: str, vocab_size: int, decodes: bool) -> dict[str, Any]:
    """``OPENAPI`` as this server takes requests: the served model's name the only
    ``model``, token ids below ``vocab_size``; without a decode server (``decodes``
    False) a completion's ``max_tokens`` is required and at most 1, and nothing is
    streamed."""
    doc = copy.deepcopy(OPENAPI)
    paths = doc["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props = schema["properties"]
        props["model"] = {**props["model"], "enum": [model]}
        props["stop_token_ids"] = {
            **props["stop_token_ids"],
            "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
        }
        if not decodes:
            for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
                if name in props:
                    props[name] = {**props[name], "maximum": 1}
            props["stream"] = {"enum": [False], "description": "no decode server: not streamed"}
            props.pop("stream_options")
            schema["required"] = [*schema["required"], "max_tokens"]
    return doc
