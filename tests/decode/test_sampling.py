"""Token choice from logits (``decode/sampling.py``): greedy is the argmax, top-p
keeps the smallest set of most likely ids that reaches the mass, seeded draws are
reproducible and follow the distribution, and bad parameters are refused
(``protocol/sampling_params.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from vertumnus.decode.sampling import make_generator, nucleus_probs, sample, sample_rows
from vertumnus.protocol.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Probabilities 0.5, 0.3, 0.15, 0.05 as logits.
LOGITS = torch.tensor([math.log(p) for p in (0.5, 0.3, 0.15, 0.05)])


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    gen = make_generator(params, CPU)
    return [sample(logits, params, gen) for _ in range(n)]


@pytest.mark.timeout(30)
def test_greedy_is_the_argmax_and_draws_nothing() -> None:
    logits = torch.tensor([0.1, 3.0, -2.0, 3.0])
    for temperature in (0.0, 1e-6):
        params = SamplingParams(temperature=temperature, top_p=0.5, seed=3)
        assert params.greedy and make_generator(params, CPU) is None
        assert sample(logits, params, None) == 1  # ties: the lowest id
    with pytest.raises(ValueError, match="generator"):
        sample(logits, SamplingParams(temperature=1.0), None)


@pytest.mark.timeout(30)
def test_top_p_keeps_the_smallest_set_that_reaches_the_mass() -> None:
    expected = {
        0.4: [1.0, 0.0, 0.0, 0.0],  # the most likely id alone has 0.5 >= 0.4
        0.7: [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0],
        0.9: [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0],
        1.0: [0.5, 0.3, 0.15, 0.05],
    }
    for top_p, probs in expected.items():
        got = nucleus_probs(LOGITS, temperature=1.0, top_p=top_p)
        torch.testing.assert_close(got, torch.tensor(probs), atol=1e-6, rtol=0)
    # Temperature sharpens: at 0.5 the probabilities go as p^2.
    squares = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    torch.testing.assert_close(
        nucleus_probs(LOGITS, 0.5, 1.0), squares / squares.sum(), atol=1e-6, rtol=0
    )
    # A tiny top_p always draws the most likely id.
    assert set(draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.01, seed=0), 50)) == {0}


@pytest.mark.timeout(30)
def test_seeded_draws_are_reproducible_and_follow_the_distribution() -> None:
    flat = torch.zeros(1024)
    same = SamplingParams(temperature=1.0, seed=11)
    assert draws(flat, same, 20) == draws(flat, same, 20)
    assert draws(flat, same, 20) != draws(flat, SamplingParams(temperature=1.0, seed=12), 20)
    # No seed: a random one per sequence.
    unseeded = SamplingParams(temperature=1.0)
    assert draws(flat, unseeded, 20) != draws(flat, unseeded, 20)
    counts = torch.bincount(torch.tensor(draws(LOGITS, same, 4000)), minlength=4) / 4000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    # top_p 0.7: ids 2 and 3 are never drawn.
    assert set(draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.7, seed=1), 500)) == {0, 1}


@pytest.mark.timeout(30)
def test_rows_are_chosen_each_by_its_own_params() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), torch.zeros(4)])
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=5),
    ]
    gens = [make_generator(p, CPU) for p in params]
    first = sample_rows(logits, params, gens)
    assert first[:2] == [0, 3]
    again = sample_rows(logits, params, [make_generator(p, CPU) for p in params])
    assert again == first  # the seeded row too
    with pytest.raises(ValueError, match="3 rows of logits, 2 params"):
        sample_rows(logits, params[:2], gens[:2])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_min_tokens_bans_the_end_until_reached() -> None:
    from vertumnus.decode.sampling import Choosing, adjust

    logits = torch.tensor([0.0, 5.0, 1.0])
    choosing = Choosing(SamplingParams(temperature=0.0), None, frozenset({1}), min_tokens=2)
    assert torch.isinf(adjust(logits, choosing, [2])[1])
    assert adjust(logits, choosing, [2, 2]) is logits  # reached: nothing changes


def test_logit_bias_and_penalties_follow_vllm() -> None:
    from vertumnus.decode.sampling import Choosing, adjust

    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias=((3, 10.0),),
    )
    out = adjust(logits, Choosing(params, None, prompt_ids=[0]), [1, 1])
    # id 0 (in the prompt): 2 / 2; id 1 (output twice): -2 * 2 - 0.5 * 2 - 0.25;
    # id 2 unseen; id 3 biased.
    assert out.tolist() == [1.0, -5.25, 1.0, 10.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # the raw row is kept for logprobs


def test_top_k_and_min_p_truncate() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = nucleus_probs(logits, 1.0, 1.0, top_k=2)
    assert kept.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    kept = nucleus_probs(logits, 1.0, 1.0, min_p=0.2)  # p >= 0.1
    assert kept.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_top_logprobs_are_raw_and_sorted() -> None:
    from vertumnus.decode.sampling import top_logprobs
    from vertumnus.protocol.sampling_params import LOGPROB_FLOOR

    logits = torch.tensor([[0.0, 1.0, float("-inf")], [3.0, 0.0, 0.0]])
    first, second = top_logprobs(logits, [2, 0], k=2)
    lse = torch.logsumexp(logits[0], dim=-1).item()
    assert first.token_id == 2 and first.logprob == LOGPROB_FLOOR
    assert [i for i, _ in first.top] == [1, 0]
    assert first.top[0][1] == pytest.approx(1.0 - lse)
    assert second.logprob == pytest.approx(torch.log_softmax(logits[1], -1)[0].item())
    assert top_logprobs(logits, [0, 0], k=0)[0].top == ()


def test_copies_get_their_own_seeds() -> None:
    params = SamplingParams(seed=5)
    assert params.for_copy(0).seed == 5 and params.for_copy(2).seed == 7
    assert SamplingParams().for_copy(3).seed is None
