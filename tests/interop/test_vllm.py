"""Vertumnus's prefill pool in front of a real vLLM decode instance (vLLM's CPU build,
``tools/vllm/setup.sh``), through ``VertumnusConnector``
(``integrations/vllm``), on a random Qwen3 folder built here:

- exact: greedy ids from the pool's prefill plus vLLM's decode equal vLLM alone (its
  prefix cache off, so it computes every prompt itself), log-probabilities (of each
  token and of the 5 most likely) within 1e-4, on a worker of CP degree 1 and one of
  degree 2, fresh and with the prompt's prefix cached in the pool; vLLM's own metrics
  count the prompt but its last token as transferred and that one token as computed;
- the same for the other families (``support/families.py``) on folders that vLLM's
  CPU build takes (``VLLM_SHAPE``): Mistral (a window on every layer) and gpt-oss
  (MoE, sinks, YaRN, windowed and full layers: several KV cache groups in its hybrid
  manager) in CI; with ``VERTUMNUS_VLLM_FAMILIES=all`` also Llama 3, Qwen2 (its
  window on every layer), Mixtral and Qwen2-MoE, each with a pull that fails;
- one front door: ``serve`` with ``[decode] engine = "vllm"`` answers completions and
  chat, whole and streamed, through the openai SDK, with no lease left;
- a pull that fails is recomputed by vLLM (``kv_load_failure_policy = "recompute"``)
  and the request completes with the same tokens.

Skipped, saying why, without ``.venv-vllm``."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import transformers

from support.families import CASES, VOCAB
from support.reference import seed_weights
from support.server import Server, running_server, write_serve_config
from support.tokenizer import make_tokenizer
from support.tools import load_tool

SERVER = load_tool("vllm/vllm_server.py")
SECRET = "interop-handoff-secret-0123456789"

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(
        not SERVER.VLLM_PYTHON.exists(), reason="no vLLM in .venv-vllm: run tools/vllm/setup.sh"
    ),
]


def call(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
            ctype = resp.headers.get("Content-Type", "")
            return resp.status, json.loads(raw) if "json" in ctype else raw.decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_folder = load_tool("clients/model_folder.py")
    path: Path = model_folder.write_model_folder(tmp_path_factory.mktemp("qwen3-vllm"), head_dim=64)
    return path


@pytest.fixture(scope="module")
def vllm(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``vllm serve`` with the connector (prefix caching off: a request without
    ``kv_transfer_params`` computes its whole prompt)."""
    log = (tmp_path_factory.mktemp("vllm") / "vllm.log").open("w")
    proc, url = SERVER.start_vllm(
        folder, log, connector=True, prefix_caching=False, prefill_key=SECRET
    )
    try:
        yield url
    finally:
        SERVER.stop(proc)
        log.close()


def pool_config(path: Path, folder: Path, degree: int, **decode: Any) -> Path:
    return write_serve_config(
        path,
        model={"name": str(folder)},
        profile={"path": "tiny-cpu"},
        engine={"dtype": "float32", "device": "cpu"},
        pool={"degrees": [degree], "layout": [degree]},
        controller={"enabled": False},
        handoff={"secret": SECRET},
        decode=decode or {"local": False},
    )


@pytest.fixture(scope="module", params=[1, 2], ids=["cp1", "cp2"])
def pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, folder: Path
) -> Iterator[tuple[Server, int]]:
    """A pool of one worker of CP degree ``param`` that keeps the KV for vLLM."""
    config = pool_config(tmp_path_factory.mktemp("pool") / "serve.toml", folder, request.param)
    with running_server(config) as srv:
        yield srv, request.param


def by_source(vllm: str) -> dict[str, float]:
    """vLLM's prompt tokens by where they came from."""
    _, text = call(vllm + "/metrics")
    out = {}
    for line in str(text).splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="')[1].split('"')[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


