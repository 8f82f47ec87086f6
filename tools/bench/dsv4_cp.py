"""DeepSeek-V4 under partitioned zigzag CP: what a rank receives against an all-gather
of the raw KV, and the engine's per-core speed against transformers.

``--bytes`` (on by default): a random DeepSeek-V4 with V4-Flash's attention dimensions
where they set what crosses ranks (head_dim 512, indexer keys of 128, window 128, CSA
ratio 4, HCA ratio 128) and the rest small (hidden 128, 2 query heads, 2 index heads, 4
experts), three layers (sliding, CSA, HCA), one prefill of ``--tokens`` (16,384) tokens
at C = ``--cp`` (2, 4, 8; ranks as threads, ``engine/comm.ThreadComm`` counts the
elements each rank receives, attributed here to the layer whose ``halo`` opened it).
Per layer kind and tag (``halo``, ``comp``; ``out``, the final hidden states every
model gathers, shown apart): elements received per rank (max and mean over ranks),
against an all-gather of every layer's raw KV, ``(C-1)/C x padded tokens x 512`` per
layer (V4's K and V are one tensor of ``head_dim``, so the raw KV is 512 values per
token per layer). Then per-kind per-layer figures combined over DeepSeek-V4-Flash's
43 layers (transformers' ``DeepseekV4Config().layer_types``). Target: at most 1/3 of
the all-gather at C = 4. Bytes are at bf16 (2 per element); counted, not timed.

``--cache`` (on by default): the same model served as the pool serves it, from
a worker's cache index and 128-token blocks (``engine/dsv4/blocks.py``): a prompt of
``--tokens`` that stores every whole block (the ``blocks`` all-to-all carries each
block's tail to the rank storing it), then a prompt sharing its first half that
resumes it (the ``prefix`` all-gather of the cached blocks' facts; the prefix's
tokens after its last block that keeps its raw rows are computed again) and stores
the rest. Per prefill, elements received per rank (max over ranks) by tag, against an
all-gather of the raw KV of every token of the prompt, cached ones included (what a
shared-decoder worker gathers per full-attention layer), over the 3 layers.

``--speed``: one thread, C = 1 (``SoloComm``): the engine's ``prefill_rank`` (last
logits) against transformers' ``DeepseekV4ForCausalLM`` forward (eager, no cache,
``logits_to_keep=1``) on the same seeded weights (transformers writes the folder, the
engine loads it), hidden 256, 4 layers (sliding, CSA, HCA, CSA), 8 heads of 128, 8
experts top 2, at ``--lengths`` (2,048, 8,192), ``--dtypes``; one warm-up, then the
median of ``--repeats``, alternating. Ratio = transformers / engine (target >= 1).
``--profile`` adds a cProfile of one engine prefill (the top functions).

Run::

    .venv/bin/python -m tools.bench.dsv4_cp                       # bytes, C = 2, 4, 8
    .venv/bin/python -m tools.bench.dsv4_cp --no-bytes --cp 4     # --cache alone, C = 4
    .venv/bin/python -m tools.bench.dsv4_cp --no-bytes --speed --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import torch
import transformers
from torch import Tensor

from vertumnus.blocks import block_ids
from vertumnus.config import ModelConfig
from vertumnus.engine.comm import SoloComm, ThreadComm, ThreadGroup
from vertumnus.engine.dsv4.blocks import keeps_raw_rows
from vertumnus.engine.dsv4.load import load_dsv4, random_dsv4, seed_tensors
from vertumnus.engine.dsv4.model import DeepseekV4LM, command_rank, partition_of, prefill_rank
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.policy.cache.index import WorkerCacheIndex
from vertumnus.runtime.prefill import plan_prefill

KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA",
         "heavily_compressed_attention": "HCA"}  # fmt: skip
TARGET = 1 / 3
RAW_KV = 512  # V4's shared K = V per token per layer: one vector of head_dim


def hf_config(**fields: Any) -> transformers.DeepseekV4Config:
    cfg = transformers.DeepseekV4Config(**fields)
    cfg._attn_implementation = "eager"
    return cfg


def bytes_config() -> ModelConfig:
    cfg = hf_config(
        vocab_size=1024, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, head_dim=512, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=128,
        index_topk=512, sliding_window=128, layer_types=list(KINDS),
        mlp_layer_types=["moe"] * 3, hc_mult=4,
    )  # fmt: skip
    raw = cfg.to_dict() | {"architectures": ["DeepseekV4ForCausalLM"]}
    return ModelConfig.from_hf_dict(raw, name="dsv4-bytes")


class LayerComm:
    """A rank's ``ThreadComm`` that also files what it receives under the layer whose
    ``halo`` all-to-all came last (-1 before the first, the last layer for ``out``)."""

    def __init__(self, inner: ThreadComm) -> None:
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.calls, self.received = inner.calls, inner.received
        self.layer = -1
        self.by: Counter[tuple[int, str]] = Counter()

    def _file(self, tag: str, before: int) -> None:
        self.by[(self.layer, tag)] += self.received[tag] - before

    def all_gather(self, t: Tensor, tag: str) -> Tensor:
        before = self.received[tag]
        out: Tensor = self.inner.all_gather(t, tag)
        self._file(tag, before)
        return out

    def all_to_all(self, send: list[Tensor], recv_rows: list[int], tag: str) -> list[Tensor]:
        self.layer += tag == "halo"
        before = self.received[tag]
        out: list[Tensor] = self.inner.all_to_all(send, recv_rows, tag)
        self._file(tag, before)
        return out


def run_cp(model: DeepseekV4LM, ids: Tensor, c: int) -> list[LayerComm]:
    return run_threads(c, lambda r, comm: prefill_rank(model, comm, ids))


def run_threads(c: int, work: Any) -> list[LayerComm]:
    """``work(rank, comm)`` on C threads; their comms."""
    group = ThreadGroup(c)
    comms = [LayerComm(group.comm(r)) for r in range(c)]
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            work(r, comms[r])
        except BaseException as exc:
            errors.append(exc)
            group._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return comms


def bench_bytes(args: argparse.Namespace) -> None:
    cfg = bytes_config()
    model = random_dsv4(cfg, seed=0, dtype=getattr(torch, args.dtype))
    types = list(KINDS.values())
    flash = Counter(KINDS[t] for t in transformers.DeepseekV4Config().layer_types or [])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=gen)
    print(f"--bytes: {args.tokens} tokens, {args.dtype}, layers {types}; elements received "
          f"per rank (max / mean over ranks); bf16 MiB = 2 bytes per element")  # fmt: skip
    print(f"V4-Flash's 43 layers (transformers' default layer_types): {dict(flash)}")
    for c in args.cp:
        began = time.perf_counter()
        comms = run_cp(model, ids, c)
        padded = partition_of(model, args.tokens, c).padded_len
        gather = (c - 1) * padded // c * RAW_KV  # raw-KV all-gather, per layer
        print(f"\nC={c} (padded {padded} tokens, {time.perf_counter() - began:.0f} s): raw-KV "
              f"all-gather per layer {gather} elements ({2 * gather / 2**20:.2f} MiB)")  # fmt: skip
        print(f"  {'layer':8} {'tag':5} {'max':>10} {'mean':>12} {'MiB max':>8} {'/ gather':>9}")
        per_kind: dict[str, float] = {}
        for i, kind in enumerate(types):
            tags = ("halo", "comp", "out") if i == len(types) - 1 else ("halo", "comp")
            for tag in tags:
                got = [comm.by[(i, tag)] for comm in comms]
                print(f"  {kind:8} {tag:5} {max(got):>10} {statistics.mean(got):>12.1f} "
                      f"{2 * max(got) / 2**20:>8.2f} {max(got) / gather:>9.4f}")  # fmt: skip
            kv = [comm.by[(i, "halo")] + comm.by[(i, "comp")] for comm in comms]
            per_kind[kind] = max(kv)
            print(f"  {kind:8} {'KV':5} {max(kv):>10} {statistics.mean(kv):>12.1f} "
                  f"{2 * max(kv) / 2**20:>8.2f} {max(kv) / gather:>9.4f}  "
                  f"-> {max(kv) / gather / TARGET:.3f} of the 1/3 target")  # fmt: skip
        total = [sum(comm.by[(i, t)] for i in range(3) for t in ("halo", "comp")) for comm in comms]
        print(f"  3 layers KV: max {max(total)}, ratio {max(total) / (3 * gather):.4f} "
              f"({max(total) / (3 * gather) / TARGET:.3f} of target)")  # fmt: skip
        mix = sum(n * per_kind[k] for k, n in flash.items())
        ratio = mix / (sum(flash.values()) * gather)
        print(f"  V4-Flash mix, KV per rank (max per kind, summed): {mix:.0f} elements "
              f"({2 * mix / 2**20:.1f} MiB bf16) vs all-gather {sum(flash.values()) * gather} "
              f"-> ratio {ratio:.4f}, {ratio / TARGET:.3f} of the 1/3 target")  # fmt: skip
        out = max(comm.by[(2, "out")] for comm in comms)
        print(f"  out (not KV): {out} elements at hidden {cfg.hidden_size}; at V4-Flash's "
              f"4096: {out * 4096 // cfg.hidden_size}")  # fmt: skip


def bench_cache(args: argparse.Namespace) -> None:
    cfg = bytes_config()
    dtype = getattr(torch, args.dtype)
    model = random_dsv4(cfg, seed=0, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=gen).tolist()
    half = args.tokens // 2
    second = first[:half] + torch.randint(0, cfg.vocab_size, (half,), generator=gen).tolist()
    print(
        "\n--cache: 128-token blocks; elements received per rank (max over ranks); "
        "'/ gather': against all-gathering the raw KV of the whole prompt in 3 layers"
    )
    for c in args.cp:
        blocks = args.tokens // 128 // c + 2
        index = WorkerCacheIndex(c, blocks)
        stores = [PagedKVStore(cfg, blocks, 128, dtype, torch.device("cpu")) for _ in range(c)]
        for name, tokens in (("stores its blocks", first), ("resumes half", second)):
            allocation, cmd = plan_prefill(index, tokens, 128, 0, tuple(range(c)),
                                           prefix_ids=True)  # fmt: skip
            comms = run_threads(c, lambda r, comm, cmd=cmd, stores=stores: command_rank(
                model, comm, stores[r], cmd, cmd.token_ids))  # fmt: skip
            index.commit(allocation)
            gather = 3 * (c - 1) * len(tokens) // c * RAW_KV
            tags = ("prefix", "halo", "comp")
            got = {t: max(comm.received[t] for comm in comms) for t in tags}
            total = max(sum(comm.received[t] for t in tags) for comm in comms)
            shown = ", ".join(f"{t} {n}" for t, n in got.items())
            path = index.match(block_ids(tokens, 128))  # the prompt's blocks, by depth
            marks = [keeps_raw_rows(stores[loc.rank], loc.slot) for loc in path]
            # A hit of n blocks resumes after its last marked block: the rest is computed.
            again = [128 * (n - max((d + 1 for d in range(n) if marks[d]), default=0))
                     for n in range(1, len(marks) + 1)]  # fmt: skip
            shown += (
                f"; a later hit of n = 1..{len(marks)} of its blocks computes again "
                f"{statistics.mean(again):.0f} tokens on average, {max(again)} at most"
            )
            print(f"  C={c} {name:17} (cached {cmd.prefix_len:>5}): {shown}; total {total} "
                  f"/ gather {gather} = {total / gather:.4f} "
                  f"({total / gather / TARGET:.3f} of the 1/3 target)")  # fmt: skip


def speed_model(seed: int = 5) -> Any:
    cfg = hf_config(
        vocab_size=1024, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, head_dim=128, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        n_routed_experts=8, num_experts_per_tok=2, index_n_heads=4, index_head_dim=32,
        index_topk=64, sliding_window=128, hc_mult=4,
        layer_types=[*KINDS, "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    )  # fmt: skip
    model: Any = transformers.DeepseekV4ForCausalLM(cfg)
    model = model.float().eval()
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    seed_tensors(named, cfg.n_routed_experts, seed)
    return model


def bench_speed(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        speed_model().save_pretrained(folder)
        cfg = ModelConfig.from_dir(folder)
        print(f"\n--speed: 1 thread, C = 1, median of {args.repeats} after a warm-up (ms)")
        print(f"  {'dtype':9} {'tokens':>6} {'transformers':>13} {'engine':>9} {'ratio':>6}"
              f" {'max |dl|':>9}")  # fmt: skip
        for name in args.dtypes:
            dtype = getattr(torch, name)
            theirs: Any = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=dtype)
            theirs.config._attn_implementation = "eager"
            theirs.eval()
            ours = load_dsv4(cfg, folder, dtype, torch.device("cpu"))
            for length in args.lengths:
                gen = torch.Generator().manual_seed(length)
                ids = torch.randint(0, cfg.vocab_size, (length,), generator=gen)
                t, e, diff = time_pair(theirs, ours, ids, args.repeats)
                print(f"  {name:9} {length:>6} {t * 1e3:>13.0f} {e * 1e3:>9.0f} {t / e:>6.2f}"
                      f" {diff:>9.2e}")  # fmt: skip
                if args.profile:
                    prof = cProfile.Profile()
                    with torch.inference_mode():
                        prof.runcall(prefill_rank, ours, SoloComm(), ids, "last")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


def time_pair(
    theirs: Any, ours: DeepseekV4LM, ids: Tensor, repeats: int
) -> tuple[float, float, float]:
    """Median seconds of transformers' forward and the engine's prefill, alternating,
    after one warm-up of each; and the largest |difference| of their last logits."""
    times: list[list[float]] = [[], []]
    diff = 0.0
    with torch.inference_mode():
        for i in range(repeats + 1):
            began = time.perf_counter()
            ref = theirs(ids[None], use_cache=False, logits_to_keep=1).logits[0, -1].float()
            times[0].append(time.perf_counter() - began)
            began = time.perf_counter()
            got = prefill_rank(ours, SoloComm(), ids, logits="last")
            times[1].append(time.perf_counter() - began)
            if i == 0 and got is not None:
                diff = float((got[0] - ref).abs().max())
    return statistics.median(times[0][1:]), statistics.median(times[1][1:]), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--cp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2048, 8192])  # fmt: skip
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, help="top N functions, cProfile")
    args = parser.parse_args()
    if args.bytes:
        bench_bytes(args)
    if args.cache:
        bench_cache(args)
    if args.speed:
        bench_speed(args)


if __name__ == "__main__":
    main()
