"""DeepSeek-V4's decode engine: the reference decode server's ``DecodeEngine`` for a
model whose prompt state is not K and V rows but a ``DsV4State`` (``engine/dsv4/
state.py``: the window's last raw rows, the compressed entries and indexer keys, the
compressors' open windows).

A sequence joins with the state of its prompt but the last token (the pool's prefill
computes it: ``resume_rank``, at C = 1 or gathered under CP) and that last token; each
step resumes every sequence by one token, one sequence after another (the state's
tensors differ in length per sequence, so the step is not batched across sequences),
and keeps its new state. Choosing, stopping and log-probabilities are the base
engine's. Not here: the hand-off of the state (not built yet), HTTP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vertumnus.decode.engine import DecodeEngine, _Sequence
from vertumnus.engine.comm import SoloComm
from vertumnus.engine.dsv4.model import DeepseekV4LM, resume_rank
from vertumnus.engine.dsv4.state import DsV4State


class DsV4DecodeEngine(DecodeEngine):
    """``add``'s ``prompt_kv`` is the prompt's ``DsV4State`` (its last token excluded)."""

    def __init__(self, model: DeepseekV4LM) -> None:
        super().__init__(model)  # type: ignore[arg-type]
        self.dsv4 = model
        self._states: dict[int, DsV4State] = {}

    def _prompt_tokens(self, prompt_kv: Any) -> int:
        if not isinstance(prompt_kv, DsV4State):
            raise ValueError(
                f"DeepSeek-V4 decodes from a DsV4State, got {type(prompt_kv).__name__}"
            )
        if len(prompt_kv.layers) != self.config.num_hidden_layers:
            raise ValueError(
                f"a state of {len(prompt_kv.layers)} layers for a model of "
                f"{self.config.num_hidden_layers}"
            )
        return prompt_kv.length

    def _new_cache(self, seq_id: int, prompt_kv: Any, n: int, limit: int) -> tuple[Tensor, Tensor]:
        self._states[seq_id] = prompt_kv  # never written in place: resuming makes a new one
        empty = torch.empty(0)
        return empty, empty

    def _left(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def _logits(self, seqs: list[_Sequence]) -> Tensor:
        rows = []
        device = self.dsv4.device
        for seq in seqs:
            ids = torch.tensor([seq.next_token], dtype=torch.long, device=device)
            logits, state = resume_rank(
                self.dsv4, SoloComm(), ids, "last", self._states[seq.seq_id]
            )
            assert logits is not None and state is not None
            self._states[seq.seq_id] = state
            rows.append(logits)
        return torch.cat(rows)
