"""The OpenAI dialect through the decode server (``decode/server.py``), in process,
against the fake prefill pool (``support/decode_pool.py``), on a transformers
checkpoint with a text tokenizer and a chat template (``support/tokenizer.py``).

Chat and completions, whole and streamed, carry transformers' greedy ids (chat:
their text); a list of prompts answers its choices in order, one pull per prompt,
``n`` and ``best_of`` copies forked in the decode thread; stop strings cut the text
and cancel the sequence; ``stop_token_ids``; logprobs equal ``log_softmax`` of
transformers' logits; echo, with the prompt's log-probabilities from
``kv_transfer_params``, and without decode; usage only on the final event with
``include_usage``; ``timings`` on exactly one event, the last; the model check; a
``kv_transfer_params`` list that does not fit the prompts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from aiohttp import web
from aiohttp.test_utils import TestClient

from support.decode_pool import FakePool, events, run, serving
from support.reference import VOCAB, Checkpoint, hf_greedy, hf_logits
from support.tokenizer import make_tokenizer
from vertumnus.decode.engine import DecodeEngine
from vertumnus.engine.model import CausalLM
from vertumnus.engine.weights import load_model
from vertumnus.protocol.tokenizer import Tokenizer

Client = TestClient[web.Request, web.Application]
NAME = "org/reference"  # served under a name with a slash, as a Hugging Face id
MESSAGES = [{"role": "user", "content": "Hello, world! How are you today?"}]
TEXT = "The prefill pool computes the key"
ATOL = 1e-4


@dataclass(frozen=True)
class Text:
    checkpoint: Checkpoint
    model: CausalLM
    tokenizer: Tokenizer
    end: int  # <|im_end|>: the end-of-sequence id


@pytest.fixture(scope="module")
def text(checkpoint: Checkpoint) -> Text:
    end = make_tokenizer(Path(checkpoint.model_dir), VOCAB)
    model = load_model(
        checkpoint.config, Path(checkpoint.model_dir), torch.float32, torch.device("cpu")
    )
    return Text(checkpoint, model, Tokenizer.for_model(str(checkpoint.model_dir), VOCAB), end)


class CountingEngine(DecodeEngine):
    """Counts the sequences that joined (each copy of a prompt is one)."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__(model)
        self.joined = 0

    def add(self, *args: Any, **kwargs: Any) -> None:
        super().add(*args, **kwargs)
        self.joined += 1


def serve(text: Text, pool: FakePool, engine: DecodeEngine | None = None) -> Any:
    return serving(
        text.model,
        pool,
        engine,
        tokenizer=text.tokenizer,
        served_model=NAME,
        eos_token_ids=(text.end,),
    )


