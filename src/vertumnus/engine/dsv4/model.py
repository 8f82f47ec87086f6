"""DeepSeek-V4 as the engine runs it: the decoder (hyper-connected streams through
every layer's attention and experts), its two RoPEs, and one rank's share of a zigzag
prefill (``prefill_rank``).

The decoder knows nothing of parallelism: each layer hands its ``LayerInputs`` to the
attention it is given (``zigzag.DsV4Attention``: the window, the compressed entries,
the exchanges between ranks) and gets [T, H, D] back. At C = 1 nothing crosses, and
the same code is the single-process model the tests hold against transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from vertumnus.config import ModelConfig
from vertumnus.config.families.deepseek_v4 import DeepseekV4Spec
from vertumnus.engine.comm import Communicator
from vertumnus.engine.dsv4.blocks import BlockWriter, read_prefix
from vertumnus.engine.dsv4.layers import (
    Attention,
    HyperConnection,
    HyperHead,
    MoE,
    Norm,
    hc_merge,
)
from vertumnus.engine.dsv4.state import DsV4State, Head, LayerState, assemble
from vertumnus.engine.dsv4.zigzag import DsV4Attention
from vertumnus.engine.fused import EAGER
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.messages import PrefillCommand
from vertumnus.engine.partition import ZigzagPartition
from vertumnus.engine.rope import yarn


def spec_of(cfg: ModelConfig) -> DeepseekV4Spec:
    if cfg.dsv4 is None:
        raise ValueError(f"{cfg.architecture} is not DeepSeek-V4")
    return cfg.dsv4


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DeepseekV4Spec, layer: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, spec, layer)
        self.mlp = MoE(cfg, spec, layer)
        self.input_layernorm = Norm(cfg.hidden_size, eps)
        self.post_attention_layernorm = Norm(cfg.hidden_size, eps)
        self.attn_hc = HyperConnection(cfg.hidden_size, spec, eps)
        self.ffn_hc = HyperConnection(cfg.hidden_size, spec, eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DeepseekV4Spec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, spec, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, spec, cfg.rms_norm_eps)


class DeepseekV4LM(nn.Module):
    """``forward`` returns final-normed hidden states; ``logits`` projects chosen rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config, self.spec = cfg, spec_of(cfg)
        self.cpu_attention = "flash"  # unused: this model attends in its own kernels
        self.layer_fns = EAGER  # not compiled (``fused.py`` is the shared decoder's)
        self.model = Backbone(cfg, self.spec)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.model.layers))

    def freqs(self, kind: str) -> Tensor:
        """[rd/2] fp32 inverse frequencies of the ``main`` or ``compress`` RoPE."""
        spec, dim = self.spec, self.spec.rope_head_dim
        if kind == "main":
            theta = self.config.rope_theta
        elif spec.compress_rope_type == "yarn":
            return yarn(dim, spec.compress_rope_theta, spec.compress_param,
                        self.config.max_position_embeddings)[0]  # fmt: skip
        else:
            theta = spec.compress_rope_theta
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))

    def rope(self, kind: str, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, rd/2] in the model's dtype (V4's factor is 1 on both RoPEs)."""
        angles = positions.float()[:, None] * self.freqs(kind).to(positions.device)[None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attention: Callable[..., Tensor],
        counted: Tensor | None = None,
    ) -> Tensor:
        """``input_ids``, ``positions`` [T] -> hidden [T, hidden] after the final norm.
        ``attention(layer, inputs)`` -> [T, H, D] (``zigzag.DsV4Attention``)."""
        n = self.spec.hc_mult
        x = self.model.embed_tokens(input_ids)  # [T, H]
        streams = x[:, None, :].expand(-1, n, -1).contiguous()  # [T, n, H]
        ropes = {kind: self.rope(kind, positions) for kind in ("main", "compress")}
        for i, layer in enumerate(self.decoder_layers()):
            attn = layer.self_attn
            cos, sin = ropes["compress" if attn.ratio else "main"]
            post, comb, h = layer.attn_hc(streams)
            inputs = attn.inputs(layer.input_layernorm(h), cos, sin)
            out = attn.output(attention(i, inputs), cos, sin)
            streams = hc_merge(streams, out, post, comb)
            post, comb, h = layer.ffn_hc(streams)
            moe = layer.mlp(layer.post_attention_layernorm(h), input_ids, counted)
            streams = hc_merge(streams, moe, post, comb)
        hidden: Tensor = self.model.norm(self.model.hc_head(streams))
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] in fp32."""
        logits: Tensor = self.lm_head(hidden)
        return logits.float()

    def reset_expert_tokens(self) -> None:
        for layer in self.decoder_layers():
            layer.mlp.tokens_per_expert.zero_()

    def expert_tokens(self, reset: bool = True) -> dict[int, list[int]]:
        out = {}
        for i, layer in enumerate(self.decoder_layers()):
            out[i] = layer.mlp.tokens_per_expert.tolist()
            if reset:
                layer.mlp.tokens_per_expert.zero_()
        return out


