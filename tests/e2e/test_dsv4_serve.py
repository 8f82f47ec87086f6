"""DeepSeek-V4 through ``python -m vertumnus serve`` as users run it (the adaptive
pool, its own decode process, two CPU ranks, fp32, 128-token blocks) on a random folder
transformers saved: greedy completions of 12 tokens, prefilled by the pool, the
prompt's DeepSeek-V4 state handed off (``kv_wire`` kind 3) and decoded by the decode
process, equal transformers' ``generate`` at CP 1 and, after an admin merge, at CP 2
(the state then gathered from both ranks, the blocks the degree-1 workers wrote
adopted by the merged one). Prompts of 300 and 258 tokens cross the first HCA
window's end (256) and the sliding window; a one-token prompt hands off the state of
no token; a prompt sent again resumes its 2 cached blocks (from the pool's block
cache, ``engine/dsv4/blocks.py``) and hands off the whole prompt's state. A
prompt-logprobs request is refused, saying why."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from support.dsv4 import write_dsv4_folder
from support.factories import make_tokens
from support.reference import hf_greedy
from support.server import ADMIN_TOKEN, Server, running_server, write_folder_config

pytestmark = pytest.mark.multiproc
N = 12
SECRET = "v4-handoff-secret"
SERVE_VOCAB = 384  # a byte-level tokenizer and its special tokens need more than 256


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Server]]:
    folder = tmp_path_factory.mktemp("dsv4-folder")
    hf = write_dsv4_folder(folder, tokenizer=True, vocab_size=SERVE_VOCAB)
    config = tmp_path_factory.mktemp("dsv4-serve") / "serve.toml"
    write_folder_config(
        config,
        folder,
        server={"admin_token": ADMIN_TOKEN},
        engine={"block_size": 128, "kv_blocks_per_rank": 64},
        controller={"enabled": True, "decision_s": 600.0},
        decode={"local": True},
        handoff={"secret": SECRET},
    )
    with running_server(config) as srv:
        yield hf, srv


def _complete(server: Server, prompt: list[int]) -> Any:
    body = {"prompt": prompt, "max_tokens": N, "min_tokens": N, "temperature": 0}
    status, out = server.call("POST", "/v1/completions", body)
    assert status == 200, out
    return out


@pytest.mark.timeout(300)
def test_greedy_completions_equal_transformers_at_cp_1_and_after_a_merge(
    served: tuple[Any, Server],
) -> None:
    hf, server = served
    for cp in (1, 2):
        if cp == 2:
            status, merged = server.call("POST", "/v1/admin/reconfigure", {"op": "merge"})
            assert status == 200 and merged["cp_degree"] == 2, merged
        for length in (300, 258, 1):  # (1: the state of no token is handed off)
            prompt = make_tokens(length, seed=10 * cp + length, vocab=SERVE_VOCAB)
            out = _complete(server, prompt)
            assert out["cp_degree"] == cp, out
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, out
            assert out["timings"]["handoff_bytes"] > 0, out  # the decode process decoded
            (choice,) = out["choices"]
            assert choice["finish_reason"] == "length", choice
            assert choice["token_ids"] == hf_greedy(hf, prompt, N), (cp, length)
        # Again: its 2 whole blocks resumed from the worker that wrote them; at CP 2
        # also the CP-1 prompt, whose blocks a degree-1 worker wrote before the merge.
        for seed in range(310, 10 * cp + 301, 10):
            prompt = make_tokens(300, seed=seed, vocab=SERVE_VOCAB)
            out = _complete(server, prompt)
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 256, (seed, out)
            assert out["choices"][0]["token_ids"] == hf_greedy(hf, prompt, N), (cp, seed)


def test_prompt_logprobs_are_refused_saying_why(served: tuple[Any, Server]) -> None:
    _, server = served
    body = {"prompt": make_tokens(20, seed=1, vocab=SERVE_VOCAB), "max_tokens": 0, "echo": True,
            "logprobs": 1}  # fmt: skip
    status, out = server.call("POST", "/v1/completions", body)
    assert status == 400, out
    assert "not built for DeepSeek-V4 yet" in str(out)


def test_an_open_state_lease_is_listed_and_goes_over_http_only(served: tuple[Any, Server]) -> None:
    """A hand-off whose lease holds a DeepSeek-V4 state: ``/v1/handoffs`` lists it,
    the ``dist`` transport refuses it (400, saying why), a release ends it."""
    _, server = served
    body = {"token_ids": make_tokens(140, seed=7, vocab=SERVE_VOCAB),
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    status, answer = server.call("POST", "/v1/prefill", body)
    assert status == 200, answer
    handle = answer["kv_transfer_params"]["remote_handle"]
    status, view = server.call("GET", "/v1/handoffs")
    assert status == 200 and view["open"] >= 1 and view["held_rows"] == 0, view
    dist = json.dumps({"store_host": "127.0.0.1", "store_port": 1, "prefix": "x"}).encode()
    req = urllib.request.Request(server.url + f"/v1/kv/{handle}/dist", data=dist, method="POST")
    req.add_header("Authorization", f"Bearer {SECRET}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 400 and "HTTP only" in refused.value.read().decode()
    release = urllib.request.Request(server.url + f"/v1/kv/{handle}", method="DELETE")
    release.add_header("Authorization", f"Bearer {SECRET}")
    with urllib.request.urlopen(release, timeout=60) as resp:
        assert resp.status == 200
