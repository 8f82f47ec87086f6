"""Trace files: format detection, Mooncake and Azure parsing, line-numbered errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from vertumnus.traces import MOONCAKE_BLOCK_TOKENS, TraceError, load_trace

SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"

MOONCAKE = """\
{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 1000, "input_length": 1536, "output_length": 7, "hash_ids": [0, 1, 3]}

{"timestamp": 4000, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]}
{"timestamp": 4500, "input_length": 600, "output_length": 1, "hash_ids": [9, 2]}
"""

AZURE = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.9799600,12,0"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_mooncake_is_detected_and_read(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "t.jsonl", MOONCAKE))
    assert trace.format == "mooncake"
    assert trace.block_tokens == MOONCAKE_BLOCK_TOKENS
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.0, 3.0, 3.5]
    assert [r.input_tokens for r in trace.requests] == [1100, 1536, 1024, 600]
    assert trace.requests[1].block_hashes == (0, 1, 3)
    assert trace.duration_s == 3.5
    # Request 2 reuses blocks 0, 1 (1024 tokens) but whole blocks must leave one token
    # to compute: only 1 block of its 1024 tokens can be cached. Request 4's first
    # block is new, so nothing after it counts.
    assert trace.cached_tokens_unbounded() == [0, 1024, 512, 0]


def test_azure_is_detected_and_read(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "t.csv", AZURE))
    assert trace.format == "azure"
    assert trace.block_tokens is None
    assert [r.input_tokens for r in trace.requests] == [4808, 3180, 12]
    assert [r.output_tokens for r in trace.requests] == [10, 8, 0]
    assert [r.arrival_s for r in trace.requests] == pytest.approx([0.0, 0.052, 2.0])
    assert all(r.block_hashes is None for r in trace.requests)
    assert trace.cached_tokens_unbounded() == [0, 0, 0]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "a.jsonl",
            '{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"time',
            r"a.jsonl:2: not a Mooncake record",
        ),
        (
            "b.jsonl",
            '{"timestamp": 0, "input_length": 600, "hash_ids": [1]}',
            r"b.jsonl:1: 1 hash_ids for 600 tokens, expected ceil\(600/512\) = 2",
        ),
        (
            "c.jsonl",
            '{"timestamp": 5, "input_length": 1}\n{"timestamp": 4, "input_length": 1}',
            r"c.jsonl:2: timestamps must be numbers in arrival order",
        ),
        (
            "d.jsonl",
            '{"timestamp": 0, "input_length": 0}',
            r"d.jsonl:1: input_length must be an integer >= 1",
        ),
        (
            "e.jsonl",
            '{"timestamp": 0, "input_length": 10, "hash_ids": ["x"]}',
            r"e.jsonl:1: hash_ids must be a list of integers",
        ),
        ("f.jsonl", '{"input_length": 10}', r"f.jsonl:1: not a Mooncake record \(.*timestamp"),
        (
            "g.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,10,1\nyesterday,5,1",
            r"g.csv:3: expected TIMESTAMP,ContextTokens,GeneratedTokens",
        ),
        (
            "h.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:17:03,10,1\n2023-11-16 18:17:02,10,1",
            r"h.csv:3: timestamps must be in arrival order",
        ),
        ("i.csv", "a,b,c\n1,2,3", r"i.csv: unknown trace format"),
        ("j.txt", "", r"j.txt: unknown trace format"),
    ],
)
def test_bad_traces_name_the_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path, name, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.jsonl"):
        load_trace(tmp_path / "nope.jsonl")


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="the shared traces are not here")
def test_the_shared_traces_match_their_readme() -> None:
    conv = load_trace(SHARED_TRACES / "conversation_trace.jsonl")
    assert len(conv.requests) == 12_031
    assert conv.duration_s == pytest.approx(3537, abs=1)
    cached = conv.cached_tokens_unbounded()
    total = sum(r.input_tokens for r in conv.requests)
    # README: 37.4% with the last partial block counted by its real size; whole
    # blocks with one token left to compute give a little less.
    assert 0.36 < sum(cached) / total < 0.375
    code = load_trace(SHARED_TRACES / "AzureLLMInferenceTrace_code.csv")
    assert len(code.requests) == 8_819
    assert max(r.input_tokens for r in code.requests) == 7_437
