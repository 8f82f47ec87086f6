"""Answers in OpenAI's shapes: stop strings cut the text (held back while streaming),
stop ids add no text, logprobs as completions and chat name them, echo, best_of's
choice by cumulative log-probability, and usage only where asked."""

from __future__ import annotations

from typing import Any

from vertumnus.protocol.answers import Answer
from vertumnus.protocol.request import Served, parse
from vertumnus.protocol.sampling_params import TokenLogprobs
from vertumnus.protocol.tokenizer import Tokenizer

TOK = Tokenizer.for_model(None, 1024)
SERVED = Served("tiny", TOK, vocab_size=1024, max_model_len=256)


def request(chat: bool = False, **body: Any) -> Any:
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "ab"}
    return parse({**base, **body}, SERVED, chat=chat)


def feed(answer: Answer, index: int, text: str, last: str | None = "length") -> list[bool]:
    """The characters of ``text`` as tokens (byte-level) into choice ``index``."""
    choice = answer.choices[index]
    out = []
    for i, ch in enumerate(text.encode()):
        finish = last if i == len(text) - 1 else None
        out.append(choice.add(TokenLogprobs(ch, -0.5, ((ch, -0.5), (0, -3.0))), finish))
    return out


def test_whole_completion() -> None:
    answer = Answer(request(max_tokens=3), TOK)
    feed(answer, 0, "xyz")
    body = answer.body()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == "xyz" and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None and choice["token_ids"] == list(b"xyz")
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_stop_string_cuts_and_ends() -> None:
    answer = Answer(request(stop=["END", "\n\n"]), TOK)
    stops = feed(answer, 0, "abEND", last=None)
    assert stops == [False, False, False, False, True]  # the decoder stops here
    choice = answer.choices[0]
    assert choice.text == "ab" and choice.finish_reason == "stop" and choice.stop_reason == "END"
    kept = Answer(request(stop=["END"], include_stop_str_in_output=True), TOK)
    feed(kept, 0, "abEND", last=None)
    assert kept.choices[0].text == "abEND"


def test_stream_holds_back_a_possible_stop_string() -> None:
    answer = Answer(request(stop=["END"], stream=True), TOK)
    choice = answer.choices[0]
    sent = []
    for ch in "abEN":
        choice.add(TokenLogprobs(ord(ch), -1.0), None)
        sent.append(choice.release())
    # The last len("END") - 1 characters wait: they may begin "END" (vLLM's rule).
    assert sent == ["", "", "a", "b"]
    choice.add(TokenLogprobs(ord("X"), -1.0), None)
    assert choice.release() == "E"
    choice.add(TokenLogprobs(ord("Y"), -1.0), "length")
    assert choice.release() == "NXY"


def test_stop_token_id_adds_no_text() -> None:
    answer = Answer(request(stop_token_ids=[ord("!")]), TOK)
    feed(answer, 0, "hi!", last="stop")
    choice = answer.choices[0]
    assert choice.text == "hi" and choice.stop_reason == ord("!") and len(choice.token_ids) == 3


def test_completion_logprobs_and_echo() -> None:
    req = request(logprobs=2, echo=True, max_tokens=2)
    prompt = [(97, None), (98, TokenLogprobs(98, -1.25, ((98, -1.25), (99, -2.0))))]
    answer = Answer(req, TOK, [prompt])
    feed(answer, 0, "cd")
    (choice,) = answer.body()["choices"]
    assert choice["text"] == "abcd"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "d"]
    assert lp["token_logprobs"] == [None, -1.25, -0.5, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -1.25, "c": -2.0}
    assert lp["text_offset"] == [0, 1, 2, 3]


def test_chat_answer_and_logprobs() -> None:
    answer = Answer(request(chat=True, logprobs=True, top_logprobs=1, max_tokens=2), TOK)
    feed(answer, 0, "ok", last="stop")
    body = answer.body()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "ok"}
    first = choice["logprobs"]["content"][0]
    assert first["token"] == "o" and first["logprob"] == -0.5 and first["bytes"] == [111]
    assert first["top_logprobs"][0] == {"token": "o", "logprob": -0.5, "bytes": [111]}


def test_best_of_keeps_the_most_likely() -> None:
    answer = Answer(request(n=1, best_of=3, max_tokens=1), TOK)
    for index, logprob in enumerate([-3.0, -0.1, -2.0]):
        answer.choices[index].add(TokenLogprobs(65 + index, logprob), "length")
    body = answer.body()
    assert [c["text"] for c in body["choices"]] == ["B"]
    assert body["choices"][0]["index"] == 0 and body["usage"]["completion_tokens"] == 3