def partition_of(model: DeepseekV4LM, num_tokens: int, cp_degree: int) -> ZigzagPartition:
    """The zigzag partition for this model: chunks of whole windows of every
    compressor and at least the sliding window."""
    align = max(model.spec.largest_ratio, model.config.sliding_window or 1)
    return ZigzagPartition(num_tokens, cp_degree, align)


def prefill_rank(
    model: DeepseekV4LM, comm: Communicator, token_ids: Tensor, logits: str = "last"
) -> Tensor | None:
    """``resume_rank`` from position 0: rank 0's logits, None elsewhere."""
    return resume_rank(model, comm, token_ids, logits)[0]


@torch.inference_mode()
def resume_rank(
    model: DeepseekV4LM,
    comm: Communicator,
    token_ids: Tensor,
    logits: str = "last",
    prefix: DsV4State | None = None,
    keep_state: bool = False,
    state_at: int | None = None,
    blocks: tuple[PagedKVStore, Sequence[tuple[int, int]]] | None = None,
) -> tuple[Tensor | None, DsV4State | None]:
    """One rank's part of a zigzag prefill of ``token_ids`` [R] after ``prefix`` (None:
    from position 0; under CP it must end on a chunk boundary, ``partition_of``).

    Returns, on rank 0, fp32 logits in sequence order ([1, V] for ``"last"``, [R, V]
    for ``"all"``), else None; and the prompt's state after these tokens
    (``state.py``) at C = 1, or under CP with ``keep_state`` (on every rank), else None;
    ``state_at`` = n: the state after the first n of these tokens instead (a hand-off's:
    the prompt but its last token). ``blocks`` = (store, writes): this rank stores its
    new full blocks ``writes`` ((depth, slot)) into ``store`` (``blocks.py``).
    Collectives per layer: one ``halo`` all-to-all, and one ``comp`` all-gather on a
    compressed layer; then one ``out`` all-gather (of the last token's row alone for
    ``"last"``), and with ``keep_state`` under CP one ``state`` all-gather of the rows
    around the prompt's end. Storing blocks adds none.
    """
    part = partition_of(model, int(token_ids.numel()), comm.size)
    dev = token_ids.device
    idx = torch.tensor(part.indices(comm.rank), dtype=torch.long, device=dev)
    real = idx < part.num_tokens
    ids = torch.where(real, token_ids[idx.clamp(max=part.num_tokens - 1)], 0)
    offset = 0 if prefix is None else prefix.length

    def entry_rope(positions: Tensor) -> tuple[Tensor, Tensor]:
        return model.rope("compress", positions)

    topk = model.spec.index_topk
    before: DsV4State | None = None  # the state asked for, when it precedes these tokens
    if state_at == 0:  # the prefix's, or nothing yet
        keep_state, state_at = False, None
        before = prefix if prefix is not None else empty_state(model)
    writer = None if blocks is None else BlockWriter(model, blocks[0], blocks[1], offset)
    attention = DsV4Attention(part, comm, entry_rope, topk, prefix, keep_state, state_at, writer)
    hidden = model(ids, idx + offset, attention, counted=real)  # [2s, H]
    state = None
    if before is not None:
        state = before
    elif comm.size == 1:
        state = DsV4State(offset + attention.state_at, attention.states)
    elif keep_state:
        state = _gathered_state(model, comm, attention, prefix)
    if logits == "last":  # one row crosses: the last token's, from the rank that has it
        last = hidden.new_zeros((1, hidden.shape[-1]))
        mine = (idx == part.num_tokens - 1).nonzero().flatten()
        if mine.numel():
            last[0] = hidden[mine[0]]
        rows = comm.all_gather(last, tag="out").sum(dim=0)  # zeros from the others
        return (model.logits(rows) if comm.rank == 0 else None), state
    gathered = comm.all_gather(hidden, tag="out")
    if comm.rank != 0:
        return None, state
    seq = gathered.reshape(-1, hidden.shape[-1])
    restore = torch.tensor(part.restore_index(), dtype=torch.long, device=dev)
    return model.logits(seq[restore[: part.num_tokens]]), state


