"""Choosing the next token from fp32 logits: the sampling model of one request.

Pure functions over logits and a per-sequence ``torch.Generator``: no model, no
state of their own. A sequence's generator is seeded once from its request's
``seed`` (a random one when the request gives none; ``n`` copies of one request
get ``seed``, ``seed + 1``, ...), so the same seed on the same device draws the
same tokens whether the sequence decodes alone or in a batch.

The sampling model, per row of raw logits ``z`` [V], in vLLM's order:

    1. min_tokens        while fewer than ``min_tokens`` were generated, the ids that
                         would end the sequence (end-of-sequence, ``stop_token_ids``)
                         get -inf
    2. logit_bias        z[id] += bias
    3. penalties         over the ids seen (``repetition_penalty``: prompt and output,
                         z / p where z > 0, z * p elsewhere; ``frequency_penalty``:
                         z -= f * count in the output; ``presence_penalty``: z -= p
                         for every id in the output)
    4. greedy            temperature < GREEDY_BELOW: argmax (ties: the lowest id)
    5. otherwise         p = softmax(z / temperature); keep the ``top_k`` most likely
                         ids, then those with p >= ``min_p`` * max p, then the smallest
                         set of most likely ids whose mass reaches ``top_p`` (at least
                         the most likely one); renormalise; draw one id

Log-probabilities reported to the client (``logprobs``) are those of the raw
logits, before any of the above (vLLM's default ``raw_logprobs``).

Not owned here: the parameters and the reported log-probabilities as values
(``SamplingParams``, ``TokenLogprobs``: ``protocol/sampling_params.py``, which the
requests validate without torch).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vertumnus.protocol.sampling_params import LOGPROB_FLOOR, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class Choosing:
    """What one sequence's next-token choice depends on besides its parameters:
    the ids that end it while ``min_tokens`` are not reached, the prompt's ids and
    the output so far (for the penalties)."""

    params: SamplingParams
    generator: torch.Generator | None
    end_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    prompt_ids: Sequence[int] = ()


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The sequence's own generator on ``device`` (None for greedy: it draws nothing)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device=device).manual_seed(seed)


def adjust(logits: Tensor, choosing: Choosing, output_ids: Sequence[int]) -> Tensor:
    """Steps 1-3 of the model on one row of [V] fp32 logits (a new tensor when any
    applies; ``logits`` itself otherwise)."""
    p = choosing.params
    bans = len(output_ids) < choosing.min_tokens and choosing.end_ids
    if not (bans or p.logit_bias or p.penalized):
        return logits
    z = logits.float().clone()
    if bans:
        ids = torch.tensor(sorted(choosing.end_ids), dtype=torch.long, device=z.device)
        z[ids] = float("-inf")
    for token, bias in p.logit_bias:
        z[token] += bias
    if p.penalized:
        vocab = z.shape[-1]
        out = torch.tensor(list(output_ids), dtype=torch.long, device=z.device)
        counts = torch.bincount(out, minlength=vocab).to(z.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if choosing.prompt_ids:
                prompt = torch.tensor(list(choosing.prompt_ids), dtype=torch.long, device=z.device)
                seen[prompt] = True
            penalized = torch.where(z > 0, z / p.repetition_penalty, z * p.repetition_penalty)
            z = torch.where(seen, penalized, z)
        z -= p.frequency_penalty * counts
        z -= p.presence_penalty * (counts > 0).to(z.dtype)
    return z


def nucleus_probs(
    logits: Tensor, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0
) -> Tensor:
    """[V] fp32 logits -> [V] probabilities after temperature, top-k, min-p and top-p
    truncation."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep an id while the mass of the ids before it is below top_p (of what is
        # left): the first id is always kept, and the kept set is the smallest whose
        # mass reaches top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p * sorted_probs.sum(), 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum()


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from [V] fp32 logits (already adjusted)."""
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs the sequence's generator")
    probs = nucleus_probs(logits, params.temperature, params.top_p, params.top_k, params.min_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def choose_rows(
    logits: Tensor, choosing: Sequence[Choosing], outputs: Sequence[Sequence[int]]
) -> list[int]:
    """One token id per row of [N, V] fp32 logits, row i by ``choosing[i]`` with the
    output so far ``outputs[i]``. Plain greedy rows share one argmax over the batch
    (one device sync)."""
    if not len(choosing) == len(outputs) == logits.shape[0]:
        raise ValueError(
            f"{logits.shape[0]} rows of logits, {len(choosing)} choosers, {len(outputs)} outputs"
        )
    chosen = torch.argmax(logits, dim=-1).tolist()
    for i, (c, out) in enumerate(zip(choosing, outputs, strict=True)):
        row = adjust(logits[i], c, out)
        if row is not logits[i] or not c.params.greedy:
            chosen[i] = sample(row, c.params, c.generator)
    return [int(t) for t in chosen]


def sample_rows(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per row of [N, V] fp32 logits, row i by ``params[i]`` with
    ``generators[i]`` (no ``min_tokens``, no penalties)."""
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"{logits.shape[0]} rows of logits, {len(params)} params, {len(generators)} generators"
        )
    choosing = [Choosing(p, g) for p, g in zip(params, generators, strict=True)]
    return choose_rows(logits, choosing, [()] * len(choosing))


def top_logprobs(logits: Tensor, chosen: Sequence[int], k: int) -> list[TokenLogprobs]:
    """The raw log-probabilities of row i's ``chosen[i]`` and its ``k`` most likely
    ids, for every row of [N, V] fp32 logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, torch.tensor(chosen, dtype=torch.long)[:, None].to(logits.device))
    top_values, top_ids = (
        torch.topk(logprobs, k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    )
    picked_l, values_l, ids_l = picked[:, 0].tolist(), top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(
            token_id=int(t),
            logprob=_finite(lp),
            top=tuple((int(i), _finite(v)) for i, v in zip(ids, vals, strict=True)),
        )
        for t, lp, ids, vals in zip(chosen, picked_l, ids_l, values_l, strict=True)
    ]


def _finite(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR
