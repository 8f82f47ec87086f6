"""One choice of an answer as its tokens come: the text decoded piece by piece, cut
at the first stop string, and its log-probabilities in the shape the client asked
for.

Text model, per choice::

    text      every piece decoded so far (a piece is held back while it ends in an
              incomplete character, as vLLM's incremental detokenizer does), cut
              before the first stop string (kept with ``include_stop_str_in_output``)
    sent      how much of ``text`` was streamed: a stream holds back the last
              ``len(longest stop) - 1`` characters until the choice ends, since they
              may begin a stop string

A token that ends the choice by ``stop_token_ids`` adds no text (unless
``include_stop_str_in_output``); an end-of-sequence id is a special token, which
``skip_special_tokens`` drops. The choice's token count includes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vertumnus.protocol.request import GenerateRequest, Prompt
from vertumnus.protocol.sampling_params import TokenLogprobs
from vertumnus.protocol.tokenizer import Tokenizer


class Detokenizer:
    """Text of a growing list of ids, piece by piece: a piece is held back while the
    text ends in an incomplete character (U+FFFD), as vLLM's incremental decoding."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def add(self, token_id: int, last: bool) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        text = decode(self.ids[self.prefix_offset :], self.skip)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not last):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(before) :]


@dataclass
class Choice:
    """One sequence's output: ``index`` in the answer (prompt-major, then copy)."""

    index: int
    prompt: Prompt
    req: GenerateRequest
    tokenizer: Tokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    logprobs_sent: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    _detok: Detokenizer = field(init=False)

    def __post_init__(self) -> None:
        self._detok = Detokenizer(self.tokenizer, self.req.skip_special_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def hold(self) -> int:
        return max((len(s) for s in self.req.stop), default=1) - 1

    def add(self, lp: TokenLogprobs, finish_reason: str | None) -> bool:
        """Record the next token (``finish_reason`` as the decoder decided: "stop"
        for an end-of-sequence or stop id, "length"); True when a stop string ended
        the choice here (the decoder should stop its sequence)."""
        req = self.req
        self.token_ids.append(lp.token_id)
        self.logprobs.append(lp)
        self.cumulative_logprob += lp.logprob
        piece = self._detok.add(lp.token_id, last=finish_reason is not None)
        by_id = finish_reason == "stop" and lp.token_id in req.stop_token_ids
        if by_id:
            self.stop_reason = lp.token_id
            if not req.include_stop_str_in_output:
                piece = ""
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        self.finish_reason = finish_reason
        if req.stop and not by_id:
            found = [(at, s) for s in req.stop if (at := self.text.find(s, start)) >= 0]
            if found:
                at, stop = min(found)
                self.text = self.text[: at + (len(stop) if req.include_stop_str_in_output else 0)]
                self.finish_reason, self.stop_reason = "stop", stop
                return finish_reason is None
        return False

    def release(self) -> str:
        """The text that may be streamed now (held back: a possible stop string)."""
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def new_logprobs(self) -> list[TokenLogprobs]:
        out, self.logprobs_sent = self.logprobs[self.logprobs_sent :], len(self.logprobs)
        return out


def _token(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_text(token_id)


def completion_logprobs(
    tokenizer: Tokenizer,
    entries: list[tuple[int, TokenLogprobs | None]],
    offset: int,
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the chosen token among them, as vLLM) and ``text_offset``
    (from ``offset``), for (token id, its log-probabilities) pairs; None: the first
    prompt token, which has none."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in entries:
        text = _token(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        top = {_token(tokenizer, i): v for i, v in entry.top}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``content``, one entry per token with its
    ``top_logprobs``."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
        for e in entries
    ]
    return {"content": content}
