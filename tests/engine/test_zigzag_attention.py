"""Zigzag CP prefill on C threads of one process against single-process references.

Each test runs the C ranks of one worker as threads sharing a ``ThreadGroup``; slots
for cached and new blocks come from ``WorkerCacheIndex`` + ``plan_prefill``, as in
production. References: ``model(ids, positions, causal_attention())`` over the whole
sequence (logits and per-layer K/V), and ``causal_attention`` itself for the
attention-only tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from support.factories import BLOCK_SIZE, TINY, make_tokens
from support.threads import BLOCKS_PER_RANK, ThreadWorker, cp_prefill, make_stores, run_ranks
from vertumnus.blocks import block_ids
from vertumnus.engine import attention
from vertumnus.engine.comm import Communicator, SoloComm, ThreadComm
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.model import CausalLM, causal_attention
from vertumnus.engine.zigzag import RankPrefill, ZigzagAttention, ZigzagPartition, prefill_rank
from vertumnus.policy.cache.index import BlockLocation, WorkerCacheIndex
from vertumnus.runtime.prefill import plan_prefill

LOGITS_ATOL = 1e-4  # fp32
KV_ATOL = 1e-5  # fp32 K/V stored in the cache vs the reference's
PREFIX_LEN = 80  # 5 blocks: uneven shares for C = 2, 3, 4


# -- references and checks (the rank threads: support/threads.py) -------------------


class RecordingAttention:
    """``causal_attention()`` that also keeps every layer's post-RoPE k and v."""

    def __init__(self) -> None:
        self.inner = causal_attention()
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        self.kv[layer] = (k.clone(), v.clone())
        return self.inner(layer, q, k, v, window, sinks)


@torch.no_grad()
def reference(model: CausalLM, tokens: Sequence[int]) -> tuple[Tensor, RecordingAttention]:
    """Logits [L, V] of every position and the per-layer K/V, single process."""
    rec = RecordingAttention()
    ids = torch.tensor(tokens, dtype=torch.long)
    hidden = model(ids, torch.arange(len(tokens)), rec)
    return model.logits(hidden), rec


def assert_blocks_match(
    worker: ThreadWorker, locs: Sequence[BlockLocation], rec: RecordingAttention
) -> None:
    """The KV of every block in ``locs`` sits at its slot on rank depth % C and equals
    the reference's K/V of that block's tokens in every layer."""
    c = worker.index.cp_degree
    for loc in locs:
        assert loc.rank == loc.depth % c
        rows = slice(loc.depth * BLOCK_SIZE, (loc.depth + 1) * BLOCK_SIZE)
        store = worker.stores[loc.rank]
        for layer, (k, v) in rec.kv.items():
            torch.testing.assert_close(store.k[loc.slot, layer], k[rows], rtol=0, atol=KV_ATOL)
            torch.testing.assert_close(store.v[loc.slot, layer], v[rows], rtol=0, atol=KV_ATOL)


def written_slots(store: PagedKVStore) -> set[int]:
    """Slots of ``store`` holding anything but the zeros it starts with."""
    used = (store.k != 0).flatten(1).any(1) | (store.v != 0).flatten(1).any(1)
    return {int(s) for s in used.nonzero().flatten()}


def expected_calls() -> Counter[str]:
    """Exactly one K/V all-gather per layer and one all-gather of the outputs."""
    return Counter({"kv": TINY.num_hidden_layers, "out": 1})


def suffix_lengths(c: int) -> list[int]:
    # 1 (all but one token is padding); 2C-1 (one padding token); odd; block multiples;
    # 7C, not a multiple of 2C (C padding tokens).
    return sorted({1, 2 * c - 1, 37, 16, 48, 7 * c})


CASES = [(c, r) for c in (1, 2, 3, 4) for r in suffix_lengths(c)]


def test_harness_propagates_a_rank_failure_without_hanging() -> None:
    def body(rank: int, comm: ThreadComm) -> Tensor:
        if rank == 1:
            raise RuntimeError("rank 1 failed")
        return comm.all_gather(torch.zeros(2), tag="kv")  # would wait for rank 1 forever

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_ranks(3, body)


