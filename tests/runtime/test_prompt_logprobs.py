"""A prompt's log-probabilities (``Coordinator.prefill(prompt_logprobs=k)``) over
real rank processes (gloo) equal ``torch.log_softmax`` of transformers' logits on
the checkpoint the test saved, at CP 1 and 2: every token's and the top k (0
included), also when the prompt's prefix was cached by an earlier request (the
request skips the cache and computes the whole prompt, leaving the cache as it
was), for a one-token prompt, and with a hand-off (all of the prompt's rows but its
last come back with the prefill, as a plain hand-off's)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from support.factories import cpu_profile, engine_config, make_tokens
from support.reference import ATOL, VOCAB, Checkpoint, hf_logits, max_abs_diff
from vertumnus.config.pool import PoolConfig
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.request_path import PrefillResult
from vertumnus.runtime.serve_config import ServeConfig

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("no_leftover_ranks")]
K = 5


def check(result: PrefillResult, checkpoint: Checkpoint, prompt: list[int], k: int) -> None:
    """The whole prompt's log-probabilities, and the last position's logits, equal
    transformers'."""
    got = result.prompt_logprobs
    assert got is not None
    assert (result.cached_tokens, result.computed_tokens) == (0, len(prompt))
    logits = hf_logits(checkpoint.hf, prompt)
    assert max_abs_diff(result.logits, logits[-1]) < ATOL
    assert result.first_token == int(logits[-1].argmax())
    ref = torch.log_softmax(logits, dim=-1)[:-1]  # row i predicts prompt[i + 1]
    n = len(prompt) - 1
    assert got.token_logprobs.dtype == torch.float32 and got.token_logprobs.shape == (n,)
    assert got.top_ids.dtype == torch.long and got.top_ids.shape == (n, k)
    assert got.top_values.dtype == torch.float32 and got.top_values.shape == (n, k)
    close = dict(rtol=0.0, atol=ATOL)  # (empty tensors too: k = 0, one token)
    want = ref.gather(1, torch.tensor(prompt[1:], dtype=torch.long)[:, None])[:, 0]
    torch.testing.assert_close(got.token_logprobs, want, **close)
    top = torch.topk(ref, k, dim=-1)
    torch.testing.assert_close(got.top_values, top.values, **close)
    # the ids are the most likely ones (ids of near-equal values may swap places)
    torch.testing.assert_close(ref.gather(1, got.top_ids), top.values, **close)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [1, 2])
def test_prompt_logprobs_equal_transformers(
    tmp_path: Path, checkpoint: Checkpoint, cp: int
) -> None:
    cfg = ServeConfig(
        model=str(checkpoint.model_dir),
        pool=PoolConfig((cp,), (cp,)),
        engine=engine_config(),
        profile=cpu_profile(tmp_path),
        policy=PolicyConfig(adaptive=False, replication=False),
    )

    async def main() -> None:
        coord = Coordinator(cfg)
        await coord.start()
        try:
            shared = make_tokens(40, seed=cp, vocab=VOCAB)  # 2 whole blocks and 8 tokens
            prompt = [*shared, 5, 6, 7]
            plain = await coord.prefill(shared)  # caches the 2 blocks
            assert plain.prompt_logprobs is None and plain.cached_tokens == 0
            check(await coord.prefill(prompt, prompt_logprobs=K), checkpoint, prompt, K)
            check(await coord.prefill(prompt, prompt_logprobs=0), checkpoint, prompt, 0)
            check(await coord.prefill([9], prompt_logprobs=K), checkpoint, [9], K)
            # The cache is as it was: a plain request reuses the shared blocks.
            again = await coord.prefill(prompt, handoff=True)
            assert again.cached_tokens == 32 and again.prompt_logprobs is None
            held = await coord.prefill(prompt, handoff=True, prompt_logprobs=K)
            check(held, checkpoint, prompt, K)
            assert again.handoff is not None and held.handoff is not None
            assert held.handoff.blocks == [] and held.handoff.rows is not None
            assert held.handoff.rows.shape[2] == held.handoff.num_tokens == len(prompt) - 1
            assert again.handoff.rows is not None  # the rows after its 2 held blocks
            assert max_abs_diff(held.handoff.rows[:, :, 32:], again.handoff.rows) < ATOL
            for lease in (again.handoff, held.handoff):
                assert coord.handoffs.end(lease.handle, "released")
            assert coord.handoffs.view()["open"] == 0
            for bad in (-1, VOCAB + 1):
                with pytest.raises(ValueError, match="prompt_logprobs must be in"):
                    await coord.prefill(prompt, prompt_logprobs=bad)
        finally:
            await coord.close()

    asyncio.run(main())
