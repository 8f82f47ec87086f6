"""The decode engine (``decode/engine.py``) against transformers: greedy ids
equal ``generate(do_sample=False)`` on the same checkpoint, dense and Qwen3-MoE,
from the prompt KV our own model computed (as the prefill pool hands it over);
a batch of prompts of different lengths, with one joining mid-way, gives each the
ids it gets alone, in one forward per step; the reported log-probabilities are
transformers' raw ones; seeded sampling is reproducible; end-of-sequence ids,
``stop_token_ids`` (never before ``min_tokens``) and the model's last position stop
a sequence; penalties choose as ``sampling.adjust`` says; the decode thread
(``decode/loop.py``) delivers, cancels and fails sequences as it promises, and forks
a request's ``n`` copies from one prompt KV."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
import transformers

from support.factories import TINY, make_tokens
from support.reference import Checkpoint, make_hf_moe
from vertumnus.config import ModelConfig
from vertumnus.decode.engine import DecodeEngine, StepOutput
from vertumnus.decode.loop import DecodeFailure, DecodeLoop, NewSequence
from vertumnus.decode.sampling import Choosing, adjust
from vertumnus.engine.model import CausalLM, causal_attention
from vertumnus.engine.weights import load_model, random_model
from vertumnus.protocol.sampling_params import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
KV = list[tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def prompt_kv(model: CausalLM, prompt: list[int]) -> KV:
    """K and V of every token of ``prompt`` but the last, per layer [n, Hkv, D]: what
    the prefill pool hands over, computed by our single-process model."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    reference = causal_attention()

    def capture(
        layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        captured[layer] = (k.clone(), v.clone())
        return reference(layer, q, k, v, *rest)  # type: ignore[arg-type]

    n = len(prompt) - 1
    if n == 0:
        cfg = model.config
        empty = torch.empty(0, cfg.num_key_value_heads, cfg.head_dim)
        return [(empty, empty) for _ in range(cfg.num_hidden_layers)]
    model(torch.tensor(prompt[:-1]), torch.arange(n), capture)
    return [captured[i] for i in range(model.config.num_hidden_layers)]


def decode(
    model: CausalLM, prompt: list[int], max_tokens: int, **kwargs: object
) -> list[StepOutput]:
    """One sequence alone, to its end."""
    engine = DecodeEngine(model)
    engine.add(0, prompt_kv(model, prompt), prompt[-1], max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]
    outputs: list[StepOutput] = []
    while len(engine):
        outputs += engine.step()
    return outputs


@torch.inference_mode()
def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit mask: with a pad id, generate would mask that id out of the prompt.
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    assert out.shape[1] == len(prompt) + n, "transformers stopped early"
    return [int(t) for t in out[0, len(prompt) :]]


@torch.inference_mode()
def hf_logprobs(
    hf: transformers.PreTrainedModel, prompt: list[int], ids: list[int]
) -> torch.Tensor:
    """[len(ids), V] raw log-probabilities transformers gives at the positions that
    chose ``ids`` after ``prompt``."""
    full = torch.tensor([prompt + ids[:-1]])
    logits = hf(full, attention_mask=torch.ones_like(full)).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def load_ours(checkpoint: Checkpoint) -> CausalLM:
    model = load_model(checkpoint.config, Path(checkpoint.model_dir), torch.float32, CPU)
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    hf = make_hf_moe(top_k=2, vocab_size=256)
    folder = tmp_path_factory.mktemp("qwen3-moe")
    hf.save_pretrained(folder)
    return Checkpoint(hf, folder, ModelConfig.from_dir(folder))  # type: ignore[arg-type]


@pytest.fixture(params=["dense", "moe"])
def pair(
    request: pytest.FixtureRequest, checkpoint: Checkpoint, moe_checkpoint: Checkpoint
) -> tuple[transformers.PreTrainedModel, CausalLM]:
    """(transformers' model, ours) on the same checkpoint."""
    chosen = checkpoint if request.param == "dense" else moe_checkpoint
    return chosen.hf, load_ours(chosen)


@pytest.mark.timeout(120)
def test_greedy_ids_equal_transformers_alone(
    pair: tuple[transformers.PreTrainedModel, CausalLM],
) -> None:
    hf, ours = pair
    prompt = make_tokens(13, seed=1, vocab=ours.config.vocab_size)
    outputs = decode(ours, prompt, 8, params=GREEDY)
    assert [o.token_id for o in outputs] == hf_greedy(hf, prompt, 8)
    assert [o.finish_reason for o in outputs] == [None] * 7 + ["length"]


@pytest.mark.timeout(120)
def test_a_batch_with_a_late_joiner_equals_transformers_in_one_forward_per_step(
    pair: tuple[transformers.PreTrainedModel, CausalLM],
) -> None:
    hf, ours = pair
    vocab = ours.config.vocab_size
    # Lengths 1 (no prompt KV at all), 6, 23 and 31, one max_tokens each.
    prompts = {i: make_tokens(n, seed=10 + i, vocab=vocab) for i, n in enumerate((1, 6, 23, 31))}
    max_tokens = {0: 7, 1: 4, 2: 9, 3: 5}
    kvs = {i: prompt_kv(ours, prompt) for i, prompt in prompts.items()}
    engine = DecodeEngine(ours, initial_headroom=2)  # caches grow more than once
    for i in (0, 1, 2):
        engine.add(i, kvs[i], prompts[i][-1], GREEDY, max_tokens[i])
    batch_sizes: list[int] = []
    hook = ours.register_forward_hook(lambda _m, args, _out: batch_sizes.append(args[0].shape[0]))
    got: dict[int, list[int]] = {i: [] for i in prompts}
    try:
        step = 0
        while step < 2 or len(engine):
            if step == 2:  # sequence 3 joins before the third step
                engine.add(3, kvs[3], prompts[3][-1], GREEDY, max_tokens[3])
            for out in engine.step():
                got[out.seq_id].append(out.token_id)
            step += 1
    finally:
        hook.remove()
    for i, prompt in prompts.items():
        assert got[i] == hf_greedy(hf, prompt, max_tokens[i]), f"sequence {i}"
        assert got[i] == [o.token_id for o in decode(ours, prompt, max_tokens[i], params=GREEDY)]
    # One forward per step over every active sequence: 3 and 3; 4 once sequence 3
    # joined, until 1 ends (its 4th token); 3 until 0 and 3 end together; 2 alone.
    assert batch_sizes == [3, 3, 4, 4, 3, 3, 3, 1, 1], batch_sizes


@pytest.mark.timeout(60)
def test_seeded_sampling_is_reproducible_alone_and_batched(tiny_model: CausalLM) -> None:
    prompt = make_tokens(9, seed=3)
    # The tiny preset's logits spread over tens: a high temperature mixes them.
    hot = SamplingParams(temperature=20.0, top_p=0.95, seed=42)
    ids = [o.token_id for o in decode(tiny_model, prompt, 12, params=hot)]
    assert ids == [o.token_id for o in decode(tiny_model, prompt, 12, params=hot)]
    other = dataclasses.replace(hot, seed=43)
    assert ids != [o.token_id for o in decode(tiny_model, prompt, 12, params=other)]
    # Beside another sequence, it draws the same ids.
    engine = DecodeEngine(tiny_model)
    engine.add(0, prompt_kv(tiny_model, prompt), prompt[-1], hot, 12)
    side = make_tokens(20, seed=4)
    engine.add(1, prompt_kv(tiny_model, side), side[-1], other, 12)
    batched: list[int] = []
    while len(engine):
        batched += [o.token_id for o in engine.step() if o.seq_id == 0]
    assert batched == ids


@pytest.mark.timeout(60)
def test_an_end_of_sequence_id_stops_unless_ignored(tiny_model: CausalLM) -> None:
    prompt = make_tokens(7, seed=5)
    free = [o.token_id for o in decode(tiny_model, prompt, 10, params=GREEDY)]
    eos = free[3]
    stopped = decode(tiny_model, prompt, 10, params=GREEDY, eos_token_ids=(eos, 5000))
    first = free.index(eos)
    assert [o.token_id for o in stopped] == free[: first + 1]
    assert stopped[-1].finish_reason == "stop"
    ignored = decode(tiny_model, prompt, 10, params=GREEDY, eos_token_ids=(eos,), ignore_eos=True)
    assert [o.token_id for o in ignored] == free and ignored[-1].finish_reason == "length"


@pytest.mark.timeout(60)
def test_the_last_position_ends_a_sequence() -> None:
    model = random_model(dataclasses.replace(TINY, max_position_embeddings=8), seed=0).eval()
    prompt = make_tokens(6, seed=6)  # positions 0..5; decoding feeds 5, 6 and 7
    outputs = decode(model, prompt, 100, params=GREEDY)
    assert len(outputs) == 3 and outputs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="no position to decode at"):
        decode(model, make_tokens(9, seed=6), 4, params=GREEDY)


