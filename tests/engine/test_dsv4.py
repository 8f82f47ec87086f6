"""DeepSeek-V4 in the engine against transformers: the config read from its folder,
exact fp32 logits under partitioned zigzag CP at C = 1-4 over 1-4K tokens (every
layer kind, both expert routings), the collectives and what crosses ranks, and FP8
block-scaled folders in DeepSeek's own names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from support.dsv4 import VOCAB, write_dsv4_folder
from support.threads import run_ranks
from vertumnus.config import ConfigError, ModelConfig
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.dsv4.load import load_dsv4
from vertumnus.engine.dsv4.model import DeepseekV4LM, prefill_rank, resume_rank
from vertumnus.engine.fp8 import dequantize_blocks, quantize_blocks

CPU = torch.device("cpu")
TOL = 1e-4


_REFERENCE: dict[int, torch.Tensor] = {}


def _ids(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(length))


def _reference(model: Any, length: int) -> torch.Tensor:
    if length not in _REFERENCE:
        with torch.no_grad():
            _REFERENCE[length] = model(_ids(length)[None]).logits[0].float()
    return _REFERENCE[length]


def _prefill(model: DeepseekV4LM, ids: torch.Tensor, c: int) -> tuple[torch.Tensor, list[Any]]:
    if c == 1:
        comm = SoloComm()
        out = prefill_rank(model, comm, ids, logits="all")
        assert out is not None
        return out, [comm]
    results, comms = run_ranks(c, lambda _r, comm: prefill_rank(model, comm, ids, logits="all"))
    assert all(r is None for r in results[1:])
    return results[0], comms


def test_config_reads_every_field(dsv4_folder: tuple[Path, Any]) -> None:
    cfg = ModelConfig.from_dir(dsv4_folder[0])
    spec = cfg.dsv4
    assert spec is not None and cfg.architecture == "DeepseekV4ForCausalLM"
    assert spec.compress_ratios == (0, 4, 128, 4)
    assert spec.hash_layers == (True, False, False, True)
    assert (spec.index_n_heads, spec.index_head_dim, spec.index_topk) == (16, 16, 8)
    assert (spec.q_lora_rank, spec.o_groups, spec.o_lora_rank, spec.hc_mult) == (32, 2, 16, 4)
    assert spec.rope_head_dim == 8 and spec.compress_rope_type == "yarn"
    assert spec.compress_param("attention_factor") == 1.0  # transformers' V4 rule
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window) == (1, 64, 128)
    assert spec.largest_ratio == 128


def test_native_config_keys_fold_in_as_transformers_does() -> None:
    """DeepSeek's own config.json: per-layer compress_ratios, num_hash_layers,
    qk_rope_head_dim, a flat rope_scaling, FP8 quantization."""
    raw = {
        "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 32,
        "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "compress_ratios": [128, 4, 0], "num_hash_layers": 1, "qk_rope_head_dim": 16,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "weight_block_size": [128, 128]},
    }  # fmt: skip
    spec = ModelConfig.from_hf_dict(raw).dsv4
    assert spec is not None
    assert spec.compress_ratios == (128, 4, 0) and spec.hash_layers == (True, False, False)
    assert spec.rope_head_dim == 16 and spec.compress_rope_type == "yarn"
    assert spec.compress_param("attention_factor") == 1.0


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4"}}, "fp8"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ],
)
def test_unsupported_configs_are_refused_by_name(
    dsv4_folder: tuple[Path, Any], over: dict[str, Any], words: str
) -> None:
    raw = {**json.loads((dsv4_folder[0] / "config.json").read_text()), **over}
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("length", [1000, 1024, 2100])
@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_logits_equal_transformers_under_zigzag_cp(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM, c: int, length: int
) -> None:
    """Lengths that are and are not multiples of 128, past the window, with the
    indexer choosing 8 of up to 525 entries."""
    want = _reference(dsv4_folder[1], length)
    got, _ = _prefill(dsv4_engine, _ids(length), c)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


def test_four_thousand_tokens_at_cp4(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM
) -> None:
    want = _reference(dsv4_folder[1], 4000)
    got, _ = _prefill(dsv4_engine, _ids(4000), 4)
    assert (got - want).abs().max().item() <= TOL


def test_collectives_and_what_crosses_ranks(dsv4_engine: DeepseekV4LM) -> None:
    """One halo all-to-all per layer, one entries all-gather per compressed layer, one
    output all-gather; a rank receives the window's halo and the entries, far less
    than an all-gather of the raw KV would bring it."""
    length, c, d, di = 2048, 4, 64, 16
    _, comms = _prefill(dsv4_engine, _ids(length), c)
    for comm in comms:
        assert dict(comm.calls) == {"halo": 4, "comp": 3, "out": 1}
    received = [comm.received for comm in comms]
    # Entries: CSA 2048/4 x (64 + 16) and HCA 2048/128 x 64 per layer; a rank has 1/4.
    comp = 2 * (length // 4) * (d + di) + (length // 128) * d
    assert all(r["comp"] == comp * (c - 1) // c for r in received)
    # The halo: 127 rows of 64 (plus, on CSA layers, 4 rows of half of the
    # compressor's and the indexer's kv and gate) per chunk boundary a rank receives:
    # one for rank 0 (chunk 2C-1) and rank C-1 (chunk C-1; chunk C follows it there).
    csa_extra = 4 * 2 * (d + di)
    for rank, r in enumerate(received):
        boundaries = 1 if rank in (0, c - 1) else 2
        assert r["halo"] == boundaries * (4 * 127 * d + 2 * csa_extra)
    raw_gather = 4 * length * d * (c - 1) // c  # every layer's shared KV
    assert max(r["comp"] + r["halo"] for r in received) < raw_gather / 3


def _fp8_folder(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``src`` rewritten in DeepSeek's FP8 layout (every 2-D matrix but the embeddings
    and the compressors' projections as e4m3 with ``.scale``; an ``mtp`` layer the
    loader must skip), over two shards; returns the dequantized matrices by name."""
    from safetensors import safe_open

    dst.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensors[name] = f.get_tensor(name)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    expected = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        keep = "compressor" in name or "embed" in name or t.dim() != 2 or name == "head.weight"
        if keep or not name.endswith(".weight"):
            shards[i % 2][name] = t
            continue
        weight, scale = quantize_blocks(t, (128, 128))
        shards[i % 2][name] = weight
        shards[(i + 1) % 2][name[: -len("weight")] + "scale"] = scale
        expected[name] = dequantize_blocks(weight, scale, (128, 128))
    shards[0]["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)
    for k, shard in enumerate(shards):
        save_file(shard, str(dst / f"model-{k:05d}-of-00002.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(raw))
    return expected


def test_fp8_folder_loads_to_the_dequantized_weights(
    dsv4_folder: tuple[Path, Any], tmp_path: Path
) -> None:
    expected = _fp8_folder(dsv4_folder[0], tmp_path / "fp8")
    cfg = ModelConfig.from_dir(tmp_path / "fp8")
    model = load_dsv4(cfg, tmp_path / "fp8", torch.float32, CPU)
    state = dict(model.named_parameters())
    layer = "model.layers.1"
    pairs = {
        f"{layer}.attn.wq_a.weight": f"{layer}.self_attn.q_a_proj.weight",
        f"{layer}.attn.wo_a.weight": f"{layer}.self_attn.o_a_proj.weight",
        f"{layer}.ffn.shared_experts.w2.weight": f"{layer}.mlp.shared_experts.down_proj.weight",
    }
    assert len(expected) > 20
    for native, ours in pairs.items():
        assert torch.equal(state[ours], expected[native])
    fused = state[f"{layer}.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[2, :32], expected[f"{layer}.ffn.experts.2.w1.weight"])
    assert torch.equal(fused[2, 32:], expected[f"{layer}.ffn.experts.2.w3.weight"])
    ids = _ids(300)
    logits = prefill_rank(model, SoloComm(), ids, logits="all")
    assert logits is not None and torch.isfinite(logits).all()


@pytest.mark.parametrize("prefix", [1, 3, 4, 127, 128, 130, 257, 1024, 1027])
def test_a_prompt_resumes_from_its_prefix_state(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM, prefix: int
) -> None:
    """A prefix ending inside and at the end of CSA and HCA windows (its open windows
    and CSA's overlap carried over), then the rest of the prompt at C = 1."""
    ids, want = _ids(1300), _reference(dsv4_folder[1], 1300)
    _, state = resume_rank(dsv4_engine, SoloComm(), ids[:prefix], "all")
    assert state is not None and state.length == prefix
    got, after = resume_rank(dsv4_engine, SoloComm(), ids[prefix:], "all", state)
    assert got is not None and after is not None and after.length == 1300
    assert (got - want[prefix:]).abs().max().item() <= TOL


@pytest.mark.parametrize("c", [2, 3, 4])
def test_cp_resumes_a_prefix_on_a_chunk_boundary(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM, c: int
) -> None:
    ids, want = _ids(1300), _reference(dsv4_folder[1], 1300)
    _, state = resume_rank(dsv4_engine, SoloComm(), ids[:1024], "all")
    results, comms = run_ranks(
        c, lambda _r, comm: resume_rank(dsv4_engine, comm, ids[1024:], "all", state)
    )
    assert (results[0][0] - want[1024:]).abs().max().item() <= TOL
    assert dict(comms[0].calls) == {"halo": 4, "comp": 3, "out": 1}
    with pytest.raises(ValueError, match="boundary"):
        run_ranks(
            c,
            lambda _r, comm: resume_rank(
                dsv4_engine,
                comm,
                ids[1000:],
                "all",
                resume_rank(dsv4_engine, SoloComm(), ids[:1000])[1],
            ),
        )


def test_decode_steps_match_the_whole_prompt(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM
) -> None:
    """One token at a time across a CSA window and the first HCA window's end (256):
    the decode engine's step."""
    ids, want = _ids(1300), _reference(dsv4_folder[1], 1300)
    _, state = resume_rank(dsv4_engine, SoloComm(), ids[:250], "all")
    for t in range(250, 262):
        got, state = resume_rank(dsv4_engine, SoloComm(), ids[t : t + 1], "last", state)
        assert got is not None and (got[0] - want[t]).abs().max().item() <= TOL


def test_ties_at_the_topk_boundary_go_the_same_way_whole_and_resumed(tmp_path: Path) -> None:
    """With 4 index heads the indexer often scores entries exactly 0 and the top k
    falls among them: the engine breaks such ties toward earlier entries, so a prompt
    resumed from its prefix picks what it picks whole."""
    write_dsv4_folder(tmp_path, index_n_heads=4)
    model = load_dsv4(ModelConfig.from_dir(tmp_path), tmp_path, torch.float32, CPU)
    ids = _ids(1300)
    whole, _ = resume_rank(model, SoloComm(), ids, "all")
    _, state = resume_rank(model, SoloComm(), ids[:1024], "all")
    resumed, _ = resume_rank(model, SoloComm(), ids[1024:], "all", state)
    assert whole is not None and resumed is not None
    assert (resumed - whole[1024:]).abs().max().item() <= 1e-5


def test_a_rank_refuses_what_dsv4_prefills_do_not_take_yet() -> None:
    from vertumnus.engine.messages import PrefillCommand
    from vertumnus.engine.rank_state import _check_dsv4

    ids, ids128 = torch.arange(5), torch.arange(128)
    plain = PrefillCommand(1, (0,), ids, 0, ((),), ((),), 16)
    _check_dsv4(plain, "no blocks at 16")
    _check_dsv4(PrefillCommand(1, (0,), ids, 0, ((),), ((),), 16, export=(0, 4)), None)
    cached = PrefillCommand(1, (0,), ids, 128, ((3,),), (((1, 4),),), 128, prefix_ids=ids128)
    _check_dsv4(cached, None)
    with pytest.raises(ValueError, match="no blocks at 16"):
        _check_dsv4(cached, "no blocks at 16")
    partial = PrefillCommand(1, (0,), ids, 128, ((3,),), ((),), 128, export=(1, 4),
                             prefix_ids=ids128)  # fmt: skip
    with pytest.raises(ValueError, match="exported rows other than the prompt but its last"):
        _check_dsv4(partial, None)
    unknown = PrefillCommand(1, (0,), ids, 128, ((3,),), ((),), 128)
    with pytest.raises(ValueError, match="needs its token ids"):
        _check_dsv4(unknown, None)
    logprobs = PrefillCommand(1, (0,), ids, 0, ((),), ((),), 128, prompt_logprobs=2)
    with pytest.raises(ValueError, match="prompt logprobs"):
        _check_dsv4(logprobs, None)


def test_bf16_rounds_no_worse_than_transformers_in_bf16(dsv4_folder: tuple[Path, Any]) -> None:
    """The Qwen3 rule (tests/engine/test_bf16.py) at CP 2 with a resumed prefix: mean
    |logit - fp32| at most 1.25x transformers-bf16's + 1e-3, top-1 agreement at most 2
    points lower (a mixture of experts: no bound on the max). Both keep the same
    parameters in fp32 (norms, sinks, position biases, hyper-connections)."""
    import transformers

    path, ref = dsv4_folder
    theirs_model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours_model = load_dsv4(ModelConfig.from_dir(path), path, torch.bfloat16, CPU)
    ids = _ids(1300)
    want = _reference(ref, 1300)[1024:]
    _, state = resume_rank(ours_model, SoloComm(), ids[:1024], "all")
    results, _ = run_ranks(
        2, lambda _r, comm: resume_rank(ours_model, comm, ids[1024:], "all", state)
    )
    ours = results[0][0]
    with torch.no_grad():
        theirs = theirs_model.eval()(ids[None]).logits[0, 1024:].float()
    err, their_err = (ours - want).abs(), (theirs - want).abs()
    assert float(err.mean()) <= 1.25 * float(their_err.mean()) + 1e-3
    top1 = float((ours.argmax(-1) == want.argmax(-1)).float().mean())
    their_top1 = float((theirs.argmax(-1) == want.argmax(-1)).float().mean())
    assert top1 >= their_top1 - 0.02
    assert float(err.mean()) > 1e-4  # rounding's size: bf16 did run


def _state_diff(a: Any, b: Any) -> float:
    worst = 0.0
    assert a.length == b.length and len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers, strict=True):
        pairs = [(la.raw, lb.raw), (la.entries, lb.entries), (la.index_keys, lb.index_keys)]
        opens = zip(la.open, lb.open, strict=True)
        priors = zip(la.prior, lb.prior, strict=True)
        for x, y in [*pairs, *opens, *priors]:
            assert (x is None) == (y is None)
            if x is not None and x.numel():
                assert x.shape == y.shape
                worst = max(worst, (x - y).abs().max().item())
    return worst


@pytest.mark.parametrize("length", [257, 1027])
@pytest.mark.parametrize("c", [2, 4])
def test_cp_gathers_the_prompt_state_a_decode_resumes(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM, c: int, length: int
) -> None:
    """Under CP the state after the prompt (what a hand-off carries) comes from one
    ``state`` all-gather of the rows around its end: it equals C = 1's, and decoding
    from it gives transformers' logits."""
    ids, want = _ids(1300), _reference(dsv4_folder[1], 1300)
    _, alone = resume_rank(dsv4_engine, SoloComm(), ids[:length], "all")
    results, comms = run_ranks(
        c, lambda _r, comm: resume_rank(dsv4_engine, comm, ids[:length], "all", None, True)
    )
    assert dict(comms[0].calls) == {"halo": 4, "comp": 3, "state": 1, "out": 1}
    assert all(_state_diff(alone, state) <= 1e-5 for _, state in results)
    state = results[c - 1][1]
    for t in range(length, length + 4):
        got, state = resume_rank(dsv4_engine, SoloComm(), ids[t : t + 1], "last", state)
        assert got is not None and (got[0] - want[t]).abs().max().item() <= TOL


def test_the_last_logits_need_one_row_from_each_rank(
    dsv4_folder: tuple[Path, Any], dsv4_engine: DeepseekV4LM
) -> None:
    """For the first token alone, ``out`` gathers one hidden row per rank (the last
    token's, zeros from the others), not every rank's hidden states."""
    ids, want = _ids(1000), _reference(dsv4_folder[1], 1000)
    results, comms = run_ranks(4, lambda _r, comm: prefill_rank(dsv4_engine, comm, ids, "last"))
    assert (results[0][0] - want[-1]).abs().max().item() <= TOL
    assert all(comm.received["out"] == 3 * 64 for comm in comms)


def test_a_rank_keeps_no_kv_blocks_it_never_writes(dsv4_folder: tuple[Path, Any]) -> None:
    """At a block size that cannot hold DeepSeek-V4's prefix state (16) the pool caches
    none of its prefixes, so a rank's paged store is one block, whatever
    ``kv_blocks_per_rank`` asks (at V4-Flash's size the unused blocks would be
    gigabytes per rank)."""
    from vertumnus.engine.kv_store import PagedKVStore

    cfg = ModelConfig.from_dir(dsv4_folder[0])
    store = PagedKVStore(cfg, 4096, 16, torch.float32, CPU)
    assert store.num_blocks == 1 and store.k.shape[0] == 1
