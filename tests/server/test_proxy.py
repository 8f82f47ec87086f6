"""The decode proxy (``server/proxy.py``) on the app in process, over fake ranks, in
front of a fake decode server that records what it gets: the client's body goes to
the same path with ``kv_transfer_params`` replaced by one dict per prompt (with the
prompt's log-probabilities when the request asks for them); the whole answer and the
one streamed event that carries "timings" get the pool's share, the cached tokens
only where usage is; a decode server's refusal passes through, and every lease is
released when the decode server refuses or another prompt's prefill fails; the
local decode process serves under the pool's model name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from support.pool_app import DECODE_TIMINGS, FakeDecode, pool_app, post, stream_events
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.request_path import Unavailable
from vertumnus.runtime.serve_config import DecodeConfig, ServeConfig
from vertumnus.server.answers import serve_prefills
from vertumnus.server.proxy import DecodeProxy

POOL_TIMINGS = {"queue_s", "prefill_s", "rank_compute_s", "ttft_s", "total_s"}


def check_pool_share(out: dict[str, Any]) -> None:
    timings = out["timings"]
    assert timings.keys() >= POOL_TIMINGS
    assert timings["decode_s"] == DECODE_TIMINGS["decode_s"]  # the decode's, kept
    assert timings["handoff_bytes"] == DECODE_TIMINGS["handoff_bytes"]
    assert timings["prefill_s"] > 0 and timings["ttft_s"] >= timings["prefill_s"] + 0.012 - 1e-5
    assert (out["worker"], out["cp_degree"]) == (0, 2)


@pytest.mark.timeout(60)
def test_the_body_goes_on_with_one_transfer_dict_per_prompt(tmp_path: Path) -> None:
    decode = FakeDecode()

    async def main() -> None:
        async with pool_app(tmp_path, decode) as (client, coord):
            body = {"prompt": ["abc", "defgh"], "max_tokens": 5, "echo": True, "logprobs": 2}
            status, out = await post(client, "/v1/completions", body)
            assert status == 200, out
            (path, sent), *_ = decode.calls
            assert path == "/v1/completions"
            params = sent.pop("kv_transfer_params")
            assert sent == body  # as the client sent it, but for kv_transfer_params
            assert [p["prompt_tokens"] for p in params] == [3, 5]
            assert [p["num_tokens"] for p in params] == [2, 4]
            assert len({p["remote_handle"] for p in params}) == 2
            assert all(p["do_remote_prefill"] and p["model"] == "tiny" for p in params)
            logprobs = params[1]["prompt_logprobs"]  # the fake ranks': zeros
            assert logprobs["token_logprobs"] == [0.0] * 4
            assert logprobs["top_ids"] == [[0, 0]] * 4 and logprobs["top_values"] == [[0.0] * 2] * 4
            check_pool_share(out)
            assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            assert out["choices"][0]["text"] == "ab"  # the decode server's answer
            assert coord.handoffs.view()["open"] == 2  # the fake never pulls

            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            status, out = await post(client, "/v1/chat/completions", chat)
            assert status == 200, out
            path, sent = decode.calls[1]
            assert path == "/v1/chat/completions"
            (params,) = sent.pop("kv_transfer_params")
            assert sent == chat and "prompt_logprobs" not in params
            check_pool_share(out)

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("include_usage", [False, True], ids=["plain", "include_usage"])
def test_a_stream_gets_the_pools_share_on_the_event_with_timings(
    tmp_path: Path, include_usage: bool
) -> None:
    decode = FakeDecode()

    async def main() -> None:
        async with pool_app(tmp_path, decode) as (client, _):
            body: dict[str, Any] = {"prompt": "hello", "max_tokens": 3, "stream": True}
            if include_usage:
                body["stream_options"] = {"include_usage": True}
            events = await stream_events(client, "/v1/completions", body)
            assert events[-1] == "[DONE]"
            first, *rest = events[:-1]
            assert "timings" not in first and "worker" not in first  # relayed as it was
            assert first["choices"][0]["text"] == "a"
            last = rest[-1]
            check_pool_share(last)
            if include_usage:
                assert last["choices"] == []
                assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
                assert "usage" not in rest[0] and "timings" not in rest[0]
            else:
                assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_refusal_of_the_decode_server_passes_through_and_releases_every_lease(
    tmp_path: Path,
) -> None:
    decode = FakeDecode(status=400)

    async def main() -> None:
        async with pool_app(tmp_path, decode) as (client, coord):
            body = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3}
            status, out = await post(client, "/v1/completions", body)
            assert (status, out["error"]["param"]) == (400, "seed")
            view = coord.handoffs.view()
            assert (view["open"], view["released"]) == (0, 2)
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
            decode.status = 503
            response = await client.post("/v1/completions", json=body)
            assert response.status == 503
            assert coord.handoffs.view()["released"] == 3

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_failed_prefill_releases_the_leases_of_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One prompt of three cannot be prefilled: the client gets its 503, the two
    leases already opened are released, and nothing goes to the decode server."""
    decode = FakeDecode()

    async def main() -> None:
        async with pool_app(tmp_path, decode) as (client, coord):
            prefill = Coordinator.prefill

            async def failing(self: Coordinator, tokens: Any, *args: Any, **kwargs: Any) -> Any:
                if list(tokens) == [9, 9]:
                    raise Unavailable("the test's")
                return await prefill(self, tokens, *args, **kwargs)

            monkeypatch.setattr(Coordinator, "prefill", failing)
            body = {"prompt": [[1, 2, 3], [9, 9], [4, 5, 6]], "max_tokens": 3}
            status, out = await post(client, "/v1/completions", body)
            assert status == 503 and "the test's" in out["error"]["message"]
            view = coord.handoffs.view()
            assert (view["open"], view["released"], coord.handoffs.counts["opened"]) == (0, 2, 2)
            assert decode.calls == []

    asyncio.run(main())


