"""An OpenAI completions or chat completions request, read and checked against the
served model into one ``GenerateRequest``.

Every field either works or is refused with a 400 that names it: the fields of
OpenAI's API and vLLM's sampling extensions listed in ``COMPLETION`` and ``CHAT``
work; those in ``*_OFF`` are accepted only with the value that means "off"; any
other field is refused. ``max_tokens`` defaults to 16 for completions and to the
rest of the model's context for chat (as vLLM); a prompt plus ``max_tokens`` beyond
the context is refused. A ``model`` other than the served one is a 404 (as vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vertumnus.protocol import fields
from vertumnus.protocol.chat import check_messages
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.sampling_params import SamplingParams
from vertumnus.protocol.tokenizer import Tokenizer, TokenizerError

MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
MAX_SEQUENCES = 128  # sequences one request may decode: prompts x best_of
COMPLETION_MAX_TOKENS = 16

_SAMPLING = frozenset(
    {
        "model",
        "n",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "add_special_tokens",
        "logprobs",
        "user",
        "return_token_ids",
        "kv_transfer_params",
    }
)
COMPLETION = _SAMPLING | {"prompt", "best_of", "echo"}
COMPLETION_OFF: dict[str, tuple[Any, ...]] = {"suffix": (None, "")}
CHAT = _SAMPLING | {
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
}
CHAT_OFF: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "echo": (None, False),
    "modalities": (None, ["text"]),
}


@dataclass(frozen=True)
class Served:
    """What a request is checked against: the served model's name, tokenizer (and
    chat template) and sizes."""

    model: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # as the client sent or the template rendered it; None: ids given


@dataclass(frozen=True)
class GenerateRequest:
    """One checked request: ``prompts`` (one choice group each, in order), each
    decoded ``best_of`` times of which the ``n`` most likely are answered."""

    chat: bool
    model: str
    prompts: tuple[Prompt, ...]
    n: int
    best_of: int
    max_tokens: int  # per choice (0: echo only)
    min_tokens: int
    params: SamplingParams
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    include_stop_str_in_output: bool
    ignore_eos: bool
    skip_special_tokens: bool
    logprobs: int | None  # top alternatives of each generated token; None: no logprobs
    echo: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool  # every streamed event carries the usage so far (vLLM)
    return_token_ids: bool  # chat choices carry their token ids too (completions always do)
    user: str | None
    transfer: Any  # ``kv_transfer_params`` as sent (the decode server reads them)

    @property
    def prompt_logprobs(self) -> int | None:
        """Top alternatives of each prompt token (completions, ``echo`` with
        ``logprobs``): the loglikelihood request of evaluation harnesses."""
        return self.logprobs if self.echo else None

    @property
    def needs_decode(self) -> bool:
        """Whether a decode server must answer (the pool alone answers one token)."""
        return self.max_tokens > 1 or self.stream


def check_model(body: dict[str, Any], served: Served) -> str:
    model = fields.text(body, "model")
    if model is not None and model != served.model:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
    return served.model


def _encode(served: Served, text: str, add_special_tokens: bool, name: str) -> list[int]:
    try:
        return served.tokenizer.encode(text, add_special_tokens)
    except TokenizerError as exc:
        raise BadRequest(f"'{name}': {exc}", name) from None


def _completion_prompts(body: dict[str, Any], served: Served) -> list[Prompt]:
    raw = body.get("prompt")
    special = fields.flag(body, "add_special_tokens", True)
    if isinstance(raw, str):
        return [Prompt(_encode(served, raw, special, "prompt"), raw)]
    if isinstance(raw, list) and raw:
        if fields.is_id_list(raw):
            return [Prompt(list(raw), None)]
        if all(isinstance(p, str) for p in raw):
            return [Prompt(_encode(served, p, special, "prompt"), p) for p in raw]
        if all(fields.is_id_list(p) for p in raw):
            return [Prompt(list(p), None) for p in raw]
    raise BadRequest(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids",
        "prompt",
    )


def chat_prompt(body: dict[str, Any], served: Served) -> list[Prompt]:
    template = served.tokenizer.chat
    if template is None:
        raise BadRequest("this model has no tokenizer: chat needs one", "messages")
    messages = check_messages(body.get("messages"))
    generation = fields.flag(body, "add_generation_prompt", True)
    cont = fields.flag(body, "continue_final_message", False)
    if generation and cont:
        raise BadRequest(
            "'continue_final_message' needs 'add_generation_prompt': false",
            "continue_final_message",
        )
    if cont and messages[-1]["role"] != "assistant":
        raise BadRequest(
            "'continue_final_message': the final message must be the assistant's",
            "continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    text = template.render(messages, generation, cont, kwargs)
    special = fields.flag(body, "add_special_tokens", False)
    return [Prompt(_encode(served, text, special, "messages"), text)]


def _max_tokens(
    body: dict[str, Any], chat: bool, echo: bool, prompts: list[Prompt], served: Served
) -> int:
    name = (
        "max_completion_tokens"
        if chat and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    longest = max(len(p.token_ids) for p in prompts)
    room = served.max_model_len - longest
    given = fields.integer(body, name, None, lo=0 if echo else 1)
    if room < (0 if echo else 1):
        where = "messages" if chat else "prompt"
        raise BadRequest(
            f"This model's maximum context length is {served.max_model_len} tokens; the "
            f"{where} has {longest}, which leaves no room to generate.",
            where,
        )
    if given is None:
        return room if chat else min(COMPLETION_MAX_TOKENS, room)
    if longest + given > served.max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {served.max_model_len} tokens. However, "
            f"you requested {longest + given} tokens ({longest} in the "
            f"{'messages' if chat else 'prompt'}, {given} in the completion). Please reduce "
            "the length of the prompt or the completion.",
            name,
        )
    return given


def _params(body: dict[str, Any], served: Served) -> SamplingParams:
    seed = fields.integer(body, "seed", None)
    top_k = fields.integer(body, "top_k", 0, lo=-1)
    return SamplingParams(
        temperature=fields.number(body, "temperature", 1.0, lo=0.0),
        top_p=fields.number(body, "top_p", 1.0, lo=1e-9, hi=1.0),
        seed=None if seed is None else seed % 2**63,
        top_k=0 if top_k in (None, -1) else top_k,
        min_p=fields.number(body, "min_p", 0.0, lo=0.0, hi=1.0),
        repetition_penalty=fields.number(body, "repetition_penalty", 1.0, lo=1e-9),
        presence_penalty=fields.number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=fields.number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        logit_bias=fields.logit_bias(body, served.vocab_size),
    )


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:
        return fields.integer(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if not fields.flag(body, "logprobs", False):
        if body.get("top_logprobs") not in (None, 0):
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return fields.integer(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)


def _stream_usage(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """``stream_options``: (``include_usage``, ``continuous_usage_stats``)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise BadRequest("'stream_options' needs 'stream': true", "stream_options")
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    fields.refuse_unknown(options, frozenset({"include_usage", "continuous_usage_stats"}), {})
    return (
        fields.flag(options, "include_usage", False),
        fields.flag(options, "continuous_usage_stats", False),
    )