# -- whole-model logits --------------------------------------------------------------


@pytest.mark.parametrize(("c", "r"), CASES)
def test_cp_logits_match_reference_without_prefix(tiny_model: CausalLM, c: int, r: int) -> None:
    tokens = make_tokens(r, seed=1000 + r)
    worker = ThreadWorker.make(c)
    res = cp_prefill(tiny_model, worker, tokens)
    assert res.cmd.prefix_len == 0
    ref, _ = reference(tiny_model, tokens)
    assert res.logits.shape == (r, TINY.vocab_size)
    assert res.logits.dtype == torch.float32
    torch.testing.assert_close(res.logits, ref, rtol=0, atol=LOGITS_ATOL)
    assert res.calls == [expected_calls()] * c


@pytest.mark.parametrize(("c", "r"), CASES)
def test_cp_logits_match_reference_with_cached_prefix(tiny_model: CausalLM, c: int, r: int) -> None:
    tokens = make_tokens(PREFIX_LEN + r, seed=2000 + r)
    worker = ThreadWorker.make(c)
    first = cp_prefill(tiny_model, worker, tokens[:PREFIX_LEN])
    assert [loc.depth for loc in first.allocation.new] == list(range(PREFIX_LEN // BLOCK_SIZE))
    assert first.calls == [expected_calls()] * c

    res = cp_prefill(tiny_model, worker, tokens)
    assert res.cmd.prefix_len == PREFIX_LEN
    assert res.allocation.reused == first.allocation.new
    assert res.cmd.token_ids.tolist() == tokens[PREFIX_LEN:]
    ref, _ = reference(tiny_model, tokens)
    assert res.logits.shape == (r, TINY.vocab_size)
    torch.testing.assert_close(res.logits, ref[PREFIX_LEN:], rtol=0, atol=LOGITS_ATOL)
    # The prefix travels inside the same per-layer all-gather: no extra collectives.
    assert res.calls == [expected_calls()] * c


@pytest.mark.parametrize("c", [1, 3])
def test_the_chunked_cpu_kernel_gives_the_reference_logits(
    tiny_model: CausalLM, c: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose model picked the chunked CPU attention (``pick_cpu_kernel``):
    blocks of 16 rows, a cached prefix, every rank's two zigzag ranges."""
    monkeypatch.setattr(attention, "CHUNK_ROWS", 16)
    monkeypatch.setattr(tiny_model, "cpu_attention", "chunked")
    calls: list[int] = []
    chunked = attention._chunked

    def counted(*args: object) -> Tensor:
        calls.append(1)
        return chunked(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "_chunked", counted)
    r = 150
    tokens = make_tokens(PREFIX_LEN + r, seed=3000 + c)
    worker = ThreadWorker.make(c)
    cp_prefill(tiny_model, worker, tokens[:PREFIX_LEN])
    res = cp_prefill(tiny_model, worker, tokens)
    assert res.cmd.prefix_len == PREFIX_LEN
    ref, _ = reference(tiny_model, tokens)
    torch.testing.assert_close(res.logits, ref[PREFIX_LEN:], rtol=0, atol=LOGITS_ATOL)
    # Once per layer and query range of each rank, in both prefills.
    ranges = sum(len(ZigzagPartition(n, c).ranges(k)) for n in (PREFIX_LEN, r) for k in range(c))
    assert len(calls) == TINY.num_hidden_layers * ranges


@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_conversation_reuses_and_extends_the_cache(tiny_model: CausalLM, c: int) -> None:
    # Three turns of one conversation; turn 1 ends mid-block, so turn 2 recomputes the
    # tail of block 2 and writes blocks after a prefix; turn 3 reuses both turns.
    tokens = make_tokens(150, seed=3)
    worker = ThreadWorker.make(c)
    ref, rec = reference(tiny_model, tokens)
    cached: list[BlockLocation] = []
    for length, prefix_len in ((40, 0), (100, 32), (150, 96)):
        res = cp_prefill(tiny_model, worker, tokens[:length])
        assert res.cmd.prefix_len == prefix_len
        assert res.allocation.reused == cached
        assert [loc.depth for loc in res.allocation.new] == list(
            range(prefix_len // BLOCK_SIZE, length // BLOCK_SIZE)
        )
        torch.testing.assert_close(res.logits, ref[prefix_len:length], rtol=0, atol=LOGITS_ATOL)
        assert res.calls == [expected_calls()] * c
        cached = cached + res.allocation.new
    # Every block of the conversation (9 full blocks), each where the index put it.
    assert [loc.depth for loc in cached] == list(range(150 // BLOCK_SIZE))
    assert_blocks_match(worker, cached, rec)


def test_fully_cached_sequence_recomputes_its_last_block(tiny_model: CausalLM) -> None:
    # 64 tokens = 4 whole blocks, all cached: the last token must still be computed, so
    # only 3 blocks are reused and the last block (already cached) is not written again.
    c = 2
    tokens = make_tokens(64, seed=4)
    worker = ThreadWorker.make(c)
    cp_prefill(tiny_model, worker, tokens)
    res = cp_prefill(tiny_model, worker, tokens)
    assert res.cmd.prefix_len == 48
    assert res.allocation.new == []
    ref, _ = reference(tiny_model, tokens)
    torch.testing.assert_close(res.logits, ref[48:], rtol=0, atol=LOGITS_ATOL)


def test_last_logits_equal_last_row_of_all(tiny_model: CausalLM) -> None:
    c, tokens = 3, make_tokens(45, seed=5)
    _, cmd = plan_prefill(WorkerCacheIndex(c, 0), tokens, BLOCK_SIZE, 0, (0, 1, 2), "last")
    outs, comms = run_ranks(
        c, lambda r, comm: prefill_rank(tiny_model, comm, None, cmd.for_rank(r), logits="last")
    )
    ref, _ = reference(tiny_model, tokens)
    assert outs[0].shape == (1, TINY.vocab_size)
    assert outs[1:] == [None, None]
    torch.testing.assert_close(outs[0], ref[-1:], rtol=0, atol=LOGITS_ATOL)
    assert [comm.calls for comm in comms] == [expected_calls()] * c


# -- the KV blocks a prefill stores --------------------------------------------------


@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_stored_prefix_blocks_equal_reference_kv(tiny_model: CausalLM, c: int) -> None:
    tokens = make_tokens(PREFIX_LEN + 9, seed=6)  # 5 full blocks and a partial one
    worker = ThreadWorker.make(c)
    res = cp_prefill(tiny_model, worker, tokens)
    num_blocks = PREFIX_LEN // BLOCK_SIZE
    ids = block_ids(tokens, BLOCK_SIZE)
    assert [loc.block_id for loc in res.allocation.new] == ids
    assert [loc.depth for loc in res.allocation.new] == list(range(num_blocks))
    # Spread over ranks as depth % C, in slots 0, 1, ... of each rank.
    assert [loc.rank for loc in res.allocation.new] == [d % c for d in range(num_blocks)]
    assert [loc.slot for loc in res.allocation.new] == [d // c for d in range(num_blocks)]
    assert res.cmd.write == tuple(
        tuple((d, d // c) for d in range(num_blocks) if d % c == r) for r in range(c)
    )
    _, rec = reference(tiny_model, tokens)
    assert sorted(rec.kv) == list(range(TINY.num_hidden_layers))
    assert_blocks_match(worker, res.allocation.new, rec)
    # Each rank wrote its own blocks and nothing else.
    for rank, store in enumerate(worker.stores):
        assert written_slots(store) == {loc.slot for loc in res.allocation.new if loc.rank == rank}


# -- attention alone, on random q/k/v -----------------------------------------------


def scatter_prefix(
    c: int, prefix_k: Tensor, prefix_v: Tensor, layers: int
) -> tuple[list[PagedKVStore], list[tuple[int, ...]]]:
    """Write prefix K/V into per-rank stores, block at depth j on rank j % C, at slots
    in descending order (so slot order differs from depth order)."""
    num_blocks = prefix_k.shape[1] // BLOCK_SIZE
    stores = make_stores(c)
    slots: list[list[int]] = [[] for _ in range(c)]
    for depth in range(num_blocks):
        rank = depth % c
        slot = BLOCKS_PER_RANK - 1 - len(slots[rank])
        rows = slice(depth * BLOCK_SIZE, (depth + 1) * BLOCK_SIZE)
        for layer in range(layers):
            stores[rank].write([slot], layer, prefix_k[layer, rows], prefix_v[layer, rows])
        slots[rank].append(slot)
    return stores, [tuple(s) for s in slots]


@pytest.mark.parametrize("c", [1, 2, 3, 4])
@pytest.mark.parametrize("prefix_blocks", [0, 1, 5])
@pytest.mark.parametrize("r", [1, 7, 33])
def test_zigzag_attention_matches_causal_attention(c: int, prefix_blocks: int, r: int) -> None:
    gen = torch.Generator().manual_seed(100 * c + 10 * prefix_blocks + r)
    layers, hq, hkv, d = (
        TINY.num_hidden_layers,
        TINY.num_attention_heads,
        TINY.num_key_value_heads,
        TINY.head_dim,
    )
    p = prefix_blocks * BLOCK_SIZE
    q = torch.randn(r, hq, d, generator=gen)
    k = torch.randn(r, hkv, d, generator=gen)
    v = torch.randn(r, hkv, d, generator=gen)
    prefix_k = torch.randn(layers, p, hkv, d, generator=gen)
    prefix_v = torch.randn(layers, p, hkv, d, generator=gen)
    stores, slots = scatter_prefix(c, prefix_k, prefix_v, layers)
    layer = layers - 1
    part = ZigzagPartition(r, c)

    def body(rank: int, comm: ThreadComm) -> Tensor:
        step = RankPrefill(
            token_ids=torch.zeros(r, dtype=torch.long),
            prefix_len=p,
            prefix_slots=slots[rank],
            write=(),
            block_size=BLOCK_SIZE,
        )
        attn = ZigzagAttention(part, comm, stores[rank], step)
        idx = torch.tensor(part.indices(rank))
        real = idx < r
        # Padded tokens get arbitrary values: they must not reach any real query.
        pad = torch.full((int((~real).sum()),), 1e3)

        def take(x: Tensor) -> Tensor:
            out = torch.empty((len(idx), *x.shape[1:]))
            out[real] = x[idx[real]]
            out[~real] = pad[:, None, None]
            return out

        return attn(layer, take(q), take(k), take(v))

    outs, comms = run_ranks(c, body)
    got = torch.empty(part.padded_len, hq, d)
    for rank in range(c):
        got[torch.tensor(part.indices(rank))] = outs[rank]
    prefix_kv = [(prefix_k[i], prefix_v[i]) for i in range(layers)]
    want = causal_attention(prefix_kv if p else None)(layer, q, k, v)
    torch.testing.assert_close(got[:r], want, rtol=0, atol=1e-5)
    assert [comm.calls for comm in comms] == [Counter({"kv": 1})] * c


def test_zigzag_attention_rejects_inconsistent_steps() -> None:
    store = make_stores(1)[0]
    comm: Communicator = SoloComm()
    # Degree 1 with 3 prefix blocks needs 3 slots, not 2.
    bad = RankPrefill(
        torch.zeros(4, dtype=torch.long),
        prefix_len=48,
        prefix_slots=(0, 1),
        write=(),
        block_size=BLOCK_SIZE,
    )
    with pytest.raises(ValueError, match="prefix slots"):
        ZigzagAttention(ZigzagPartition(4, 1), comm, store, bad)
    # A cached prefix without a store to read it from.
    no_store = RankPrefill(
        torch.zeros(4, dtype=torch.long),
        prefix_len=16,
        prefix_slots=(0,),
        write=(),
        block_size=BLOCK_SIZE,
    )
    with pytest.raises(ValueError, match="needs a store"):
        ZigzagAttention(ZigzagPartition(4, 1), comm, None, no_store)
