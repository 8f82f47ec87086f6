"""Every served family through the whole path: ``python -m vertumnus serve`` as users
run it (the adaptive pool with its own decode process, compiled layers, two CPU
ranks; fp32 on the CPU) on a random folder of each family that transformers saved
(``support/families.py``: one case per family), against transformers on the same
folder, at CP 1 and, after an admin merge, at CP 2:

- greedy completions of 12 tokens, prefilled by the pool, handed off and decoded by
  the decode process, equal ``generate``'s, for a prompt of 52 tokens (longer than
  every sliding window: 8, 12, 20, 24) and for one that shares its first 40 with it
  (32 of them, two whole blocks, reused from the cache). Both sides ban the
  end-of-sequence id for all 12 tokens: ``hf_greedy`` by ``min_new_tokens``, the
  server by ``min_tokens`` 12 (not ``ignore_eos``, which would let the id be chosen
  and go on), so they agree even where the id would be the argmax. Each generated
  token's log-probability, and the most likely one's, are transformers' (1e-4);
- a chat completion rendered by the folder's chat template (as many prompt tokens as
  transformers' ``apply_chat_template``), whose 12 greedy tokens are ``generate``'s
  on those ids (the same ban), with the log-probabilities of each token and of the
  5 most likely ids at its position within 1e-4 of transformers';
- the loglikelihood request (``echo``, ``logprobs``, ``max_tokens`` 0) of a 47-token
  prompt: each prompt token's log-probability, and the most likely one's, within 1e-4
  of ``log_softmax`` of transformers' logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from support.factories import make_tokens
from support.families import VOCAB, write_family_folder
from support.reference import assert_prompt_logprobs, hf_greedy, hf_logits
from support.server import ADMIN_TOKEN, Server, running_server, write_folder_config

pytestmark = pytest.mark.multiproc

# One case per family; each sliding window (8, 12, 20, 24) is shorter than the prompts.
FAMILIES = ["llama3", "mistral", "qwen2", "mixtral", "qwen2-moe", "gpt-oss"]
ATOL = 1e-4  # fp32 against fp32
N = 12  # generated tokens per choice
SHARED = 40  # tokens the second prompt shares with the first: 2 whole blocks and 8


@dataclass(frozen=True)
class Family:
    case: str
    hf: transformers.PreTrainedModel
    folder: Path
    server: Server


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Family]:
    case: str = request.param
    folder = tmp_path_factory.mktemp(f"{case}-folder")
    hf = write_family_folder(case, folder)
    config = tmp_path_factory.mktemp(f"{case}-serve") / "serve.toml"
    # serve's defaults but fp32 on CPU (write_folder_config): the adaptive pool, its
    # own decode process and compiled layers (SERVE_DEFAULTS turns them off). Its
    # what-if controller decides only past the test's time-out, so that the operator's
    # merge holds while the test reads CP 2's answers (deciding every 10 s, it could
    # split the merged worker back on a loaded machine: an answer came from CP 1).
    write_folder_config(
        config,
        folder,
        server={"admin_token": ADMIN_TOKEN},
        controller={"enabled": True, "decision_s": 600.0},
        decode={"local": True},
        engine={"compile": "auto"},
    )
    with running_server(config) as srv:
        (ready,) = srv.events("ready")
        assert ready["layers"] == "compiled", ready  # as users run it (Inductor here)
        yield Family(case, hf, folder, srv)


def complete(server: Server, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    status, out = server.call("POST", path, body)
    assert status == 200, out
    return out


def greedy(prompt: list[int] | None = None, **body: Any) -> dict[str, Any]:
    """A greedy request of ``N`` tokens with the end-of-sequence id banned for all."""
    fields = {"max_tokens": N, "min_tokens": N, "temperature": 0, **body}
    return fields if prompt is None else {"prompt": prompt, **fields}


def check_generated_logprobs(
    fam: Family, prompt: list[int], tokens: list[int], chosen: list[float], top: list[list[float]]
) -> None:
    """The decode's log-probabilities of the generated ``tokens`` (``chosen``) and of
    the most likely ids at each position (``top``: each step's k values, most likely
    first) are transformers' there: its logits over the handed-off cache, not only
    their argmax (a tied-embedding model may repeat one token with probability ~1)."""
    ref = torch.log_softmax(hf_logits(fam.hf, prompt + tokens)[len(prompt) - 1 : -1], dim=-1)
    want = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(chosen), want, rtol=0.0, atol=ATOL)
    k = len(top[0])
    want_top = torch.topk(ref, k, dim=-1).values
    torch.testing.assert_close(torch.tensor(top), want_top, rtol=0.0, atol=ATOL)


def check_completions(fam: Family, cp: int) -> None:
    first = make_tokens(52, seed=100 + cp, vocab=VOCAB)
    second = [*first[:SHARED], *make_tokens(14, seed=200 + cp, vocab=VOCAB)]
    for prompt, cached in ((first, 0), (second, 32)):
        out = complete(fam.server, greedy(prompt, logprobs=1))
        assert out["cp_degree"] == cp, out
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == cached, out
        assert out["timings"]["handoff_bytes"] > 0, out  # decoded by the decode process
        (choice,) = out["choices"]
        assert choice["finish_reason"] == "length", choice
        tokens = hf_greedy(fam.hf, prompt, N)
        assert choice["token_ids"] == tokens, (fam.case, cp, cached)
        logprobs = choice["logprobs"]
        best = [[max(t.values())] for t in logprobs["top_logprobs"]]  # keyed by text
        check_generated_logprobs(fam, prompt, tokens, logprobs["token_logprobs"], best)


def check_chat(fam: Family, cp: int) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(fam.folder)
    messages = [{"role": "user", "content": f"Hello from {fam.case} on CP {cp}, how are you?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = greedy(messages=messages, return_token_ids=True, logprobs=True, top_logprobs=5)
    out = complete(fam.server, body, "/v1/chat/completions")
    assert out["cp_degree"] == cp and out["usage"]["prompt_tokens"] == len(ids), (out, len(ids))
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "length", choice
    tokens = hf_greedy(fam.hf, ids, N)
    assert choice["token_ids"] == tokens, (fam.case, cp)
    content = choice["logprobs"]["content"]
    top = [[t["logprob"] for t in e["top_logprobs"]] for e in content]
    check_generated_logprobs(fam, ids, tokens, [e["logprob"] for e in content], top)


def check_prompt_logprobs(fam: Family, cp: int) -> None:
    """Each prompt token's log-probability (none for the first) and the most likely
    one's (the top entry, k = 1) are transformers'."""
    prompt = make_tokens(47, seed=300 + cp, vocab=VOCAB)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    out = complete(fam.server, body)
    assert out["cp_degree"] == cp, out
    (choice,) = out["choices"]
    assert_prompt_logprobs(choice["logprobs"], fam.hf, prompt)


@pytest.mark.timeout(300)
def test_each_family_serves_transformers_answers_at_cp_1_and_2(family: Family) -> None:
    for cp in (1, 2):
        if cp == 2:
            status, merged = family.server.call("POST", "/v1/admin/reconfigure", {"op": "merge"})
            assert status == 200 and merged["cp_degree"] == 2, merged
        check_completions(family, cp)
        check_chat(family, cp)
        check_prompt_logprobs(family, cp)