def parse(body: dict[str, Any], served: Served, chat: bool) -> GenerateRequest:
    """``body`` of ``POST /v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    if chat:
        fields.refuse_unknown(body, CHAT, CHAT_OFF)
    else:
        fields.refuse_unknown(body, COMPLETION, COMPLETION_OFF)
    model = check_model(body, served)
    echo = False if chat else fields.flag(body, "echo")
    prompts = chat_prompt(body, served) if chat else _completion_prompts(body, served)
    for p in prompts:
        if not p.token_ids:
            raise BadRequest("the prompt is empty: at least one token is needed", "prompt")
        fields.check_vocab(p.token_ids, served.vocab_size, "prompt")
    max_tokens = _max_tokens(body, chat, echo, prompts, served)
    n = fields.integer(body, "n", 1, lo=1, hi=MAX_SEQUENCES)
    best_of = fields.integer(body, "best_of", n, lo=1, hi=MAX_SEQUENCES)
    assert n is not None and best_of is not None
    if best_of < n:
        raise BadRequest(f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
    stream = fields.flag(body, "stream")
    if stream and best_of > n:
        raise BadRequest("'best_of' > 'n' cannot be streamed", "best_of")
    if best_of * len(prompts) > MAX_SEQUENCES:
        raise BadRequest(
            f"{len(prompts)} prompts x {best_of} sequences exceed this server's "
            f"{MAX_SEQUENCES} per request",
            "n",
        )
    min_tokens = fields.integer(body, "min_tokens", 0, lo=0, hi=max_tokens)
    assert min_tokens is not None
    logprobs = _logprobs(body, chat)
    include_usage, continuous_usage = _stream_usage(body, stream)
    return GenerateRequest(
        chat=chat,
        model=model,
        prompts=tuple(prompts),
        n=n,
        best_of=best_of,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        params=_params(body, served),
        stop=fields.texts(body, "stop"),
        stop_token_ids=fields.token_ids(body, "stop_token_ids", served.vocab_size),
        include_stop_str_in_output=fields.flag(body, "include_stop_str_in_output"),
        ignore_eos=fields.flag(body, "ignore_eos"),
        skip_special_tokens=fields.flag(body, "skip_special_tokens", True),
        logprobs=logprobs,
        echo=echo,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=fields.text(body, "user"),
        return_token_ids=fields.flag(body, "return_token_ids"),
        transfer=body.get("kv_transfer_params"),
    )
