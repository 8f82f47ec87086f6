"""``python -m vertumnus serve`` on a Hugging Face folder with a tokenizer and a chat
template, driven by the openai SDK as a user would: chat and completions, streamed
and whole, a batch of prompts, ``n``, stop strings, ``logprobs`` and ``echo``. Greedy
text equals transformers' ``generate`` on the prompt that transformers' own
tokenizer renders; the prompt's log-probabilities (``echo`` with ``logprobs`` and
``max_tokens`` 0, the loglikelihood request) equal transformers' within 1e-4, on a
worker of CP degree 1 and one of degree 2, also after the prefix was cached; a
conversation's second turn reuses the first's KV."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
import torch
import transformers

from support.reference import VOCAB, Checkpoint, hf_greedy, make_checkpoint
from support.server import Server, running_server, write_folder_config
from support.tokenizer import make_tokenizer

pytestmark = pytest.mark.multiproc

SYSTEM = (
    "You are the prefill pool's test assistant. "
    + "Context parallelism splits a long prompt over several ranks in zigzag order. " * 6
)


@dataclass(frozen=True)
class Folder:
    checkpoint: Checkpoint
    tokenizer: transformers.PreTrainedTokenizerBase


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("qwen3-chat"), tie_word_embeddings=False)
    make_tokenizer(checkpoint.model_dir, VOCAB)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint.model_dir)
    return Folder(checkpoint, tokenizer)


@pytest.fixture(scope="module", params=[1, 2], ids=["cp1", "cp2"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, folder: Folder
) -> Iterator[Server]:
    """One worker of CP degree ``param`` that holds still: every prompt meets the
    KV its predecessors left."""
    config = tmp_path_factory.mktemp("serve-openai") / "serve.toml"
    write_folder_config(
        config,
        folder.checkpoint.model_dir,
        pool={"degrees": [request.param], "layout": [request.param]},
        controller={"enabled": False},
        decode={"local": True},
    )
    with running_server(config) as srv:
        yield srv


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def model_name(folder: Folder) -> str:
    return str(folder.checkpoint.model_dir)


def greedy(folder: Folder, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        return hf_greedy(folder.checkpoint.hf, prompt, n)


def chat_ids(folder: Folder, messages: list[dict[str, str]]) -> list[int]:
    """The prompt as transformers renders and tokenizes the conversation."""
    text = folder.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return list(folder.tokenizer(text, add_special_tokens=False)["input_ids"])


def text_of(folder: Folder, ids: list[int]) -> str:
    return str(folder.tokenizer.decode(ids, skip_special_tokens=True))


@pytest.mark.timeout(600)
def test_chat_greedy_equals_transformers_whole_and_streamed(server: Server, folder: Folder) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hello, world! How are you today?"},
    ]
    prompt = chat_ids(folder, messages)
    expected = text_of(folder, greedy(folder, prompt, 10))
    api = client(server)
    whole = api.chat.completions.create(
        model=model_name(folder),
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert whole.object == "chat.completion" and whole.model == model_name(folder)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == 10
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 10)

    chunks = list(
        api.chat.completions.create(
            model=model_name(folder),
            messages=messages,  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])  # usage only on the last, when asked
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


@pytest.mark.timeout(600)
def test_a_conversation_reuses_its_first_turn(server: Server, folder: Folder) -> None:
    api = client(server)
    turns = [
        {"role": "system", "content": SYSTEM + " Conversation."},
        {"role": "user", "content": "What does a decode server do?"},
    ]
    first = api.chat.completions.create(
        model=model_name(folder),
        messages=turns,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    reply = first.choices[0].message.content or ""
    turns += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And the prefill pool?"},
    ]
    second = api.chat.completions.create(
        model=model_name(folder),
        messages=turns,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    prompt = chat_ids(folder, turns)
    assert second.usage is not None and second.usage.prompt_tokens == len(prompt)
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert first.usage is not None
    # The first turn's rendered prompt is a prefix of the second's: its whole blocks
    # (block size 16) were reused.
    assert details.cached_tokens >= (first.usage.prompt_tokens // 16 - 1) * 16 > 0
    assert second.choices[0].message.content == text_of(folder, greedy(folder, prompt, 6))


@pytest.mark.timeout(600)
def test_completions_batched_with_n_stop_and_logprobs(server: Server, folder: Folder) -> None:
    api = client(server)
    prompts = ["The prefill pool computes", "A decode server generates one token"]
    ids = [list(folder.tokenizer(p)["input_ids"]) for p in prompts]
    expected = [text_of(folder, greedy(folder, p, 8)) for p in ids]
    answer = api.completions.create(
        model=model_name(folder),
        prompt=prompts,
        n=2,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == [expected[0]] * 2 + [expected[1]] * 2
    for c in answer.choices:
        assert c.logprobs is not None and c.logprobs.tokens is not None
        assert len(c.logprobs.tokens) == 8 and c.logprobs.top_logprobs is not None
        assert all(1 <= len(top) <= 4 for top in c.logprobs.top_logprobs)
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(len(p) for p in ids)
    assert answer.usage.completion_tokens == 4 * 8

    # A stop string from the middle of the greedy text: the text is cut before it.
    full = expected[0]
    stop = next(full[i : i + 2] for i in range(1, len(full) - 1) if full[i : i + 2].strip())
    for stream in (False, True):
        got = api.completions.create(
            model=model_name(folder),
            prompt=prompts[0],
            max_tokens=8,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            pieces = list(got)  # type: ignore[arg-type]
            text = "".join(c.choices[0].text for c in pieces if c.choices)
            finish = [c.choices[0].finish_reason for c in pieces if c.choices][-1]
        else:
            text, finish = got.choices[0].text, got.choices[0].finish_reason  # type: ignore[union-attr]
        assert (text, finish) == (full[: full.find(stop)], "stop")


@pytest.mark.timeout(600)
def test_echo_prompt_logprobs_equal_transformers(server: Server, folder: Folder) -> None:
    api = client(server)
    prompt = SYSTEM + " Loglikelihood of this continuation."
    ids = list(folder.tokenizer(prompt)["input_ids"])
    # First an ordinary request, so that the prompt's prefix is cached.
    api.completions.create(model=model_name(folder), prompt=prompt, max_tokens=1)
    with torch.inference_mode():
        logits = folder.checkpoint.hf(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    answer = api.completions.create(
        model=model_name(folder), prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = answer.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    values = choice.logprobs.token_logprobs
    assert len(values) == len(ids) and values[0] is None
    got = torch.tensor([float(v) for v in values[1:] if v is not None])
    assert got.shape[0] == len(ids) - 1
    torch.testing.assert_close(got, expected[:, 0], atol=1e-4, rtol=0)
    assert answer.usage is not None and answer.usage.completion_tokens == 0


def test_the_model_is_checked(server: Server, folder: Folder) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(server).completions.create(model="gpt-4", prompt="hello", max_tokens=1)
    assert "gpt-4" in str(caught.value)
    card = client(server).models.retrieve(model_name(folder))
    assert card.id == model_name(folder)
