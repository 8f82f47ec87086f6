"""``kv_transfer_params`` as the decode server reads them: one object (one prompt)
or a list of objects, one per prompt in order (as the pool's proxy sends them).

Each object is what the pool answered for that prompt's KV (``TransferParams``),
plus, when the request asks for the prompt's log-probabilities (completions, ``echo``
with ``logprobs`` k), ``"prompt_logprobs"`` as the pool computed them::

    {"token_logprobs": [n - 1 floats],      log p(prompt[i + 1] | prompt[: i + 1])
     "top_ids": [[k ints] x (n - 1)],       the k most likely ids there
     "top_values": [[k floats] x (n - 1)]}  their log-probabilities

stripped before ``TransferParams.parse`` and turned into the answer's
``PromptLogprobs``. Every fault is a ``BadRequest`` naming ``kv_transfer_params``.
Not here: the pulls, and giving up the leases of a request that fails
(``handoff.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vertumnus.decode.first_token import prompt_entries
from vertumnus.decode.kv_client import TransferParams
from vertumnus.protocol.answers import PromptLogprobs
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.request import GenerateRequest, Prompt

FIELD = "kv_transfer_params"


@dataclass(frozen=True)
class PromptTransfer:
    """Where one prompt's KV waits, and its log-probabilities when asked for."""

    params: TransferParams
    prompt_logprobs: PromptLogprobs | None


def transfer_list(raw: Any) -> list[Any]:
    """The request's ``kv_transfer_params`` as a list, one entry per prompt."""
    if isinstance(raw, dict):
        return [raw]
    if isinstance(raw, list) and raw:
        return raw
    raise BadRequest(f"'{FIELD}' must be an object, or a list of one object per prompt", FIELD)


def read_entry(item: Any) -> tuple[TransferParams, Any]:
    """One prompt's entry: where its KV waits, and its ``prompt_logprobs`` as sent
    (None: absent)."""
    if not isinstance(item, dict):
        raise BadRequest(f"'{FIELD}' must hold objects", FIELD)
    rest = {k: v for k, v in item.items() if k != "prompt_logprobs"}
    try:
        return TransferParams.parse(rest), item.get("prompt_logprobs")
    except ValueError as exc:
        raise BadRequest(str(exc), FIELD) from None


def check_entry(
    params: TransferParams, logprobs: Any, prompt: Prompt, req: GenerateRequest, vocab_size: int
) -> PromptTransfer:
    """One prompt's entry checked against the prompt (``num_tokens`` is its length
    - 1) and the request (``prompt_logprobs`` present when it asks for them)."""
    n = len(prompt.token_ids) - 1
    if params.num_tokens != n:
        raise BadRequest(
            f"'{FIELD}.num_tokens' is {params.num_tokens}; a prompt of "
            f"{len(prompt.token_ids)} tokens needs the KV of {n}",
            FIELD,
        )
    k = req.prompt_logprobs
    if k is None:
        return PromptTransfer(params, None)
    if logprobs is None:
        raise BadRequest(
            f"echo with logprobs needs '{FIELD}.prompt_logprobs' (the pool's proxy sends them)",
            FIELD,
        )
    return PromptTransfer(params, read_prompt_logprobs(logprobs, prompt, k, vocab_size))


def read_prompt_logprobs(raw: Any, prompt: Prompt, k: int, vocab_size: int) -> PromptLogprobs:
    """The pool's ``prompt_logprobs`` of ``prompt`` (top ``k`` at each position)."""
    n = len(prompt.token_ids) - 1
    what = (
        f"'{FIELD}.prompt_logprobs' must hold token_logprobs [{n}], top_ids and "
        f"top_values [{n}, {k}]"
    )
    if not isinstance(raw, dict):
        raise BadRequest(what, FIELD)
    try:
        values, ids, tops = raw["token_logprobs"], raw["top_ids"], raw["top_values"]
        if not (len(values) == len(ids) == len(tops) == n):
            raise ValueError("lengths")
        token_logprobs = torch.tensor(values, dtype=torch.float32).reshape(n)
        top_ids = torch.tensor(ids, dtype=torch.long).reshape(n, k)
        top_values = torch.tensor(tops, dtype=torch.float32).reshape(n, k)
    except (KeyError, TypeError, ValueError, RuntimeError):
        raise BadRequest(what, FIELD) from None
    if n and not bool(((top_ids >= 0) & (top_ids < vocab_size)).all()):
        raise BadRequest(f"'{FIELD}.prompt_logprobs.top_ids' outside the vocabulary", FIELD)
    return prompt_entries(prompt.token_ids, token_logprobs, top_ids, top_values)