async def post(client: Client, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    resp = await client.post(path, json=body)
    if body.get("stream") and resp.status == 200:
        got = events(await resp.text())
        assert got[-1] == "[DONE]" and "[DONE]" not in got[:-1]
        return resp.status, got[:-1]
    return resp.status, await resp.json()


def timed_last(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The one event with ``timings``, which must be the last."""
    assert [i for i, c in enumerate(chunks) if "timings" in c] == [len(chunks) - 1]
    return chunks[-1]


def chat_ids(text: Text) -> list[int]:
    hf = transformers.AutoTokenizer.from_pretrained(text.checkpoint.model_dir)
    ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


@pytest.mark.timeout(120)
def test_chat_whole_and_streamed(text: Text) -> None:
    prompt = chat_ids(text)
    content = text.tokenizer.decode(hf_greedy(text.checkpoint.hf, prompt, 8))
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    body["ignore_eos"] = True

    async def main() -> None:
        async with serve(text, FakePool(text.model)) as client:
            status, whole = await post(client, "/v1/chat/completions", body)
            assert status == 200 and whole["object"] == "chat.completion", whole
            (choice,) = whole["choices"]
            assert choice["message"] == {"role": "assistant", "content": content}
            assert choice["finish_reason"] == "length" and whole["model"] == NAME
            assert whole["usage"] == {
                "prompt_tokens": len(prompt),
                "completion_tokens": 8,
                "total_tokens": len(prompt) + 8,
            }
            assert whole["timings"]["prefill_s"] > 0
            _, chunks = await post(client, "/v1/chat/completions", body | {"stream": True})
            assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
            assert "".join(deltas) == content
            assert timed_last(chunks)["choices"][0]["finish_reason"] == "length"
            assert not any("usage" in c for c in chunks)
            options = {"stream": True, "stream_options": {"include_usage": True}}
            _, chunks = await post(client, "/v1/chat/completions", body | options)
            assert [c for c in chunks if "usage" in c] == [chunks[-1]]
            assert timed_last(chunks)["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"

    run(main)


@pytest.mark.timeout(120)
def test_a_list_of_prompts_with_n_copies(text: Text) -> None:
    prompts = [text.tokenizer.encode(TEXT), text.tokenizer.encode("Hello, world!")]
    greedy = [hf_greedy(text.checkpoint.hf, p, 5) for p in prompts]
    engine, pool = CountingEngine(text.model), FakePool(text.model)
    body = {"prompt": [TEXT, "Hello, world!"], "max_tokens": 5, "temperature": 0, "n": 2}
    body["ignore_eos"] = True

    async def main() -> None:
        async with serve(text, pool, engine) as client:
            status, whole = await post(client, "/v1/completions", body)
            assert status == 200, whole
            assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
            assert [c["token_ids"] for c in whole["choices"]] == [greedy[0]] * 2 + [greedy[1]] * 2
            assert [c["text"] for c in whole["choices"]][1:3] == [
                text.tokenizer.decode(greedy[0]),
                text.tokenizer.decode(greedy[1]),
            ]
            assert whole["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
            assert whole["usage"]["completion_tokens"] == 20
            assert pool.prefills == 2 and engine.joined == 4  # one pull per prompt, forked
            # as the proxy sends it: one kv_transfer_params per prompt
            params = [pool.keep(p) for p in prompts]
            _, chunks = await post(
                client, "/v1/completions", body | {"stream": True, "kv_transfer_params": params}
            )
            ids: dict[int, list[int]] = {}
            for c in chunks:
                (choice,) = c["choices"]
                ids.setdefault(choice["index"], []).extend(choice["token_ids"])
            assert ids == {0: greedy[0], 1: greedy[0], 2: greedy[1], 3: greedy[1]}
            assert timed_last(chunks)["timings"]["prefill_s"] is None
            assert pool.prefills == 2 and engine.joined == 8 and pool.leases == {}
            pool.listed = True  # a pool that answers a prefill's params as a list of one
            status, again = await post(client, "/v1/completions", body)
            assert status == 200 and again["choices"][3]["token_ids"] == greedy[1]

    run(main)


@pytest.mark.timeout(120)
def test_best_of_keeps_the_most_likely_copy(text: Text) -> None:
    prompt = text.tokenizer.encode(TEXT)
    engine, pool = CountingEngine(text.model), FakePool(text.model)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 7, "logprobs": 0}

    async def main() -> None:
        async with serve(text, pool, engine) as client:
            _, three = await post(client, "/v1/completions", body | {"n": 3})
            sums = [sum(c["logprobs"]["token_logprobs"]) for c in three["choices"]]
            best = three["choices"][sums.index(max(sums))]
            assert len({tuple(c["token_ids"]) for c in three["choices"]}) > 1  # seeds differ
            _, one = await post(client, "/v1/completions", body | {"best_of": 3, "n": 1})
            (choice,) = one["choices"]
            assert choice["index"] == 0 and choice["token_ids"] == best["token_ids"]
            assert pool.prefills == 2 and engine.joined == 6
            status, refused = await post(
                client, "/v1/completions", body | {"best_of": 3, "stream": True}
            )
            assert status == 400 and refused["error"]["param"] == "best_of"

    run(main)


def first_stop(tokenizer: Tokenizer, ids: list[int]) -> tuple[int, str]:
    """The first token k >= 2 whose text is a stop string that first occurs there."""
    whole = tokenizer.decode(ids)
    for k in range(2, len(ids) - 1):
        before, upto = tokenizer.decode(ids[:k]), tokenizer.decode(ids[: k + 1])
        piece = upto[len(before) :]
        if piece.strip() and whole.startswith(upto) and whole.find(piece) == len(before):
            return k, piece
    raise AssertionError(f"no stop string in {whole!r}")


async def idle(client: Client) -> bool:
    """Whether the decode thread's batch empties (a cancelled sequence leaves it)."""
    for _ in range(200):
        if (await (await client.get("/health")).json())["active_sequences"] == 0:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.timeout(120)
def test_stop_strings_and_stop_token_ids(text: Text) -> None:
    prompt, tok = text.tokenizer.encode(TEXT), text.tokenizer
    ids = hf_greedy(text.checkpoint.hf, prompt, 16)
    k, stop = first_stop(tok, ids)
    j = next(i for i in range(2, 16) if ids[i] not in ids[:i])
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def main() -> None:
        async with serve(text, FakePool(text.model)) as client:
            _, whole = await post(client, "/v1/completions", body | {"stop": [stop]})
            (choice,) = whole["choices"]
            assert choice["text"] == tok.decode(ids[:k]) and choice["token_ids"] == ids[: k + 1]
            assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
            assert whole["usage"]["completion_tokens"] == k + 1 < 16  # the sequence stopped
            assert await idle(client)
            kept = {"stop": stop, "include_stop_str_in_output": True}
            _, whole = await post(client, "/v1/completions", body | kept)
            assert whole["choices"][0]["text"] == tok.decode(ids[: k + 1])
            _, chunks = await post(client, "/v1/completions", body | {"stop": stop, "stream": True})
            assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(ids[:k])
            last = timed_last(chunks)["choices"][0]
            assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
            assert await idle(client)
            _, whole = await post(client, "/v1/completions", body | {"stop_token_ids": [ids[j]]})
            (choice,) = whole["choices"]
            assert choice["token_ids"] == ids[: j + 1] and choice["text"] == tok.decode(ids[:j])
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[j])

    run(main)


def hf_logprobs(text: Text, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: row i is log p(. | ids[: i + 1]) by transformers."""
    return torch.log_softmax(hf_logits(text.checkpoint.hf, ids), dim=-1)[:-1]


@pytest.mark.timeout(120)
def test_logprobs_equal_transformers(text: Text) -> None:
    prompt, tok = text.tokenizer.encode(TEXT), text.tokenizer
    ids = hf_greedy(text.checkpoint.hf, prompt, 5)
    ref = hf_logprobs(text, prompt + ids)[len(prompt) - 1 :]  # [5, V]
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def main() -> None:
        async with serve(text, FakePool(text.model)) as client:
            _, whole = await post(client, "/v1/completions", body | {"logprobs": 2})
            lp = whole["choices"][0]["logprobs"]
            assert lp["tokens"] == [tok.token_text(i) for i in ids]
            want = [float(ref[i, t]) for i, t in enumerate(ids)]
            assert lp["token_logprobs"] == pytest.approx(want, abs=ATOL)
            for i, top in enumerate(lp["top_logprobs"]):
                best = torch.topk(ref[i], 2)
                names = [tok.token_text(int(t)) for t in best.indices]
                assert list(top)[:2] == names and tok.token_text(ids[i]) in top
                assert [top[n] for n in names] == pytest.approx(best.values.tolist(), abs=ATOL)
            lengths = [len(t) for t in lp["tokens"]]
            assert lp["text_offset"] == [sum(lengths[:i]) for i in range(5)]
            stream = body | {"logprobs": 2, "stream": True}
            _, chunks = await post(client, "/v1/completions", stream)
            parts = [c["choices"][0]["logprobs"] for c in chunks]
            assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
            assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]
            chat = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            chat |= {"logprobs": True, "top_logprobs": 2}
            _, answer = await post(client, "/v1/chat/completions", chat)
            content = answer["choices"][0]["logprobs"]["content"]
            asked = chat_ids(text)
            chat_ref = hf_logprobs(text, asked + hf_greedy(text.checkpoint.hf, asked, 4))
            assert len(content) == 4
            for i, entry in enumerate(content):
                row = chat_ref[len(asked) - 1 + i]
                assert entry["logprob"] == pytest.approx(float(row.max()), abs=ATOL)
                assert len(entry["top_logprobs"]) == 2
                assert entry["top_logprobs"][0]["token"] == entry["token"]
                assert entry["bytes"] == list(entry["token"].encode())

    run(main)


@pytest.mark.timeout(120)
def test_echo_with_and_without_decode(text: Text) -> None:
    tok, prompt = text.tokenizer, text.tokenizer.encode(TEXT)
    ids = hf_greedy(text.checkpoint.hf, prompt, 3)
    ref = hf_logprobs(text, prompt)  # [n - 1, V]
    pool = FakePool(text.model)
    body = {"prompt": TEXT, "echo": True, "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def main() -> None:
        async with serve(text, pool) as client:
            _, whole = await post(client, "/v1/completions", body)
            assert whole["choices"][0]["text"] == TEXT + tok.decode(ids)
            asked = body | {"logprobs": 1, "kv_transfer_params": pool.keep(prompt, logprobs=1)}
            _, whole = await post(client, "/v1/completions", asked)
            lp = whole["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(prompt) + 3
            assert lp["tokens"][0] == tok.token_text(prompt[0])
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            want = [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
            assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(want, abs=ATOL)
            assert whole["choices"][0]["token_ids"] == ids and pool.prefills == 1
            status, refused = await post(client, "/v1/completions", body | {"logprobs": 1})
            assert status == 400 and refused["error"]["param"] == "kv_transfer_params"
            # max_tokens 0: the prompt alone, nothing decoded, the KV released unpulled
            params = pool.keep(prompt, logprobs=0)
            only = body | {"max_tokens": 0, "logprobs": 0, "kv_transfer_params": params}
            _, whole = await post(client, "/v1/completions", only)
            (choice,) = whole["choices"]
            assert (choice["text"], choice["token_ids"]) == (TEXT, [])
            assert choice["finish_reason"] == "length"
            assert len(choice["logprobs"]["tokens"]) == len(prompt)
            assert pool.released == [params["remote_handle"]]
            assert whole["usage"]["completion_tokens"] == 0 and whole["timings"]["decode_s"] == 0
            _, chunks = await post(
                client, "/v1/completions", body | {"max_tokens": 0, "stream": True}
            )
            (event,) = chunks
            assert event["choices"][0]["text"] == TEXT and "timings" in event
            assert event["choices"][0]["finish_reason"] == "length" and pool.prefills == 1

    run(main)


@pytest.mark.timeout(120)
def test_the_served_model_and_its_routes(text: Text) -> None:
    async def main() -> None:
        async with serve(text, FakePool(text.model)) as client:
            for path, body in (
                ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
            ):
                status, answer = await post(client, path, body | {"model": "other"})
                assert status == 404 and answer["error"] == {
                    "message": "The model `other` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
                status, answer = await post(client, path, body)
                assert status == 200 and answer["model"] == NAME
            listed = await (await client.get("/v1/models")).json()
            assert [m["id"] for m in listed["data"]] == [NAME]
            one = await (await client.get(f"/v1/models/{NAME}")).json()
            assert one == listed["data"][0] and one["max_model_len"] == 4096
            resp = await client.get("/v1/models/other")
            assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"

    run(main)


@pytest.mark.timeout(120)
def test_kv_transfer_params_must_fit_the_prompts(text: Text) -> None:
    prompts = [text.tokenizer.encode(TEXT), text.tokenizer.encode("Hello")]
    pool = FakePool(text.model)

    async def main() -> None:
        async with serve(text, pool) as client:

            async def refused(params: Any, **extra: Any) -> str:
                body = {"prompt": prompts, "max_tokens": 2, "kv_transfer_params": params}
                status, answer = await post(client, "/v1/completions", body | extra)
                assert status == 400 and answer["error"]["param"] == "kv_transfer_params"
                return str(answer["error"]["message"])

            one = pool.keep(prompts[0])
            assert "1 entries for 2 prompts" in await refused([one])
            assert "1 entries for 2 prompts" in await refused(pool.keep(prompts[0]))
            three = [pool.keep(prompts[0]), pool.keep(prompts[1]), pool.keep(prompts[1])]
            assert "3 entries for 2 prompts" in await refused(three)
            swapped = [pool.keep(prompts[1]), pool.keep(prompts[0])]
            assert "num_tokens" in await refused(swapped)
            shapes = [pool.keep(p, logprobs=1) for p in prompts]
            shapes[0]["prompt_logprobs"]["top_ids"] = [[1, 2]] * (len(prompts[0]) - 1)
            assert "prompt_logprobs" in await refused(shapes, echo=True, logprobs=1)
            # every lease given back, none pulled
            assert sorted(pool.released) == [f"h{i}" for i in range(9)]
            assert pool.leases == {} and pool.prefills == 0

    run(main)