def command_rank(
    model: DeepseekV4LM,
    comm: Communicator,
    store: PagedKVStore,
    cmd: PrefillCommand,
    token_ids: Tensor,
) -> tuple[Tensor | None, DsV4State | None]:
    """One rank's part of the pool's prefill ``cmd`` (``token_ids``: its suffix on the
    model's device): the cached prefix read from the worker's blocks, the new full
    blocks stored (``blocks.py``), and for a hand-off (``cmd.export`` = (0, n - 1))
    the state of the whole prompt but its last token on every rank.

    The blocks give the state at the end of the prefix's last block that keeps its
    raw rows (``read_prefix``); the prefix's tokens after it (``cmd.prefix_ids``) are
    computed again before the suffix, and their logits dropped."""
    prefix, ids, again = None, token_ids, 0
    if cmd.prefix_len:
        slots = cmd.prefix_slots[comm.rank]
        prefix = read_prefix(model, store, comm, slots, cmd.prefix_len)
        again = cmd.prefix_len - (0 if prefix is None else prefix.length)
        if again:
            assert cmd.prefix_ids is not None  # (``rank_state._check_dsv4``)
            lead = cmd.prefix_ids[cmd.prefix_len - again :].to(token_ids.device)
            ids = torch.cat((lead, token_ids))
    handoff = cmd.export is not None
    state_at = cmd.export[1] + again if cmd.export is not None else None
    writes = (store, cmd.write[comm.rank]) if cmd.write[comm.rank] else None
    logits, state = resume_rank(model, comm, ids, cmd.logits, prefix, handoff, state_at, writes)
    if again and logits is not None and cmd.logits == "all":
        logits = logits[again:]
    return logits, state


def _gathered_state(
    model: DeepseekV4LM, comm: Communicator, attention: DsV4Attention, prefix: DsV4State | None
) -> DsV4State:
    """The prompt's state under CP: every rank's rows around its end (one ``state``
    all-gather; each row computed by one rank, zeros from the others) and the entries
    every rank holds after the ``comp`` gathers."""
    flat = torch.cat([span.reshape(-1) for span in attention.spans])
    rows = comm.all_gather(flat, tag="state").sum(dim=0)
    end = attention.offset + attention.state_at
    n = end - attention.span_start
    at, layers = 0, []
    for i, layer in enumerate(model.decoder_layers()):
        span = attention.spans[i]
        whole = rows[at : at + span.numel()].view(span.shape)[:n]
        at += span.numel()
        attn = layer.self_attn
        if prefix is not None and attention.span_start == attention.offset:
            head = prefix.layers[i].head()
        else:
            head = Head(span.new_zeros((0, attn.head_dim)))
        entries, keys = attention.kept[i]
        seen = end // attn.ratio if attn.ratio else 0
        kept = (None if entries is None else entries[:seen], None if keys is None else keys[:seen])
        layers.append(assemble(head, whole, attention.widths[i], attn.ratio, attn.window, kept))
    return DsV4State(end, layers)


def empty_state(model: DeepseekV4LM) -> DsV4State:
    """The state of no token: what a one-token prompt hands off."""
    layers = []
    dtype, device = model.dtype, model.device
    for layer in model.decoder_layers():
        attn = layer.self_attn
        d = attn.head_dim
        entries = keys = None
        if attn.compressor is not None:
            entries = torch.zeros((0, d), dtype=dtype, device=device)
            if attn.compressor.indexer is not None:
                di = attn.compressor.indexer.kv_norm.weight.shape[0]
                keys = torch.zeros((0, di), dtype=dtype, device=device)
        raw = torch.zeros((0, d), dtype=dtype, device=device)
        layers.append(LayerState(raw, entries, keys))
    return DsV4State(0, layers)