@pytest.mark.timeout(60)
def test_joining_is_checked(tiny_model: CausalLM) -> None:
    engine = DecodeEngine(tiny_model)
    kv = prompt_kv(tiny_model, make_tokens(5, seed=7))
    with pytest.raises(ValueError, match="prompt KV of 3 layers for a model of 4"):
        engine.add(0, kv[:3], 1, GREEDY, 4)
    with pytest.raises(ValueError, match=r"layer 0: K \(4, 2, 32\), V \(4, 2, 16\)"):
        engine.add(0, [(k, v[..., :16]) for k, v in kv], 1, GREEDY, 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add(0, kv, TINY.vocab_size, GREEDY, 4)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        engine.add(0, kv, 1, GREEDY, 0)
    with pytest.raises(ValueError, match="prompt ids of 2 tokens for a prompt KV of 4"):
        engine.add(0, kv, 1, GREEDY, 4, prompt_ids=[0, 1])
    engine.add(0, kv, 1, GREEDY, 4)
    with pytest.raises(ValueError, match="already decoding"):
        engine.add(0, kv, 1, GREEDY, 4)
    assert engine.remove(0) and not engine.remove(0) and engine.step() == []


@pytest.mark.timeout(60)
def test_the_decode_thread_delivers_cancels_and_fails(tiny_model: CausalLM) -> None:
    prompt = make_tokens(8, seed=8)
    expected = [o.token_id for o in decode(tiny_model, prompt, 6, params=GREEDY)]
    events: dict[int, list[StepOutput | DecodeFailure]] = {}
    done = {i: threading.Event() for i in range(4)}
    ids: dict[int, int] = {}

    def deliver_to(i: int):  # type: ignore[no-untyped-def]
        def deliver(event: StepOutput | DecodeFailure, at: float) -> None:
            events.setdefault(i, []).append(event)
            if isinstance(event, DecodeFailure) or event.finish_reason is not None:
                done[i].set()
            if i == 1 and len(events[1]) == 1:
                loop.cancel(ids[1])  # leaves after its first token

        return deliver

    loop = DecodeLoop(DecodeEngine(tiny_model))
    loop.start()
    try:
        kv = prompt_kv(tiny_model, prompt)
        (ids[1],) = loop.submit(NewSequence(kv, prompt[-1], GREEDY, 10_000), deliver_to(1))
        (ids[0],) = loop.submit(NewSequence(kv, prompt[-1], GREEDY, 6), deliver_to(0))
        (ids[2],) = loop.submit(NewSequence(kv[:1], prompt[-1], GREEDY, 6), deliver_to(2))
        assert done[0].wait(30) and done[2].wait(30)
        (ids[3],) = loop.submit(NewSequence(kv, prompt[-1], GREEDY, 10_000), deliver_to(3))
    finally:
        loop.close()
    assert [e.token_id for e in events[0] if isinstance(e, StepOutput)] == expected
    assert len(events[1]) in (1, 2) and not done[1].is_set()  # cancelled: no end, no failure
    (failure,) = events[2]
    assert isinstance(failure, DecodeFailure) and "prompt KV of 1 layers" in failure.message
    assert isinstance(events[3][-1], DecodeFailure) and "shutting down" in events[3][-1].message
    assert loop.num_active == 0
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(NewSequence(kv, prompt[-1], GREEDY, 1), deliver_to(0))


@pytest.mark.timeout(120)
def test_logprobs_are_transformers_raw_ones_in_a_mixed_batch(
    pair: tuple[transformers.PreTrainedModel, CausalLM],
) -> None:
    hf, model = pair
    prompt = make_tokens(11, seed=20, vocab=model.config.vocab_size)
    kv = prompt_kv(model, prompt)
    hot = SamplingParams(temperature=1.5, seed=3, logit_bias=((7, 2.0),))
    engine = DecodeEngine(model)
    engine.add(0, kv, prompt[-1], GREEDY, 6, logprobs=5)
    engine.add(1, kv, prompt[-1], hot, 6)  # adjusted and sampled: raw logprobs still
    engine.add(2, kv, prompt[-1], GREEDY, 6, logprobs=2)
    got: dict[int, list[StepOutput]] = {0: [], 1: [], 2: []}
    while len(engine):
        for out in engine.step():
            got[out.seq_id].append(out)
    assert [o.token_id for o in got[0]] == hf_greedy(hf, prompt, 6)
    for seq_id, k in ((0, 5), (1, 0), (2, 2)):
        ids = [o.token_id for o in got[seq_id]]
        ref = hf_logprobs(hf, prompt, ids)
        for j, out in enumerate(got[seq_id]):
            assert out.logprobs.token_id == ids[j]
            assert out.logprobs.logprob == pytest.approx(float(ref[j, ids[j]]), abs=1e-4)
            top = torch.topk(ref[j], k) if k else None
            assert [t for t, _ in out.logprobs.top] == ([] if top is None else top.indices.tolist())
            if top is not None:
                values = [v for _, v in out.logprobs.top]
                assert values == pytest.approx(top.values.tolist(), abs=1e-4)
    assert [o.logprobs.top for o in got[2]] == [o.logprobs.top[:2] for o in got[0]]


@pytest.mark.timeout(120)
def test_stop_token_ids_stop_and_min_tokens_bans_the_end_ids(checkpoint: Checkpoint) -> None:
    hf, model = checkpoint.hf, load_ours(checkpoint)
    prompt = make_tokens(9, seed=21, vocab=model.config.vocab_size)
    free = [o.token_id for o in decode(model, prompt, 10, params=GREEDY)]
    j = next(j for j in range(2, 10) if free[j] not in free[:j])
    # A stop token id stops, even with ignore_eos.
    stopped = decode(model, prompt, 10, params=GREEDY, stop_token_ids=(free[j],), ignore_eos=True)
    assert [o.token_id for o in stopped] == free[: j + 1] and stopped[-1].finish_reason == "stop"
    # An end id biased to be chosen every time is chosen once min_tokens are reached.
    eos = next(t for t in range(50, 60) if t not in free)
    for kwargs in ({"eos_token_ids": (eos,)}, {"stop_token_ids": (eos,)}):
        forced = SamplingParams(temperature=0.0, logit_bias=((eos, 100.0),))
        outs = decode(model, prompt, 10, params=forced, min_tokens=3, **kwargs)
        ids = [o.token_id for o in outs]
        assert ids[3:] == [eos] and [o.finish_reason for o in outs] == [None] * 3 + ["stop"]
        ref = hf_logprobs(hf, prompt, ids)
        banned = ref.clone()
        banned[:, eos] = float("-inf")
        assert ids[:3] == banned[:3].argmax(-1).tolist()
        assert outs[3].logprobs.logprob == pytest.approx(float(ref[3, eos]), abs=1e-4)
    # Without min_tokens it ends at once; with ignore_eos an eos id is a token as any.
    forced = SamplingParams(temperature=0.0, logit_bias=((eos, 100.0),))
    at_once = decode(model, prompt, 4, params=forced, eos_token_ids=(eos,))
    assert [(o.token_id, o.finish_reason) for o in at_once] == [(eos, "stop")]
    kept = decode(
        model, prompt, 4, params=forced, eos_token_ids=(eos,), ignore_eos=True, min_tokens=2
    )
    assert [o.token_id for o in kept] == [eos] * 4 and kept[-1].finish_reason == "length"


@pytest.mark.timeout(120)
def test_penalties_choose_as_adjust_says(checkpoint: Checkpoint) -> None:
    hf, model = checkpoint.hf, load_ours(checkpoint)
    base = make_tokens(12, seed=22, vocab=model.config.vocab_size)
    prompt = hf_greedy(hf, base, 10) + base  # ids the greedy choice may repeat
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5)
    got = [o.token_id for o in decode(model, prompt, 10, params=params, prompt_ids=prompt)]
    choosing = Choosing(params, None, prompt_ids=prompt)
    expected: list[int] = []
    with torch.inference_mode():
        for _ in range(10):
            full = torch.tensor([prompt + expected])
            logits = hf(full, attention_mask=torch.ones_like(full)).logits[0, -1].float()
            expected.append(int(torch.argmax(adjust(logits, choosing, expected))))
    assert got == expected
    assert got != hf_greedy(hf, prompt, 10)  # the penalties changed the choice
    # The prompt's ids count as seen only when given.
    assert got != [o.token_id for o in decode(model, prompt, 10, params=params)]


