"""``POST /v1/completions`` and ``/v1/chat/completions`` answered by the pool itself
(``max_tokens`` 0 with echo, or 1, without stream), on the app in process over fake
ranks (whose logits are all zero: greedy picks id 0): OpenAI's shapes with the pool's
share (worker, CP degree, timings), lists of prompts in order with their cached
tokens summed, n and best_of, echo with the prompt's log-probabilities, a hand-off
for one prompt; the model check (404), and a 400 that names each refused field, on
this path and on the decode path, before anything is prefilled. Exact tokens and
log-probabilities against transformers: ``tests/e2e/test_openai_api.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from support.pool_app import FakeDecode, pool_app, post
from vertumnus.protocol.request import CHAT_OFF, COMPLETION_OFF

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
GREEDY = {"max_tokens": 1, "temperature": 0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_one_token_from_the_pool(tmp_path: Path, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = CHAT if chat else {"prompt": "hello"}

    async def main() -> None:
        async with pool_app(tmp_path) as (client, coord):
            status, out = await post(client, path, {**base, **GREEDY, "model": "tiny"})
            assert status == 200, out
            assert out["object"] == ("chat.completion" if chat else "text_completion")
            assert out["model"] == "tiny" and len(out["choices"]) == 1
            (choice,) = out["choices"]
            assert choice["finish_reason"] == "length" and choice["index"] == 0
            if chat:
                assert choice["message"] == {"role": "assistant", "content": "\x00"}
            else:
                assert choice["text"] == "\x00" and choice["token_ids"] == [0]
            usage = out["usage"]
            assert usage["completion_tokens"] == 1
            assert usage["total_tokens"] == usage["prompt_tokens"] + 1
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
            assert (out["worker"], out["cp_degree"]) == (0, 2)
            timings = out["timings"]
            assert timings["ttft_s"] >= timings["prefill_s"] > 0 and timings["handoff_s"] == 0
            # an end id finishes the choice with "stop" (and adds no text)
            stop = {**base, **GREEDY, "stop_token_ids": [0]}
            status, out = await post(client, path, stop)
            (choice,) = out["choices"]
            assert status == 200 and choice["finish_reason"] == "stop"
            assert choice["stop_reason"] == 0
            assert coord.handoffs.counts["opened"] == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_list_of_prompts_answers_in_order_with_their_cached_tokens_summed(
    tmp_path: Path,
) -> None:
    shared = "a" * 32  # two whole blocks of the byte-level tokenizer

    async def main() -> None:
        async with pool_app(tmp_path) as (client, _):
            body = {"prompt": shared + "q", **GREEDY}
            status, first = await post(client, "/v1/completions", body)
            assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            prompts = [shared + "x", "bcd", shared + "yz"]
            body = {"prompt": prompts, "echo": True, **GREEDY}
            status, out = await post(client, "/v1/completions", body)
            assert status == 200, out
            assert [c["index"] for c in out["choices"]] == [0, 1, 2]
            assert [c["text"] for c in out["choices"]] == [p + "\x00" for p in prompts]
            usage = out["usage"]
            assert usage["prompt_tokens"] == 33 + 3 + 34 and usage["completion_tokens"] == 3
            assert usage["prompt_tokens_details"] == {"cached_tokens": 32 + 0 + 32}

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_n_and_best_of_copies_of_each_prompt(tmp_path: Path) -> None:
    async def main() -> None:
        async with pool_app(tmp_path) as (client, _):
            body = {"prompt": ["ab", "cd"], "n": 2, "best_of": 3, "echo": True, "logprobs": 1}
            status, out = await post(client, "/v1/completions", {**body, **GREEDY})
            assert status == 200, out
            choices = out["choices"]
            assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt-major, n per prompt
            assert [c["text"] for c in choices] == ["ab\x00", "ab\x00", "cd\x00", "cd\x00"]
            assert out["usage"]["completion_tokens"] == 6  # best_of copies of each decoded
            for c in choices:  # the prompt's two tokens (none for the first), then the new one
                assert c["logprobs"]["tokens"] == [c["text"][0], c["text"][1], "\x00"]
                assert c["logprobs"]["token_logprobs"][0] is None
                assert len(c["logprobs"]["top_logprobs"]) == 3
            chat = {**CHAT, **GREEDY, "n": 2, "logprobs": True, "top_logprobs": 2}
            status, out = await post(client, "/v1/chat/completions", chat)
            assert status == 200 and len(out["choices"]) == 2
            content = out["choices"][1]["logprobs"]["content"]
            assert len(content) == 1 and len(content[0]["top_logprobs"]) == 2

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_echo_alone_answers_the_prompts_logprobs(tmp_path: Path) -> None:
    """``max_tokens`` 0 with echo and logprobs (the loglikelihood request): no token,
    each choice ends with "length"; the fake ranks' log-probabilities are all 0."""

    async def main() -> None:
        async with pool_app(tmp_path) as (client, _):
            body = {"prompt": ["abcd", "xy"], "max_tokens": 0, "echo": True, "logprobs": 2}
            status, out = await post(client, "/v1/completions", body)
            assert status == 200, out
            first, second = out["choices"]
            assert (first["text"], first["token_ids"], first["finish_reason"]) == (
                "abcd",
                [],
                "length",
            )
            assert first["logprobs"]["tokens"] == ["a", "b", "c", "d"]
            assert first["logprobs"]["token_logprobs"] == [None, 0.0, 0.0, 0.0]
            assert first["logprobs"]["text_offset"] == [0, 1, 2, 3]
            assert second["logprobs"]["tokens"] == ["x", "y"]
            assert out["usage"]["completion_tokens"] == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_hand_off_of_one_prompt_but_not_of_several(tmp_path: Path) -> None:
    keep = {"kv_transfer_params": {"do_remote_decode": True}}

    async def main() -> None:
        async with pool_app(tmp_path) as (client, coord):
            body = {"prompt": [1, 2, 3, 4], "max_tokens": 1, **keep}
            status, out = await post(client, "/v1/completions", body)
            assert status == 200, out
            params = out["kv_transfer_params"]
            assert params["do_remote_prefill"] and params["num_tokens"] == 3
            assert coord.handoffs.view()["open"] == 1
            body = {"prompt": [[1, 2], [3, 4]], "max_tokens": 1, **keep}
            status, out = await post(client, "/v1/completions", body)
            assert status == 400 and out["error"]["param"] == "kv_transfer_params"
            assert coord.handoffs.counts["opened"] == 1

    asyncio.run(main())


