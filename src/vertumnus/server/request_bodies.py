"""The request body of ``/v1/prefill`` read and checked: what the route serves, or
``BadRequest`` naming the field; and ``kv_transfer_params``'s one question for the
pool (keep the KV?), which the completions routes ask too. Holds no route and builds
no answer; the checks run in a fixed order, so a body with several faults is told
about the first. The completions bodies are ``protocol/request.py``'s."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from vertumnus.config.model import ModelConfig
from vertumnus.http_json import parse_json
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.tokenizer import Tokenizer, TokenizerError
from vertumnus.server.handoff_routes import wants_handoff

PREFILL_FIELDS = frozenset({"token_ids", "prompt", "ttft_slo_s", "kv_transfer_params"})


async def read_body(request: web.Request) -> dict[str, Any]:
    return parse_json(request.content_type, await request.read())


def prompt_tokens(body: dict[str, Any], tokenizer: Tokenizer, model: ModelConfig) -> list[int]:
    """The prompt's token ids (``token_ids``, or ``prompt`` as text or token ids),
    checked against the served model."""
    vocab_size, max_len = model.vocab_size, model.max_position_embeddings
    ids = body.get("token_ids")
    prompt = body.get("prompt")
    name = "prompt" if prompt is not None else "token_ids"
    if (ids is None) == (prompt is None):
        raise BadRequest(
            "give exactly one of 'token_ids' (a list of integers) or 'prompt' (text)", "token_ids"
        )
    if prompt is not None:
        if isinstance(prompt, list):  # the OpenAI form: a list of token ids
            ids = prompt
        elif isinstance(prompt, str):
            try:
                ids = tokenizer.encode(prompt)
            except TokenizerError as exc:
                raise BadRequest(str(exc), name) from None
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids", name)
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise BadRequest("'token_ids' must be a list of integers", name)
    if not ids:
        raise BadRequest("the prompt is empty: at least one token is needed", name)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", name)
    if len(ids) > max_len:
        raise BadRequest(f"{len(ids)} tokens exceed the model's maximum of {max_len}", name)
    return ids


def handoff_asked(body: dict[str, Any]) -> bool:
    """Whether the KV is to be kept for a decode server (``kv_transfer_params``)."""
    try:
        return wants_handoff(body)
    except ValueError as exc:
        raise BadRequest(str(exc), "kv_transfer_params") from None


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    """A ``POST /v1/prefill`` body: the prompt, and whether its KV is kept."""

    tokens: list[int]
    handoff: bool
    ttft_slo_s: float | None  # the client's TTFT target: the answer says if it was met

    @classmethod
    def parse(
        cls, body: dict[str, Any], tokenizer: Tokenizer, model: ModelConfig
    ) -> PrefillRequest:
        unknown = sorted(set(body) - PREFILL_FIELDS)
        if unknown:
            raise BadRequest(f"unknown fields {unknown}", unknown[0])
        slo = body.get("ttft_slo_s")
        if slo is not None and not (isinstance(slo, int | float) and slo > 0):
            raise BadRequest("'ttft_slo_s' must be a positive number of seconds", "ttft_slo_s")
        handoff = handoff_asked(body)
        return cls(prompt_tokens(body, tokenizer, model), handoff, slo)
