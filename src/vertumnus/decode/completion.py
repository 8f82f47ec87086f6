"""One OpenAI completions request as the decode server takes it and answers it:
``parse_completion`` checks the body against the served model (``BadRequest``
names the field), ``Generation`` records the tokens as they come and gives the
answer's ``usage`` and ``timings``, ``Detokenizer`` turns a stream of ids into
text pieces. No I/O: the app (``decode_server.py``) reads and writes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vertumnus.config import ModelConfig
from vertumnus.decode.kv_client import PulledKV, TransferParams
from vertumnus.decode.sampling import SamplingParams
from vertumnus.server.http import BadRequest
from vertumnus.server.tokenizer import Tokenizer, TokenizerError


@dataclass(frozen=True)
class Completion:
    """One checked ``POST /v1/completions``."""

    model: str
    token_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stream: bool
    ignore_eos: bool
    transfer: TransferParams | None


# Fields of the OpenAI API this server does not implement: each may be absent or
# take a value that means "off", nothing else.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (None,),
    "stop": (None, []),
    "suffix": (None,),
}


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{name}' must be a number")
    return float(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false")
    return value


def parse_completion(body: dict[str, Any], tokenizer: Tokenizer, cfg: ModelConfig) -> Completion:
    """The request, checked against the served model; ``BadRequest`` names the field."""
    for name, off in _UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise BadRequest(f"'{name}' = {body[name]!r} is not supported by this decode server")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt)
        except TokenizerError as exc:
            raise BadRequest(f"'prompt': {exc}") from None
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        raise BadRequest("'prompt': one prompt per request")
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = prompt
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids")
    if not ids:
        raise BadRequest("'prompt' is empty: at least one token is needed")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise BadRequest(
            f"'prompt': token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}"
        )
    if len(ids) > cfg.max_position_embeddings:
        raise BadRequest(
            f"'prompt': {len(ids)} tokens exceed the model's maximum of "
            f"{cfg.max_position_embeddings}"
        )
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("'max_tokens' must be an integer >= 1")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer")
    temperature, top_p = _number(body, "temperature", 1.0), _number(body, "top_p", 1.0)
    if not temperature >= 0:
        raise BadRequest("'temperature' must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise BadRequest("'top_p' must be in (0, 1]")
    transfer = None
    if body.get("kv_transfer_params") is not None:
        try:
            transfer = TransferParams.parse(body["kv_transfer_params"])
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    return Completion(
        model=model or cfg.name,
        token_ids=ids,
        max_tokens=max_tokens,
        params=SamplingParams(temperature, top_p, seed),
        stream=_flag(body, "stream"),
        ignore_eos=_flag(body, "ignore_eos"),
        transfer=transfer,
    )


class Detokenizer:
    """Text of a growing list of ids, piece by piece: a piece is held back while the
    text ends in an incomplete character (U+FFFD), as vLLM's incremental decoding."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids = tokenizer, list[int]()
        self.prefix_offset = self.read_offset = 0

    def add(self, token_id: int, last: bool) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not last):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(before) :]


@dataclass
class Generation:
    """One request's decode as it goes: its tokens, when each was chosen
    (``time.perf_counter``), and the bodies of its answer."""

    req: Completion
    # The prompt's KV, until handed to the decode thread (then dropped: the engine
    # copies it into its cache, and the pulled copy is not kept for the whole decode).
    pulled: PulledKV | None
    prefill_s: float | None  # the prefill this server asked for (None: a proxy did)
    submitted: float = 0.0  # when the sequence was handed to the decode thread
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    head: dict[str, Any] = field(init=False)
    handoff_s: float = field(init=False)
    handoff_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.pulled is None:
            raise ValueError("a generation starts with the prompt's pulled KV")
        self.handoff_s, self.handoff_bytes = self.pulled.seconds, self.pulled.num_bytes
        self.head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.req.model,
        }

    def usage(self) -> dict[str, int]:
        prompt = len(self.req.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.ids),
            "total_tokens": prompt + len(self.ids),
        }

    def timings(self) -> dict[str, Any]:
        """The hand-off's seconds and bytes; the first step's seconds (from joining
        the batch to the first token, queueing included); the rest of the decode's
        seconds and their mean per token (``tpot_s``, None for one token)."""
        decode_s = self.times[-1] - self.times[0]
        return {
            "handoff_s": self.handoff_s,
            "handoff_bytes": self.handoff_bytes,
            "prefill_s": self.prefill_s,
            "first_step_s": self.times[0] - self.submitted,
            "decode_s": decode_s,
            "tpot_s": decode_s / (len(self.times) - 1) if len(self.times) > 1 else None,
        }

    def answer(self, text: str) -> dict[str, Any]:
        """The non-streaming answer, once finished."""
        choice = {
            "index": 0,
            "text": text,
            "token_ids": self.ids,
            "finish_reason": self.finish_reason,
            "logprobs": None,
        }
        return {**self.head, "choices": [choice], "usage": self.usage(), "timings": self.timings()}

    def chunk(self, text: str) -> dict[str, Any]:
        """The streaming event of the latest token; the last also has the usage and
        timings."""
        choice = {
            "index": 0,
            "text": text,
            "token_ids": self.ids[-1:],
            "finish_reason": self.finish_reason,
            "logprobs": None,
        }
        out: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.finish_reason is not None:
            out |= {"usage": self.usage(), "timings": self.timings()}
        return out
