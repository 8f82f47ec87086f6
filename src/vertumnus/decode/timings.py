"""The decode server's share of a request's times, as its answer's ``timings``::

    handoff_s       the longest of the request's pulls (they run at once)
    handoff_bytes   the bytes of all its pulls' streams
    prefill_s       the prefills this server asked for, at once (None: the request
                    brought ``kv_transfer_params``)
    first_step_s    from handing the sequences to the decode thread to the first
                    token of any (queueing for a step under way included; 0 when
                    nothing was decoded: an echo only)
    decode_s        from that first token to the last token of any sequence
    decoded_tokens  the tokens decoded, every sequence's (a stream's count of its
                    generated tokens, which its events need not show one by one)
    tpot_s          per sequence of two tokens or more, (its last token's time - its
                    first's) / (its tokens - 1), averaged over those (None: none)

Times are ``time.perf_counter`` seconds as the decode thread chose each token. Not
here: the pool's share, which the proxy adds (``server/answers.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timings:
    handoff_s: float
    handoff_bytes: int
    prefill_s: float | None
    submitted: float | None = None
    # per sequence (its choice's index): the time of its first and last token, tokens
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)

    def start(self) -> None:
        self.submitted = time.perf_counter()

    def token(self, index: int, at: float) -> None:
        self.first.setdefault(index, at)
        self.last[index] = at
        self.tokens[index] = self.tokens.get(index, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        first_step_s = decode_s = 0.0
        if self.first and self.submitted is not None:
            first = min(self.first.values())
            first_step_s, decode_s = first - self.submitted, max(self.last.values()) - first
        per_token = [
            (self.last[i] - self.first[i]) / (n - 1) for i, n in self.tokens.items() if n > 1
        ]
        return {
            "handoff_s": self.handoff_s,
            "handoff_bytes": self.handoff_bytes,
            "prefill_s": self.prefill_s,
            "first_step_s": first_step_s,
            "decode_s": decode_s,
            "tpot_s": sum(per_token) / len(per_token) if per_token else None,
            "decoded_tokens": sum(self.tokens.values()),
        }
