"""A decode server that goes away between a completion's prefill and its forward
(``server/proxy.py``), injected exactly there: a hook on ``Coordinator.prefill``
kills the decode side once the prompts are prefilled, before the proxy reads where
the decode server is. The completion waits for it with its leases kept and is
answered by the one that comes back; or, when none does in time, when its KV ended
meanwhile or when the server shuts down, it gets a 503 naming why, its leases
released; a client that leaves while it waits releases them too. Never a 500, never
a bug counted. The same for a separate decode server (``[decode] url``) that refuses
connections, and for a local process whose sockets are gone before its exit is
seen.

Every step waits on state (``proxy.waiting``, the leases, the metrics), not on
time: the windows are hit on every run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from support.pool_app import FakeLocalDecode, ProxyApp, post, proxy_app
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import DecodeConfig

LOCAL, REMOTE = True, False


def hook_after_prefill(
    monkeypatch: pytest.MonkeyPatch, away: Callable[[], Awaitable[None]]
) -> None:
    """Run ``away`` once each prompt's prefill is done, before its answer reaches
    the proxy."""
    prefill = Coordinator.prefill

    async def hooked(self: Coordinator, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        result = await prefill(self, tokens, *args, **kwargs)
        await away()
        return result

    monkeypatch.setattr(Coordinator, "prefill", hooked)


def die_after_prefill(monkeypatch: pytest.MonkeyPatch, app: ProxyApp) -> FakeLocalDecode:
    """The local decode process dies once each prompt is prefilled, before the proxy
    reads where it is; its supervisor, for the test to bring it back."""
    assert app.local is not None
    local = app.local

    async def die() -> None:
        local.die()

    hook_after_prefill(monkeypatch, die)
    return local


async def until(check: Callable[[], bool], what: str) -> None:
    """Wait for ``check`` (state, not time: the bound only fails a wedged test fast)."""
    for _ in range(3000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def waits(app: ProxyApp, outcome: str) -> float:
    value = app.coord.metrics.registry.get_sample_value
    return value("vertumnus_decode_waits_total", {"outcome": outcome}) or 0.0


def check_clean(app: ProxyApp) -> None:
    assert app.coord.metrics.internal_error_count == 0
    assert app.proxy.waiting == 0


async def send(app: ProxyApp, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, the answer: JSON, or a stream's events' data) of a completion."""
    response = await app.client.post("/v1/completions", json=body)
    if response.status != 200 or not body.get("stream"):
        return response.status, await response.json()
    lines = (await response.text()).splitlines()
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    return 200, [d if d == "[DONE]" else json.loads(d) for d in data]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_decode_process_killed_during_the_prefill_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The local decode process dies while the prompt is prefilled: the completion
    waits, its lease kept, and the restarted process answers it."""

    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(), LOCAL) as app:
            local = die_after_prefill(monkeypatch, app)
            body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": stream}
            answer = asyncio.ensure_future(send(app, body))
            await until(lambda: app.proxy.waiting == 1, "the completion waits")
            assert app.decode.calls == [] and app.coord.handoffs.view()["open"] == 1
            local.back()
            status, out = await answer
            assert status == 200
            if stream:  # the decode server's events, with the pool's share on the last
                assert (
                    out[-1] == "[DONE]"
                    and "".join(e["choices"][0]["text"] for e in out[:-1]) == "ab"
                )
                assert out[-2]["timings"]["prefill_s"] > 0
            else:
                assert out["choices"][0]["text"] == "ab"
            ((path, sent),) = app.decode.calls
            (params,) = sent["kv_transfer_params"]
            assert path == "/v1/completions" and params["prompt_tokens"] == 4
            assert app.coord.handoffs.view()["open"] == 1  # kept for its pull
            assert waits(app, "forwarded") == 1
            check_clean(app)

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_decode_process_not_back_in_time_is_a_503_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """It does not come back within ``restart_wait_s``: a 503 that says the local
    decode process exited and how long the prefilled prompt waited; every lease
    released; nothing reached a decode server."""

    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(restart_wait_s=0.3), LOCAL) as app:
            die_after_prefill(monkeypatch, app)
            body = {"prompt": [[1, 2, 3], [4, 5, 6, 7]], "max_tokens": 3, "stream": stream}
            response = await app.client.post("/v1/completions", json=body)
            out = await response.json()  # (a stream too: refused before its first event)
            assert response.status == 503 and response.headers["Retry-After"] == "2"
            message = out["error"]["message"]
            assert "the local decode process exited with code -9" in message, message
            assert "restart_wait_s" in message and out["error"]["type"] == "unavailable"
            assert app.coord.handoffs.counts["opened"] == 2 and app.decode.calls == []
            view = app.coord.handoffs.view()
            assert (view["open"], view["released"]) == (0, 2)
            assert waits(app, "unavailable") == 1
            check_clean(app)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_dead_process_not_yet_seen_refuses_and_the_next_one_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's sockets are gone but its exit is not seen yet (its address is
    still the current one): the connection is refused, nothing was sent, and the
    completion waits for the process that comes back, on another port."""

    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(), LOCAL) as app:
            assert app.local is not None
            local = app.local

            hook_after_prefill(monkeypatch, app.site.stop)
            answer = asyncio.ensure_future(
                post(app.client, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
            )
            await until(lambda: app.proxy.waiting == 1, "the refused completion waits")
            local.die()  # (the supervisor sees the exit)
            app.site.port = 0
            await app.site.start()
            local.back(app.site.url)
            status, out = await answer
            assert status == 200 and out["choices"][0]["text"] == "ab"
            assert len(app.decode.calls) == 1 and waits(app, "forwarded") == 1
            check_clean(app)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_separate_decode_server_that_refuses_is_waited_for_then_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[decode] url`` refuses connections after the prefill: the completion tries
    again until it listens (200); a second one, which it never listens for again,
    gets a 503 naming the server, its lease released."""

    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(restart_wait_s=1.0), REMOTE) as app:
            hook_after_prefill(monkeypatch, app.site.stop)
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            answer = asyncio.ensure_future(post(app.client, "/v1/completions", body))
            await until(lambda: app.proxy.waiting == 1, "the refused completion waits")
            await app.site.start()  # (the same port)
            status, out = await answer
            assert status == 200 and out["choices"][0]["text"] == "ab"
            assert waits(app, "forwarded") == 1

            status, out = await post(app.client, "/v1/completions", body)
            assert status == 503
            message = out["error"]["message"]
            assert f"the decode server at {app.site.url} is unreachable" in message, message
            view = app.coord.handoffs.view()
            assert (view["open"], view["released"]) == (1, 1)  # (the first one's: kept)
            assert waits(app, "unavailable") == 1 and len(app.decode.calls) == 1
            check_clean(app)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_lease_that_ends_while_the_completion_waits_is_a_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt's worker fails while the completion waits (its lease ends, moved):
    when the decode process is back, nothing is forwarded that it could not pull,
    and the client gets a 503 naming what ended."""

    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(), LOCAL) as app:
            local = die_after_prefill(monkeypatch, app)
            body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 2}
            answer = asyncio.ensure_future(post(app.client, "/v1/completions", body))
            await until(lambda: app.proxy.waiting == 1, "the completion waits")
            (lease,) = app.coord.handoffs.leases.values()
            assert app.coord.handoffs.cut(lease.worker_id, "moved") == 1
            local.back()
            status, out = await answer
            assert status == 503
            message = out["error"]["message"]
            assert "the KV kept for the prompt ended (moved)" in message, message
            assert app.decode.calls == [] and app.coord.handoffs.view()["open"] == 0
            assert waits(app, "unavailable") == 1
            check_clean(app)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_client_that_leaves_while_it_waits_releases_the_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(), LOCAL) as app:
            local = die_after_prefill(monkeypatch, app)
            raw = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
            _, writer = await asyncio.open_connection("127.0.0.1", app.client.port)
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
            writer.write(head.encode() + raw)
            await until(lambda: app.proxy.waiting == 1, "the completion waits")
            writer.close()  # the client leaves
            await until(lambda: waits(app, "client_gone") == 1, "the proxy sees it leave")
            view = app.coord.handoffs.view()
            assert (view["open"], view["released"]) == (0, 1)
            local.back()
            assert app.decode.calls == []
            check_clean(app)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_shutdown_while_it_waits_is_a_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(), LOCAL) as app:
            die_after_prefill(monkeypatch, app)
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            answer = asyncio.ensure_future(post(app.client, "/v1/completions", body))
            await until(lambda: app.proxy.waiting == 1, "the completion waits")
            await app.proxy.close()
            status, out = await answer
            assert status == 503 and "the server is shutting down" in out["error"]["message"]
            assert app.coord.handoffs.view()["open"] == 0 and app.decode.calls == []
            check_clean(app)

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_decode_process_that_dies_with_the_completion_unanswered_is_replaced(
    tmp_path: Path, stream: bool
) -> None:
    """The local decode process takes the completion and dies before answering (its
    connection reset, its exit seen): the lease is still open, so the completion
    goes to the process that comes back, and the client gets its one answer."""

    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(), LOCAL) as app:
            assert app.local is not None
            local = app.local

            def first_dies(body: dict[str, Any]) -> bool:
                if len(app.decode.calls) == 1:
                    local.die()
                    return True
                return False

            app.decode.dies = first_dies
            body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": stream}
            answer = asyncio.ensure_future(send(app, body))
            await until(lambda: app.proxy.waiting == 1, "the completion waits")
            local.back()
            status, out = await answer
            assert status == 200, out
            events = out[:-1] if stream else [out]
            assert "".join(e["choices"][0]["text"] for e in events) == "ab"
            first, second = (sent["kv_transfer_params"] for _, sent in app.decode.calls)
            assert first == second  # the same lease, pulled by the new process
            assert waits(app, "forwarded") == 1 and app.coord.handoffs.view()["open"] == 1
            check_clean(app)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_decode_process_that_dies_after_its_pull_is_a_503_naming_both(
    tmp_path: Path,
) -> None:
    """It pulled the KV (the lease ended) and died before answering: nothing can be
    decoded from that lease any more, so the client gets a 503 that says so."""

    async def main() -> None:
        async with proxy_app(tmp_path, DecodeConfig(), LOCAL) as app:
            assert app.local is not None
            local, handoffs = app.local, app.coord.handoffs

            def pulls_then_dies(body: dict[str, Any]) -> bool:
                (params,) = body["kv_transfer_params"]
                assert handoffs.end(params["remote_handle"], "pulled")
                local.die()
                return True

            app.decode.dies = pulls_then_dies
            body = {"prompt": [1, 2, 3, 4], "max_tokens": 3}
            answer = asyncio.ensure_future(send(app, body))
            await until(lambda: app.proxy.waiting == 1, "the completion waits")
            local.back()
            status, out = await answer
            assert status == 503, out
            message = out["error"]["message"]
            assert "the KV kept for the prompt ended (pulled)" in message, message
            assert "the local decode process that had it went away" in message, message
            assert len(app.decode.calls) == 1 and handoffs.view()["open"] == 0
            check_clean(app)

    asyncio.run(main())
