"""The OpenAI API of ``python -m vertumnus serve`` answered by the pool itself, on a
random Qwen3 folder the test saved (with a tokenizer, a chat template and an
end-of-sequence id), against transformers on the same folder (fp32, 1e-4), on
workers of CP degree 1 and, after a merge, 2:

- the loglikelihood request (``echo``, ``logprobs``, ``max_tokens`` 0): each prompt
  token's log-probability, and the most likely one's, equal ``log_softmax`` of
  transformers' logits, for a list of prompts, also when a prefix of the prompt is
  cached (the request computes it all, and leaves the cache as it was);
- one greedy token, for completions and chat (the chat template rendered as
  transformers renders it): the argmax and its log-probability; the folder's
  end-of-sequence id finishes the choice with "stop"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers

from support.factories import make_tokens
from support.reference import (
    ATOL,
    VOCAB,
    Checkpoint,
    assert_prompt_logprobs,
    hf_logits,
    make_checkpoint,
)
from support.server import ADMIN_TOKEN, Server, running_server, write_folder_config
from support.tokenizer import make_tokenizer

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    folder = tmp_path_factory.mktemp("qwen3-openai")
    checkpoint = make_checkpoint(folder, tie_word_embeddings=False)
    end = make_tokenizer(folder, VOCAB)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": end}))
    return checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("serve-openai") / "serve.toml"
    write_folder_config(config, checkpoint.model_dir, server={"admin_token": ADMIN_TOKEN})
    with running_server(config) as srv:
        yield srv


def loglikelihood(server: Server, prompts: list[list[int]]) -> dict[str, Any]:
    body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    status, out = server.call("POST", "/v1/completions", body)
    assert status == 200, out
    answer: dict[str, Any] = out
    return answer


def check_prompt_logprobs(
    choice: dict[str, Any], checkpoint: Checkpoint, prompt: list[int]
) -> None:
    """The choice's prompt log-probabilities are transformers' (the first token has
    none); its top entry (k = 1) is the most likely token's."""
    assert_prompt_logprobs(choice["logprobs"], checkpoint.hf, prompt)
    assert choice["finish_reason"] == "length" and choice["token_ids"] == []


def check_loglikelihood(server: Server, checkpoint: Checkpoint, cp: int) -> None:
    shared = make_tokens(40, seed=10 + cp, vocab=VOCAB)  # 2 whole blocks and 8 tokens
    prompts = [[*shared, 5, 6, 7], make_tokens(23, seed=20 + cp, vocab=VOCAB), [9]]
    status, plain = server.call("POST", "/v1/completions", {"prompt": shared, "max_tokens": 1})
    assert status == 200 and plain["cp_degree"] == cp, plain
    out = loglikelihood(server, prompts)
    assert out["cp_degree"] == cp and len(out["choices"]) == 3
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # computed whole
    for choice, prompt in zip(out["choices"], prompts, strict=True):
        check_prompt_logprobs(choice, checkpoint, prompt)
    # the cache is as it was: a plain request of the first prompt reuses its prefix
    body = {"prompt": prompts[0], "max_tokens": 1}
    status, again = server.call("POST", "/v1/completions", body)
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def check_one_greedy_token(server: Server, checkpoint: Checkpoint, cp: int) -> None:
    prompt = make_tokens(30, seed=30 + cp, vocab=VOCAB)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}
    status, out = server.call("POST", "/v1/completions", body)
    assert status == 200 and out["cp_degree"] == cp, out
    ref = torch.log_softmax(hf_logits(checkpoint.hf, prompt)[-1], dim=-1)
    (choice,) = out["choices"]
    assert choice["token_ids"] == [int(ref.argmax())]
    assert abs(choice["logprobs"]["token_logprobs"][0] - float(ref.max())) < ATOL
    # chat: the template rendered as transformers renders it, then one greedy token
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint.model_dir)
    messages = [{"role": "user", "content": f"Hello on CP {cp}, how are you?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    chat = {"messages": messages, "max_tokens": 1, "temperature": 0, "logprobs": True}
    status, out = server.call("POST", "/v1/chat/completions", chat)
    assert status == 200 and out["usage"]["prompt_tokens"] == len(ids), out
    ref = torch.log_softmax(hf_logits(checkpoint.hf, ids)[-1], dim=-1)
    (entry,) = out["choices"][0]["logprobs"]["content"]
    assert entry["token"] == tokenizer.decode([int(ref.argmax())])
    assert abs(entry["logprob"] - float(ref.max())) < ATOL
    # the folder's end-of-sequence id (made the most likely) ends the choice
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    status, out = server.call(
        "POST", "/v1/chat/completions", {**chat, "logit_bias": {str(end): 100}}
    )
    (choice,) = out["choices"]
    assert status == 200 and choice["finish_reason"] == "stop", out
    assert choice["message"]["content"] == ""  # a special token: skipped


@pytest.mark.timeout(300)
def test_the_pools_own_answers_equal_transformers_at_cp_1_and_2(
    server: Server, checkpoint: Checkpoint
) -> None:
    check_loglikelihood(server, checkpoint, cp=1)
    check_one_greedy_token(server, checkpoint, cp=1)
    status, merged = server.call("POST", "/v1/admin/reconfigure", {"op": "merge"})
    assert status == 200 and merged["cp_degree"] == 2, merged
    check_loglikelihood(server, checkpoint, cp=2)
    check_one_greedy_token(server, checkpoint, cp=2)