def test_n_and_prompts_are_prompt_major() -> None:
    answer = Answer(request(prompt=["a", "b"], n=2, max_tokens=1), TOK)
    for index in range(4):
        answer.choices[index].add(TokenLogprobs(48 + index, -1.0), "length")
    assert [c["text"] for c in answer.body()["choices"]] == ["0", "1", "2", "3"]
    assert answer.body()["usage"]["prompt_tokens"] == 2


def test_chat_stream_events() -> None:
    req = request(chat=True, stream=True, stream_options={"include_usage": True}, max_tokens=2)
    answer = Answer(req, TOK)
    choice = answer.choices[0]
    choice.add(TokenLogprobs(ord("o"), -1.0), None)
    first = answer.events(choice)
    assert [e["choices"][0]["delta"] for e in first] == [
        {"role": "assistant", "content": ""},
        {"content": "o"},
    ]
    assert all(e["object"] == "chat.completion.chunk" for e in first)
    choice.add(TokenLogprobs(ord("k"), -1.0), "length")
    (last,) = answer.events(choice)
    assert last["choices"][0]["delta"] == {"content": "k"}
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last
    usage = answer.usage_event()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2


def test_continuous_usage_stats_put_the_usage_so_far_on_every_event() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    answer = Answer(request(chat=True, stream=True, stream_options=options, max_tokens=2), TOK)
    choice = answer.choices[0]
    choice.add(TokenLogprobs(ord("o"), -1.0), None)
    first = answer.events(choice)
    assert len(first) == 2 and all(e["usage"]["completion_tokens"] == 1 for e in first)
    choice.add(TokenLogprobs(ord("k"), -1.0), "length")
    (last,) = answer.events(choice)
    prompt = len(answer.req.prompts[0].token_ids)  # the chat template's
    assert last["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 2,
        "total_tokens": prompt + 2,
    }


def test_completion_stream_with_echo() -> None:
    answer = Answer(request(stream=True, echo=True, max_tokens=2), TOK)
    choice = answer.choices[0]
    choice.add(TokenLogprobs(ord("c"), -1.0), None)
    (first,) = answer.events(choice)
    assert first["choices"][0]["text"] == "abc"
    choice.add(TokenLogprobs(ord("d"), -1.0), "length")
    (last,) = answer.events(choice)
    assert last["choices"][0]["text"] == "d" and last["choices"][0]["finish_reason"] == "length"


def test_completion_stream_has_an_event_for_every_token() -> None:
    """A token with no text of its own (an incomplete character, held back) still
    has its event, with its id and no text, as vLLM streams completions."""
    answer = Answer(request(stream=True, max_tokens=3), TOK)
    choice = answer.choices[0]
    sent: list[tuple[list[int], str]] = []
    for token, finish in ((0xC3, None), (0xA9, None), (ord("x"), "length")):  # "é", "x"
        choice.add(TokenLogprobs(token, -1.0), finish)
        sent += [
            (e["choices"][0]["token_ids"], e["choices"][0]["text"]) for e in answer.events(choice)
        ]
    assert sent == [([0xC3], ""), ([0xA9], "é"), ([ord("x")], "x")]


def test_return_token_ids_puts_a_chat_choices_ids_on_it() -> None:
    answer = Answer(request(chat=True, max_tokens=2, return_token_ids=True), TOK)
    choice = answer.choices[0]
    choice.add(TokenLogprobs(ord("o"), -1.0), None)
    choice.add(TokenLogprobs(ord("k"), -1.0), "length")
    assert answer.body()["choices"][0]["token_ids"] == [ord("o"), ord("k")]
    plain = Answer(request(chat=True, max_tokens=1), TOK)
    plain.choices[0].add(TokenLogprobs(ord("o"), -1.0), "length")
    assert "token_ids" not in plain.body()["choices"][0]
    streamed = Answer(request(chat=True, stream=True, max_tokens=2, return_token_ids=True), TOK)
    choice = streamed.choices[0]
    choice.add(TokenLogprobs(0xC3, -1.0), None)  # half of a character: no text yet
    events = streamed.events(choice)
    assert [e["choices"][0].get("token_ids") for e in events] == [None, [0xC3]]
