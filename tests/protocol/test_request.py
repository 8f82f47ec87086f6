"""Every field of a completions or chat request works or is refused with a 400 (404
for a model not served) that names it; the defaults are OpenAI's and vLLM's."""

from __future__ import annotations

from typing import Any

import pytest

from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.request import COMPLETION_MAX_TOKENS, Served, parse
from vertumnus.protocol.tokenizer import Tokenizer

SERVED = Served("tiny", Tokenizer.for_model(None, 1024), vocab_size=1024, max_model_len=64)


def completion(**body: Any) -> Any:
    return parse({"prompt": "hello", **body}, SERVED, chat=False)


def chat(**body: Any) -> Any:
    return parse({"messages": [{"role": "user", "content": "hi"}], **body}, SERVED, chat=True)


def refused(body: dict[str, Any], chat_api: bool, param: str, status: int = 400) -> str:
    with pytest.raises(BadRequest) as info:
        parse(body, SERVED, chat=chat_api)
    assert (info.value.param, info.value.status) == (param, status), str(info.value)
    return str(info.value)


def test_completion_defaults() -> None:
    req = completion()
    assert req.max_tokens == COMPLETION_MAX_TOKENS == 16
    assert (req.n, req.best_of, req.min_tokens, req.logprobs, req.echo) == (1, 1, 0, None, False)
    assert req.params.temperature == 1.0 and req.params.top_k == 0
    assert req.prompts[0].token_ids == list(b"hello") and req.prompts[0].text == "hello"
    assert not req.stream and not req.include_usage and req.model == "tiny"


def test_chat_defaults_to_the_rest_of_the_context() -> None:
    req = chat()
    prompt = req.prompts[0].token_ids
    assert req.chat and req.max_tokens == SERVED.max_model_len - len(prompt)
    assert bytes(prompt).decode().endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("prompt", "want"),
    [
        ("ab", [[97, 98]]),
        (["ab", "c"], [[97, 98], [99]]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
    ],
)
def test_prompt_forms(prompt: Any, want: list[list[int]]) -> None:
    assert [p.token_ids for p in completion(prompt=prompt).prompts] == want


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [[1], "a"], 3, None, [True]])
def test_bad_prompts(prompt: Any) -> None:
    refused({"prompt": prompt}, False, "prompt")


def test_tokens_outside_the_vocabulary() -> None:
    assert "vocabulary" in refused({"prompt": [1, 5000]}, False, "prompt")
    assert "vocabulary" in refused(
        {"prompt": "x", "stop_token_ids": [9999]}, False, "stop_token_ids"
    )
    assert "vocabulary" in refused({"prompt": "x", "logit_bias": {"9999": 1}}, False, "logit_bias")


def test_context_length() -> None:
    """Prompt plus max_tokens beyond the context: a 400, as vLLM answers."""
    assert "maximum context length is 64" in refused(
        {"prompt": "a" * 60, "max_tokens": 5}, False, "max_tokens"
    )
    assert completion(prompt="a" * 60).max_tokens == 4  # the default fits what is left
    refused({"prompt": "a" * 64}, False, "prompt")
    assert completion(prompt="a" * 59, max_tokens=5).max_tokens == 5


def test_model_not_served_is_a_404() -> None:
    message = refused({"prompt": "x", "model": "gpt-4"}, False, "model", status=404)
    assert message == "The model `gpt-4` does not exist."
    assert completion(model="tiny").model == "tiny"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", "tail"),
        ("frobnicate", 1),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", True),
        ("n", 0),
        ("best_of", 0),
        ("temperature", -0.5),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logprobs", 21),
        ("logprobs", True),
        ("echo", 1),
        ("stop", ""),
        ("stop", [1]),
        ("seed", 1.5),
        ("stream", "yes"),
        ("stream_options", {"include_usage": True}),
        ("user", 5),
        ("min_tokens", 17),
        ("logit_bias", {"1": 200}),
        ("ignore_eos", "no"),
    ],
)
def test_completion_fields_refused(field: str, value: Any) -> None:
    refused({"prompt": "x", field: value}, False, field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
        ("echo", True),
        ("best_of", 2),
        ("suffix", "x"),
        ("top_logprobs", 3),
        ("logprobs", 3),
        ("max_completion_tokens", 0),
        ("add_generation_prompt", 1),
        ("chat_template_kwargs", "x"),
    ],
)
def test_chat_fields_refused(field: str, value: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    refused(body, True, field)


def test_off_values_are_accepted() -> None:
    req = chat(tools=[], tool_choice="none", response_format={"type": "text"}, store=False)
    assert req.chat
    assert completion(suffix=None).prompts


def test_sampling_fields() -> None:
    req = completion(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=-1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"7": 3, "3": -100},
        min_tokens=2,
        max_tokens=4,
        stop=["\n", "END"],
        stop_token_ids=[10],
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=3,
        echo=True,
        n=2,
        best_of=3,
    )
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.9, 5, 0.1)
    assert p.seed == 2**63 - 1 and p.logit_bias == ((3, -100.0), (7, 3.0))
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.5, -0.5)
    assert (req.min_tokens, req.max_tokens, req.n, req.best_of) == (2, 4, 2, 3)
    assert req.stop == ("\n", "END") and req.stop_token_ids == (10,)
    assert req.logprobs == 3 and req.prompt_logprobs == 3 and req.ignore_eos
    assert completion(top_k=-1).params.top_k == 0


def test_echo_allows_zero_tokens() -> None:
    req = completion(echo=True, logprobs=1, max_tokens=0)
    assert req.max_tokens == 0 and not req.needs_decode and req.prompt_logprobs == 1


def test_best_of_rules() -> None:
    refused({"prompt": "x", "n": 3, "best_of": 2}, False, "best_of")
    refused({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, False, "best_of")
    refused({"prompt": ["a"] * 3, "n": 50}, False, "n")


def test_chat_logprobs_and_usage_options() -> None:
    req = chat(logprobs=True, top_logprobs=4, stream=True, stream_options={"include_usage": True})
    assert req.logprobs == 4 and req.include_usage and req.prompt_logprobs is None
    assert chat(logprobs=True).logprobs == 0 and chat().logprobs is None
    assert chat(max_completion_tokens=3).max_tokens == 3
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    req = chat(**body, stream_options={"continuous_usage_stats": True})  # guidellm sends it
    assert req.continuous_usage and not req.include_usage
    assert not chat(**body, stream_options={"include_usage": True}).continuous_usage
    refused({**body, "stream_options": {"usage_every": 2}}, True, "usage_every")


def test_no_tokenizer_refuses_text() -> None:
    served = Served("m", Tokenizer.for_model(None, 100), vocab_size=100, max_model_len=64)
    with pytest.raises(BadRequest, match="token ids") as info:
        parse({"prompt": "x"}, served, chat=False)
    assert info.value.param == "prompt"
    assert parse({"prompt": [1, 2]}, served, chat=False).prompts[0].token_ids == [1, 2]
