"""``tools/bench/vs_vllm.py``'s trace stream: the turns of multi-turn conversations, in
trace order, so that a later turn's prompt starts with an earlier turn's."""

from __future__ import annotations

import json
from pathlib import Path

from support.tools import load_tool


def test_the_trace_stream_keeps_multi_turn_conversations_in_order(tmp_path: Path) -> None:
    vs_vllm = load_tool("bench/vs_vllm.py")
    records = [
        {"hash_ids": [0, 1, 2]},  # conversation A, turn 1
        {"hash_ids": [0, 5]},  # a single-turn conversation: left out
        {"hash_ids": [0, 7, 8]},  # conversation B, turn 1
        {"hash_ids": [0, 1, 2, 3, 4]},  # A, turn 2
        {"hash_ids": [0, 9]},  # single turn: left out
        {"hash_ids": [0, 7, 8, 10]},  # B, turn 2
        {"hash_ids": [0, 1, 2, 3, 4, 6]},  # A, turn 3
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = vs_vllm.trace_dataset(trace, 4, 3, tmp_path / "stream.jsonl")
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == 4  # A1, B1, A2, B2: the first four turns in trace order
    a1, b1, a2, b2 = prompts
    assert a2.startswith(a1 + " ") and b2.startswith(b1 + " ")
    assert a1.split()[:3] == b1.split()[:3]  # the shared first chunk (hash id 0)
    assert len(a1.split()) == 9 and len(a2.split()) == 15  # 3 words per hash id
    assert not a1.startswith(b1) and not b1.startswith(a1)
