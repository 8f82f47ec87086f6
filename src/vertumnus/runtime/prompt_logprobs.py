"""A request for its prompt's log-probabilities (an OpenAI ``echo`` with
``logprobs``), on the request path: it skips the prefix cache, and its answer
carries ``PromptLogprobs`` (``engine/logprobs.py``: computed on CP rank 0 of the
worker, in chunks of rows, from its own logits).

A cached prefix gives no logits for its positions, so such a request computes its
whole prompt: the request path gives the policy no block ids for it. Placement then
sees no reusable prefix anywhere (no lookup, no pull, no cache demand counted), and
its lease pins nothing and writes no block: the prefill computes every token from
position 0 and leaves the cache as it was (vLLM's prompt logprobs skip the prefix
cache too). A hand-off still works: with no block held, all of the prompt's rows but
its last come back with the prefill (``kv/leases.export_range``).
"""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.blocks import block_ids
from vertumnus.engine.logprobs import PromptLogprobs
from vertumnus.engine.messages import PrefillCommand, PrefillDone

__all__ = ["check_top_k", "placement_ids", "prompt_answer"]


def check_top_k(top_k: int | None, vocab_size: int) -> None:
    """Refuse (ValueError) a top k the ranks would refuse, before it reaches them (a
    command the ranks refuse takes their worker down)."""
    if top_k is not None and not 0 <= top_k <= vocab_size:
        raise ValueError(f"prompt_logprobs must be in [0, {vocab_size}], got {top_k}")


def placement_ids(
    tokens: Sequence[int], block_size: int, top_k: int | None, caches_prefixes: bool = True
) -> tuple[int, ...]:
    """The block ids the policy places a request by: none for a request of its
    prompt's log-probabilities (it reuses no prefix and writes no block), nor for a
    model whose prefixes the pool does not cache at this block size (DeepSeek-V4
    at a block size not a multiple of 128)."""
    if top_k is not None or not caches_prefixes:
        return ()
    return tuple(block_ids(tokens, block_size))


def prompt_answer(
    top_k: int | None, cmd: PrefillCommand, lead: PrefillDone
) -> PromptLogprobs | None:
    """The prompt's log-probabilities from CP rank 0's answer (``lead``), when the
    request asked for them: the whole prompt's, since nothing was reused."""
    if top_k is None:
        return None
    got = lead.prompt_logprobs
    n = int(cmd.token_ids.numel())
    assert cmd.prefix_len == 0, f"a prompt_logprobs prefill reused {cmd.prefix_len} tokens"
    assert got is not None, "CP rank 0 answered no prompt log-probabilities"
    assert got.top_ids.shape == (n - 1, top_k), f"top ids of shape {tuple(got.top_ids.shape)}"
    return got
