"""The OpenAPI schemas of the OpenAI and vLLM routes (``openapi.py`` places them):
the completions and chat completions requests, made from ``protocol/request.py``'s
field sets (every field it reads, and each ``*_OFF`` field with the values that mean
"off"), their answers (``text_completion``, ``chat.completion``,
``chat.completion.chunk``), /tokenize, /detokenize, the model card, and the error
body. A field of a set without a schema here fails at import.
"""

from __future__ import annotations

from typing import Any

from vertumnus.protocol.chat import ROLES
from vertumnus.protocol.request import (
    CHAT,
    CHAT_OFF,
    COMPLETION,
    COMPLETION_OFF,
    MAX_LOGPROBS,
    MAX_SEQUENCES,
)

Schema = dict[str, Any]

_BOOL: Schema = {"type": "boolean"}
_STR: Schema = {"type": "string"}
_INT: Schema = {"type": "integer"}
_ID: Schema = {"type": "integer", "minimum": 0}
_IDS: Schema = {"type": "array", "items": _ID}
_NONEMPTY_IDS: Schema = {**_IDS, "minItems": 1}
_PENALTY: Schema = {"type": "number", "minimum": -2, "maximum": 2}
_TEXT: Schema = {"type": "string", "minLength": 1}
_TEXTS: Schema = {"type": "array", "items": _TEXT}

ERROR: Schema = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": {"type": ["string", "null"], "description": "the field at fault"},
                "code": {"type": "integer", "description": "the HTTP status"},
            },
            "required": ["message", "type"],
        }
    },
}
KV_TRANSFER: Schema = {
    "type": "object",
    "properties": {"do_remote_decode": _BOOL},
    "description": "do_remote_decode: keep the prompt's KV for a decode server to pull; "
    "the answer's kv_transfer_params name where and how",
}

_SAMPLING: dict[str, Schema] = {
    "model": {**_STR, "description": "the served model's name; another is a 404"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_SEQUENCES},
    "stop": {"anyOf": [_TEXT, _TEXTS]},
    "stop_token_ids": _IDS,
    "include_stop_str_in_output": _BOOL,
    "stream": _BOOL,
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": _BOOL, "continuous_usage_stats": _BOOL},
        "additionalProperties": False,
        "description": "only with stream",
    },
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "description": "0 or -1: off"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": _INT,
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "logit_bias": {
        "type": "object",
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id (as a string) -> bias",
    },
    "max_tokens": {"type": "integer", "minimum": 1, "description": "also 0, with echo"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "add_special_tokens": _BOOL,
    "user": _STR,
    "return_token_ids": {
        **_BOOL,
        "description": "chat: token_ids on each choice (completions: always)",
    },
    "kv_transfer_params": KV_TRANSFER,
}
_COMPLETION_ONLY: dict[str, Schema] = {
    "prompt": {
        "anyOf": [  # an empty prompt is refused
            _TEXT,
            {"type": "array", "items": _TEXT, "minItems": 1},
            _NONEMPTY_IDS,
            {"type": "array", "items": _NONEMPTY_IDS, "minItems": 1},
        ]
    },
    "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_SEQUENCES},
    "echo": _BOOL,
    "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
}
_PART: Schema = {
    "type": "object",
    "properties": {"type": {"enum": ["text"]}, "text": _STR},
    "required": ["type", "text"],
}
_MESSAGE: Schema = {
    "type": "object",
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {
            "anyOf": [_STR, {"type": "array", "items": _PART}],
            "description": "also null for an assistant's message (vLLM's tool-call turns)",
        },
        "name": _STR,
        "tool_call_id": _STR,
    },
    "required": ["role", "content"],
    "additionalProperties": False,
}
MESSAGES: Schema = {"type": "array", "items": _MESSAGE, "minItems": 1}
_CHAT_TEMPLATE: dict[str, Schema] = {
    "add_generation_prompt": _BOOL,
    "continue_final_message": {**_BOOL, "description": "needs add_generation_prompt false"},
    "chat_template_kwargs": {"type": "object"},
}
_CHAT_ONLY: dict[str, Schema] = {
    "messages": MESSAGES,
    **_CHAT_TEMPLATE,
    "logprobs": _BOOL,
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "max_tokens": {"type": "integer", "minimum": 1},
}


def _request(
    names: frozenset[str], off: dict[str, tuple[Any, ...]], own: dict[str, Schema], required: str
) -> Schema:
    known = {**_SAMPLING, **own}
    properties = {name: known[name] for name in sorted(names)}
    for name, values in off.items():
        properties[name] = {"enum": list(values), "description": "not supported: only off"}
    return {
        "type": "object",
        "properties": properties,
        "required": [required],
        "additionalProperties": False,
    }


COMPLETION_REQUEST = _request(COMPLETION, COMPLETION_OFF, _COMPLETION_ONLY, "prompt")
CHAT_REQUEST = _request(CHAT, CHAT_OFF, _CHAT_ONLY, "messages")

_USAGE: Schema = {
    "type": "object",
    "properties": {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}},
    },
}
_STOP_REASON: Schema = {"type": ["string", "integer", "null"]}
_FINISH: Schema = {"enum": ["stop", "length", None]}


def _answer(kind: str, choice: dict[str, Schema]) -> Schema:
    return {
        "type": "object",
        "properties": {
            "id": _STR,
            "object": {"const": kind},
            "created": _INT,
            "model": _STR,
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": _INT,
                        **choice,
                        "logprobs": {"type": ["object", "null"]},
                        "finish_reason": _FINISH,
                        "stop_reason": _STOP_REASON,
                    },
                },
            },
            "usage": _USAGE,
        },
    }


TEXT_COMPLETION = _answer("text_completion", {"text": _STR, "token_ids": _IDS})
_ASSISTANT: Schema = {
    "type": "object",
    "properties": {"role": {"const": "assistant"}, "content": _STR},
}
CHAT_COMPLETION = _answer("chat.completion", {"message": _ASSISTANT})
CHAT_CHUNK = _answer("chat.completion.chunk", {"delta": _ASSISTANT})

_TOKEN_STRS: Schema = {**_BOOL, "description": "answer token_strs too"}
TOKENIZE_REQUEST: Schema = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "model": _STR,
                "prompt": _STR,
                "add_special_tokens": _BOOL,
                "return_token_strs": _TOKEN_STRS,
            },
            "required": ["prompt"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "model": _STR,
                "messages": MESSAGES,
                **_CHAT_TEMPLATE,
                "add_special_tokens": _BOOL,
                "return_token_strs": _TOKEN_STRS,
            },
            "required": ["messages"],
            "additionalProperties": False,
        },
    ]
}
TOKENIZE_RESPONSE: Schema = {
    "type": "object",
    "properties": {
        "count": _INT,
        "max_model_len": _INT,
        "tokens": _IDS,
        "token_strs": {"type": ["array", "null"], "items": _STR},
    },
    "required": ["count", "max_model_len", "tokens"],
}
DETOKENIZE_REQUEST: Schema = {
    "type": "object",
    "properties": {"model": _STR, "tokens": _IDS},
    "required": ["tokens"],
    "additionalProperties": False,
}
DETOKENIZE_RESPONSE: Schema = {"type": "object", "properties": {"prompt": _STR}}
MODEL_CARD: Schema = {
    "type": "object",
    "properties": {
        "id": _STR,
        "object": {"const": "model"},
        "owned_by": _STR,
        "max_model_len": _INT,
    },
}
MODEL_LIST: Schema = {
    "type": "object",
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_CARD}},
}
VERSION: Schema = {"type": "object", "properties": {"version": _STR}}
