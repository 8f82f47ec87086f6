"""A prompt's log-probabilities on the rank (``engine/logprobs.py``): computed in
chunks of rows, they equal ``torch.log_softmax`` over all the rows at once, for any
chunk size and top k (0 included) and for one token (nothing to predict); through
``prefill_rank`` at CP 1 to 3 (threads) they equal the log-softmax of the same
prefill's logits of every row, with the last row's logits still returned, on CP rank
0 only; they cross the pipe as bytes, and the ranks refuse a top k outside the
vocabulary. (Against transformers over rank processes: ``tests/runtime``.)"""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from support.factories import BLOCK_SIZE, TINY, make_tokens
from support.threads import make_stores, run_ranks
from vertumnus.engine.comm import Communicator
from vertumnus.engine.logprobs import PromptLogprobs, prompt_logprobs
from vertumnus.engine.messages import PrefillDone
from vertumnus.engine.model import CausalLM
from vertumnus.engine.rank_state import _check_command
from vertumnus.engine.zigzag import prefill_rank
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.runtime.prefill import plan_prefill

ATOL = 1e-4  # fp32


def unchunked(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> PromptLogprobs:
    """The plain math: log_softmax of every row, then gather and top k."""
    lp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(lp, k, dim=-1)
    return PromptLogprobs(lp.gather(1, next_ids[:, None])[:, 0], top.indices, top.values)


def assert_matches(got: PromptLogprobs, want: PromptLogprobs, full: torch.Tensor) -> None:
    """``got`` equals ``want``; its top ids are the most likely ones, by ``full``'s
    log-probabilities (ids of near-equal values may be ordered either way)."""
    n, k = want.top_ids.shape
    assert got.token_logprobs.dtype == torch.float32 and got.token_logprobs.shape == (n,)
    assert got.top_ids.dtype == torch.long and got.top_ids.shape == (n, k)
    assert got.top_values.dtype == torch.float32 and got.top_values.shape == (n, k)
    torch.testing.assert_close(got.token_logprobs, want.token_logprobs, rtol=0, atol=ATOL)
    torch.testing.assert_close(got.top_values, want.top_values, rtol=0, atol=ATOL)
    lp = torch.log_softmax(full, dim=-1)
    torch.testing.assert_close(lp.gather(1, got.top_ids), want.top_values, rtol=0, atol=ATOL)
    assert bool((got.top_values[:, :-1] >= got.top_values[:, 1:]).all()), "not most likely first"


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("k", [0, 1, 7])
def test_chunked_equals_unchunked(chunk: int, k: int) -> None:
    gen = torch.Generator().manual_seed(chunk * 10 + k)
    hidden = torch.randn(37, 16, generator=gen)
    head = torch.randn(50, 16, generator=gen) / 2
    next_ids = torch.randint(0, 50, (37,), generator=gen)
    calls: list[int] = []

    def logits(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows @ head.T

    got = prompt_logprobs(logits, hidden, next_ids, k, chunk_rows=chunk)
    assert max(calls) == min(chunk, 37) and sum(calls) == 37  # never more rows at once
    full = hidden @ head.T
    assert_matches(got, unchunked(full, next_ids, k), full)


@pytest.mark.parametrize("k", [0, 3])
def test_one_token_has_nothing_to_predict(k: int) -> None:
    got = prompt_logprobs(lambda rows: rows, torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), k)
    assert got.token_logprobs.shape == (0,) and got.token_logprobs.dtype == torch.float32
    assert got.top_ids.shape == (0, k) and got.top_ids.dtype == torch.long
    assert got.top_values.shape == (0, k) and got.top_values.dtype == torch.float32


def test_mismatched_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="hidden rows"):
        prompt_logprobs(lambda rows: rows, torch.zeros(3, 8), torch.zeros(2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="top_k"):
        prompt_logprobs(lambda rows: rows, torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), -1)


@pytest.mark.parametrize("c", [1, 2, 3])
@pytest.mark.parametrize("k", [0, 5])
def test_prefill_rank_equals_log_softmax_of_all_logits(
    tiny_model: CausalLM, c: int, k: int
) -> None:
    tokens = make_tokens(45, seed=c + 10 * k)
    ranks = tuple(range(c))
    _, cmd = plan_prefill(WorkerCacheIndex(c, 0), tokens, BLOCK_SIZE, 0, ranks, "all")

    def body(r: int, comm: Communicator) -> tuple[torch.Tensor | None, list[PromptLogprobs]]:
        prompt: list[PromptLogprobs] = []
        step = replace(cmd.for_rank(r), prompt_logprobs=k)
        out = prefill_rank(tiny_model, comm, None, step, "last", None, prompt)
        return out, prompt

    outs, _ = run_ranks(c, body)
    assert [o for o, _ in outs[1:]] == [None] * (c - 1)
    assert all(p == [] for _, p in outs[1:]), "only CP rank 0 computes them"
    all_logits = run_ranks(
        c, lambda r, comm: prefill_rank(tiny_model, comm, None, cmd.for_rank(r), logits="all")
    )[0][0]
    last, [got] = outs[0]
    torch.testing.assert_close(last, all_logits[-1:], rtol=0, atol=ATOL)
    next_ids = torch.tensor(tokens[1:])
    assert_matches(got, unchunked(all_logits[:-1], next_ids, k), all_logits[:-1])


def test_prefill_done_carries_them_as_bytes() -> None:
    got = PromptLogprobs(torch.randn(4), torch.randint(0, 9, (4, 2)), torch.randn(4, 2))
    done = PrefillDone(3, 0, 0.1, torch.randn(1, 9), {"out": 1}, prompt_logprobs=got)
    back = pickle.loads(pickle.dumps(done))
    assert b"_rebuild_tensor" not in pickle.dumps(done)  # (bytes, not tensors' storages)
    for name in ("token_logprobs", "top_ids", "top_values"):
        assert torch.equal(getattr(back.prompt_logprobs, name), getattr(got, name))


@pytest.mark.parametrize("k", [-1, TINY.vocab_size + 1])
def test_ranks_refuse_a_top_k_outside_the_vocabulary(k: int) -> None:
    _, cmd = plan_prefill(WorkerCacheIndex(1, 8), make_tokens(20, 1), BLOCK_SIZE, 0, (0,))
    store = make_stores(1, 8)[0]
    _check_command(replace(cmd, prompt_logprobs=TINY.vocab_size), TINY.vocab_size, store)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        _check_command(replace(cmd, prompt_logprobs=k), TINY.vocab_size, store)
