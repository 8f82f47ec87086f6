"""A request's answer, whole or streamed, in OpenAI's shapes: ``text_completion``
(and its chunks) for completions, ``chat.completion`` and ``chat.completion.chunk``
for chat.

Choices are prompt-major: sequence ``p * best_of + j`` is copy ``j`` of prompt ``p``.
A whole answer keeps, per prompt, the ``n`` copies of highest cumulative
log-probability (all of them when ``best_of`` = ``n``), numbered ``p * n + k``. A
stream (``best_of`` = ``n``) sends one event per new piece of a choice (completions:
per new token, with text or not; chat: a first event with the role; completions with
``echo``: a first event with the prompt), then,
with ``stream_options.include_usage``, one event with ``choices: []`` and the usage.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from vertumnus.protocol.choices import Choice, chat_logprobs, completion_logprobs
from vertumnus.protocol.request import GenerateRequest
from vertumnus.protocol.sampling_params import TokenLogprobs
from vertumnus.protocol.tokenizer import Tokenizer

# Per prompt: (token id, its log-probabilities) for every prompt token; None for the
# first, which has none.
PromptLogprobs = list[tuple[int, TokenLogprobs | None]]


class Answer:
    def __init__(
        self,
        req: GenerateRequest,
        tokenizer: Tokenizer,
        prompt_logprobs: list[PromptLogprobs] | None = None,
    ) -> None:
        self.req, self.tokenizer = req, tokenizer
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [
            Choice(p * req.best_of + j, prompt, req, tokenizer)
            for p, prompt in enumerate(req.prompts)
            for j in range(req.best_of)
        ]
        if req.prompt_logprobs is not None and prompt_logprobs is None:
            raise ValueError("echo with logprobs needs the prompts' log-probabilities")
        self.prompt_logprobs = prompt_logprobs
        self._offsets: dict[int, int] = {}  # stream: text offset of each choice's next token
        self._started: set[int] = set()

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if self.req.chat
            else "text_completion"
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.req.model}

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p.token_ids) for p in self.req.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    # -- whole --------------------------------------------------------------------------

    def answered(self) -> list[Choice]:
        """Per prompt, the ``n`` best copies (by cumulative log-probability; ties: the
        first), in prompt order."""
        req, out = self.req, []
        for p in range(len(req.prompts)):
            copies = self.choices[p * req.best_of : (p + 1) * req.best_of]
            if req.best_of > req.n:
                copies = sorted(copies, key=lambda c: -c.cumulative_logprob)[: req.n]
            out.extend(copies)
        return out

    def body(self) -> dict[str, Any]:
        """The whole answer, once every choice has finished."""
        choices = []
        for k, choice in enumerate(self.answered()):
            echo = self._echo(choice) if self.req.echo else ""
            choices.append(self._choice(k, choice, echo + choice.text, choice.logprobs, 0))
        return {**self._head(False), "choices": choices, "usage": self.usage()}

    def _echo(self, choice: Choice) -> str:
        prompt = choice.prompt
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _choice(
        self, index: int, choice: Choice, text: str, new: list[TokenLogprobs], offset: int
    ) -> dict[str, Any]:
        req, logprobs = self.req, None
        if req.chat:
            if req.logprobs is not None:
                logprobs = chat_logprobs(self.tokenizer, new)
            out = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            if req.return_token_ids:
                out["token_ids"] = choice.token_ids
            return out
        if req.logprobs is not None:
            entries: list[tuple[int, TokenLogprobs | None]] = [(e.token_id, e) for e in new]
            if req.echo and offset == 0 and index not in self._started:
                entries = self._prompt_entries(choice) + entries
            logprobs = completion_logprobs(self.tokenizer, entries, offset)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": choice.token_ids if not self.req.stream else [e.token_id for e in new],
        }

    def _prompt_entries(self, choice: Choice) -> list[tuple[int, TokenLogprobs | None]]:
        assert self.prompt_logprobs is not None
        return list(self.prompt_logprobs[self.req.prompts.index(choice.prompt)])

    # -- streamed -----------------------------------------------------------------------

    def events(self, choice: Choice) -> list[dict[str, Any]]:
        """The stream's events for what is new in ``choice`` (none when nothing is);
        with ``stream_options.continuous_usage_stats``, each with the usage so far."""
        out = self._events(choice)
        if self.req.continuous_usage:
            for event in out:
                event["usage"] = self.usage()
        return out

    def _events(self, choice: Choice) -> list[dict[str, Any]]:
        out, index = [], choice.index
        head = self._head(True)
        if self.req.chat and index not in self._started:
            delta = {"role": "assistant", "content": ""}
            out.append({**head, "choices": [self._delta(index, delta, None, None)]})
            self._started.add(index)
        text, new = choice.release(), choice.new_logprobs()
        if self.req.chat:
            ids = self.req.return_token_ids
            if text or choice.finished or (new and (self.req.logprobs is not None or ids)):
                logprobs = (
                    chat_logprobs(self.tokenizer, new) if self.req.logprobs is not None else None
                )
                delta = {"content": text} if text else {}
                event = self._delta(index, delta, logprobs, choice)
                if ids:
                    event["token_ids"] = [e.token_id for e in new]
                out.append({**head, "choices": [event]})
            return out
        offset = self._offsets.get(index, 0)
        if self.req.echo and index not in self._started:
            text = self._echo(choice) + text
        # An event for every new token, with text or not (as vLLM streams completions):
        # its id, and a client sees the decode go on while text is held back.
        if text or choice.finished or new or (index not in self._started and self.req.echo):
            body = self._choice(index, choice, text, new, offset)
            if body["logprobs"] is not None:
                offsets = body["logprobs"]["text_offset"]
                last = body["logprobs"]["tokens"][-1:] or [""]
                self._offsets[index] = (offsets[-1] + len(last[0])) if offsets else offset
            out.append({**head, "choices": [body]})
        self._started.add(index)
        return out

    def _delta(
        self, index: int, delta: dict[str, Any], logprobs: Any, choice: Choice | None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": None if choice is None else choice.finish_reason,
            **({} if choice is None else {"stop_reason": choice.stop_reason}),
        }

    def usage_event(self) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self.usage()}
