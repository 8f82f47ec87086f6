"""What the vLLM connector decides and moves, without vLLM (``integrations/vllm/
loads.py``): how many prompt tokens the pool supplies past vLLM's own prefix cache,
the slots they go to in a paged cache, and the pulls, against a fake pool in process:
the pulled KV equals the model's, the lease ends pulled, a pull that fails marks its
blocks failed (vLLM recomputes them) and still ends its request, and a lease nobody
will pull is released."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestServer

from support.decode_pool import POOL_KEY, FakePool, prompt_kv
from support.factories import make_tokens
from vertumnus.decode.kv_client import TransferParams
from vertumnus.decode.kv_pull import PulledKV
from vertumnus.engine.model import CausalLM
from vertumnus.integrations.vllm.loads import Load, Loader, blocks_of, plan, slot_mapping

BLOCK = 16


def test_plan_counts_the_tokens_past_vllms_own_cache() -> None:
    params = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_handle": "h1",
        "num_tokens": 39,
    }
    transfer, count = plan(params, prompt_len=40, num_computed=0)
    assert transfer == TransferParams("http://127.0.0.1:9", "h1", 39) and count == 39
    assert plan(params, prompt_len=40, num_computed=32)[1] == 7
    assert plan(params, prompt_len=40, num_computed=39)[1] == 0
    assert plan(None, 40, 0) == (None, 0)
    assert plan({"do_remote_decode": True}, 40, 0) == (None, 0)  # not a pool's answer
    with pytest.raises(ValueError, match="all but the last"):
        plan(params, prompt_len=41, num_computed=0)
    with pytest.raises(ValueError, match="remote_handle"):
        plan({**params, "remote_handle": ""}, 40, 0)


def test_slots_follow_the_block_table() -> None:
    slots = slot_mapping((5, 2, 9), block_size=4, first=3, count=6)
    assert slots.tolist() == [23, 8, 9, 10, 11, 36]
    assert blocks_of(Load("r", TransferParams("http://h:1", "h", 9), 3, 6, (5, 2, 9)), 4) == {
        5,
        2,
        9,
    }
    assert blocks_of(Load("r", TransferParams("http://h:1", "h", 9), 4, 4, (5, 2, 9)), 4) == {2}
    with pytest.raises(ValueError, match="fewer than"):
        slot_mapping((5,), block_size=4, first=3, count=6)


async def _until_ended(loader: Loader, write: Any) -> tuple[set[str], set[int]]:
    ended: set[str] = set()
    failed: set[int] = set()
    for _ in range(2000):
        done, bad = loader.finished(write)
        ended |= done
        failed |= bad
        if not loader.pending:
            return ended, failed
        await asyncio.sleep(0.01)
    raise AssertionError("the pulls did not end")


@pytest.mark.timeout(60)
def test_a_load_pulls_the_prompts_kv_and_writes_it_where_vllm_will_read_it(
    tiny_model: CausalLM,
) -> None:
    prompt = make_tokens(40, seed=3)
    k, v = prompt_kv(tiny_model, prompt)  # [L, 39, Hkv, D]

    async def main() -> None:
        pool = FakePool(tiny_model)
        async with TestServer(pool.app()) as server:
            pool.port = server.port or 0
            params = pool.keep(prompt)
            transfer, count = plan(params, len(prompt), num_computed=BLOCK)  # one block held
            assert transfer is not None and count == 39 - BLOCK
            table = (7, 3, 5)
            loader = Loader(POOL_KEY, 10.0, BLOCK)
            caches = [torch.zeros(2, 8 * BLOCK, *k.shape[2:]) for _ in range(k.shape[0])]

            def write(load: Load, pulled: PulledKV) -> None:  # as a backend's cache write
                slots = slot_mapping(load.block_ids, BLOCK, load.first, load.count)
                rows = slice(load.first, load.first + load.count)
                for cache, (key, value) in zip(caches, pulled.kv, strict=True):
                    cache[0, slots], cache[1, slots] = key[rows], value[rows]

            loader.start(Load("r1", transfer, BLOCK, count, table))
            ended, failed = await _until_ended(loader, write)
            assert (ended, failed) == ({"r1"}, set())
            assert transfer.handle in pool.ended  # the pull ended the lease
            for layer, cache in enumerate(caches):
                for rows, x in zip(cache.view(2, 8, BLOCK, *k.shape[2:]), (k, v), strict=True):
                    torch.testing.assert_close(rows[3], x[layer, BLOCK : 2 * BLOCK])
                    torch.testing.assert_close(rows[5, :7], x[layer, 2 * BLOCK : 39])
                    assert not rows[7].any()  # vLLM's own block: not overwritten
            # A pull that fails ends its request with its blocks failed.
            gone = TransferParams(f"http://127.0.0.1:{pool.port}", "no-such-handle", 39)
            loader.start(Load("r2", gone, 0, 39, table))
            ended, failed = await _until_ended(loader, write)
            assert (ended, failed) == ({"r2"}, {7, 3, 5})
            # A lease nobody will pull is released.
            spare = pool.keep(prompt)
            released, _ = plan(spare, len(prompt), 39)
            assert released is not None
            loader.release(released)
            for _ in range(500):
                if spare["remote_handle"] in pool.released:
                    break
                await asyncio.sleep(0.01)
            assert spare["remote_handle"] in pool.released
            loader.close()

    asyncio.run(main())
