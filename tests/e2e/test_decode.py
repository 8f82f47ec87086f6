"""``python -m vertumnus serve`` with its local decode process, end to end: a stock
OpenAI client streams a completion of many tokens; greedy ids equal transformers'
``generate`` on the checkpoint the test saved, for a fresh prompt and one whose
prefix is cached, on workers of CP degree 1 (2, 3 and MoE:
``runtime/test_handoff_exact.py``); a decode process killed mid-stream gives the
client an error event, no lease is left, the pool keeps serving and the proxy
starts a new decode process."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from support.factories import make_tokens
from support.processes import children_of, is_running
from support.reference import VOCAB, Checkpoint, hf_greedy, make_checkpoint
from support.server import Server, running_server, write_folder_config

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3-decode"), tie_word_embeddings=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("serve-decode") / "serve.toml"
    write_folder_config(config, checkpoint.model_dir, decode={"local": True, "restart_s": 0.2})
    with running_server(config) as srv:
        yield srv


def reference(checkpoint: Checkpoint, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``: ``n`` new ids."""
    return hf_greedy(checkpoint.hf, prompt, n)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.timeout(300)
def test_a_stock_openai_client_streams_the_greedy_continuation(
    server: Server, checkpoint: Checkpoint
) -> None:
    shared = make_tokens(70, seed=11, vocab=VOCAB)
    for prompt in ([*shared, 3, 4], [*shared, 5]):  # the second reuses the first's prefix
        stream = client(server).completions.create(
            model=str(checkpoint.model_dir),  # the served name: --model as given
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        ids = [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]]
        assert ids == reference(checkpoint, prompt, 12)
        assert chunks[-1].choices[0].finish_reason == "length"
        whole = client(server).completions.create(
            model=str(checkpoint.model_dir),  # the served name: --model as given
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert (whole.choices[0].model_extra or {})["token_ids"] == ids
        timings = (whole.model_extra or {})["timings"]
        assert timings["handoff_bytes"] > 0 and timings["ttft_s"] >= timings["prefill_s"] > 0
    status, _view = server.call("GET", "/v1/cache")
    assert status == 200
    status, _composition = server.call("GET", "/v1/composition")
    assert status == 200


def _stream_events(server: Server, body: dict[str, Any]) -> Iterator[dict[str, Any] | str]:
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: ") :]
                yield data if data == "[DONE]" else json.loads(data)


@pytest.mark.timeout(300)
def test_a_decode_process_killed_mid_stream(server: Server, checkpoint: Checkpoint) -> None:
    decoders = [p for p in children_of(server.proc.pid) if _is_decoder(p)]
    assert len(decoders) == 1
    body = {"prompt": make_tokens(40, seed=12, vocab=VOCAB), "max_tokens": 4000, "stream": True}
    events: list[dict[str, Any] | str] = []
    for event in _stream_events(server, {**body, "temperature": 0, "ignore_eos": True}):
        events.append(event)
        if len(events) == 3:
            os.kill(decoders[0], signal.SIGKILL)
    assert isinstance(events[-1], dict) and "error" in events[-1], events[-3:]
    error = events[-1]["error"]
    assert (error["type"], error["code"], error["param"]) == ("decode_error", 502, None)
    assert "[DONE]" not in events
    # The pool keeps serving prefills, and the proxy starts a new decode process.
    status, _answer = server.call("POST", "/v1/prefill", {"token_ids": [1, 2, 3]})
    assert status == 200
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        fresh = [p for p in children_of(server.proc.pid) if _is_decoder(p)]
        if fresh and fresh != decoders and all(is_running(p) for p in fresh):
            try:
                again = client(server).completions.create(
                    model=str(checkpoint.model_dir),
                    prompt=[1, 2, 3, 4],
                    max_tokens=3,
                    temperature=0,
                )
            except openai.APIStatusError:
                time.sleep(0.5)  # still starting
                continue
            assert len((again.choices[0].model_extra or {})["token_ids"]) == 3
            break
        time.sleep(0.5)
    else:
        raise AssertionError("no new decode process served")
    status, leases = server.call("GET", "/v1/handoffs")
    assert status == 200 and leases["open"] == 0  # pulled or released: none left


def _is_decoder(pid: int) -> bool:
    """Whether ``pid`` runs ``python -m vertumnus decode`` (its arguments, not a
    substring of its command line, which the checkout's path may contain)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[1:4] == [b"-m", b"vertumnus", b"decode"]
