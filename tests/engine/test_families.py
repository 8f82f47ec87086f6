"""Every family against transformers on the same folder: loaded as ``save_pretrained``
wrote it, the zigzag CP prefill's fp32 logits at C = 1 to 4, fresh and after a cached
prefix that ends inside and outside the sliding window, within ``ATOL`` of
transformers' own; and the decode engine's greedy tokens equal ``generate``'s.

The prefixes: one block (16 tokens: inside a window of 20 or 24, so the first new
queries see all of it) and three blocks (48: the window reaches back only into its
end, or not at all for a window of 8).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from support.decode_pool import greedy_ids, prompt_kv
from support.factories import BLOCK_SIZE, make_tokens
from support.families import CASES, VOCAB, write_family_folder
from support.reference import hf_greedy, hf_logits, max_abs_diff
from support.threads import ThreadWorker, cp_prefill
from vertumnus.config import ModelConfig
from vertumnus.engine.model import CausalLM, causal_attention
from vertumnus.engine.weights import load_model

ATOL = 1e-4  # fp32 against fp32
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    case = request.param
    folder = tmp_path_factory.mktemp(case)
    hf = write_family_folder(case, folder, shard=case == "mixtral")
    cfg = ModelConfig.from_dir(folder)
    ours = load_model(cfg, folder, torch.float32, CPU).requires_grad_(False)
    return case, hf, ours, folder


def test_the_folder_reads_as_its_family(family) -> None:
    case, hf, ours, folder = family
    cfg = ours.config
    assert cfg.architecture == hf.config.architectures[0]
    assert cfg.num_hidden_layers == hf.config.num_hidden_layers
    if case == "mixtral":  # sharded: the index names several files
        assert (folder / "model.safetensors.index.json").is_file()
    windows = {c: w for c, w in [("mistral", 24), ("mixtral", 20), ("qwen2", 12), ("gpt-oss", 8)]}
    assert cfg.sliding_window == windows.get(case)
    if case == "gpt-oss":
        assert cfg.windows == (8, None, 8) and cfg.attention_sinks
    if case == "qwen2":
        assert cfg.windows == (None, 12, 12) and cfg.attention_bias and not cfg.o_proj_bias


@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_cp_logits_equal_transformers_fresh_and_cached(family, c: int) -> None:
    case, hf, ours, _ = family
    tokens = make_tokens(45, seed=3, vocab=VOCAB)
    worker = ThreadWorker.make(c, ours.config)
    out = cp_prefill(ours, worker, tokens)
    ref = hf_logits(hf, tokens)
    assert max_abs_diff(out.logits, ref) < ATOL, case
    # A conversation that extends the first prompt: its 2 full blocks are reused.
    longer = tokens + make_tokens(40, seed=4, vocab=VOCAB)
    out = cp_prefill(ours, worker, longer)
    assert out.cmd.prefix_len == 2 * BLOCK_SIZE
    diff = max_abs_diff(out.logits, hf_logits(hf, longer)[2 * BLOCK_SIZE :])
    assert diff < ATOL, f"{case} C={c} prefix 32: {diff:.3g}"


@pytest.mark.parametrize("prefix_blocks", [1, 3])
def test_a_cached_prefix_inside_and_outside_the_window(family, prefix_blocks: int) -> None:
    case, hf, ours, _ = family
    prefix = make_tokens(prefix_blocks * BLOCK_SIZE, seed=5, vocab=VOCAB)
    worker = ThreadWorker.make(2, ours.config)
    cp_prefill(ours, worker, [*prefix, 1])  # caches the prefix's blocks
    tokens = prefix + make_tokens(37, seed=6, vocab=VOCAB)
    out = cp_prefill(ours, worker, tokens)
    assert out.cmd.prefix_len == prefix_blocks * BLOCK_SIZE
    diff = max_abs_diff(out.logits, hf_logits(hf, tokens)[prefix_blocks * BLOCK_SIZE :])
    assert diff < ATOL, f"{case} prefix {prefix_blocks} blocks: {diff:.3g}"


@torch.inference_mode()
def test_decode_engine_greedy_equals_generate(family) -> None:
    case, hf, ours, _ = family
    prompt = make_tokens(30, seed=7, vocab=VOCAB)
    assert greedy_ids(ours, prompt, 12) == hf_greedy(hf, prompt, 12), case


def test_unsupported_features_are_named(tmp_path: Path) -> None:
    from vertumnus.config import ConfigError

    base = CASES["llama-linear"]().to_dict()
    for change, message in [
        ({"architectures": ["PhiForCausalLM"]}, "unsupported architecture 'PhiForCausalLM'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method 'mxfp4'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLM"], **change})


def test_model_is_a_causal_lm(family) -> None:
    assert isinstance(family[2], CausalLM)


@pytest.mark.parametrize("c", [2, 3, 4])
def test_a_sliding_layer_moves_its_halo_not_the_sequence(family, c: int) -> None:
    """Per rank: one all-gather per full layer, one all-to-all per sliding layer; the
    all-to-all brings at most the window's rows before each of the rank's two chunks
    and the rows of the blocks it stores, far fewer than the all-gather's."""
    case, _, ours, _ = family
    cfg = ours.config
    if cfg.sliding_window is None:
        pytest.skip("no sliding layer")
    worker = ThreadWorker.make(c, cfg)
    out = cp_prefill(ours, worker, make_tokens(45, seed=3, vocab=VOCAB))
    windows = cfg.windows
    sliding = sum(w is not None for w in windows)
    row = 2 * cfg.num_key_value_heads * cfg.head_dim  # elements of one token's K and V
    for rank, (calls, got) in enumerate(zip(out.calls, out.received, strict=True)):
        assert calls == Counter(kv=len(windows) - sliding, halo=sliding, out=1)
        stored = len(out.cmd.write[rank]) * BLOCK_SIZE
        bound = 2 * (cfg.sliding_window - 1) + stored
        assert got["halo"] <= sliding * bound * row, (case, rank, got)
        if sliding == len(windows):
            continue
        # Whole-sequence all-gathers, for comparison: (C - 1) shares of 2s rows.
        assert got["kv"] == (len(windows) - sliding) * (c - 1) * 2 * (-(-45 // (2 * c))) * row


@pytest.mark.parametrize("c", [2, 3])
def test_stored_blocks_hold_every_layers_kv(family, c: int) -> None:
    """The blocks a prefill stores (each on rank depth % C) hold the reference's K/V in
    every layer, sliding ones included: the halo brought each rank its blocks' rows."""
    _, _, ours, _ = family
    tokens = make_tokens(70, seed=8, vocab=VOCAB)
    worker = ThreadWorker.make(c, ours.config)
    out = cp_prefill(ours, worker, tokens)
    ks, vs = prompt_kv(ours, [*tokens, 0])  # [L, 70, Hkv, D]: every token's
    written = [(d, rank, slot) for rank, w in enumerate(out.cmd.write) for d, slot in w]
    assert len(written) == 70 // BLOCK_SIZE
    for depth, rank, slot in written:
        assert rank == depth % c
        rows = slice(depth * BLOCK_SIZE, (depth + 1) * BLOCK_SIZE)
        store = worker.stores[rank]
        for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
            torch.testing.assert_close(store.k[slot, layer], k[rows], rtol=0, atol=1e-5)
            torch.testing.assert_close(store.v[slot, layer], v[rows], rtol=0, atol=1e-5)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("no_leftover_ranks")
def test_gpt_oss_over_rank_processes(tmp_path: Path) -> None:
    """gpt-oss on a degree-2 worker of rank processes (gloo): the halo's all-to-all
    and the sinks over real process groups, fp32 and bf16, fresh and cached."""
    from support.factories import engine_config
    from vertumnus.runtime.prefill import PrefillClient
    from vertumnus.runtime.ranks import ChildRanks

    hf = write_family_folder("gpt-oss", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    tokens = make_tokens(61, seed=9, vocab=VOCAB)
    ref = hf_logits(hf, tokens)
    for dtype, atol in (("float32", ATOL), ("bfloat16", None)):
        pool = ChildRanks(cfg, str(tmp_path), engine_config(dtype=dtype), world_size=2, degrees=[2])
        pool.start()
        try:
            worker = PrefillClient(pool, (0, 1))
            fresh = worker.prefill(tokens[:40], logits="all")
            out = worker.prefill(tokens, logits="all")
        finally:
            pool.close()
        assert fresh.collectives == {"kv": 1, "halo": 2, "out": 1}
        assert out.cached_tokens == 32
        if atol is not None:
            assert max_abs_diff(fresh.logits, ref[:40]) < atol
            assert max_abs_diff(out.logits, ref[32:]) < atol
        else:  # bf16: the same greedy token at the end, logits near
            assert int(out.logits[-1].argmax()) == int(ref[-1].argmax())
            assert max_abs_diff(out.logits, ref[32:]) < 0.5


def test_the_gpt_oss_preset_runs_under_cp() -> None:
    """``tiny-gpt-oss`` (random weights, no folder) reads as gpt-oss and its CP-3
    prefill equals the single-process reference."""
    from vertumnus.config import PRESETS
    from vertumnus.engine.weights import random_model

    cfg = PRESETS["tiny-gpt-oss"]
    assert cfg.windows == (128, None, 128, None) and cfg.attention_sinks
    model = random_model(cfg, 0).requires_grad_(False)
    tokens = make_tokens(300, seed=1, vocab=cfg.vocab_size)
    out = cp_prefill(model, ThreadWorker.make(3, cfg, blocks_per_rank=32), tokens)
    with torch.inference_mode():
        ids = torch.tensor(tokens)
        ref = model.logits(model(ids, torch.arange(len(tokens)), causal_attention()))
    assert max_abs_diff(out.logits, ref) < ATOL
