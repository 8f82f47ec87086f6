"""DeepSeek-V4's decode engine against transformers' ``generate``: sequences that
join with the prompt's state (computed by the engine's prefill at C = 1, or gathered
under CP 2) decode transformers' greedy tokens, several at once, and leave cleanly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.dsv4 import VOCAB, write_dsv4_folder
from support.threads import run_ranks
from vertumnus.config import ModelConfig
from vertumnus.decode.dsv4_engine import DsV4DecodeEngine
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.dsv4.load import load_dsv4
from vertumnus.engine.dsv4.model import DeepseekV4LM, resume_rank
from vertumnus.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
NEW = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, DeepseekV4LM]:
    path = tmp_path_factory.mktemp("dsv4")
    ref = write_dsv4_folder(path)
    return ref, load_dsv4(ModelConfig.from_dir(path), path, torch.float32, torch.device("cpu"))


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _generate(ref: Any, prompt: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = ref.generate(prompt[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           eos_token_id=None)  # fmt: skip
    return [int(t) for t in out[0, prompt.numel() :]]


def _state(model: DeepseekV4LM, prompt: torch.Tensor, c: int) -> Any:
    """The state of the prompt but its last token, from the engine's prefill."""
    if c == 1:
        return resume_rank(model, SoloComm(), prompt[:-1], "last")[1]
    results, _ = run_ranks(
        c, lambda _r, comm: resume_rank(model, comm, prompt[:-1], "last", None, True)
    )
    return results[0][1]


@pytest.mark.parametrize("c", [1, 2])
def test_greedy_tokens_equal_transformers_generate(
    models: tuple[Any, DeepseekV4LM], c: int
) -> None:
    ref, model = models
    prompts = {0: _prompt(300, 1), 1: _prompt(257, 2)}  # the second crosses 256 (HCA)
    engine = DsV4DecodeEngine(model)
    for seq_id, prompt in prompts.items():
        engine.add(seq_id, _state(model, prompt, c), int(prompt[-1]), GREEDY, NEW)
    got: dict[int, list[int]] = {0: [], 1: []}
    while len(engine):
        for out in engine.step():
            got[out.seq_id].append(out.token_id)
            assert out.finish_reason in (None, "length")
    assert got == {seq_id: _generate(ref, p) for seq_id, p in prompts.items()}


def test_a_sequence_leaves_and_bad_states_are_refused(models: tuple[Any, DeepseekV4LM]) -> None:
    _, model = models
    engine = DsV4DecodeEngine(model)
    prompt = _prompt(40, 3)
    engine.add(0, _state(model, prompt, 1), int(prompt[-1]), GREEDY, NEW)
    assert engine.step()[0].seq_id == 0
    assert engine.remove(0) and not engine.remove(0) and engine.step() == []
    assert engine._states == {}
    with pytest.raises(ValueError, match="DsV4State"):
        engine.add(1, [(torch.zeros(3, 1, 64), torch.zeros(3, 1, 64))], 5, GREEDY, NEW)


def test_a_one_token_prompt_decodes_from_the_empty_state(models: tuple[Any, DeepseekV4LM]) -> None:
    """A one-token prompt hands off the state of no token (``state_at`` 0)."""
    ref, model = models
    prompt = _prompt(1, 4)
    results, _ = run_ranks(
        2, lambda _r, comm: resume_rank(model, comm, prompt, "last", None, True, 0)
    )
    state = results[0][1]
    assert state.length == 0
    engine = DsV4DecodeEngine(model)
    engine.add(0, state, int(prompt[-1]), GREEDY, NEW)
    got = []
    while len(engine):
        got += [out.token_id for out in engine.step()]
    assert got == _generate(ref, prompt)


def _fill(stream: Any, data: bytes) -> None:
    """Feed ``data`` to a ``KVStream``'s regions as a socket would."""
    at = 0
    for region in stream.regions():
        n = len(region)
        region[:n] = data[at : at + n]
        at += n
    assert at == len(data)


def test_the_state_travels_as_one_chunk_and_a_wrong_one_is_refused(
    models: tuple[Any, DeepseekV4LM],
) -> None:
    from vertumnus import kv_wire as wire
    from vertumnus.decode.kv_stream import Arena, KVStream
    from vertumnus.engine.dsv4.state import to_bytes

    _, model = models
    _, state = resume_rank(model, SoloComm(), _prompt(130, 5), "last")
    assert state is not None
    blob = to_bytes(state)
    cfg = model.config
    header = wire.KVHeader("kv-x", 130, cfg.num_hidden_layers, 1, cfg.head_dim, "float32", 16,
                           "m", state_bytes=len(blob))  # fmt: skip
    good = header.encode() + wire.chunk_header(130, wire.CHUNK_STATE) + blob + wire.END
    stream = KVStream("pull", "kv-x", cfg, Arena())
    _fill(stream, good)
    got = stream.prompt()
    assert got.length == 130 and torch.equal(got.layers[1].entries, state.layers[1].entries)
    bad = header.encode() + wire.chunk_header(130, wire.CHUNK_ROWS) + blob + wire.END
    with pytest.raises(wire.HandoffError, match="expected the prompt's state"):
        _fill(KVStream("pull", "kv-x", cfg, Arena()), bad)
    assert wire.parse_chunk_header(wire.chunk_header(0, wire.CHUNK_STATE), 16) == (3, 0)
    with pytest.raises(wire.WireError):
        wire.parse_chunk_header(wire.chunk_header(0, wire.CHUNK_ROWS), 16)