def decode(vllm: str, folder: Path, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "model": str(folder), "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True,
        "return_token_ids": True, **extra,
    }  # fmt: skip
    status, answer = call(vllm + "/v1/completions", body)
    assert status == 200, answer
    choice: dict[str, Any] = answer["choices"][0]
    return choice


def prompt_ids(seed: int, n: int, vocab: int = 370) -> list[int]:
    return [(seed * 7919 + i * 104729) % vocab + 3 for i in range(n)]


def assert_same_logprobs(got: dict[str, Any], alone: dict[str, Any]) -> None:
    """Each token's log-probability and the 5 most likely ones (sorted: a near tie
    may swap two ids) within 1e-4."""
    ours, theirs = got["logprobs"], alone["logprobs"]
    pairs = list(zip(ours["token_logprobs"], theirs["token_logprobs"], strict=True))
    for a, b in zip(ours["top_logprobs"], theirs["top_logprobs"], strict=True):
        pairs += zip(sorted(a.values()), sorted(b.values()), strict=True)
    assert max(abs(x - y) for x, y in pairs) <= 1e-4


def assert_pool_then_vllm_equals_vllm_alone(
    server: Server, degree: int, vllm: str, folder: Path
) -> None:
    """Two prompts prefilled by the pool (the second's first 150 tokens from its
    cache), decoded by vLLM: vLLM alone's tokens, n - 1 prompt tokens transferred."""
    shared = prompt_ids(1, 150)
    for prompt in (shared + prompt_ids(2, 30), shared + prompt_ids(3, 45)):  # 2nd: cached
        body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, prefilled = server.call("POST", "/v1/completions", body)
        assert status == 200, prefilled
        assert prefilled["cp_degree"] == degree
        params = prefilled["kv_transfer_params"]
        before = by_source(vllm)
        got = decode(vllm, folder, prompt, kv_transfer_params=params)
        after = by_source(vllm)
        alone = decode(vllm, folder, prompt)
        assert got["token_ids"] == alone["token_ids"]
        assert_same_logprobs(got, alone)
        transferred = after["external_kv_transfer"] - before["external_kv_transfer"]
        computed = after["local_compute"] - before["local_compute"]
        assert (transferred, computed) == (len(prompt) - 1, 1)
    cached = prefilled["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 144  # the second prompt's shared prefix came from the pool's cache
    status, leases = server.call("GET", "/v1/handoffs")
    assert status == 200 and leases["open"] == 0 and leases["pulled"] == 2


def assert_a_failed_pull_is_recomputed(vllm: str, folder: Path) -> None:
    prompt = prompt_ids(5, 60)
    gone = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": SERVER.free_port(),  # nobody listens: the pull fails
        "remote_handle": "kv-gone",
        "num_tokens": len(prompt) - 1,
    }
    got = decode(vllm, folder, prompt, kv_transfer_params=gone)
    alone = decode(vllm, folder, prompt)
    assert got["token_ids"] == alone["token_ids"]
    assert_same_logprobs(got, alone)


# How each family's case (support/families.py) is changed for vLLM CPU 0.32.0: head_dim
# 64 (its CPU attention takes 32, 64, 80, ...; the cases have 16 and 24). vLLM's Qwen2
# and Qwen2-MoE take head_dim as hidden_size / heads, so their hidden size is 4 x 64;
# its Qwen2 refuses a window on some layers only ("Sliding window for some but all
# layers is not supported"), so Qwen2's window is on every layer.
VLLM_SHAPE: dict[str, dict[str, Any]] = {
    "llama3": {},
    "mistral": {},
    "qwen2": {
        "hidden_size": 256,
        "max_window_layers": 0,
        "layer_types": ["sliding_attention"] * 3,
    },
    "mixtral": {},
    "qwen2-moe": {"hidden_size": 256},
    "gpt-oss": {},
}
# Two families in CI (a dense one windowed on every layer, an MoE one with windowed
# and full layers); VERTUMNUS_VLLM_FAMILIES=all runs them all (about a minute each).
FAMILIES = (
    list(VLLM_SHAPE)
    if os.environ.get("VERTUMNUS_VLLM_FAMILIES") == "all"
    else ["mistral", "gpt-oss"]
)


