"""DeepSeek-V4's attention arithmetic over given keys: the compressors' pooling, the
lightning indexer's choice, and one block of queries attending over its window and
the compressed entries with sinks. Pure functions of tensors; which rows a rank holds
and what it exchanges is ``zigzag.py``'s.

Model (transformers' ``DeepseekV4Attention`` and its compressors; positions absolute):

- a window ``w`` of ``ratio`` tokens pools into entry ``w``: per channel, a softmax over
  the window's gate rows (plus a learned bias per row) weights its KV rows. CSA
  (ratio 4) pools 8 rows: the previous window's first half of the channels (``Ca``)
  and this window's second half (``Cb``); window 0 has no previous one (weight 0).
  Then RMSNorm and RoPE at position ``w * ratio`` (the compress RoPE);
- query ``t`` sees raw keys ``t - window < j <= t`` and entries ``e < (t + 1) // ratio``
  (windows wholly at or before it): all of them (HCA), or the ``index_topk`` the
  indexer scores highest, ``sum_h w[t, h] * relu(q_I[t, h] . k_I[e]) / sqrt(Di)``
  (CSA; an exact tie at the boundary goes to the earlier entry, where transformers'
  ``topk`` decides by its algorithm: ``_top``);
- one softmax over [raw scores, entry scores, the head's sink], keys = values.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pool(
    kv: Tensor,
    gate: Tensor,
    bias: Tensor,
    overlap: bool,
    prior: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Pooled entries [n, Dc] (before norm and RoPE) of ``n`` whole windows.

    ``kv``, ``gate``: [n * ratio, W] projections (W = 2 Dc with ``overlap``, else Dc);
    ``bias``: [ratio, W]. ``prior``: the previous window's ``Ca`` rows, (kv, gate with
    its bias) [ratio, Dc] each, for the first window (None: none, weight 0).
    """
    ratio = bias.shape[0]
    n = kv.shape[0] // ratio
    kv = kv.view(n, ratio, -1)
    gate = gate.view(n, ratio, -1) + bias
    if not overlap:
        return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    d = kv.shape[-1] // 2
    slots_kv = kv.new_zeros((n, 2 * ratio, d))
    slots_gate = gate.new_full((n, 2 * ratio, d), float("-inf"))
    slots_kv[:, ratio:] = kv[..., d:]
    slots_gate[:, ratio:] = gate[..., d:]
    if n > 1:
        slots_kv[1:, :ratio] = kv[:-1, :, :d]
        slots_gate[1:, :ratio] = gate[:-1, :, :d]
    if prior is not None:
        slots_kv[0, :ratio] = prior[0].to(kv.dtype)
        slots_gate[0, :ratio] = prior[1].to(gate.dtype)
    weights = slots_gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return (slots_kv * weights).sum(dim=1)


def index_choice(
    q: Tensor,
    weights: Tensor,
    keys: Tensor,
    positions: Tensor,
    ratio: int,
    topk: int,
) -> Tensor:
    """The entries each query reads, [b, E] bool: the top ``topk`` of the indexer's
    scores among the entries it sees (``q`` [b, Hi, Di] after RoPE, ``weights`` [b, Hi]
    fp32 scaled, ``keys`` [E, Di] every entry of the prompt, ``positions`` [b])."""
    e = keys.shape[0]
    scores = torch.matmul(q.float(), keys.float().t())  # [b, Hi, E]
    scores = torch.relu(scores) * q.shape[-1] ** -0.5
    scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [b, E]
    seen = (positions + 1) // ratio  # [b]: entries before it
    future = torch.arange(e, device=q.device)[None, :] >= seen[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    if e == 0:
        return future
    top = _top(scores, min(topk, e))  # [b, k]
    # Chosen entries past what the query sees (too few before it) are not read: they
    # land in a spare column, dropped.
    top = torch.where(top < seen[:, None], top, e)
    chosen = torch.zeros((q.shape[0], e + 1), dtype=torch.bool, device=q.device)
    chosen.scatter_(1, top, True)
    return chosen[:, :e]


def _top(scores: Tensor, k: int) -> Tensor:
    """The indices of each row's ``k`` highest scores, ties at the boundary going to
    the earlier entries: a row's choice does not depend on how many future entries
    (-inf) follow it, so a prompt resumed from its prefix chooses as it would whole.
    (``topk`` alone leaves ties to its algorithm; the indexer's ReLU makes exact ties,
    at 0, common when few heads score.) Rows with such a tie are sorted stably."""
    values, top = scores.topk(k, dim=-1)
    kth = values[:, -1:]
    tied = ((scores == kth).sum(-1) > (values == kth).sum(-1)) & torch.isfinite(kth[:, 0])
    if tied.any():
        rows = tied.nonzero().flatten()
        order = torch.sort(scores[rows], dim=-1, descending=True, stable=True).indices
        top[rows] = order[:, :k]
    return top


def attend(
    q: Tensor,
    raw: Tensor,
    raw_seen: Tensor,
    entries: Tensor | None,
    entries_seen: Tensor | None,
    sinks: Tensor,
) -> Tensor:
    """One block of queries ``q`` [b, H, D] over raw keys ``raw`` [n, D] where
    ``raw_seen`` [b, n] and over ``entries`` [E, D] where ``entries_seen`` [b, E], with a
    sink logit per head: [b, H, D]. Keys are values; scores scaled by 1/sqrt(D)."""
    scaling = q.shape[-1] ** -0.5
    qh = q.transpose(0, 1)  # [H, b, D]
    logits = [torch.matmul(qh, raw.t()) * scaling]  # [H, b, n]
    masks = [raw_seen]
    if entries is not None and entries_seen is not None and entries.shape[0]:
        logits.append(torch.matmul(qh, entries.t()) * scaling)
        masks.append(entries_seen)
    mask = torch.cat(masks, dim=-1)  # [b, n + E]
    scores = torch.cat(logits, dim=-1).masked_fill(~mask[None], float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    combined = torch.cat((scores, sink), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(raw.dtype)
    values = raw if len(logits) == 1 else torch.cat((raw, entries), dim=0)  # type: ignore[arg-type]
    return torch.matmul(probs, values).transpose(0, 1)  # [b, H, D]
