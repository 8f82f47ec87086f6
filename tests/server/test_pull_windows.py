"""The hand-off's windows on the prefill side, each injected exactly where an
``await`` opens it (on fake ranks, in process):

- a pull claims its lease before its head goes out (``response.prepare``): a second
  pull meanwhile gets 409, and a lease that ends meanwhile (its worker failed) is
  not streamed from slots that are no longer pinned; the answer is cut short;
- a lease that ends while it is being pulled cuts the pull off (its sink aborted);
- a prefill whose caller stopped waiting before it ended opens no lease that
  nobody would pull (``RequestPath``: the request's future is cancelled).

No bug counted in any of them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from support.fake_ranks import FakeRanks, MemorySink
from support.pool_app import Client, pool_app
from vertumnus.engine.messages import KVRead, PrefillCommand
from vertumnus.runtime.coordinator import Coordinator

TOKENS = list(range(1, 41))  # two whole blocks of 16 and 7 rows


async def handoff(client: Client) -> str:
    body = {"token_ids": TOKENS, "kv_transfer_params": {"do_remote_decode": True}}
    response = await client.post("/v1/prefill", json=body)
    assert response.status == 200, await response.text()
    handle: str = (await response.json())["kv_transfer_params"]["remote_handle"]
    return handle


def pinned(coord: Coordinator) -> int:
    """Blocks held in use in every worker's cache index."""
    indexes = coord.policy.indexes.values()
    return sum(1 for index in indexes for e in index._entries.values() if e.refcount)


def bearer(coord: Coordinator) -> dict[str, str]:
    return {"Authorization": f"Bearer {coord.handoffs.secret}"}


def hook_prepare(monkeypatch: pytest.MonkeyPatch, meanwhile: Any) -> list[int]:
    """Run ``meanwhile`` (a coroutine function) inside the first pull's
    ``response.prepare``, before its head goes out; the list counts the calls."""
    prepare, calls = web.StreamResponse.prepare, []

    async def hooked(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if request.path.startswith("/v1/kv/") and not calls:
            calls.append(1)
            await meanwhile()
        return await prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", hooked)
    return calls


@pytest.mark.timeout(60)
def test_a_second_pull_while_the_first_starts_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with pool_app(tmp_path) as (client, coord):
            handle = await handoff(client)
            seen: list[tuple[int, Any]] = []

            async def second_pull() -> None:
                response = await client.get(f"/v1/kv/{handle}", headers=bearer(coord))
                seen.append((response.status, await response.json()))

            calls = hook_prepare(monkeypatch, second_pull)
            response = await client.get(f"/v1/kv/{handle}", headers=bearer(coord))
            body = await response.read()
            assert calls == [1] and response.status == 200
            assert len(body) == response.content_length  # whole, once
            ((status, out),) = seen
            assert status == 409 and "is being pulled" in out["error"]["message"]
            counts = coord.handoffs.counts
            assert (counts["pulled"], counts["released"], len(coord.handoffs.leases)) == (1, 0, 0)
            assert coord.metrics.internal_error_count == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_lease_that_ends_while_its_pull_starts_is_not_streamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its worker fails while the pull's head goes out: nothing is read from the
    ranks (the slots are no longer the lease's), the answer is cut short, and the
    lease ended once, as moved."""

    async def main() -> None:
        async with pool_app(tmp_path) as (client, coord):
            handle = await handoff(client)
            (lease,) = coord.handoffs.leases.values()
            fake = coord.ranks
            assert isinstance(fake, FakeRanks)

            async def worker_fails() -> None:
                assert coord.handoffs.cut(lease.worker_id, "moved") == 1

            hook_prepare(monkeypatch, worker_fails)
            sent_before = len(fake.sent)
            response = await client.get(f"/v1/kv/{handle}", headers=bearer(coord))
            assert response.status == 200  # (the head had gone out)
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()
            assert not any(isinstance(m, KVRead) for _, m in fake.sent[sent_before:])
            counts = coord.handoffs.counts
            assert (counts["moved"], counts["pulled"], coord.handoffs.ended[handle]) == (
                1,
                0,
                "moved",
            )
            assert coord.metrics.internal_error_count == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_lease_ended_while_it_is_pulled_cuts_the_pull_off(tmp_path: Path) -> None:
    """Released (the proxy's client left) while its pull streams: the pull's sink is
    aborted at once, so the stream stops reading slots that are free from now on."""

    async def main() -> None:
        async with pool_app(tmp_path) as (client, coord):
            await handoff(client)
            (lease,) = coord.handoffs.leases.values()
            sink = MemorySink()
            pull = asyncio.ensure_future(coord.handoffs.stream(lease, sink))
            while lease.handle not in coord.handoffs._pulls:
                await asyncio.sleep(0)
            assert coord.handoffs.end(lease.handle, "released")
            assert sink.aborted
            with pytest.raises(ConnectionError):
                await pull
            assert coord.handoffs.ended[lease.handle] == "released"
            assert coord.handoffs.counts["pulled"] == 0 and not coord.handoffs._pulls

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_prefill_whose_caller_left_opens_no_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller is cancelled the moment the prefill's command leaves for the ranks
    (the handler of a client that left): the prefill still ends, but no lease opens
    for it, nothing stays pinned, and the next request is served as usual."""

    async def main() -> None:
        async with pool_app(tmp_path) as (_, coord):
            fake = coord.ranks
            assert isinstance(fake, FakeRanks)
            send, caller = FakeRanks.send, []

            def hooked(self: FakeRanks, rank: int, msg: object) -> None:
                send(self, rank, msg)
                if isinstance(msg, PrefillCommand) and caller:
                    caller.pop().cancel()

            monkeypatch.setattr(FakeRanks, "send", hooked)
            task = asyncio.ensure_future(coord.prefill(TOKENS, handoff=True))
            caller.append(task)
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(3000):  # the prefill ends on the ranks' time
                if coord.policy.running(0) is None and not coord.requests.open:
                    break
                await asyncio.sleep(0.01)
            assert coord.policy.running(0) is None  # (its end commits its blocks at once)
            assert coord.handoffs.counts["opened"] == 0 and not coord.handoffs.leases
            assert pinned(coord) == 0
            result = await coord.prefill(TOKENS, handoff=True)
            assert result.handoff is not None and result.cached_tokens == 32
            assert coord.metrics.internal_error_count == 0

    asyncio.run(main())
