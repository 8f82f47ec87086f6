"""The log-probabilities of a prompt's own tokens (an OpenAI ``echo`` with
``logprobs``: the loglikelihood request of evaluation harnesses).

CP rank 0 of a worker, which holds the final hidden states of the whole computed
suffix after their all-gather (``zigzag.prefill_rank``), computes them there from
its own logits: the [R, V] logits never leave the rank, and they exist only
``chunk_rows`` rows at a time, so memory stays O(chunk_rows x V). What crosses the
process boundary is ``PromptLogprobs``: O(R x k).

Row i of the hidden states predicts token i + 1: for suffix tokens t_0 .. t_{R-1}
the rank answers log p(t_{i+1} | everything before it) for i in 0 .. R - 2, and the
k most likely ids at each of those positions (most likely first). A cached prefix
has no hidden states here, so the whole prompt's values need a prefill that
computed it all (``prefix_len`` 0: the runtime's request path skips the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vertumnus.engine.wire import TensorsAsBytes

CHUNK_ROWS = 512  # rows of logits [rows, V] that exist at once


@dataclass(frozen=True)
class PromptLogprobs(TensorsAsBytes):
    """A prompt's log-probabilities, for n tokens (CPU tensors once answered)."""

    token_logprobs: Tensor  # fp32 [n - 1]: log p(tokens[i + 1] | tokens[: i + 1])
    top_ids: Tensor  # int64 [n - 1, k]: the k most likely ids at each, most likely first
    top_values: Tensor  # fp32 [n - 1, k]: their log-probabilities
    _tensor_fields = ("token_logprobs", "top_ids", "top_values")

    def cpu(self) -> PromptLogprobs:
        return PromptLogprobs(self.token_logprobs.cpu(), self.top_ids.cpu(), self.top_values.cpu())


@torch.inference_mode()
def prompt_logprobs(
    logits: Callable[[Tensor], Tensor],
    hidden: Tensor,
    next_ids: Tensor,
    top_k: int,
    chunk_rows: int = CHUNK_ROWS,
) -> PromptLogprobs:
    """Log-probabilities of ``next_ids`` [N] after the final hidden states ``hidden``
    [N, H] (row i predicts ``next_ids[i]``) and the ``top_k`` most likely ids at each
    row; ``logits``: [rows, H] -> fp32 [rows, V] (the model's head). Computed
    ``chunk_rows`` rows at a time; the values are those of ``torch.log_softmax``."""
    if hidden.shape[0] != next_ids.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows for {next_ids.shape[0]} next ids")
    if top_k < 0 or chunk_rows < 1:
        raise ValueError(f"top_k must be >= 0 and chunk_rows >= 1, got {top_k}, {chunk_rows}")
    token, ids, values = [], [], []
    for a in range(0, hidden.shape[0], chunk_rows):
        rows = logits(hidden[a : a + chunk_rows]).float()  # [c, V]
        lse = torch.logsumexp(rows, dim=-1, keepdim=True)  # [c, 1]
        target = next_ids[a : a + chunk_rows, None]
        token.append((rows.gather(-1, target) - lse)[:, 0])
        top = torch.topk(rows, top_k, dim=-1)  # (ordered on logits = on log-probabilities)
        ids.append(top.indices)
        values.append(top.values - lse)
    if not token:  # one computed token: nothing to predict
        dev, fp32 = hidden.device, torch.float32
        return PromptLogprobs(
            torch.empty(0, dtype=fp32, device=dev),
            torch.empty((0, top_k), dtype=torch.long, device=dev),
            torch.empty((0, top_k), dtype=fp32, device=dev),
        )
    return PromptLogprobs(torch.cat(token), torch.cat(ids), torch.cat(values))
