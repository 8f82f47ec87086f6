"""Continuous-batching decode over a ``CausalLM`` (any family): the reference decode
server's engine (``DecodeEngine``).

A sequence joins with the KV of its prompt but the last token, pulled from the
prefill pool (``prompt_kv.py``: pieces as they came), and that last token. Every ``step`` runs
ONE forward over all active sequences, one token each at its own position::

    step 1 of a sequence    feeds the prompt's last token at position n (the "first
                            decode step": like vLLM's disaggregated decode, this side
                            computes the last prompt token; it never recomputes the
                            rest of the prompt)
    step k > 1              feeds the token step k - 1 chose, at position n + k - 1

Projections and the MLP (or the experts) run batched over the T = number of active
sequences; attention runs per sequence, over that sequence's cache plus its new
token, whose K and V the attention function writes into the cache first.

Cache of a sequence (per layer, K and V alike)::

    [L, Hkv, capacity, D]   positions [0, length) filled: the n prompt tokens, then
                            every token fed since; capacity grows geometrically (x2,
                            at most n + max_tokens, all the sequence can ever hold)

Each sequence chooses its token from the step's [T, V] fp32 logits by its own
``Choosing`` (``sampling.choose_rows``: min_tokens, logit bias, penalties over its
prompt and output, then greedy or its own generator; plain greedy rows share one
argmax). Every ``StepOutput`` carries the chosen token's raw log-probability (one
log_softmax over the step's logits, before any adjustment) and, for a sequence that
asked for ``logprobs`` k > 0, the k most likely ids (one top-k over those rows).

A sequence leaves when it chose one of its end ids, the end-of-sequence ids (unless
``ignore_eos``) and ``stop_token_ids`` (``finish_reason`` "stop"; never before
``min_tokens``, which bans them until then), reached ``max_tokens`` or the model's
last position ("length"), or was removed. The ``n`` copies of one request are
sequences of their own, each added from the same prompt KV. Sequences join and
leave between steps. The engine is not thread-safe: ``DecodeLoop`` (``loop.py``)
owns it and applies joins and cancellations from other threads between steps. Not
here: HTTP, the pull of the KV (``kv_client``), text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vertumnus.decode.prompt_kv import PromptKV
from vertumnus.decode.sampling import Choosing, choose_rows, make_generator
from vertumnus.engine.attention import banded_attention
from vertumnus.engine.model import CausalLM
from vertumnus.protocol.sampling_params import LOGPROB_FLOOR, SamplingParams, TokenLogprobs

# Positions a new cache holds beyond the prompt before its first growth.
INITIAL_HEADROOM = 64


@dataclass(frozen=True)
class StepOutput:
    """The token one step chose for one sequence; ``finish_reason`` "stop" (an end
    id), "length", or None while the sequence goes on; ``logprobs``: the token's raw
    log-probability and, when the sequence asked for ``logprobs`` k, the k most likely
    ids (``top`` empty otherwise)."""

    seq_id: int
    token_id: int
    finish_reason: str | None
    logprobs: TokenLogprobs


@dataclass
class _Sequence:
    seq_id: int
    k: Tensor  # [L, Hkv, capacity, D]
    v: Tensor
    length: int  # positions [0, length) of the cache are filled
    next_token: int  # fed by the next step, at position ``length``
    limit: int  # the most positions the cache will ever hold: n + max_tokens
    choosing: Choosing  # end_ids: eos (unless ignore_eos) and stop_token_ids
    max_tokens: int
    logprobs: int | None  # top alternatives reported per token
    output: list[int] = field(default_factory=list)


class DecodeEngine:
    """The active sequences and their caches; ``step`` decodes one token of each."""

    def __init__(self, model: CausalLM, initial_headroom: int = INITIAL_HEADROOM) -> None:
        if initial_headroom < 1:
            raise ValueError(f"initial_headroom must be >= 1, got {initial_headroom}")
        self.model = model
        self.config = model.config
        self.initial_headroom = initial_headroom
        self._seqs: dict[int, _Sequence] = {}  # in joining order: the batch's row order

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    @torch.inference_mode()
    def add(
        self,
        seq_id: int,
        prompt_kv: PromptKV | Sequence[tuple[Tensor, Tensor]] | Any,
        last_token: int,
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        *,
        stop_token_ids: Iterable[int] = (),
        min_tokens: int = 0,
        prompt_ids: Sequence[int] = (),
        logprobs: int | None = None,
    ) -> None:
        """Join the batch at the next step. ``prompt_kv``: the KV of the prompt but
        its last token, as pulled (``PromptKV``) or per layer (K, V) each [n, Hkv, D]
        (any dtype and device: copied into this engine's cache, so the same one may
        be added again, as each of a request's ``n`` copies, with its own
        ``params.for_copy(i)``); ``last_token``: the prompt's last id, fed by the
        first step at position n; ``prompt_ids``: the whole prompt, n + 1 ids (for
        ``repetition_penalty``; empty: the output alone counts); ``logprobs``: the
        top alternatives each ``StepOutput`` reports (None or 0: the chosen token's
        log-probability alone)."""
        cfg = self.config
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already decoding")
        n = self._prompt_tokens(prompt_kv)
        if not 0 <= last_token < cfg.vocab_size:
            raise ValueError(f"token id {last_token} outside the vocabulary [0, {cfg.vocab_size})")
        # End ids outside the vocabulary can never be chosen: nothing to ban or watch.
        ends = {*stop_token_ids, *(() if ignore_eos else eos_token_ids)}
        ends = {t for t in ends if 0 <= t < cfg.vocab_size}
        if prompt_ids and (len(prompt_ids) != n + 1 or prompt_ids[-1] != last_token):
            raise ValueError(
                f"prompt ids of {len(prompt_ids)} tokens for a prompt KV of {n} and its "
                f"last token {last_token}"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if min_tokens < 0 or (logprobs is not None and logprobs < 0):
            raise ValueError(f"min_tokens {min_tokens} and logprobs {logprobs} must be >= 0")
        if n >= cfg.max_position_embeddings:
            raise ValueError(
                f"a prompt of {n + 1} tokens leaves no position to decode at "
                f"(max_position_embeddings {cfg.max_position_embeddings})"
            )
        limit = n + max_tokens
        k_cache, v_cache = self._new_cache(seq_id, prompt_kv, n, limit)
        generator = make_generator(params, self.model.device)
        choosing = Choosing(params, generator, frozenset(ends), min_tokens, tuple(prompt_ids))
        self._seqs[seq_id] = _Sequence(
            seq_id, k_cache, v_cache, n, last_token, limit, choosing, max_tokens, logprobs
        )

    def _prompt_tokens(self, prompt_kv: Any) -> int:
        """The prompt's tokens but its last, once its KV is checked against the model."""
        cfg = self.config
        if not isinstance(prompt_kv, PromptKV):
            prompt_kv = self._from_layers(prompt_kv)
        got = (prompt_kv.num_layers, prompt_kv.num_kv_heads, prompt_kv.head_dim)
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        if got != want:
            raise ValueError(
                f"prompt KV of {got[0]} layers, {got[1]} KV heads, head_dim {got[2]}; the "
                f"model has {want[0]}, {want[1]}, {want[2]}"
            )
        return int(prompt_kv.num_tokens)

    def _new_cache(self, seq_id: int, prompt_kv: Any, n: int, limit: int) -> tuple[Tensor, Tensor]:
        """A new sequence's K and V caches, holding its prompt's KV."""
        cfg = self.config
        if not isinstance(prompt_kv, PromptKV):
            prompt_kv = self._from_layers(prompt_kv)
        capacity = min(limit, n + self.initial_headroom)
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, capacity, cfg.head_dim)
        device, dtype = self.model.device, self.model.dtype
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        v_cache = torch.empty(shape, dtype=dtype, device=device)
        prompt_kv.copy_into(k_cache, v_cache)
        return k_cache, v_cache

    def _from_layers(self, layers: Sequence[tuple[Tensor, Tensor]]) -> PromptKV:
        cfg = self.config
        if len(layers) != cfg.num_hidden_layers:
            raise ValueError(
                f"prompt KV of {len(layers)} layers for a model of {cfg.num_hidden_layers}"
            )
        want = (layers[0][0].shape[0], cfg.num_key_value_heads, cfg.head_dim)
        for layer, (k, v) in enumerate(layers):
            if tuple(k.shape) != want or tuple(v.shape) != want:
                raise ValueError(
                    f"prompt KV of layer {layer}: K {tuple(k.shape)}, V {tuple(v.shape)}; "
                    f"expected {want} ([tokens, kv heads, head dim])"
                )
        return PromptKV.from_layers(layers)

    def remove(self, seq_id: int) -> bool:
        """Leave the batch (a client gone); False when it was not decoding."""
        if self._seqs.pop(seq_id, None) is None:
            return False
        self._left(seq_id)
        return True

    def _left(self, seq_id: int) -> None:
        """A sequence finished (a subclass drops what it keeps of it)."""

    @staticmethod
    def _reserve(seq: _Sequence) -> None:
        """Room for one more position, doubling the capacity when full."""
        capacity = seq.k.shape[2]
        if seq.length < capacity:
            return
        grown = min(seq.limit, max(2 * capacity, seq.length + 1))
        for name in ("k", "v"):
            old: Tensor = getattr(seq, name)
            new = old.new_empty((old.shape[0], old.shape[1], grown, old.shape[3]))
            new[:, :, : seq.length].copy_(old[:, :, : seq.length])
            setattr(seq, name, new)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One batched forward over every active sequence; the token each chose, in
        joining order. Finished sequences have left when this returns."""
        seqs = list(self._seqs.values())
        if not seqs:
            return []
        logits = self._logits(seqs)  # [T, V] fp32
        tokens = choose_rows(logits, [s.choosing for s in seqs], [s.output for s in seqs])
        logprobs = _logprobs(logits, tokens, [s.logprobs or 0 for s in seqs])
        max_positions = self.config.max_position_embeddings
        outputs = []
        for seq, token, lp in zip(seqs, tokens, logprobs, strict=True):
            ended = token in seq.choosing.end_ids and len(seq.output) >= seq.choosing.min_tokens
            seq.length += 1
            seq.output.append(token)
            seq.next_token = token
            reason = None
            if ended:
                reason = "stop"
            elif len(seq.output) >= seq.max_tokens or seq.length >= max_positions:
                reason = "length"
            if reason is not None:
                del self._seqs[seq.seq_id]
                self._left(seq.seq_id)
            outputs.append(StepOutput(seq.seq_id, token, reason, lp))
        return outputs

    def _logits(self, seqs: list[_Sequence]) -> Tensor:
        """One forward of each sequence's next token at its position: [T, V] fp32."""
        for seq in seqs:
            self._reserve(seq)
        device = self.model.device
        ids = torch.tensor([s.next_token for s in seqs], dtype=torch.long, device=device)
        positions = torch.tensor([s.length for s in seqs], dtype=torch.long, device=device)

        def attend(
            layer: int,
            q: Tensor,
            k: Tensor,
            v: Tensor,
            window: int | None = None,
            sinks: Tensor | None = None,
        ) -> Tensor:
            # q [T, Hq, D], k and v [T, Hkv, D]: row i is sequence i's new token.
            out = torch.empty_like(q)
            for i, seq in enumerate(seqs):
                pos = seq.length
                seq.k[layer, :, pos] = k[i]
                seq.v[layer, :, pos] = v[i]
                # One query, the last position: it sees every cached key in its window.
                first = 0 if window is None else max(0, pos - window + 1)
                keys = seq.k[layer, :, first : pos + 1][None]  # [1, Hkv, keys, D]
                values = seq.v[layer, :, first : pos + 1][None]
                query = q[i][None, :, None]  # [1, Hq, 1, D]
                if sinks is None:
                    one = F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)
                else:
                    one = banded_attention(query, keys, values, pos, first, window, sinks)
                out[i] = one[0, :, 0]
            return out

        hidden = self.model(ids, positions, attend)  # [T, H]
        logits: Tensor = self.model.logits(hidden)
        return logits


def _logprobs(logits: Tensor, chosen: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """Row i's ``chosen[i]`` and its ``tops[i]`` most likely ids with their raw
    log-probabilities: one log_softmax over [T, V] fp32 logits, one top-k over the
    rows that want alternatives."""
    logprobs = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(chosen, dtype=torch.long, device=logits.device)[:, None]
    picked = logprobs.gather(-1, index)[:, 0].tolist()
    rows = [i for i, k in enumerate(tops) if k > 0]
    alternatives: dict[int, tuple[tuple[int, float], ...]] = {}
    if rows:
        k = min(max(tops[i] for i in rows), logits.shape[-1])
        values, ids = torch.topk(logprobs[rows], k, dim=-1)
        for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            pairs = zip(row_ids[: tops[i]], row_values[: tops[i]], strict=True)
            alternatives[i] = tuple((int(t), max(v, LOGPROB_FLOOR)) for t, v in pairs)
    return [
        TokenLogprobs(token, max(lp, LOGPROB_FLOOR), alternatives.get(i, ()))
        for i, (token, lp) in enumerate(zip(chosen, picked, strict=True))
    ]
