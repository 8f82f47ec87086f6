"""Greedy generation through the hand-off is exact: a prompt prefilled by a CP worker
of degree 2 or 3 (real rank processes, gloo), its KV pulled over HTTP by the decode
server's client and decoded by its engine, gives transformers' ``generate(do_sample=
False)`` ids on the checkpoint the test saved: a fresh prompt and one whose prefix
the worker had cached, for a dense Qwen3 and a Qwen3-MoE checkpoint. (Degree 1, the
decode process and a stock OpenAI client: ``tests/e2e/test_decode.py``.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import transformers
from aiohttp import web

from support.factories import engine_config, make_profile, make_tokens
from support.reference import VOCAB, hf_greedy, make_hf_model, make_hf_moe
from vertumnus.config import ModelConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.decode.engine import DecodeEngine
from vertumnus.decode.kv_pull import pull
from vertumnus.engine.weights import load_model
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.protocol.sampling_params import SamplingParams
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.server.app import build_app
from vertumnus.server.keys import ADDRESS

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("no_leftover_ranks")]
NEW_TOKENS = 10


def reference(hf: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    return hf_greedy(hf, prompt, NEW_TOKENS)


async def generate(
    coord: Coordinator, base: str, decoder: DecodeEngine, model: ModelConfig, prompt: list[int]
) -> tuple[list[int], int]:
    """Prefill with a hand-off, pull, decode greedily: the new ids and the tokens the
    prefill reused from the worker's cache."""
    result = await coord.prefill(prompt, handoff=True)
    assert result.handoff is not None
    pulled = await pull(base, result.handoff.handle, coord.handoffs.secret, model=model)
    assert pulled.header.num_tokens == len(prompt) - 1
    decoder.add(1, pulled.kv, prompt[-1], SamplingParams(temperature=0.0), NEW_TOKENS)
    ids: list[int] = []
    while len(decoder):
        ids += [out.token_id for out in decoder.step()]
    return ids, result.cached_tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "cp"), [("dense", 2), ("dense", 3), ("moe", 2)])
def test_greedy_ids_equal_transformers(tmp_path: Path, kind: str, cp: int) -> None:
    hf = make_hf_model(tie_word_embeddings=False) if kind == "dense" else make_hf_moe()
    folder = tmp_path / "checkpoint"
    hf.save_pretrained(folder)
    profile = tmp_path / "profile.json"
    coeffs = {cp: DegreeCoeffs(d=0.004, c=3e-5, alpha=3e-8)}
    make_profile(coeffs, {cp: 10.0}, model="checkpoint", hardware="cpu").save(profile)
    cfg = ServeConfig(
        model=str(folder),
        pool=PoolConfig((cp,), (cp,)),
        engine=engine_config(),
        profile=str(profile),
        policy=PolicyConfig(adaptive=False, replication=False),
    )
    model_cfg = ModelConfig.from_dir(folder)
    decoder = DecodeEngine(load_model(model_cfg, folder, torch.float32, torch.device("cpu")))

    async def main() -> None:
        coord = Coordinator(cfg)
        await coord.start()
        app = build_app(coord, Tokenizer.for_model(str(folder), model_cfg.vocab_size))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        try:
            await site.start()
            port = runner.addresses[0][1]
            app[ADDRESS].extend(["127.0.0.1", port])
            base = f"http://127.0.0.1:{port}"
            shared = make_tokens(53, seed=cp, vocab=VOCAB)
            fresh, cached = await generate(coord, base, decoder, model_cfg, [*shared, 7, 8])
            assert cached == 0 and fresh == reference(hf, [*shared, 7, 8])
            again, cached = await generate(coord, base, decoder, model_cfg, [*shared, 9])
            assert cached == 48 and again == reference(hf, [*shared, 9])
            assert coord.handoffs.view()["open"] == 0
        finally:
            await runner.cleanup()
            await coord.close()

    asyncio.run(main())
