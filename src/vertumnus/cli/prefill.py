"""``python -m vertumnus prefill``: one worker of C ranks, one (or two) prefills.

With ``--prefix-len P`` the first P tokens are prefilled first as a request of their
own (caching their whole blocks); then the whole sequence is prefilled reusing that
cache. Both times are of the warm path: the same prefills run first on another prompt
of the same lengths (no block in common), so that one-time costs (the compiled layers'
first call, a kernel's first use) are in neither. Prints one JSON object on stdout;
``--check`` adds ``max_abs_diff`` against a single-process reference (the same model,
plain causal attention over the whole sequence, no cache; DeepSeek-V4: its own model
at C = 1, which the tests hold against transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vertumnus.config import ConfigError, EngineConfig, resolve_model

if TYPE_CHECKING:
    from vertumnus.runtime.prefill import PrefillClient, PrefillOutcome

_DEFAULTS = EngineConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="tiny",
        help="built-in preset (tiny, qwen3-0.6b-4l) or a Hugging Face folder "
        "with config.json and *.safetensors (default: tiny)",
    )
    p.add_argument("--cp", type=int, default=1, metavar="C", help="CP degree (default: 1)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens-file", type=Path, metavar="F.json", help="a JSON list of token ids")
    src.add_argument(
        "--prompt-len", type=int, metavar="N", help="N random token ids drawn from --seed"
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        metavar="P",
        help="prefill the first P tokens first, then the whole sequence",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=_DEFAULTS.block_size,
        metavar="B",
        help=f"tokens per KV block (default: {_DEFAULTS.block_size})",
    )
    p.add_argument(
        "--kv-blocks-per-rank",
        type=int,
        default=_DEFAULTS.kv_blocks_per_rank,
        help=f"KV cache capacity per rank (default: {_DEFAULTS.kv_blocks_per_rank})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=_DEFAULTS.seed,
        help="seed of the random weights and random prompt (default: 0)",
    )
    p.add_argument("--device", default=_DEFAULTS.device, choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--dtype", default=_DEFAULTS.dtype, choices=("auto", "float32", "bfloat16", "float16")
    )
    p.add_argument(
        "--compile",
        default=_DEFAULTS.compile,
        choices=("auto", "on", "off"),
        help="compile the ranks' layers at start, as serve does (default: auto)",
    )
    p.add_argument(
        "--cpu-attention",
        default=_DEFAULTS.cpu_attention,
        choices=("auto", "flash", "chunked"),
        help="a CPU rank's attention kernel, as serve picks it (default: auto)",
    )
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="intra-op threads per CPU rank (default: cores / ranks)",
    )
    p.add_argument(
        "--dump-logits",
        type=Path,
        metavar="OUT.npy",
        help="write float32 logits [computed_tokens, vocab] of the last prefill",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="also run a single-process reference and print max_abs_diff",
    )


def _read_tokens(args: argparse.Namespace, vocab_size: int) -> list[int]:
    if args.tokens_file is not None:
        try:
            tokens = json.loads(args.tokens_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--tokens-file {args.tokens_file}: {exc}") from exc
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise ConfigError(
                f"--tokens-file {args.tokens_file}: expected a JSON list of integer token ids"
            )
    else:
        if args.prompt_len <= 0:
            raise ConfigError(f"--prompt-len must be positive, got {args.prompt_len}")
        import random

        rng = random.Random(args.seed)
        tokens = [rng.randrange(vocab_size) for _ in range(args.prompt_len)]
    if not tokens:
        raise ConfigError("the prompt is empty: a prefill needs at least one token")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return tokens


def run(args: argparse.Namespace) -> int:
    cfg, model_dir = resolve_model(args.model)
    engine = EngineConfig(
        block_size=args.block_size,
        kv_blocks_per_rank=args.kv_blocks_per_rank,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
        cpu_attention=args.cpu_attention,
        threads_per_rank=args.threads_per_rank,
        seed=args.seed,
    )
    if args.cp < 1:
        raise ConfigError(f"--cp must be >= 1, got {args.cp}")
    tokens = _read_tokens(args, cfg.vocab_size)
    if not 0 <= args.prefix_len <= len(tokens):
        raise ConfigError(f"--prefix-len must be in [0, {len(tokens)}], got {args.prefix_len}")
    uncached = cfg.block_cache_problem(args.block_size)
    if args.prefix_len and uncached is not None:
        raise ConfigError(f"--prefix-len: {uncached}")
    if len(tokens) > cfg.max_position_embeddings:
        raise ConfigError(
            f"{len(tokens)} tokens exceed the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    if args.dump_logits is not None and not args.dump_logits.parent.is_dir():
        raise ConfigError(
            f"--dump-logits {args.dump_logits}: no directory {args.dump_logits.parent}"
        )

    # Heavy imports only once the arguments are known to be good.
    from vertumnus.runtime.prefill import PrefillClient
    from vertumnus.runtime.ranks import ChildRanks

    want = "all" if (args.dump_logits is not None or args.check) else "last"
    # The reference first, in this process alone: computed after the ranks, under a
    # busy machine it came out different (0.003 against 4.6e-5) while the ranks' logits
    # did not.
    reference = _reference(cfg, model_dir, engine, tokens) if args.check else None
    with ChildRanks(cfg, model_dir, engine, world_size=args.cp, degrees=[args.cp]) as ranks:
        worker = PrefillClient(ranks, tuple(range(args.cp)))
        warm_up = [(t + 1) % cfg.vocab_size for t in tokens]  # the same lengths, other blocks
        _prefills(worker, warm_up, args.prefix_len, want)
        prefix_s, out = _prefills(worker, tokens, args.prefix_len, want)
        device = ranks.ready[0].device
    result: dict[str, Any] = {
        "model": cfg.name,
        "cp_degree": args.cp,
        "device": device,
        "prompt_tokens": len(tokens),
        "block_size": engine.block_size,
        "cached_tokens": out.cached_tokens,
        "computed_tokens": out.computed_tokens,
        "first_token": out.first_token,
        "prefill_s": round(out.prefill_s, 6),
        "prefix_prefill_s": None if prefix_s is None else round(prefix_s, 6),
        "collectives_per_rank": out.collectives,
    }
    if out.expert_tokens is not None:
        # The last prefill's (token, expert) assignments per expert, by sparse layer.
        result["expert_tokens"] = {str(k): v for k, v in out.expert_tokens.items()}
    if args.dump_logits is not None:
        import numpy as np

        try:  # through a file object: np.save would append .npy to another name
            with open(args.dump_logits, "wb") as f:
                np.save(f, out.logits.numpy().astype(np.float32))
        except OSError as exc:
            raise ConfigError(f"--dump-logits {args.dump_logits}: {exc}") from exc
        result["logits_file"] = str(args.dump_logits)
    if reference is not None:
        ref = reference[out.cached_tokens :]
        result["max_abs_diff"] = float((ref - out.logits).abs().max())
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


def _prefills(
    worker: PrefillClient, tokens: list[int], prefix_len: int, logits: str
) -> tuple[float | None, PrefillOutcome]:
    """The prefix's prefill time (None without a prefix), then the whole sequence's
    outcome, reusing the prefix's cached blocks."""
    prefix_s = worker.prefill(tokens[:prefix_len]).prefill_s if prefix_len else None
    return prefix_s, worker.prefill(tokens, logits=logits)


def _reference(cfg: Any, model_dir: str | None, engine: EngineConfig, tokens: list[int]) -> Any:
    """The reference's logits of every position: the same model in one process, plain
    causal attention over the whole sequence, no cache."""
    import torch

    from vertumnus.engine.model import causal_attention
    from vertumnus.engine.rank import resolve_device
    from vertumnus.engine.weights import build_model, resolve_dtype

    device = resolve_device(engine, 0)
    model = build_model(cfg, model_dir, engine.seed, resolve_dtype(engine.dtype, device), device)
    if cfg.dsv4 is not None:  # its own model, at C = 1: nothing crosses ranks
        from vertumnus.engine.comm import SoloComm
        from vertumnus.engine.dsv4.model import prefill_rank

        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        return prefill_rank(model, SoloComm(), ids, logits="all").cpu()  # type: ignore[arg-type,union-attr]
    with torch.inference_mode():
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        hidden = model(ids, torch.arange(len(tokens), device=device), causal_attention())
        return model.logits(hidden).cpu()