def test_the_local_decode_process_serves_under_the_pools_model_name() -> None:
    """The decode process is told the pool's name (``--served-model-name``): a body's
    ``model`` that the pool accepts, it accepts too."""
    cfg = ServeConfig()
    coord = Coordinator(cfg)  # (never started)
    proxy = DecodeProxy(coord, DecodeConfig(local=True), cfg.model)
    assert proxy.local is not None
    argv = proxy.local.command()
    assert argv[argv.index("--served-model-name") + 1] == coord.cfg.model
    assert argv[argv.index("--model") + 1] == cfg.model


@pytest.mark.timeout(60)
def test_a_request_cancelled_mid_prefill_releases_the_leases_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler cancelled (its client gone) while one prompt's prefill still runs:
    the leases of the prompts already prefilled are released."""

    async def main() -> None:
        async with pool_app(tmp_path) as (_, coord):
            prefill = Coordinator.prefill

            async def hanging(self: Coordinator, tokens: Any, *args: Any, **kwargs: Any) -> Any:
                if list(tokens) == [9, 9]:
                    await asyncio.Event().wait()  # never
                return await prefill(self, tokens, *args, **kwargs)

            monkeypatch.setattr(Coordinator, "prefill", hanging)
            task = asyncio.ensure_future(serve_prefills(coord, [[1, 2, 3], [9, 9], [4, 5]], True))
            for _ in range(500):
                if coord.handoffs.counts["opened"] == 2:
                    break
                await asyncio.sleep(0.01)
            assert coord.handoffs.counts["opened"] == 2 and not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            view = coord.handoffs.view()
            assert (view["open"], view["released"]) == (0, 2)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_every_answer_feeds_vllms_latency_generation_and_running_series(tmp_path: Path) -> None:
    decode = FakeDecode()

    async def main() -> None:
        async with pool_app(tmp_path, decode) as (client, coord):
            value = coord.metrics.registry.get_sample_value
            label = {"model_name": "tiny"}
            status, _ = await post(client, "/v1/completions", {"prompt": "ab", "max_tokens": 1})
            assert status == 200  # the pool's own answer: one token
            status, _ = await post(client, "/v1/completions", {"prompt": "ab", "max_tokens": 4})
            assert status == 200  # decoded: the fake's usage says 2
            body = {"prompt": "hello", "max_tokens": 3, "stream": True}
            events = await stream_events(client, "/v1/completions", body)
            assert events[-1] == "[DONE]"  # streamed: the timings' decoded_tokens, 2
            assert value("vllm:generation_tokens_total", label) == 1 + 2 + 2
            assert value("vllm:e2e_request_latency_seconds_count", label) == 3
            assert coord.metrics.vllm.decodes_in_flight == 0  # each decode ended

    asyncio.run(main())
