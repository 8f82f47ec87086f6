"""The served model and its tokenizer, as OpenAI clients and vLLM's tools ask for
them (docs/api.md, "OpenAI and vLLM compatibility"):

    GET  /v1/models              the served model (OpenAI's list of one)
    GET  /v1/models/{model_id}   its card; 404 for any other name
    POST /tokenize               {"prompt": text} or {"messages": [...]}: the token ids
                                 (the chat template rendered as for a chat completion)
    POST /detokenize             {"tokens": [ids]}: the text
    GET  /version                vertumnus's version

The bodies are read like a completion's (``protocol/``): an unknown field is a 400
that names it, a ``model`` other than the served one a 404. /tokenize and
/detokenize are behind the API key like /v1 (``access.py``); /version is open.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from vertumnus.http_json import bad_request, json_response, model_card, model_list, parse_json
from vertumnus.protocol import fields
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.request import Served, chat_prompt, check_model
from vertumnus.protocol.tokenizer import TokenizerError
from vertumnus.server.keys import COORDINATOR, TOKENIZER

TOKENIZE_TEXT = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT = frozenset(
    {
        "model",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "chat_template_kwargs",
        "return_token_strs",
    }
)
# vLLM's other fields of a chat /tokenize: no tools, no request's own template, no media
TOKENIZE_CHAT_OFF: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "chat_template": (None,),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
}
DETOKENIZE = frozenset({"model", "tokens"})


def served(request: web.Request) -> Served:
    coord = request.app[COORDINATOR]
    return Served(
        coord.cfg.model,
        request.app[TOKENIZER],
        coord.model_cfg.vocab_size,
        coord.model_cfg.max_position_embeddings,
    )


def tokenize_body(body: dict[str, Any], model: Served) -> dict[str, Any]:
    """The answer to a /tokenize ``body``: vLLM's ``count``, ``max_model_len``,
    ``tokens`` and ``token_strs`` (null unless ``return_token_strs``)."""
    if "messages" in body:
        fields.refuse_unknown(body, TOKENIZE_CHAT, TOKENIZE_CHAT_OFF)
        check_model(body, model)
        (prompt,) = chat_prompt(body, model)
        ids = prompt.token_ids
    else:
        fields.refuse_unknown(body, TOKENIZE_TEXT, {})
        check_model(body, model)
        text = body.get("prompt")
        if not isinstance(text, str):
            raise BadRequest("'prompt' must be a string (or send 'messages')", "prompt")
        try:
            ids = model.tokenizer.encode(text, fields.flag(body, "add_special_tokens", True))
        except TokenizerError as exc:
            raise BadRequest(f"'prompt': {exc}", "prompt") from None
    strs = fields.flag(body, "return_token_strs", False)
    return {
        "count": len(ids),
        "max_model_len": model.max_model_len,
        "tokens": ids,
        "token_strs": model.tokenizer.token_strs(ids) if strs else None,
    }


def detokenize_body(body: dict[str, Any], model: Served) -> dict[str, Any]:
    """The answer to a /detokenize ``body``: the text of ``tokens``, special tokens
    included (as vLLM decodes them)."""
    fields.refuse_unknown(body, DETOKENIZE, {})
    check_model(body, model)
    ids = body.get("tokens")
    if not fields.is_id_list(ids):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    assert isinstance(ids, list)
    fields.check_vocab(ids, model.vocab_size, "tokens")
    if not model.tokenizer.has_text:
        raise BadRequest(
            f"this model has no tokenizer ({model.tokenizer.name}): no text to give", "tokens"
        )
    return {"prompt": model.tokenizer.decode(ids, skip_special_tokens=False)}


def _json_route(
    answer: Callable[[dict[str, Any], Served], dict[str, Any]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A POST route: the JSON body, ``answer``ed against the served model."""

    async def route(request: web.Request) -> web.Response:
        try:
            body = parse_json(request.content_type, await request.read())
            return json_response(answer(body, served(request)))
        except BadRequest as exc:
            return bad_request(exc)

    return route


async def models(request: web.Request) -> web.Response:
    """The served model, as OpenAI clients list it (the decode server answers alike)."""
    model = served(request)
    return model_list(model.model, model.max_model_len)


async def model(request: web.Request) -> web.Response:
    """OpenAI's retrieve: the served model's card, or 404 for any other id."""
    served_model = served(request)
    try:
        check_model({"model": request.match_info["model_id"]}, served_model)
    except BadRequest as exc:
        return bad_request(exc)
    return json_response(model_card(served_model.model, served_model.max_model_len))


def package_version() -> str:
    try:
        return importlib.metadata.version("vertumnus")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


async def version(request: web.Request) -> web.Response:
    return json_response({"version": package_version()})


ROUTES = [
    web.get("/v1/models", models),
    # a served name may hold slashes (a Hugging Face id or a folder, as given)
    web.get("/v1/models/{model_id:.+}", model),
    web.post("/tokenize", _json_route(tokenize_body)),
    web.post("/detokenize", _json_route(detokenize_body)),
    web.get("/version", version),
]
