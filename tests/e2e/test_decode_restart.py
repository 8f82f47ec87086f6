"""The local decode process SIGKILLed exactly between a completion's prefill and
its forward (a hook on ``Coordinator.prefill``, on real rank processes and a real
decode process): the completion waits for the restarted process, its lease kept,
and gets the same tokens as the same completion before the kill; no bug is
counted and the decode process restarted once. With ``restart_wait_s = 0`` the
same kill is a 503 naming the decode process, its lease released."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from support.factories import cpu_profile, engine_config, make_tokens
from support.pool_app import rank_app
from vertumnus.config.pool import PoolConfig
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import DecodeConfig, ServeConfig
from vertumnus.server.proxy import DecodeProxy

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("no_leftover_ranks")]


def kill_after_prefill(monkeypatch: pytest.MonkeyPatch, proxy: DecodeProxy) -> list[int]:
    """SIGKILL the local decode process once the next prefill is done, before the
    proxy reads where the decode server is; the list holds the killed pid."""
    prefill, killed = Coordinator.prefill, []

    async def hooked(self: Coordinator, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        result = await prefill(self, tokens, *args, **kwargs)
        assert proxy.local is not None and proxy.local.process is not None
        if not killed:
            killed.append(proxy.local.process.pid)
            os.kill(killed[0], signal.SIGKILL)
        return result

    monkeypatch.setattr(Coordinator, "prefill", hooked)
    return killed


async def until_up(proxy: DecodeProxy) -> None:
    assert proxy.local is not None
    assert await proxy.local.wait_up(180) is not None, proxy.local.state


@pytest.mark.timeout(400)
@pytest.mark.parametrize("restart_wait_s", [60.0, 0.0], ids=["waits", "refuses"])
def test_a_decode_process_killed_after_the_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restart_wait_s: float
) -> None:
    decode = DecodeConfig(restart_s=0.0, restart_wait_s=restart_wait_s)
    cfg = ServeConfig(
        pool=PoolConfig((1, 2), (2,)),
        engine=engine_config(),
        profile=cpu_profile(tmp_path),
        policy=PolicyConfig(adaptive=False, replication=False),
        decode=decode,
    )
    body = {"prompt": make_tokens(40, seed=9), "max_tokens": 8, "temperature": 0}

    async def main() -> None:
        async with rank_app(cfg) as (client, coord, proxy):
            await until_up(proxy)
            response = await client.post("/v1/completions", json=body)
            assert response.status == 200, await response.text()
            before = (await response.json())["choices"][0]["token_ids"]
            assert len(before) == 8

            killed = kill_after_prefill(monkeypatch, proxy)
            response = await client.post("/v1/completions", json=body)
            out = await response.json()
            assert killed, "the hook ran"
            value = coord.metrics.registry.get_sample_value
            if restart_wait_s:
                assert response.status == 200, out
                assert out["choices"][0]["token_ids"] == before
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
                waited = value("vertumnus_decode_waits_total", {"outcome": "forwarded"})
                assert waited == 1
                assert coord.handoffs.counts["pulled"] == 2
            else:
                assert response.status == 503, out
                assert "the local decode process" in out["error"]["message"], out
                assert coord.handoffs.counts["released"] == 1
            assert not coord.handoffs.leases
            assert coord.metrics.internal_error_count == 0
            await until_up(proxy)
            assert proxy.local is not None and proxy.local.restarts == 1

    asyncio.run(main())
