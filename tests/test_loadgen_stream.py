"""The load generator's generation path (``output_tokens`` > 1) against an
in-process fake of the streaming completions endpoint whose delays are known: TTFT,
TPOT and ITL come out as the delays say, and a stream that breaks (an error event,
an end before ``[DONE]``, a cut connection, an HTTP error, no token) is a failed
request with its error, never dropped."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web

from support.factories import make_tokens
from vertumnus import loadgen

FIRST_S = 0.25  # the fake's time from a request to its first token
GAP_S = 0.06  # then between tokens
# What the fake does, chosen by the prompt's first token id:
OK, STOP, ERROR, TRUNCATED, CUT, REFUSED, EMPTY = range(7)
STOP_TOKENS = 3  # STOP finishes early, with "stop"
BROKEN_TOKENS = 2  # ERROR, TRUNCATED and CUT break after this many tokens


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _token_event(prompt: list[int], i: int, finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "text": f" t{i}", "token_ids": [100 + i], "finish_reason": finish}
    event: dict[str, Any] = {"id": "c", "object": "text_completion", "model": "fake"}
    event["choices"] = [choice]
    if finish is not None:  # the last event carries the usage and timings
        details = {"cached_tokens": len(prompt) // 2}
        event["usage"] = {"prompt_tokens": len(prompt), "prompt_tokens_details": details}
        event["timings"] = {"tpot_s": GAP_S}
        event["worker"], event["cp_degree"] = 1, 2  # where the proxy's pool prefilled it
    return event


@asynccontextmanager
async def fake_server() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """``POST /v1/completions`` on 127.0.0.1 (a free port): the URL, and the request
    bodies as they come."""
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        prompt, mode = body["prompt"], body["prompt"][0]
        if mode == REFUSED:
            error = {"error": {"message": "overloaded", "type": "overloaded"}}
            return web.json_response(error, status=503)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        count = {OK: body["max_tokens"], STOP: STOP_TOKENS, EMPTY: 0}.get(mode, BROKEN_TOKENS)
        await asyncio.sleep(FIRST_S)
        for i in range(count):
            if i > 0:
                await asyncio.sleep(GAP_S)
            finish = None
            if i == count - 1 and mode in (OK, STOP):
                finish = "stop" if mode == STOP else "length"
            await stream.write(_event(_token_event(prompt, i, finish)))
        if mode == CUT:
            assert request.transport is not None
            request.transport.close()
            return stream
        if mode == ERROR:
            error = {"error": {"message": "decode failed: boom", "type": "decode_error"}}
            await stream.write(_event(error))
        elif mode != TRUNCATED:
            await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", bodies
    finally:
        await runner.cleanup()


def make_request(index: int, mode: int) -> loadgen.LoadRequest:
    """A 32-token prompt whose first id tells the fake what to do."""
    return loadgen.LoadRequest(index, 0.0, (mode, *make_tokens(31, seed=index)))


def measure(
    requests: list[loadgen.LoadRequest], output_tokens: int
) -> tuple[loadgen.LoadResult, list[dict[str, Any]]]:
    async def go() -> tuple[loadgen.LoadResult, list[dict[str, Any]]]:
        async with fake_server() as (url, bodies):
            result = await loadgen.run(url, requests, 8, output_tokens=output_tokens)
        return result, bodies

    return asyncio.run(go())


@pytest.mark.timeout(60)
def test_ttft_tpot_and_itl_come_out_as_the_delays_say() -> None:
    requests = [make_request(i, OK) for i in range(4)]
    result, bodies = measure(requests, output_tokens=6)
    summary = loadgen.summarize(result, detailed=True)

    asked = {"max_tokens": 6, "stream": True, "temperature": 0, "ignore_eos": True}
    assert sorted(b.pop("prompt") for b in bodies) == sorted(list(r.token_ids) for r in requests)
    assert bodies == [asked] * 4
    assert (summary["completed"], summary["failed"], summary["errors"]) == (4, 0, [])
    for o in result.outcomes:
        assert o.output_tokens == 6 and len(o.itl_s) == 5
        assert o.ttft_s is not None and o.latency_s is not None and o.tpot_s is not None
        # TPOT is (latency - TTFT) / 5, the mean of the request's five gaps.
        assert o.tpot_s == pytest.approx(statistics.fmean(o.itl_s), rel=1e-9)
        assert o.latency_s == pytest.approx(o.ttft_s + sum(o.itl_s), rel=1e-9)
        assert o.server_tpot_s == GAP_S
        assert (o.worker, o.cp_degree) == (1, 2)
    # Generous upper margins: the machine is shared; the lower ones are the sleeps.
    assert FIRST_S * 1e3 - 5 <= summary["median_ttft_ms"] <= FIRST_S * 1e3 + 200
    for name in ("mean_tpot_ms", "median_tpot_ms", "mean_itl_ms"):
        assert GAP_S * 1e3 * 0.8 <= summary[name] <= GAP_S * 1e3 + 40, name
    assert summary["p99_itl_ms"] >= summary["median_itl_ms"]
    assert summary["total_output_tokens"] == 24
    assert summary["output_throughput"] == pytest.approx(24 / summary["duration"])
    assert summary["token_hit_rate"] == 0.5  # from the last event's usage

    record = summary["requests"][0]
    assert record["output_tokens"] == 6 and len(record["itl_s"]) == 5
    assert record["tpot_s"] == result.outcomes[0].tpot_s
    text = loadgen.text_summary(summary).splitlines()
    assert "Total generated tokens:       24" in text
    assert "-----Time per Output Token (excl. 1st token)------" in text
    assert "---------------Inter-token Latency----------------" in text
    for label in ("Mean TPOT (ms):", "Median TPOT (ms):", "P99 ITL (ms):"):
        assert any(line.startswith(label) for line in text), label


@pytest.mark.timeout(60)
def test_broken_streams_are_failed_requests_with_their_errors() -> None:
    modes = [OK, STOP, ERROR, TRUNCATED, CUT, REFUSED, EMPTY]
    result, bodies = measure([make_request(i, mode) for i, mode in enumerate(modes)], 5)
    summary = loadgen.summarize(result, detailed=True)

    assert len(bodies) == 7 and len(summary["requests"]) == 7
    assert (summary["completed"], summary["failed"]) == (2, 5)
    assert summary["total_output_tokens"] == 5 + STOP_TOKENS  # completed requests only
    by_mode = dict(zip(modes, result.outcomes, strict=True))
    assert by_mode[OK].error is None and by_mode[OK].output_tokens == 5
    assert by_mode[STOP].error is None and by_mode[STOP].output_tokens == STOP_TOKENS
    assert by_mode[ERROR].error == "stream error: decode failed: boom (decode_error)"
    assert by_mode[TRUNCATED].error == "the stream ended before [DONE], after 2 tokens"
    assert "ClientPayloadError" in str(by_mode[CUT].error)  # the body's chunks never ended
    assert by_mode[REFUSED].error == "HTTP 503: overloaded"
    assert by_mode[EMPTY].error == "the stream ended with no token"
    for mode in (ERROR, TRUNCATED, CUT):  # what was measured before the break stays
        o = by_mode[mode]
        assert o.output_tokens == BROKEN_TOKENS and len(o.itl_s) == 1 and o.ttft_s is not None
    assert len(summary["errors"]) == 5
    # Neither the server's usage nor its TPOT came on a broken stream.
    assert by_mode[ERROR].cached_tokens is None and by_mode[ERROR].server_tpot_s is None
    assert "Failed requests:              5" in loadgen.text_summary(summary)


def test_prefill_only_results_keep_their_shape() -> None:
    outcome = loadgen.Outcome(0, 10, 0.0, ttft_s=0.1, server_ttft_s=0.09, cached_tokens=5)
    summary = loadgen.summarize(loadgen.LoadResult([outcome], 1.0), detailed=True)
    assert not {"total_output_tokens", "mean_tpot_ms", "mean_itl_ms"} & set(summary)
    assert not {"output_tokens", "tpot_s", "itl_s"} & set(summary["requests"][0])
    text = loadgen.text_summary(summary)
    assert "TPOT" not in text and "ITL" not in text and "Token hit rate:" in text
    with pytest.raises(ValueError, match="output_tokens"):
        asyncio.run(loadgen.run("http://127.0.0.1:1", [], output_tokens=0))
