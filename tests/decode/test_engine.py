"""The decode engine (``decode/engine.py``) against transformers: greedy ids
equal ``generate(do_sample=False)`` on the same checkpoint, dense and Qwen3-MoE,
from the prompt KV our own model computed (as the prefill pool hands it over);
a batch of prompts of different lengths, with one joining mid-way, gives each the
ids it gets alone, in one forward per step; seeded sampling is reproducible;
end-of-sequence ids and the model's last position stop a sequence; the decode
thread (``decode/loop.py``) delivers, cancels and fails sequences as it promises."""

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
from vertumnus.decode.sampling import SamplingParams
from vertumnus.engine.model import Qwen3ForCausalLM, causal_attention
from vertumnus.engine.weights import load_model, random_model

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
KV = list[tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def prompt_kv(model: Qwen3ForCausalLM, prompt: list[int]) -> KV:
    """K and V of every token of ``prompt`` but the last, per layer [n, Hkv, D]: what
    the prefill pool hands over, computed by our single-process model."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    reference = causal_attention()

    def capture(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        captured[layer] = (k.clone(), v.clone())
        return reference(layer, q, k, v)

    n = len(prompt) - 1
    if n == 0:
        cfg = model.config
        empty = torch.empty(0, cfg.num_key_value_heads, cfg.head_dim)
        return [(empty, empty) for _ in range(cfg.num_hidden_layers)]
    model(torch.tensor(prompt[:-1]), torch.arange(n), capture)
    return [captured[i] for i in range(model.config.num_hidden_layers)]


def decode(
    model: Qwen3ForCausalLM, prompt: list[int], max_tokens: int, **kwargs: object
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


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    hf = make_hf_moe(top_k=2, vocab_size=256)
    folder = tmp_path_factory.mktemp("qwen3-moe")
    hf.save_pretrained(folder)
    return Checkpoint(hf, folder, ModelConfig.from_dir(folder))  # type: ignore[arg-type]


@pytest.fixture(params=["dense", "moe"])
def pair(
    request: pytest.FixtureRequest, checkpoint: Checkpoint, moe_checkpoint: Checkpoint
) -> tuple[transformers.PreTrainedModel, Qwen3ForCausalLM]:
    """(transformers' model, ours) on the same checkpoint."""
    chosen = checkpoint if request.param == "dense" else moe_checkpoint
    ours = load_model(chosen.config, Path(chosen.model_dir), torch.float32, CPU)
    return chosen.hf, ours.requires_grad_(False)


@pytest.mark.timeout(120)
def test_greedy_ids_equal_transformers_alone(
    pair: tuple[transformers.PreTrainedModel, Qwen3ForCausalLM],
) -> None:
    hf, ours = pair
    prompt = make_tokens(13, seed=1, vocab=ours.config.vocab_size)
    outputs = decode(ours, prompt, 8, params=GREEDY)
    assert [o.token_id for o in outputs] == hf_greedy(hf, prompt, 8)
    assert [o.finish_reason for o in outputs] == [None] * 7 + ["length"]


@pytest.mark.timeout(120)
def test_a_batch_with_a_late_joiner_equals_transformers_in_one_forward_per_step(
    pair: tuple[transformers.PreTrainedModel, Qwen3ForCausalLM],
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
def test_seeded_sampling_is_reproducible_alone_and_batched(tiny_model: Qwen3ForCausalLM) -> None:
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
def test_an_end_of_sequence_id_stops_unless_ignored(tiny_model: Qwen3ForCausalLM) -> None:
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
def test_joining_is_checked(tiny_model: Qwen3ForCausalLM) -> None:
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
    engine.add(0, kv, 1, GREEDY, 4)
    with pytest.raises(ValueError, match="already decoding"):
        engine.add(0, kv, 1, GREEDY, 4)
    assert engine.remove(0) and not engine.remove(0) and engine.step() == []


@pytest.mark.timeout(60)
def test_the_decode_thread_delivers_cancels_and_fails(tiny_model: Qwen3ForCausalLM) -> None:
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
        ids[1] = loop.submit(NewSequence(kv, prompt[-1], GREEDY, 10_000), deliver_to(1))
        ids[0] = loop.submit(NewSequence(kv, prompt[-1], GREEDY, 6), deliver_to(0))
        ids[2] = loop.submit(NewSequence(kv[:1], prompt[-1], GREEDY, 6), deliver_to(2))
        assert done[0].wait(30) and done[2].wait(30)
        ids[3] = loop.submit(NewSequence(kv, prompt[-1], GREEDY, 10_000), deliver_to(3))
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