REFUSED: list[tuple[bool, str, Any]] = [
    *((False, name, "x" if name == "suffix" else 1) for name in COMPLETION_OFF),
    (False, "frobnicate", 1),
    (False, "kv_transfer_params", []),
    (False, "best_of", 0),
    *((True, name, [{"x": 1}] if name != "response_format" else {"type": "json_object"})
      for name in CHAT_OFF),
    (True, "frobnicate", 1),
    (True, "echo", True),
    (True, "top_logprobs", 2),
]  # fmt: skip


@pytest.mark.timeout(120)
def test_each_refused_field_is_named_on_both_paths(tmp_path: Path) -> None:
    """The pool's own path (``max_tokens`` 1) and the decode path (5): the same 400
    naming the field, and nothing prefilled nor sent to the decode server."""
    decode = FakeDecode()

    async def main() -> None:
        async with pool_app(tmp_path, decode) as (client, coord):
            for chat, name, value in REFUSED:
                path = "/v1/chat/completions" if chat else "/v1/completions"
                base = CHAT if chat else {"prompt": "hi"}
                for max_tokens in (1, 5):
                    body = {**base, "max_tokens": max_tokens, name: value}
                    status, out = await post(client, path, body)
                    assert (status, out["error"]["param"]) == (400, name), (body, out)
                    assert out["error"]["type"] == "invalid_request_error"
            status, out = await post(client, "/v1/completions", {"prompt": "hi", "model": "x"})
            assert status == 404 and out["error"]["param"] == "model"
            assert out["error"]["message"] == "The model `x` does not exist."
            assert decode.calls == [] and coord.handoffs.counts["opened"] == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_without_a_decode_server_only_the_pools_own_answers(tmp_path: Path) -> None:
    async def main() -> None:
        async with pool_app(tmp_path) as (client, _):
            for body, param in (
                ({"prompt": "hi"}, "max_tokens"),  # the default is 16
                ({"prompt": "hi", "max_tokens": 5}, "max_tokens"),
                ({"prompt": "hi", "max_tokens": 1, "stream": True}, "stream"),
                ({**CHAT, "stream": True}, "stream"),
                (CHAT, "max_tokens"),  # chat's default: the rest of the context
            ):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                status, out = await post(client, path, body)
                assert (status, out["error"]["param"]) == (400, param), (body, out)
                assert "no decode server" in out["error"]["message"]

    asyncio.run(main())
