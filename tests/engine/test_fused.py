"""The layers' arithmetic around attention, compiled (``engine/fused.py``): the same
numbers as eager (within 1e-4 in fp32; ``attention_in`` bit for bit in bf16), one
compiled graph for every length after the rank's warm-up, and what ``[engine]
compile`` does when compiling works and when it does not."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from support.factories import TINY, make_tokens
from vertumnus.config import EngineConfig
from vertumnus.config.model import PRESETS
from vertumnus.config.tables import ConfigError
from vertumnus.engine import fused
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.model import CausalLM
from vertumnus.engine.rank import _warm_up
from vertumnus.engine.weights import random_model
from vertumnus.engine.zigzag import RankPrefill, prefill_rank

pytestmark = pytest.mark.timeout(600)


def last_logits(model: CausalLM, n: int, seed: int = 0) -> torch.Tensor:
    ids = torch.tensor(make_tokens(n, seed, model.config.vocab_size))
    out = prefill_rank(model, SoloComm(), None, RankPrefill(ids, 0, (), (), 16), logits="all")
    assert out is not None
    return out


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_compiled_layers_give_the_eager_logits_in_fp32(preset: str) -> None:
    model = random_model(PRESETS[preset], seed=3).eval()
    lengths = (9, 200)
    eager = [last_logits(model, n) for n in lengths]
    model.layer_fns = fused.compiled_layer_fns()
    for n, want in zip(lengths, eager, strict=True):
        got = last_logits(model, n)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert model.layer_fns.name == "compiled"


def test_compiled_attention_in_is_the_eager_one_bit_for_bit_in_bf16() -> None:
    gen = torch.Generator().manual_seed(0)
    t, hidden, heads, kv_heads, d = 75, TINY.hidden_size, 4, 2, TINY.head_dim

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.1).to(torch.bfloat16)

    args = (
        w(t, hidden) * 10, w(t, 1, d), w(t, 1, d), w(hidden) + 1,
        w(heads * d, hidden), None, w(kv_heads * d, hidden), None, w(kv_heads * d, hidden), None,
        w(d) + 1, w(d) + 1, heads, kv_heads, 1e-6,
    )  # fmt: skip
    compiled = fused.compiled_layer_fns().attention_in(*args)
    for got, want in zip(compiled, fused.attention_in(*args), strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_one_compiled_graph_serves_every_length_after_the_warm_up() -> None:
    model = random_model(TINY, seed=5).eval()
    assert fused.prepare_layers(model, "on", lambda: _warm_up(model, 16)) is None
    before = counters["stats"]["unique_graphs"]
    # Lengths equal to the model's dimensions too (head dim, hidden, intermediate).
    for n in (2, TINY.head_dim, TINY.hidden_size, TINY.intermediate_size, 1001):
        last_logits(model, n)
    assert counters["stats"]["unique_graphs"] == before


def test_compile_off_runs_eager_and_auto_falls_back_with_the_reason() -> None:
    model = random_model(TINY, seed=1).eval()
    assert fused.prepare_layers(model, "off", lambda: pytest.fail("no warm-up when off")) is None
    assert model.layer_fns is fused.EAGER

    def broken() -> None:
        raise RuntimeError("no C++ compiler\nmore detail")

    why = fused.prepare_layers(model, "auto", broken)
    assert why == "RuntimeError: no C++ compiler" and model.layer_fns is fused.EAGER
    with pytest.raises(RuntimeError, match='compile = "on" but compiling failed: no C'):
        fused.prepare_layers(model, "on", broken)
    assert model.layer_fns is fused.EAGER
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        fused.prepare_layers(model, "sometimes", broken)


def test_the_engine_config_refuses_an_unknown_compile_mode() -> None:
    assert EngineConfig().compile == "auto"
    with pytest.raises(ConfigError, match="compile must be auto, on or off, got 'yes'"):
        EngineConfig(compile="yes")
