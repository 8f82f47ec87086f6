"""The served model's routes as OpenAI clients and vLLM's tools call them, on the app
itself (no rank processes): /tokenize, /detokenize, /version, /v1/models/{model_id};
a 400 names the field, another model is a 404, the API key guards the tokenizer."""

from __future__ import annotations

import asyncio
import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from support.tokenizer import make_tokenizer
from vertumnus.protocol.request import Served, parse
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.server.app import build_app

KEY = "api-key-0123456789abcdef"
MAX_LEN = 65536  # the tiny preset's positions
Call = tuple[str, str, Any]  # method, path, JSON body (None: none)


def answers(
    calls: list[Call], cfg: ServeConfig | None = None, tokenizer: Tokenizer | None = None
) -> list[tuple[int, Any]]:
    """(status, JSON body) of each call, against an app whose coordinator never
    started; ``tokenizer``: the tiny preset's byte-level one unless given."""

    async def main() -> list[tuple[int, Any]]:
        coord = Coordinator(cfg or ServeConfig())
        tok = tokenizer or Tokenizer.for_model(coord.model_dir, coord.model_cfg.vocab_size)
        async with TestClient(TestServer(build_app(coord, tok))) as client:
            out = []
            for method, path, body in calls:
                headers = {"Authorization": f"Bearer {KEY}"} if path.endswith("#key") else {}
                resp = await client.request(
                    method, path.removesuffix("#key"), json=body, headers=headers
                )
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(main())


def refused(status_body: tuple[int, Any], status: int, param: str | None) -> str:
    code, body = status_body
    error = body["error"]
    assert (code, error["code"], error["param"]) == (status, status, param), body
    assert error["type"] == ("NotFoundError" if status == 404 else "invalid_request_error")
    return str(error["message"])


@pytest.mark.timeout(60)
def test_tokenize_a_prompt_and_a_chat_as_a_completion_would() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text, strs, chat, cont = answers(
        [
            ("POST", "/tokenize", {"prompt": "héllo", "model": "tiny"}),
            ("POST", "/tokenize", {"prompt": "ab", "return_token_strs": True}),
            ("POST", "/tokenize", {"messages": messages}),
            (
                "POST",
                "/tokenize",
                {
                    "messages": [*messages, {"role": "assistant", "content": "Hel"}],
                    "add_generation_prompt": False,
                    "continue_final_message": True,
                },
            ),
        ]
    )
    tokens = list("héllo".encode())
    assert text == (
        200,
        {"count": 6, "max_model_len": MAX_LEN, "tokens": tokens, "token_strs": None},
    )
    assert strs[1]["tokens"] == [97, 98] and strs[1]["token_strs"] == ["a", "b"]
    served = Served("tiny", Tokenizer.for_model(None, 1024), 1024, MAX_LEN)
    as_chat = parse({"messages": messages}, served, chat=True).prompts[0]
    assert chat[0] == 200 and chat[1]["tokens"] == as_chat.token_ids
    assert chat[1]["count"] == len(as_chat.token_ids)
    assert bytes(chat[1]["tokens"]).decode().endswith("<|im_start|>assistant\n")
    assert bytes(cont[1]["tokens"]).decode().endswith("<|im_start|>assistant\nHel")


@pytest.mark.timeout(60)
def test_a_hugging_face_tokenizer_spells_its_tokens_and_round_trips(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    end = make_tokenizer(tmp_path, 1024)
    tokenizer = Tokenizer.for_model(str(tmp_path), 1024)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello, world! The prefill pool."
    ids = reference.encode(text)
    tokenized, detok, specials, bad = answers(
        [
            ("POST", "/tokenize", {"prompt": text, "return_token_strs": True}),
            ("POST", "/detokenize", {"tokens": ids}),
            ("POST", "/detokenize", {"tokens": [*ids, end], "model": "tiny"}),
            ("POST", "/detokenize", {"tokens": [*ids, 1024]}),
        ],
        tokenizer=tokenizer,
    )
    assert tokenized[1]["tokens"] == ids
    assert tokenized[1]["token_strs"] == reference.convert_ids_to_tokens(ids)
    assert any(s.startswith("Ġ") for s in tokenized[1]["token_strs"])
    assert detok == (200, {"prompt": text})
    assert specials[1]["prompt"] == text + "<|im_end|>"  # special tokens kept, as vLLM
    assert "1024" in refused(bad, 400, "tokens")


USER = [{"role": "user", "content": "hi"}]
CONTINUE = "continue_final_message"
BAD: list[tuple[str, dict[str, Any], int, str]] = [  # route, body, status, param
    ("/tokenize", {"prompt": "x", "temperature": 0}, 400, "temperature"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": USER, CONTINUE: True}, 400, CONTINUE),  # with the generation prompt
    ("/tokenize", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/tokenize", {"messages": USER, "prompt": "x"}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": USER, "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
]


@pytest.mark.timeout(60)
def test_bad_bodies_are_a_400_naming_the_field_and_another_model_a_404() -> None:
    results = answers([("POST", route, body) for route, body, _, _ in BAD])
    for result, (_, _, status, param) in zip(results, BAD, strict=True):
        message = refused(result, status, param)
        if status == 404:
            assert message == "The model `other` does not exist."


@pytest.mark.timeout(60)
def test_the_model_card_and_the_version() -> None:
    listed, card, other, slashed, version = answers(
        [
            ("GET", "/v1/models", None),
            ("GET", "/v1/models/tiny", None),
            ("GET", "/v1/models/other", None),
            ("GET", "/v1/models/org/tiny", None),
            ("GET", "/version", None),
        ]
    )
    assert card == (200, listed[1]["data"][0])
    assert card[1] == {
        "id": "tiny",
        "object": "model",
        "owned_by": "vertumnus",
        "max_model_len": MAX_LEN,
    }
    assert refused(other, 404, "model") == "The model `other` does not exist."
    assert "org/tiny" in refused(slashed, 404, "model")
    assert version == (200, {"version": importlib.metadata.version("vertumnus")})


@pytest.mark.timeout(60)
def test_the_api_key_guards_the_tokenizer_but_not_the_version() -> None:
    results = answers(
        [
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [120]}),
            ("GET", "/v1/models/tiny", None),
            ("POST", "/tokenize#key", {"prompt": "x"}),
            ("POST", "/detokenize#key", {"tokens": [120]}),
            ("GET", "/v1/models/tiny#key", None),
            ("GET", "/version", None),
        ],
        cfg=ServeConfig(api_key=KEY),
    )
    assert [status for status, _ in results] == [401, 401, 401, 200, 200, 200, 200]
    assert results[4][1] == {"prompt": "x"}


@pytest.mark.timeout(60)
def test_a_stock_openai_client_retrieves_the_model() -> None:
    openai = pytest.importorskip("openai")

    async def main() -> tuple[Any, type[BaseException] | None]:
        coord = Coordinator(ServeConfig())
        tok = Tokenizer.for_model(None, coord.model_cfg.vocab_size)
        async with TestClient(TestServer(build_app(coord, tok))) as client:
            url = str(client.make_url("/v1"))
            api = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
            model = await api.models.retrieve("tiny")
            try:
                await api.models.retrieve("other")
                raised = None
            except openai.APIStatusError as exc:
                raised = type(exc)
            await api.close()
            return model, raised

    model, raised = asyncio.run(main())
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "vertumnus")
    assert raised is openai.NotFoundError
