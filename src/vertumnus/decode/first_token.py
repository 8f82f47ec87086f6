"""The one token the prefill pool answers by itself (``max_tokens`` 1, not streamed):
chosen from the logits at the prompt's last position for each of the ``best_of``
copies, by the same sampling model as the decode's steps (``sampling.py``). The pool's
server answers with it (``server/answers.py``); the prompt's log-probabilities of an
echo (``prompt_entries``) serve the pool and the decode server alike
(``transfer.py``).

It ends its choice with "stop" when it is an end-of-sequence id (unless
``ignore_eos``) or one of ``stop_token_ids``; with "length" otherwise (``min_tokens``
of 1 bans those ids first).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vertumnus.decode.sampling import Choosing, choose_rows, make_generator, top_logprobs
from vertumnus.protocol.request import GenerateRequest, Prompt
from vertumnus.protocol.sampling_params import TokenLogprobs


def end_ids(req: GenerateRequest, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The ids that end a choice: ``stop_token_ids``, and end-of-sequence ids
    unless ``ignore_eos``."""
    return frozenset(req.stop_token_ids) | frozenset(() if req.ignore_eos else eos_token_ids)


def first_tokens(
    logits: Tensor, req: GenerateRequest, prompt: Prompt, eos_token_ids: tuple[int, ...]
) -> list[tuple[TokenLogprobs, str]]:
    """Each copy's token and its finish reason, from [V] fp32 ``logits`` (none when
    ``max_tokens`` is 0: echo only)."""
    if req.max_tokens == 0:
        return []
    ends = end_ids(req, eos_token_ids)
    copies = [req.params.for_copy(i) for i in range(req.best_of)]
    choosing = [
        Choosing(p, make_generator(p, logits.device), ends, req.min_tokens, prompt.token_ids)
        for p in copies
    ]
    rows = logits.float()[None].expand(req.best_of, -1)
    chosen = choose_rows(rows, choosing, [()] * req.best_of)
    entries = top_logprobs(rows, chosen, req.logprobs or 0)
    return [(e, "stop" if e.token_id in ends else "length") for e in entries]


def prompt_entries(
    prompt: list[int], token_logprobs: Tensor, top_ids: Tensor, top_values: Tensor
) -> list[tuple[int, TokenLogprobs | None]]:
    """The prompt's (token id, log-probabilities) pairs for an echo: none for the
    first token; ``token_logprobs`` [n - 1], ``top_ids`` and ``top_values`` [n - 1, k]
    for the others."""
    out: list[tuple[int, TokenLogprobs | None]] = [(prompt[0], None)]
    values = torch.clamp(token_logprobs, min=-9999.0).tolist()
    ids, tops = top_ids.tolist(), torch.clamp(top_values, min=-9999.0).tolist()
    for i, token in enumerate(prompt[1:]):
        top = tuple((int(t), float(v)) for t, v in zip(ids[i], tops[i], strict=True))
        out.append((token, TokenLogprobs(token, float(values[i]), top)))
    return out
