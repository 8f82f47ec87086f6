"""The decode server's API (``decode/server.py``) in process, against a fake
prefill pool (``support/decode_pool.py``). Answers, streamed or not, carry the
engine's greedy ids; the pool's refusals and broken streams become clear errors;
what the client sends is checked field by field;
the bearer goes to the pool; a failed step ends a stream with an error event; a
client that goes away leaves the batch; ``pull`` reads bfloat16 in uneven chunks.
Last, ``python -m vertumnus decode`` as a process (multiproc): it serves under its
``--served-model-name``, and exits 0 on SIGTERM. The OpenAI dialect's features
through this server are in ``test_openai.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from support.decode_pool import POOL_KEY, FakePool, events, greedy_ids, run, serving
from support.factories import make_tokens
from vertumnus.config import ConfigError
from vertumnus.config.model import eos_token_ids
from vertumnus.decode.engine import DecodeEngine, StepOutput
from vertumnus.decode.kv_client import release
from vertumnus.decode.kv_pull import pull
from vertumnus.engine.model import CausalLM
from vertumnus.kv_wire import HandoffError
from vertumnus.protocol.tokenizer import Tokenizer

API_KEY = "decode-key-0123456789abcdef"
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.timeout(60)
def test_answers_carry_the_engine_greedy_ids(tiny_model: CausalLM) -> None:
    tokenizer = Tokenizer.for_model(None, tiny_model.config.vocab_size)
    prompts = [make_tokens(9, seed=1), tokenizer.encode("the prompt, as text"), [7]]
    expected = [greedy_ids(tiny_model, p, 6) for p in prompts]
    pool = FakePool(tiny_model, chunk_tokens=4)

    async def main() -> None:
        async with serving(tiny_model, pool) as client:
            bodies = [
                {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0}
                for p in (prompts[0], "the prompt, as text", prompts[2])
            ]
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=b) for b in bodies)
            )
            for resp, prompt, ids in zip(answers, prompts, expected, strict=True):
                assert resp.status == 200, await resp.text()
                body = await resp.json()
                (choice,) = body["choices"]
                assert choice["token_ids"] == ids and choice["finish_reason"] == "length"
                assert choice["text"] == tokenizer.decode(ids)
                assert body["object"] == "text_completion" and body["model"] == "tiny"
                assert body["usage"] == {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": 6,
                    "total_tokens": len(prompt) + 6,
                }
                timings = body["timings"]
                assert timings["handoff_bytes"] == pool.stream_bytes(len(prompt) - 1)
                assert timings["prefill_s"] > 0 and timings["first_step_s"] > 0
                assert timings["tpot_s"] == pytest.approx(timings["decode_s"] / 5)

    run(main)
    assert pool.prefills == 3 and pool.leases == {} and len(pool.ended) == 3
    assert pool.auth == [f"Bearer {POOL_KEY}"] * 6  # three prefills, three pulls


@pytest.mark.timeout(60)
def test_a_stream_with_kv_transfer_params(tiny_model: CausalLM) -> None:
    tokenizer = Tokenizer.for_model(None, tiny_model.config.vocab_size)
    prompt = tokenizer.encode("héllo wörld")  # multi-byte characters: held back whole
    expected = greedy_ids(tiny_model, prompt, 5)
    pool = FakePool(tiny_model, dtype="float32", chunk_tokens=3)

    async def main() -> None:
        async with serving(tiny_model, pool) as client:
            params = pool.keep(prompt)  # as a proxy would have it from the pool
            body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": True}
            body["kv_transfer_params"] = params
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            got = events(await resp.text())
        assert got[-1] == "[DONE]"
        chunks = got[:-1]
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[i] for i in expected]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks]
        assert reasons == [None] * 4 + ["length"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(expected)
        # no usage without stream_options.include_usage; timings on the last event only
        assert not any("usage" in c for c in chunks)
        assert [i for i, c in enumerate(chunks) if "timings" in c] == [len(chunks) - 1]
        assert chunks[-1]["timings"]["prefill_s"] is None

    run(main)
    assert pool.prefills == 0 and pool.ended == {"h0"}


@pytest.mark.timeout(60)
def test_the_pools_refusals_and_broken_streams_are_clear_errors(
    tiny_model: CausalLM,
) -> None:
    pool = FakePool(tiny_model)
    prompt = make_tokens(6, seed=2)

    async def main() -> None:
        async with serving(tiny_model, pool) as client:

            async def ask(**params: Any) -> tuple[int, str, Any]:
                body = {"prompt": prompt, "max_tokens": 2}
                if params:
                    body["kv_transfer_params"] = params
                resp = await client.post("/v1/completions", json=body)
                answer = await resp.json()
                return resp.status, answer["error"]["message"], resp.headers

            kept = pool.keep(prompt)
            status, message, _ = await ask(**{**kept, "remote_handle": "nope"})
            assert status == 502 and "HTTP 404: unknown KV hand-off 'nope'" in message
            pulled = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": kept}
            assert (await client.post("/v1/completions", json=pulled)).status == 200
            status, message, _ = await ask(**kept)  # pulled already
            assert status == 502 and "HTTP 410: the KV hand-off 'h0' has ended" in message
            status, message, _ = await ask(**{**pool.keep(prompt), "num_tokens": 9})
            assert status == 400 and "'kv_transfer_params.num_tokens' is 9" in message
            assert pool.released == ["h1"]  # given back at once
            pool.truncate = True
            status, message, _ = await ask()
            assert status == 502 and "truncated" in message
            pool.truncate, pool.layers = False, 3
            status, message, _ = await ask()
            assert status == 502 and "3 layers" in message and "serve the same model" in message
            pool.layers, pool.busy = None, True
            status, message, headers = await ask()
            assert status == 503 and "overloaded" in message and headers["Retry-After"] == "1"
            pool.busy, pool.key = False, "another-key-0123456789"
            status, message, _ = await ask()
            assert status == 502 and "HTTP 401: a valid key is needed" in message
            with socket.socket() as s:  # a port where nobody listens
                s.bind(("127.0.0.1", 0))
                closed = s.getsockname()[1]
            status, message, _ = await ask(**{**kept, "remote_port": closed})
            assert status == 502 and "cannot reach the prefill pool" in message

    run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt": None}, "'prompt'"),
        ({"prompt": []}, "'prompt' must be"),
        ({"prompt": [[1, 2], "x"]}, "'prompt' must be"),
        ({"prompt": [[1, 2], []]}, "the prompt is empty"),
        ({"prompt": [1, 5000]}, "outside the vocabulary"),
        ({"max_tokens": 0}, "'max_tokens'"),
        ({"temperature": -1}, "'temperature'"),
        ({"top_p": 0}, "'top_p'"),
        ({"seed": "x"}, "'seed'"),
        ({"stream": "yes"}, "'stream'"),
        ({"ignore_eos": 1}, "'ignore_eos'"),
        ({"n": 0}, "'n'"),
        ({"n": 2, "best_of": 1}, "'best_of'"),
        ({"suffix": "x"}, "'suffix'"),
        ({"kv_transfer_params": [{"remote_host": "h"}]}, "kv_transfer_params.remote_port"),
        ({"kv_transfer_params": {"remote_host": "h"}}, "kv_transfer_params.remote_port"),
    ],
)
def test_bad_requests_name_the_field(
    tiny_model: CausalLM, change: dict[str, Any], field: str
) -> None:
    async def main() -> None:
        async with serving(tiny_model, FakePool(tiny_model)) as client:
            resp = await client.post("/v1/completions", json={"prompt": [1, 2, 3]} | change)
            body = await resp.json()
            assert resp.status == 400 and field in body["error"]["message"], body
            assert body["error"]["type"] == "invalid_request_error"
            json_type = {"Content-Type": "application/json"}
            resp = await client.post("/v1/completions", data=b"{", headers=json_type)
            assert resp.status == 400

    run(main)


@pytest.mark.timeout(60)
def test_the_api_key_guards_v1_and_eos_stops(tiny_model: CausalLM) -> None:
    prompt = make_tokens(5, seed=3)
    free = greedy_ids(tiny_model, prompt, 6)
    eos = free[2]

    async def main() -> None:
        async with serving(
            tiny_model, FakePool(tiny_model), api_key=API_KEY, eos_token_ids=(eos,)
        ) as client:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
            assert (await client.get("/health")).status == 200
            auth = {"Authorization": f"Bearer {API_KEY}"}
            models = await (await client.get("/v1/models", headers=auth)).json()
            assert models["data"][0]["id"] == "tiny"
            choice = (await (await client.post("/v1/completions", json=body, headers=auth)).json())[
                "choices"
            ][0]
            assert choice["token_ids"] == free[: free.index(eos) + 1]
            assert choice["finish_reason"] == "stop"
            body["ignore_eos"] = True
            resp = await client.post("/v1/completions", json=body, headers=auth)
            assert (await resp.json())["choices"][0]["token_ids"] == free

    run(main)


class FailingEngine(DecodeEngine):
    """Its ``fail_at``-th step (counted from 1) raises."""

    def __init__(self, model: CausalLM, fail_at: int) -> None:
        super().__init__(model)
        self.steps, self.fail_at = 0, fail_at

    def step(self) -> list[StepOutput]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("an injected failure")
        return super().step()


@pytest.mark.timeout(60)
def test_a_failed_step_ends_the_stream_with_an_error_event(tiny_model: CausalLM) -> None:
    prompt = make_tokens(5, seed=7)
    expected = greedy_ids(tiny_model, prompt, 3)

    async def main() -> None:
        engine = FailingEngine(tiny_model, fail_at=2)
        async with serving(tiny_model, FakePool(tiny_model), engine) as client:
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True}
            resp = await client.post("/v1/completions", json=body)
            first, error = events(await resp.text())
            assert first["choices"][0]["token_ids"] == expected[:1]
            assert error == {
                "error": {
                    "message": "decode step failed: RuntimeError: an injected failure",
                    "type": "decode_error",
                    "param": None,
                    "code": 500,
                }
            }
            # The decode thread goes on: the next request is whole.
            resp = await client.post("/v1/completions", json=body | {"stream": False})
            assert (await resp.json())["choices"][0]["token_ids"] == expected
            engine.fail_at = engine.steps + 1
            resp = await client.post("/v1/completions", json=body | {"stream": False})
            assert resp.status == 500 and (await resp.json())["error"]["type"] == "decode_error"

    run(main)


@pytest.mark.timeout(60)
def test_a_client_that_goes_away_leaves_the_batch(tiny_model: CausalLM) -> None:
    async def main() -> None:
        async with serving(tiny_model, FakePool(tiny_model)) as client:

            async def reaches(active: int) -> bool:
                for _ in range(200):
                    health = await (await client.get("/health")).json()
                    if health["active_sequences"] == active:
                        return True
                    await asyncio.sleep(0.05)
                return False

            body = {"prompt": make_tokens(5, seed=4), "max_tokens": 60_000, "stream": True}
            resp = await client.post("/v1/completions", json=body)
            await resp.content.readuntil(b"\n\n")
            assert (await (await client.get("/health")).json())["active_sequences"] == 1
            resp.close()
            assert await reaches(0), "the sequence of a closed stream is still decoding"
            # two prompts, two copies each: all four sequences leave with their client
            prompts = [make_tokens(5, seed=4), make_tokens(6, seed=5)]
            resp = await client.post("/v1/completions", json=body | {"prompt": prompts, "n": 2})
            await resp.content.readuntil(b"\n\n")
            assert await reaches(4)
            resp.close()
            assert await reaches(0), "the sequences of a closed stream are still decoding"

    run(main)


@pytest.mark.timeout(60)
def test_pull_reads_bfloat16_in_uneven_chunks(tiny_model: CausalLM) -> None:
    pool = FakePool(tiny_model, dtype="bfloat16", chunk_tokens=3)
    prompt = make_tokens(12, seed=5)

    async def main() -> None:
        async with TestServer(pool.app()) as server:
            pool.port = server.port or 0
            base = f"http://127.0.0.1:{pool.port}"
            handle = pool.keep(prompt)["remote_handle"]
            _, k, v = pool.leases[handle]
            pulled = await pull(base, handle, POOL_KEY, model=tiny_model.config)
            assert pulled.header.dtype == "bfloat16" and len(pulled.kv) == 4
            for layer, (pk, pv) in enumerate(pulled.kv):
                assert pk.dtype == torch.bfloat16 and torch.equal(pk, k[layer])
                assert torch.equal(pv, v[layer])
            assert pulled.num_bytes == pool.stream_bytes(11) and pulled.seconds > 0
            with pytest.raises(HandoffError, match="HTTP 410") as err:
                await pull(base, handle, POOL_KEY)
            assert err.value.status == 410 and err.value.kind == "http"
            second = pool.keep(prompt)["remote_handle"]
            assert await release(base, second, POOL_KEY) is True
            assert await release(base, second, POOL_KEY) is False  # gone already

    run(main)


@pytest.mark.timeout(30)
def test_end_of_sequence_ids_come_from_the_model_folder(tmp_path: Path) -> None:
    assert eos_token_ids(None) == ()
    (tmp_path / "config.json").write_text('{"eos_token_id": 7}')
    assert eos_token_ids(str(tmp_path)) == (7,)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [3, 9]}')
    assert eos_token_ids(str(tmp_path)) == (3, 9)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ConfigError, match="eos_token_id must be an id or a list of ids"):
        eos_token_ids(str(tmp_path))


@contextmanager
def pool_in_thread(pool: FakePool) -> Iterator[str]:
    """The fake pool on a free port, served by an event loop of its own thread."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(pool.app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    pool.port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{pool.port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_the_decode_command_serves_and_stops_on_sigterm(
    tiny_model: CausalLM, tmp_path: Path
) -> None:
    prompt = make_tokens(7, seed=6)
    expected = greedy_ids(tiny_model, prompt, 4)
    pool = FakePool(tiny_model)
    command = [sys.executable, "-m", "vertumnus", "decode", "--port", "0", "--device", "cpu"]
    env = {**os.environ, "VERTUMNUS_PREFILL_KEY": POOL_KEY, "VERTUMNUS_DECODE_API_KEY": API_KEY}
    with pool_in_thread(pool) as url, (tmp_path / "decode.log").open("w") as log:
        proc = subprocess.Popen(
            [*command, "--prefill", url, "--dtype", "float32", "--served-model-name", "org/m"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("vertumnus listening on http://127.0.0.1:"), (
                line + (tmp_path / "decode.log").read_text()[-2000:]
            )
            base, auth = line.split()[-1], {"Authorization": f"Bearer {API_KEY}"}
            body = {"model": "org/m", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            req = urllib.request.Request(
                base + "/v1/completions",
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"} | auth,
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                answer = orjson.loads(resp.read())
            assert answer["choices"][0]["token_ids"] == expected and answer["model"] == "org/m"
            req = urllib.request.Request(base + "/v1/models/org/m", headers=auth)
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert orjson.loads(resp.read())["id"] == "org/m"  # --served-model-name
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    logs = [orjson.loads(x) for x in (tmp_path / "decode.log").read_text().splitlines()]
    assert [e["event"] for e in logs if e["event"] in ("listening", "completion", "stopped")] == [
        "listening",
        "completion",
        "stopped",
    ]
    assert pool.auth == [f"Bearer {POOL_KEY}"] * 2