def run_loop(
    model: CausalLM, prompt: list[int], seq: NewSequence, cancel_copy: int | None = None
) -> tuple[list[int], dict[int, list[StepOutput]]]:
    """``seq`` through a decode thread: its copies' ids and outputs; ``cancel_copy``
    is cancelled after its first token."""
    events: dict[int, list[StepOutput]] = {}
    lock, ended = threading.Lock(), threading.Semaphore(0)
    ids: list[int] = []

    def deliver(event: StepOutput | DecodeFailure, at: float) -> None:
        assert isinstance(event, StepOutput), event
        with lock:
            events.setdefault(event.seq_id, []).append(event)
            if event.finish_reason is not None:
                ended.release()
            if cancel_copy is not None and event.seq_id == ids[cancel_copy]:
                loop.cancel(event.seq_id)

    loop = DecodeLoop(DecodeEngine(model))
    loop.start()
    try:
        with lock:
            ids += loop.submit(seq, deliver)
        for _ in range(seq.copies - (cancel_copy is not None)):
            assert ended.acquire(timeout=30)
    finally:
        loop.close()
    return ids, events


@pytest.mark.timeout(60)
def test_copies_fork_one_prompt_kv(tiny_model: CausalLM) -> None:
    prompt = make_tokens(8, seed=23)
    kv = prompt_kv(tiny_model, prompt)
    releases: list[int] = []
    hot = SamplingParams(temperature=20.0, top_p=0.95, seed=5)
    new = NewSequence(kv, prompt[-1], hot, 8, release=lambda: releases.append(1), copies=3)
    ids, events = run_loop(tiny_model, prompt, new)
    assert releases == [1] and len(set(ids)) == 3
    alone = [
        [o.token_id for o in decode(tiny_model, prompt, 8, params=hot.for_copy(i))]
        for i in range(3)
    ]
    assert [[o.token_id for o in events[seq_id]] for seq_id in ids] == alone
    assert len({tuple(a) for a in alone}) == 3  # seeds 5, 6, 7 draw differently
    # Greedy copies are identical; a cancelled copy leaves, the others finish.
    greedy = [o.token_id for o in decode(tiny_model, prompt, 6, params=GREEDY)]
    ids, events = run_loop(tiny_model, prompt, NewSequence(kv, prompt[-1], GREEDY, 6, copies=3), 1)
    for copy in (0, 2):
        assert [o.token_id for o in events[ids[copy]]] == greedy
        assert events[ids[copy]][-1].finish_reason == "length"
    assert len(events[ids[1]]) in (1, 2) and events[ids[1]][-1].finish_reason is None
