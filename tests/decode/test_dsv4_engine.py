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
