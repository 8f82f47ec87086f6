"""``/openapi.json`` documents every route the app serves, the completions and chat
requests with exactly the fields ``protocol/request.py`` reads, and shapes that
the answers really have (checked with a JSON Schema validator where installed)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from vertumnus.protocol.answers import Answer
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.request import CHAT, CHAT_OFF, COMPLETION, COMPLETION_OFF, Served, parse
from vertumnus.protocol.sampling_params import TokenLogprobs
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.server import openai_schemas as schemas
from vertumnus.server.app import build_app
from vertumnus.server.openapi import OPENAPI, served_document

TOK = Tokenizer.for_model(None, 1024)
SERVED = Served("tiny", TOK, vocab_size=1024, max_model_len=256)


def served_routes() -> set[tuple[str, str]]:
    app = build_app(Coordinator(ServeConfig()), TOK)
    out = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method != "HEAD" and not path.startswith("/dashboard"):
            out.add((route.method.lower(), path.replace("{model_id:.+}", "{model_id}")))
    return out


def test_every_route_is_documented() -> None:
    documented = {(method, path) for path, item in OPENAPI["paths"].items() for method in item}
    served = served_routes()
    assert served - documented == set()
    assert documented - served == set()
    for path in ("/tokenize", "/detokenize", "/version", "/v1/models/{model_id}"):
        assert path in OPENAPI["paths"]
    assert "/v1/chat/completions" in OPENAPI["paths"]


def request_schema(path: str) -> dict[str, Any]:
    body: dict[str, Any] = OPENAPI["paths"][path]["post"]["requestBody"]
    schema: dict[str, Any] = body["content"]["application/json"]["schema"]
    return schema


def test_the_openai_requests_list_exactly_the_fields_read() -> None:
    completion = request_schema("/v1/completions")
    chat = request_schema("/v1/chat/completions")
    assert set(completion["properties"]) == COMPLETION | set(COMPLETION_OFF)
    assert set(chat["properties"]) == CHAT | set(CHAT_OFF)
    assert completion["required"] == ["prompt"] and chat["required"] == ["messages"]
    assert chat["properties"]["tools"]["enum"] == [None, []]
    assert chat["properties"]["logprobs"] == {"type": "boolean"}
    assert completion["properties"]["logprobs"]["maximum"] == 20
    error = schemas.ERROR["properties"]["error"]["properties"]
    assert set(error) == {"message", "type", "param", "code"}
    components = OPENAPI["components"]["schemas"]
    refs = set()
    for item in OPENAPI["paths"].values():
        for text in json.dumps(item).split('"$ref": "#/components/schemas/')[1:]:
            refs.add(text.split('"')[0])
    assert refs == {"TextCompletion", "ChatCompletion"} and refs <= set(components)
    # a stream's events are named in its description: data: <ChatCompletionChunk>
    assert "<ChatCompletionChunk>" in json.dumps(OPENAPI["paths"]["/v1/chat/completions"])
    assert "ChatCompletionChunk" in components


def answered_chat(stream: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    answer = Answer(parse(body, SERVED, chat=True), TOK)
    choice = answer.choices[0]
    events = []
    for token, finish in ((104, None), (105, "length")):
        choice.add(TokenLogprobs(token, -0.5, ((token, -0.5),)), finish)
        events += answer.events(choice)
    return answer.body(), [*events, answer.usage_event()]


def test_the_documented_shapes_are_the_answers_shapes() -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")

    def check(schema: dict[str, Any], instance: Any) -> None:
        jsonschema_rs.validator_for(schema).validate(instance)

    whole, _ = answered_chat(stream=False)
    check(schemas.CHAT_COMPLETION, whole)
    _, events = answered_chat(stream=True)
    assert len(events) >= 3
    for event in events:
        check(schemas.CHAT_CHUNK, event)
    completion = Answer(parse({"prompt": "ab", "max_tokens": 1}, SERVED, chat=False), TOK)
    completion.choices[0].add(TokenLogprobs(99, -1.0), "length")
    check(schemas.TEXT_COMPLETION, completion.body())
    for accepted in (
        {"prompt": [[1, 2], [3]], "n": 2, "best_of": 3, "echo": True, "logprobs": 5},
        {"prompt": "x", "stop": "END", "stream": True, "stream_options": {"include_usage": True}},
    ):
        parse(accepted, SERVED, chat=False)
        check(request_schema("/v1/completions"), accepted)
    with pytest.raises(ValueError):
        check(request_schema("/v1/completions"), {"prompt": "x", "suffix": "y"})
    chat = request_schema("/v1/chat/completions")
    for refused in (
        {"messages": [], "tools": []},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    ):
        with pytest.raises(ValueError):
            check(chat, refused)
        with pytest.raises(BadRequest):
            parse(refused, SERVED, chat=True)


@pytest.mark.timeout(60)
def test_the_small_routes_answer_as_documented() -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    calls = [
        ("POST", "/tokenize", {"prompt": "ab", "return_token_strs": True}),
        ("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/detokenize", {"tokens": [104, 105]}),
        ("GET", "/v1/models/tiny", None),
        ("GET", "/v1/models", None),
        ("GET", "/version", None),
        ("POST", "/detokenize", {"tokens": [99999]}),
        ("GET", "/v1/models/other", None),
    ]

    async def main() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(build_app(Coordinator(ServeConfig()), TOK))) as client:
            out = []
            for method, path, body in calls:
                resp = await client.request(method, path, json=body)
                out.append((resp.status, await resp.json()))
            return out

    for (method, path, _), (status, body) in zip(calls, asyncio.run(main()), strict=True):
        documented = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
        response = OPENAPI["paths"][documented][method.lower()]["responses"][str(status)]
        schema = response["content"]["application/json"]["schema"]
        jsonschema_rs.validator_for(schema).validate(body)
        if status >= 400:
            assert body["error"]["code"] == status and body["error"]["param"] is not None


def test_the_served_document_says_what_this_server_takes() -> None:
    """Without a decode server a completion is at most one token and not streamed;
    the served model's name is the only ``model``; ids stay in the vocabulary."""
    for decodes in (False, True):
        doc = served_document("tiny", 1024, decodes)
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            props, required = body["schema"]["properties"], body["schema"]["required"]
            assert props["model"]["enum"] == ["tiny"]
            assert props["stop_token_ids"]["items"]["maximum"] == 1023
            if decodes:
                assert "max_tokens" not in required and "stream_options" in props
                assert "maximum" not in props["max_tokens"]
            else:
                assert "max_tokens" in required and props["max_tokens"]["maximum"] == 1
                assert props["stream"]["enum"] == [False] and "stream_options" not in props
    # The document itself is left as it was.
    schema = OPENAPI["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    assert "enum" not in schema["application/json"]["schema"]["properties"]["model"]
