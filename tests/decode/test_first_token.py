"""The one token the pool answers by itself (``decode/first_token.py``): greedy picks
the argmax; an end-of-sequence id or one of ``stop_token_ids`` finishes the choice
with "stop" (unless ``ignore_eos``), any other with "length"; ``min_tokens`` 1 bans
them; ``best_of`` copies each get a token (seeded copies draw apart); the chosen
token's raw log-probability and the top k come with it; and the prompt's entries for
an echo."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vertumnus.decode.first_token import end_ids, first_tokens, prompt_entries
from vertumnus.protocol.request import GenerateRequest, Served, parse
from vertumnus.protocol.tokenizer import Tokenizer

VOCAB = 64
SERVED = Served("tiny", Tokenizer.for_model(None, 1024), vocab_size=VOCAB, max_model_len=256)
EOS = (7,)


def request(**body: Any) -> GenerateRequest:
    return parse({"prompt": [1, 2, 3], "max_tokens": 1, **body}, SERVED, chat=False)


def logits(best: int, second: int | None = None) -> torch.Tensor:
    """[VOCAB] fp32 logits whose most likely id is ``best`` (then ``second``)."""
    z = torch.linspace(-3.0, 0.0, VOCAB)
    z[best] = 5.0
    if second is not None:
        z[second] = 4.0
    return z


def choose(z: torch.Tensor, req: GenerateRequest) -> list[tuple[int, str]]:
    return [(e.token_id, why) for e, why in first_tokens(z, req, req.prompts[0], EOS)]


def test_greedy_picks_the_argmax_and_finishes_with_length() -> None:
    assert choose(logits(42), request(temperature=0)) == [(42, "length")]


def test_an_end_id_finishes_with_stop_unless_ignore_eos() -> None:
    assert choose(logits(7), request(temperature=0)) == [(7, "stop")]
    assert choose(logits(7), request(temperature=0, ignore_eos=True)) == [(7, "length")]
    stop = request(temperature=0, stop_token_ids=[42])
    assert choose(logits(42), stop) == [(42, "stop")]
    assert end_ids(stop, EOS) == {7, 42}
    assert end_ids(request(ignore_eos=True, stop_token_ids=[42]), EOS) == {42}


def test_min_tokens_of_one_bans_the_end_ids() -> None:
    z = logits(7, second=42)  # the end id first, a stop id second
    req = request(temperature=0, min_tokens=1, stop_token_ids=[42])
    # the most likely id left is the last (the linear ramp's top)
    assert choose(z, req) == [(VOCAB - 1, "length")]
    assert choose(z, request(temperature=0, stop_token_ids=[42])) == [(7, "stop")]


def test_best_of_copies_each_get_a_token() -> None:
    greedy = choose(logits(42), request(temperature=0, n=2, best_of=3))
    assert greedy == [(42, "length")] * 3
    flat = torch.zeros(VOCAB)  # every id equally likely: seeded copies draw apart
    req = request(temperature=1.0, seed=5, n=4)
    drawn = [t for t, _ in choose(flat, req)]
    assert len(drawn) == 4 and len(set(drawn)) > 1
    assert [t for t, _ in choose(flat, req)] == drawn  # the same seed, the same draws


def test_logprobs_are_the_raw_ones_with_the_top_k() -> None:
    z = logits(42, second=9)
    (entry, _), *_ = first_tokens(z, request(temperature=0, logprobs=3), request().prompts[0], EOS)
    ref = torch.log_softmax(z, dim=-1)
    assert entry.token_id == 42 and entry.logprob == pytest.approx(float(ref[42]), abs=1e-6)
    assert [i for i, _ in entry.top] == torch.topk(ref, 3).indices.tolist()
    assert [v for _, v in entry.top] == pytest.approx(torch.topk(ref, 3).values.tolist())
    (plain, _), *_ = first_tokens(z, request(temperature=0), request().prompts[0], EOS)
    assert plain.top == () and plain.logprob == entry.logprob


def test_an_echo_alone_chooses_nothing() -> None:
    req = parse({"prompt": [1, 2], "max_tokens": 0, "echo": True}, SERVED, chat=False)
    assert first_tokens(logits(3), req, req.prompts[0], EOS) == []


def test_prompt_entries_pair_each_token_with_its_logprobs() -> None:
    values = torch.tensor([-0.5, float("-inf")])
    top_ids = torch.tensor([[4, 2], [1, 0]])
    top_values = torch.tensor([[-0.1, -0.5], [-0.2, float("-inf")]])
    entries = prompt_entries([9, 2, 5], values, top_ids, top_values)
    assert entries[0] == (9, None)
    (t1, e1), (t2, e2) = entries[1:]
    assert e1 is not None and e2 is not None
    assert (t1, e1.token_id, e1.logprob) == (2, 2, -0.5)
    assert [i for i, _ in e1.top] == [4, 2]
    assert [v for _, v in e1.top] == pytest.approx([-0.1, -0.5])
    assert (t2, e2.token_id, e2.logprob) == (5, 5, -9999.0)  # clamped: JSON has no infinity
    assert e2.top[1] == (0, -9999.0)