def write_vllm_family_folder(case: str, folder: Path, seed: int = 11) -> Path:
    """``support.families.write_family_folder`` of ``case`` with ``VLLM_SHAPE``'s
    changes: seeded fp32 weights saved by transformers, a tokenizer and template."""
    cfg = CASES[case]()
    cfg.head_dim = 64
    for key, value in VLLM_SHAPE[case].items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    seed_weights(model, seed)
    folder.mkdir(parents=True)
    model.config.eos_token_id = model.generation_config.eos_token_id = make_tokenizer(folder, VOCAB)
    with torch.no_grad():
        model.save_pretrained(folder)
    return folder


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", FAMILIES)
def test_each_family_through_the_connector_equals_vllm_alone(case: str, tmp_path: Path) -> None:
    """One vLLM (started here, so that no other runs beside it), then a pool at CP 1
    and one at CP 2 in front of it, then a pull that fails."""
    folder = write_vllm_family_folder(case, tmp_path / "model")
    with (tmp_path / "vllm.log").open("w") as log:
        proc, vllm = SERVER.start_vllm(
            folder, log, connector=True, prefix_caching=False, prefill_key=SECRET
        )
        try:
            for degree in (1, 2):
                (tmp_path / f"cp{degree}").mkdir()
                config = pool_config(tmp_path / f"cp{degree}" / "serve.toml", folder, degree)
                with running_server(config) as server:
                    assert_pool_then_vllm_equals_vllm_alone(server, degree, vllm, folder)
            assert_a_failed_pull_is_recomputed(vllm, folder)
        finally:
            SERVER.stop(proc)


@pytest.mark.timeout(900)
def test_the_pools_prefill_and_vllms_decode_equal_vllm_alone(
    pool: tuple[Server, int], vllm: str, folder: Path
) -> None:
    server, degree = pool
    assert_pool_then_vllm_equals_vllm_alone(server, degree, vllm, folder)


@pytest.mark.timeout(600)
def test_a_pull_that_fails_is_recomputed(vllm: str, folder: Path) -> None:
    assert_a_failed_pull_is_recomputed(vllm, folder)


@pytest.mark.timeout(900)
def test_serve_in_front_of_vllm_answers_completions_and_chat(
    vllm: str, folder: Path, tmp_path: Path
) -> None:
    config = pool_config(tmp_path / "serve.toml", folder, 2, url=vllm, engine="vllm")
    prompt = "A benchmark client sends many requests and measures the time to the first token."
    with running_server(config) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        whole = api.completions.create(
            model=str(folder), prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        ids = list(folder_tokens(folder, prompt))
        alone = decode(vllm, folder, ids, max_tokens=8, logprobs=None)
        assert (whole.choices[0].model_extra or {})["token_ids"] == alone["token_ids"]
        assert whole.usage is not None and whole.usage.completion_tokens == 8
        chunks = list(
            api.completions.create(
                model=str(folder), prompt=prompt, max_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        messages = [{"role": "user", "content": "What does the prefill pool do?"}]
        chat = api.chat.completions.create(
            model=str(folder),
            messages=messages,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
        streamed = list(
            api.chat.completions.create(
                model=str(folder),
                messages=messages,
                max_tokens=6,
                temperature=0,
                stream=True,  # type: ignore[arg-type]
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == (chat.choices[0].message.content or "")
        status, leases = server.call("GET", "/v1/handoffs")
        assert status == 200 and leases["open"] == 0 and leases["pulled"] == 4
        with pytest.raises(openai.BadRequestError, match="one prompt per request"):
            api.completions.create(model=str(folder), prompt=["a", "b"], max_tokens=4)


def folder_tokens(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids)
