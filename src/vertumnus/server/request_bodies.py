"""The request bodies of ``/v1/prefill`` and ``/v1/completions`` (the OpenAI
completions subset), read and checked: what a route serves, or ``BadRequest``
naming the field. Holds no route and builds no answer; the checks run in a fixed
order, so a body with several faults is told about the first."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from vertumnus.config.model import ModelConfig
from vertumnus.server.handoff_routes import wants_handoff
from vertumnus.server.http import BadRequest, parse_json
from vertumnus.server.tokenizer import Tokenizer, TokenizerError

PREFILL_FIELDS = frozenset({"token_ids", "prompt", "ttft_slo_s", "kv_transfer_params"})


async def read_body(request: web.Request) -> dict[str, Any]:
    return parse_json(request.content_type, await request.read())


def prompt_tokens(body: dict[str, Any], tokenizer: Tokenizer, model: ModelConfig) -> list[int]:
    """The prompt's token ids (``token_ids``, or ``prompt`` as text or token ids),
    checked against the served model."""
    vocab_size, max_len = model.vocab_size, model.max_position_embeddings
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


def handoff_asked(body: dict[str, Any]) -> bool:
    """Whether the KV is to be kept for a decode server (``kv_transfer_params``)."""
    try:
        return wants_handoff(body)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


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
            raise BadRequest(f"unknown fields {unknown}")
        slo = body.get("ttft_slo_s")
        if slo is not None and not (isinstance(slo, int | float) and slo > 0):
            raise BadRequest("'ttft_slo_s' must be a positive number of seconds")
        handoff = handoff_asked(body)
        return cls(prompt_tokens(body, tokenizer, model), handoff, slo)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A ``POST /v1/completions`` body. ``body`` is kept as sent: a completion that
    needs decoding forwards it to the decode server."""

    body: dict[str, Any]
    tokens: list[int]
    max_tokens: int
    stream: bool
    handoff: bool

    @property
    def needs_decode(self) -> bool:
        """More than the first token, or a stream: the decode server's work."""
        return self.max_tokens > 1 or self.stream

    @classmethod
    def parse(
        cls, body: dict[str, Any], tokenizer: Tokenizer, model: ModelConfig, decodes: bool
    ) -> CompletionRequest:
        """``decodes``: this server has a decode server (else a completion is its
        first token alone)."""
        max_tokens = body.get("max_tokens", 1)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("'max_tokens' must be an integer >= 1")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false")
        if (max_tokens > 1 or stream) and not decodes:
            raise BadRequest(
                "this server has no decode server ([decode] local = false and no url): "
                "max_tokens = 1 without stream only"
            )
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            raise BadRequest("one prompt per request")
        handoff = handoff_asked(body)
        tokens = prompt_tokens({"prompt": prompt}, tokenizer, model)
        return cls(body, tokens, max_tokens, stream, handoff)
